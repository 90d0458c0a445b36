//! The cluster executor: the run loop on the driver (verl's single controller) over actors — one [`TrainerRank`]
//! per bundle of a resource group, a [`DataLoader`] holding the tokenized data, a [`Checkpointer`] finishing
//! checkpoints while training goes on. Tensors never travel through messages, only token ids, paths and numbers.
//!
//! The loop runs on a blocking thread; each executor call blocks on the actors' replies through the runtime handle.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use ferl_trainer::checkpoint::{RunMeta, HF_DIR};
use ferl_trainer::run::{Phase, RestartPolicy, RestartRecord, StepExecutor, StepOutcome};
use tokio::runtime::Handle;

use crate::cluster_run::{cause_kind, ClusterRun, RunActors};
use crate::data_loader::DataLoader;
use crate::data_loader::{call_samples, rows_done, validation_calls};
use crate::messages::*;
use crate::rank::micro_batches;
use crate::rl::{RlTrainStep, WirePrompt};
use crate::trainer_rank::TrainerRank;
use ferl_rl::GrpoPrompt;
use ferl_runtime::ActorRef;

/// The actors a cluster run trains with.
pub struct ClusterExecutor {
    /// The runtime the actors' calls run on.
    pub handle: Handle,
    /// What the actors are spawned from (restarts spawn them again).
    pub run: ClusterRun,
    /// The ranks, data loader and checkpointer of the current attempt.
    pub actors: RunActors,
    /// `data.micro_batch_size_per_gpu` (validation rounds).
    pub micro_batch_size: usize,
    /// Rows of the loader's validation set (0: none).
    pub val_len: usize,
    /// An RL run's prompts (the loop's training set), sent to the ranks step by step; none for SFT.
    pub prompts: Option<Arc<Vec<GrpoPrompt>>>,
    /// Steps the run completed (an RL step's sampling derives from it).
    pub completed: u64,
}

impl ClusterExecutor {
    /// Sends rank `r` message `r` at once (the ranks meet in collectives) and gathers the replies in rank order
    /// ([`ferl_runtime::WorkerGroup::call_each`]: a rank that died is named before the collateral failures).
    fn each<M>(&self, what: &str, messages: Vec<M>) -> Result<Vec<M::Reply>>
    where
        M: ferl_runtime::Message,
        TrainerRank: ferl_runtime::Handler<M>,
    {
        let replies = self.handle.block_on(self.actors.ranks.call_each(messages));
        replies.map_err(|e| match e {
            ferl_runtime::Error::Rank {
                rank,
                actor,
                node,
                cause,
            } => anyhow::Error::new(*cause)
                .context(format!("{what}: trainer rank {rank} ({actor} on {node})")),
            other => anyhow::Error::new(other).context(what.to_string()),
        })
    }

    fn all<M>(&self, what: &str, message: M) -> Result<Vec<M::Reply>>
    where
        M: ferl_runtime::Message + Clone,
        TrainerRank: ferl_runtime::Handler<M>,
    {
        let n = self.actors.ranks.members().len();
        self.each(what, vec![message; n])
    }
}

impl ClusterExecutor {
    /// The data loader (an SFT run's).
    fn loader(&self) -> Result<&ActorRef<DataLoader>> {
        self.actors
            .loader
            .as_ref()
            .context("this run has no data loader (an RL run's driver sends its prompts itself)")
    }

    /// One SFT step: the loader cuts the global batch into the ranks' micro-batches.
    fn sft_step(&self, batch: &[usize]) -> Result<StepOutcome> {
        let indices = batch.iter().map(|&i| i as u64).collect();
        let b = self
            .handle
            .block_on(self.loader()?.call(BatchOf { indices }))
            .context("data loader: batch")?;
        let targets = b.global_targets;
        let messages = b
            .shards
            .into_iter()
            .zip(b.micro_sizes)
            .map(|(samples, micro_sizes)| TrainStep {
                samples,
                micro_sizes,
                global_targets: targets,
            })
            .collect();
        let replies = self.each("training", messages)?;
        Ok(StepOutcome {
            loss: replies.iter().map(|r| r.loss_share).sum(),
            grad_norm: replies[0].grad_norm,
            lr: replies[0].lr,
            skipped: replies[0].skipped,
            tokens: b.tokens,
            peak_memory_bytes: replies.iter().map(|r| r.peak_memory_bytes).collect(),
            metrics: Vec::new(),
        })
    }

