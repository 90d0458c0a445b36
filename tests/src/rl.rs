//! What the RL tests share: the GSM8K fixture and `ferl grpo` arguments of the CLI tests with their step comparison,
//! the plugin template's exact-match reward built as a plugin, and the digit task as a user
//! would bring it to `ferl grpo` — a tiny Qwen2 whose word-level tokenizer (vocabulary 16) and chat template are in
//! its model folder, and prompts in verl's RL layout.

use std::path::{Path, PathBuf};

use serde_json::Value;

use ferl::plugins::cargo_build::{build_plugin, workspace_root, PluginBuild};

use crate::{output_text, repo_root, run_ferl, write_gsm8k_slice, write_tiny_model};

/// The plugin template's exact-match reward (`--features reward`, named `template-reward`), built once into the
/// cache the tests share.
pub fn template_reward() -> PathBuf {
    let ws = workspace_root(&repo_root()).unwrap();
    let spec = PluginBuild {
        package: "ferl-plugin-template".into(),
        features: vec!["reward".into()],
        ..Default::default()
    };
    let target = std::env::temp_dir()
        .join("ferl-plugin-builds")
        .join("ferl-plugin-template-reward");
    build_plugin(&ws, &target, &spec).unwrap_or_else(|e| panic!("{e:#}"))
}

pub use ferl_rl::digits::{write_digit_model, write_digit_prompts};

/// A tiny model and verl's GSM8K parquet of 6 training rows.
pub fn fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_tiny_model(&d.join("model")).unwrap();
    std::fs::create_dir_all(d.join("raw")).unwrap();
    write_gsm8k_slice(&d.join("raw/train.jsonl"), 6).unwrap();
    write_gsm8k_slice(&d.join("raw/test.jsonl"), 2).unwrap();
    let out = run_ferl(&[
        "data".into(),
        "gsm8k".into(),
        "--input-dir".into(),
        d.join("raw").display().to_string(),
        "--local-dir".into(),
        d.join("data").display().to_string(),
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
    dir
}

/// `ferl grpo` on the fixture: 2 prompts x 2 responses of 6 tokens per step, KL loss and an entropy bonus.
pub fn grpo_args(d: &Path, run: &str, steps: usize, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "grpo".into(),
        format!(
            "data.train_files={}",
            d.join("data/train.parquet").display()
        ),
        format!("actor_rollout_ref.model.path={}", d.join("model").display()),
        format!("trainer.default_local_dir={}", d.join(run).display()),
        "data.train_batch_size=2".into(),
        "data.max_prompt_length=256".into(),
        "data.max_response_length=6".into(),
        "actor_rollout_ref.rollout.n=2".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
        "actor_rollout_ref.actor.use_kl_loss=true".into(),
        "actor_rollout_ref.actor.entropy_coeff=0.01".into(),
        "actor_rollout_ref.actor.optim.lr=1e-3".into(),
        "actor_rollout_ref.model.enable_gradient_checkpointing=false".into(),
        "algorithm.adv_estimator=grpo".into(),
        "trainer.logger=[console,jsonl]".into(),
        "trainer.device=cpu".into(),
        "trainer.n_gpus_per_node=1".into(),
        "trainer.val_before_train=false".into(),
        "trainer.save_freq=1".into(),
        format!("trainer.total_training_steps={steps}"),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// The lines of a run folder's `metrics.jsonl`, one per step.
pub fn metrics(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The number `key` of a metrics line (`{"step": N, "<key>": value, ...}`).
pub fn number(line: &Value, key: &str) -> f64 {
    line.get(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no `{key}` in {line}"))
}

/// The metrics a step's responses, rewards, losses and update decide (not timings, throughput or memory).
pub const STEP_KEYS: [&str; 9] = [
    "critic/score/mean",
    "response_length/mean",
    "response_length/max",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
];

/// Asserts that the runs' lines agree on [`STEP_KEYS`] within `tol` (relative above 1), and prints the largest
/// difference.
pub fn assert_same_steps(what: &str, want: &[Value], got: &[Value], tol: f64) {
    assert_eq!(want.len(), got.len(), "{what}: steps");
    let mut largest = 0.0_f64;
    for (w, g) in want.iter().zip(got) {
        for key in STEP_KEYS {
            let (x, y) = (number(w, key), number(g, key));
            let diff = (x - y).abs() / x.abs().max(1.0);
            largest = largest.max(diff);
            assert!(
                diff <= tol,
                "{what}, step {}: {key} {x} in the reference run, {y} here",
                w["step"]
            );
        }
    }
    println!("{what}: largest difference {largest:.2e} (tolerance {tol:.0e})");
}
