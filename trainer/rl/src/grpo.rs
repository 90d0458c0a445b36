//! GRPO (and RLOO) in one process, colocated: the policy's engine trains, a [`RolloutModel`] snapshot of its weights
//! generates, and after every update the snapshot is taken again ([`RolloutModel::from_store`]: the colocated
//! "weight sync", timed as `timing_s/update_weights`).
//!
//! One [`GrpoTrainer::step`] over a batch of prompts, as verl's `RayPPOTrainer.fit` runs it:
//! 1. `gen`: `n` responses per prompt (seeded sampling with `temperature`, `top_k`, `top_p`, stopped at an EOS token
//!    or `max_response_length`); the `n` rows of a prompt share a group id.
//! 2. `reward`: one score per row ([`Reward`]).
//! 3. `old_log_prob`: the current policy's log-probabilities (and entropies: `actor/entropy`) of the responses at the
//!    rollout temperature ([`compute_log_prob`]).
//! 4. `ref`: with `use_kl_loss`, the reference policy's (a frozen copy of the weights the trainer was built with).
//! 5. `adv`: GRPO or RLOO outcome advantages over the groups.
//! 6. `update_actor`: [`PolicyWorker::update_policy`].
//! 7. `update_weights`: the rollout snapshot is refreshed.
//!
//! # Reproducibility
//! Every random choice of step `k` (0-based: the number of steps completed before it) is seeded by
//! [`derive_seed`]`(seed, k, stream)` — the sampling of step `k` by stream 0, its mini-batch shuffles by stream 1 —
//! so a run restored at step `k` ([`GrpoTrainer::save`] / [`GrpoTrainer::load`]) generates and trains exactly what
//! an uninterrupted run does.

use super::batch::RlBatch;
use super::grpo_step::GrpoStep;
use super::micro::MicroBatching;
use super::policy_worker::{ActorUpdateConfig, PolicyWorker};
use super::reward::Reward;
use super::roles::{Colocated, ReferencePolicy};
use super::{check_outcome_estimator, ActorLossConfig, AdvEstimator};
use anyhow::{bail, Context, Result};
use ferl_trainer::engine::Engine;
use ferl_trainer::optim::{AdamWConfig, LrSchedule, ScheduleKind};
use ferl_trainer::params::{LocalParams, ParamStore};
use ferl_trainer::rollout::SamplingParams;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

pub use super::state::{STATE_META, STATE_TENSORS};

/// Every knob of a GRPO run (verl's keys under `actor_rollout_ref` and `algorithm`).
#[derive(Clone, Debug)]
pub struct GrpoSettings {
    /// `rollout.n`: responses per prompt.
    pub n: usize,
    /// `rollout.temperature` (also the `T` of every log-probability; 0: greedy, log-probabilities at T = 1).
    pub temperature: f64,
    /// `rollout.top_k` (0 or negative: no limit).
    pub top_k: i64,
    /// `rollout.top_p` (1: no limit).
    pub top_p: f64,
    /// The run's seed: every step's sampling and shuffles derive from it and the step ([`derive_seed`]).
    pub seed: u64,
    /// `data.max_response_length`.
    pub max_response_length: usize,
    /// Tokens that end a response (kept in it).
    pub eos_token_ids: Vec<i64>,
    /// The token left-padding prompts during generation.
    pub pad_token_id: i64,
    /// `actor.ppo_mini_batch_size`: prompts per optimizer step.
    pub ppo_mini_batch_size: usize,
    /// The update's forward/backward: `actor.ppo_micro_batch_size_per_gpu` rows, or (`actor.use_dynamic_bsz`)
    /// `actor.ppo_max_token_len_per_gpu` tokens.
    pub ppo_micro_batching: MicroBatching,
    /// The old log-probabilities' forwards: `rollout.log_prob_micro_batch_size_per_gpu` rows, or
    /// (`rollout.log_prob_use_dynamic_bsz`) `rollout.log_prob_max_token_len_per_gpu` tokens.
    pub log_prob_micro_batching: MicroBatching,
    /// The reference log-probabilities' forwards: `ref.log_prob_micro_batch_size_per_gpu` rows, or
    /// (`ref.log_prob_use_dynamic_bsz`) `ref.log_prob_max_token_len_per_gpu` tokens.
    pub ref_log_prob_micro_batching: MicroBatching,
    /// `actor.ppo_epochs`.
    pub ppo_epochs: usize,
    /// `actor.shuffle`: permute the rows before splitting them into mini-batches (seeded per step).
    pub shuffle: bool,
    /// The actor's loss: clip ratios (`clip_ratio`, `_low`, `_high`, `_c`), `loss_agg_mode`, `entropy_coeff`,
    /// `use_kl_loss`, `kl_loss_coef`, `kl_loss_type`.
    pub loss: ActorLossConfig,
    /// `algorithm.adv_estimator`.
    pub adv_estimator: AdvEstimator,
    /// `algorithm.norm_adv_by_std_in_grpo`.
    pub norm_adv_by_std_in_grpo: bool,
    /// `actor.optim.lr` (constant).
    pub lr: f64,
    /// AdamW's betas, epsilon and weight decay (`actor.optim`).
    pub optim: AdamWConfig,
    /// `actor.grad_clip` (0: no clipping).
    pub grad_clip: f64,
}

