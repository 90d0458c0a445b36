//! Batched generation: left-pad the prompts, prefill them through the KV cache in one pass, then decode one token per
//! step for the whole batch until every sequence has produced an EOS token or `max_response_length` tokens.
//!
//! A finished sequence keeps its row in the batch (its later tokens are padding and are not returned), so the batch
//! shape never changes and the other sequences' draws are not shifted.

use super::cache::KvCache;
use super::head::LogitBuffers;
use super::prefill::PromptBatch;
use super::sampling::{Sampler, SamplingParams};
use super::RolloutModel;
use anyhow::{Context, Result};
use serde_json::Value;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// What to generate: length limit, sampling and stop tokens (verl's rollout `response_length`, `do_sample`,
/// `temperature`, `top_k`, `top_p`).
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationConfig {
    /// Most tokens generated per sequence (the EOS token included).
    pub max_response_length: usize,
    /// How each token is chosen.
    pub sampling: SamplingParams,
    /// A sequence stops after generating any of these (kept as its last token); empty: only the length stops it.
    pub eos_token_ids: Vec<i64>,
    /// The token a finished sequence's row is fed after its EOS token (never returned); any id in the vocabulary
    /// works.
    pub pad_token_id: i64,
    /// The index of the first prompt in the whole rollout batch: prompt `i` samples from stream `first_row + i`
    /// (see [`SamplingParams::seed`]), so a share of the batch generates what the whole batch would for those rows.
    pub first_row: u64,
}

impl GenerationConfig {
    /// `max_response_length` tokens with `sampling`, no stop token, padding with token 0.
    pub fn new(max_response_length: usize, sampling: SamplingParams) -> Self {
        Self {
            max_response_length,
            sampling,
            eos_token_ids: Vec::new(),
            pad_token_id: 0,
            first_row: 0,
        }
    }

    /// Like [`GenerationConfig::new`], with the stop and padding tokens of the model folder `dir`:
    /// `eos_token_id` (a number or a list) and `pad_token_id` of `generation_config.json`, else of `config.json`
    /// (transformers' order); padding falls back to the first EOS token, then 0.
    pub fn from_model_dir(
        dir: &Path,
        max_response_length: usize,
        sampling: SamplingParams,
    ) -> Result<Self> {
        let files = [
            read_json(&dir.join("generation_config.json"))?,
            read_json(&dir.join("config.json"))?,
        ];
        let key = |k: &str| {
            files
                .iter()
                .flatten()
                .find_map(|f| f.get(k).filter(|v| !v.is_null()))
        };
        let eos_token_ids = match key("eos_token_id") {
            None => Vec::new(),
            Some(v) => token_ids(v).with_context(|| format!("{}: eos_token_id", dir.display()))?,
        };
        let pad = match key("pad_token_id") {
            Some(v) => token_ids(v).with_context(|| format!("{}: pad_token_id", dir.display()))?,
            None => Vec::new(),
        };
        let pad_token_id = pad.first().or(eos_token_ids.first()).copied().unwrap_or(0);
        Ok(Self {
            max_response_length,
            sampling,
            eos_token_ids,
            pad_token_id,
            first_row: 0,
        })
    }
}

/// A JSON file, or `None` when it does not exist.
fn read_json(file: &Path) -> Result<Option<Value>> {
    if !file.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    Ok(Some(
        serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))?,
    ))
}

/// A token id or a list of them.
fn token_ids(v: &Value) -> Result<Vec<i64>> {
    let one = |x: &Value| x.as_i64().with_context(|| format!("{x} is not a token id"));
    match v {
        Value::Array(items) => items.iter().map(one).collect(),
        x => Ok(vec![one(x)?]),
    }
}

/// One sequence's generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The response's token ids (ending with the EOS token when one stopped it).
    pub response: Vec<i64>,
    /// `log_softmax(logits / T)` of each response token, fp32 (see [`crate::rollout`]).
    pub log_probs: Vec<f32>,
    /// Whether an EOS token ended the response (else `max_response_length` did).
    pub stopped_at_eos: bool,
}

impl Generated {
    /// The response length in tokens.
    pub fn len(&self) -> usize {
        self.response.len()
    }

