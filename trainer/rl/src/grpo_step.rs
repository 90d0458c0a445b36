//! One GRPO (or RLOO) step, written once against the [`PolicyRole`]: the one-process [`super::GrpoTrainer`] and
//! every rank of a sharded run (`ferl grpo` on any launch path) run this code. With `W` data-parallel ranks each
//! rank takes the contiguous share `W` divides evenly of the step's `prompts × n` rows:
//!
//! 1. `update_weights` + `gen`: the [`RolloutRole`] generates the rank's rows — colocated, from the policy's weights
//!    gathered into a rollout model (the whole model beside this rank's shard until generation ends); on a separate
//!    pool, by rollout actors synced after each update. Row `i` samples from its own
//!    stream ([`ferl_trainer::rollout::GenerationConfig::first_row`]) of `derive_seed(seed, step, 0)`, so its tokens do not
//!    depend on the rank or the number of ranks. One sum over the ranks gives every rank every response.
//! 2. `reward`: each rank scores its rows; one sum gives every rank every score.
//! 3. `old_log_prob`, `ref`: each rank computes its rows' log-probabilities; sums give every rank the matrices.
//! 4. `adv`: every rank computes the same advantages over the whole batch.
//! 5. `update_actor`: each rank takes its share of every mini-batch, normalised by the whole mini-batch; the store
//!    sums the gradients over the ranks ([`super::PolicyWorker::update_policy`]).
//!
//! So a step at any world size computes what one process computes on the whole batch (up to the order of float
//! sums), and the metrics are the same on every rank.
//!
//! Under Ulysses sequence parallelism the `W` ranks form data-parallel groups of `K`: steps 1–2 spread over all `W`
//! ranks ([`PolicyRole::generation_share`]), steps 3 and 5 take each group's data-parallel share, every rank of the
//! group computing its slice of each sequence's tokens (the sums then add the slices up).

use super::batch::{RlBatch, RlRow};
use super::grpo::{data_metrics, derive_seed, timed, Decoder, GrpoPrompt, GrpoSettings};
use super::policy_worker::Placement;
use super::reward::{score_rows, Reward};
use super::roles::{PolicyRole, ReferencePolicy, RolloutRole};
use super::{agg_loss, outcome_advantage, sum_tensor_over_ranks, GlobalBatch, GrpoStepOutput};
use anyhow::{bail, Result};
use ferl_trainer::rollout::GenerationConfig;
use std::collections::BTreeMap;
use std::ops::Range;
use std::time::Instant;
use tch::Tensor;

/// The reference policy of the KL loss.
pub enum Reference {
    /// A frozen model of its own (the initial weights).
    Frozen(Box<dyn ReferencePolicy>),
    /// The policy's base model with its LoRA adapters off, as verl's reference of a LoRA actor: no second copy
    /// ([`PolicyRole::base_log_prob`]).
    PolicyBase,
}

/// Everything of a GRPO step but the policy: settings, the reference (with `use_kl_loss`), the reward and the
/// decoder, and the steps completed.
pub struct GrpoStep {
    /// The run's settings.
    pub settings: GrpoSettings,
    /// The reference policy when `use_kl_loss` asks for one.
    reference: Option<Reference>,
    reward: Box<dyn Reward>,
    decoder: Option<Decoder>,
    /// Steps completed (the next step's 0-based index).
    pub completed: u64,
}

impl GrpoStep {
    /// A step scoring with `reward`, with the frozen `reference` for the KL loss (required when `use_kl_loss` is
    /// set).
    pub fn new(
        settings: GrpoSettings,
        reference: Option<Box<dyn ReferencePolicy>>,
        reward: Box<dyn Reward>,
    ) -> Result<Self> {
        Self::with_reference(settings, reference.map(Reference::Frozen), reward)
    }

    /// [`Self::new`] with any [`Reference`].
    pub fn with_reference(
        settings: GrpoSettings,
        reference: Option<Reference>,
        reward: Box<dyn Reward>,
    ) -> Result<Self> {
        settings.validate()?;
        if settings.loss.use_kl_loss && reference.is_none() {
            bail!("use_kl_loss needs a reference policy");
        }
        Ok(Self {
            settings,
            reference,
            reward,
            decoder: None,
            completed: 0,
        })
    }

