//! The checkpointer actor: finishes checkpoints off the training path. The layout is the one of every launch path
//! ([`ferl_trainer::checkpoint`]); the ranks copy their shards and write them on background threads while training
//! continues, and the checkpointer waits for every rank's files, then writes `fsdp_meta.json`, then commits
//! (`meta.json`, then `latest_checkpointed_iteration.txt`, then pruning).

use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{Context as _, Result};
use ferl_runtime::{Actor, Context, Handler};
use ferl_trainer::checkpoint::{commit, step_dir, wait_for_files, write_atomic, RunMeta};

use crate::messages::{Commit, Flush};

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
        Ok(Self {
            root: PathBuf::from(args.root),
            keep: (args.max_keep > 0).then_some(args.max_keep as usize),
            committed: Mutex::new(0),
        })
    }
}

impl Handler<Commit> for Checkpointer {
    async fn handle(&self, m: Commit, _: &Context) -> Result<()> {
        let meta: RunMeta =
            serde_json::from_str(&m.run_meta_json).context("checkpointer: parsing meta.json")?;
        let (root, keep, step) = (self.root.clone(), self.keep, meta.global_step);
        tokio::task::spawn_blocking(move || {
            wait_for_files(&m.files, file_wait())?;
            let dir = step_dir(&root, meta.global_step);
            let fsdp_meta = dir.join(ferl_fsdp::checkpoint::META_FILE);
            write_atomic(&fsdp_meta, m.fsdp_meta_json.as_bytes())?;
            commit(&root, &meta, keep)
        })
        .await
        .context("checkpointer task")??;
        *self
            .committed
            .lock()
            .map_err(|_| anyhow::anyhow!("checkpointer lock poisoned"))? = step;
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
