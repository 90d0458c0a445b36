//! `ferl-bench train`: train-step throughput and peak memory of ferl's engine and of the plain PyTorch eager loop
//! (transformers' Qwen2, `trainer/py/parity_reference.py train`) on the same model, batches and thread count.
//!
//! The model is the tiny Qwen2 of `assets/models/tiny-qwen2` (vocab 151,936), randomly initialised once and loaded by
//! both sides; the batches are the first GSM8K rows tokenized with the real Qwen tokenizer (prompt through the chat
//! template, loss on the response and EOS). Each side runs in its own child process; the first step is a warm-up and
//! is not timed. Figures: tokens/s = real (non-pad) tokens of the timed steps / their wall time; peak memory =
//! the child's `VmHWM` (resident high-water mark) — the whole process, interpreter and libraries included.
//! Rows: `train_<side>_tokens_per_s`, `train_<side>_peak_rss_MiB`, `train_tokens_per_s_ratio` (ferl ÷ PyTorch, goal
//! ≥ 1.2) and `train_peak_rss_ratio` (ferl ÷ PyTorch, goal ≤ 1.0), then `train_gemm_peak_GFLOPs` and
//! `train_{ferl,pytorch}_cpu_mfu` (model FLOP/s ÷ the fp32 GEMM peak the ferl child measured on the same threads;
//! goal ≥ 0.5) with their `_6n` variants ([`mfu`] says what is counted).
//!
//! `--lora-rank R [--lora-alpha A] [--model-shape SHAPE]` (issue #12) adds two more children on the same model,
//! batches, loop and threads: ferl training LoRA adapters of rank `R` (alpha `A`, default 16, `all-linear`: the seven
//! decoder projections, base frozen; [`lora::with_adapters`], as `model.lora_rank=R model.lora_alpha=A
//! model.target_modules=all-linear` loads it) and the peer, transformers 5.24 + peft 0.21.2 (`get_peft_model` with the
//! same rank, alpha and targets, `lora_dropout` 0; eager — no `torch.compile`, transformers' default sdpa attention —
//! fp32, torch's AdamW over the trainable parameters, the same token-mean loss and clipping; `parity_reference.py
//! train --lora-rank R`). Rows: `train_{ferl,peft}_lora_tokens_per_s`, `train_{ferl,peft}_lora_peak_rss_MiB`,
//! `lora_first_loss_rel_diff_ppm` (the adapters start at `B = 0`, so both sides' first loss is the base model's), then
//! `lora_peak_rss_vs_full` (ferl LoRA ÷ ferl full fine-tuning, goal ≤ 0.6), `lora_peak_rss_vs_peft` and
//! `lora_tokens_per_s_vs_peft` (ferl LoRA ÷ peft, goal ≥ 1.2). The peer's versions and attention implementation are printed to stderr. With `--model-shape` the
//! comparison's model is a random-init model of that named shape ([`shape::shape_config`], e.g. `qwen2.5-0.5b`) instead
//! of the tiny Qwen2, whose 19M-parameter embedding leaves the runtime's fixed memory dominant.
//!
//! ferl's sides train through `--store local` (`LocalParams`, the default) or `--store fsdp` (`ferl-fsdp`'s
//! FULL_SHARD at world size 1, the store a one-rank `ferl sft` trains through), full fine-tuning and LoRA alike.
//!
//! Five more modes share the prepared data and settings ([`common`]):
//! - `--nproc-per-node N` ([`fsdp`]): sharded training at world size 1 and N, ferl's FULL_SHARD trainer ranks beside
//!   PyTorch FSDP2 (`fully_shard`, gloo), rows `fsdp_wW_*`.
//! - `--token-budget N` ([`budget`]): token-budget micro-batches (`data.use_dynamic_bsz`) beside fixed ones, padded
//!   and packed, rows `train_{fixed,budget}_*` and `train_budget_vs_fixed_*`.
//! - `--packed-attention` ([`varlen`]): the attention op of a packed micro-batch at `--packed-len` tokens of GSM8K
//!   sequences, the engine's varlen path beside the dense mask it replaced (ms and peak memory), rows `packed_attn_*`.
//! - `--sequence-parallel K [--seq-len T]` ([`sp`]): peak memory per rank of Ulysses sequence parallelism over `K`
//!   ranks on `T`-token sequences beside one rank and beside `K`-way data parallelism, rows `sp_*`.
//! - `--model-shape SHAPE --device cpu|cuda` without `--lora-rank` ([`shape`]): bf16 steps of a random-init model of a
//!   named shape (e.g. Qwen2.5-0.5B at seq 2048) on synthetic tokens, with tokens/s and MFU — the GPU benchmark
//!   `bench/gpu/h200_sft.sh`.

