//! Helpers shared by the bridge's integration tests: plugin builds, a tiny Qwen2, synthetic samples.

#![allow(dead_code)]

use ferl_plugin_host::cargo_build::{build_plugin, workspace_root, PluginBuild};
use ferl_trainer::data::{SftDataset, TokenizedSample};
use std::path::{Path, PathBuf};

/// Builds plugin `package` with the build environment `env` into its own cached target folder; returns the library.
pub(crate) fn build(package: &str, env: &[(&str, &str)]) -> PathBuf {
    let ws = workspace_root(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
    let key: String = std::iter::once(package.to_string())
        .chain(env.iter().map(|(k, v)| format!("{k}={v}")))
        .collect::<Vec<_>>()
        .join("-");
    let target = std::env::temp_dir().join("ferl-plugin-builds").join(key);
    let spec = PluginBuild {
        package: package.into(),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    build_plugin(&ws, &target, &spec).unwrap_or_else(|e| panic!("{e:#}"))
}

/// A 2-layer Qwen2 (vocab 97, hidden 32, GQA) with seeded random weights under `dir/model`.
pub(crate) fn tiny_model(dir: &Path) -> PathBuf {
    let cfg = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 97, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true,
        "hidden_act": "silu", "initializer_range": 0.02, "torch_dtype": "float32", "eos_token_id": 1
    });
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("source_config.json");
    std::fs::write(&file, cfg.to_string()).unwrap();
    ferl_trainer::model::init_model(&file, None, &dir.join("model"), 3).unwrap();
    dir.join("model")
}

/// Sample `i` of the synthetic data: 6 to 12 tokens, trained on all but the first two.
pub(crate) fn sample(i: usize) -> TokenizedSample {
    let len = 6 + i % 7;
    TokenizedSample {
        input_ids: (0..len).map(|t| ((i * 31 + t * 7) % 97) as i64).collect(),
        loss_mask: (0..len).map(|t| t >= 2).collect(),
    }
}

/// `n` synthetic samples as a dataset.
pub(crate) fn dataset(n: usize) -> SftDataset {
    SftDataset::from_samples((0..n).map(sample).collect(), 0, 1)
}
