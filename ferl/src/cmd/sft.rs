//! `ferl sft` (owned by the trainer work; `--nproc-per-node` by the distributed work).

use clap::Args;

/// Arguments of `ferl sft`.
#[derive(Args)]
pub struct SftArgs {}

pub fn run(_: SftArgs) -> anyhow::Result<()> {
    anyhow::bail!("`ferl sft` is being built (issue 3)")
}
