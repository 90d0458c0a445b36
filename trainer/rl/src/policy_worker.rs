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
use super::roles::PolicyRole;
use super::{ActorLossConfig, ActorRows, ActorTokenLoss, GlobalBatch};
use anyhow::{bail, Context, Result};
use ferl_trainer::batch::Layout;
use ferl_trainer::engine::Engine;
use ferl_trainer::model::ulysses::SpGroup;
use ferl_trainer::optim::{clip_grads, AdamW, AdamWConfig, LrSchedule};
use ferl_trainer::params::ParamStore;
use ferl_trainer::rollout::RolloutModel;
use ferl_trainer::step::Stepper;

use crate::micro::MicroBatching;
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
    /// `ppo_micro_batch_size_per_gpu` rows per forward/backward, or (`use_dynamic_bsz`) `ppo_max_token_len_per_gpu`
    /// tokens.
    pub micro_batching: MicroBatching,
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

/// This rank's part of a data-parallel update: rank `rank` of `world` computes the log-probabilities of its
/// contiguous share of the rows and the gradients of its contiguous share of every mini-batch; the store sums the
/// gradients over the ranks, and each micro-batch's loss is normalised by the whole mini-batch, so the update is the
/// one of a single rank holding every row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataShare {
    /// This rank's index among the data-parallel ranks.
    pub rank: usize,
    /// The data-parallel ranks.
    pub world: usize,
}

impl DataShare {
    /// The whole batch on one rank.
    pub const WHOLE: DataShare = DataShare { rank: 0, world: 1 };

    /// This rank's contiguous share of `rows`.
    pub fn of<'a>(&self, rows: &'a [usize]) -> &'a [usize] {
        ferl_data::batch::rank_shard(rows, self.rank, self.world)
    }

    /// Refuses a batch of `rows` rows that the ranks cannot share evenly (every rank must run as many
    /// micro-batches: the store's gathers are collectives).
    pub(crate) fn check(&self, rows: usize, what: &str) -> Result<()> {
        if !rows.is_multiple_of(self.world) {
            bail!(
                "{what} of {rows} rows cannot be split evenly over {} data-parallel ranks",
                self.world
            );
        }
        Ok(())
    }
}

/// The actor: a [`Stepper`] (engine, AdamW, learning-rate schedule) and this rank's [`DataShare`].
pub struct PolicyWorker<P: ParamStore> {
    stepper: Stepper<P>,
    share: DataShare,
}

/// The actor's computations over a stepper it borrows (a trainer rank keeps its stepper, and saves and loads it as
/// SFT does): [`PolicyWorker`] owns one and lends it here.
pub struct StepperPolicy<'a, P: ParamStore> {
    /// The engine, optimizer and schedule.
    pub stepper: &'a mut Stepper<P>,
    /// This rank's share of each batch.
    pub share: DataShare,
}

/// Log-probabilities (and with `entropy` the entropies) of `batch`'s response tokens under `engine` at temperature
/// `temperature`, as `[rows, width]` fp32 matrices with zeros past each response, computed in the micro-batches
/// `micro_batching` cuts, without gradients on `device` (verl's `compute_log_prob`; the reference policy's too).
/// Leaves the engine at that temperature.
pub fn compute_log_prob<P: ParamStore>(
    engine: &mut Engine<P>,
    batch: &RlBatch,
    micro_batching: MicroBatching,
    temperature: f64,
    entropy: bool,
    device: Device,
) -> Result<(Tensor, Option<Tensor>)> {
    let share = DataShare::WHOLE;
    let on = Placement { share, sp: None };
    compute_log_prob_rows(
        engine,
        batch,
        on,
        micro_batching,
        temperature,
        entropy,
        device,
    )
}

/// Where a rank's forwards run: its data-parallel share of the rows and, under Ulysses sequence parallelism, the
/// group it splits each micro-batch with.
#[derive(Clone, Copy)]
pub struct Placement<'a> {
    /// This rank's share of the rows.
    pub share: DataShare,
    /// The Ulysses group, if any.
    pub sp: Option<&'a SpGroup>,
}

