//! The actor as verl's FSDP worker runs it, over the layer-wise [`Engine`]: [`compute_log_prob`] (the old policy's
//! and, on a second frozen engine, the reference policy's log-probabilities of the responses; no gradients) and
//! [`PolicyWorker::update_policy`] (verl's `update_policy`: `ppo_epochs` passes over the batch in mini-batches of
//! `ppo_mini_batch_size × n` rows, each mini-batch one optimizer step over its micro-batches).
//!
//! Each micro-batch's [`ActorTokenLoss`] is normalised by its mini-batch ([`GlobalBatch`]: the mini-batch's response
//! tokens for `token-mean`, its sequences for the `seq-mean-*` modes), so the summed micro-batch gradients are the
//! gradient of the mini-batch's loss whatever the micro-batch size.
//!
//! # Metrics (verl's names, averaged over the update's optimizer steps)
//! - `actor/pg_loss`, `actor/entropy` (with `entropy_coeff != 0`), `actor/kl_loss` (with `use_kl_loss`): the
//!   mini-batch's value, the sum of its micro-batches' globally normalised shares.
//! - `actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`: the mini-batch's token mean (micro-batches
//!   weighted by their response tokens).
//! - `actor/grad_norm` (before clipping), `actor/lr` (of the last step).

use super::batch::RlBatch;
use super::{ActorLossConfig, ActorRows, ActorTokenLoss, GlobalBatch};
use crate::engine::Engine;
use crate::optim::{clip_grads, AdamW, AdamWConfig, LrSchedule};
use crate::params::ParamStore;
use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use tch::{Device, Kind, Tensor};

/// verl's actor update keys (`actor_rollout_ref.actor`) for one [`PolicyWorker::update_policy`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActorUpdateConfig {
    /// The loss keys (clip ratios, `loss_agg_mode`, entropy and KL terms).
    pub loss: ActorLossConfig,
    /// `ppo_mini_batch_size`: prompts per optimizer step (a mini-batch holds `ppo_mini_batch_size × rollout_n` rows).
    pub ppo_mini_batch_size: usize,
    /// `rollout.n`: responses per prompt.
    pub rollout_n: usize,
    /// `ppo_micro_batch_size_per_gpu`: rows per forward/backward.
    pub ppo_micro_batch_size: usize,
    /// `ppo_epochs`: passes over the batch.
    pub ppo_epochs: usize,
    /// `shuffle`: permute the rows before each epoch's split, seeded by `shuffle_seed` and the epoch.
    pub shuffle: bool,
    /// Seed of the shuffles (derive it from the run's seed and step for a resumable run).
    pub shuffle_seed: u64,
    /// `grad_clip`: the gradients' global norm is clipped to it (0: no clipping).
    pub grad_clip: f64,
    /// The rollout temperature `T` of `log_softmax(logits / T)`.
    pub temperature: f64,
}

/// The actor: an engine over its parameters, AdamW and a learning-rate schedule.
pub struct PolicyWorker<P: ParamStore> {
    engine: Engine<P>,
    optimizer: AdamW,
    schedule: LrSchedule,
    completed_steps: i64,
    device: Device,
}

/// Log-probabilities (and with `entropy` the entropies) of `batch`'s response tokens under `engine` at temperature
/// `temperature`, as `[rows, width]` fp32 matrices with zeros past each response, computed `micro_batch_size` rows
/// at a time without gradients on `device` (verl's `compute_log_prob`; the reference policy's too). Leaves the
/// engine at that temperature.
pub fn compute_log_prob<P: ParamStore>(
    engine: &mut Engine<P>,
    batch: &RlBatch,
    micro_batch_size: usize,
    temperature: f64,
    entropy: bool,
    device: Device,
) -> Result<(Tensor, Option<Tensor>)> {
    if micro_batch_size == 0 {
        bail!("compute_log_prob: micro_batch_size must be positive");
    }
    engine.set_temperature(temperature)?;
    let _g = tch::no_grad_guard();
    let mut log_probs = batch.zeros(Kind::Float, device);
    let mut entropies = entropy.then(|| batch.zeros(Kind::Float, device));
    let all: Vec<usize> = (0..batch.len()).collect();
    for rows in all.chunks(micro_batch_size) {
        let mb = batch.micro_batch(rows, device)?;
        let stats = engine.token_stats(&mb, entropy)?;
        batch.scatter_tokens(&mut log_probs, rows, &stats.log_prob);
        if let (Some(m), Some(h)) = (entropies.as_mut(), stats.entropy.as_ref()) {
            batch.scatter_tokens(m, rows, h);
        }
    }
    Ok((log_probs, entropies))
}