mod budget;
mod common;
mod fsdp;
mod mfu;
mod shape;
mod sp;
mod varlen;

use crate::report::Report;
use anyhow::{bail, Context, Result};
use clap::Args;
pub(crate) use common::python;
use common::{prepare, py_script, vm_hwm_kib, SideRecord};
use ferl::actors::messages::Sample;
use ferl::trainer::batch::SampleRef;
use ferl::trainer::engine::EngineOptions;
use ferl::trainer::model::config::ModelConfig;
use ferl::trainer::model::load_model;
use ferl::trainer::model::lora::{self, LoraSpec};
use ferl::trainer::params::{LocalParams, ParamStore};
use ferl::trainer::step::Stepper;
pub(crate) use shape::shape_config;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind};

/// Options of the train suite.
#[derive(Args, Debug, Clone)]
pub(crate) struct TrainArgs {
    /// Samples per optimizer step (the global batch).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Samples per micro-batch (gradient accumulation = batch / micro_batch, per rank).
    #[arg(long, default_value_t = 4)]
    micro_batch: usize,
    /// Steps per side; the first is a warm-up.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Intra-op threads of every process (rank) of both sides; default 2, or 1 per rank with --nproc-per-node.
    #[arg(long)]
    threads: Option<usize>,
    /// Recompute layers in backward (both sides).
    #[arg(long)]
    gradient_checkpointing: bool,
    /// Sharded training at world size 1 and N: ferl FULL_SHARD ranks beside PyTorch FSDP2 (gloo).
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Train a random-init model of this shape on synthetic tokens instead (qwen2.5-0.5b, tiny-qwen2, test); with
    /// --lora-rank, the model of the GSM8K comparison instead of --config's.
    #[arg(long)]
    model_shape: Option<String>,
    /// Also train LoRA adapters of this rank (all-linear) on both sides: ferl beside transformers + peft.
    #[arg(long)]
    lora_rank: Option<i64>,
    /// LoRA alpha of --lora-rank runs (updates scaled by alpha / rank).
    #[arg(long, default_value_t = 16.0)]
    lora_alpha: f64,
    /// Device of --model-shape, --packed-attention and --sequence-parallel runs: cpu or cuda.
    #[arg(long)]
    device: Option<String>,
    /// Tokens per sample of --model-shape and --sequence-parallel runs.
    #[arg(long, default_value_t = 2048)]
    seq_len: usize,
    /// Compute dtype of --model-shape runs and of CUDA --packed-attention and --sequence-parallel runs: bf16 or fp32
    /// (fp32 masters either way).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Parameter store of --model-shape runs and of the comparison's ferl sides: local (`LocalParams`) or fsdp
    /// (FULL_SHARD at world size 1, as a one-rank `ferl sft`).
    #[arg(long, default_value = "local")]
    store: String,
    /// Logits per head chunk of --model-shape runs (default: the engine's on the CPU, 2^28 on CUDA).
    #[arg(long)]
    logits_chunk_elements: Option<i64>,
    /// Peak dense bf16 TFLOP/s the MFU of --model-shape runs is taken against (H200: 989).
    #[arg(long, default_value_t = 989.0)]
    peak_tflops: f64,
    /// With --nproc-per-node: measure ferl's side only (profiling); no PyTorch rows or ratios.
    #[arg(long)]
    skip_pytorch: bool,
    /// Model config.json.
    #[arg(long, default_value = "assets/models/tiny-qwen2/config.json")]
    config: PathBuf,
    /// Tokenizer folder.
    #[arg(long, default_value = "assets/tokenizers/qwen3")]
    tokenizer: PathBuf,
    /// GSM8K jsonl (question/answer columns).
    #[arg(long, default_value = "assets/data/gsm8k/train.jsonl")]
    data: PathBuf,
    /// Instead: the packed-attention micro-bench (varlen beside the dense mask it replaced) at this packed length.
    #[arg(long)]
    packed_attention: bool,
    /// Tokens of the packed row of --packed-attention.
    #[arg(long, default_value_t = 8192)]
    packed_len: i64,
    /// Internal: run one form (varlen or dense) of --packed-attention over --packed-lens.
    #[arg(long, hide = true)]
    packed_attention_child: Option<String>,
    /// Internal: the packed sequence lengths of --packed-attention-child.
    #[arg(long, hide = true, value_delimiter = ',')]
    packed_lens: Vec<i64>,
    /// Instead: peak memory per rank of Ulysses sequence parallelism over this many ranks at --seq-len tokens
    /// (synthetic sequences), beside one rank and beside plain data parallelism over as many ranks.
    #[arg(long)]
    sequence_parallel: Option<usize>,
    /// Internal: the ulysses_sequence_parallel_size of a --rank-child (with remove-padding).
    #[arg(long, hide = true)]
    rank_sp: Option<usize>,
    /// Instead: token-budget micro-batches of this many tokens beside fixed --micro-batch ones (padded and packed).
    #[arg(long)]
    token_budget: Option<usize>,
    /// Internal: one run (FORM,LAYOUT) of --token-budget on the prepared folder of --child.
    #[arg(long, hide = true)]
    budget_child: Option<String>,
    /// Internal: run ferl's side in this process on the prepared folder.
    #[arg(long, hide = true)]
    child: Option<PathBuf>,
    /// Internal: run one ferl rank of the --nproc-per-node comparison on the prepared folder.
    #[arg(long, hide = true)]
    rank_child: Option<PathBuf>,
    /// Internal: where --child writes its record (default: ferl.json in the prepared folder).
    #[arg(long, hide = true)]
    out: Option<PathBuf>,
}

