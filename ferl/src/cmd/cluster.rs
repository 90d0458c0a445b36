//! `ferl start`, `ferl status`, `ferl stop` (owned by the runtime work).

use clap::Args;

/// Arguments of `ferl start`.
#[derive(Args)]
pub struct StartArgs {}
/// Arguments of `ferl status`.
#[derive(Args)]
pub struct StatusArgs {}
/// Arguments of `ferl stop`.
#[derive(Args)]
pub struct StopArgs {}

pub fn start(_: StartArgs) -> anyhow::Result<()> {
    anyhow::bail!("`ferl start` is being built (issue 2)")
}
pub fn status(_: StatusArgs) -> anyhow::Result<()> {
    anyhow::bail!("`ferl status` is being built (issue 2)")
}
pub fn stop(_: StopArgs) -> anyhow::Result<()> {
    anyhow::bail!("`ferl stop` is being built (issue 2)")
}