    /// Decodes responses for the reward with `decoder` (without one the reward sees empty response texts).
    pub fn set_decoder(&mut self, decoder: Decoder) {
        self.decoder = Some(decoder);
    }

    /// `ids` as text, as the reward sees responses (special tokens skipped); empty without a decoder.
    pub fn decode(&self, ids: &[i64]) -> String {
        self.decoder.as_ref().map(|d| d(ids)).unwrap_or_default()
    }

    /// One step over `prompts` with `policy`, generating with `rollout` (see the module docs); every data-parallel
    /// rank calls it alike.
    pub fn run(
        &mut self,
        policy: &mut dyn PolicyRole,
        rollout: &mut dyn RolloutRole,
        prompts: &[GrpoPrompt],
    ) -> Result<GrpoStepOutput> {
        if prompts.is_empty() {
            bail!("a GRPO step needs at least one prompt");
        }
        let started = Instant::now();
        let (s, step) = (self.settings.clone(), self.completed);
        let rows = self.my_rows(policy, prompts.len())?;
        let temperature = s.log_prob_temperature();
        let mut timing = BTreeMap::new();
        let config = self.generation(step, rows.start as u64);
        let expanded: Vec<Vec<i64>> = rows.clone().map(|i| prompts[i / s.n].ids.clone()).collect();
        let mine = rollout.generate(policy, &expanded, &config)?;
        let responses = exchange_responses(policy, &rows, mine, prompts.len() * s.n, &s)?;
        let mut batch = self.batch(prompts, responses);
        let rewards = timed(&mut timing, "reward", || {
            let scores = score_rows(self.reward.as_mut(), &batch, rows.clone())?;
            place_and_sum(policy, &rows, &scores, batch.len())
        })?;
        batch.rewards = Some(rewards);
        let mask = batch.response_mask(policy.device());
        let (old, entropy) = timed(&mut timing, "old_log_prob", || {
            policy.compute_log_prob(&batch, s.log_prob_micro_batching, temperature, true)
        })?;
        batch.old_log_probs = Some(old);
        if self.reference.is_some() {
            let r = timed(&mut timing, "ref", || {
                self.reference_log_prob(policy, &batch)
            })?;
            batch.ref_log_probs = Some(r);
        }
        let adv = timed(&mut timing, "adv", || self.advantages(&batch, &mask))?;
        batch.advantages = Some(adv);
        let cfg = s.update_config(step);
        let actor_metrics = timed(&mut timing, "update_actor", || {
            policy.update_policy(&batch, &cfg)
        })?;
        rollout.after_update(policy)?;
        self.completed += 1;
        let mut metrics = data_metrics(&batch, &mask, s.max_response_length)?;
        if let Some(h) = entropy {
            let e = agg_loss(&h, &mask, s.loss.loss_agg_mode, GlobalBatch::default())?;
            metrics.insert("actor/entropy".into(), e.double_value(&[]));
        }
        metrics.extend(actor_metrics);
        metrics.extend(timing);
        metrics.extend(rollout.take_metrics());
        metrics.insert("timing_s/step".into(), started.elapsed().as_secs_f64());
        Ok(GrpoStepOutput {
            step: self.completed,
            metrics,
            batch,
        })
    }

    /// This rank's rows of a step of `prompts` prompts (refused when the ranks cannot share them evenly).
    fn my_rows(&self, policy: &dyn PolicyRole, prompts: usize) -> Result<Range<usize>> {
        let (total, share) = (prompts * self.settings.n, policy.generation_share());
        if !total.is_multiple_of(share.world) {
            bail!(
                "{prompts} prompts × rollout.n={} = {total} rows cannot be split evenly over {} data-parallel ranks",
                self.settings.n,
                share.world
            );
        }
        let per = total / share.world;
        Ok(share.rank * per..(share.rank + 1) * per)
    }

