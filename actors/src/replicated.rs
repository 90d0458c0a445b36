//! [`ReplicatedParams`]: data parallelism without sharding (`NO_SHARD`). Every rank holds the whole model in a
//! [`LocalParams`]; gradients are summed across ranks once per optimizer step, just before the norm is taken, so
//! clipping and AdamW see the gradient of the whole global batch on every rank and the replicas stay identical.
//!
//! Invariants:
//! 1. Each rank's gradient is already scaled by `1 / global targets`, so the all-reduced sum is the gradient of the
//!    token-mean loss over the global batch — the same as one process computing the whole batch.
//! 2. `grad_sq_norm` is the step's only collective; every rank calls it exactly once per step (a rank with no
//!    samples still joins it with zero gradients).

use std::sync::Arc;

use anyhow::{Context as _, Result};
use ferl_collective::{Communicator, ReduceOp};
use ferl_trainer::model::layout::{ModelLayout, Stage};
use ferl_trainer::params::{LocalParams, ParamStore, StageParams};
use tch::Tensor;

/// A full replica per rank, with gradients all-reduced across the communicator's group.
pub struct ReplicatedParams {
    local: LocalParams,
    comm: Arc<dyn Communicator>,
    flat: Option<Tensor>,
}

impl ReplicatedParams {
    /// Wraps a local store; `comm` spans the data-parallel ranks.
    pub fn new(local: LocalParams, comm: Arc<dyn Communicator>) -> Self {
        Self { local, comm, flat: None }
    }

    /// The replica's local store (checkpoints and exports read its masters).
    pub fn local(&self) -> &LocalParams {
        &self.local
    }

    /// The replica's local store, mutably (checkpoint restore).
    pub fn local_mut(&mut self) -> &mut LocalParams {
        &mut self.local
    }

    /// The communicator of the data-parallel group.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Sums every gradient across ranks through one flat buffer (one collective per step).
    fn all_reduce_grads(&mut self) -> Result<()> {
        if self.comm.world_size() == 1 {
            return Ok(());
        }
        let _g = tch::no_grad_guard();
        let (_, grads) = self.local.master_and_grads();
        let total: i64 = grads.iter().map(|g| g.numel() as i64).sum();
        let device = grads.first().map(Tensor::device).unwrap_or(tch::Device::Cpu);
        let flat = self.flat.get_or_insert_with(|| Tensor::zeros([total], (tch::Kind::Float, device)));
        let mut offset = 0;
        for g in grads.iter() {
            let n = g.numel() as i64;
            flat.narrow(0, offset, n).copy_(&g.reshape([-1]));
            offset += n;
        }
        self.comm.all_reduce(flat, ReduceOp::Sum).context("all-reducing gradients across data-parallel ranks")?;
        let mut offset = 0;
        for g in grads.iter_mut() {
            let n = g.numel() as i64;
            g.copy_(&flat.narrow(0, offset, n).view(g.size().as_slice()));
            offset += n;
        }
        Ok(())
    }
}

impl ParamStore for ReplicatedParams {
    fn layout(&self) -> &ModelLayout {
        self.local.layout()
    }
    fn gather(&mut self, stage: Stage) -> Result<StageParams> {
        self.local.gather(stage)
    }
    fn accumulate_grads(&mut self, stage: Stage, grads: &[Tensor]) -> Result<()> {
        self.local.accumulate_grads(stage, grads)
    }
    fn release(&mut self, stage: Stage) {
        self.local.release(stage)
    }
    fn master_and_grads(&mut self) -> (&mut [Tensor], &mut [Tensor]) {
        self.local.master_and_grads()
    }
    fn grad_sq_norm(&mut self) -> Result<f64> {
        self.all_reduce_grads()?;
        self.local.grad_sq_norm()
    }
    fn zero_grads(&mut self) {
        self.local.zero_grads()
    }
}
