//! `ferl-bench train --token-budget N`: token-budget micro-batches (`data.use_dynamic_bsz=true
//! data.max_token_len_per_gpu=N`, [`Batching::TokenBudget`]) beside fixed micro-batches of `--micro-batch` samples,
//! on the same model (the tiny Qwen2, random init), the same GSM8K batches, loop and threads, padded and packed
//! (`use_remove_padding`). Each of the four runs is a child process; the first step is a warm-up.
//!
//! Rows: `train_{fixed,budget}_{padded,packed}_tokens_per_s` (real tokens of the timed steps / their wall time),
//! `train_{fixed,budget}_{padded,packed}_micro_batches_per_step`, `train_{fixed,budget}_{padded,packed}_peak_rss_MiB`
//! and `train_budget_vs_fixed_{padded,packed}` (tokens/s ratio). The token-budget plan is the one every launch path
//! uses; at one rank it only forms the micro-batches (at more ranks it also balances the ranks).

use super::common::{prepare, read_samples, vm_hwm_kib, SideRecord};
use super::{shape, TrainArgs};
use crate::report::Report;
use anyhow::{bail, Context, Result};
use ferl::actors::messages::Sample;
use ferl::trainer::batch::{Layout, SampleRef};
use ferl::trainer::data::Batching;
use ferl::trainer::engine::EngineOptions;
use ferl::trainer::model::load_model;
use ferl::trainer::params::LocalParams;
use std::path::Path;
use std::process::Command;
use std::time::Instant;
use tch::{Device, Kind};

/// The four runs: (form, layout).
const RUNS: [(&str, &str); 4] = [
    ("fixed", "padded"),
    ("budget", "padded"),
    ("fixed", "packed"),
    ("budget", "packed"),
];

/// Runs the comparison at a budget of `budget` tokens per micro-batch.
pub(super) fn run(a: &TrainArgs, budget: usize, out: &mut Report) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("ferl-bench-budget-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = measure(a, budget, &dir, out);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(a: &TrainArgs, budget: usize, dir: &Path, out: &mut Report) -> Result<()> {
    prepare(a, dir)?;
    let longest = read_samples(dir)?.iter().map(|s| s.input_ids.len()).max();
    eprintln!(
        "train --token-budget {budget}: batch {}, fixed micro-batch {}, longest sample {} tokens",
        a.batch,
        a.micro_batch,
        longest.unwrap_or(0)
    );
    let mut rates = Vec::new();
    for (form, layout) in RUNS {
        let record = run_child(a, budget, dir, form, layout)?;
        let side = SideRecord::read(&record)?;
        let micro: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&record)?)?;
        let name = format!("train_{form}_{layout}");
        out.row(
            &format!("{name}_tokens_per_s"),
            side.tokens_per_s(),
            "tokens/s",
        );
        let per_step = micro["micro_batches_per_step"].as_f64().unwrap_or(0.0);
        out.row(&format!("{name}_micro_batches_per_step"), per_step, "count");
        out.row(
            &format!("{name}_peak_rss_MiB"),
            side.peak_rss_kib / 1024.0,
            "MiB",
        );
        rates.push(side.tokens_per_s());
    }
    out.row("train_budget_vs_fixed_padded", rates[1] / rates[0], "x");
    out.row("train_budget_vs_fixed_packed", rates[3] / rates[2], "x");
    Ok(())
}

fn run_child(
    a: &TrainArgs,
    budget: usize,
    dir: &Path,
    form: &str,
    layout: &str,
) -> Result<std::path::PathBuf> {
    let record = dir.join(format!("{form}_{layout}.json"));
    let output = Command::new(std::env::current_exe()?)
        .args(["train", "--budget-child", &format!("{form},{layout}")])
        .args(["--token-budget", &budget.to_string()])
        .args(["--batch", &a.batch.to_string()])
        .args(["--micro-batch", &a.micro_batch.to_string()])
        .args(["--steps", &a.steps.to_string()])
        .args(["--threads", &a.threads.unwrap_or(2).to_string()])
        .arg("--child")
        .arg(dir)
        .arg("--out")
        .arg(&record)
        .output()
        .with_context(|| format!("starting the {form} {layout} run"))?;
    if !output.status.success() {
        bail!(
            "the {form} {layout} run failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(record)
}

/// One run (`--budget-child FORM,LAYOUT --child DIR`): `--steps` steps on the prepared rows.
pub(super) fn child(a: &TrainArgs, spec: &str, budget: usize, dir: &Path) -> Result<()> {
    tch::set_num_threads(a.threads.unwrap_or(2) as i32);
    let (form, layout) = spec.split_once(',').context("--budget-child FORM,LAYOUT")?;
    let layout = match layout {
        "padded" => Layout::Padded,
        "packed" => Layout::Packed,
        other => bail!("--budget-child: layout {other} (padded or packed)"),
    };
    let batching = match form {
        "fixed" => Batching::Fixed {
            micro_batch_size: a.micro_batch,
        },
        "budget" => Batching::TokenBudget {
            max_tokens: budget,
            padded: layout == Layout::Padded,
        },
        other => bail!("--budget-child: form {other} (fixed or budget)"),
    };
    let samples = read_samples(dir)?;
    let model = load_model(&dir.join("model"))?;
    let (kind, device) = (Kind::Float, Device::Cpu);
    let store = LocalParams::new(model.layout, model.params, kind);
    let opts = EngineOptions {
        gradient_checkpointing: a.gradient_checkpointing,
        ..EngineOptions::default()
    };
    let mut stepper = shape::stepper(&model.config, store, kind, opts, device, a)?;
    stepper.layout = layout;
    let (mut tokens, mut secs, mut micro) = (Vec::new(), Vec::new(), 0usize);
    for step in 0..a.steps {
        let rows = samples
            .get(step * a.batch..(step + 1) * a.batch)
            .with_context(|| format!("step {step}: {} samples prepared", samples.len()))?;
        let (ordered, sizes) = planned(rows, batching)?;
        micro += sizes.len();
        let targets = ordered.iter().map(SampleRef::num_targets).sum();
        let t0 = Instant::now();
        let stats = stepper.step_in_micro_batches(&ordered, &sizes, targets)?;
        secs.push(t0.elapsed().as_secs_f64());
        tokens.push(stats.tokens as f64);
    }
    let record = serde_json::json!({
        "tokens": tokens, "step_s": secs, "peak_rss_kib": vm_hwm_kib()?,
        "micro_batches_per_step": micro as f64 / a.steps as f64,
    });
    let file = a.out.clone().unwrap_or_else(|| dir.join("budget.json"));
    std::fs::write(&file, record.to_string())?;
    Ok(())
}

/// The rows of one step in `batching`'s micro-batches (one rank): the samples in order and the micro-batch sizes.
fn planned(rows: &[Sample], batching: Batching) -> Result<(Vec<SampleRef<'_>>, Vec<usize>)> {
    let lengths: Vec<usize> = rows.iter().map(|s| s.input_ids.len()).collect();
    let positions: Vec<usize> = (0..rows.len()).collect();
    let plan = batching.plan(&positions, &lengths, 1)?;
    let ordered = plan[0]
        .iter()
        .flatten()
        .map(|&p| SampleRef {
            input_ids: &rows[p].input_ids,
            loss_mask: &rows[p].loss_mask,
        })
        .collect();
    Ok((ordered, plan[0].iter().map(Vec::len).collect()))
}
