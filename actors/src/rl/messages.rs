//! The wire types of the RL roles, one type per message with its reply ([`ferl_runtime::message!`]), and the
//! conversions between them and the trainer's [`RlBatch`].
//!
//! Per-token values (log-probabilities, entropies, advantages) travel as flat `f32` lists of the batch's response
//! tokens, row after row ([`token_values`]; [`token_matrix`] rebuilds verl's `[rows, width]` matrix with zeros past
//! each response), so a value crosses the wire bit for bit. Weights travel as one byte blob ([`WeightsPayload`]).

use anyhow::{bail, Result};
use ferl_rl::{
    ActorLossConfig, ActorUpdateConfig, ClipConfig, GrpoPrompt, GrpoSettings, KlPenalty,
    LossAggMode, MicroBatching, RlBatch, RlRow,
};
use ferl_runtime::{ObjectRef, SharedBytes};
use ferl_trainer::rollout::{GenerationConfig, SamplingParams};
use rkyv::{Archive, Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// One row a policy scores or trains on: a prompt and one response to it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RowIds {
    /// Prompt token ids.
    pub prompt: Vec<i64>,
    /// Response token ids.
    pub response: Vec<i64>,
}

impl RowIds {
    /// The rows of `batch`, in order.
    pub fn of(batch: &RlBatch) -> Vec<RowIds> {
        batch
            .rows
            .iter()
            .map(|r| RowIds {
                prompt: r.prompt.clone(),
                response: r.response.clone(),
            })
            .collect()
    }

    /// A batch of `rows` (no uid, text or ground truth: what the policy needs).
    pub fn batch(rows: Vec<RowIds>) -> RlBatch {
        RlBatch::new(
            rows.into_iter()
                .map(|r| RlRow {
                    prompt: r.prompt,
                    response: r.response,
                    ..RlRow::default()
                })
                .collect(),
        )
    }
}

/// The response tokens of the `[rows, width]` matrix `m` of `batch`, row after row, as `f32`.
pub fn token_values(batch: &RlBatch, m: &Tensor) -> Result<Vec<f32>> {
    let all: Vec<usize> = (0..batch.len()).collect();
    let flat = batch.gather_tokens(m, &all).to_kind(Kind::Float);
    Ok(Vec::<f32>::try_from(flat.to_device(Device::Cpu))?)
}

/// The `[rows, width]` fp32 matrix of `batch` on `device` holding `values` (as [`token_values`] lists them) on the
/// response tokens and zeros after them.
pub fn token_matrix(batch: &RlBatch, values: &[f32], device: Device) -> Result<Tensor> {
    let tokens: i64 = batch.response_lengths().iter().sum();
    if values.len() as i64 != tokens {
        bail!(
            "{} per-token values for a batch of {tokens} response tokens",
            values.len()
        );
    }
    let all: Vec<usize> = (0..batch.len()).collect();
    let mut m = batch.zeros(Kind::Float, device);
    batch.scatter_tokens(&mut m, &all, &Tensor::from_slice(values));
    Ok(m)
}

/// How tokens are sampled ([`SamplingParams`] on the wire).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Sample (else greedy).
    pub do_sample: bool,
    /// Temperature (0: greedy).
    pub temperature: f64,
    /// Top-k (0 or negative: no limit).
    pub top_k: i64,
    /// Top-p (1: no limit).
    pub top_p: f64,
    /// The sampler's seed.
    pub seed: u64,
}

impl From<SamplingParams> for Sampling {
    fn from(p: SamplingParams) -> Self {
        Self {
            do_sample: p.do_sample,
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            seed: p.seed,
        }
    }
}

impl From<Sampling> for SamplingParams {
    fn from(s: Sampling) -> Self {
        Self {
            do_sample: s.do_sample,
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            seed: s.seed,
        }
    }
}

/// Rollout: `n` responses to each prompt, in one batch (prompt `i`'s responses are rows `i·n .. (i+1)·n`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Generate {
    /// Prompt token ids.
    pub prompts: Vec<Vec<i64>>,
    /// Responses per prompt.
    pub n: u64,
    /// Sampling, seed included.
    pub sampling: Sampling,
    /// Most tokens per response.
    pub max_response_length: u64,
    /// Tokens that end a response (kept in it).
    pub eos_token_ids: Vec<i64>,
    /// The token left-padding prompts.
    pub pad_token_id: i64,
    /// The index of this call's first response row in the step's whole batch (its sampling stream; see
    /// `GenerationConfig::first_row`).
    pub first_row: u64,
}

