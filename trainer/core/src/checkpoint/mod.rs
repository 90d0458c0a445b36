//! The one checkpoint layout of every launch path, under `trainer.default_local_dir`:
//! ```text
//! global_step_N/model_world_size_W_rank_R.safetensors   rank R's fp32 master shards (ferl-fsdp's format)
//! global_step_N/optim_world_size_W_rank_R.safetensors   rank R's AdamW moment shards
//! global_step_N/fsdp_meta.json      the sharded layout and model config; loads at any world size and strategy
//! global_step_N/huggingface/        the model's tokenizer and generation files (always, as verl keeps them), and
//!                                   the model as a Hugging Face folder when `save_contents` has `hf_model`
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
//! 4. `meta.json` records the size and CRC-32 of every other file ([`digest`]); a load verifies them and refuses a
//!    corrupted or truncated checkpoint naming the file. `resume_mode=auto` then falls back to the newest older
//!    checkpoint that verifies, with a warning.

pub mod digest;

use crate::model::weights;
use anyhow::{bail, Context, Result};
use digest::{digest_dir, verify_dir, FileDigest};
use ferl_config::{expand_path, ResumeMode, SftConfig};
use ferl_data::DataPosition;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
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
    /// Size and CRC-32 of every other file of the folder, by relative path (filled in by [`commit`]).
    #[serde(default)]
    pub files: BTreeMap<String, FileDigest>,
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

/// Marks `global_step_N` complete: records the digests of its files in its `meta.json`, writes that, then the
/// latest pointer, then prunes (keeping `keep`).
pub fn commit(root: &Path, meta: &RunMeta, keep: Option<usize>) -> Result<()> {
    let dir = step_dir(root, meta.global_step);
    let meta = RunMeta {
        files: digest_dir(&dir, META_FILE)?,
        ..meta.clone()
    };
    write_atomic(&dir.join(META_FILE), &serde_json::to_vec_pretty(&meta)?)?;
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

/// Reads `dir/meta.json` and verifies every file it records (invariant 4).
pub fn verify(dir: &Path) -> Result<RunMeta> {
    let meta = read_meta(dir)?;
    verify_dir(dir, &meta.files, META_FILE)?;
    Ok(meta)
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

/// The step `latest_checkpointed_iteration.txt` under `root` names, if there is one.
pub fn latest_step(root: &Path) -> Result<Option<u64>> {
    let file = root.join(LATEST_FILE);
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(None);
    };
    let step = text
        .trim()
        .parse()
        .with_context(|| format!("{}: `{}` is not a step number", file.display(), text.trim()))?;
    Ok(Some(step))
}

/// The checkpoint named by `latest_checkpointed_iteration.txt` under `root`, if any.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    let Some(step) = latest_step(root)? else {
        return Ok(None);
    };
    let dir = step_dir(root, step);
    if !dir.is_dir() {
        bail!(
            "{} names {}, which does not exist",
            root.join(LATEST_FILE).display(),
            dir.display()
        );
    }
    Ok(Some(dir))
}

/// The checkpoint a run starts from, per `trainer.resume_mode` (and `resume_from_path`), verified (invariant 4).
pub fn resume_dir(cfg: &SftConfig) -> Result<Option<PathBuf>> {
    let root = expand_path(&cfg.trainer.default_local_dir);
    match cfg.trainer.resume_mode {
        ResumeMode::Disable => Ok(None),
        ResumeMode::Auto => newest_good(&root),
        ResumeMode::ResumePath => {
            let p = cfg
                .trainer
                .resume_from_path
                .as_deref()
                .context("trainer.resume_mode=resume_path needs trainer.resume_from_path")?;
            let dir = expand_path(p);
            verify(&dir).with_context(|| format!("resuming from {}", dir.display()))?;
            Ok(Some(dir))
        }
    }
}

