//! `ferl model ...` (owned by the trainer's model work).

use clap::Subcommand;

/// `ferl model` subcommands.
#[derive(Subcommand)]
pub enum ModelCommand {}

pub fn run(c: ModelCommand) -> anyhow::Result<()> {
    match c {}
}
