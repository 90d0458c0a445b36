//! `ferl export` (owned by the trainer's checkpoint work).

use clap::Args;

/// Arguments of `ferl export`.
#[derive(Args)]
pub struct ExportArgs {}

pub fn run(_: ExportArgs) -> anyhow::Result<()> {
    anyhow::bail!("`ferl export` is being built (issue 3)")
}
