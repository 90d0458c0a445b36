//! Every config under examples/configs loads (with the overrides scripts/demo.sh adds) — as a
//! [`PpoConfig`] when it has an `actor_rollout_ref` section, else as an [`SftConfig`] — and the demo's is the short
//! CPU run the README promises.

use std::path::{Path, PathBuf};

use ferl_config::ppo::AdvEstimator;
use ferl_config::{PpoConfig, SftConfig, Truncation};

fn configs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/configs")
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Whether the config file is a PPO one (it has verl's `actor_rollout_ref` section).
fn is_ppo(path: &Path) -> bool {
    let text = std::fs::read_to_string(path).unwrap();
    let tree: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    tree.get("actor_rollout_ref").is_some()
}

#[test]
fn example_configs_load_with_the_demo_overrides() {
    let sft = strings(&[
        "data.train_files=/tmp/demo/data/train.parquet",
        "data.val_files=/tmp/demo/data/test.parquet",
        "model.partial_pretrain=/tmp/demo/model",
        "trainer.default_local_dir=/tmp/demo/checkpoints",
    ]);
    let ppo = strings(&[
        "data.train_files=/tmp/demo/data/train.parquet",
        "data.val_files=/tmp/demo/data/test.parquet",
        "actor_rollout_ref.model.path=/tmp/demo/model",
        "trainer.default_local_dir=/tmp/demo/checkpoints",
    ]);
    let (mut n_sft, mut n_ppo) = (0, 0);
    for entry in std::fs::read_dir(configs_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        if is_ppo(&path) {
            let cfg = PpoConfig::load(Some(&path), &ppo)
                .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            assert_eq!(cfg.actor_rollout_ref.model.path, "/tmp/demo/model");
            n_ppo += 1;
        } else {
            let cfg = SftConfig::load(Some(&path), &sft)
                .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            assert_eq!(cfg.model.partial_pretrain, "/tmp/demo/model");
            n_sft += 1;
        }
    }
    assert!(n_sft >= 1 && n_ppo >= 1, "example configs missing");
}

#[test]
fn grpo_tiny_is_a_small_cpu_grpo_run() {
    let cfg = PpoConfig::load(Some(&configs_dir().join("grpo_tiny.yaml")), &[]).unwrap();
    let (d, a, r) = (
        &cfg.data,
        &cfg.actor_rollout_ref.actor,
        &cfg.actor_rollout_ref.rollout,
    );
    assert_eq!(cfg.algorithm.adv_estimator, AdvEstimator::Grpo);
    assert!(!cfg.uses_critic());
    assert_eq!((d.train_batch_size, r.n), (8, 4));
    assert_eq!((d.max_prompt_length, d.max_response_length), (64, 32));
    assert_eq!((r.prompt_length, r.response_length), (64, 32));
    assert!(a.use_kl_loss);
    assert_eq!(r.name, "ferl");
    assert_eq!(cfg.actor_rollout_ref.model.path, "runs/demo/model");
    let steps = cfg.trainer.total_training_steps.unwrap();
    assert!(
        steps <= 20,
        "{steps} steps would not finish quickly on 2 cores"
    );
    assert_eq!(cfg.trainer.device, "cpu");
    assert_eq!(cfg.trainer.logger.as_slice(), ["console", "jsonl"]);
}

#[test]
fn demo_config_is_a_short_cpu_run_that_leaves_a_checkpoint() {
    let cfg = SftConfig::load(Some(&configs_dir().join("gsm8k_tiny.yaml")), &[]).unwrap();
    assert_eq!(
        (cfg.data.prompt_key.as_str(), cfg.data.response_key.as_str()),
        ("question", "answer")
    );
    assert_eq!(cfg.data.max_length, 512);
    assert_eq!(cfg.data.truncation, Truncation::Right);
    assert_eq!(cfg.data.micro_batch_size_per_gpu, 4);
    assert!((16..=32).contains(&cfg.data.train_batch_size));
    assert_eq!(cfg.optim.lr, 1e-4);
    let steps = cfg.trainer.total_training_steps.unwrap();
    assert!(
        steps <= 100,
        "{steps} steps would not finish in a few minutes on 2 cores"
    );
    assert!(
        cfg.trainer.save_freq > 0 && steps as i64 % cfg.trainer.save_freq == 0,
        "a checkpoint at the end"
    );
    assert!(cfg.trainer.test_freq > 0);
    assert_eq!(cfg.trainer.logger.as_slice(), ["console", "jsonl"]);
    assert_eq!(cfg.trainer.device, "cpu");
}
