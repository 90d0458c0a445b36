//! The one checkpoint layout of every launch path, under `trainer.default_local_dir`:
//! ```text
//! global_step_N/model_world_size_W_rank_R.safetensors   rank R's fp32 master shards (ferl-fsdp's format)
//! global_step_N/optim_world_size_W_rank_R.safetensors   rank R's AdamW moment shards
//! global_step_N/fsdp_meta.json      the sharded layout and model config; loads at any world size and strategy
//! global_step_N/huggingface/        the model as a Hugging Face folder, when `save_contents` has `hf_model`
//! global_step_N/meta.json           written last: global step, data position, world size
//! latest_checkpointed_iteration.txt N of the newest complete checkpoint (verl's file name)
//! ```
//! A one-process run is world size 1 of the same layout, so any path resumes any other path's checkpoint.
//!
//! Invariants (tests name them):
//! 1. `meta.json` and `latest_checkpointed_iteration.txt` are written atomically (temporary file, then rename), in
//!    that order, after every other file of the checkpoint exists: a crash never leaves the latest pointer at a
//!    partial checkpoint.
//! 2. Pruning keeps the newest `trainer.max_ckpt_to_keep` complete checkpoints and never deletes the latest.
//! 3. A checkpoint of ferl's earlier single-process layout (`trainer_state.json` + `huggingface/`) is refused with
//!    an error that says how to continue from it.

use crate::model::weights;
use anyhow::{bail, Context, Result};
use ferl_config::{expand_path, ResumeMode, SftConfig};
use ferl_data::DataPosition;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tch::Kind;

/// verl's name for the file holding the newest checkpoint's step.
pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";
/// Metadata file inside `global_step_N/`, written last.
pub const META_FILE: &str = "meta.json";
/// The Hugging Face folder inside `global_step_N/` (`save_contents` with `hf_model`).
pub const HF_DIR: &str = "huggingface";

/// What `meta.json` holds.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RunMeta {
    /// Optimizer steps completed.
    pub global_step: u64,
    /// Epoch of the next batch.
    pub epoch: u64,
    /// Step within that epoch of the next batch.
    pub step_in_epoch: u64,
    /// Ranks that wrote it.
    pub world_size: u64,
}

impl RunMeta {
    /// The data position to resume from.
    pub fn position(&self) -> DataPosition {
        DataPosition {
            epoch: self.epoch,
            step_in_epoch: self.step_in_epoch,
        }
    }
}

/// `root/global_step_{step}`.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("global_step_{step}"))
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Marks `global_step_N` complete: writes its `meta.json`, then the latest pointer, then prunes (keeping `keep`).
pub fn commit(root: &Path, meta: &RunMeta, keep: Option<usize>) -> Result<()> {
    let dir = step_dir(root, meta.global_step);
    write_atomic(&dir.join(META_FILE), &serde_json::to_vec_pretty(meta)?)?;
    write_atomic(
        &root.join(LATEST_FILE),
        meta.global_step.to_string().as_bytes(),
    )?;
    if let Some(keep) = keep {
        prune(root, keep.max(1))?;
    }
    Ok(())
}

/// Steps of the complete checkpoints (with `meta.json`) under `root`, ascending.
pub fn complete_steps(root: &Path) -> Result<Vec<u64>> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(Vec::new());
    };
    let mut steps = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("listing {}", root.display()))?;
        let step = entry
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("global_step_"))
            .and_then(|n| n.parse().ok());
        if let Some(step) = step {
            if entry.path().join(META_FILE).exists() {
                steps.push(step);
            }
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// Deletes all but the newest `keep` complete checkpoints.
pub fn prune(root: &Path, keep: usize) -> Result<()> {
    let steps = complete_steps(root)?;
    for &step in steps.iter().take(steps.len().saturating_sub(keep)) {
        let dir = step_dir(root, step);
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("pruning old checkpoint {}", dir.display()))?;
    }
    Ok(())
}

/// Reads `dir/meta.json`; a checkpoint of the earlier single-process layout is refused saying what to do.
pub fn read_meta(dir: &Path) -> Result<RunMeta> {
    refuse_legacy(dir)?;
    let file = dir.join(META_FILE);
    let bytes = std::fs::read(&file)
        .with_context(|| format!("reading {} (is it a complete checkpoint?)", file.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", file.display()))
}

/// Invariant 3: the earlier single-process layout cannot resume; its model can start a new run.
fn refuse_legacy(dir: &Path) -> Result<()> {
    if dir.join("trainer_state.json").is_file() && !dir.join(META_FILE).is_file() {
        bail!(
            "{} is a checkpoint of ferl's earlier single-process layout (trainer_state.json), which cannot resume \
             (its optimizer state is not in the sharded format); continue from its weights with \
             model.partial_pretrain={}",
            dir.display(),
            dir.join(HF_DIR).display()
        );
    }
    Ok(())
}

/// The checkpoint named by `latest_checkpointed_iteration.txt` under `root`, if any.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    let file = root.join(LATEST_FILE);
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(None);
    };
    let step: u64 = text
        .trim()
        .parse()
        .with_context(|| format!("{}: `{}` is not a step number", file.display(), text.trim()))?;
    let dir = step_dir(root, step);
    if !dir.is_dir() {
        bail!(
            "{} names {}, which does not exist",
            file.display(),
            dir.display()
        );
    }
    Ok(Some(dir))
}

