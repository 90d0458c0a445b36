//! `ferl-bench kernels`: the loss step of the tiny Qwen2 (`hidden @ lm_head^T`, cross-entropy, backward to the
//! hidden states and the `lm_head` weight) with the plain tch ops (`[tokens, vocab]` logits) and with the `liger`
//! fused linear + cross-entropy kernel, same batch, side by side.
//!
//! Each variant runs in its own child process so peak memory is its own: the child resets the kernel's peak-RSS
//! counter (`/proc/self/clear_refs`) after a warm-up step, runs the timed steps, and reports `VmHWM` minus the RSS
//! before the steps (inputs and weights are allocated before, so the figure is what the loss step adds). Rows:
//! `<variant>_loss_step_peak_mem_MiB`, `<variant>_tokens_per_s`, `fused_ce_max_loss_diff`, then the ratios
//! `fused_ce_peak_mem_ratio` and `fused_ce_tokens_per_s_ratio` (fused ÷ unfused; goals ≤ 0.3 and ≥ 1.0).
//!
//! Then the whole train step (the engine's forward + backward of one `--seq`-token sequence through the tiny Qwen2
//! of `--model-config`, random weights, fp32) with the built-in ops, with RMSNorm and SwiGLU through the `liger`
//! kernels (the layers run split at the kernels), and with all three kernels (`model.use_liger=true`); the variants
//! take turns step by step (in a rotating order) and each reports its median: rows `train_step_<variant>_tokens_per_s` and the ratios
//! `liger_norm_swiglu_train_step_ratio`, `liger_all_train_step_ratio` (÷ built-in; above 1 is faster).

use crate::report::Report;
use anyhow::{bail, Context, Result};
use clap::Args;
use ferl::trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl::trainer::engine::{Engine, EngineOptions};
use ferl::trainer::kernels::KernelRegistry;
use ferl::trainer::model::config::ModelConfig;
use ferl::trainer::model::layout::ModelLayout;
use ferl::trainer::model::weights::init_params;
use ferl::trainer::params::{LocalParams, ParamStore};
use ferl_plugin_bridge::liger_kernels;
use ferl_plugin_tch::{reference, Kernels, Reduction};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Options of the kernels suite.
#[derive(Args, Debug)]
pub(crate) struct KernelsArgs {
    /// Hidden size (the tiny Qwen2's).
    #[arg(long, default_value_t = 128)]
    hidden: i64,
    /// Vocabulary size (Qwen's).
    #[arg(long, default_value_t = 151_936)]
    vocab: i64,
    /// Tokens per step (one sequence).
    #[arg(long, default_value_t = 1024)]
    seq: i64,
    /// Timed steps per variant.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rows per chunk of the fused kernel (0: the kernel's automatic choice).
    #[arg(long, default_value_t = 0)]
    chunk_rows: usize,
    /// The model of the train-step rows.
    #[arg(long, default_value = "assets/models/tiny-qwen2/config.json")]
    model_config: PathBuf,
    /// Timed train steps per variant (0: skip the train-step rows).
    #[arg(long, default_value_t = 8)]
    train_steps: usize,
    /// Internal: run one variant (`unfused` or `fused`) and print its figures.
    #[arg(long, hide = true)]
    child: Option<String>,
}

/// What one child measured.
struct Figures {
    peak_mib: f64,
    tokens_per_s: f64,
    loss: f64,
}

fn proc_status_kib(field: &str) -> Result<f64> {
    let s = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = s
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("no {field} in /proc/self/status"))?;
    let kib: f64 = line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib)
}

/// One loss step: forward and backward; returns the loss.
fn step(
    variant: &str,
    kernels: &Kernels,
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk: usize,
) -> Result<f64> {
    let loss = match variant {
        "unfused" => {
            reference::linear_cross_entropy(hidden, weight, targets, -100, Reduction::Mean)
        }
        "fused" => kernels.fused_linear_cross_entropy(
            hidden,
            weight,
            targets,
            -100,
            Reduction::Mean,
            chunk,
        )?,
        other => bail!("unknown variant {other:?}"),
    };
    let grads = Tensor::run_backward(&[&loss], &[hidden, weight], false, false);
    let value = loss.double_value(&[]);
    drop((loss, grads));
    Ok(value)
}

