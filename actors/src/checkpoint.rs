//! Checkpoint folders and the checkpointer actor.
//!
//! Layout under `trainer.default_local_dir`:
//! ```text
//! global_step_N/model_world_size_W_rank_R.safetensors   rank R's fp32 master shards (ferl-fsdp's format)
//! global_step_N/optim_world_size_W_rank_R.safetensors   rank R's AdamW moment shards
//! global_step_N/fsdp_meta.json           the sharded layout; loads at any world size (`ferl_fsdp::load_sharded`)
//! global_step_N/meta.json                written last: global step, data position, world size
//! latest_checkpointed_iteration.txt      N of the newest complete checkpoint (verl's file name)
//! ```
//! The ranks copy their shards and write them on background threads while training continues; the checkpointer
//! waits for every rank's files, then writes the metadata.
//!
//! Invariants:
//! 1. `fsdp_meta.json`, `meta.json` and `latest_checkpointed_iteration.txt` are written atomically (temp file, then
//!    rename), in that order, and only after every rank's files exist (each is itself written then renamed), so a
//!    crash never leaves the latest pointer at a partial checkpoint.
//! 2. Pruning keeps the newest `trainer.max_ckpt_to_keep` complete checkpoints and never deletes the latest.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context as _, Result};
use ferl_runtime::{Actor, Context, Handler};
use serde::{Deserialize, Serialize};

use crate::messages::{Commit, DataPosition, Flush};

/// verl's name for the file holding the newest checkpoint's step.
pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";
/// Metadata file inside `global_step_N/`, written last.
pub const META_FILE: &str = "meta.json";

/// What `meta.json` holds.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct CheckpointMeta {
    /// Optimizer steps completed.
    pub global_step: u64,
    /// Epoch of the next batch.
    pub epoch: u64,
    /// Step within that epoch of the next batch.
    pub step_in_epoch: u64,
    /// Ranks that wrote it.
    pub world_size: u64,
}

impl CheckpointMeta {
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

/// Marks `global_step_N` complete: writes its metadata, then the latest pointer, then prunes (keeping `keep`).
pub fn commit(root: &Path, meta: &CheckpointMeta, keep: Option<usize>) -> Result<()> {
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
        let name = entry.file_name();
        if let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("global_step_"))
            .and_then(|n| n.parse().ok())
        {
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

/// Reads `dir/meta.json`.
pub fn read_meta(dir: &Path) -> Result<CheckpointMeta> {
    let file = dir.join(META_FILE);
    let bytes = std::fs::read(&file)
        .with_context(|| format!("reading {} (is it a complete checkpoint?)", file.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", file.display()))
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
    Ok(Some(step_dir(root, step)))
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
            anyhow::bail!("checkpoint files still missing after {timeout:?}: {missing:?}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// How long the checkpointer waits for the ranks' files (`FERL_CHECKPOINT_WAIT_S`, default 1800 s).
fn file_wait() -> std::time::Duration {
    let secs = std::env::var("FERL_CHECKPOINT_WAIT_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1800.0);
    std::time::Duration::from_secs_f64(secs)
}

/// Constructor arguments of [`Checkpointer`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct CheckpointerArgs {
    /// `trainer.default_local_dir`.
    pub root: String,
    /// `trainer.max_ckpt_to_keep` (0 keeps all).
    pub max_keep: u64,
}

/// Finishes checkpoints off the training path: the driver `tell`s it a [`Commit`] and goes on training.
pub struct Checkpointer {
    root: PathBuf,
    keep: Option<usize>,
    committed: Mutex<u64>,
}

impl Actor for Checkpointer {
    type Args = CheckpointerArgs;
    const NAME: &'static str = "ferl.actors.Checkpointer";
    async fn start(args: CheckpointerArgs, _: &Context) -> Result<Self> {
        let keep = (args.max_keep > 0).then_some(args.max_keep as usize);
        Ok(Self {
            root: PathBuf::from(args.root),
            keep,
            committed: Mutex::new(0),
        })
    }
}

impl Checkpointer {
    /// A checkpointer for `root` hosted in the driver's process.
    pub fn local(root: PathBuf, keep: Option<usize>) -> Self {
        Self {
            root,
            keep,
            committed: Mutex::new(0),
        }
    }
}

impl Handler<Commit> for Checkpointer {
    async fn handle(&self, m: Commit, _: &Context) -> Result<()> {
        let meta = CheckpointMeta {
            global_step: m.global_step,
            epoch: m.position.epoch,
            step_in_epoch: m.position.step_in_epoch,
            world_size: m.world_size,
        };
        let (root, keep) = (self.root.clone(), self.keep);
        let (files, fsdp_meta) = (m.files, m.fsdp_meta_json);
        tokio::task::spawn_blocking(move || {
            wait_for_files(&files, file_wait())?;
            let dir = step_dir(&root, meta.global_step);
            write_atomic(
                &dir.join(ferl_fsdp::checkpoint::META_FILE),
                fsdp_meta.as_bytes(),
            )?;
            commit(&root, &meta, keep)
        })
        .await
        .context("checkpointer task")??;
        *self
            .committed
            .lock()
            .map_err(|_| anyhow::anyhow!("checkpointer lock poisoned"))? = m.global_step;
        Ok(())
    }
}

impl Handler<Flush> for Checkpointer {
    async fn handle(&self, _: Flush, _: &Context) -> Result<u64> {
        Ok(*self
            .committed
            .lock()
            .map_err(|_| anyhow::anyhow!("checkpointer lock poisoned"))?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invariants_1_2_commit_points_latest_and_prunes() {
        let root = tempfile::tempdir().unwrap();
        for step in [2u64, 4, 6] {
            std::fs::create_dir_all(step_dir(root.path(), step)).unwrap();
            let meta = CheckpointMeta {
                global_step: step,
                epoch: 0,
                step_in_epoch: step,
                world_size: 2,
            };
            commit(root.path(), &meta, Some(2)).unwrap();
        }
        // An incomplete folder (no meta.json) is never counted nor pointed at.
        std::fs::create_dir_all(step_dir(root.path(), 8)).unwrap();
        assert_eq!(complete_steps(root.path()).unwrap(), vec![4, 6]);
        let latest = latest(root.path()).unwrap().unwrap();
        assert_eq!(latest, step_dir(root.path(), 6));
        assert_eq!(
            read_meta(&latest).unwrap().position(),
            DataPosition {
                epoch: 0,
                step_in_epoch: 6
            }
        );
        assert!(!step_dir(root.path(), 2).exists());
    }
}
