//! `ferl-bench train --packed-attention [--packed-len 8192] [--device cpu|cuda]`: the attention op of a packed
//! micro-batch (`use_remove_padding=true`), forward + backward, in its two forms side by side:
//! - `varlen`: what the engine runs ([`Varlen::attend`]: torch's variable-length kernel on CUDA, causal SDPA per
//!   sequence elsewhere; cost and memory follow `Σ Lᵢ²`);
//! - `dense`: the path it replaced, SDPA under a dense `[1, 1, T, T]` block-diagonal causal mask (built in the
//!   measured region, as the old micro-batch did).
//!
//! The row is `--packed-len` tokens of real GSM8K sequences (the bench's data, tokenized with the chat template, as
//! the train suite does), packed in dataset order; the last one is cut to fill the row exactly. Heads are
//! Qwen2.5-0.5B's (14 query heads, 2 kv heads, head dim 64); fp32 on the CPU, `--dtype` on CUDA.
//!
//! Each form runs in a child process of its own: one warm-up pass, then `ITERS` timed passes. Time: mean wall ms of
//! a timed forward + backward (synchronized on CUDA). Memory (CPU): after the warm-up the child resets its resident
//! high-water mark (`VmHWM`, via `/proc/self/clear_refs`) and reports how far it rose above the resident set of that
//! moment (inputs allocated) over the timed passes — the op's peak working set, mask and scores included (the child
//! runs with glibc's `MALLOC_MMAP_THRESHOLD_=131072`, so freed blocks leave the resident set). On CUDA the memory
//! rows are not measured (tch exposes no allocator statistics).
//!
//! Rows: `packed_attn_{varlen,dense}_ms` and `packed_attn_speedup` (dense ms ÷ varlen ms);
//! `packed_attn_{varlen,dense}_peak_MiB` and `packed_attn_memory_ratio` (dense ÷ varlen);
//! `packed_attn_{varlen,dense}_work_MiB` and `packed_attn_work_ratio` (the same less the tensors every form has: the
//! output, the output's gradient as the backward pass hands it in, and the gradients of q, k, v,
//! `(3·14 + 2·2)·T·64` floats — goal ≥ 5);
//! `packed_attn_sdpa_calls` (SDPA calls per layer where no variable-length kernel runs); `packed_attn_max_abs_diff`
//! (in millionths), the largest difference between the two forms' outputs and input gradients on the first 1,024
//! tokens of the layout in the bench's dtype on its device (on CUDA: torch's variable-length kernel against the
//! dense mask).

use super::TrainArgs;
use crate::report::Report;
use anyhow::{bail, Context, Result};
use ferl::trainer::config::SftConfig;
use ferl::trainer::data::SftDataset;
use ferl::trainer::model::varlen::Varlen;
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

const HEADS: i64 = 14;
const KV_HEADS: i64 = 2;
const HEAD_DIM: i64 = 64;
const ITERS: usize = 3;

/// Tokens of the layout prefix the two forms are compared on.
const PARITY_LEN: i64 = 1024;

/// GSM8K rows read to fill the packed row.
const ROWS: usize = 400;

/// Runs both forms in child processes and prints their rows.
pub(super) fn run(a: &TrainArgs, out: &mut Report) -> Result<()> {
    // The device first: libtorch_cuda must be loaded before the first tensor op of the process.
    options(a)?;
    let lens = gsm8k_lengths(a)?;
    let calls = Varlen::new(&lens, Device::Cpu)?.num_calls();
    eprintln!(
        "train: packed attention over {} GSM8K sequences (lengths {}..={}) in {} tokens ({calls} SDPA calls off CUDA)",
        lens.len(),
        lens.iter().min().unwrap_or(&0),
        lens.iter().max().unwrap_or(&0),
        lens.iter().sum::<i64>()
    );
    let diff = parity(a, &pack(lens.iter().copied(), PARITY_LEN))?;
    let varlen = run_child(a, "varlen", &lens)?;
    let dense = run_child(a, "dense", &lens)?;
    out.row("packed_attn_varlen_ms", varlen.ms, "ms");
    out.row("packed_attn_dense_ms", dense.ms, "ms");
    out.row("packed_attn_speedup", dense.ms / varlen.ms, "x");
    if let (Some(v), Some(d)) = (varlen.peak_mib, dense.peak_mib) {
        let results = results_mib(a.packed_len, Kind::Float);
        out.row("packed_attn_varlen_peak_MiB", v, "MiB");
        out.row("packed_attn_dense_peak_MiB", d, "MiB");
        out.row("packed_attn_memory_ratio", d / v.max(1e-3), "x");
        out.row("packed_attn_varlen_work_MiB", v - results, "MiB");
        out.row("packed_attn_dense_work_MiB", d - results, "MiB");
        out.row(
            "packed_attn_work_ratio",
            (d - results) / (v - results).max(1e-3),
            "x",
        );
    }
    out.row("packed_attn_sdpa_calls", calls as f64, "calls");
    out.row("packed_attn_max_abs_diff", diff * 1e6, "1e-6");
    Ok(())
}

