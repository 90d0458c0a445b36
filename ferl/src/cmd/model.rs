//! `ferl model ...`: model utilities.

use anyhow::Result;
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// `ferl model` subcommands.
#[derive(Subcommand)]
pub(crate) enum ModelCommand {
    /// Write a randomly initialised model (transformers' initialisation, seeded) as a Hugging Face folder.
    Init(InitArgs),
}

/// Arguments of `ferl model init`.
#[derive(Args)]
pub(crate) struct InitArgs {
    /// A Hugging Face `config.json` (Qwen2 or Llama).
    #[arg(long)]
    pub config: PathBuf,
    /// A folder with `tokenizer.json` (and `tokenizer_config.json`) copied into the model.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Output folder.
    #[arg(long)]
    pub out: PathBuf,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
}

/// Runs a `ferl model` subcommand.
pub(crate) fn run(c: ModelCommand) -> Result<()> {
    match c {
        ModelCommand::Init(a) => {
            ferl_trainer::model::init_model(&a.config, a.tokenizer.as_deref(), &a.out, a.seed)?;
            println!("wrote a random-init model to {}", a.out.display());
            Ok(())
        }
    }
}
