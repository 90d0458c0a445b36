//! The learning rows: time for GRPO to reach a mean reward of [`GOAL`] on the digit task of the CLI learning test
//! ([`ferl::rl::digits`]: tokenizer and chat template in the model folder, the plugin template's exact-match reward),
//! `ferl grpo` in one process and on `--nproc-per-node 2`, against TRL's `GRPOTrainer` (`rl/trl_peer.py`, one
//! process, in a private network namespace) on the same model folder, prompts, reward, batch (20 prompts × n 8),
//! mini-batches (5 prompts: 4 optimizer steps per generation), micro-batches (a whole mini-batch), 2 PPO epochs,
//! learning rate 3e-3 (constant), KL coefficient 0.001, clip ratios 0.2/0.28, seed and threads (every core).
//!
//! A run's figure is the training time until the first batch whose mean reward reaches the goal: for ferl the step
//! times (`timing_s/step`) summed through that step, for TRL the seconds from `on_train_begin` to the log of that
//! batch's reward (its generation and one optimizer step). Process start-up is not counted on either side (it is
//! printed). Rows (median of `--learn-runs` runs, min and max beside): `learn_to_0.8_s_{ferl_world1,ferl_world2,trl}`,
//! `learn_speedup_vs_trl_world{1,2}` (TRL's time over ferl's; goal ≥ 4 at world 1).

use super::{median, RlArgs};
use crate::report::Report;
use anyhow::{bail, Context, Result};
use ferl::plugins::cargo_build::{build_plugin, workspace_root, PluginBuild};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The mean reward the runs race to.
const GOAL: f64 = 0.8;
/// Steps (generations) each run may take.
const STEPS: usize = 30;

/// Runs ferl at world 1 and 2 and TRL `--learn-runs` times each and prints the rows.
pub(crate) fn run(a: &RlArgs, dir: &Path, out: &mut Report) -> Result<()> {
    let model = dir.join("digits-model");
    ferl::rl::digits::write_digit_model(&model, 7)?;
    let data = dir.join("digits.jsonl");
    ferl::rl::digits::write_digit_prompts(&data, 2)?;
    let reward = template_reward(dir)?;
    let ferl = super::ranks::ferl_binary()?;
    let mut times: [Vec<f64>; 3] = Default::default();
    for run in 0..a.learn_runs {
        for (i, world) in [1usize, 2].into_iter().enumerate() {
            let run_dir = dir.join(format!("learn-{world}-{run}"));
            let s = ferl_to_goal(&ferl, &model, &data, &reward, &run_dir, world)?;
            eprintln!(
                "rl: learn: ferl world {world} run {}: {s:.2} s to {GOAL}",
                run + 1
            );
            times[i].push(s);
        }
        let s = trl_to_goal(a, &model, &data, &dir.join(format!("trl-{run}.json")))?;
        eprintln!("rl: learn: TRL run {}: {s:.2} s to {GOAL}", run + 1);
        times[2].push(s);
    }
    let names = ["ferl_world1", "ferl_world2", "trl"];
    let mut medians = [0.0; 3];
    for (i, name) in names.iter().enumerate() {
        let v = &times[i];
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
        medians[i] = median(v.clone());
        out.row(&format!("learn_to_0.8_s_{name}"), medians[i], "s");
        out.row(&format!("learn_to_0.8_s_{name}_min"), lo, "s");
        out.row(&format!("learn_to_0.8_s_{name}_max"), hi, "s");
    }
    out.row("learn_speedup_vs_trl_world1", medians[2] / medians[0], "x");
    out.row("learn_speedup_vs_trl_world2", medians[2] / medians[1], "x");
    Ok(())
}

/// The plugin template's exact-match reward, built as a plugin under `dir`.
fn template_reward(dir: &Path) -> Result<PathBuf> {
    let root = std::env::current_dir()?;
    let ws = workspace_root(&root).context("run ferl-bench from the repository")?;
    let spec = PluginBuild {
        package: "ferl-plugin-template".into(),
        features: vec!["reward".into()],
        ..Default::default()
    };
    build_plugin(&ws, &dir.join("reward-plugin"), &spec)
}

/// Seconds of training until `ferl grpo` at `world` ranks first reaches [`GOAL`].
fn ferl_to_goal(
    ferl: &Path,
    model: &Path,
    data: &Path,
    reward: &Path,
    run_dir: &Path,
    world: usize,
) -> Result<f64> {
    let mut cmd = Command::new(ferl);
    cmd.env_remove("OMP_NUM_THREADS").arg("grpo");
    if world > 1 {
        cmd.args(["--nproc-per-node", &world.to_string()]);
    }
    cmd.args([
        format!("data.train_files={}", data.display()),
        format!("actor_rollout_ref.model.path={}", model.display()),
        format!("trainer.default_local_dir={}", run_dir.display()),
        format!("custom_reward_function.path={}", reward.display()),
        "custom_reward_function.name=template-reward".into(),
        format!("trainer.total_training_steps={STEPS}"),
    ]);
    cmd.args(ferl::rl::digits::GRPO_KEYS).args([
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "trainer.logger=[jsonl]",
    ]);
    let output = cmd.output().context("running ferl grpo")?;
    if !output.status.success() {
        bail!(
            "ferl grpo failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl"))?;
    std::fs::remove_dir_all(run_dir).ok();
    let mut elapsed = 0.0;
    let mut curve = Vec::new();
    for line in text.lines() {
        let l: Value = serde_json::from_str(line)?;
        elapsed += l["timing_s/step"].as_f64().unwrap_or(0.0);
        let score = l["critic/score/mean"].as_f64().unwrap_or(0.0);
        curve.push(format!("{score:.2}@{elapsed:.2}s"));
        if score >= GOAL {
            eprintln!(
                "rl: learn: ferl world {world}: mean reward per step: {}",
                curve.join(" ")
            );
            return Ok(elapsed);
        }
    }
    bail!("ferl at world {world} did not reach {GOAL} in {STEPS} steps")
}

/// Seconds of training until TRL first reaches [`GOAL`].
fn trl_to_goal(a: &RlArgs, model: &Path, data: &Path, out: &Path) -> Result<f64> {
    let venv = std::env::var("FERL_VENV").context("FERL_VENV (source scripts/env.sh)")?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/rl/trl_peer.py");
    let output = Command::new("unshare")
        .arg("-n")
        .arg(Path::new(&venv).join("bin/python"))
        .arg(script)
        .args(["--model", &model.display().to_string()])
        .args(["--data", &data.display().to_string()])
        .args(["--out", &out.display().to_string()])
        .args(["--threads", &a.threads().to_string()])
        .args(["--generations", &STEPS.to_string()])
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .output()
        .context("running TRL (scripts/setup.sh installs trl into the venv)")?;
    if !output.status.success() {
        let err = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = err.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "the TRL peer failed ({}):\n{}",
            output.status,
            tail.join("\n")
        );
    }
    let v: Value = serde_json::from_str(&std::fs::read_to_string(out)?)?;
    let curve: Vec<String> = (v["curve"].as_array().into_iter().flatten())
        .map(|p| {
            format!(
                "{:.2}@{:.2}s",
                p[2].as_f64().unwrap_or(0.0),
                p[1].as_f64().unwrap_or(0.0)
            )
        })
        .collect();
    eprintln!(
        "rl: learn: TRL set-up (imports, model, trainer) {:.1} s; mean reward per generation: {}",
        v["setup_s"].as_f64().unwrap_or(0.0),
        curve.join(" ")
    );
    v["reached_s"]
        .as_f64()
        .with_context(|| format!("TRL did not reach {GOAL} in {STEPS} generations"))
}