/// Sums of one mini-batch's micro-batch figures.
#[derive(Default)]
struct MiniBatchSums {
    pg_loss: f64,
    entropy: Option<f64>,
    kl_loss: Option<f64>,
    /// Token-weighted sums of the fractions, and the tokens.
    clipfrac: f64,
    ppo_kl: f64,
    clipfrac_lower: f64,
    tokens: f64,
}

/// Per metric name: the sum of its values and their count.
#[derive(Default)]
struct Averages(BTreeMap<&'static str, (f64, usize)>);

impl Averages {
    fn add(&mut self, key: &'static str, value: f64) {
        let e = self.0.entry(key).or_insert((0.0, 0));
        e.0 += value;
        e.1 += 1;
    }

    fn means(self) -> BTreeMap<String, f64> {
        self.0
            .into_iter()
            .map(|(k, (sum, n))| (k.to_string(), sum / n.max(1) as f64))
            .collect()
    }
}

impl<P: ParamStore> PolicyWorker<P> {
    /// A worker training `engine`'s parameters with AdamW (`optim`) at the learning rates of `schedule`, its
    /// micro-batches on `device`.
    pub fn new(
        mut engine: Engine<P>,
        optim: AdamWConfig,
        schedule: LrSchedule,
        device: Device,
    ) -> Self {
        let optimizer = AdamW::new(optim, engine.store_mut().master_and_grads().0);
        Self {
            engine,
            optimizer,
            schedule,
            completed_steps: 0,
            device,
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<P> {
        &self.engine
    }

    /// The engine, mutably (its store for checkpoints and weight syncs).
    pub fn engine_mut(&mut self) -> &mut Engine<P> {
        &mut self.engine
    }

    /// The optimizer state.
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }

    /// The optimizer state, mutably (checkpoint restore).
    pub fn optimizer_mut(&mut self) -> &mut AdamW {
        &mut self.optimizer
    }

    /// Optimizer steps taken (skipped ones included): the schedule's position.
    pub fn completed_steps(&self) -> i64 {
        self.completed_steps
    }

    /// Sets the schedule's position (checkpoint restore).
    pub fn set_completed_steps(&mut self, steps: i64) {
        self.completed_steps = steps;
    }

    /// Where micro-batches are built.
    pub fn device(&self) -> Device {
        self.device
    }

    /// [`compute_log_prob`] under the current policy: `[rows, width]` log-probabilities and entropies.
    pub fn compute_log_prob(
        &mut self,
        batch: &RlBatch,
        micro_batch_size: usize,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let device = self.device;
        compute_log_prob(
            &mut self.engine,
            batch,
            micro_batch_size,
            temperature,
            entropy,
            device,
        )
    }

    /// verl's `update_policy` over `batch` (it must hold old log-probabilities and advantages, and reference
    /// log-probabilities with `use_kl_loss`); returns the `actor/*` metrics (see the module docs).
    pub fn update_policy(
        &mut self,
        batch: &RlBatch,
        cfg: &ActorUpdateConfig,
    ) -> Result<BTreeMap<String, f64>> {
        let rows_per_mini = cfg.ppo_mini_batch_size * cfg.rollout_n;
        if rows_per_mini == 0 || cfg.ppo_micro_batch_size == 0 || cfg.ppo_epochs == 0 {
            bail!(
                "update_policy: ppo_mini_batch_size ({}) × n ({}), ppo_micro_batch_size ({}) and ppo_epochs ({}) must be positive",
                cfg.ppo_mini_batch_size, cfg.rollout_n, cfg.ppo_micro_batch_size, cfg.ppo_epochs
            );
        }
        if batch.old_log_probs.is_none() || batch.advantages.is_none() {
            bail!("update_policy: the batch needs old log-probabilities and advantages");
        }
        if cfg.loss.use_kl_loss && batch.ref_log_probs.is_none() {
            bail!("update_policy: use_kl_loss is set but the batch has no reference log-probabilities");
        }
        self.engine.set_temperature(cfg.temperature)?;
        let mut metrics = Averages::default();
        let mut lr = self.schedule.lr_at(self.completed_steps);
        for epoch in 0..cfg.ppo_epochs {
            let mut order: Vec<usize> = (0..batch.len()).collect();
            if cfg.shuffle {
                let seed = cfg.shuffle_seed.wrapping_add(epoch as u64);
                order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
            }
            for mini in order.chunks(rows_per_mini) {
                let sums = self.mini_batch_grads(batch, mini, cfg)?;
                let (grad_norm, step_lr) = self.optimizer_step(cfg.grad_clip)?;
                lr = step_lr;
                record(&mut metrics, &sums, grad_norm);
            }
        }
        let mut out = metrics.means();
        out.insert("actor/lr".into(), lr);
        Ok(out)
    }

    /// Zeroes the gradients and accumulates those of mini-batch `rows`, micro-batch by micro-batch.
    fn mini_batch_grads(
        &mut self,
        batch: &RlBatch,
        rows: &[usize],
        cfg: &ActorUpdateConfig,
    ) -> Result<MiniBatchSums> {
        let tokens = batch.tokens_per_row(rows);
        let global = GlobalBatch {
            dp_size: 1,
            batch_num_tokens: Some(tokens.iter().sum::<i64>() as f64),
            global_batch_size: Some(tokens.iter().filter(|&&n| n > 0).count() as f64),
        };
        let old = (batch.old_log_probs.as_ref()).context("the batch's old log-probabilities")?;
        let adv = batch
            .advantages
            .as_ref()
            .context("the batch's advantages")?;
        let reference = batch
            .ref_log_probs
            .as_ref()
            .filter(|_| cfg.loss.use_kl_loss);
        self.engine.store_mut().zero_grads();
        let mut sums = MiniBatchSums::default();
        for micro in rows.chunks(cfg.ppo_micro_batch_size) {
            let per_row = batch.tokens_per_row(micro);
            let n = per_row.iter().sum::<i64>() as f64;
            let actor_rows = ActorRows {
                tokens_per_sample: per_row,
                old_log_prob: batch.gather_tokens(old, micro),
                advantages: batch.gather_tokens(adv, micro),
                ref_log_prob: reference.map(|r| batch.gather_tokens(r, micro)),
            };
            let loss = ActorTokenLoss::new(cfg.loss, global, actor_rows)?;
            let mb = batch.micro_batch(micro, self.device)?;
            self.engine.forward_backward_with(&mb, &loss)?;
            if n == 0.0 {
                continue; // no response token: the loss was never evaluated
            }
            let m = loss.metrics();
            sums.pg_loss += m.pg_loss;
            sums.entropy = m.entropy.map(|e| sums.entropy.unwrap_or(0.0) + e);
            sums.kl_loss = m.kl_loss.map(|k| sums.kl_loss.unwrap_or(0.0) + k);
            sums.clipfrac += m.pg_clipfrac * n;
            sums.ppo_kl += m.ppo_kl * n;
            sums.clipfrac_lower += m.pg_clipfrac_lower * n;
            sums.tokens += n;
        }
        Ok(sums)
    }

    /// Clips the accumulated gradients and takes one AdamW step at the scheduled learning rate (skipped on a
    /// non-finite norm, as verl does). Returns the norm before clipping and the learning rate.
    fn optimizer_step(&mut self, grad_clip: f64) -> Result<(f64, f64)> {
        let store = self.engine.store_mut();
        let grad_norm = store.grad_sq_norm()?.sqrt();
        let lr = self.schedule.lr_at(self.completed_steps);
        if grad_norm.is_finite() {
            let (master, grads) = store.master_and_grads();
            clip_grads(grads, grad_norm, grad_clip);
            self.optimizer.step(master, grads, lr);
        } else {
            tracing::warn!(grad_norm, "non-finite gradient norm: actor update skipped");
        }
        self.completed_steps += 1;
        Ok((grad_norm, lr))
    }
}

/// Adds one optimizer step's figures to the running averages.
fn record(metrics: &mut Averages, s: &MiniBatchSums, grad_norm: f64) {
    let per_token = |v: f64| v / s.tokens.max(1.0);
    metrics.add("actor/pg_loss", s.pg_loss);
    metrics.add("actor/pg_clipfrac", per_token(s.clipfrac));
    metrics.add("actor/ppo_kl", per_token(s.ppo_kl));
    metrics.add("actor/pg_clipfrac_lower", per_token(s.clipfrac_lower));
    if let Some(e) = s.entropy {
        metrics.add("actor/entropy", e);
    }
    if let Some(k) = s.kl_loss {
        metrics.add("actor/kl_loss", k);
    }
    metrics.add("actor/grad_norm", grad_norm);
}
