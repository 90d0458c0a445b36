//! `ferl data ...`: dataset preparation (owned by the trainer's data work; the logic lives in `ferl-data`).

use std::path::PathBuf;

use clap::{Args, Subcommand};

/// `ferl data` subcommands.
#[derive(Subcommand)]
pub(crate) enum DataCommand {
    /// GSM8K jsonl (or HF parquet) into verl's train.parquet/test.parquet, plus flat question/answer columns.
    Gsm8k(Gsm8kArgs),
}

/// Arguments of `ferl data gsm8k`.
#[derive(Args)]
pub(crate) struct Gsm8kArgs {
    /// Folder holding train.jsonl and test.jsonl (or train.parquet/test.parquet, or HF's main/*.parquet).
    #[arg(long)]
    pub input_dir: PathBuf,
    /// Folder to write train.parquet and test.parquet into (created if missing; `~/` is expanded).
    #[arg(long, alias = "local-save-dir", default_value = "~/data/gsm8k")]
    pub local_dir: String,
}

/// Runs a `ferl data` subcommand.
pub(crate) fn run(c: DataCommand) -> anyhow::Result<()> {
    match c {
        DataCommand::Gsm8k(a) => {
            let out = ferl_data::expand_path(&a.local_dir);
            let existed = out.exists();
            let s = ferl_data::gsm8k::prepare_gsm8k(&a.input_dir, &out).inspect_err(|_| {
                // A refused input leaves no output folder behind (unless it existed before).
                if !existed {
                    let _ = std::fs::remove_dir_all(&out);
                }
            })?;
            println!(
                "wrote {} ({} rows) and {} ({} rows)",
                out.join("train.parquet").display(),
                s.train_rows,
                out.join("test.parquet").display(),
                s.test_rows
            );
            Ok(())
        }
    }
}
