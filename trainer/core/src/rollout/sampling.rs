//! Choosing the next token from fp32 logits: greedy, or sampling with temperature, top-k and top-p from a seeded
//! generator of our own; and the log-probability (and entropy) convention every path shares ([`token_log_probs`]).
//!
//! Sampling is by inverse CDF: the candidates are sorted by logit, those outside top-k / top-p are dropped, and the
//! token is where a uniform draw `u ∈ [0, 1)` falls in the cumulative probabilities of the rest. One `u` per sequence
//! and step comes from a ChaCha8 generator seeded with [`SamplingParams::seed`] on the host, so results depend on the
//! seed and the model only (not on torch's global generator, nor on the device's random number generator).

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};

/// How tokens are chosen (verl's rollout keys `do_sample`, `temperature`, `top_k`, `top_p`, plus a seed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Sample (true) or take the most likely token (false: greedy, whatever the other keys say).
    pub do_sample: bool,
    /// Divides the logits before sampling; 0 means greedy. Also the `T` of the log-probabilities (see the module
    /// docs of [`crate::rollout`]).
    pub temperature: f64,
    /// Sample only among the `top_k` most likely tokens; 0 or negative: no limit (vLLM's -1).
    pub top_k: i64,
    /// Sample only among the most likely tokens whose probabilities add up to `top_p` (nucleus); 1: no limit.
    pub top_p: f64,
    /// Seed of the sampling generators (one per row, see `GenerationConfig::first_row`): the same seed and inputs
    /// give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy decoding (verl's validation default `do_sample=False`).
    fn default() -> Self {
        Self {
            do_sample: false,
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Sampling at `temperature` without top-k or top-p, seeded with `seed`.
    pub fn sample(temperature: f64, seed: u64) -> Self {
        Self {
            do_sample: true,
            temperature,
            seed,
            ..Self::default()
        }
    }

    /// Whether tokens are chosen by argmax (`do_sample` false or temperature 0).
    pub fn is_greedy(&self) -> bool {
        !self.do_sample || self.temperature == 0.0
    }

    /// The `T` of the reported log-probabilities `log_softmax(logits / T)`: the temperature when it is positive
    /// (also under greedy decoding, as verl's recompute divides by its configured temperature), else 1.
    pub fn log_prob_temperature(&self) -> f64 {
        if self.temperature > 0.0 {
            self.temperature
        } else {
            1.0
        }
    }

    /// Refuses values that sample nothing: a negative or non-finite temperature, `top_p` outside `(0, 1]`.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("temperature {} must be finite and >= 0", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p {} must be in (0, 1]", self.top_p);
        }
        Ok(())
    }
}

/// Per-token log-probabilities `log_softmax(logits / temperature)[target]` (`[n]` fp32) of fp32 `logits` (`[n, V]`),
/// and with `entropy` the entropy of each row's `softmax(logits / temperature)`.
pub fn token_log_probs(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
    entropy: bool,
) -> (Tensor, Option<Tensor>) {
    let ls = log_softmax_at(logits, temperature, None);
    let lp = ls.gather(1, &targets.unsqueeze(1), false).squeeze_dim(1);
    let h = entropy.then(|| -(ls.exp() * &ls).sum_dim_intlist(1, false, Kind::Float));
    (lp, h)
}

/// `log_softmax(logits / temperature)` in fp32 (`[n, V]`), written into `out` when given (fp32, `logits`' shape).
fn log_softmax_at(logits: &Tensor, temperature: f64, out: Option<&Tensor>) -> Tensor {
    let logits = logits.to_kind(Kind::Float);
    let scaled = if temperature == 1.0 {
        logits
    } else {
        logits / temperature
    };
    match out {
        Some(out) => scaled.log_softmax_int_out(out, -1, Kind::Float),
        None => scaled.log_softmax(-1, Kind::Float),
    }
}

