//! Generation (rollouts) and one-pass scoring with the trainer's own model code and weights (design note 13).
//!
//! - [`RolloutModel`]: a model's parameters grouped by stage on one device, in one dtype, loaded from a Hugging Face
//!   folder the way the trainer loads it ([`crate::model::load_model`]) or snapshotted from a [`ParamStore`].
//! - [`cache`]: the KV cache. Prompts of different lengths are **left-padded** into one batch; every token's RoPE
//!   position counts only its own sequence's tokens (`0..prompt_len`, then `prompt_len + step`), and padding keys
//!   are masked out, so each sequence's result is that of generating it alone.
//! - [`sampling`]: greedy, temperature, top-k and top-p sampling with a seeded generator of its own (ChaCha8 on the
//!   host, one uniform draw per sequence and step, so the same seed gives the same tokens on any device and does not
//!   depend on torch's global generator).
//! - [`generate`]: prefill the batch, then decode one token per step for every sequence; a sequence stops at an EOS
//!   token (kept in its response) or at `max_response_length`. The prefill (`prefill`) runs the prompts' real tokens
//!   packed in one row, without their padding, attends packed, and scatters only the keys and values into the padded
//!   cache; a decode step writes its logits into buffers kept from step to step (`head`); greedy decoding on the CPU
//!   reads its token and log-probability straight from the output product in one pass (`greedy`).
//! - [`score`]: per-token log-probabilities and entropies of given prompt + response tokens in one forward pass,
//!   without a cache (verl's `compute_log_prob`).
//!
//! # Log-probability convention
//! Every log-probability here, sampled or scored, is `log_softmax(logits / T)` of the token, computed in fp32 from the
//! model's raw fp32 logits, with `T` the sampling temperature when it is positive and 1 otherwise
//! ([`SamplingParams::log_prob_temperature`]). That is what verl's actor recomputes as `old_log_prob`
//! (`logits.div_(temperature)`), so a rollout's log-probabilities and their recomputation agree. Top-k and top-p
//! restrict which tokens can be sampled but do not renormalise the log-probability (verl's recompute does not see them
//! either). Entropies are of the same `softmax(logits / T)`.
//!
//! # Invariants
//! 1. A sequence's tokens and log-probabilities do not depend on the other prompts of its batch (up to floating-point
//!    rounding of the batched matmuls): positions and attention are per sequence.
//! 2. The log-probabilities [`RolloutModel::generate`] returns equal those [`RolloutModel::score`] computes for the
//!    same prompt + response in one pass (within fp32 rounding).
//! 3. The same [`SamplingParams::seed`] and prompts give the same tokens.
//!
//! The layer functions are the built-in ops of [`crate::model::layers`] (kernel overrides are a training concern). On
//! the CPU a decode step's few rows multiply the weights from the left ([`crate::model::layers::matmul_t`]).

pub mod cache;
pub mod generate;
mod greedy;
mod head;
mod prefill;
mod reload;
pub mod sampling;
pub mod score;
#[cfg(test)]
mod tests;

pub use generate::{Generated, GenerationConfig};
pub use sampling::SamplingParams;
pub use score::{ScoreRequest, TokenScores};

use crate::model::config::ModelConfig;
use crate::model::layers;
use crate::model::layout::{DecoderParam, ModelLayout, Stage};
use crate::model::lora;
use crate::params::ParamStore;
use anyhow::{bail, Result};
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// A device named as on the command line: `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => match s.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Ok(Device::Cuda(n)),
            None => bail!("device `{s}`: expected cpu, cuda or cuda:N"),
        },
    }
}

/// A compute dtype named as on the command line: `fp32`/`float32` or `bf16`/`bfloat16`.
pub fn parse_dtype(s: &str) -> Result<Kind> {
    match s {
        "fp32" | "float32" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        other => bail!("dtype `{other}`: expected fp32 or bf16"),
    }
}

/// Makes `device` usable: for a CUDA device, loads libtorch_cuda (which the linker may have dropped, see
/// [`ferl_collective::load_torch_cuda`]) and checks that torch sees the device.
pub fn ensure_device(device: Device) -> Result<()> {
    let Device::Cuda(index) = device else {
        return Ok(());
    };
    ferl_collective::load_torch_cuda()?;
    let count = tch::Cuda::device_count();
    if index >= count as usize {
        bail!("device cuda:{index} asked for, but torch sees {count} CUDA device(s)");
    }
    Ok(())
}

/// A model ready to generate and score: every stage's parameters, without gradients, on one device in one dtype.
pub struct RolloutModel {
    cfg: ModelConfig,
    decoder: DecoderParam,
    embed: Tensor,
    layers: Vec<Vec<Tensor>>,
    norm: Tensor,
    lm_head: Tensor,
    kind: Kind,
}