impl Generate {
    /// `settings.n` responses to each of `prompts` with the sampling of `settings` seeded by `seed` (as
    /// `GrpoTrainer` generates step `k` with `derive_seed(settings.seed, k, 0)`), its first response being row
    /// `first_row` of the step's batch.
    pub fn new(prompts: &[GrpoPrompt], settings: &GrpoSettings, seed: u64, first_row: u64) -> Self {
        Self {
            prompts: prompts.iter().map(|p| p.ids.clone()).collect(),
            n: settings.n as u64,
            sampling: Sampling {
                do_sample: true,
                temperature: settings.temperature,
                top_k: settings.top_k,
                top_p: settings.top_p,
                seed,
            },
            max_response_length: settings.max_response_length as u64,
            eos_token_ids: settings.eos_token_ids.clone(),
            pad_token_id: settings.pad_token_id,
            first_row,
        }
    }

    /// One response to each of `rows` (prompt token ids) generated as `config` says, the first being row
    /// `first_row` of the step's batch.
    pub fn rows(rows: Vec<Vec<i64>>, config: &GenerationConfig, first_row: u64) -> Self {
        Self {
            prompts: rows,
            n: 1,
            sampling: config.sampling.into(),
            max_response_length: config.max_response_length as u64,
            eos_token_ids: config.eos_token_ids.clone(),
            pad_token_id: config.pad_token_id,
            first_row,
        }
    }
}

/// What a [`Generate`] produced, row by row.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct Generations {
    /// Response token ids.
    pub responses: Vec<Vec<i64>>,
    /// `log_softmax(logits / T)` of each response token.
    pub log_probs: Vec<Vec<f32>>,
    /// Whether an EOS token ended each response.
    pub stopped_at_eos: Vec<bool>,
}

/// The element type of a weights payload.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireDtype {
    /// fp32, little-endian.
    F32,
    /// bf16, little-endian.
    Bf16,
}

/// The tensors of a weights payload: names, shapes and dtype; their data lie back to back in that order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WeightsHeader {
    /// Hugging Face tensor names.
    pub names: Vec<String>,
    /// Shapes, one per name.
    pub shapes: Vec<Vec<i64>>,
    /// The element type of every tensor.
    pub dtype: WireDtype,
}

/// A model's weights for the wire: the header and one blob of all the tensors' bytes (see [`crate::rl::weights`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct WeightsPayload {
    /// What the blob holds.
    pub header: WeightsHeader,
    /// Every tensor's bytes, back to back, in header order.
    pub data: SharedBytes,
}

/// Where a [`LoadWeights`] finds the blob.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub enum WeightsSource {
    /// In the message itself.
    Inline(SharedBytes),
    /// In the cluster's object store (fetched once per node, or mapped on the owner's host).
    Object(ObjectRef),
}

/// Rollout: replace the model's parameters with these weights (every tensor of the model, by name).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct LoadWeights {
    /// What the blob holds.
    pub header: WeightsHeader,
    /// Where the blob is.
    pub source: WeightsSource,
}

/// What a [`LoadWeights`] took.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct WeightsLoaded {
    /// Bytes of the blob.
    pub bytes: u64,
    /// Seconds to fetch the blob (from the object store, when it is there).
    pub fetch_seconds: f64,
    /// Seconds to build the model from it.
    pub build_seconds: f64,
}

/// Policy: the log-probabilities (and entropies) of the rows' response tokens at `temperature`, under the current
/// policy or the frozen reference (verl's `compute_log_prob` / `compute_ref_log_prob`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ComputeLogProb {
    /// The rows.
    pub rows: Vec<RowIds>,
    /// Rows or tokens per forward pass.
    pub micro_batching: WireMicroBatching,
    /// The `T` of `log_softmax(logits / T)`.
    pub temperature: f64,
    /// Also the entropies.
    pub entropy: bool,
    /// Under the reference policy (the actor must have one) instead of the current one.
    pub reference: bool,
}

impl ComputeLogProb {
    /// The current policy's log-probabilities of `batch` (with entropies when `entropy`).
    pub fn policy(
        batch: &RlBatch,
        micro_batching: MicroBatching,
        temperature: f64,
        entropy: bool,
    ) -> Self {
        Self {
            rows: RowIds::of(batch),
            micro_batching: micro_batching.into(),
            temperature,
            entropy,
            reference: false,
        }
    }

