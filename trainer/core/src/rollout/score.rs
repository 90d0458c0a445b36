//! Scoring: per-token log-probabilities and entropies of given prompt + response tokens in one forward pass without
//! a cache (verl's `compute_log_prob` of the old or reference policy), through the same layer functions and the same
//! log-probability convention as generation ([`super::sampling::token_log_probs`]).
//!
//! The sequences form one right-padded micro-batch ([`crate::batch::MicroBatch`]: positions restart at 0 per
//! sequence, causal attention, so real tokens never see padding); only the rows predicting a response token reach the
//! output projection, in chunks of rows so that no `[tokens, vocab]` matrix exists whole.

use super::sampling::token_log_probs;
use super::RolloutModel;
use crate::batch::{Layout, MicroBatch, SampleRef};
use crate::model::layers::{self, Attention, Rope};
use anyhow::Result;
use tch::{Device, Kind, Tensor};

/// Logits of at most this many elements exist at once while scoring.
const CHUNK_ELEMENTS: i64 = 1 << 24;

/// One sequence to score: its response tokens are scored, each given every token before it.
#[derive(Clone, Copy, Debug)]
pub struct ScoreRequest<'a> {
    /// Prompt token ids (at least one).
    pub prompt: &'a [i64],
    /// Response token ids (may be empty).
    pub response: &'a [i64],
}

/// Per response token of one sequence: `log_softmax(logits / T)` of the token and the entropy of that distribution.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenScores {
    /// Log-probability of each response token, fp32.
    pub log_probs: Vec<f32>,
    /// Entropy of each response token's distribution, fp32 (empty unless asked for).
    pub entropy: Vec<f32>,
}

impl RolloutModel {
    /// Scores the response tokens of `seqs` under the model at `temperature` (`T` of `log_softmax(logits / T)`; pass
    /// [`super::SamplingParams::log_prob_temperature`] to match a rollout), with entropies when `entropy`. All
    /// sequences run as one micro-batch.
    pub fn score(
        &self,
        seqs: &[ScoreRequest<'_>],
        temperature: f64,
        entropy: bool,
    ) -> Result<Vec<TokenScores>> {
        anyhow::ensure!(
            temperature > 0.0 && temperature.is_finite(),
            "scoring temperature {temperature} must be positive"
        );
        for (i, s) in seqs.iter().enumerate() {
            self.check_tokens("scored prompt", i, s.prompt, false)?;
            self.check_tokens("scored response", i, s.response, true)?;
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let _g = tch::no_grad_guard();
        let ids: Vec<Vec<i64>> = seqs
            .iter()
            .map(|s| [s.prompt, s.response].concat())
            .collect();
        let masks: Vec<Vec<bool>> = seqs
            .iter()
            .map(|s| {
                (0..s.prompt.len() + s.response.len())
                    .map(|t| t >= s.prompt.len())
                    .collect()
            })
            .collect();
        let samples: Vec<SampleRef<'_>> = ids
            .iter()
            .zip(&masks)
            .map(|(input_ids, loss_mask)| SampleRef {
                input_ids,
                loss_mask,
            })
            .collect();
        let mb = MicroBatch::new(&samples, Layout::Padded, self.device())?;
        let (lp, h) = self.score_rows(&mb, temperature, entropy)?;
        let lens: Vec<usize> = seqs.iter().map(|s| s.response.len()).collect();
        Ok(split(&lp, h.as_deref(), &lens))
    }

    /// Log-probabilities (and entropies) of `mb`'s target rows, on the host.
    fn score_rows(
        &self,
        mb: &MicroBatch,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let rope = Rope::new(&self.cfg, &mb.positions, self.kind);
        let mut h = self.embed(&mb.input_ids);
        for l in 0..self.cfg.num_layers {
            h = self.layer(l, &h, |p, d, x| {
                layers::attention(&self.cfg, d, p, x, &rope, &Attention::Causal)
            });
        }
        let rows = h
            .reshape([-1, self.cfg.hidden_size])
            .index_select(0, &mb.target_rows);
        let per_chunk = (CHUNK_ELEMENTS / self.cfg.vocab_size).max(1);
        let (mut lps, mut hs) = (Vec::new(), Vec::new());
        for start in (0..mb.num_targets).step_by(per_chunk as usize) {
            let n = per_chunk.min(mb.num_targets - start);
            let logits = self.logits(&rows.narrow(0, start, n));
            let targets = mb.target_ids.narrow(0, start, n);
            let (lp, ent) = token_log_probs(&logits, &targets, temperature, entropy);
            lps.push(lp);
            hs.extend(ent);
        }
        let host = |v: Vec<Tensor>| -> Result<Vec<f32>> {
            if v.is_empty() {
                return Ok(Vec::new());
            }
            let t = Tensor::cat(&v, 0)
                .to_kind(Kind::Float)
                .to_device(Device::Cpu);
            Ok(Vec::<f32>::try_from(t)?)
        };
        let ent = if entropy { Some(host(hs)?) } else { None };
        Ok((host(lps)?, ent))
    }
}

/// Consecutive runs of `lens[i]` values of `lp` (and `h`) per sequence.
fn split(lp: &[f32], h: Option<&[f32]>, lens: &[usize]) -> Vec<TokenScores> {
    let mut start = 0;
    lens.iter()
        .map(|&n| {
            let range = start..start + n;
            start += n;
            TokenScores {
                log_probs: lp[range.clone()].to_vec(),
                entropy: h.map(|h| h[range].to_vec()).unwrap_or_default(),
            }
        })
        .collect()
}