/// The checkpoint a run starts from, per `trainer.resume_mode` (and `resume_from_path`).
pub fn resume_dir(cfg: &SftConfig) -> Result<Option<PathBuf>> {
    let root = expand_path(&cfg.trainer.default_local_dir);
    let dir = match cfg.trainer.resume_mode {
        ResumeMode::Disable => return Ok(None),
        ResumeMode::Auto => latest(&root)?,
        ResumeMode::ResumePath => {
            let p = cfg
                .trainer
                .resume_from_path
                .as_deref()
                .context("trainer.resume_mode=resume_path needs trainer.resume_from_path")?;
            Some(expand_path(p))
        }
    };
    if let Some(d) = &dir {
        read_meta(d).with_context(|| format!("resuming from {}", d.display()))?;
    }
    Ok(dir)
}

/// Waits until every path in `files` exists, polling, for at most `timeout`; the error names the missing files.
pub fn wait_for_files(files: &[String], timeout: std::time::Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let missing: Vec<&String> = files.iter().filter(|f| !Path::new(f).exists()).collect();
        if missing.is_empty() {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bail!("checkpoint files still missing after {timeout:?}: {missing:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The weight dtype of an export named on the command line: `fp32`/`float32` or `bf16`/`bfloat16`.
pub fn export_kind(dtype: &str) -> Result<Kind> {
    match dtype {
        "fp32" | "float32" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        other => bail!("export dtype `{other}`: expected fp32 or bf16"),
    }
}

/// `ferl export` of a Hugging Face folder (or a checkpoint's `huggingface/` folder): rewrites it to `out` with
/// weights in `dtype` (`fp32` or `bf16`).
pub fn export(dir: &Path, out: &Path, dtype: &str) -> Result<()> {
    let kind = export_kind(dtype)?;
    let src = if dir.join(HF_DIR).is_dir() {
        dir.join(HF_DIR)
    } else {
        dir.to_path_buf()
    };
    let model = crate::model::load_model(&src)
        .with_context(|| format!("exporting checkpoint {}", dir.display()))?;
    weights::save_hf_folder(
        out,
        &model.config,
        &model.layout,
        &model.params,
        kind,
        &[&src],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(step: u64) -> RunMeta {
        RunMeta {
            global_step: step,
            epoch: 0,
            step_in_epoch: step,
            world_size: 2,
        }
    }

    #[test]
    fn invariants_1_2_commit_points_latest_and_prunes() {
        let root = tempfile::tempdir().unwrap();
        for step in [2u64, 4, 6] {
            std::fs::create_dir_all(step_dir(root.path(), step)).unwrap();
            commit(root.path(), &meta(step), Some(2)).unwrap();
        }
        // An incomplete folder (no meta.json) is never counted nor pointed at.
        std::fs::create_dir_all(step_dir(root.path(), 8)).unwrap();
        assert_eq!(complete_steps(root.path()).unwrap(), vec![4, 6]);
        let latest = latest(root.path()).unwrap().unwrap();
        assert_eq!(latest, step_dir(root.path(), 6));
        let position = read_meta(&latest).unwrap().position();
        assert_eq!(
            position,
            DataPosition {
                epoch: 0,
                step_in_epoch: 6
            }
        );
        assert!(!step_dir(root.path(), 2).exists());
        write_atomic(&root.path().join(LATEST_FILE), b"7").unwrap();
        let err = super::latest(root.path()).unwrap_err().to_string();
        assert!(err.contains("global_step_7"), "{err}");
    }

    #[test]
    fn invariant_3_legacy_layout_is_refused_with_what_to_do() {
        let root = tempfile::tempdir().unwrap();
        let dir = step_dir(root.path(), 3);
        std::fs::create_dir_all(dir.join(HF_DIR)).unwrap();
        std::fs::write(dir.join("trainer_state.json"), "{}").unwrap();
        let err = format!("{:#}", read_meta(&dir).unwrap_err());
        assert!(err.contains("earlier single-process layout"), "{err}");
        assert!(err.contains("model.partial_pretrain="), "{err}");
    }
}