    /// The reference policy's log-probabilities of `batch`.
    pub fn reference(batch: &RlBatch, micro_batching: MicroBatching, temperature: f64) -> Self {
        Self {
            reference: true,
            ..Self::policy(batch, micro_batching, temperature, false)
        }
    }
}

/// [`MicroBatching`] on the wire.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub enum WireMicroBatching {
    /// At most this many rows per forward.
    Rows(u64),
    /// At most this many tokens per forward (verl's `use_dynamic_bsz`).
    Tokens(u64),
}

impl From<MicroBatching> for WireMicroBatching {
    fn from(m: MicroBatching) -> Self {
        match m {
            MicroBatching::Rows(n) => Self::Rows(n as u64),
            MicroBatching::Tokens(n) => Self::Tokens(n as u64),
        }
    }
}

impl From<WireMicroBatching> for MicroBatching {
    fn from(m: WireMicroBatching) -> Self {
        match m {
            WireMicroBatching::Rows(n) => Self::Rows(n as usize),
            WireMicroBatching::Tokens(n) => Self::Tokens(n as usize),
        }
    }
}

/// Per-token values of a batch's response tokens (see [`token_values`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct TokenValues {
    /// Log-probabilities.
    pub log_probs: Vec<f32>,
    /// Entropies, when asked for.
    pub entropies: Option<Vec<f32>>,
}

/// verl's actor loss keys on the wire ([`ActorLossConfig`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LossKeys {
    /// `clip_ratio`.
    pub clip_ratio: f64,
    /// `clip_ratio_low`.
    pub clip_ratio_low: Option<f64>,
    /// `clip_ratio_high`.
    pub clip_ratio_high: Option<f64>,
    /// `clip_ratio_c`.
    pub clip_ratio_c: f64,
    /// `loss_agg_mode` as verl spells it.
    pub loss_agg_mode: String,
    /// `entropy_coeff`.
    pub entropy_coeff: f64,
    /// `use_kl_loss`.
    pub use_kl_loss: bool,
    /// `kl_loss_coef`.
    pub kl_loss_coef: f64,
    /// `kl_loss_type` as verl spells it (`k3`, `k1+`, ...).
    pub kl_loss_type: String,
}

impl From<&ActorLossConfig> for LossKeys {
    fn from(c: &ActorLossConfig) -> Self {
        let (kl, plus) = c.kl_loss_type;
        let name = KlPenalty::NAMES
            .iter()
            .find(|(_, k)| *k == kl)
            .map_or("k3", |(n, _)| *n);
        Self {
            clip_ratio: c.policy.clip_ratio,
            clip_ratio_low: c.policy.clip_ratio_low,
            clip_ratio_high: c.policy.clip_ratio_high,
            clip_ratio_c: c.policy.clip_ratio_c,
            loss_agg_mode: c.loss_agg_mode.as_str().into(),
            entropy_coeff: c.entropy_coeff,
            use_kl_loss: c.use_kl_loss,
            kl_loss_coef: c.kl_loss_coef,
            kl_loss_type: format!("{name}{}", if plus { "+" } else { "" }),
        }
    }
}

impl LossKeys {
    /// The loss config these keys name; an unknown spelling is an error naming the key.
    pub fn to_config(&self) -> Result<ActorLossConfig> {
        Ok(ActorLossConfig {
            policy: ClipConfig {
                clip_ratio: self.clip_ratio,
                clip_ratio_low: self.clip_ratio_low,
                clip_ratio_high: self.clip_ratio_high,
                clip_ratio_c: self.clip_ratio_c,
            },
            loss_agg_mode: LossAggMode::parse(&self.loss_agg_mode)?,
            entropy_coeff: self.entropy_coeff,
            use_kl_loss: self.use_kl_loss,
            kl_loss_coef: self.kl_loss_coef,
            kl_loss_type: KlPenalty::parse(&self.kl_loss_type)?,
        })
    }
}

/// verl's actor update keys on the wire ([`ActorUpdateConfig`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct UpdateKeys {
    /// The loss keys.
    pub loss: LossKeys,
    /// Prompts per optimizer step.
    pub ppo_mini_batch_size: u64,
    /// Responses per prompt.
    pub rollout_n: u64,
    /// Rows or tokens per forward/backward.
    pub micro_batching: WireMicroBatching,
    /// Passes over the batch.
    pub ppo_epochs: u64,
    /// Shuffle the rows before each epoch.
    pub shuffle: bool,
    /// The shuffles' seed.
    pub shuffle_seed: u64,
    /// Gradient clipping norm (0: none).
    pub grad_clip: f64,
    /// The rollout temperature.
    pub temperature: f64,
}

