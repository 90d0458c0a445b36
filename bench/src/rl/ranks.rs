//! The GRPO rows of the trainer ranks: `ferl grpo` (the CLI, the binary beside this one) at world 1 and at world 2
//! (`--nproc-per-node 2`), the same global batch on the same cores — world 1 with every core's intra-op thread,
//! world 2 with the cores split between the ranks, as each path sets its threads. Each run is `1 + --ranks-steps`
//! steps; the first is a warm-up; a run's figure is the mean of the others from its `metrics.jsonl`. Every figure is
//! the median of `--ranks-runs` runs (min and max beside it), worlds alternating.
//!
//! The model is `--ranks-model` (Qwen2.5-0.5B's shape by default, random init), [`PROMPTS`] GSM8K prompts ×
//! [`N`] responses of at most [`NEW_TOKENS`] tokens, one optimizer step per step, a KL loss (the frozen sharded
//! reference runs), scored by the first-party `gsm8k` reward plugin (built beside the binary).
//!
//! Rows:
//! - `grpo_ranks_step_s_world{1,2}` and `grpo_ranks_speedup_world2` (world 1's step time over world 2's; goal ≥ 1.6).
//! - `grpo_ranks_peak_gb_world{1,2}` (the largest rank's peak resident memory, `perf/max_memory_gb/rank_R`: shards,
//!   optimizer, the frozen reference's shard and the rollout's gathered copy all counted) and
//!   `grpo_ranks_peak_ratio_world2` (goal ≤ 0.7).
//! - `grpo_ranks_gather_GBps_world{1,2}`: the colocated weight gather (`timing_s/update_weights`: the model's fp32
//!   bytes gathered from the shards into the rollout model), beside `memcpy_GBps_same_bytes` (one copy of the same
//!   bytes between two buffers in this process: the ceiling) and `grpo_ranks_gather_share_of_memcpy_world{1,2}`
//!   (goal ≥ 0.5).

use super::{median, RlArgs};
use crate::report::Report;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Prompts per step (`data.train_batch_size`).
const PROMPTS: usize = 2;
/// Responses per prompt (`rollout.n`).
const N: usize = 2;
/// Most tokens per response.
const NEW_TOKENS: usize = 16;

/// One run's figures: step seconds, the largest rank's peak GiB and the gather's seconds (means after the warm-up).
#[derive(Clone, Copy, Debug)]
struct RunFigures {
    step_s: f64,
    peak_gb: f64,
    gather_s: f64,
}

/// Runs both worlds `--ranks-runs` times on `model` and prints the rows.
pub(crate) fn run(
    a: &RlArgs,
    name: &str,
    model: &Path,
    dir: &Path,
    out: &mut Report,
) -> Result<()> {
    let ferl = ferl_binary()?;
    let data = dir.join("ranks-prompts.jsonl");
    write_prompts(a, &data)?;
    let bytes = 4.0 * num_params(model)? as f64;
    let mut figures: [Vec<RunFigures>; 2] = [Vec::new(), Vec::new()];
    for run in 0..a.ranks_runs {
        for (i, world) in [1usize, 2].into_iter().enumerate() {
            let started = Instant::now();
            let f = one_run(
                a,
                &ferl,
                model,
                &data,
                &dir.join(format!("ranks-{world}-{run}")),
                world,
            )?;
            eprintln!(
                "rl: ranks: world {world} run {}: {:.2} s/step, peak {:.2} GiB, gather {:.3} s ({:.0} s in all)",
                run + 1,
                f.step_s,
                f.peak_gb,
                f.gather_s,
                started.elapsed().as_secs_f64()
            );
            figures[i].push(f);
        }
    }
    let stat = |i: usize, f: fn(&RunFigures) -> f64| {
        let v: Vec<f64> = figures[i].iter().map(f).collect();
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
        (median(v), lo, hi)
    };
    let memcpy = memcpy_gbps(bytes as usize);
    out.row(&format!("memcpy_GBps_same_bytes_{name}"), memcpy, "GB/s");
    for (i, world) in [1, 2].into_iter().enumerate() {
        let (s, lo, hi) = stat(i, |f| f.step_s);
        out.row(&format!("grpo_ranks_step_s_world{world}_{name}"), s, "s");
        out.row(
            &format!("grpo_ranks_step_s_world{world}_{name}_min"),
            lo,
            "s",
        );
        out.row(
            &format!("grpo_ranks_step_s_world{world}_{name}_max"),
            hi,
            "s",
        );
        let (m, _, _) = stat(i, |f| f.peak_gb);
        out.row(&format!("grpo_ranks_peak_gb_world{world}_{name}"), m, "GiB");
        let (g, _, _) = stat(i, |f| f.gather_s);
        let gbps = bytes / g.max(1e-9) / 1e9;
        out.row(
            &format!("grpo_ranks_gather_GBps_world{world}_{name}"),
            gbps,
            "GB/s",
        );
        let share = format!("grpo_ranks_gather_share_of_memcpy_world{world}_{name}");
        out.row(&share, gbps / memcpy, "x");
    }
    let speedup = stat(0, |f| f.step_s).0 / stat(1, |f| f.step_s).0;
    out.row(&format!("grpo_ranks_speedup_world2_{name}"), speedup, "x");
    let ratio = stat(1, |f| f.peak_gb).0 / stat(0, |f| f.peak_gb).0;
    out.row(&format!("grpo_ranks_peak_ratio_world2_{name}"), ratio, "x");
    Ok(())
}

