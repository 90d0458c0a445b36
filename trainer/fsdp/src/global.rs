//! The exact token-mean over the global batch across data-parallel ranks.
//!
//! Every rank holds a slice of the global batch. The loss is `sum of per-target CE over all ranks / number of targets
//! over all ranks`, so each rank scales its gradients by `1 / global targets` and the reductions *sum* them: the sum
//! over ranks of `local CE sum / global count` is exactly the global mean, whatever the split.

use crate::store::ShardedParams;
use anyhow::{Context, Result};
use ferl_trainer::batch::SampleRef;
use ferl_trainer::step::{StepStats, Stepper};

/// One optimizer step on every rank: `samples` is this rank's slice of the global batch (at least one sample).
/// Returns the global statistics: the token-mean loss of the whole global batch, the global gradient norm, and the
/// global token and target counts (identical on every rank).
pub fn global_step(
    stepper: &mut Stepper<ShardedParams>,
    samples: &[SampleRef<'_>],
) -> Result<StepStats> {
    let local_targets: i64 = samples.iter().map(SampleRef::num_targets).sum();
    let local_tokens: i64 = samples.iter().map(|s| s.input_ids.len() as i64).sum();
    let store = stepper.engine.store_mut();
    let (rank, _) = store.rank_and_world();
    let counts = store
        .all_reduce_sum(&[local_targets as f64, local_tokens as f64])
        .with_context(|| format!("rank {rank}: summing the global batch's target count"))?;
    let (targets, tokens) = (counts[0] as i64, counts[1] as i64);
    let mut stats = stepper
        .step_with_global_targets(samples, targets)
        .with_context(|| format!("rank {rank}: training step"))?;
    let loss = stepper
        .engine
        .store_mut()
        .all_reduce_sum(&[stats.loss])
        .with_context(|| format!("rank {rank}: summing the loss over ranks"))?;
    stats.loss = loss[0];
    stats.tokens = tokens;
    stats.targets = targets;
    Ok(stats)
}
