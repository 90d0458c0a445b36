//! The roles a GRPO step asks for, whatever runs them:
//! - [`PolicyRole`]: the policy (old log-probabilities, the update, the rollout's weights, sums over the
//!   data-parallel ranks), implemented by `StepperPolicy` over a stepper — a one-process [`super::PolicyWorker`]'s
//!   or a trainer rank's sharded one — and by the policy actor (`ferl_actors::rl::remote`);
//! - [`ReferencePolicy`]: the frozen reference (an engine over any store: a whole copy in one process, or shards of
//!   a frozen store on trainer ranks);
//! - [`RolloutRole`]: generation — [`Colocated`] from the policy's own weights gathered for the step, or rollout
//!   actors on a separate pool (`ferl_actors::rl`) whose weights are synced after each update.
//!
//! So the step ([`super::grpo_step::GrpoStep`]) is written once for one process, every rank of a sharded run and
//! the actor driver.

use super::batch::RlBatch;
use super::micro::MicroBatching;
use super::policy_worker::{compute_log_prob_rows, ActorUpdateConfig, DataShare, Placement};
use anyhow::Result;
use ferl_trainer::engine::Engine;
use ferl_trainer::model::ulysses::SpGroup;
use ferl_trainer::params::ParamStore;
use ferl_trainer::rollout::{GenerationConfig, RolloutModel};
use std::collections::BTreeMap;
use std::time::Instant;
use tch::{Device, Tensor};

/// The policy as a GRPO step uses it. Every data-parallel rank calls the same methods in the same order (they hold
/// collectives).
pub trait PolicyRole {
    /// Where the step's tensors live.
    fn device(&self) -> Device;
    /// This rank's data-parallel share of each batch (the rows its forwards and update take).
    fn share(&self) -> DataShare;
    /// This rank among every rank of the step: the rows it generates and scores. The data-parallel share without
    /// sequence parallelism; under it each rank of a Ulysses group takes its own rows, since generation needs no
    /// group.
    fn generation_share(&self) -> DataShare {
        self.share()
    }
    /// The Ulysses group this rank splits each forward's sequences with, if any.
    fn sequence_parallel(&self) -> Option<SpGroup> {
        None
    }
    /// Sums `values` over the data-parallel ranks.
    fn sum_over_ranks(&mut self, values: &[f64]) -> Result<Vec<f64>>;
    /// `[rows, width]` log-probabilities (and with `entropy` entropies) of every row of `batch` at `temperature`,
    /// each rank computing its share.
    fn compute_log_prob(
        &mut self,
        batch: &RlBatch,
        micro_batching: MicroBatching,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)>;
    /// verl's `update_policy`; returns the `actor/*` metrics.
    fn update_policy(
        &mut self,
        batch: &RlBatch,
        cfg: &ActorUpdateConfig,
    ) -> Result<BTreeMap<String, f64>>;
    /// [`Self::compute_log_prob`] (no entropies) under the policy's base model, its LoRA adapters off: the
    /// reference policy of a LoRA actor. Refused by a policy without adapters.
    fn base_log_prob(
        &mut self,
        _batch: &RlBatch,
        _micro_batching: MicroBatching,
        _temperature: f64,
    ) -> Result<Tensor> {
        anyhow::bail!("this policy has no LoRA adapters to turn off for a reference")
    }
    /// A rollout model of the current weights: the colocated weight sync, gathered from the shards stage by stage
    /// (every rank holds the whole model until the caller drops it).
    fn rollout_model(&mut self) -> Result<RolloutModel>;
}

/// The frozen reference policy as a GRPO step uses it: log-probabilities of some rows, no gradients. A sharded
/// reference gathers its stages with collectives, so every rank calls it, each for its share. Sendable, so that a
/// trainer-rank actor can hold it.
pub trait ReferencePolicy: Send {
    /// `[rows, width]` log-probabilities of `on.share`'s rows of `batch` (zeros elsewhere; under sequence
    /// parallelism, of `on.sp`'s slice of their tokens) at `temperature`, in the micro-batches `micro_batching`
    /// cuts, on `device`.
    fn log_prob_rows(
        &mut self,
        batch: &RlBatch,
        on: Placement<'_>,
        micro_batching: MicroBatching,
        temperature: f64,
        device: Device,
    ) -> Result<Tensor>;
}

impl<P: ParamStore + Send> ReferencePolicy for Engine<P> {
    fn log_prob_rows(
        &mut self,
        batch: &RlBatch,
        on: Placement<'_>,
        micro_batching: MicroBatching,
        temperature: f64,
        device: Device,
    ) -> Result<Tensor> {
        let (lp, _) =
            compute_log_prob_rows(self, batch, on, micro_batching, temperature, false, device)?;
        Ok(lp)
    }
}

/// Where responses come from.
pub trait RolloutRole {
    /// A response (token ids) to each of `prompts` (one row each; the first is row `config.first_row` of the step's
    /// batch) sampled with `config`.
    fn generate(
        &mut self,
        policy: &mut dyn PolicyRole,
        prompts: &[Vec<i64>],
        config: &GenerationConfig,
    ) -> Result<Vec<Vec<i64>>>;
    /// Called after the policy's update (a separate pool syncs its weights here).
    fn after_update(&mut self, policy: &mut dyn PolicyRole) -> Result<()>;
    /// The step's rollout metrics (`timing_s/gen`, `timing_s/update_weights`, ...), taken once per step.
    fn take_metrics(&mut self) -> BTreeMap<String, f64>;
}

/// The colocated rollout (verl's hybrid engine): before generating, the policy's weights are gathered into a
/// rollout model (`timing_s/update_weights`), which is dropped as soon as generation ends (`timing_s/gen`), before
/// the update.
#[derive(Default)]
pub struct Colocated {
    metrics: BTreeMap<String, f64>,
}

impl RolloutRole for Colocated {
    fn generate(
        &mut self,
        policy: &mut dyn PolicyRole,
        prompts: &[Vec<i64>],
        config: &GenerationConfig,
    ) -> Result<Vec<Vec<i64>>> {
        let started = Instant::now();
        let rollout = policy.rollout_model()?;
        let gathered = Instant::now();
        let out = rollout.generate(prompts, config)?;
        drop(rollout);
        let m = &mut self.metrics;
        let gather_s = (gathered - started).as_secs_f64();
        m.insert("timing_s/update_weights".into(), gather_s);
        m.insert("timing_s/gen".into(), gathered.elapsed().as_secs_f64());
        Ok(out.into_iter().map(|g| g.response).collect())
    }

    fn after_update(&mut self, _policy: &mut dyn PolicyRole) -> Result<()> {
        Ok(())
    }

    fn take_metrics(&mut self) -> BTreeMap<String, f64> {
        std::mem::take(&mut self.metrics)
    }
}