/// Picks tokens for a batch, step after step, with a generator per row: row `i` draws from the stream of
/// [`row_seed`]`(seed, first_row + i)`, so a row's tokens depend on the seed, its index in the whole rollout batch
/// and the model, never on how the batch is split between ranks or calls.
pub(crate) struct Sampler {
    params: SamplingParams,
    first_row: u64,
    rngs: Vec<ChaCha8Rng>,
    /// The last step's `[B, V]` log-softmax, whose memory the next step reuses (a new 10 MB tensor per step costs
    /// page faults).
    log_softmax: Option<Tensor>,
}

impl Sampler {
    /// The parameters this sampler follows.
    pub(crate) fn params(&self) -> SamplingParams {
        self.params
    }

    /// A sampler seeded with `params.seed` whose first row is row `first_row` of the rollout batch.
    pub(crate) fn new(params: SamplingParams, first_row: u64) -> Self {
        Self {
            params,
            first_row,
            rngs: Vec::new(),
            log_softmax: None,
        }
    }

    /// One uniform draw in `[0, 1)` for each of `b` rows (the generators are made on the first call).
    fn draws(&mut self, b: usize) -> Vec<f64> {
        if self.rngs.len() != b {
            let (seed, first) = (self.params.seed, self.first_row);
            self.rngs = (0..b as u64)
                .map(|i| ChaCha8Rng::seed_from_u64(row_seed(seed, first + i)))
                .collect();
        }
        self.rngs.iter_mut().map(|r| r.random::<f64>()).collect()
    }

    /// The next token of each row of fp32 `logits` (`[B, V]`) and its log-probability (`[B]` int64, `[B]` fp32).
    /// Draws one uniform number per row even under greedy decoding, so sequences keep their draws whatever stops.
    pub(crate) fn pick(&mut self, logits: &Tensor) -> (Tensor, Tensor) {
        let _g = tch::no_grad_guard();
        let b = logits.size()[0];
        let u = self.draws(b as usize);
        let tokens = if self.params.is_greedy() {
            logits.argmax(-1, false)
        } else {
            let u = Tensor::from_slice(&u).to_device(logits.device());
            self.sample(logits, &u)
        };
        let lp = self.log_probs(logits, &tokens);
        (tokens, lp)
    }

    /// `log_softmax(logits / T)[tokens]` (`[B]` fp32), as [`token_log_probs`] computes it, into reused memory.
    fn log_probs(&mut self, logits: &Tensor, tokens: &Tensor) -> Tensor {
        let out = match &self.log_softmax {
            Some(t) if t.size() == logits.size() && t.device() == logits.device() => {
                t.shallow_clone()
            }
            _ => Tensor::empty(logits.size(), (Kind::Float, logits.device())),
        };
        let temperature = self.params.log_prob_temperature();
        let ls = log_softmax_at(logits, temperature, Some(&out));
        self.log_softmax = Some(out);
        ls.gather(1, &tokens.unsqueeze(1), false).squeeze_dim(1)
    }

    /// Inverse-CDF sampling of each row of `logits / temperature` restricted by top-k and top-p, with draws `u`
    /// (`[B]` fp64 in `[0, 1)`). Without a restriction the CDF runs over the vocabulary in its own order (no sort);
    /// with top-k only over the `k` largest logits (`topk`); top-p needs every probability in descending order.
    fn sample(&self, logits: &Tensor, u: &Tensor) -> Tensor {
        let p = &self.params;
        let vocab = logits.size()[1];
        let scaled = logits / p.temperature;
        let top_k = (p.top_k > 0 && p.top_k < vocab).then_some(p.top_k);
        let (candidates, order) = match (top_k, p.top_p < 1.0) {
            (None, false) => return inverse_cdf(&scaled.softmax(-1, Kind::Double), u),
            (Some(k), false) => scaled.topk(k, -1, true, true),
            (_, true) => {
                let (sorted, order) = scaled.sort(-1, true);
                let k = top_k.unwrap_or(vocab);
                (sorted.narrow(1, 0, k), order.narrow(1, 0, k))
            }
        };
        let mut probs = candidates.softmax(-1, Kind::Double);
        if p.top_p < 1.0 {
            // Keep a token while the mass of the tokens before it is below top_p (the first is always kept).
            let before = probs.cumsum(-1, Kind::Double) - &probs;
            probs *= before.lt(p.top_p).to_kind(Kind::Double);
        }
        order
            .gather(1, &inverse_cdf(&probs, u).unsqueeze(1), false)
            .squeeze_dim(1)
    }
}