/// Runs the suite: the single-process comparison, or (`--nproc-per-node`) the sharded one, or (`--model-shape`) the
/// synthetic-shape run; internally also one side's child process.
pub(crate) fn run(a: TrainArgs, out: &mut Report) -> Result<()> {
    if let (Some(spec), Some(dir)) = (&a.budget_child, &a.child) {
        return budget::child(&a, spec, a.token_budget.unwrap_or(0), dir);
    }
    if let Some(dir) = &a.child {
        return child(&a, dir);
    }
    if let Some(dir) = &a.rank_child {
        return fsdp::rank_child(&a, dir);
    }
    if let Some(form) = &a.packed_attention_child {
        return varlen::child(&a, form);
    }
    if a.packed_attention {
        return varlen::run(&a, out);
    }
    if let Some(budget) = a.token_budget {
        return budget::run(&a, budget, out);
    }
    if let Some(k) = a.sequence_parallel {
        return sp::run(&a, k, out);
    }
    match (&a.model_shape, a.lora_rank, a.nproc_per_node) {
        (Some(shape), None, _) => return shape::run(&a, shape, out),
        (_, Some(_), Some(_)) => {
            bail!("--lora-rank runs in the single-process comparison, not with --nproc-per-node")
        }
        _ => {}
    }
    if a.micro_batch == 0 || !a.batch.is_multiple_of(a.micro_batch) || a.steps < 2 {
        bail!("--batch must be a multiple of --micro-batch and --steps at least 2");
    }
    let dir = std::env::temp_dir().join(format!("ferl-bench-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = match a.nproc_per_node {
        Some(world) => fsdp::run(&a, world, &dir, out),
        None => measure(&a, &dir, out),
    };
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Runs one side's child process for full fine-tuning (`lora_rank` None) or LoRA, and reads its record.
fn run_side(a: &TrainArgs, dir: &Path, ferl: bool, lora_rank: Option<i64>) -> Result<SideRecord> {
    let threads = a.threads.unwrap_or(2).to_string();
    let tag = match lora_rank {
        Some(_) => "_lora",
        None => "",
    };
    let (name, record) = if ferl {
        ("ferl", dir.join(format!("ferl{tag}.json")))
    } else {
        ("PyTorch", dir.join(format!("pytorch{tag}.json")))
    };
    let mut cmd = if ferl {
        let mut c = Command::new(std::env::current_exe()?);
        c.args(["train", "--child"])
            .arg(dir)
            .args(["--batch", &a.batch.to_string()])
            .args(["--micro-batch", &a.micro_batch.to_string()])
            .args(["--steps", &a.steps.to_string()])
            .args(["--store", &a.store]);
        if a.gradient_checkpointing {
            c.arg("--gradient-checkpointing");
        }
        c
    } else {
        let mut c = Command::new(python());
        c.arg(py_script("parity_reference.py"))
            .args(["train", "--model"])
            .arg(dir.join("model"))
            .arg("--data")
            .arg(dir.join("data.json"))
            .arg("--settings")
            .arg(dir.join("settings.json"));
        c
    };
    cmd.args(["--threads", &threads]).arg("--out").arg(&record);
    if let Some(rank) = lora_rank {
        cmd.args(["--lora-rank", &rank.to_string()])
            .args(["--lora-alpha", &a.lora_alpha.to_string()]);
    }
    let hint = match ferl {
        true => "",
        false => " (is the venv set up? scripts/setup.sh)",
    };
    let started = cmd
        .output()
        .with_context(|| format!("starting {name}'s side{hint}"))?;
    if !started.status.success() {
        bail!(
            "{name}'s side{tag} failed ({}):\n{}",
            started.status,
            String::from_utf8_lossy(&started.stderr)
        );
    }
    SideRecord::read(&record)
}

fn measure(a: &TrainArgs, dir: &Path, out: &mut Report) -> Result<()> {
    prepare(a, dir)?;
    let ferl = run_side(a, dir, true, None)?;
    let torch = run_side(a, dir, false, None)?;
    let (ferl_rate, torch_rate) = (ferl.tokens_per_s(), torch.tokens_per_s());
    let (ferl_mib, torch_mib) = (ferl.peak_rss_kib / 1024.0, torch.peak_rss_kib / 1024.0);
    out.row("train_ferl_tokens_per_s", ferl_rate, "tokens/s");
    out.row("train_pytorch_tokens_per_s", torch_rate, "tokens/s");
    out.row("train_ferl_peak_rss_MiB", ferl_mib, "MiB");
    out.row("train_pytorch_peak_rss_MiB", torch_mib, "MiB");
    out.row("train_tokens_per_s_ratio", ferl_rate / torch_rate, "x");
    out.row("train_peak_rss_ratio", ferl_mib / torch_mib, "x");
    if a.lora_rank.is_none() {
        mfu_rows(a, dir, "train", &[ferl], &[torch], out)?;
    }
    let Some(rank) = a.lora_rank else {
        return Ok(());
    };
    let ferl_lora = run_side(a, dir, true, Some(rank))?;
    let peft = run_side(a, dir, false, Some(rank))?;
    if let Ok(peer) = std::fs::read_to_string(dir.join("pytorch_lora.json")) {
        let v: serde_json::Value = serde_json::from_str(&peer)?;
        eprintln!("train: LoRA peer {}", v["peer"].as_str().unwrap_or("?"));
    }
    let (lora_rate, peft_rate) = (ferl_lora.tokens_per_s(), peft.tokens_per_s());
    let (lora_mib, peft_mib) = (ferl_lora.peak_rss_kib / 1024.0, peft.peak_rss_kib / 1024.0);
    out.row("train_ferl_lora_tokens_per_s", lora_rate, "tokens/s");
    out.row("train_peft_lora_tokens_per_s", peft_rate, "tokens/s");
    out.row("train_ferl_lora_peak_rss_MiB", lora_mib, "MiB");
    out.row("train_peft_lora_peak_rss_MiB", peft_mib, "MiB");
    if let (Some(fl), Some(pl)) = (ferl_lora.loss.first(), peft.loss.first()) {
        let ppm = (fl - pl).abs() / pl.abs().max(1e-12) * 1e6;
        out.row("lora_first_loss_rel_diff_ppm", ppm, "ppm");
    }
    out.row("lora_peak_rss_vs_full", lora_mib / ferl_mib, "x");
    out.row("lora_peak_rss_vs_peft", lora_mib / peft_mib, "x");
    out.row("lora_tokens_per_s_vs_peft", lora_rate / peft_rate, "x");
    Ok(())
}

/// The `cpu_mfu` rows of one comparison (`PREFIX_{ferl,pytorch}_cpu_mfu[_6n]`, `PREFIX_gemm_peak_GFLOPs`): the
/// model FLOPs of the timed steps over each side's (slowest rank's) time ÷ the sum of ferl's ranks' GEMM peaks.
fn mfu_rows(
    a: &TrainArgs,
    dir: &Path,
    prefix: &str,
    ferl: &[SideRecord],
    torch: &[SideRecord],
    out: &mut Report,
) -> Result<()> {
    let peak: f64 = ferl
        .iter()
        .map(|r| {
            r.gemm_flops_per_s
                .context("a ferl record without gemm_flops_per_s")
        })
        .sum::<Result<f64>>()?;
    let cfg = ModelConfig::from_file(&dir.join("model").join("config.json"))?;
    let samples = common::read_samples(dir)?;
    let (flops, flops_6n) = mfu::FlopModel::of(&cfg).timed_flops(&samples, a.batch, a.steps);
    out.row(&format!("{prefix}_gemm_peak_GFLOPs"), peak / 1e9, "GFLOP/s");
    for (side, ranks) in [("ferl", ferl), ("pytorch", torch)] {
        if ranks.is_empty() {
            continue;
        }
        let secs = mfu::slowest_s(ranks);
        out.row(
            &format!("{prefix}_{side}_cpu_mfu"),
            flops / secs / peak,
            "x",
        );
        out.row(
            &format!("{prefix}_{side}_cpu_mfu_6n"),
            flops_6n / secs / peak,
            "x",
        );
    }
    Ok(())
}

/// ferl's side: the same loop as the PyTorch script (constant lr, AdamW, clipping, micro-batches); with
/// `--lora-rank`, over fresh adapters (seed 0) of the frozen model, the optimizer holding the adapters only; through
/// `--store` (`local`: `LocalParams`, `fsdp`: FULL_SHARD at world size 1, as a one-rank `ferl sft`).
fn child(a: &TrainArgs, dir: &Path) -> Result<()> {
    tch::set_num_threads(a.threads.unwrap_or(2) as i32);
    let samples = common::read_samples(dir)?;
    let model = load_model(&dir.join("model"))?;
    let (layout, params) = match a.lora_rank {
        Some(rank) => {
            let spec = LoraSpec {
                rank,
                alpha: a.lora_alpha,
                targets: vec!["all-linear".into()],
                exclude: vec![],
            };
            lora::with_adapters(&model.config, model.layout, model.params, &spec, None, 0)?
        }
        None => (model.layout, model.params),
    };
    let opts = EngineOptions {
        gradient_checkpointing: a.gradient_checkpointing,
        ..EngineOptions::default()
    };
    let (cfg, kind, device) = (&model.config, Kind::Float, Device::Cpu);
    let result = match a.store.as_str() {
        "local" => {
            let store = LocalParams::new(layout, params, kind);
            train_steps(
                a,
                &samples,
                shape::stepper(cfg, store, kind, opts, device, a)?,
            )?
        }
        "fsdp" => {
            let store = shape::fsdp_store(layout, params, kind, device)?;
            train_steps(
                a,
                &samples,
                shape::stepper(cfg, store, kind, opts, device, a)?,
            )?
        }
        other => bail!("--store {other}: expected local or fsdp"),
    };
    let record = a.out.clone().unwrap_or_else(|| dir.join("ferl.json"));
    std::fs::write(&record, result.to_string())?;
    Ok(())
}

/// Trains `--steps` steps on the prepared rows; the record: per-step real tokens, seconds and loss, and `VmHWM`.
fn train_steps<P: ParamStore>(
    a: &TrainArgs,
    samples: &[Sample],
    mut stepper: Stepper<P>,
) -> Result<serde_json::Value> {
    let (mut tokens, mut secs, mut losses) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..a.steps {
        let rows = samples
            .get(step * a.batch..(step + 1) * a.batch)
            .with_context(|| format!("step {step}: {} samples prepared", samples.len()))?;
        let batch: Vec<SampleRef> = rows
            .iter()
            .map(|s| SampleRef {
                input_ids: &s.input_ids,
                loss_mask: &s.loss_mask,
            })
            .collect();
        let t0 = Instant::now();
        let stats = stepper.step(&batch)?;
        secs.push(t0.elapsed().as_secs_f64());
        tokens.push(stats.tokens as f64);
        losses.push(stats.loss);
    }
    Ok(serde_json::json!({
        "tokens": tokens, "step_s": secs, "loss": losses, "peak_rss_kib": vm_hwm_kib()?,
        "gemm_flops_per_s": mfu::gemm_peak_flops(),
    }))
}
