//! Qwen2 and Llama decoders from a Hugging Face folder: [`config`] (config.json), [`layout`] (which tensors each stage
//! uses), [`layers`] (the forward functions) and [`weights`] (safetensors in and out, random init).

pub mod config;
pub mod layers;
pub mod layout;
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
