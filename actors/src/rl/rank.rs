//! GRPO and RLOO as an algorithm of the one run loop ([`ferl_trainer::run::run`]) on trainer ranks: every rank holds
//! its shard of the policy in the [`RankState`] SFT trains (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HSDP from the
//! actor's `fsdp_config`; gradient checkpointing; the learning-rate schedule), and runs the one GRPO step
//! ([`GrpoStep`]) over the loop's prompts with its share of every row. The loop owns the rest: data order, saving
//! (the sharded checkpoint format of SFT, resumable at any world size), resume, restarts, loggers and progress.
//!
//! Metrics carry verl's names; `train/*` is not logged for RL (its `actor/pg_loss`, `actor/grad_norm` and
//! `actor/lr` say it).

use std::sync::Arc;

use anyhow::{Context as _, Result};
use ferl_rl::{Colocated, DataShare, GrpoPrompt, GrpoStep, StepperPolicy};
use ferl_trainer::run::{Phase, StepOutcome};

use crate::rank::RankState;
use crate::spmd::RankAlgorithm;

/// GRPO over the run's prompts (the loop's training set): one [`GrpoStep`] per global batch.
pub struct GrpoAlgorithm {
    prompts: Arc<Vec<GrpoPrompt>>,
    step: GrpoStep,
}

impl GrpoAlgorithm {
    /// Trains on `prompts` (indexed by the loop's data order) with `step`.
    pub fn new(prompts: Arc<Vec<GrpoPrompt>>, step: GrpoStep) -> Self {
        Self { prompts, step }
    }
}

impl RankAlgorithm for GrpoAlgorithm {
    fn train_step(&mut self, state: &mut RankState, batch: &[usize]) -> Result<StepOutcome> {
        let chosen: Vec<GrpoPrompt> = batch.iter().map(|&i| self.prompts[i].clone()).collect();
        let (rank, world) = state.rank_and_world();
        let (dp_rank, dp_world) = state.data_rank_and_world();
        let share = DataShare {
            rank: dp_rank,
            world: dp_world,
        };
        let device = state.stepper.device;
        let mut policy = StepperPolicy {
            stepper: &mut state.stepper,
            share,
        };
        let out = self
            .step
            .run(&mut policy, &mut Colocated::default(), &chosen)
            .with_context(|| format!("rank {rank}"))?;
        let mut memory = vec![0.0; world];
        memory[rank] = crate::device_memory::peak_memory_bytes(device) as f64;
        let memory = state.sum_over_ranks(&memory)?;
        let metric = |k: &str| out.metrics.get(k).copied().unwrap_or(f64::NAN);
        let tokens = out
            .batch
            .rows
            .iter()
            .map(|r| (r.prompt.len() + r.response.len()) as i64)
            .sum();
        Ok(StepOutcome {
            loss: metric("actor/pg_loss"),
            grad_norm: metric("actor/grad_norm"),
            lr: metric("actor/lr"),
            skipped: !metric("actor/grad_norm").is_finite(),
            tokens,
            peak_memory_bytes: memory.iter().map(|&b| b as u64).collect(),
            metrics: out.metrics.into_iter().collect(),
        })
    }

    /// GRPO has no validation pass yet (the config gate refuses the keys that ask for one).
    fn validate(&mut self, _state: &mut RankState, _progress: &Phase) -> Result<Option<f64>> {
        Ok(None)
    }

    /// The next step is the checkpoint's next: its sampling and shuffles derive from the step.
    fn loaded(&mut self, _dir: &std::path::Path, global_step: u64) -> Result<()> {
        self.step.completed = global_step;
        Ok(())
    }
}
