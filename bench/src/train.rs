//! `ferl-bench train`: train-step throughput and peak memory of ferl's engine and of the plain PyTorch eager loop
//! (transformers' Qwen2, `trainer/py/parity_reference.py train`) on the same model, batches and thread count.
//!
//! The model is the tiny Qwen2 of `assets/models/tiny-qwen2` (vocab 151,936), randomly initialised once and loaded by
//! both sides; the batches are the first GSM8K rows tokenized with the real Qwen tokenizer (prompt through the chat
//! template, loss on the response and EOS). Each side runs in its own child process; the first step is a warm-up and
//! is not timed. Figures: tokens/s = real (non-pad) tokens of the timed steps / their wall time; peak memory =
//! the child's `VmHWM` (resident high-water mark) — the whole process, interpreter and libraries included.
//! Rows: `train_<side>_tokens_per_s`, `train_<side>_peak_rss_MiB`, `train_tokens_per_s_ratio` (ferl ÷ PyTorch, goal
//! ≥ 1.2) and `train_peak_rss_ratio` (ferl ÷ PyTorch, goal ≤ 1.0).

use crate::report::Report;
use anyhow::{bail, Context, Result};
use clap::Args;
use ferl::trainer::batch::{Layout, SampleRef};
use ferl::trainer::config::SftConfig;
use ferl::trainer::data::SftDataset;
use ferl::trainer::engine::{Engine, EngineOptions};
use ferl::trainer::model::{init_model, load_model};
use ferl::trainer::optim::{AdamW, AdamWConfig, LrSchedule};
use ferl::trainer::params::LocalParams;
use ferl::trainer::step::Stepper;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind};

/// Options of the train suite.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Samples per optimizer step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Samples per micro-batch (gradient accumulation = batch / micro_batch).
    #[arg(long, default_value_t = 4)]
    micro_batch: usize,
    /// Steps per side; the first is a warm-up.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Intra-op threads of both sides.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Recompute layers in backward (both sides).
    #[arg(long)]
    gradient_checkpointing: bool,
    /// Model config.json.
    #[arg(long, default_value = "assets/models/tiny-qwen2/config.json")]
    config: PathBuf,
    /// Tokenizer folder.
    #[arg(long, default_value = "assets/tokenizers/qwen3")]
    tokenizer: PathBuf,
    /// GSM8K jsonl (question/answer columns).
    #[arg(long, default_value = "assets/data/gsm8k/train.jsonl")]
    data: PathBuf,
    /// Internal: run ferl's side in this process on the prepared folder.
    #[arg(long, hide = true)]
    child: Option<PathBuf>,
}

fn vm_hwm_kib() -> Result<f64> {
    let s = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .context("no VmHWM in /proc/self/status")?;
    Ok(line["VmHWM:".len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?)
}

fn python() -> PathBuf {
    let venv = std::env::var_os("FERL_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ferl/venv")
        });
    venv.join("bin/python")
}

fn settings(a: &TrainArgs) -> serde_json::Value {
    serde_json::json!({
        "lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.01, "warmup_ratio": 0.0, "min_lr_ratio": 0.0,
        "scheduler": "constant", "total_steps": a.steps, "clip_grad": 1.0,
        "train_batch_size": a.batch, "micro_batch_size": a.micro_batch,
        "gradient_checkpointing": a.gradient_checkpointing,
    })
}

