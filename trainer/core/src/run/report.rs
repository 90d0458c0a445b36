//! The metric names every launch path logs, and the values of one step.

use super::StepOutcome;

/// Metric names (invariant 2 of [`super`]): the same keys from every path.
pub mod metric {
    /// Token-mean training loss over the global batch.
    pub const LOSS: &str = "train/loss";
    /// Learning rate of the step.
    pub const LR: &str = "train/lr";
    /// Global gradient norm before clipping.
    pub const GRAD_NORM: &str = "train/grad_norm";
    /// Real (non-pad) tokens of the global batch.
    pub const TOKENS: &str = "train/tokens";
    /// 1 when the update was skipped (non-finite gradient norm).
    pub const SKIPPED: &str = "train/skipped_step";
    /// Real tokens per second of wall time, all ranks together.
    pub const TOKENS_PER_S: &str = "perf/tokens_per_s";
    /// Wall time of the step.
    pub const STEP_SECONDS: &str = "perf/step_seconds";
    /// Prefix of each rank's peak memory in GiB, `perf/max_memory_gb/rank_R`: peak resident memory on CPU; device
    /// memory in use on CUDA (driver's total − free: torch's reservations + context, and any other process's memory
    /// on the device), the highest of the samples taken at the end of each step.
    pub const MAX_MEMORY_GB: &str = "perf/max_memory_gb";
    /// Model FLOPs utilisation, where the device's peak is known.
    pub const MFU: &str = "perf/mfu";
    /// Token-mean validation loss.
    pub const VAL_LOSS: &str = "val/loss";
}

/// What `perf/mfu` needs besides the step.
#[derive(Clone, Copy, Debug)]
pub struct MfuInputs {
    /// Parameters of the model.
    pub num_params: i64,
    /// Peak FLOP/s of one device.
    pub peak_flops: f64,
}

/// The named values of one step.
pub fn step_values(
    out: &StepOutcome,
    seconds: f64,
    mfu_in: Option<&MfuInputs>,
) -> Vec<(String, f64)> {
    let mut v = match out.metrics.is_empty() {
        true => vec![
            (metric::LOSS.to_string(), out.loss),
            (metric::LR.to_string(), out.lr),
            (metric::GRAD_NORM.to_string(), out.grad_norm),
            (metric::TOKENS.to_string(), out.tokens as f64),
        ],
        false => out.metrics.clone(),
    };
    v.push((
        metric::TOKENS_PER_S.to_string(),
        out.tokens as f64 / seconds.max(1e-9),
    ));
    v.push((metric::STEP_SECONDS.to_string(), seconds));
    if out.skipped {
        v.push((metric::SKIPPED.to_string(), 1.0));
    }
    for (rank, bytes) in out.peak_memory_bytes.iter().enumerate() {
        let gib = *bytes as f64 / (1u64 << 30) as f64;
        v.push((format!("{}/rank_{rank}", metric::MAX_MEMORY_GB), gib));
    }
    if let Some(m) = mfu_in {
        let devices = out.peak_memory_bytes.len().max(1);
        let value = mfu(m.num_params, out.tokens, seconds, devices, m.peak_flops);
        v.push((metric::MFU.to_string(), value));
    }
    v
}

/// Dense bf16 peak FLOP/s of one device: `FERL_PEAK_FLOPS` when set, else looked up by the GPU's name from
/// `nvidia-smi` (H100/H200: 989e12, A100: 312e12, L40S: 362e12), else unknown (the CPU has no listed peak).
pub fn peak_flops(on_gpu: bool) -> Option<f64> {
    if let Some(v) = std::env::var("FERL_PEAK_FLOPS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Some(v);
    }
    if !on_gpu {
        return None;
    }
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()?;
    let name = String::from_utf8_lossy(&out.stdout).to_uppercase();
    [
        ("H200", 989e12),
        ("H100", 989e12),
        ("A100", 312e12),
        ("L40S", 362e12),
    ]
    .iter()
    .find(|(k, _)| name.contains(k))
    .map(|&(_, v)| v)
}

/// Model FLOPs utilisation: `6 * params * tokens` (forward and backward) over the step time and the peak of
/// `devices` devices.
pub fn mfu(num_params: i64, tokens: i64, seconds: f64, devices: usize, peak: f64) -> f64 {
    6.0 * num_params as f64 * tokens as f64 / (seconds.max(1e-9) * devices as f64 * peak)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_reports_the_same_names() {
        let out = StepOutcome {
            loss: 2.0,
            grad_norm: 1.0,
            lr: 1e-5,
            skipped: false,
            tokens: 100,
            peak_memory_bytes: vec![1 << 30, 2 << 30],
            metrics: Vec::new(),
        };
        let m = MfuInputs {
            num_params: 10,
            peak_flops: 1e3,
        };
        let v = step_values(&out, 2.0, Some(&m));
        let names: Vec<&str> = v.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "train/loss",
                "train/lr",
                "train/grad_norm",
                "train/tokens",
                "perf/tokens_per_s",
                "perf/step_seconds",
                "perf/max_memory_gb/rank_0",
                "perf/max_memory_gb/rank_1",
                "perf/mfu"
            ]
        );
        assert_eq!(v[4].1, 50.0);
        assert_eq!(v[7].1, 2.0);
        assert!((v[8].1 - 6.0 * 10.0 * 100.0 / (2.0 * 2.0 * 1e3)).abs() < 1e-12);
    }
}