impl From<&ActorUpdateConfig> for UpdateKeys {
    fn from(c: &ActorUpdateConfig) -> Self {
        Self {
            loss: LossKeys::from(&c.loss),
            ppo_mini_batch_size: c.ppo_mini_batch_size as u64,
            rollout_n: c.rollout_n as u64,
            micro_batching: c.micro_batching.into(),
            ppo_epochs: c.ppo_epochs as u64,
            shuffle: c.shuffle,
            shuffle_seed: c.shuffle_seed,
            grad_clip: c.grad_clip,
            temperature: c.temperature,
        }
    }
}

impl UpdateKeys {
    /// The update config these keys name.
    pub fn to_config(&self) -> Result<ActorUpdateConfig> {
        Ok(ActorUpdateConfig {
            loss: self.loss.to_config()?,
            ppo_mini_batch_size: self.ppo_mini_batch_size as usize,
            rollout_n: self.rollout_n as usize,
            micro_batching: self.micro_batching.into(),
            ppo_epochs: self.ppo_epochs as usize,
            shuffle: self.shuffle,
            shuffle_seed: self.shuffle_seed,
            grad_clip: self.grad_clip,
            temperature: self.temperature,
        })
    }
}

/// Policy: verl's `update_policy` over these rows; replies with the `actor/*` metrics.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct UpdatePolicy {
    /// The rows.
    pub rows: Vec<RowIds>,
    /// Old log-probabilities per response token.
    pub old_log_probs: Vec<f32>,
    /// Reference log-probabilities per response token (with `use_kl_loss`).
    pub ref_log_probs: Option<Vec<f32>>,
    /// Advantages per response token.
    pub advantages: Vec<f32>,
    /// The update's keys.
    pub keys: UpdateKeys,
}

impl UpdatePolicy {
    /// The update over `batch` (it must hold old log-probabilities and advantages) with `cfg`.
    pub fn new(batch: &RlBatch, cfg: &ActorUpdateConfig) -> Result<Self> {
        let (Some(old), Some(adv)) = (&batch.old_log_probs, &batch.advantages) else {
            bail!("UpdatePolicy: the batch needs old log-probabilities and advantages");
        };
        Ok(Self {
            rows: RowIds::of(batch),
            old_log_probs: token_values(batch, old)?,
            ref_log_probs: match &batch.ref_log_probs {
                Some(r) => Some(token_values(batch, r)?),
                None => None,
            },
            advantages: token_values(batch, adv)?,
            keys: UpdateKeys::from(cfg),
        })
    }
}

/// Policy: its full current weights as a [`WeightsPayload`] of `dtype`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ExportWeights {
    /// The payload's element type.
    pub dtype: WireDtype,
}

/// Policy: put its full current weights of `dtype` into the cluster's object store and reply with their header
/// and the object ([`PublishedWeights`]). The blob is in shared memory where the host allows it, so a rollout on
/// the policy's host maps it instead of receiving a copy. The policy keeps the object alive until
/// [`ReleaseWeights`] or its next publish.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct PublishWeights {
    /// The blob's element type.
    pub dtype: WireDtype,
}

/// The reply to [`PublishWeights`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct PublishedWeights {
    /// What the blob holds.
    pub header: WeightsHeader,
    /// The blob (a borrowed handle: the policy holds the owner's).
    pub object: ObjectRef,
}

/// Policy: free the weights of its last [`PublishWeights`] (once every rollout loaded them).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ReleaseWeights;

/// Policy: write the trainable weights, AdamW's state and the step counters into the folder `dir` (the files of
/// `GrpoTrainer::save`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct SaveState {
    /// Output folder.
    pub dir: String,
    /// The run's completed steps, recorded as `global_step`.
    pub global_step: u64,
}

/// Policy: restore what [`SaveState`] (or `GrpoTrainer::save`) wrote; replies with the saved `global_step`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct LoadState {
    /// The folder.
    pub dir: String,
}

ferl_runtime::message! {
    Generate => Generations;
    LoadWeights => WeightsLoaded;
    ComputeLogProb => TokenValues;
    UpdatePolicy => Vec<(String, f64)>;
    ExportWeights => WeightsPayload;
    PublishWeights => PublishedWeights;
    ReleaseWeights => ();
    SaveState => ();
    LoadState => u64;
}
