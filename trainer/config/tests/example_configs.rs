//! Every config under examples/configs loads (with the overrides scripts/demo.sh adds), and the demo's is the
//! short CPU run the README promises.

use std::path::PathBuf;

use ferl_config::{SftConfig, Truncation};

fn configs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/configs")
}

#[test]
fn example_configs_load_with_the_demo_overrides() {
    let overrides: Vec<String> = [
        "data.train_files=/tmp/demo/data/train.parquet",
        "data.val_files=/tmp/demo/data/test.parquet",
        "model.partial_pretrain=/tmp/demo/model",
        "trainer.default_local_dir=/tmp/demo/checkpoints",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut n = 0;
    for entry in std::fs::read_dir(configs_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let cfg = SftConfig::load(Some(&path), &overrides)
                .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            assert_eq!(cfg.model.partial_pretrain, "/tmp/demo/model");
            n += 1;
        }
    }
    assert!(n >= 1, "no example configs found");
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
