//! Qwen2, Qwen3 (dense) and Llama decoders from a Hugging Face folder: [`config`] (config.json), [`rope`] (RoPE
//! types and frequencies), [`layout`] (which tensors each stage uses), [`layers`] (the forward functions), [`varlen`]
//! (attention over packed sequences), [`ulysses`] (attention over a sequence-parallel group), [`graph`] (layers split at ops replaced by kernels, with their backward) and
//! [`weights`] (safetensors in and out, random init).

pub mod config;
pub mod graph;
pub mod hub;
pub mod layers;
pub mod layout;
pub mod lora;
pub mod rope;
pub mod skinny;
pub mod ulysses;
pub mod varlen;
pub mod weights;

use anyhow::{Context, Result};
use std::path::Path;
use tch::Tensor;

/// A model read from a folder: its config, its tensor layout and its fp32 parameters (in layout order).
pub struct LoadedModel {
    /// Parsed config.json.
    pub config: config::ModelConfig,
    /// Tensor names and stages.
    pub layout: layout::ModelLayout,
    /// fp32 parameters in `layout.tensors` order.
    pub params: Vec<Tensor>,
}

/// Reads `dir/config.json` and the safetensors weights of `dir`.
pub fn load_model(dir: &Path) -> Result<LoadedModel> {
    let config = config::ModelConfig::from_file(&dir.join("config.json"))
        .with_context(|| format!("loading the model folder {}", dir.display()))?;
    let layout = layout::ModelLayout::new(&config);
    let params = weights::load_params(dir, &layout)?;
    Ok(LoadedModel {
        config,
        layout,
        params,
    })
}

/// `ferl model init`: writes a randomly initialised model (transformers' init, seeded) described by `config_file`
/// to `out` as a Hugging Face folder, with the tokenizer files of `tokenizer_dir` and a generation config (the one
/// next to `config_file` when present, else one made from the config's token ids).
pub fn init_model(
    config_file: &Path,
    tokenizer_dir: Option<&Path>,
    out: &Path,
    seed: i64,
) -> Result<()> {
    let config = config::ModelConfig::from_file(config_file)?;
    let layout = layout::ModelLayout::new(&config);
    let params = weights::init_params(&config, &layout, seed);
    let kind = if config.declared_dtype == "bfloat16" {
        tch::Kind::BFloat16
    } else {
        tch::Kind::Float
    };
    let mut side: Vec<&Path> = Vec::new();
    if let Some(t) = tokenizer_dir {
        if !t.join("tokenizer.json").exists() {
            anyhow::bail!("--tokenizer {}: no tokenizer.json there", t.display());
        }
        side.push(t);
    }
    let config_dir = config_file.parent().unwrap_or(Path::new("."));
    side.push(config_dir);
    weights::save_hf_folder(out, &config, &layout, &params, kind, &side)?;
    let gen = out.join("generation_config.json");
    if !gen.exists() {
        let mut g = serde_json::Map::new();
        for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            if let Some(v) = config.raw.get(key).filter(|v| !v.is_null()) {
                g.insert(key.into(), v.clone());
            }
        }
        std::fs::write(
            &gen,
            serde_json::to_string_pretty(&serde_json::Value::Object(g))?,
        )
        .with_context(|| format!("writing {}", gen.display()))?;
    }
    Ok(())
}