    /// One RL step: every rank gets the step's prompts and takes its share of the rows; they all know the result.
    fn rl_step(&self, prompts: &[GrpoPrompt], batch: &[usize]) -> Result<StepOutcome> {
        let message = RlTrainStep {
            prompts: batch
                .iter()
                .map(|&i| WirePrompt::from(&prompts[i]))
                .collect(),
            completed: self.completed,
        };
        let mut replies = self.all("RL step", message)?;
        Ok(replies.swap_remove(0).into())
    }
}

impl StepExecutor for ClusterExecutor {
    fn world_size(&self) -> usize {
        self.actors.ranks.members().len()
    }

    fn train_step(&mut self, batch: &[usize]) -> Result<StepOutcome> {
        let outcome = match self.prompts.clone() {
            Some(prompts) => self.rl_step(&prompts, batch),
            None => self.sft_step(batch),
        }?;
        self.completed += 1;
        Ok(outcome)
    }

    fn validate(&mut self, progress: &Phase) -> Result<Option<f64>> {
        if self.val_len == 0 {
            return Ok(None);
        }
        progress.set_length(self.val_len as u64);
        progress.set_position(0);
        let shards = self.handle.block_on(self.loader()?.call(ValShards))?;
        let micro = self.micro_batch_size;
        let rounds = shards
            .iter()
            .map(|s| micro_batches(s.len(), micro))
            .max()
            .unwrap_or(0);
        let (mut sum, mut count) = (0.0, 0);
        for call in validation_calls(rounds) {
            let messages = shards
                .iter()
                .map(|shard| Validate {
                    samples: call_samples(shard, &call, micro).to_vec(),
                    rounds: call.len() as u64,
                })
                .collect();
            for (s, c) in self.each("validation", messages)? {
                sum += s;
                count += c;
            }
            progress.set_position(rows_done(self.val_len, call.end, rounds));
        }
        Ok(Some(sum / count.max(1) as f64))
    }

    fn save(&mut self, dir: &Path, meta: &RunMeta, hf_model: bool) -> Result<()> {
        let dir_text = dir.display().to_string();
        let saving = self.all("checkpoint save", SaveShard { dir: dir_text })?;
        if hf_model {
            let hf = dir.join(HF_DIR).display().to_string();
            self.all("checkpoint huggingface/ export", Export { dir: hf })?;
        }
        let commit = Commit {
            fsdp_meta_json: saving[0].meta_json.clone(),
            files: saving
                .iter()
                .flat_map(|s| s.files.iter().cloned())
                .collect(),
            run_meta_json: serde_json::to_string(meta)?,
        };
        self.handle
            .block_on(self.actors.checkpointer.tell(commit))?;
        Ok(())
    }

    fn load(&mut self, dir: &Path) -> Result<()> {
        self.completed = ferl_trainer::checkpoint::read_meta(dir)?.global_step;
        let dir = dir.display().to_string();
        self.all("loading the checkpoint", LoadShard { dir })?;
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.all("finishing checkpoint writes", FinishSave)?;
        self.handle.block_on(self.actors.checkpointer.call(Flush))?;
        Ok(())
    }

    fn restart(&mut self, cause: &anyhow::Error, policy: &RestartPolicy<'_>) -> Result<String> {
        let kind = cause_kind(cause);
        let fresh = self
            .handle
            .block_on(self.run.restart(&self.actors, policy))?;
        self.actors = fresh;
        // The loop starts again from its newest checkpoint (`load` then sets the count), else from the first step.
        self.completed = 0;
        Ok(kind)
    }

    fn on_restart(&mut self, restarts: &[RestartRecord]) {
        let world = self.world_size();
        self.handle
            .block_on(self.run.publish("running", world, restarts));
    }
}