/// MiB of the tensors any form has over a pass: the output, its gradient (the backward pass's input) and the
/// gradients of `q`, `k` and `v`.
fn results_mib(t: i64, kind: Kind) -> f64 {
    ((3 * HEADS + 2 * KV_HEADS) * t * HEAD_DIM * kind.elt_size_in_bytes() as i64) as f64
        / (1 << 20) as f64
}

/// Lengths of the first GSM8K rows packed in order into exactly `--packed-len` tokens (the last one cut to fit).
fn gsm8k_lengths(a: &TrainArgs) -> Result<Vec<i64>> {
    let cfg = SftConfig::load(
        None,
        &[
            "data.prompt_key=question".into(),
            "data.response_key=answer".into(),
            format!("data.train_files={}", a.data.display()),
            format!("data.train_max_samples={ROWS}"),
            "data.shuffle=false".into(),
        ],
    )?;
    let data = SftDataset::train(&cfg.data, &a.tokenizer)?;
    let lens = data.samples().iter().map(|s| s.input_ids.len() as i64);
    let packed = pack(lens, a.packed_len);
    if packed.iter().sum::<i64>() != a.packed_len {
        bail!(
            "{}: {} rows hold {} tokens, fewer than --packed-len {}",
            a.data.display(),
            data.len(),
            packed.iter().sum::<i64>(),
            a.packed_len
        );
    }
    Ok(packed)
}

/// Takes `lens` in order until `total` tokens are filled, cutting the last one to fit.
fn pack(lens: impl Iterator<Item = i64>, total: i64) -> Vec<i64> {
    let mut out = Vec::new();
    let mut left = total;
    for l in lens {
        if left == 0 {
            break;
        }
        out.push(l.min(left));
        left -= l.min(left);
    }
    out
}

/// One form's figures.
struct Figures {
    ms: f64,
    peak_mib: Option<f64>,
}

fn run_child(a: &TrainArgs, form: &str, lens: &[i64]) -> Result<Figures> {
    let lens_arg: Vec<String> = lens.iter().map(i64::to_string).collect();
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["train", "--packed-attention-child", form])
        .args(["--packed-lens", &lens_arg.join(",")])
        .args(["--threads", &a.threads.unwrap_or(2).to_string()])
        .args(["--dtype", &a.dtype])
        // Every large block is mapped and unmapped on its own, so freed memory leaves the resident set at once and a
        // pass's peak shows in VmHWM (else glibc keeps freed blocks resident and reuses them unseen).
        .env("MALLOC_MMAP_THRESHOLD_", "131072");
    if let Some(d) = &a.device {
        cmd.args(["--device", d]);
    }
    let done = cmd
        .output()
        .with_context(|| format!("starting the {form} child"))?;
    if !done.status.success() {
        bail!(
            "the packed attention {form} child failed ({}):\n{}",
            done.status,
            String::from_utf8_lossy(&done.stderr)
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&done.stdout)
        .with_context(|| format!("the {form} child's record"))?;
    Ok(Figures {
        ms: v["ms"].as_f64().context("no ms in the child's record")?,
        peak_mib: v["peak_mib"].as_f64(),
    })
}

/// `(kind, device)` of the measured tensors: `--device` (default cpu), fp32 on the CPU, `--dtype` on CUDA.
fn options(a: &TrainArgs) -> Result<(Kind, Device)> {
    let device = super::shape::resolve_device(a.device.as_deref().unwrap_or("cpu"))?;
    let kind = match (device, a.dtype.as_str()) {
        (Device::Cpu, _) | (_, "fp32") => Kind::Float,
        (_, "bf16") => Kind::BFloat16,
        (_, other) => bail!("--dtype {other}: expected bf16 or fp32"),
    };
    Ok((kind, device))
}