/// [`compute_log_prob`] of `on.share`'s rows only (the other rows stay zero; under sequence parallelism, of this
/// rank's slice of their tokens only), summed over the ranks afterwards with [`sum_tensor_over_ranks`].
pub fn compute_log_prob_rows<P: ParamStore>(
    engine: &mut Engine<P>,
    batch: &RlBatch,
    on: Placement<'_>,
    micro_batching: MicroBatching,
    temperature: f64,
    entropy: bool,
    device: Device,
) -> Result<(Tensor, Option<Tensor>)> {
    if !micro_batching.is_positive() {
        bail!("compute_log_prob: the micro-batch size must be positive ({micro_batching:?})");
    }
    on.share.check(batch.len(), "a log-probability batch")?;
    let all: Vec<usize> = (0..batch.len()).collect();
    let micros = micro_batching.cut(batch, &all, on.share, engine.layout())?;
    engine.set_temperature(temperature)?;
    let _g = tch::no_grad_guard();
    let mut log_probs = batch.zeros(Kind::Float, device);
    let mut entropies = entropy.then(|| batch.zeros(Kind::Float, device));
    for micro in &micros {
        let (mb, kept) = batch.micro_batch_on(micro, engine.layout(), device, on.sp)?;
        let stats = engine.token_stats(&mb, entropy)?;
        let whole = |t: &Tensor| batch.whole_tokens(micro, kept.as_ref(), t);
        batch.scatter_tokens(&mut log_probs, micro, &whole(&stats.log_prob));
        if let (Some(m), Some(h)) = (entropies.as_mut(), stats.entropy.as_ref()) {
            batch.scatter_tokens(m, micro, &whole(h));
        }
    }
    Ok((log_probs, entropies))
}

/// Sums over the ranks, as a function of the values each rank gives (in order with its other collectives).
pub type SumOverRanks<'a> = &'a mut dyn FnMut(&[f64]) -> Result<Vec<f64>>;

/// The element-wise sum of the fp32 tensor `t` over the ranks (`sum`), on `t`'s device.
pub fn sum_tensor_over_ranks(sum: SumOverRanks<'_>, t: &Tensor) -> Result<Tensor> {
    let values = Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1]))?;
    let sums = sum(&values)?;
    Ok(Tensor::from_slice(&sums)
        .to_kind(Kind::Float)
        .view(t.size().as_slice())
        .to_device(t.device()))
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

impl MiniBatchSums {
    /// Adds one micro-batch's figures: its token means are over `tokens` response tokens, of which this rank
    /// counts `counted` (all of them, or its share under sequence parallelism, whose ranks each add their part
    /// of the means).
    fn add(&mut self, m: &super::ActorLossMetrics, tokens: f64, counted: f64) {
        self.pg_loss += m.pg_loss;
        self.entropy = m.entropy.map(|e| self.entropy.unwrap_or(0.0) + e);
        self.kl_loss = m.kl_loss.map(|k| self.kl_loss.unwrap_or(0.0) + k);
        self.clipfrac += m.pg_clipfrac * tokens;
        self.ppo_kl += m.ppo_kl * tokens;
        self.clipfrac_lower += m.pg_clipfrac_lower * tokens;
        self.tokens += counted;
    }

    /// The sums as numbers (a missing term as 0 with a presence count of 0), for a sum over ranks.
    fn to_values(&self) -> [f64; 9] {
        let opt = |v: Option<f64>| (v.unwrap_or(0.0), f64::from(u8::from(v.is_some())));
        let (e, has_e) = opt(self.entropy);
        let (k, has_k) = opt(self.kl_loss);
        let (c, p, l, t) = (self.clipfrac, self.ppo_kl, self.clipfrac_lower, self.tokens);
        [self.pg_loss, e, has_e, k, has_k, c, p, l, t]
    }