/// The seed of row `row`'s generator in a batch sampled with `seed` (SplitMix64 of the two).
pub fn row_seed(seed: u64, row: u64) -> u64 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    mix(mix(seed) ^ row)
}

/// For each row of (unnormalised, non-negative) `probs` `[B, N]`, the first column whose cumulative mass exceeds
/// `u · total` — never a zero-mass column.
fn inverse_cdf(probs: &Tensor, u: &Tensor) -> Tensor {
    let n = probs.size()[1];
    let cdf = probs.cumsum(-1, Kind::Double);
    let target = u.unsqueeze(1) * cdf.select(1, n - 1).unsqueeze(1);
    cdf.le_tensor(&target)
        .sum_dim_intlist(1, false, Kind::Int64)
        .clamp_max(n - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Tensor {
        Tensor::from_slice(&[2.0f32, 1.0, 0.5, -1.0, 3.0, 0.0]).view([1, 6])
    }

    /// Frequencies of each token over `n` draws of one row.
    fn frequencies(params: SamplingParams, n: usize) -> Vec<f64> {
        let mut s = Sampler::new(params, 0);
        let row = logits().repeat([n as i64, 1]);
        let (tokens, _) = s.pick(&row);
        let counts = tokens.bincount::<Tensor>(None, 6);
        Vec::<f64>::try_from(counts.to_kind(Kind::Double) / n as f64).unwrap()
    }

    #[test]
    fn sampling_follows_softmax_and_respects_top_k_and_top_p() {
        let n = 20_000;
        let freq = frequencies(SamplingParams::sample(1.0, 1), n);
        let expected = Vec::<f64>::try_from(logits().softmax(-1, Kind::Double).view([-1])).unwrap();
        for (f, e) in freq.iter().zip(&expected) {
            assert!((f - e).abs() < 0.015, "frequency {f} vs probability {e}");
        }
        let top2 = SamplingParams {
            top_k: 2,
            ..SamplingParams::sample(1.0, 2)
        };
        let freq = frequencies(top2, n);
        assert!(freq[4] > 0.6 && freq[0] > 0.2, "{freq:?}");
        assert_eq!(freq[1] + freq[2] + freq[3] + freq[5], 0.0, "{freq:?}");
        // softmax: token 4 has 0.61, token 0 0.22: top_p 0.5 keeps token 4 alone, 0.7 keeps both.
        let nucleus = |top_p| SamplingParams {
            top_p,
            ..SamplingParams::sample(1.0, 3)
        };
        assert_eq!(frequencies(nucleus(0.5), n)[4], 1.0);
        let freq = frequencies(nucleus(0.7), n);
        assert!(
            (freq[4] + freq[0] - 1.0).abs() < 1e-12 && freq[0] > 0.2,
            "{freq:?}"
        );
    }

    #[test]
    fn greedy_takes_the_argmax_and_log_probs_use_the_temperature() {
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.5,
                ..SamplingParams::default()
            },
            0,
        );
        let (t, lp) = s.pick(&logits());
        assert_eq!(t.int64_value(&[0]), 4);
        let expected = (logits() / 0.5)
            .log_softmax(-1, Kind::Float)
            .double_value(&[0, 4]);
        assert!((lp.double_value(&[0]) - expected).abs() < 1e-6);
        let (_, h) = token_log_probs(&logits(), &t, 1.0, true);
        let p = logits().softmax(-1, Kind::Double);
        let e = -(&p * p.log()).sum(Kind::Double).double_value(&[]);
        assert!((h.unwrap().double_value(&[0]) - e).abs() < 1e-6);
        assert!(SamplingParams::sample(-1.0, 0).validate().is_err());
        let zero_p = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert!(zero_p.validate().is_err());
    }
}
