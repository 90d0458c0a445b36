//! `ferl export`: a checkpoint's model as a Hugging Face folder.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

/// Arguments of `ferl export`.
#[derive(Args)]
pub struct ExportArgs {
    /// A `global_step_N` checkpoint folder (or a Hugging Face folder).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Output folder.
    #[arg(long)]
    pub out: PathBuf,
    /// Weight dtype of the export: fp32 or bf16.
    #[arg(long, default_value = "fp32")]
    pub dtype: String,
}

/// Writes the export.
pub fn run(a: ExportArgs) -> Result<()> {
    ferl_trainer::checkpoint::export(&a.checkpoint, &a.out, &a.dtype)?;
    println!("exported {} to {}", a.checkpoint.display(), a.out.display());
    Ok(())
}