    /// The inverse of [`Self::to_values`] (a term present on any rank is present).
    fn from_values(v: &[f64]) -> Self {
        Self {
            pg_loss: v[0],
            entropy: (v[2] > 0.0).then_some(v[1]),
            kl_loss: (v[4] > 0.0).then_some(v[3]),
            clipfrac: v[5],
            ppo_kl: v[6],
            clipfrac_lower: v[7],
            tokens: v[8],
        }
    }
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
    /// micro-batches on `device`, holding the whole batch.
    pub fn new(
        mut engine: Engine<P>,
        optim: AdamWConfig,
        schedule: LrSchedule,
        device: Device,
    ) -> Self {
        let optimizer = AdamW::new(optim, engine.store_mut().master_and_grads().0);
        let stepper = Stepper {
            engine,
            optimizer,
            schedule,
            clip_grad: 0.0,
            micro_batch_size: 1,
            layout: Layout::Padded,
            device,
            completed_steps: 0,
            sequence_parallel: None,
        };
        Self::from_stepper(stepper, DataShare::WHOLE)
    }

    /// A worker over a trainer rank's stepper (its sharded store, optimizer and schedule), computing `share` of
    /// every batch. Its clipping and micro-batch size are the update's ([`ActorUpdateConfig`]).
    pub fn from_stepper(stepper: Stepper<P>, share: DataShare) -> Self {
        Self { stepper, share }
    }

    /// The stepper back (the rank keeps it between steps, and saves and loads it as SFT does).
    pub fn into_stepper(self) -> Stepper<P> {
        self.stepper
    }

    /// This worker's share of each batch.
    pub fn share(&self) -> DataShare {
        self.share
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<P> {
        &self.stepper.engine
    }

    /// The engine, mutably (its store for checkpoints and weight syncs).
    pub fn engine_mut(&mut self) -> &mut Engine<P> {
        &mut self.stepper.engine
    }

    /// The optimizer state.
    pub fn optimizer(&self) -> &AdamW {
        &self.stepper.optimizer
    }

    /// The optimizer state, mutably (checkpoint restore).
    pub fn optimizer_mut(&mut self) -> &mut AdamW {
        &mut self.stepper.optimizer
    }

    /// Updates completed ([`Self::update_policy`] calls, as verl steps its scheduler once per update): the
    /// schedule's position.
    pub fn completed_steps(&self) -> i64 {
        self.stepper.completed_steps
    }

    /// Sets the schedule's position (checkpoint restore).
    pub fn set_completed_steps(&mut self, steps: i64) {
        self.stepper.completed_steps = steps;
    }

    /// Where micro-batches are built.
    pub fn device(&self) -> Device {
        self.stepper.device
    }

    /// This worker's computations over its stepper.
    pub fn lend(&mut self) -> StepperPolicy<'_, P> {
        StepperPolicy {
            stepper: &mut self.stepper,
            share: self.share,
        }
    }

    /// [`PolicyRole::compute_log_prob`] over this worker's stepper.
    pub fn compute_log_prob(
        &mut self,
        batch: &RlBatch,
        micro_batching: MicroBatching,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.lend()
            .compute_log_prob(batch, micro_batching, temperature, entropy)
    }

    /// [`PolicyRole::update_policy`] over this worker's stepper.
    pub fn update_policy(
        &mut self,
        batch: &RlBatch,
        cfg: &ActorUpdateConfig,
    ) -> Result<BTreeMap<String, f64>> {
        self.lend().update_policy(batch, cfg)
    }
}