fn child(variant: &str, a: &KernelsArgs) -> Result<()> {
    tch::manual_seed(0);
    let kernels = Kernels::builtin()?;
    let opts = (Kind::Float, Device::Cpu);
    let hidden = (Tensor::randn([a.seq, a.hidden], opts)).set_requires_grad(true);
    let weight = (Tensor::randn([a.vocab, a.hidden], opts) * 0.02).set_requires_grad(true);
    let targets = Tensor::randint(a.vocab, [a.seq], (Kind::Int64, Device::Cpu));
    step(variant, &kernels, &hidden, &weight, &targets, a.chunk_rows)?; // warm-up
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let base = proc_status_kib("VmRSS:")?;
    let t0 = Instant::now();
    let mut loss = 0.0;
    for _ in 0..a.steps {
        loss = step(variant, &kernels, &hidden, &weight, &targets, a.chunk_rows)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    if !reset {
        bail!("cannot reset the peak-RSS counter (/proc/self/clear_refs): peak memory would include set-up");
    }
    let peak = proc_status_kib("VmHWM:")? - base;
    println!(
        "{} {} {}",
        peak / 1024.0,
        (a.seq as f64 * a.steps as f64) / secs,
        loss
    );
    Ok(())
}

fn run_child(variant: &str, a: &KernelsArgs) -> Result<Figures> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .args(["kernels", "--child", variant])
        .args([
            "--hidden",
            &a.hidden.to_string(),
            "--vocab",
            &a.vocab.to_string(),
            "--seq",
            &a.seq.to_string(),
        ])
        .args([
            "--steps",
            &a.steps.to_string(),
            "--chunk-rows",
            &a.chunk_rows.to_string(),
        ])
        .output()
        .context("starting a ferl-bench kernels child")?;
    if !out.status.success() {
        bail!(
            "the {variant} child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let nums: Vec<f64> = text
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("the {variant} child printed {text:?}"))?;
    let [peak_mib, tokens_per_s, loss] = nums[..] else {
        bail!("the {variant} child printed {text:?}")
    };
    Ok(Figures {
        peak_mib,
        tokens_per_s,
        loss,
    })
}

/// Runs the suite and prints its rows.
pub(crate) fn run(args: KernelsArgs, out: &mut Report) -> Result<()> {
    if let Some(variant) = &args.child {
        return child(variant, &args);
    }
    let unfused = run_child("unfused", &args)?;
    let fused = run_child("fused", &args)?;
    out.row("unfused_loss_step_peak_mem_MiB", unfused.peak_mib, "MiB");
    out.row("fused_loss_step_peak_mem_MiB", fused.peak_mib, "MiB");
    out.row("unfused_tokens_per_s", unfused.tokens_per_s, "tokens/s");
    out.row("fused_tokens_per_s", fused.tokens_per_s, "tokens/s");
    out.row(
        "fused_ce_max_loss_diff",
        (unfused.loss - fused.loss).abs(),
        "nats",
    );
    out.row(
        "fused_ce_peak_mem_ratio",
        fused.peak_mib / unfused.peak_mib,
        "x",
    );
    out.row(
        "fused_ce_tokens_per_s_ratio",
        fused.tokens_per_s / unfused.tokens_per_s,
        "x",
    );
    if args.train_steps > 0 {
        train_steps(&args, out)?;
    }
    Ok(())
}

/// The train-step rows (see the module docs).
fn train_steps(a: &KernelsArgs, out: &mut Report) -> Result<()> {
    let cfg = ModelConfig::from_file(&a.model_config)
        .with_context(|| format!("--model-config {}", a.model_config.display()))?;
    let layout = ModelLayout::new(&cfg);
    let params = init_params(&cfg, &layout, 0);
    let liger = liger_kernels(None);
    let norm_swiglu = KernelRegistry {
        head: None,
        ..liger.clone()
    };
    let variants = [
        ("builtin", KernelRegistry::builtin()),
        ("liger_norm_swiglu", norm_swiglu),
        ("liger_all", liger),
    ];
    let mut engines: Vec<Engine<LocalParams>> = variants
        .iter()
        .map(|(_, k)| {
            let copies = params.iter().map(Tensor::copy).collect();
            let store = LocalParams::new(layout.clone(), copies, Kind::Float);
            let mut e = Engine::new(cfg.clone(), store, Kind::Float, EngineOptions::default());
            e.set_kernels(k.clone());
            e
        })
        .collect();
    tch::manual_seed(1);
    let ids: Vec<i64> = Vec::try_from(&Tensor::randint(
        cfg.vocab_size,
        [a.seq],
        (Kind::Int64, Device::Cpu),
    ))?;
    let mask: Vec<bool> = (0..a.seq).map(|i| i > 0).collect();
    let sample = [SampleRef {
        input_ids: &ids,
        loss_mask: &mask,
    }];
    let mb = MicroBatch::new(&sample, Layout::Padded, Device::Cpu)?;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut losses = vec![0.0; variants.len()];
    for round in 0..=a.train_steps {
        // Each round starts with another variant, so no variant always runs right after the same one.
        let n = engines.len();
        for i in (0..n).map(|j| (j + round) % n) {
            let e = &mut engines[i];
            e.store_mut().zero_grads();
            let t0 = Instant::now();
            losses[i] = e.forward_backward(&mb, mb.num_targets)?;
            if round > 0 {
                times[i].push(t0.elapsed().as_secs_f64()); // round 0 warms up
            }
        }
    }
    let tokens_per_s: Vec<f64> = times
        .iter_mut()
        .map(|t| {
            t.sort_by(f64::total_cmp);
            a.seq as f64 / t[t.len() / 2]
        })
        .collect();
    for ((name, _), tps) in variants.iter().zip(&tokens_per_s) {
        out.row(&format!("train_step_{name}_tokens_per_s"), *tps, "tokens/s");
    }
    let per_token = |l: f64| l / mb.num_targets as f64;
    out.row(
        "liger_all_train_step_max_loss_diff",
        losses
            .iter()
            .map(|l| (per_token(*l) - per_token(losses[0])).abs())
            .fold(0.0, f64::max),
        "nats",
    );
    out.row(
        "liger_norm_swiglu_train_step_ratio",
        tokens_per_s[1] / tokens_per_s[0],
        "x",
    );
    out.row(
        "liger_all_train_step_ratio",
        tokens_per_s[2] / tokens_per_s[0],
        "x",
    );
    Ok(())
}
