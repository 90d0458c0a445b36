//! Rewards: one score per response ([`Reward`]), given the prompt, the response and the ground truth, as text (when
//! the caller decodes with a tokenizer) and as token ids. A reward plugin plugs in through an adapter implementing
//! the trait; tests and synthetic tasks implement it directly or with [`FnReward`].

use super::batch::RlBatch;
use anyhow::{bail, Result};

/// What a reward sees of one row.
#[derive(Clone, Copy, Debug)]
pub struct RewardRow<'a> {
    /// The prompt as text (empty without a tokenizer).
    pub prompt: &'a str,
    /// The response as text (empty without a tokenizer).
    pub response: &'a str,
    /// The row's ground truth.
    pub ground_truth: &'a str,
    /// The prompt's token ids.
    pub prompt_ids: &'a [i64],
    /// The response's token ids.
    pub response_ids: &'a [i64],
    /// Anything else the dataset gave the row (verl's `extra_info`).
    pub extra: &'a serde_json::Value,
}

/// Scores responses (verl's reward function / reward manager). Sendable, so that a trainer-rank actor can hold it.
pub trait Reward: Send {
    /// The reward's name (for logs).
    fn name(&self) -> String;
    /// One finite score per row, in order.
    fn score(&mut self, rows: &[RewardRow<'_>]) -> Result<Vec<f64>>;
}

/// A reward given by a function of one row.
pub struct FnReward<F> {
    name: String,
    f: F,
}

impl<F: FnMut(&RewardRow<'_>) -> f64> FnReward<F> {
    /// The reward `f` named `name`.
    pub fn new(name: impl Into<String>, f: F) -> Self {
        Self {
            name: name.into(),
            f,
        }
    }
}

impl<F: FnMut(&RewardRow<'_>) -> f64 + Send> Reward for FnReward<F> {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn score(&mut self, rows: &[RewardRow<'_>]) -> Result<Vec<f64>> {
        Ok(rows.iter().map(&mut self.f).collect())
    }
}

/// Scores every row of `batch` with `reward`; refuses a wrong count or a non-finite score, naming the reward.
pub fn score_batch(reward: &mut dyn Reward, batch: &RlBatch) -> Result<Vec<f64>> {
    score_rows(reward, batch, 0..batch.len())
}

/// [`score_batch`] of the rows `rows` of `batch` only (a rank's share), a non-finite score named by its row in the
/// whole batch.
pub fn score_rows(
    reward: &mut dyn Reward,
    batch: &RlBatch,
    rows: std::ops::Range<usize>,
) -> Result<Vec<f64>> {
    let first = rows.start;
    let rows: Vec<RewardRow<'_>> = batch.rows[rows]
        .iter()
        .map(|r| RewardRow {
            prompt: &r.prompt_text,
            response: &r.response_text,
            ground_truth: &r.ground_truth,
            prompt_ids: &r.prompt,
            response_ids: &r.response,
            extra: &r.extra,
        })
        .collect();
    let scores = reward.score(&rows)?;
    if scores.len() != rows.len() {
        bail!(
            "reward `{}` returned {} scores for {} rows",
            reward.name(),
            scores.len(),
            rows.len()
        );
    }
    if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
        bail!(
            "reward `{}` gave row {} the non-finite score {}",
            reward.name(),
            first + i,
            scores[i]
        );
    }
    Ok(scores)
}