/// The policy of a GRPO step over a borrowed stepper: one process's, or a trainer rank's sharded one.
impl<P: ParamStore> PolicyRole for StepperPolicy<'_, P> {
    fn device(&self) -> Device {
        self.stepper.device
    }

    fn share(&self) -> DataShare {
        self.share
    }

    /// Sums `values` over the store's ranks.
    fn sum_over_ranks(&mut self, values: &[f64]) -> Result<Vec<f64>> {
        self.stepper.engine.store_mut().all_reduce_sum(values)
    }

    /// Every rank of the store (each data-parallel rank times its Ulysses group), ordered by data-parallel rank.
    fn generation_share(&self) -> DataShare {
        match &self.stepper.sequence_parallel {
            None => self.share,
            Some(sp) => {
                let k = sp.size() as usize;
                DataShare {
                    rank: self.share.rank * k + sp.rank() as usize,
                    world: self.share.world * k,
                }
            }
        }
    }

    fn sequence_parallel(&self) -> Option<SpGroup> {
        self.stepper.sequence_parallel.clone()
    }

    /// [`compute_log_prob`] under the current policy, each rank computing its share of the rows: `[rows, width]`
    /// log-probabilities and entropies of every row on every rank.
    fn compute_log_prob(
        &mut self,
        batch: &RlBatch,
        micro_batching: MicroBatching,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let device = self.stepper.device;
        let ranks = self.generation_share().world;
        let on = Placement {
            share: self.share,
            sp: self.stepper.sequence_parallel.as_ref(),
        };
        let engine = &mut self.stepper.engine;
        let (lp, h) = compute_log_prob_rows(
            engine,
            batch,
            on,
            micro_batching,
            temperature,
            entropy,
            device,
        )?;
        if ranks == 1 {
            return Ok((lp, h));
        }
        let mut sum = |v: &[f64]| engine.store_mut().all_reduce_sum(v);
        let lp = sum_tensor_over_ranks(&mut sum, &lp)?;
        let h = h.map(|h| sum_tensor_over_ranks(&mut sum, &h)).transpose()?;
        Ok((lp, h))
    }

    /// verl's `update_policy` over `batch` (it must hold old log-probabilities and advantages, and reference
    /// log-probabilities with `use_kl_loss`); returns the `actor/*` metrics (see the module docs). Every optimizer
    /// step of the call uses the schedule's learning rate at [`Self::completed_steps`], which then advances by one.
    fn update_policy(
        &mut self,
        batch: &RlBatch,
        cfg: &ActorUpdateConfig,
    ) -> Result<BTreeMap<String, f64>> {
        check_update(batch, cfg)?;
        self.share
            .check(cfg.ppo_mini_batch_size * cfg.rollout_n, "a mini-batch")?;
        self.stepper.engine.set_temperature(cfg.temperature)?;
        let mut metrics = Averages::default();
        let lr = self.stepper.schedule.lr_at(self.stepper.completed_steps);
        for epoch in 0..cfg.ppo_epochs {
            let mut order: Vec<usize> = (0..batch.len()).collect();
            if cfg.shuffle {
                let seed = cfg.shuffle_seed.wrapping_add(epoch as u64);
                order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
            }
            for mini in order.chunks(cfg.ppo_mini_batch_size * cfg.rollout_n) {
                let sums = self.mini_batch_grads(batch, mini, cfg)?;
                let sums = self.summed_over_ranks(sums)?;
                let grad_norm = self.optimizer_step(cfg.grad_clip, lr)?;
                record(&mut metrics, &sums, grad_norm);
            }
        }
        self.stepper.completed_steps += 1;
        let mut out = metrics.means();
        out.insert("actor/lr".into(), lr);
        Ok(out)
    }

    /// The rows' log-probabilities with the engine's LoRA adapters off for these forwards only.
    fn base_log_prob(
        &mut self,
        batch: &RlBatch,
        micro_batching: MicroBatching,
        temperature: f64,
    ) -> Result<Tensor> {
        if self.stepper.engine.store().layout().decoder.lora.is_empty() {
            bail!("the policy has no LoRA adapters: its reference needs a model of its own");
        }
        self.stepper.engine.options_mut().adapters_off = true;
        let out = self.compute_log_prob(batch, micro_batching, temperature, false);
        self.stepper.engine.options_mut().adapters_off = false;
        Ok(out?.0)
    }

    fn rollout_model(&mut self) -> Result<RolloutModel> {
        let engine = &mut self.stepper.engine;
        let (cfg, kind) = (engine.config().clone(), engine.compute_kind());
        RolloutModel::from_store(cfg, engine.store_mut(), kind)
    }
}

