//! `ferl grpo --nproc-per-node 2` learns, run as a user would: the digit task with its tokenizer and chat template in
//! the model folder (a word-level vocabulary of 16, [`ferl_tests::rl::write_digit_model`]), prompts in verl's RL
//! layout (each digit asked as the user's message, the digit as ground truth) and the plugin template's exact-match
//! reward built as a plugin (`custom_reward_function.path`). A response is its first token (`response_length=1`),
//! decoded as verl decodes it, so it earns 1 when it is the digit asked: about 1/16 at random init. With n = 8 at
//! temperature 1, lr 3e-3, 2 PPO epochs of 4 mini-batches and a KL loss to the initial weights, the mean reward rises
//! from its start to ≥ 0.8 within 40 steps on the two ranks and stays learned (≥ 0.75 over the last 10; the curve
//! is printed: 0.06 at step 1, 0.8 first at step 11 when this test was written).

use ferl_rl::digits::GRPO_KEYS;
use ferl_tests::rl::{template_reward, write_digit_model, write_digit_prompts};
use ferl_tests::*;
use serde_json::Value;
use std::process::Command;

/// Steps the run may take.
const STEPS: usize = 40;

#[test]
fn grpo_on_two_ranks_learns_the_digit_task_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_digit_model(&d.join("model"), 7).unwrap();
    write_digit_prompts(&d.join("train.jsonl"), 2).unwrap();
    let run = d.join("run");
    let s = |p: std::path::PathBuf| p.display().to_string();
    let mut args: Vec<String> = vec![
        "grpo".into(),
        "--nproc-per-node".into(),
        "2".into(),
        format!("data.train_files={}", s(d.join("train.jsonl"))),
        format!("actor_rollout_ref.model.path={}", s(d.join("model"))),
        format!("trainer.default_local_dir={}", s(run.clone())),
        format!("custom_reward_function.path={}", s(template_reward())),
        "custom_reward_function.name=template-reward".into(),
        format!("trainer.total_training_steps={STEPS}"),
    ];
    args.extend(GRPO_KEYS.iter().map(|k| k.to_string()));
    args.extend(
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "trainer.logger=[console,jsonl]",
        ]
        .map(String::from),
    );
    let out = Command::new(ferl_binary())
        .env("OMP_NUM_THREADS", "1")
        .env_remove("FERL_PLUGIN_PATH")
        .args(&args)
        .output()
        .unwrap();
    assert_success(&out, "ferl grpo --nproc-per-node 2");
    let curve: Vec<f64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["critic/score/mean"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let shown: Vec<String> = curve.iter().map(|r| format!("{r:.2}")).collect();
    println!("mean reward per step: {}", shown.join(" "));
    assert_eq!(curve.len(), STEPS);
    assert!(curve[0] < 0.3, "the random policy starts low: {}", curve[0]);
    let reached = curve.iter().position(|&r| r >= 0.8);
    assert!(
        reached.is_some(),
        "the mean reward never reached 0.8: {shown:?}"
    );
    println!("0.8 first reached at step {}", reached.unwrap() + 1);
    let last: f64 = curve[STEPS - 10..].iter().sum::<f64>() / 10.0;
    assert!(
        last >= 0.75,
        "the task stays learned: {last} over the last 10 steps"
    );
}
