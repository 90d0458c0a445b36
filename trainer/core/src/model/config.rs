//! The architecture hyper-parameters of a Hugging Face `config.json` (Qwen2, Qwen3 dense and Llama), parsed and
//! checked: anything the engine would not compute exactly as transformers 5.24 does is refused with an error naming
//! the file and the field.

use super::rope::{self, RopeScaling};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// Which decoder family a folder holds. All three are pre-norm RMSNorm decoders with GQA self-attention, RoPE
/// (`default`, `linear` or `llama3`, see [`RopeScaling`]) and a SiLU-gated MLP without bias; they differ in the
/// attention biases and Qwen3's q/k norms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `Qwen2ForCausalLM`: bias on q/k/v always, none on o (`attention_bias` is ignored, as transformers does).
    Qwen2,
    /// `Qwen3ForCausalLM` (dense): bias on q/k/v/o only with `attention_bias`; per-head RMSNorm of q and k
    /// (`self_attn.q_norm`, `self_attn.k_norm`, `[head_dim]`) after their projections, before RoPE; `head_dim`
    /// defaults to 128.
    Qwen3,
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
    /// How RoPE's frequencies are scaled (`rope_scaling` / `rope_parameters`).
    pub rope_scaling: RopeScaling,
    /// Output projection shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias.
    pub qkv_bias: bool,
    /// The o projection carries a bias (Llama and Qwen3 `attention_bias`).
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
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

/// An optional integer key (absent or null: `None`).
fn opt_i64(v: &Value, key: &str, file: &Path) -> Result<Option<i64>> {
    match v.get(key).filter(|x| !x.is_null()) {
        None => Ok(None),
        Some(x) => match x.as_i64() {
            Some(n) => Ok(Some(n)),
            None => bail!("{}: `{key}` is {x}, not an integer", file.display()),
        },
    }
}

/// An optional boolean key, `false` when absent or null.
fn get_bool(v: &Value, key: &str, file: &Path) -> Result<bool> {
    match v.get(key).filter(|x| !x.is_null()) {
        None => Ok(false),
        Some(x) => match x.as_bool() {
            Some(b) => Ok(b),
            None => bail!("{}: `{key}` is {x}, not a boolean", file.display()),
        },
    }
}

/// The decoder family of `model_type`.
fn architecture(raw: &Value, file: &Path) -> Result<Architecture> {
    let model_type = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
    Ok(match model_type {
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "llama" => Architecture::Llama,
        other => bail!(
            "{}: `model_type` `{other}` is not supported (supported: qwen2, qwen3, llama)",
            file.display()
        ),
    })
}

/// Refuses what the engine does not compute: sliding-window attention, MLP biases, activations other than SiLU and
/// attention dropout.
fn check_unsupported(raw: &Value, file: &Path) -> Result<()> {
    let f = file.display();
    if get_bool(raw, "use_sliding_window", file)? {
        bail!("{f}: `use_sliding_window` true is not supported (sliding-window attention)");
    }
    if let Some(types) = raw.get("layer_types").filter(|v| !v.is_null()) {
        let types = types
            .as_array()
            .with_context(|| format!("{f}: `layer_types` is {types}, not an array"))?;
        if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
            bail!("{f}: `layer_types` entry {t} is not supported (only full_attention)");
        }
    }
    if get_bool(raw, "mlp_bias", file)? {
        bail!("{f}: `mlp_bias` true is not supported (the MLP projections have no bias)");
    }
    let act = raw.get("hidden_act").unwrap_or(&Value::Null);
    if !act.is_null() && act.as_str() != Some("silu") {
        bail!("{f}: `hidden_act` {act} is not supported (only silu)");
    }
    let dropout = raw.get("attention_dropout").unwrap_or(&Value::Null);
    if !dropout.is_null() && dropout.as_f64() != Some(0.0) {
        bail!("{f}: `attention_dropout` {dropout} is not supported (only 0)");
    }
    Ok(())
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
        let arch = architecture(&raw, file)?;
        check_unsupported(&raw, file)?;
        let hidden_size = get_i64(&raw, "hidden_size", file)?;
        let num_heads = get_i64(&raw, "num_attention_heads", file)?;
        let num_kv_heads = opt_i64(&raw, "num_key_value_heads", file)?.unwrap_or(num_heads);
        let head_dim = match (opt_i64(&raw, "head_dim", file)?, arch) {
            (Some(d), _) => d,
            (None, Architecture::Qwen3) => 128,
            (None, _) => hidden_size / num_heads,
        };
        if num_kv_heads <= 0 || num_heads % num_kv_heads != 0 {
            bail!(
                "{}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}",
                file.display()
            );
        }
        let max_positions = match (opt_i64(&raw, "max_position_embeddings", file)?, arch) {
            (Some(n), _) => n,
            (None, Architecture::Llama) => 2048,
            (None, _) => 32768,
        };
        let (rope_theta, rope_scaling) = rope::parse(&raw, max_positions, file)?;
        let attention_bias = get_bool(&raw, "attention_bias", file)?;
        let (qkv_bias, o_bias) = match arch {
            Architecture::Qwen2 => (true, false),
            Architecture::Qwen3 | Architecture::Llama => (attention_bias, attention_bias),
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
            rope_scaling,
            tie_word_embeddings: get_bool(&raw, "tie_word_embeddings", file)?,
            qkv_bias,
            o_bias,
            qk_norm: arch == Architecture::Qwen3,
            initializer_range: raw
                .get("initializer_range")
                .and_then(Value::as_f64)
                .unwrap_or(0.02),
            declared_dtype,
            raw,
        })
    }
}