impl RolloutModel {
    /// Loads the Hugging Face folder `dir` (config.json and safetensors, as the trainer does) onto `device`,
    /// computing in `kind` (`Kind::Float` or `Kind::BFloat16`).
    pub fn load(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let model = crate::model::load_model(dir)?;
        Self::from_params(model.config, &model.layout, &model.params, device, kind)
    }

    /// A model from parameters in `layout.tensors` order (e.g. a [`crate::model::LoadedModel`]'s), copied or
    /// cast to `device` and `kind` (fp32 parameters already there are shared, not copied).
    pub fn from_params(
        cfg: ModelConfig,
        layout: &ModelLayout,
        params: &[Tensor],
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        if params.len() != layout.tensors.len() {
            bail!(
                "{} parameters for a layout of {} tensors",
                params.len(),
                layout.tensors.len()
            );
        }
        ensure_device(device)?;
        let _g = tch::no_grad_guard();
        let stage = |s: Stage| -> Result<Vec<Tensor>> {
            Ok(layout
                .stage_ids(s)?
                .iter()
                .map(|&i| params[i].detach().to_device(device).to_kind(kind))
                .collect())
        };
        Self::from_stages(cfg, layout.decoder, kind, stage)
    }

    /// A snapshot of the parameters in `store` (each stage gathered once, copied, released), computing in `kind`
    /// on the store's device: the weights of the policy being trained, as verl syncs them into its rollout engine.
    pub fn from_store<P: ParamStore>(cfg: ModelConfig, store: &mut P, kind: Kind) -> Result<Self> {
        let _g = tch::no_grad_guard();
        let decoder = store.layout().decoder;
        let mut stage = |s: Stage| -> Result<Vec<Tensor>> {
            let p = store.gather(s)?;
            let copies = p
                .tensors
                .iter()
                .map(|t| t.detach().to_kind(kind).copy())
                .collect();
            store.release(s);
            Ok(copies)
        };
        Self::from_stages(cfg, decoder, kind, &mut stage)
    }

    /// Assembles the model from a function returning each stage's tensors.
    fn from_stages(
        cfg: ModelConfig,
        decoder: DecoderParam,
        kind: Kind,
        mut stage: impl FnMut(Stage) -> Result<Vec<Tensor>>,
    ) -> Result<Self> {
        let embed = stage(Stage::Embedding)?.remove(0);
        // LoRA's adapters are merged into their projections stage by stage, as the stage arrives: generation runs
        // the base model's matrices only.
        let merged = decoder.without_adapters();
        let layers = (0..cfg.num_layers)
            .map(|l| {
                let mut tensors = stage(Stage::Decoder(l))?;
                if !decoder.lora.is_empty() {
                    lora::merge_stage(&decoder, &mut tensors);
                }
                Ok(tensors)
            })
            .collect::<Result<Vec<_>>>()?;
        let decoder = merged;
        let mut head = stage(Stage::Head)?.into_iter();
        let (norm, lm_head) = match (head.next(), head.next()) {
            (Some(n), Some(w)) => (n, w),
            _ => bail!("the head stage must hold the final norm and the output matrix"),
        };
        Ok(Self {
            cfg,
            decoder,
            embed,
            layers,
            norm,
            lm_head,
            kind,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device the parameters live on.
    pub fn device(&self) -> Device {
        self.embed.device()
    }

    /// The dtype the model computes in (logits and log-probabilities are fp32 whatever it is).
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Token embeddings of `ids` (`[B, T]`).
    fn embed(&self, ids: &Tensor) -> Tensor {
        layers::embed(&self.embed, ids)
    }

    /// Decoder layer `l` on `h` around `attend`, which gets the layer's parameters, its slots and the normalised
    /// input and returns the attention block's output.
    fn layer(
        &self,
        l: usize,
        h: &Tensor,
        attend: impl FnOnce(&[Tensor], &DecoderParam, &Tensor) -> Tensor,
    ) -> Tensor {
        let (p, d) = (&self.layers[l], &self.decoder);
        layers::decoder_layer_with(&self.cfg, d, p, h, |x| attend(p, d, x))
    }

    /// Refuses empty sequences and token ids outside the vocabulary, naming the sequence (`what` names the kind).
    fn check_tokens(&self, what: &str, i: usize, ids: &[i64], allow_empty: bool) -> Result<()> {
        if ids.is_empty() && !allow_empty {
            bail!("{what} {i} is empty: generation and scoring need at least one prompt token");
        }
        let vocab = self.cfg.vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= vocab) {
            bail!("{what} {i}: token id {bad} is outside the vocabulary (size {vocab})");
        }
        Ok(())
    }
}
