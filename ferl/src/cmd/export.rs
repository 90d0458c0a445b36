//! `ferl export`: a checkpoint's model as a Hugging Face folder, from a single-process checkpoint or from a sharded
//! one (`fsdp_meta.json` beside per-rank shards, as `ferl sft --nproc-per-node` writes) at any world size.

use anyhow::{bail, Context, Result};
use clap::Args;
use ferl_fsdp::checkpoint::LoraExport;
use ferl_trainer::checkpoint::HF_DIR;
use ferl_trainer::model::lora::CHECKPOINT_ADAPTER_DIR;
use std::path::{Path, PathBuf};

/// Arguments of `ferl export`.
#[derive(Args)]
pub(crate) struct ExportArgs {
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
    /// (typically the `model.partial_pretrain` folder the run started from). Without it they come from the
    /// checkpoint's `huggingface/` folder, where every save keeps them.
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

/// Writes the export. A refused or failed export leaves no `--out` folder behind (unless it existed before).
pub(crate) fn run(a: ExportArgs) -> Result<()> {
    let existed = a.out.exists();
    let result = export(&a);
    if result.is_err() && !existed {
        let _ = std::fs::remove_dir_all(&a.out);
    }
    result?;
    println!("exported {} to {}", a.checkpoint.display(), a.out.display());
    Ok(())
}

/// Checks the inputs, then exports a sharded checkpoint or a Hugging Face folder.
fn export(a: &ExportArgs) -> Result<()> {
    if let Some(dir) = a.copy_from.as_deref().filter(|d| !d.is_dir()) {
        bail!("--copy-from {}: no such folder", dir.display());
    }
    let lora = match a.adapter_only {
        true => LoraExport::AdapterOnly,
        false => LoraExport::Merge,
    };
    if a.checkpoint.join("fsdp_meta.json").is_file() {
        let kind = ferl_trainer::checkpoint::export_kind(&a.dtype)?;
        // Every file the checkpoint's meta.json records must verify: a corrupted shard is not exported.
        ferl_trainer::checkpoint::verify(&a.checkpoint)
            .with_context(|| format!("--checkpoint {}", a.checkpoint.display()))?;
        // The tokenizer comes from --copy-from, else from the checkpoint's own huggingface/ folder.
        let kept = a.checkpoint.join(HF_DIR);
        let side: Vec<&Path> = a
            .copy_from
            .iter()
            .map(PathBuf::as_path)
            .chain([kept.as_path()])
            .collect();
        if !side.iter().any(|d| d.join("tokenizer.json").is_file()) {
            eprintln!(
                "warning: {} keeps no tokenizer (checkpoints before this build did not); the export has none. \
                 Add --copy-from MODEL_DIR (the model.partial_pretrain folder) to copy it",
                a.checkpoint.display()
            );
        }
        let adapter = a.checkpoint.join(CHECKPOINT_ADAPTER_DIR);
        if a.merge_lora && !adapter.is_dir() {
            bail!(
                "--merge-lora: {} is not a LoRA checkpoint (no {} folder)",
                a.checkpoint.display(),
                adapter.display()
            );
        }
        ferl_fsdp::checkpoint::export_sharded(&a.checkpoint, &a.out, kind, &side, lora)
    } else if a.merge_lora || a.adapter_only {
        bail!(
            "--merge-lora/--adapter-only: {} is not a sharded ferl checkpoint (no fsdp_meta.json)",
            a.checkpoint.display()
        );
    } else if !is_hf_folder(&a.checkpoint) {
        bail!(
            "--checkpoint {}: not a ferl checkpoint (no fsdp_meta.json) nor a Hugging Face folder (no config.json, \
             nor a huggingface/ folder with one)",
            a.checkpoint.display()
        );
    } else {
        ferl_trainer::checkpoint::export(&a.checkpoint, &a.out, &a.dtype)
    }
}

/// Whether `dir` (or its `huggingface/` folder) holds a Hugging Face `config.json`.
fn is_hf_folder(dir: &Path) -> bool {
    dir.join("config.json").is_file() || dir.join("huggingface/config.json").is_file()
}