/// The `ferl` binary beside this one.
pub(super) fn ferl_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let ferl = exe.with_file_name("ferl");
    if !ferl.is_file() {
        bail!(
            "{} is missing: build it beside ferl-bench (cargo build --release -p ferl -p ferl-plugin-gsm8k -p ferl-bench)",
            ferl.display()
        );
    }
    Ok(ferl)
}

/// The suite's GSM8K questions in verl's RL layout (scored by the `gsm8k` plugin).
fn write_prompts(a: &RlArgs, file: &Path) -> Result<()> {
    let text = std::fs::read_to_string(&a.data)
        .with_context(|| format!("reading {}", a.data.display()))?;
    let mut rows = String::new();
    for line in text.lines().take(PROMPTS) {
        let row: Value = serde_json::from_str(line)?;
        let question = row["question"].as_str().context("a row without question")?;
        let answer = row["answer"].as_str().unwrap_or_default();
        let instruction = ferl::trainer::data::gsm8k::INSTRUCTION;
        let truth = ferl::trainer::data::gsm8k::extract_solution(answer).unwrap_or_default();
        let rl = serde_json::json!({
            "prompt": [{"role": "user", "content": format!("{question} {instruction}")}],
            "data_source": "openai/gsm8k",
            "reward_model": {"ground_truth": truth},
        });
        rows.push_str(&format!("{rl}\n"));
    }
    std::fs::write(file, rows)?;
    Ok(())
}

/// Parameters of the model folder's config.
fn num_params(model: &Path) -> Result<i64> {
    let cfg = ferl::trainer::model::config::ModelConfig::from_file(&model.join("config.json"))?;
    Ok(ferl::trainer::model::layout::ModelLayout::new(&cfg).num_params())
}

/// One `ferl grpo` run at `world` ranks into `run_dir`; its figures after the warm-up step.
fn one_run(
    a: &RlArgs,
    ferl: &Path,
    model: &Path,
    data: &Path,
    run_dir: &Path,
    world: usize,
) -> Result<RunFigures> {
    let steps = 1 + a.ranks_steps;
    let mut cmd = Command::new(ferl);
    cmd.env_remove("OMP_NUM_THREADS").arg("grpo");
    if world > 1 {
        cmd.args(["--nproc-per-node", &world.to_string()]);
    }
    let per_rank = PROMPTS * N / world;
    cmd.args([
        format!("data.train_files={}", data.display()),
        format!("actor_rollout_ref.model.path={}", model.display()),
        format!("trainer.default_local_dir={}", run_dir.display()),
        format!("trainer.total_training_steps={steps}"),
        format!("data.train_batch_size={PROMPTS}"),
        "data.max_prompt_length=512".into(),
        format!("data.max_response_length={NEW_TOKENS}"),
        format!("actor_rollout_ref.rollout.n={N}"),
        format!("actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}"),
        format!("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={per_rank}"),
        format!("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={per_rank}"),
        format!("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={per_rank}"),
        "actor_rollout_ref.actor.use_kl_loss=true".into(),
        "actor_rollout_ref.model.enable_gradient_checkpointing=false".into(),
        "trainer.logger=[jsonl]".into(),
        "trainer.device=cpu".into(),
        "algorithm.adv_estimator=grpo".into(),
    ]);
    let output = cmd.output().context("running ferl grpo")?;
    if !output.status.success() {
        bail!(
            "ferl grpo at world {world} failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl"))?;
    let lines: Vec<Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    std::fs::remove_dir_all(run_dir).ok();
    let after: Vec<&Value> = lines.iter().skip(1).collect();
    if after.is_empty() {
        bail!("world {world}: no step after the warm-up in metrics.jsonl");
    }
    let mean =
        |f: &dyn Fn(&Value) -> f64| after.iter().map(|l| f(l)).sum::<f64>() / after.len() as f64;
    let number = |l: &Value, k: &str| l[k].as_f64().unwrap_or(f64::NAN);
    let peak = |l: &Value| {
        (0..world)
            .map(|r| number(l, &format!("perf/max_memory_gb/rank_{r}")))
            .fold(0.0, f64::max)
    };
    Ok(RunFigures {
        step_s: mean(&|l| number(l, "timing_s/step")),
        peak_gb: after.iter().map(|l| peak(l)).fold(0.0, f64::max),
        gather_s: mean(&|l| number(l, "timing_s/update_weights")),
    })
}

/// One copy of `bytes` bytes between two buffers (touched first), the median of 5, in GB/s.
fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    bytes as f64 / median(times) / 1e9
}
