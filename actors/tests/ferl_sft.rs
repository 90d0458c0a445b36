//! A one-process run (what `ferl sft` runs without `--nproc-per-node`) with every plugin kind at once: `data.plugin=alpaca`,
//! `trainer.logger=[console,tensorboard,csv]` and `model.use_liger=true`, on a small Qwen2 with the real tokenizer.

use ferl_actors::sft::{run_in_process, InProcessOptions};
#[path = "../../plugins/bridge/tests/common/mod.rs"]
mod common;

use ferl_plugin_host::cargo_build::workspace_root;
use ferl_trainer::config::SftConfig;
use std::path::{Path, PathBuf};

#[test]
fn sft_with_dataset_logger_and_kernel_plugins() {
    tch::set_num_threads(1);
    let ws = workspace_root(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    for p in [
        "ferl-plugin-alpaca",
        "ferl-plugin-tensorboard",
        "ferl-plugin-csv",
        "ferl-plugin-liger",
    ] {
        let built = common::build(p, &[]);
        std::fs::copy(&built, folder.join(built.file_name().unwrap())).unwrap();
    }
    // A small Qwen2 with the real vocabulary, so the real tokenizer's ids fit.
    let cfg = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true,
        "hidden_act": "silu", "initializer_range": 0.02, "torch_dtype": "float32", "eos_token_id": 151645
    });
    let src = dir.path().join("config.json");
    std::fs::write(&src, cfg.to_string()).unwrap();
    let model = dir.path().join("model");
    ferl_trainer::model::init_model(&src, Some(&ws.join("assets/tokenizers/qwen3")), &model, 1)
        .unwrap();
    let records: Vec<serde_json::Value> = (0..8)
        .map(|i| serde_json::json!({"instruction": format!("Add {i} and {i}."), "input": "", "output": format!("{}", 2 * i)}))
        .collect();
    let data = dir.path().join("train.json");
    std::fs::write(&data, serde_json::Value::Array(records).to_string()).unwrap();
    let run_dir = dir.path().join("run");
    let overrides: Vec<String> = vec![
        format!("model.partial_pretrain={}", model.display()),
        format!("trainer.default_local_dir={}", run_dir.display()),
        format!("data.train_files={}", data.display()),
        "data.val_files=[]".into(),
        "data.plugin=alpaca".into(),
        "data.train_batch_size=4".into(),
        "data.micro_batch_size_per_gpu=2".into(),
        "data.max_length=64".into(),
        "trainer.total_epochs=1".into(),
        "trainer.device=cpu".into(),
        "trainer.logger=[console,tensorboard,csv]".into(),
        "model.use_liger=true".into(),
    ];
    let cfg = SftConfig::load(None, &overrides).unwrap();
    let opts = InProcessOptions {
        plugin_folders: vec![folder],
        ..Default::default()
    };
    let summary = run_in_process(cfg, opts).unwrap();
    assert_eq!(summary.global_step, 2);
    let losses = summary.losses();
    assert!(
        losses.iter().all(|l| l.is_finite() && *l > 0.0),
        "{losses:?}"
    );
    let csv = std::fs::read_to_string(run_dir.join("metrics.csv")).unwrap();
    assert!(
        csv.starts_with("step,name,value\n") && csv.contains("\n2,train/loss,"),
        "{csv}"
    );
    let tb = run_dir.join("tensorboard_log");
    let events: Vec<_> = walk(&tb)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("tfevents"))
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(std::fs::metadata(&events[0]).unwrap().len() > 100);
    let state = std::fs::read_to_string(run_dir.join("plugins/state.json")).unwrap();
    for name in ["alpaca", "tensorboard", "csv", "liger"] {
        assert!(state.contains(&format!("\"name\": \"{name}\"")), "{state}");
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