    /// Whether the response has no token (only with `max_response_length` 0).
    pub fn is_empty(&self) -> bool {
        self.response.is_empty()
    }
}

impl RolloutModel {
    /// Generates a response to each prompt (token ids) with `config`; see [`crate::rollout`] for the batching,
    /// stop and log-probability rules. All prompts form one batch.
    pub fn generate(
        &self,
        prompts: &[Vec<i64>],
        config: &GenerationConfig,
    ) -> Result<Vec<Generated>> {
        config.sampling.validate()?;
        for (i, p) in prompts.iter().enumerate() {
            self.check_tokens("prompt", i, p, false)?;
        }
        self.check_tokens("the pad token", 0, &[config.pad_token_id], false)?;
        if prompts.is_empty() || config.max_response_length == 0 {
            let empty = Generated {
                response: Vec::new(),
                log_probs: Vec::new(),
                stopped_at_eos: false,
            };
            return Ok(vec![empty; prompts.len()]);
        }
        let _g = tch::no_grad_guard();
        let (tokens, log_probs) = self.decode(prompts, config)?;
        split_responses(&tokens, &log_probs, &config.eos_token_ids)
    }

    /// The decoding loop: `[B, S]` tokens and their log-probabilities on the host (S ≤ `max_response_length`;
    /// a finished row's later columns are padding).
    fn decode(&self, prompts: &[Vec<i64>], config: &GenerationConfig) -> Result<(Tensor, Tensor)> {
        let dev = self.device();
        let steps = config.max_response_length as i64;
        let batch = PromptBatch::new(prompts, dev)?;
        let b = prompts.len() as i64;
        let mut cache = KvCache::new(&self.cfg, b, batch.width() + steps, self.kind, dev);
        let h = self.prefill(&mut cache, &batch)?;
        let mut head = LogitBuffers::default();
        let mut sampler = Sampler::new(config.sampling, config.first_row);
        let mut picked = self.next_tokens(&h, &mut head, &mut sampler);
        let eos = Tensor::from_slice(&config.eos_token_ids).to_device(dev);
        let pad = Tensor::full([b], config.pad_token_id, (Kind::Int64, dev));
        let mut done = Tensor::zeros([b], (Kind::Bool, dev));
        let real = Tensor::ones([b, 1], (Kind::Bool, dev));
        let (mut tokens, mut log_probs) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let (next, lp) = picked;
            let next = next.where_self(&done.logical_not(), &pad);
            if !config.eos_token_ids.is_empty() {
                done = done.logical_or(&Tensor::isin(&next, &eos, false, false));
            }
            tokens.push(next.shallow_clone());
            log_probs.push(lp);
            if step + 1 == steps || done.all().int64_value(&[]) != 0 {
                break;
            }
            let positions = (&batch.lens + step).unsqueeze(1);
            let h = self.forward_cached(&mut cache, &next.unsqueeze(1), &positions, &real)?;
            picked = self.next_tokens(&h.select(1, 0), &mut head, &mut sampler);
        }
        let host = |v: Vec<Tensor>| Tensor::stack(&v, 1).to_device(Device::Cpu);
        Ok((host(tokens), host(log_probs)))
    }
}

/// Each row of `[B, S]` tokens and log-probabilities up to and including its first EOS token.
fn split_responses(tokens: &Tensor, log_probs: &Tensor, eos: &[i64]) -> Result<Vec<Generated>> {
    let (b, s) = (tokens.size()[0], tokens.size()[1]);
    let ids = Vec::<i64>::try_from(tokens.contiguous().view([-1]))?;
    let lps = Vec::<f32>::try_from(log_probs.to_kind(Kind::Float).contiguous().view([-1]))?;
    let rows = (0..b as usize)
        .map(|r| {
            let row = &ids[r * s as usize..(r + 1) * s as usize];
            let stop = row.iter().position(|t| eos.contains(t));
            let n = stop.map_or(row.len(), |i| i + 1);
            let start = r * s as usize;
            Generated {
                response: row[..n].to_vec(),
                log_probs: lps[start..start + n].to_vec(),
                stopped_at_eos: stop.is_some(),
            }
        })
        .collect();
    Ok(rows)
}
