//! `ferl plugin ...` (owned by the plugins work).

use clap::Subcommand;

/// `ferl plugin` subcommands.
#[derive(Subcommand)]
pub enum PluginCommand {}

pub fn run(c: PluginCommand) -> anyhow::Result<()> {
    match c {}
}
