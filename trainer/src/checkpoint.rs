//! Checkpoints: `<default_local_dir>/global_step_N/` holding
//! - `huggingface/`: the fp32 master weights as a Hugging Face folder (config.json, model.safetensors, tokenizer and
//!   generation files) that transformers loads as-is — this is also the model state a resume reads;
//! - `optimizer.safetensors`: AdamW moments (`exp_avg.<name>`, `exp_avg_sq.<name>`);
//! - `trainer_state.json`: step, scheduler position, optimizer step count, data position (epoch, step in epoch),
//!   seed.
//!
//! Invariants: a checkpoint folder appears only complete (written under a temporary name, then renamed);
//! `latest_checkpointed_iteration.txt` is replaced atomically (temporary file + rename) after the folder exists;
//! pruning keeps the newest `max_ckpt_to_keep` folders of the directory, whichever run wrote them.

use crate::model::config::ModelConfig;
use crate::model::layout::ModelLayout;
use crate::model::weights;
use crate::optim::AdamW;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// The tracker file naming the newest complete checkpoint (verl's name).
pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";

/// Everything besides tensors that a resume needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed (the schedule position).
    pub global_step: i64,
    /// AdamW's step counter (bias correction).
    pub optimizer_step: i64,
    /// Epoch of the next batch to train.
    pub epoch: u64,
    /// Index of the next batch inside that epoch.
    pub step_in_epoch: usize,
    /// `trainer.seed` of the run (the data order derives from it and the epoch).
    pub seed: u64,
    /// Total steps the run was planned for.
    pub total_steps: i64,
}

/// The folder of step `step` under `root`.
pub fn step_dir(root: &Path, step: i64) -> PathBuf {
    root.join(format!("global_step_{step}"))
}

fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// What [`save`] writes.
pub struct CheckpointContents<'a> {
    /// Model config (for config.json).
    pub config: &'a ModelConfig,
    /// Tensor names.
    pub layout: &'a ModelLayout,
    /// fp32 masters in layout order.
    pub params: &'a [Tensor],
    /// Optimizer state.
    pub optimizer: &'a AdamW,
    /// Scalars.
    pub state: &'a TrainerState,
    /// Folders whose tokenizer/generation files are copied into `huggingface/`.
    pub side_files_from: &'a [&'a Path],
}

/// Writes `root/global_step_N/` for `c.state.global_step`, updates the tracker, prunes to `keep` folders.
pub fn save(root: &Path, c: &CheckpointContents<'_>, keep: Option<usize>) -> Result<PathBuf> {
    std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
    let step = c.state.global_step;
    let dir = step_dir(root, step);
    let tmp = root.join(format!(".global_step_{step}.partial"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    std::fs::create_dir_all(&tmp)?;
    weights::save_hf_folder(
        &tmp.join("huggingface"),
        c.config,
        c.layout,
        c.params,
        Kind::Float,
        c.side_files_from,
    )?;
    let mut moments = Vec::with_capacity(2 * c.params.len());
    for (((name, _), m), v) in c
        .layout
        .tensors
        .iter()
        .zip(&c.optimizer.exp_avg)
        .zip(&c.optimizer.exp_avg_sq)
    {
        moments.push((format!("exp_avg.{name}"), m.shallow_clone()));
        moments.push((format!("exp_avg_sq.{name}"), v.shallow_clone()));
    }
    weights::write_safetensors(&tmp.join("optimizer.safetensors"), &moments)?;
    std::fs::write(
        tmp.join("trainer_state.json"),
        serde_json::to_string_pretty(c.state)?,
    )?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("replacing {}", dir.display()))?;
    }
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
    write_atomically(&root.join(LATEST_FILE), &step.to_string())?;
    if let Some(keep) = keep {
        prune(root, keep)?;
    }
    Ok(dir)
}

/// Steps of the complete checkpoint folders under `root`, ascending.
pub fn list_steps(root: &Path) -> Result<Vec<i64>> {
    let mut steps = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(steps);
    };
    for e in entries {
        let name = e?.file_name().to_string_lossy().to_string();
        if let Some(n) = name
            .strip_prefix("global_step_")
            .and_then(|s| s.parse::<i64>().ok())
        {
            steps.push(n);
        }
    }
    steps.sort_unstable();
    Ok(steps)
}

