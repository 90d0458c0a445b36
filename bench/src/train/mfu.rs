//! `cpu_mfu` (issue #13): model FLOP/s of a CPU training run ÷ the GEMM peak that the same run measures on the same
//! threads (a large fp32 matmul), for one process and for sharded ranks.
//!
//! # The numerator: the model's FLOPs over the real tokens
//! Per sample of `n` real tokens (padding excluded) with `t` target positions:
//! `6 · N_body · n + 6 · V · d · t + 12 · L · d_attn · n²` — every non-embedding parameter does a multiply-add per
//! token in forward and two in backward; the output projection (`V × d`, tied or not) is needed only for the rows
//! whose next token is a target; attention scores and the weighted sum over the sample's own `n` keys, forward and
//! backward, PaLM's convention (the whole square, not the causal half; as `shape::step_flops`). The embedding lookup
//! costs nothing. Norms, RoPE, softmax, the optimizer and recomputation are not counted.
//!
//! The same numerator divides every side's time (ferl and the PyTorch peer do the same useful work; PyTorch also
//! projects non-target rows, which is work the model did not need). `cpu_mfu_6n` rows use the common `6 · N · n`
//! convention instead (every parameter, the head included, on every real token, plus the attention term), which
//! credits a run for head rows it skipped; both are printed so neither is mistaken for the other.
//!
//! # The denominator: the GEMM peak on the same threads
//! [`gemm_peak_flops`] times a `1024 × 1024 × 1024` fp32 matmul (two warm-ups, best of five) with the thread count
//! the run trains with; sharded ranks each measure it at the same moment (after a barrier), and the group's peak is
//! the sum, so ranks that share cores are measured sharing them.

use crate::train::common::SideRecord;
use ferl::actors::messages::Sample;
use ferl::trainer::model::config::ModelConfig;
use ferl::trainer::model::layout::ModelLayout;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Side of the square matmul that measures the peak.
const GEMM_N: i64 = 1024;

/// The FLOP counts of one model (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(super) struct FlopModel {
    /// Parameters outside the embedding and the output projection.
    body: f64,
    /// Elements of the output projection (`vocab × hidden`).
    head: f64,
    /// Every stored parameter (the `6 · N` convention).
    all: f64,
    /// `12 · layers · heads · head_dim`: attention FLOPs per squared token.
    attention: f64,
}

impl FlopModel {
    /// The counts of `cfg`'s model.
    pub(super) fn of(cfg: &ModelConfig) -> Self {
        let all = ModelLayout::new(cfg).num_params() as f64;
        let head = (cfg.vocab_size * cfg.hidden_size) as f64;
        let stored_vocab_mats = if cfg.tie_word_embeddings { 1.0 } else { 2.0 };
        Self {
            body: all - stored_vocab_mats * head,
            head,
            all,
            attention: 12.0 * cfg.num_layers as f64 * (cfg.num_heads * cfg.head_dim) as f64,
        }
    }

    /// Model FLOPs of one sample of `tokens` real tokens with `targets` target positions.
    pub(super) fn sample_flops(&self, tokens: i64, targets: i64) -> f64 {
        let n = tokens as f64;
        6.0 * self.body * n + 6.0 * self.head * targets as f64 + self.attention * n * n
    }

    /// The `6 · N · tokens` (plus attention) count of one sample.
    pub(super) fn sample_flops_6n(&self, tokens: i64) -> f64 {
        let n = tokens as f64;
        6.0 * self.all * n + self.attention * n * n
    }

    /// Both counts, summed over the timed steps (all but the first) of `steps` global batches of `batch` samples.
    pub(super) fn timed_flops(&self, samples: &[Sample], batch: usize, steps: usize) -> (f64, f64) {
        let timed = samples.iter().take(batch * steps).skip(batch);
        timed.fold((0.0, 0.0), |(f, f6), s| {
            let n = s.input_ids.len() as i64;
            (
                f + self.sample_flops(n, s.num_targets()),
                f6 + self.sample_flops_6n(n),
            )
        })
    }
}

/// FLOP/s of a `1024³` fp32 matmul on this thread's torch thread pool: two warm-ups, then the best of five.
pub(super) fn gemm_peak_flops() -> f64 {
    let opts = (Kind::Float, Device::Cpu);
    let (a, b) = (
        Tensor::randn([GEMM_N, GEMM_N], opts),
        Tensor::randn([GEMM_N, GEMM_N], opts),
    );
    let out = Tensor::empty([GEMM_N, GEMM_N], opts);
    let mut best = f64::MAX;
    for rep in 0..7 {
        let t0 = Instant::now();
        let _ = a.mm_out(&out, &b);
        let secs = t0.elapsed().as_secs_f64();
        if rep >= 2 {
            best = best.min(secs);
        }
    }
    2.0 * (GEMM_N as f64).powi(3) / best
}

/// The slowest rank's timed seconds.
pub(super) fn slowest_s(ranks: &[SideRecord]) -> f64 {
    ranks.iter().map(SideRecord::timed_s).fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn tiny() -> ModelConfig {
        let v = serde_json::json!({
            "model_type": "qwen2", "hidden_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "intermediate_size": 16, "vocab_size": 100, "tie_word_embeddings": true,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        });
        ModelConfig::from_value(v, Path::new("tiny")).unwrap()
    }

    #[test]
    fn the_head_counts_only_target_rows_and_attention_the_square() {
        let m = FlopModel::of(&tiny());
        assert_eq!(m.head, 800.0);
        assert_eq!(m.attention, 12.0 * 2.0 * 8.0);
        let no_targets = m.sample_flops(10, 0);
        assert_eq!(no_targets, 6.0 * m.body * 10.0 + m.attention * 100.0);
        assert_eq!(m.sample_flops(10, 3) - no_targets, 6.0 * 800.0 * 3.0);
        assert!(
            m.sample_flops_6n(10) > m.sample_flops(10, 9),
            "6N counts the head on every token"
        );
    }

    #[test]
    fn timed_flops_skip_the_warm_up_step() {
        let m = FlopModel::of(&tiny());
        let sample = |n: usize| Sample {
            input_ids: vec![1; n],
            loss_mask: vec![true; n],
        };
        let samples = vec![sample(50), sample(50), sample(3), sample(4)];
        let (f, f6) = m.timed_flops(&samples, 2, 2);
        assert_eq!(f, m.sample_flops(3, 2) + m.sample_flops(4, 3));
        assert_eq!(f6, m.sample_flops_6n(3) + m.sample_flops_6n(4));
    }

    #[test]
    fn the_gemm_peak_is_a_plausible_rate() {
        let peak = gemm_peak_flops();
        assert!(peak > 1e8 && peak < 1e14, "{peak} FLOP/s");
    }
}