/// Runs the suite (or, with `--child`, ferl's side of it).
pub fn run(a: TrainArgs, out: &mut Report) -> Result<()> {
    if let Some(dir) = &a.child {
        return child(&a, dir);
    }
    if a.micro_batch == 0 || !a.batch.is_multiple_of(a.micro_batch) || a.steps < 2 {
        bail!("--batch must be a multiple of --micro-batch and --steps at least 2");
    }
    let dir = std::env::temp_dir().join(format!("ferl-bench-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = measure(&a, &dir, out);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(a: &TrainArgs, dir: &Path, out: &mut Report) -> Result<()> {
    init_model(&a.config, Some(&a.tokenizer), &dir.join("model"), 0)?;
    let rows = a.batch * a.steps;
    let cfg = SftConfig::load(
        None,
        &[
            "data.prompt_key=question".into(),
            "data.response_key=answer".into(),
            format!("data.train_files={}", a.data.display()),
            format!("data.train_max_samples={rows}"),
            "data.shuffle=false".into(),
        ],
    )?;
    let data = SftDataset::train(&cfg.data, &a.tokenizer)?;
    if data.len() < rows {
        bail!(
            "{}: {} rows, the benchmark needs {rows}",
            a.data.display(),
            data.len()
        );
    }
    let samples: Vec<serde_json::Value> = data.samples()[..rows]
        .iter()
        .map(|s| serde_json::json!({"input_ids": s.input_ids, "loss_mask": s.loss_mask}))
        .collect();
    std::fs::write(dir.join("data.json"), serde_json::to_string(&samples)?)?;
    std::fs::write(dir.join("settings.json"), settings(a).to_string())?;

    let exe = std::env::current_exe()?;
    let threads = a.threads.to_string();
    let mut ferl_cmd = Command::new(exe);
    ferl_cmd
        .args(["train", "--child"])
        .arg(dir)
        .args(["--threads", &threads]);
    if a.gradient_checkpointing {
        ferl_cmd.arg("--gradient-checkpointing");
    }
    let status = ferl_cmd.status().context("starting ferl's side")?;
    if !status.success() {
        bail!("ferl's side failed ({status})");
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../trainer/py/parity_reference.py");
    let py = Command::new(python())
        .arg(&script)
        .args(["train", "--model"])
        .arg(dir.join("model"))
        .arg("--data")
        .arg(dir.join("data.json"))
        .arg("--settings")
        .arg(dir.join("settings.json"))
        .arg("--out")
        .arg(dir.join("pytorch.json"))
        .args(["--threads", &threads])
        .output()
        .context("starting the PyTorch side (is the venv set up? scripts/setup.sh)")?;
    if !py.status.success() {
        bail!(
            "PyTorch side failed:\n{}",
            String::from_utf8_lossy(&py.stderr)
        );
    }
    let figures = |file: &str| -> Result<(f64, f64)> {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join(file))?)?;
        let num = |k: &str| -> Vec<f64> {
            v[k].as_array()
                .map(|x| x.iter().filter_map(|y| y.as_f64()).collect())
                .unwrap_or_default()
        };
        let (tokens, secs) = (num("tokens"), num("step_s"));
        let rate = tokens[1..].iter().sum::<f64>() / secs[1..].iter().sum::<f64>();
        Ok((
            rate,
            v["peak_rss_kib"].as_f64().context("peak_rss_kib")? / 1024.0,
        ))
    };
    let (ferl_rate, ferl_mib) = figures("ferl.json")?;
    let (torch_rate, torch_mib) = figures("pytorch.json")?;
    out.row("train_ferl_tokens_per_s", ferl_rate, "tokens/s");
    out.row("train_pytorch_tokens_per_s", torch_rate, "tokens/s");
    out.row("train_ferl_peak_rss_MiB", ferl_mib, "MiB");
    out.row("train_pytorch_peak_rss_MiB", torch_mib, "MiB");
    out.row("train_tokens_per_s_ratio", ferl_rate / torch_rate, "x");
    out.row("train_peak_rss_ratio", ferl_mib / torch_mib, "x");
    Ok(())
}

/// ferl's side: the same loop as the PyTorch script (constant lr, AdamW, clipping, micro-batches).
fn child(a: &TrainArgs, dir: &Path) -> Result<()> {
    tch::set_num_threads(a.threads as i32);
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("settings.json"))?)?;
    let samples: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("data.json"))?)?;
    let ids: Vec<Vec<i64>> = samples
        .iter()
        .map(|x| {
            x["input_ids"]
                .as_array()
                .map(|v| v.iter().filter_map(|t| t.as_i64()).collect())
                .unwrap_or_default()
        })
        .collect();
    let masks: Vec<Vec<bool>> = samples
        .iter()
        .map(|x| {
            x["loss_mask"]
                .as_array()
                .map(|v| v.iter().filter_map(|t| t.as_bool()).collect())
                .unwrap_or_default()
        })
        .collect();
    let model = load_model(&dir.join("model"))?;
    let store = LocalParams::new(model.layout.clone(), model.params, Kind::Float);
    let opts = EngineOptions {
        gradient_checkpointing: a.gradient_checkpointing,
        ..EngineOptions::default()
    };
    let engine = Engine::new(model.config.clone(), store, Kind::Float, opts);
    let optimizer = AdamW::new(
        AdamWConfig {
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.01,
        },
        engine.store().master(),
    );
    let steps = s["total_steps"].as_i64().unwrap_or(a.steps as i64);
    let mut stepper = Stepper {
        engine,
        optimizer,
        schedule: LrSchedule::from_verl("constant", 1e-4, 0.0, steps, 0.0)?,
        clip_grad: 1.0,
        micro_batch_size: a.micro_batch,
        layout: Layout::Padded,
        device: Device::Cpu,
        completed_steps: 0,
    };
    let (mut tokens, mut secs) = (Vec::new(), Vec::new());
    for step in 0..steps as usize {
        let batch: Vec<SampleRef> = (step * a.batch..(step + 1) * a.batch)
            .map(|i| SampleRef {
                input_ids: &ids[i],
                loss_mask: &masks[i],
            })
            .collect();
        let t0 = Instant::now();
        let stats = stepper.step(&batch)?;
        secs.push(t0.elapsed().as_secs_f64());
        tokens.push(stats.tokens as f64);
    }
    let result =
        serde_json::json!({"tokens": tokens, "step_s": secs, "peak_rss_kib": vm_hwm_kib()?});
    std::fs::write(dir.join("ferl.json"), result.to_string())?;
    Ok(())
}
