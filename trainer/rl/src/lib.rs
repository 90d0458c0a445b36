//! ferl's RL crate. verl's `core_algos` as pure tensor functions: advantages ([`advantage`]: GRPO, RLOO), the PPO clipped policy
//! loss, KL penalties and entropy ([`policy`]), and the loss aggregation every loss shares ([`agg_loss`]); the actor's
//! loss as a loss of the engine ([`token_loss`]: [`ActorTokenLoss`] over a micro-batch's response tokens).
//!
//! Built from them: the step's batch ([`batch`]: [`RlBatch`]), rewards ([`reward`]), the actor worker over the
//! engine ([`policy_worker`]: `compute_log_prob`, `update_policy`, each rank's [`DataShare`]), the roles a step
//! asks for ([`roles`]: [`PolicyRole`], [`ReferencePolicy`], [`RolloutRole`]), and one GRPO/RLOO step written
//! against them ([`grpo_step`]: [`GrpoStep`]) that one process ([`GrpoTrainer`]), every trainer rank
//! (`ferl_actors::rl::GrpoAlgorithm`) and the actor driver (`ferl_actors::rl::GrpoDriver`) run.
//!
//! Shapes follow verl: per-token tensors are `[batch, response_length]` and `response_mask` marks the response
//! tokens (any dtype; non-zero = counted). Each function is checked against a PyTorch implementation of verl's
//! formulas on fixed inputs (`trainer/rl/tests/rl_core_algos.rs`, `trainer/py/rl_reference.py`).
//!
//! Invariants:
//! 1. No function mutates its inputs or holds state; gradients flow where verl's do (the policy loss, KL and
//!    entropy terms) and advantages are computed without gradient.
//! 2. Masked positions never contribute, even when they hold NaN or infinity (verl's `masked_sum`).
//! 3. A wrong shape or an unknown mode is an error naming the argument or the key and its valid values.

pub mod advantage;
pub mod batch;
pub mod digits;
pub mod grpo;
pub mod grpo_step;
pub mod micro;
pub mod policy;
pub mod policy_worker;
pub mod reward;
pub mod roles;
pub mod state;
pub mod token_loss;

use anyhow::{bail, Result};
use tch::Tensor;

pub use advantage::{check_outcome_estimator, outcome_advantage, OUTCOME_ESTIMATORS};
pub use advantage::{grpo_outcome_advantage, rloo_outcome_advantage};
pub use batch::{RlBatch, RlRow};
/// The config crate's value types of verl's algorithm keys, used here as they are (defined once, in
/// [`ferl_trainer::config::ppo`]).
pub use ferl_trainer::config::ppo::{AdvEstimator, KlPenalty, LossAggMode};
pub use grpo::{derive_seed, GrpoPrompt, GrpoSettings, GrpoStepOutput, GrpoTrainer};
pub use grpo_step::{GrpoStep, Reference};
pub use micro::MicroBatching;
pub use policy::{
    actor_loss, compute_policy_loss, entropy_from_logits, kl_penalty, ActorLoss, ActorLossConfig,
    ActorLossInputs, ClipConfig, PolicyLoss, KL_PENALTIES,
};
pub use policy_worker::{
    compute_log_prob, compute_log_prob_rows, sum_tensor_over_ranks, ActorUpdateConfig, DataShare,
    Placement, PolicyWorker, StepperPolicy, SumOverRanks,
};
pub use reward::{score_batch, score_rows, FnReward, Reward, RewardRow};
pub use roles::{Colocated, PolicyRole, ReferencePolicy, RolloutRole};
pub use token_loss::{ActorLossMetrics, ActorRows, ActorTokenLoss};

/// `values` summed where `mask` is non-zero (masked positions count as 0 even when NaN), over all dimensions or
/// along `dim`.
pub fn masked_sum(values: &Tensor, mask: &Tensor, dim: Option<i64>) -> Tensor {
    let mask = mask.to_kind(values.kind());
    let valid = values.where_self(&mask.ne(0.0), &values.zeros_like());
    let product = valid * mask;
    match dim {
        Some(d) => product.sum_dim_intlist([d].as_slice(), false, values.kind()),
        None => product.sum(values.kind()),
    }
}

/// verl's `masked_mean`: [`masked_sum`] over `mask.sum() + 1e-8`.
pub fn masked_mean(values: &Tensor, mask: &Tensor, dim: Option<i64>) -> Tensor {
    let count = match dim {
        Some(d) => {
            mask.to_kind(values.kind())
                .sum_dim_intlist([d].as_slice(), false, values.kind())
        }
        None => mask.to_kind(values.kind()).sum(values.kind()),
    };
    masked_sum(values, mask, dim) / (count + 1e-8)
}

