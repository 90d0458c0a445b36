//! What the train suites share: the prepared folder (random-init tiny model, tokenized GSM8K rows, loop settings),
//! the Python peer's interpreter, and reading a side's per-step figures back.

use super::TrainArgs;
use anyhow::{bail, Context, Result};
use ferl::trainer::config::SftConfig;
use ferl::trainer::data::SftDataset;
use ferl::trainer::model::init_model;
use std::path::{Path, PathBuf};

/// Peak resident set of this process (`VmHWM`) in KiB.
pub(super) fn vm_hwm_kib() -> Result<f64> {
    Ok(ferl::actors::device_memory::peak_resident_bytes() as f64 / 1024.0)
}

/// The venv's Python (`$FERL_VENV`, else `~/.cache/ferl/venv`).
pub(crate) fn python() -> PathBuf {
    let venv = std::env::var_os("FERL_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ferl/venv")
        });
    venv.join("bin/python")
}

/// A script of `trainer/py/`.
pub(super) fn py_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../trainer/py")
        .join(name)
}

/// The loop both sides run: constant lr 1e-4, AdamW (0.9, 0.95), weight decay 0.01, clipping at 1.0.
pub(super) fn settings(a: &TrainArgs) -> serde_json::Value {
    serde_json::json!({
        "lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.01, "warmup_ratio": 0.0, "min_lr_ratio": 0.0,
        "scheduler": "constant", "total_steps": a.steps, "clip_grad": 1.0,
        "train_batch_size": a.batch, "micro_batch_size": a.micro_batch,
        "gradient_checkpointing": a.gradient_checkpointing,
    })
}

/// The `config.json` of the compared model: `--config`, or with `--lora-rank` and `--model-shape` the named shape's
/// (written to `dir/shape/config.json`).
fn model_config_file(a: &TrainArgs, dir: &Path) -> Result<PathBuf> {
    match (&a.model_shape, a.lora_rank) {
        (Some(shape), Some(_)) => {
            let file = dir.join("shape").join("config.json");
            std::fs::create_dir_all(dir.join("shape"))?;
            std::fs::write(&file, super::shape::shape_config(shape)?.to_string())?;
            Ok(file)
        }
        _ => Ok(a.config.clone()),
    }
}

/// Writes `dir/model` (the tiny Qwen2 or `--model-shape`'s, random init, seed 0), `dir/data.json` (the first
/// `batch * steps` GSM8K rows, tokenized: `input_ids`, `loss_mask`) and `dir/settings.json`.
pub(super) fn prepare(a: &TrainArgs, dir: &Path) -> Result<()> {
    init_model(
        &model_config_file(a, dir)?,
        Some(&a.tokenizer),
        &dir.join("model"),
        0,
    )?;
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
    Ok(())
}

/// The tokenized rows of `dir/data.json`.
pub(super) fn read_samples(dir: &Path) -> Result<Vec<ferl::actors::messages::Sample>> {
    let file = dir.join("data.json");
    let raw: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?,
    )
    .with_context(|| format!("parsing {}", file.display()))?;
    raw.iter()
        .enumerate()
        .map(|(i, x)| {
            let ids: Vec<i64> = x["input_ids"]
                .as_array()
                .map(|v| v.iter().filter_map(|t| t.as_i64()).collect())
                .unwrap_or_default();
            let mask: Vec<bool> = x["loss_mask"]
                .as_array()
                .map(|v| v.iter().filter_map(|t| t.as_bool()).collect())
                .unwrap_or_default();
            if ids.is_empty() || ids.len() != mask.len() {
                bail!(
                    "{} row {i}: {} input ids, {} loss-mask entries",
                    file.display(),
                    ids.len(),
                    mask.len()
                );
            }
            Ok(ferl::actors::messages::Sample {
                input_ids: ids,
                loss_mask: mask,
            })
        })
        .collect()
}

/// One side's record of a run (one process, or one rank): per-step real tokens (of the global batch), wall seconds,
/// loss, and the peak resident set.
#[derive(Debug, Clone)]
pub(super) struct SideRecord {
    /// Real tokens of each step's global batch.
    pub tokens: Vec<f64>,
    /// Wall seconds of each step.
    pub step_s: Vec<f64>,
    /// Global loss of each step (empty when the side does not report it).
    pub loss: Vec<f64>,
    /// Peak resident set, KiB.
    pub peak_rss_kib: f64,
    /// The fp32 GEMM peak this side measured on its threads ([`super::mfu::gemm_peak_flops`]), when it did.
    pub gemm_flops_per_s: Option<f64>,
}

impl SideRecord {
    /// Reads a side's JSON (`tokens`, `step_s`, optional `loss`, `peak_rss_kib`, optional `gemm_flops_per_s`).
    pub(super) fn read(file: &Path) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?,
        )
        .with_context(|| format!("parsing {}", file.display()))?;
        let num = |k: &str| -> Vec<f64> {
            v[k].as_array()
                .map(|x| x.iter().filter_map(|y| y.as_f64()).collect())
                .unwrap_or_default()
        };
        let record = Self {
            tokens: num("tokens"),
            step_s: num("step_s"),
            loss: num("loss"),
            peak_rss_kib: v["peak_rss_kib"]
                .as_f64()
                .with_context(|| format!("{}: no peak_rss_kib", file.display()))?,
            gemm_flops_per_s: v["gemm_flops_per_s"].as_f64(),
        };
        if record.tokens.len() < 2 || record.tokens.len() != record.step_s.len() {
            bail!(
                "{}: {} token counts and {} step times (need at least 2 steps, the first is a warm-up)",
                file.display(),
                record.tokens.len(),
                record.step_s.len()
            );
        }
        Ok(record)
    }

    /// Tokens per second over the timed steps (all but the first).
    pub(super) fn tokens_per_s(&self) -> f64 {
        self.tokens[1..].iter().sum::<f64>() / self.step_s[1..].iter().sum::<f64>()
    }

    /// Seconds of the timed steps.
    pub(super) fn timed_s(&self) -> f64 {
        self.step_s[1..].iter().sum()
    }
}

/// Combines the records of a group's ranks: global tokens over the slowest rank's time, the largest peak.
pub(super) fn group_figures(ranks: &[SideRecord]) -> (f64, f64) {
    let tokens: f64 = ranks[0].tokens[1..].iter().sum();
    let slowest = ranks.iter().map(SideRecord::timed_s).fold(0.0, f64::max);
    let peak = ranks.iter().map(|r| r.peak_rss_kib).fold(0.0, f64::max);
    (tokens / slowest, peak / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_figures_use_the_slowest_rank_and_the_largest_peak() {
        let rank = |s: f64, kib: f64| SideRecord {
            tokens: vec![10.0, 100.0, 100.0],
            step_s: vec![9.0, s, s],
            loss: vec![],
            peak_rss_kib: kib,
            gemm_flops_per_s: None,
        };
        let (rate, mib) = group_figures(&[rank(1.0, 2048.0), rank(2.0, 1024.0)]);
        assert_eq!(rate, 50.0, "200 timed tokens over the slower rank's 4 s");
        assert_eq!(mib, 2.0);
        assert_eq!(
            rank(1.0, 0.0).tokens_per_s(),
            100.0,
            "the warm-up step is not timed"
        );
    }
}