impl<P: ParamStore> StepperPolicy<'_, P> {
    /// Zeroes the gradients and accumulates those of this rank's share of mini-batch `rows`, micro-batch by
    /// micro-batch, each normalised by the whole mini-batch.
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
        let device = self.stepper.device;
        let sp = self.stepper.sequence_parallel.as_ref();
        // Under sequence parallelism each rank of a group adds its slice's part of a micro-batch's figures, and
        // its share of the tokens they are weighted by.
        let token_share = 1.0 / sp.map_or(1, SpGroup::size) as f64;
        let engine = &mut self.stepper.engine;
        engine.store_mut().zero_grads();
        let mut sums = MiniBatchSums::default();
        let micros = cfg
            .micro_batching
            .cut(batch, rows, self.share, engine.layout())?;
        for micro in &micros {
            let per_row = batch.tokens_per_row(micro);
            let n = per_row.iter().sum::<i64>() as f64;
            let (mb, kept) = batch.micro_batch_on(micro, engine.layout(), device, sp)?;
            let actor_rows = ActorRows {
                tokens_per_sample: per_row,
                old_log_prob: batch.gather_tokens(old, micro),
                advantages: batch.gather_tokens(adv, micro),
                ref_log_prob: reference.map(|r| batch.gather_tokens(r, micro)),
                kept,
            };
            let loss = ActorTokenLoss::new(cfg.loss, global, actor_rows)?;
            engine.forward_backward_with(&mb, &loss)?;
            if n == 0.0 {
                continue; // no response token: the loss was never evaluated
            }
            sums.add(&loss.metrics(), n, n * token_share);
        }
        Ok(sums)
    }

    /// The mini-batch's sums over every data-parallel rank (one sum of a few numbers).
    fn summed_over_ranks(&mut self, sums: MiniBatchSums) -> Result<MiniBatchSums> {
        if self.generation_share().world == 1 {
            return Ok(sums);
        }
        let summed = self
            .stepper
            .engine
            .store_mut()
            .all_reduce_sum(&sums.to_values())?;
        Ok(MiniBatchSums::from_values(&summed))
    }

    /// Clips the accumulated gradients and takes one AdamW step at `lr` (skipped on a non-finite norm, as verl
    /// does). Returns the norm before clipping.
    fn optimizer_step(&mut self, grad_clip: f64, lr: f64) -> Result<f64> {
        let store = self.stepper.engine.store_mut();
        let grad_norm = store.grad_sq_norm()?.sqrt();
        if grad_norm.is_finite() {
            let (master, grads) = store.master_and_grads();
            clip_grads(grads, grad_norm, grad_clip);
            self.stepper.optimizer.step(master, grads, lr);
        } else {
            tracing::warn!(grad_norm, "non-finite gradient norm: actor update skipped");
        }
        Ok(grad_norm)
    }
}

/// Refuses an update the batch or the sizes cannot make.
fn check_update(batch: &RlBatch, cfg: &ActorUpdateConfig) -> Result<()> {
    let rows_per_mini = cfg.ppo_mini_batch_size * cfg.rollout_n;
    if rows_per_mini == 0 || !cfg.micro_batching.is_positive() || cfg.ppo_epochs == 0 {
        bail!(
            "update_policy: ppo_mini_batch_size ({}) × n ({}), the micro-batch size ({:?}) and ppo_epochs ({}) must be positive",
            cfg.ppo_mini_batch_size, cfg.rollout_n, cfg.micro_batching, cfg.ppo_epochs
        );
    }
    if batch.old_log_probs.is_none() || batch.advantages.is_none() {
        bail!("update_policy: the batch needs old log-probabilities and advantages");
    }
    if cfg.loss.use_kl_loss && batch.ref_log_probs.is_none() {
        bail!("update_policy: use_kl_loss is set but the batch has no reference log-probabilities");
    }
    Ok(())
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