/// Deletes all but the newest `keep` checkpoint folders under `root` (0 keeps everything).
pub fn prune(root: &Path, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let steps = list_steps(root)?;
    for s in steps.iter().take(steps.len().saturating_sub(keep)) {
        let d = step_dir(root, *s);
        std::fs::remove_dir_all(&d).with_context(|| format!("pruning {}", d.display()))?;
    }
    Ok(())
}

/// The checkpoint the tracker file of `root` names, if there is one and it exists.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    let tracker = root.join(LATEST_FILE);
    let Ok(text) = std::fs::read_to_string(&tracker) else {
        return Ok(None);
    };
    let step: i64 = text.trim().parse().with_context(|| {
        format!(
            "{}: `{}` is not a step number",
            tracker.display(),
            text.trim()
        )
    })?;
    let dir = step_dir(root, step);
    if !dir.exists() {
        bail!(
            "{} names step {step} but {} does not exist",
            tracker.display(),
            dir.display()
        );
    }
    Ok(Some(dir))
}

/// A checkpoint read back.
pub struct LoadedCheckpoint {
    /// fp32 masters in layout order.
    pub params: Vec<Tensor>,
    /// AdamW first moments.
    pub exp_avg: Vec<Tensor>,
    /// AdamW second moments.
    pub exp_avg_sq: Vec<Tensor>,
    /// Scalars.
    pub state: TrainerState,
}

/// Reads checkpoint `dir` for a model with `layout`.
pub fn load(dir: &Path, layout: &ModelLayout) -> Result<LoadedCheckpoint> {
    let params = weights::load_params(&dir.join("huggingface"), layout)
        .with_context(|| format!("checkpoint {}", dir.display()))?;
    let opt_file = dir.join("optimizer.safetensors");
    let mut moments = weights::read_tensors(std::slice::from_ref(&opt_file))?;
    let mut take = |prefix: &str| -> Result<Vec<Tensor>> {
        layout
            .tensors
            .iter()
            .map(|(name, _)| {
                moments
                    .remove(&format!("{prefix}.{name}"))
                    .with_context(|| format!("{}: `{prefix}.{name}` missing", opt_file.display()))
            })
            .collect()
    };
    let exp_avg = take("exp_avg")?;
    let exp_avg_sq = take("exp_avg_sq")?;
    let state_file = dir.join("trainer_state.json");
    let state: TrainerState = serde_json::from_str(
        &std::fs::read_to_string(&state_file)
            .with_context(|| format!("reading {}", state_file.display()))?,
    )
    .with_context(|| format!("parsing {}", state_file.display()))?;
    Ok(LoadedCheckpoint {
        params,
        exp_avg,
        exp_avg_sq,
        state,
    })
}

/// The weight dtype of an export named on the command line: `fp32`/`float32` or `bf16`/`bfloat16`.
pub fn export_kind(dtype: &str) -> Result<Kind> {
    match dtype {
        "fp32" | "float32" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        other => bail!("export dtype `{other}`: expected fp32 or bf16"),
    }
}

/// `ferl export`: writes the model of checkpoint `dir` (or of a Hugging Face folder) to `out` as a Hugging Face
/// folder with weights in `dtype` (`fp32` or `bf16`).
pub fn export(dir: &Path, out: &Path, dtype: &str) -> Result<()> {
    let kind = export_kind(dtype)?;
    let src = if dir.join("huggingface").is_dir() {
        dir.join("huggingface")
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

    #[test]
    fn prune_keeps_the_newest_and_latest_names_an_existing_folder() {
        let dir = tempfile::tempdir().unwrap();
        for s in [2, 10, 4] {
            std::fs::create_dir_all(step_dir(dir.path(), s)).unwrap();
        }
        prune(dir.path(), 2).unwrap();
        assert_eq!(list_steps(dir.path()).unwrap(), vec![4, 10]);
        assert!(latest(dir.path()).unwrap().is_none());
        write_atomically(&dir.path().join(LATEST_FILE), "10").unwrap();
        assert_eq!(
            latest(dir.path()).unwrap().unwrap(),
            step_dir(dir.path(), 10)
        );
        write_atomically(&dir.path().join(LATEST_FILE), "7").unwrap();
        let err = latest(dir.path()).unwrap_err().to_string();
        assert!(err.contains("global_step_7"), "{err}");
    }
}