impl Default for GrpoSettings {
    /// verl's defaults where it has them (`n` 8, fp32-friendly `lr` 1e-6, `grad_clip` 1, AdamW (0.9, 0.999), weight
    /// decay 0.01), no stop token.
    fn default() -> Self {
        Self {
            n: 8,
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            seed: 1,
            max_response_length: 512,
            eos_token_ids: Vec::new(),
            pad_token_id: 0,
            ppo_mini_batch_size: 256,
            ppo_micro_batching: MicroBatching::Rows(8),
            log_prob_micro_batching: MicroBatching::Rows(16),
            ref_log_prob_micro_batching: MicroBatching::Rows(16),
            ppo_epochs: 1,
            shuffle: false,
            loss: ActorLossConfig::default(),
            adv_estimator: AdvEstimator::Grpo,
            norm_adv_by_std_in_grpo: true,
            lr: 1e-6,
            optim: AdamWConfig {
                betas: (0.9, 0.999),
                eps: 1e-8,
                weight_decay: 0.01,
            },
            grad_clip: 1.0,
        }
    }
}

impl GrpoSettings {
    /// Refuses settings that cannot run, naming the key.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("n", self.n),
            ("ppo_mini_batch_size", self.ppo_mini_batch_size),
            ("ppo_epochs", self.ppo_epochs),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            bail!("GRPO setting {key} must be positive");
        }
        let micro = [
            ("ppo_micro_batching", self.ppo_micro_batching),
            ("log_prob_micro_batching", self.log_prob_micro_batching),
            (
                "ref_log_prob_micro_batching",
                self.ref_log_prob_micro_batching,
            ),
        ];
        if let Some((key, m)) = micro.iter().find(|(_, m)| !m.is_positive()) {
            bail!("GRPO setting {key} ({m:?}) must be positive");
        }
        check_outcome_estimator(self.adv_estimator)?;
        self.loss.validate()?;
        self.sampling(0).validate()?;
        if !(self.lr >= 0.0 && self.lr.is_finite()) {
            bail!("GRPO setting lr {} must be finite and >= 0", self.lr);
        }
        Ok(())
    }

    /// The `T` of every log-probability (old, reference and the update's): the rollout temperature, or 1 under
    /// greedy sampling.
    pub fn log_prob_temperature(&self) -> f64 {
        self.sampling(0).log_prob_temperature()
    }

    /// The actor update of step `step` (0-based): these settings' keys, the step's shuffle seed
    /// (`derive_seed(seed, step, 1)`) and [`GrpoSettings::log_prob_temperature`]. Every driver of the step uses it.
    pub fn update_config(&self, step: u64) -> ActorUpdateConfig {
        ActorUpdateConfig {
            loss: self.loss,
            ppo_mini_batch_size: self.ppo_mini_batch_size,
            rollout_n: self.n,
            micro_batching: self.ppo_micro_batching,
            ppo_epochs: self.ppo_epochs,
            shuffle: self.shuffle,
            shuffle_seed: derive_seed(self.seed, step, 1),
            grad_clip: self.grad_clip,
            temperature: self.log_prob_temperature(),
        }
    }

    /// The sampling of one step, seeded with `seed`.
    pub(crate) fn sampling(&self, seed: u64) -> SamplingParams {
        SamplingParams {
            do_sample: true,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed,
        }
    }
}