/// The `loss_agg_mode`s [`agg_loss`] computes (verl's `seq-mean-token-sum-norm` is refused).
pub const AGG_MODES: [LossAggMode; 3] = [
    LossAggMode::TokenMean,
    LossAggMode::SeqMeanTokenSum,
    LossAggMode::SeqMeanTokenMean,
];

/// The global batch a micro-batch belongs to, so that losses summed over micro-batches and data-parallel ranks equal
/// the loss of the whole batch (verl's `global_batch_info`). The default treats the micro-batch as the whole batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GlobalBatch {
    /// Data-parallel ranks whose gradients are averaged (the loss is scaled by it to undo the average).
    pub dp_size: i64,
    /// Response tokens in the global batch (`token-mean`); `None`: this micro-batch's.
    pub batch_num_tokens: Option<f64>,
    /// Sequences with at least one response token in the global batch (`seq-mean-*`); `None`: this micro-batch's.
    pub global_batch_size: Option<f64>,
}

impl Default for GlobalBatch {
    fn default() -> Self {
        Self {
            dp_size: 1,
            batch_num_tokens: None,
            global_batch_size: None,
        }
    }
}

/// verl's `agg_loss`: `loss_mat` `[batch, tokens]` aggregated over the positions of `loss_mask` by `mode`,
/// normalised by the global batch `global` (fully masked sequences are not counted as sequences).
pub fn agg_loss(
    loss_mat: &Tensor,
    loss_mask: &Tensor,
    mode: LossAggMode,
    global: GlobalBatch,
) -> Result<Tensor> {
    same_shape(("loss_mat", loss_mat), ("loss_mask", loss_mask))?;
    if !AGG_MODES.contains(&mode) {
        bail!(
            "loss_agg_mode `{mode}` is not supported by ferl; use one of {}",
            AGG_MODES.map(LossAggMode::as_str).join(", ")
        );
    }
    if global.dp_size > 1
        && (mode == LossAggMode::TokenMean && global.batch_num_tokens.is_none()
            || mode != LossAggMode::TokenMean && global.global_batch_size.is_none())
    {
        bail!(
            "agg_loss `{}` with dp_size {} needs the global batch's {}",
            mode.as_str(),
            global.dp_size,
            if mode == LossAggMode::TokenMean {
                "batch_num_tokens"
            } else {
                "global_batch_size"
            }
        );
    }
    let kind = loss_mat.kind();
    let mask = loss_mask.to_kind(kind);
    let dp = global.dp_size as f64;
    let loss = match mode {
        LossAggMode::TokenMean => {
            let sum = masked_sum(loss_mat, &mask, None);
            match global.batch_num_tokens {
                Some(n) => sum / n * dp,
                None => sum / mask.sum(kind) * dp,
            }
        }
        LossAggMode::SeqMeanTokenSumNorm => unreachable!("refused above: not one of AGG_MODES"),
        LossAggMode::SeqMeanTokenSum | LossAggMode::SeqMeanTokenMean => {
            let tokens = mask.sum_dim_intlist([-1i64].as_slice(), false, kind);
            let seq = masked_sum(loss_mat, &mask, Some(-1));
            let seq = if mode == LossAggMode::SeqMeanTokenMean {
                seq / (&tokens + 1e-8)
            } else {
                seq
            };
            let seq_mask = tokens.gt(0.0).to_kind(kind);
            let sum = masked_sum(&seq, &seq_mask, None);
            match global.global_batch_size {
                Some(n) => sum / n * dp,
                None => sum / seq_mask.sum(kind) * dp,
            }
        }
    };
    Ok(loss)
}

/// `Ok` when `a` and `b` have the same shape, else an error naming both.
pub(crate) fn same_shape(a: (&str, &Tensor), b: (&str, &Tensor)) -> Result<()> {
    if a.1.size() != b.1.size() {
        bail!(
            "{} is {:?} but {} is {:?}",
            a.0,
            a.1.size(),
            b.0,
            b.1.size()
        );
    }
    Ok(())
}

/// `Ok` when `t` is two-dimensional (`[batch, tokens]`), else an error naming it.
pub(crate) fn matrix(name: &str, t: &Tensor) -> Result<(i64, i64)> {
    match t.size().as_slice() {
        [b, n] => Ok((*b, *n)),
        other => bail!("{name} must be [batch, response_length], not {other:?}"),
    }
}