/// The newest complete checkpoint under `root` that verifies, starting at the one the latest pointer names; each
/// one skipped is reported with why.
fn newest_good(root: &Path) -> Result<Option<PathBuf>> {
    let Some(newest) = latest_step(root)? else {
        return Ok(None);
    };
    refuse_legacy(&step_dir(root, newest))?;
    for step in complete_steps(root)?
        .into_iter()
        .rev()
        .filter(|&s| s <= newest)
    {
        let dir = step_dir(root, step);
        match verify(&dir) {
            Ok(_) => return Ok(Some(dir)),
            Err(e) => tracing::warn!("skipping checkpoint {}: {e:#}", dir.display()),
        }
    }
    bail!(
        "no checkpoint under {} verifies (resume_mode=auto); set trainer.resume_mode=disable to start over",
        root.display()
    )
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
            files: BTreeMap::new(),
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

    /// A root with complete checkpoints at `steps`, each with a shard and a `huggingface/` file.
    fn saved(steps: &[u64]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for &step in steps {
            let dir = step_dir(root.path(), step);
            std::fs::create_dir_all(dir.join(HF_DIR)).unwrap();
            std::fs::write(
                dir.join("model_world_size_1_rank_0.safetensors"),
                vec![step as u8; 1000],
            )
            .unwrap();
            std::fs::write(dir.join(HF_DIR).join("config.json"), "{}").unwrap();
            commit(root.path(), &meta(step), None).unwrap();
        }
        root
    }

    fn auto(root: &Path) -> SftConfig {
        let o = [format!("trainer.default_local_dir={}", root.display())];
        SftConfig::load(None, &o).unwrap()
    }

    #[test]
    fn invariant_4_corrupted_or_truncated_files_are_refused_naming_them() {
        let root = saved(&[2]);
        let dir = step_dir(root.path(), 2);
        let m = verify(&dir).unwrap();
        assert_eq!(m.files.len(), 2, "{:?}", m.files);
        let shard = dir.join("model_world_size_1_rank_0.safetensors");
        let mut bytes = std::fs::read(&shard).unwrap();
        bytes[500] ^= 1;
        std::fs::write(&shard, &bytes).unwrap();
        let err = format!("{:#}", verify(&dir).unwrap_err());
        assert!(
            err.contains("corrupted") && err.contains("model_world_size_1_rank_0"),
            "{err}"
        );
        std::fs::write(&shard, &bytes[..10]).unwrap();
        let err = format!("{:#}", verify(&dir).unwrap_err());
        assert!(
            err.contains("truncated") && err.contains("model_world_size_1_rank_0"),
            "{err}"
        );
        std::fs::remove_file(dir.join(HF_DIR).join("config.json")).unwrap();
        let err = format!("{:#}", verify(&dir).unwrap_err());
        assert!(
            err.contains("huggingface/config.json") && err.contains("missing"),
            "{err}"
        );
    }

    #[test]
    fn invariant_4_auto_resume_falls_back_to_the_newest_good_checkpoint() {
        let root = saved(&[2, 4, 6]);
        assert_eq!(
            resume_dir(&auto(root.path())).unwrap(),
            Some(step_dir(root.path(), 6))
        );
        let shard = step_dir(root.path(), 6).join("model_world_size_1_rank_0.safetensors");
        std::fs::write(&shard, b"garbage").unwrap();
        assert_eq!(
            resume_dir(&auto(root.path())).unwrap(),
            Some(step_dir(root.path(), 4))
        );
        let mut cfg = auto(root.path());
        cfg.trainer.resume_mode = ResumeMode::ResumePath;
        cfg.trainer.resume_from_path = Some(step_dir(root.path(), 6).display().to_string());
        let err = format!("{:#}", resume_dir(&cfg).unwrap_err());
        assert!(
            err.contains("global_step_6") && err.contains("truncated"),
            "{err}"
        );
        for step in [2, 4] {
            let shard = step_dir(root.path(), step).join("model_world_size_1_rank_0.safetensors");
            std::fs::write(&shard, b"x").unwrap();
        }
        let err = format!("{:#}", resume_dir(&auto(root.path())).unwrap_err());
        assert!(
            err.contains("no checkpoint") && err.contains("resume_mode=disable"),
            "{err}"
        );
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
