//! The architecture hyper-parameters of a Hugging Face `config.json` (Qwen2 and Llama), parsed and checked.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// Which decoder family a folder holds; they differ only in the q/k/v bias default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `Qwen2ForCausalLM`: bias on q/k/v, none on o.
    Qwen2,
    /// `LlamaForCausalLM`: bias on q/k/v/o only with `attention_bias`.
    Llama,
}

/// The hyper-parameters the engine needs, read from `config.json`; `raw` keeps the file for exports.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// The decoder family.
    pub arch: Architecture,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: i64,
    /// Width of the residual stream.
    pub hidden_size: i64,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: i64,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: i64,
    /// Key/value heads (GQA when fewer than `num_heads`).
    pub num_kv_heads: i64,
    /// Width of one head.
    pub head_dim: i64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Output projection shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias.
    pub qkv_bias: bool,
    /// The o projection carries a bias (Llama `attention_bias`).
    pub o_bias: bool,
    /// Standard deviation of the normal initialisation.
    pub initializer_range: f64,
    /// The dtype the folder declares (`float32`, `bfloat16`, ...).
    pub declared_dtype: String,
    /// The parsed `config.json` as written, re-emitted by exports.
    pub raw: Value,
}

fn get_i64(v: &Value, key: &str, file: &Path) -> Result<i64> {
    v.get(key)
        .and_then(Value::as_i64)
        .with_context(|| format!("{}: missing or non-integer key `{key}`", file.display()))
}

impl ModelConfig {
    /// Reads and checks `config.json` at `file`.
    pub fn from_file(file: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let raw: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
        Self::from_value(raw, file)
    }

    /// Checks a parsed `config.json`; `file` only names the source in errors.
    pub fn from_value(raw: Value, file: &Path) -> Result<Self> {
        let model_type = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
        let arch = match model_type {
            "qwen2" => Architecture::Qwen2,
            "llama" => Architecture::Llama,
            other => bail!(
                "{}: model_type `{other}` is not supported (supported: qwen2, llama)",
                file.display()
            ),
        };
        let hidden_size = get_i64(&raw, "hidden_size", file)?;
        let num_heads = get_i64(&raw, "num_attention_heads", file)?;
        let num_kv_heads = raw
            .get("num_key_value_heads")
            .and_then(Value::as_i64)
            .unwrap_or(num_heads);
        let head_dim = match raw.get("head_dim").and_then(Value::as_i64) {
            Some(d) => d,
            None => hidden_size / num_heads,
        };
        if num_heads % num_kv_heads != 0 {
            bail!(
                "{}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}",
                file.display()
            );
        }
        let act = raw
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            bail!(
                "{}: hidden_act `{act}` is not supported (only silu)",
                file.display()
            );
        }
        let rope_theta = raw
            .get("rope_theta")
            .and_then(Value::as_f64)
            .or_else(|| {
                raw.get("rope_parameters")
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
            })
            .unwrap_or(10000.0);
        let rope_type = raw
            .get("rope_parameters")
            .and_then(|p| p.get("rope_type"))
            .or_else(|| {
                raw.get("rope_scaling")
                    .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            })
            .and_then(Value::as_str)
            .unwrap_or("default");
        if rope_type != "default" {
            bail!(
                "{}: rope_type `{rope_type}` is not supported (only default RoPE)",
                file.display()
            );
        }
        if raw
            .get("use_sliding_window")
            .and_then(Value::as_bool)
            .unwrap_or(false)
        {
            bail!(
                "{}: use_sliding_window=true is not supported",
                file.display()
            );
        }
        let attention_bias = raw
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if raw
            .get("mlp_bias")
            .and_then(Value::as_bool)
            .unwrap_or(false)
        {
            bail!("{}: mlp_bias=true is not supported", file.display());
        }
        let (qkv_bias, o_bias) = match arch {
            Architecture::Qwen2 => (true, false),
            Architecture::Llama => (attention_bias, attention_bias),
        };
        let declared_dtype = raw
            .get("dtype")
            .or_else(|| raw.get("torch_dtype"))
            .and_then(Value::as_str)
            .unwrap_or("float32")
            .to_string();
        Ok(Self {
            arch,
            vocab_size: get_i64(&raw, "vocab_size", file)?,
            hidden_size,
            intermediate_size: get_i64(&raw, "intermediate_size", file)?,
            num_layers: get_i64(&raw, "num_hidden_layers", file)? as usize,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: raw
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta,
            tie_word_embeddings: raw
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qkv_bias,
            o_bias,
            initializer_range: raw
                .get("initializer_range")
                .and_then(Value::as_f64)
                .unwrap_or(0.02),
            declared_dtype,
            raw,
        })
    }
}