/// One prompt of a step's batch.
#[derive(Clone, Debug, Default)]
pub struct GrpoPrompt {
    /// Its token ids (at least one).
    pub ids: Vec<i64>,
    /// Its text, when the caller has a tokenizer (given to the reward).
    pub text: String,
    /// The reward's ground truth.
    pub ground_truth: String,
    /// Anything else the reward reads.
    pub extra: serde_json::Value,
}

/// What one step did: its metrics (verl's names) and the batch with everything computed for it.
pub struct GrpoStepOutput {
    /// The step's number (1-based: steps completed after it).
    pub step: u64,
    /// `critic/*`, `response_length/*`, `prompt_length/*`, `actor/*`, `timing_s/*`.
    pub metrics: BTreeMap<String, f64>,
    /// The rows, rewards, log-probabilities and advantages of the step.
    pub batch: RlBatch,
}

/// Turns a response's token ids into text (the caller's tokenizer).
pub type Decoder = Box<dyn Fn(&[i64]) -> String + Send + Sync>;

/// The seed of random stream `stream` at step `step` of a run seeded with `seed` (SplitMix64 of the three).
pub fn derive_seed(seed: u64, step: u64, stream: u64) -> u64 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    mix(mix(mix(seed) ^ step) ^ stream)
}

/// A frozen copy of `engine`'s parameters (no gradients are kept for it) in an engine of its own: the reference
/// policy.
pub fn frozen_copy<P: ParamStore>(engine: &mut Engine<P>) -> Result<Engine<LocalParams>> {
    let _g = tch::no_grad_guard();
    let (cfg, kind, opts) = (
        engine.config().clone(),
        engine.compute_kind(),
        *engine.options_mut(),
    );
    let mut layout = engine.store().layout().clone();
    let mut params: Vec<Option<Tensor>> = (0..layout.tensors.len()).map(|_| None).collect();
    let store = engine.store_mut();
    for (stage, ids) in &layout.stages {
        let p = store.gather(*stage)?;
        for (&i, t) in ids.iter().zip(&p.tensors) {
            if params[i].is_none() {
                params[i] = Some(t.detach().to_kind(Kind::Float).copy());
            }
        }
        store.release(*stage);
    }
    let params = params
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.with_context(|| format!("no stage holds tensor {}", layout.tensors[i].0)))
        .collect::<Result<Vec<_>>>()?;
    layout.trainable = vec![false; params.len()];
    Ok(Engine::new(
        cfg,
        LocalParams::new(layout, params, kind),
        kind,
        opts,
    ))
}

/// Runs `f`, adding its wall time to `timing_s/<key>`.
pub(crate) fn timed<T>(
    timing: &mut BTreeMap<String, f64>,
    key: &str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let start = Instant::now();
    let out = f()?;
    timing.insert(format!("timing_s/{key}"), start.elapsed().as_secs_f64());
    Ok(out)
}

/// GRPO in one process: a [`PolicyWorker`] holding the whole batch and the one step ([`GrpoStep`]).
pub struct GrpoTrainer<P: ParamStore> {
    step: GrpoStep,
    actor: PolicyWorker<P>,
}

impl<P: ParamStore> GrpoTrainer<P> {
    /// A trainer of `engine`'s weights (the initial policy, also the reference with `use_kl_loss`) scored by
    /// `reward`. Micro-batches and the rollout model live on the device of the engine's parameters, in its compute
    /// dtype.
    pub fn new(
        settings: GrpoSettings,
        mut engine: Engine<P>,
        reward: Box<dyn Reward>,
    ) -> Result<Self> {
        settings.validate()?;
        let device = {
            let store = engine.store_mut();
            let stage = ferl_trainer::model::layout::Stage::Embedding;
            let device = store.gather(stage)?.tensors[0].device();
            store.release(stage);
            device
        };
        let reference = match settings.loss.use_kl_loss {
            true => Some(Box::new(frozen_copy(&mut engine)?) as Box<dyn ReferencePolicy>),
            false => None,
        };
        let schedule = LrSchedule {
            lr: settings.lr,
            warmup_steps: 0,
            total_steps: 1,
            kind: ScheduleKind::Constant,
            num_cycles: 0.5,
        };
        let actor = PolicyWorker::new(engine, settings.optim, schedule, device);
        Ok(Self {
            step: GrpoStep::new(settings, reference, reward)?,
            actor,
        })
    }

