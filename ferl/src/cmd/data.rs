//! `ferl data ...` (owned by the trainer's data work).

use clap::Subcommand;

/// `ferl data` subcommands.
#[derive(Subcommand)]
pub enum DataCommand {}

pub fn run(c: DataCommand) -> anyhow::Result<()> {
    match c {}
}