    /// Step `step`'s generation of rows from `first_row` on.
    fn generation(&self, step: u64, first_row: u64) -> GenerationConfig {
        let s = &self.settings;
        GenerationConfig {
            max_response_length: s.max_response_length,
            sampling: s.sampling(derive_seed(s.seed, step, 0)),
            eos_token_ids: s.eos_token_ids.clone(),
            pad_token_id: s.pad_token_id,
            first_row,
        }
    }

    /// The step's rows: `n` responses per prompt in order, the `n` of a prompt sharing its group id, decoded.
    fn batch(&self, prompts: &[GrpoPrompt], responses: Vec<Vec<i64>>) -> RlBatch {
        let n = self.settings.n;
        let rows = responses
            .into_iter()
            .enumerate()
            .map(|(i, response)| {
                let p = &prompts[i / n];
                RlRow {
                    prompt: p.ids.clone(),
                    response_text: self
                        .decoder
                        .as_ref()
                        .map(|d| d(&response))
                        .unwrap_or_default(),
                    response,
                    uid: (i / n) as u64,
                    prompt_text: p.text.clone(),
                    ground_truth: p.ground_truth.clone(),
                    extra: p.extra.clone(),
                }
            })
            .collect();
        RlBatch::new(rows)
    }

    /// The reference's log-probabilities of every row: this rank computes its share, a sum fills in the others.
    fn reference_log_prob(
        &mut self,
        policy: &mut dyn PolicyRole,
        batch: &RlBatch,
    ) -> Result<Tensor> {
        let s = &self.settings;
        let (micro, temperature) = (s.ref_log_prob_micro_batching, s.log_prob_temperature());
        let lp = match self.reference.as_mut() {
            None => bail!("no reference policy"),
            // Already summed over the ranks.
            Some(Reference::PolicyBase) => return policy.base_log_prob(batch, micro, temperature),
            Some(Reference::Frozen(r)) => {
                let sp = policy.sequence_parallel();
                let on = Placement {
                    share: policy.share(),
                    sp: sp.as_ref(),
                };
                r.log_prob_rows(batch, on, micro, temperature, policy.device())?
            }
        };
        if policy.generation_share().world == 1 {
            return Ok(lp);
        }
        sum_tensor_over_ranks(&mut |v| policy.sum_over_ranks(v), &lp)
    }

    /// The outcome advantages of `batch` (`[rows, width]`).
    fn advantages(&self, batch: &RlBatch, mask: &Tensor) -> Result<Tensor> {
        let rewards = batch.token_level_rewards(mask.device())?;
        let s = &self.settings;
        outcome_advantage(
            s.adv_estimator,
            &rewards,
            mask,
            &batch.uids(),
            s.norm_adv_by_std_in_grpo,
        )
    }
}

/// Every rank's responses from each rank's `mine` (rows `rows` of `total`): one sum over the ranks of a
/// `total × (1 + max_response_length)` table of lengths and token ids (exact in f64).
fn exchange_responses(
    policy: &mut dyn PolicyRole,
    rows: &Range<usize>,
    mine: Vec<Vec<i64>>,
    total: usize,
    s: &GrpoSettings,
) -> Result<Vec<Vec<i64>>> {
    if policy.generation_share().world == 1 {
        return Ok(mine);
    }
    let width = 1 + s.max_response_length;
    let mut table = vec![0.0; total * width];
    for (i, r) in rows.clone().zip(&mine) {
        table[i * width] = r.len() as f64;
        for (j, &t) in r.iter().enumerate() {
            table[i * width + 1 + j] = t as f64;
        }
    }
    let table = policy.sum_over_ranks(&table)?;
    Ok(table
        .chunks(width)
        .map(|row| {
            let len = row[0] as usize;
            row[1..1 + len].iter().map(|&t| t as i64).collect()
        })
        .collect())
}

/// A vector of `total` values holding `mine` at `rows`, summed over the ranks.
fn place_and_sum(
    policy: &mut dyn PolicyRole,
    rows: &Range<usize>,
    mine: &[f64],
    total: usize,
) -> Result<Vec<f64>> {
    if policy.generation_share().world == 1 {
        return Ok(mine.to_vec());
    }
    let mut all = vec![0.0; total];
    all[rows.clone()].copy_from_slice(mine);
    policy.sum_over_ranks(&all)
}
