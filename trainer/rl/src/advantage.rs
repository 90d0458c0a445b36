//! Outcome advantages (`algorithm.adv_estimator`): one score per response (the sum of its token-level rewards),
//! compared within its group (the responses to the same prompt, grouped by `uid`), spread over the response's
//! tokens. As verl, both return the advantages, which are also the returns.

use super::{matrix, same_shape, AdvEstimator};
use anyhow::{bail, Result};
use std::collections::HashMap;
use std::hash::Hash;
use tch::Tensor;

/// Rows of each group, in order of first appearance.
fn groups<K: Hash + Eq>(index: &[K]) -> Vec<Vec<i64>> {
    let mut slot: HashMap<&K, usize> = HashMap::new();
    let mut rows: Vec<Vec<i64>> = Vec::new();
    for (i, k) in index.iter().enumerate() {
        let g = *slot.entry(k).or_insert_with(|| {
            rows.push(Vec::new());
            rows.len() - 1
        });
        rows[g].push(i as i64);
    }
    rows
}

/// The per-row scores (`token_level_rewards` summed over tokens) after checking the shapes and the index.
fn scores<K>(token_level_rewards: &Tensor, response_mask: &Tensor, index: &[K]) -> Result<Tensor> {
    let (batch, _) = matrix("token_level_rewards", token_level_rewards)?;
    same_shape(
        ("token_level_rewards", token_level_rewards),
        ("response_mask", response_mask),
    )?;
    if index.len() as i64 != batch {
        bail!("index has {} uids for {batch} rows", index.len());
    }
    let kind = token_level_rewards.kind();
    Ok(token_level_rewards
        .detach()
        .sum_dim_intlist([-1i64].as_slice(), false, kind))
}

/// Per row, a statistic of its group: `stat(group scores)` for groups of more than one row, `single` otherwise.
fn per_row(
    scores: &Tensor,
    groups: &[Vec<i64>],
    single: f64,
    stat: impl Fn(&Tensor) -> Tensor,
) -> Tensor {
    let out = scores.zeros_like();
    for rows in groups {
        let idx = Tensor::from_slice(rows).to_device(scores.device());
        let value = if rows.len() == 1 {
            single
        } else {
            stat(&scores.index_select(0, &idx)).double_value(&[])
        };
        let _ = out.shallow_clone().index_fill_(0, &idx, value);
    }
    out
}

/// `scores` `[batch]` spread over the response tokens: `scores[:, None] * response_mask`.
fn spread(scores: &Tensor, response_mask: &Tensor) -> Tensor {
    scores.unsqueeze(-1) * response_mask.to_kind(scores.kind())
}

/// GRPO (`adv_estimator=grpo`): each score minus its group's mean, divided by the group's standard deviation
/// (unbiased) plus `epsilon` when `norm_adv_by_std_in_grpo` (as in the GRPO paper; without it, Dr. GRPO). A group
/// of one response has mean 0 and standard deviation 1. `index` holds each row's group id (verl's `uid`).
pub fn grpo_outcome_advantage<K: Hash + Eq>(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &[K],
    epsilon: f64,
    norm_adv_by_std_in_grpo: bool,
) -> Result<Tensor> {
    let _no_grad = tch::no_grad_guard();
    let scores = scores(token_level_rewards, response_mask, index)?;
    let groups = groups(index);
    let mean = per_row(&scores, &groups, 0.0, |g| g.mean(g.kind()));
    let centred = &scores - mean;
    let adv = if norm_adv_by_std_in_grpo {
        let std = per_row(&scores, &groups, 1.0, |g| g.std(true));
        centred / (std + epsilon)
    } else {
        centred
    };
    Ok(spread(&adv, response_mask))
}

/// RLOO (`adv_estimator=rloo`): each score minus the mean of the other responses of its group, written as verl
/// does, `score * n / (n - 1) - mean * n / (n - 1)` for a group of `n > 1`; a group of one keeps its score.
pub fn rloo_outcome_advantage<K: Hash + Eq>(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &[K],
) -> Result<Tensor> {
    let _no_grad = tch::no_grad_guard();
    let scores = scores(token_level_rewards, response_mask, index)?;
    let groups = groups(index);
    let mean = per_row(&scores, &groups, 0.0, |g| g.mean(g.kind()));
    let n = per_row(&scores, &groups, 1.0, |g| Tensor::from(g.size()[0] as f64));
    let loo = &scores * &n / (&n - 1.0) - &mean * &n / (&n - 1.0);
    let adv = loo.where_self(&n.gt(1.0), &scores);
    Ok(spread(&adv, response_mask))
}

/// The `algorithm.adv_estimator`s [`outcome_advantage`] computes: the critic-free outcome estimators.
pub const OUTCOME_ESTIMATORS: [AdvEstimator; 2] = [AdvEstimator::Grpo, AdvEstimator::Rloo];

/// Refuses an estimator outside [`OUTCOME_ESTIMATORS`], naming the key and the ones ferl runs.
pub fn check_outcome_estimator(estimator: AdvEstimator) -> Result<()> {
    if !OUTCOME_ESTIMATORS.contains(&estimator) {
        bail!(
            "algorithm.adv_estimator={estimator} is not a critic-free outcome estimator ferl runs; use one of {}",
            OUTCOME_ESTIMATORS.map(AdvEstimator::as_str).join(", ")
        );
    }
    Ok(())
}

/// The outcome advantages of `estimator` ([`grpo_outcome_advantage`] with verl's `epsilon` 1e-6, or
/// [`rloo_outcome_advantage`]); any other estimator is refused by [`check_outcome_estimator`].
pub fn outcome_advantage<K: Hash + Eq>(
    estimator: AdvEstimator,
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &[K],
    norm_adv_by_std_in_grpo: bool,
) -> Result<Tensor> {
    check_outcome_estimator(estimator)?;
    match estimator {
        AdvEstimator::Rloo => rloo_outcome_advantage(token_level_rewards, response_mask, index),
        _ => grpo_outcome_advantage(
            token_level_rewards,
            response_mask,
            index,
            1e-6,
            norm_adv_by_std_in_grpo,
        ),
    }
}
