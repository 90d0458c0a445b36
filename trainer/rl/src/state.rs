//! A policy's training state on disk, for resuming RL runs: the trainable master tensors and AdamW's moments
//! ([`STATE_TENSORS`], fp32, exact) and the step counters ([`STATE_META`]). The one-process trainer
//! ([`super::GrpoTrainer`]) and the policy actor write and read the same files.
//!
//! As SFT's checkpoints ([`ferl_trainer::checkpoint`]): the tensors are written to a temporary file and renamed, then
//! [`STATE_META`] (atomically, last) records the size and CRC-32 of every other file of the folder, and a restore
//! verifies them first, so a corrupted or truncated state is refused naming the file instead of loading garbage.

use super::policy_worker::PolicyWorker;
use anyhow::{bail, Context, Result};
use ferl_trainer::checkpoint::digest::{digest_dir, verify_dir, FileDigest};
use ferl_trainer::checkpoint::write_atomic;
use ferl_trainer::params::ParamStore;
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Device, Tensor};

/// File of [`PolicyWorker::save_state`]: the trainable master tensors and AdamW's moments.
pub const STATE_TENSORS: &str = "grpo_state.safetensors";
/// File of [`PolicyWorker::save_state`]: the step counters.
pub const STATE_META: &str = "grpo_state.json";

/// `prefix.i` names for `tensors`, copied to the host.
fn numbered(prefix: &str, tensors: &[Tensor]) -> Vec<(String, Tensor)> {
    tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                format!("{prefix}.{i}"),
                t.detach().to_device(Device::Cpu).contiguous(),
            )
        })
        .collect()
}

impl<P: ParamStore> PolicyWorker<P> {
    /// Writes the masters, AdamW's state and the counters (with the run's `global_step`) to `dir`.
    pub fn save_state(&mut self, dir: &Path, global_step: u64) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let (master, _) = self.engine_mut().store_mut().master_and_grads();
        let mut named = numbered("master", master);
        let opt = self.optimizer();
        named.extend(numbered("exp_avg", &opt.exp_avg));
        named.extend(numbered("exp_avg_sq", &opt.exp_avg_sq));
        let tensors = dir.join(STATE_TENSORS);
        let tmp = tensors.with_extension("tmp");
        Tensor::write_safetensors(&named, &tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &tensors)
            .with_context(|| format!("renaming {} to {}", tmp.display(), tensors.display()))?;
        let meta = serde_json::json!({
            "global_step": global_step,
            "optimizer_step": opt.step,
            "schedule_step": self.completed_steps(),
            "files": digest_dir(dir, STATE_META)?,
        });
        write_atomic(
            &dir.join(STATE_META),
            serde_json::to_string_pretty(&meta)?.as_bytes(),
        )
    }

    /// Restores what [`PolicyWorker::save_state`] wrote into this worker (built like the saved one); returns the
    /// saved `global_step`. A missing or mis-shaped tensor is an error naming it and the folder.
    pub fn restore_state(&mut self, dir: &Path) -> Result<u64> {
        let file = dir.join(STATE_META);
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        let meta: serde_json::Value = serde_json::from_str(&text)?;
        let counter = |k: &str| {
            meta[k]
                .as_i64()
                .with_context(|| format!("{}: no `{k}`", file.display()))
        };
        let (global, opt_step, sched) = (
            counter("global_step")?,
            counter("optimizer_step")?,
            counter("schedule_step")?,
        );
        // States written before the digests have no `files`: nothing to verify.
        let files: BTreeMap<String, FileDigest> = match meta.get("files") {
            Some(f) => serde_json::from_value(f.clone())
                .with_context(|| format!("{}: `files` is not a digest map", file.display()))?,
            None => BTreeMap::new(),
        };
        verify_dir(dir, &files, STATE_META)?;
        let tensors: BTreeMap<String, Tensor> = Tensor::read_safetensors(dir.join(STATE_TENSORS))?
            .into_iter()
            .collect();
        let get = |name: String, like: &Tensor| -> Result<Tensor> {
            let t = tensors
                .get(&name)
                .with_context(|| format!("{}: no tensor {name}", dir.display()))?;
            if t.size() != like.size() {
                bail!(
                    "{}: {name} is {:?}, the model's {:?}",
                    dir.display(),
                    t.size(),
                    like.size()
                );
            }
            Ok(t.to_device(like.device()).to_kind(like.kind()))
        };
        let _g = tch::no_grad_guard();
        let (master, _) = self.engine_mut().store_mut().master_and_grads();
        for (i, m) in master.iter_mut().enumerate() {
            m.copy_(&get(format!("master.{i}"), m)?);
        }
        let opt = self.optimizer_mut();
        for (i, m) in opt.exp_avg.iter_mut().enumerate() {
            *m = get(format!("exp_avg.{i}"), m)?;
        }
        for (i, v) in opt.exp_avg_sq.iter_mut().enumerate() {
            *v = get(format!("exp_avg_sq.{i}"), v)?;
        }
        opt.step = opt_step;
        self.set_completed_steps(sched);
        Ok(global as u64)
    }
}
