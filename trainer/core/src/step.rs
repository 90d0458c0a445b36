//! One optimizer step over a global batch: micro-batching, the exact token-mean loss, gradient clipping, a skipped
//! update on a non-finite norm, AdamW at the scheduled learning rate.

use crate::batch::{Layout, MicroBatch, SampleRef};
use crate::engine::Engine;
use crate::model::ulysses::SpGroup;
use crate::optim::{clip_grads, AdamW, LrSchedule};
use crate::params::ParamStore;
use anyhow::{bail, Result};
use tch::Device;

/// What one step did.
#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    /// Token-mean cross-entropy over every target of the global batch.
    pub loss: f64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
    /// Learning rate the update used.
    pub lr: f64,
    /// The update was skipped because the norm was not finite.
    pub skipped: bool,
    /// Real (non-pad) tokens in the global batch.
    pub tokens: i64,
    /// Targets in the global batch.
    pub targets: i64,
}

/// Engine, optimizer and schedule: everything a step needs.
pub struct Stepper<P: ParamStore> {
    /// Forward/backward over the parameter store.
    pub engine: Engine<P>,
    /// Optimizer state (its `step` counts completed updates, skipped ones included).
    pub optimizer: AdamW,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
    /// Max gradient norm (`optim.clip_grad`); 0 disables clipping.
    pub clip_grad: f64,
    /// Micro-batch size (`data.micro_batch_size_per_gpu`).
    pub micro_batch_size: usize,
    /// Padded or packed micro-batches.
    pub layout: Layout,
    /// Where tensors live.
    pub device: Device,
    /// Steps completed, skipped ones included: the schedule position.
    pub completed_steps: i64,
    /// The Ulysses group this rank shares its sequences with (`ulysses_sequence_parallel_size > 1`): every
    /// micro-batch is split over it ([`MicroBatch::sequence_parallel`]).
    pub sequence_parallel: Option<SpGroup>,
}

impl<P: ParamStore> Stepper<P> {
    /// Trains on one global batch.
    pub fn step(&mut self, samples: &[SampleRef<'_>]) -> Result<StepStats> {
        let targets: i64 = samples.iter().map(SampleRef::num_targets).sum();
        self.step_with_global_targets(samples, targets)
    }

    /// Trains on this rank's slice `samples` of a global batch that has `targets` targets over all ranks (data
    /// parallelism): gradients are scaled by `1 / targets`, so the ranks' summed gradients are the exact global
    /// token-mean. The returned `loss` is this rank's share (its CE sum / `targets`) and `targets` is the global count.
    pub fn step_with_global_targets(
        &mut self,
        samples: &[SampleRef<'_>],
        targets: i64,
    ) -> Result<StepStats> {
        let sizes: Vec<usize> = samples
            .chunks(self.micro_batch_size.max(1))
            .map(<[_]>::len)
            .collect();
        self.step_in_micro_batches(samples, &sizes, targets)
    }

    /// [`Self::step_with_global_targets`] with the micro-batches given: `samples` in order, `sizes[j]` of them in
    /// micro-batch `j` (a token-budget plan, `ferl_data::Batching`). Every rank must pass as many micro-batches.
    pub fn step_in_micro_batches(
        &mut self,
        samples: &[SampleRef<'_>],
        sizes: &[usize],
        targets: i64,
    ) -> Result<StepStats> {
        if samples.is_empty() {
            bail!("a training step needs at least one sample");
        }
        if sizes.contains(&0) || sizes.iter().sum::<usize>() != samples.len() {
            bail!(
                "micro-batch sizes {sizes:?} do not cover the step's {} samples",
                samples.len()
            );
        }
        let tokens: i64 = samples.iter().map(|s| s.input_ids.len() as i64).sum();
        self.engine.store_mut().zero_grads();
        let mut loss_sum = 0.0;
        let mut rest = samples;
        for &n in sizes {
            let (chunk, tail) = rest.split_at(n);
            rest = tail;
            let mb = self.micro_batch(chunk)?;
            loss_sum += self.engine.forward_backward(&mb, targets)?;
        }
        let store = self.engine.store_mut();
        let grad_norm = store.grad_sq_norm()?.sqrt();
        let lr = self.schedule.lr_at(self.completed_steps);
        let skipped = !grad_norm.is_finite();
        if skipped {
            tracing::warn!(
                step = self.completed_steps + 1,
                grad_norm,
                "non-finite gradient norm: update skipped"
            );
        } else {
            let (master, grads) = store.master_and_grads();
            clip_grads(grads, grad_norm, self.clip_grad);
            self.optimizer.step(master, grads, lr);
        }
        self.completed_steps += 1;
        Ok(StepStats {
            loss: loss_sum / targets.max(1) as f64,
            grad_norm,
            lr,
            skipped,
            tokens,
            targets,
        })
    }

    /// The micro-batch of `samples` in this stepper's layout, on its device, split over its sequence-parallel
    /// group when it has one.
    pub fn micro_batch(&self, samples: &[SampleRef<'_>]) -> Result<MicroBatch> {
        let mb = MicroBatch::new(samples, self.layout, self.device)?;
        match &self.sequence_parallel {
            Some(group) => mb.sequence_parallel(group),
            None => Ok(mb),
        }
    }

    /// Token-mean validation loss over `samples` in micro-batches (no gradients).
    pub fn validate(&mut self, samples: &[SampleRef<'_>]) -> Result<f64> {
        let (mut sum, mut count) = (0.0, 0i64);
        for chunk in samples.chunks(self.micro_batch_size.max(1)) {
            let mb = self.micro_batch(chunk)?;
            let (s, c) = self.engine.eval_loss(&mb)?;
            sum += s;
            count += c;
        }
        Ok(sum / count.max(1) as f64)
    }
}
