//! The GRPO step's roles backed by actors, for the single-controller [`super::GrpoDriver`]: [`ActorPolicy`] (the
//! [`PolicyActor`]'s log-probabilities and update), [`ActorReference`] (its frozen reference) and [`ActorRollouts`]
//! (rollout actors generating shares of the rows, their weights synced from the policy after each update). The step
//! itself is [`GrpoStep`](ferl_rl::GrpoStep), the code every other path runs.
//!
//! The roles are synchronous (the step is); each call blocks on the actor call through the runtime's handle, so the
//! driver runs the step inside `tokio::task::block_in_place` (a multi-threaded runtime).

use super::driver::{sync_weights, WeightSync};
use super::messages::{token_matrix, ComputeLogProb, Generate, UpdatePolicy, WireDtype};
use super::policy::PolicyActor;
use super::rollout::Rollout;
use anyhow::{bail, Result};
use ferl_rl::{
    ActorUpdateConfig, DataShare, MicroBatching, Placement, PolicyRole, ReferencePolicy, RlBatch,
    RolloutRole,
};
use ferl_runtime::{split_even, ActorRef, WorkerGroup};
use ferl_trainer::rollout::{GenerationConfig, RolloutModel};
use std::collections::BTreeMap;
use std::time::Instant;
use tch::{Device, Tensor};
use tokio::runtime::Handle;

/// The policy actor as the step's policy: it holds the whole batch (one rank); tensors come back to the driver's CPU.
pub struct ActorPolicy {
    /// The runtime the calls run on.
    pub handle: Handle,
    /// The policy actor.
    pub actor: ActorRef<PolicyActor>,
}

impl PolicyRole for ActorPolicy {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn share(&self) -> DataShare {
        DataShare::WHOLE
    }

    fn sum_over_ranks(&mut self, values: &[f64]) -> Result<Vec<f64>> {
        Ok(values.to_vec())
    }

    fn compute_log_prob(
        &mut self,
        batch: &RlBatch,
        micro_batching: MicroBatching,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let msg = ComputeLogProb::policy(batch, micro_batching, temperature, entropy);
        let out = self.handle.block_on(self.actor.call(msg))?;
        let log_probs = token_matrix(batch, &out.log_probs, Device::Cpu)?;
        let entropies = match &out.entropies {
            Some(h) => Some(token_matrix(batch, h, Device::Cpu)?),
            None => None,
        };
        Ok((log_probs, entropies))
    }

    fn update_policy(
        &mut self,
        batch: &RlBatch,
        cfg: &ActorUpdateConfig,
    ) -> Result<BTreeMap<String, f64>> {
        let msg = UpdatePolicy::new(batch, cfg)?;
        Ok(self
            .handle
            .block_on(self.actor.call(msg))?
            .into_iter()
            .collect())
    }

    fn rollout_model(&mut self) -> Result<RolloutModel> {
        bail!("the policy actor's weights reach the rollout actors by a weight sync, not a local gather")
    }
}

/// The policy actor's frozen reference (it holds one when `use_kl_loss` is set).
pub struct ActorReference {
    /// The runtime the calls run on.
    pub handle: Handle,
    /// The policy actor.
    pub actor: ActorRef<PolicyActor>,
}

impl ReferencePolicy for ActorReference {
    fn log_prob_rows(
        &mut self,
        batch: &RlBatch,
        on: Placement<'_>,
        micro_batching: MicroBatching,
        temperature: f64,
        _device: Device,
    ) -> Result<Tensor> {
        if on.share != DataShare::WHOLE || on.sp.is_some() {
            bail!("the policy actor's reference computes whole batches");
        }
        let msg = ComputeLogProb::reference(batch, micro_batching, temperature);
        let out = self.handle.block_on(self.actor.call(msg))?;
        token_matrix(batch, &out.log_probs, Device::Cpu)
    }
}

/// Rollout actors, each generating an even share of the rows (every row from its own sampling stream, so the
/// responses do not depend on the number of actors); after each update the policy's weights are synced to them.
pub struct ActorRollouts<'a> {
    handle: Handle,
    rollouts: &'a WorkerGroup<Rollout>,
    policy: &'a ActorRef<PolicyActor>,
    dtype: WireDtype,
    metrics: BTreeMap<String, f64>,
}

impl<'a> ActorRollouts<'a> {
    /// Rollout actors `rollouts` synced from `policy` as `dtype`.
    pub fn new(
        handle: Handle,
        rollouts: &'a WorkerGroup<Rollout>,
        policy: &'a ActorRef<PolicyActor>,
        dtype: WireDtype,
    ) -> Self {
        Self {
            handle,
            rollouts,
            policy,
            dtype,
            metrics: BTreeMap::new(),
        }
    }

    /// Moves the policy's current weights to every rollout actor ([`sync_weights`]).
    pub fn sync(&mut self) -> Result<WeightSync> {
        let fut = sync_weights(self.policy, self.rollouts, self.dtype);
        self.handle.block_on(fut)
    }
}

impl RolloutRole for ActorRollouts<'_> {
    fn generate(
        &mut self,
        _policy: &mut dyn PolicyRole,
        prompts: &[Vec<i64>],
        config: &GenerationConfig,
    ) -> Result<Vec<Vec<i64>>> {
        let started = Instant::now();
        let chunks = split_even(prompts.to_vec(), self.rollouts.len());
        let mut first_row = config.first_row;
        let mut messages = Vec::with_capacity(chunks.len());
        for chunk in chunks {
            let rows = chunk.len() as u64;
            messages.push(Generate::rows(chunk, config, first_row));
            first_row += rows;
        }
        let replies = self.handle.block_on(self.rollouts.call_each(messages))?;
        let responses = replies.into_iter().flat_map(|g| g.responses).collect();
        let gen_s = started.elapsed().as_secs_f64();
        self.metrics.insert("timing_s/gen".into(), gen_s);
        Ok(responses)
    }

    fn after_update(&mut self, _policy: &mut dyn PolicyRole) -> Result<()> {
        let sync = self.sync()?;
        self.metrics.extend(sync.metrics());
        Ok(())
    }

    fn take_metrics(&mut self) -> BTreeMap<String, f64> {
        std::mem::take(&mut self.metrics)
    }
}
