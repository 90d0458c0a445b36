//! `ferl export`: a checkpoint's model as a Hugging Face folder, from a single-process checkpoint or from a sharded
//! one (`fsdp_meta.json` beside per-rank shards, as `ferl sft --nproc-per-node` writes) at any world size.

use anyhow::{bail, Result};
use clap::Args;
use ferl_fsdp::checkpoint::LoraExport;
use ferl_trainer::model::lora::CHECKPOINT_ADAPTER_DIR;
use std::path::{Path, PathBuf};

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
    /// For a sharded checkpoint: a folder whose tokenizer and generation-config files are copied into the export
    /// (typically the `model.partial_pretrain` folder the run started from).
    #[arg(long, value_name = "DIR")]
    pub copy_from: Option<PathBuf>,
    /// For a LoRA checkpoint: write the merged model `W + (α/r)·B·A` (the default).
    #[arg(long, conflicts_with = "adapter_only")]
    pub merge_lora: bool,
    /// For a LoRA checkpoint: write only the adapter, in PEFT's format (`adapter_config.json`,
    /// `adapter_model.safetensors`), loadable by `peft.PeftModel.from_pretrained`.
    #[arg(long)]
    pub adapter_only: bool,
}

/// Writes the export.
pub fn run(a: ExportArgs) -> Result<()> {
    let lora = match a.adapter_only {
        true => LoraExport::AdapterOnly,
        false => LoraExport::Merge,
    };
    if a.checkpoint.join("fsdp_meta.json").is_file() {
        let kind = ferl_trainer::checkpoint::export_kind(&a.dtype)?;
        let side: Vec<&Path> = a.copy_from.iter().map(PathBuf::as_path).collect();
        let adapter = a.checkpoint.join(CHECKPOINT_ADAPTER_DIR);
        if a.merge_lora && !adapter.is_dir() {
            bail!(
                "--merge-lora: {} is not a LoRA checkpoint (no {} folder)",
                a.checkpoint.display(),
                adapter.display()
            );
        }
        ferl_fsdp::checkpoint::export_sharded(&a.checkpoint, &a.out, kind, &side, lora)?;
    } else if a.merge_lora || a.adapter_only {
        bail!(
            "--merge-lora/--adapter-only: {} is not a sharded ferl checkpoint (no fsdp_meta.json)",
            a.checkpoint.display()
        );
    } else {
        ferl_trainer::checkpoint::export(&a.checkpoint, &a.out, &a.dtype)?;
    }
    println!("exported {} to {}", a.checkpoint.display(), a.out.display());
    Ok(())
}