    /// Decodes responses for the reward with `decoder` (without one the reward sees empty response texts).
    pub fn set_decoder(&mut self, decoder: Decoder) {
        self.step.set_decoder(decoder);
    }

    /// The settings.
    pub fn settings(&self) -> &GrpoSettings {
        &self.step.settings
    }

    /// Steps completed.
    pub fn global_step(&self) -> u64 {
        self.step.completed
    }

    /// The policy worker (engine and optimizer).
    pub fn actor(&self) -> &PolicyWorker<P> {
        &self.actor
    }

    /// The policy worker, mutably.
    pub fn actor_mut(&mut self) -> &mut PolicyWorker<P> {
        &mut self.actor
    }

    /// One GRPO step over `prompts` ([`GrpoStep::run`]); returns its metrics and batch.
    pub fn step(&mut self, prompts: &[GrpoPrompt]) -> Result<GrpoStepOutput> {
        self.step
            .run(&mut self.actor.lend(), &mut Colocated::default(), prompts)
    }

    /// Writes the policy's state ([`crate::state`]) with this run's step counter to `dir`. The reference policy
    /// is not saved: it is the weights the trainer is built with.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        self.actor.save_state(dir, self.step.completed)
    }

    /// Restores what [`GrpoTrainer::save`] wrote into this trainer (built like the saved one, from the initial
    /// weights): the next step is the saved run's next step.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        self.step.completed = self.actor.restore_state(dir)?;
        Ok(())
    }
}

/// Mean, max and min of `v` (zeros when empty) under `prefix/`.
fn summary(out: &mut BTreeMap<String, f64>, prefix: &str, v: &[f64]) {
    let n = v.len().max(1) as f64;
    let (mean, max, min) = match v.is_empty() {
        true => (0.0, 0.0, 0.0),
        false => (
            v.iter().sum::<f64>() / n,
            v.iter().copied().fold(f64::MIN, f64::max),
            v.iter().copied().fold(f64::MAX, f64::min),
        ),
    };
    out.insert(format!("{prefix}/mean"), mean);
    out.insert(format!("{prefix}/max"), max);
    out.insert(format!("{prefix}/min"), min);
}

/// verl's data metrics of a step's batch: scores, rewards, advantages over the response tokens, response and
/// prompt lengths, and the fraction of responses cut by `max_response_length`.
pub fn data_metrics(
    batch: &RlBatch,
    mask: &Tensor,
    max_response_length: usize,
) -> Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    let scores = batch.rewards.clone().context("the batch has no rewards")?;
    summary(&mut out, "critic/score", &scores);
    let token_rewards = batch.token_level_rewards(mask.device())?;
    let sums = token_rewards.sum_dim_intlist([-1i64].as_slice(), false, Kind::Double);
    let sums = Vec::<f64>::try_from(sums.to_device(Device::Cpu))?;
    summary(&mut out, "critic/rewards", &sums);
    let adv = batch
        .advantages
        .as_ref()
        .context("the batch has no advantages")?;
    let adv = adv
        .masked_select(&mask.ne(0.0))
        .to_kind(Kind::Double)
        .to_device(Device::Cpu);
    summary(&mut out, "critic/advantages", &Vec::<f64>::try_from(adv)?);
    let lens: Vec<f64> = batch.rows.iter().map(|r| r.response.len() as f64).collect();
    summary(&mut out, "response_length", &lens);
    let clipped = batch
        .rows
        .iter()
        .filter(|r| r.response.len() >= max_response_length)
        .count();
    out.insert(
        "response_length/clip_ratio".into(),
        clipped as f64 / batch.len().max(1) as f64,
    );
    let prompt_lens: Vec<f64> = batch.rows.iter().map(|r| r.prompt.len() as f64).collect();
    summary(&mut out, "prompt_length", &prompt_lens);
    Ok(out)
}