/// Random `q`, `k`, `v` (leaves) and an output gradient for a row of `t` tokens.
fn inputs(t: i64, opts: (Kind, Device)) -> [Tensor; 4] {
    let leaf = |h: i64| Tensor::randn([1, h, t, HEAD_DIM], opts).set_requires_grad(true);
    [
        leaf(HEADS),
        leaf(KV_HEADS),
        leaf(KV_HEADS),
        Tensor::randn([1, HEADS, t, HEAD_DIM], opts),
    ]
}

/// One forward + backward of `form` over `lens`; returns the output and the gradients of `q`, `k`, `v`.
fn pass(form: &str, lens: &[i64], x: &[Tensor; 4]) -> Result<[Tensor; 4]> {
    let [q, k, v, dy] = x;
    let device = q.device();
    let o = match form {
        "varlen" => Varlen::new(lens, device)?.attend(q, k, v, true),
        "dense" => {
            let mask = dense_mask(lens, device);
            Tensor::scaled_dot_product_attention(q, k, v, Some(&mask), 0.0, false, None, true)
        }
        other => bail!("--packed-attention-child {other}: expected varlen or dense"),
    };
    // The product is freed before the backward pass (it is no part of either form's memory).
    let loss = (&o * dy).sum(Kind::Float);
    let g = Tensor::run_backward(&[loss], &[q, k, v], false, false);
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    let [dq, dk, dv] = [0, 1, 2].map(|i| g[i].shallow_clone());
    Ok([o.detach(), dq, dk, dv])
}

/// The largest absolute difference between the two forms' outputs and input gradients over `lens`.
fn parity(a: &TrainArgs, lens: &[i64]) -> Result<f64> {
    tch::manual_seed(0);
    let x = inputs(lens.iter().sum(), options(a)?);
    let (ours, theirs) = (pass("varlen", lens, &x)?, pass("dense", lens, &x)?);
    Ok(ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs().max().to_kind(Kind::Double).double_value(&[]))
        .fold(0.0, f64::max))
}

/// A child: `form` (varlen or dense) over `--packed-lens`, printing `{"ms": .., "peak_mib": ..}` on stdout.
pub(super) fn child(a: &TrainArgs, form: &str) -> Result<()> {
    let opts = options(a)?;
    tch::set_num_threads(a.threads.unwrap_or(2) as i32);
    let x = inputs(a.packed_lens.iter().sum(), opts);
    drop(pass(form, &a.packed_lens, &x)?); // warm-up: one-time allocations (thread pools, kernel buffers)
    let base = reset_peak()?;
    let t0 = Instant::now();
    for _ in 0..ITERS {
        drop(pass(form, &a.packed_lens, &x)?);
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3 / ITERS as f64;
    let peak_mib =
        (opts.1 == Device::Cpu).then_some((super::common::vm_hwm_kib()? - base) / 1024.0);
    println!("{}", serde_json::json!({"ms": ms, "peak_mib": peak_mib}));
    Ok(())
}

/// Resets this process's resident high-water mark to its current resident set (`/proc/self/clear_refs`, Linux
/// 4.0+) and returns that, in KiB.
fn reset_peak() -> Result<f64> {
    std::fs::write("/proc/self/clear_refs", "5")
        .context("resetting VmHWM (/proc/self/clear_refs)")?;
    super::common::vm_hwm_kib()
}

/// The replaced path's mask: `[1, 1, T, T]`, true where a token may attend (same sequence, not after it).
fn dense_mask(lens: &[i64], device: Device) -> Tensor {
    let seg: Vec<i64> = lens
        .iter()
        .enumerate()
        .flat_map(|(i, &l)| std::iter::repeat_n(i as i64, l as usize))
        .collect();
    let t = seg.len() as i64;
    let seg = Tensor::from_slice(&seg).to_device(device);
    let same = seg.unsqueeze(1).eq_tensor(&seg.unsqueeze(0));
    let causal = Tensor::ones([t, t], (Kind::Bool, device)).tril(0);
    same.logical_and(&causal).view([1, 1, t, t])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_fills_the_row_exactly_cutting_the_last_sequence() {
        assert_eq!(pack([5, 4, 6].into_iter(), 12), vec![5, 4, 3]);
        assert_eq!(pack([5, 4, 6].into_iter(), 9), vec![5, 4]);
        assert_eq!(pack([5].into_iter(), 9), vec![5], "too few tokens: short");
    }
}
