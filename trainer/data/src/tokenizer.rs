//! The tokenizer of a Hugging Face folder: `tokenizer.json` (the `tokenizers` crate) plus the special tokens and chat
//! template from `tokenizer_config.json` (or `chat_template.jinja`).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use crate::template::ChatTemplate;

/// A tokenizer with its EOS/PAD ids and chat template.
pub struct SftTokenizer {
    tokenizer: tokenizers::Tokenizer,
    eos_token: String,
    eos_id: u32,
    pad_id: u32,
    template: Option<ChatTemplate>,
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl SftTokenizer {
    /// Loads `dir/tokenizer.json` and `dir/tokenizer_config.json`. `chat_template` (from `data.chat_template`)
    /// replaces the folder's template when given.
    pub fn from_dir(dir: &Path, chat_template: Option<&str>) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow!("loading tokenizer {}: {e}", tok_path.display()))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", cfg_path.display()))?,
            Err(_) => Value::Null,
        };
        let eos_token = token_text(cfg.get("eos_token")).ok_or_else(|| {
            anyhow!(
                "{}: no `eos_token` (needed to end every response)",
                cfg_path.display()
            )
        })?;
        let id = |t: &str| {
            tokenizer.token_to_id(t).ok_or_else(|| {
                anyhow!(
                    "token `{t}` of {} is not in the vocabulary",
                    cfg_path.display()
                )
            })
        };
        let eos_id = id(&eos_token)?;
        let pad_id = match token_text(cfg.get("pad_token")) {
            Some(p) => id(&p)?,
            None => eos_id,
        };
        let source = match chat_template {
            Some(t) => Some(t.to_string()),
            None => template_source(dir, &cfg)?,
        };
        let bos = token_text(cfg.get("bos_token"));
        let template = source
            .map(|s| ChatTemplate::new(&s, bos, Some(eos_token.clone())))
            .transpose()?;
        Ok(Self {
            tokenizer,
            eos_token,
            eos_id,
            pad_id,
            template,
        })
    }

    /// Token ids of `text`, without adding special tokens (special tokens written in the text are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let enc = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
    }

    /// The text of token ids (special tokens kept), for looking at what a model was given.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        self.decode_with(ids, false)
    }

    /// The text of a response as verl hands it to rewards and writes it (Hugging Face's
    /// `tokenizer.decode(ids, skip_special_tokens=True)`): special tokens such as the EOS `<|im_end|>` that ends a
    /// response, or padding, are left out.
    pub fn decode_skip_special(&self, ids: &[i64]) -> Result<String> {
        self.decode_with(ids, true)
    }

    fn decode_with(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let ids = ids
            .iter()
            .map(|&i| {
                u32::try_from(i).map_err(|_| anyhow!("decoding: token id {i} is out of range"))
            })
            .collect::<Result<Vec<u32>>>()?;
        self.tokenizer
            .decode(&ids, skip_special_tokens)
            .map_err(|e| anyhow!("decoding: {e}"))
    }

    /// The EOS token's text (`<|im_end|>` for Qwen chat models).
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// The EOS token's id; every response ends with it.
    pub fn eos_token_id(&self) -> i64 {
        self.eos_id as i64
    }

    /// The padding id (`pad_token`, or EOS when there is none).
    pub fn pad_token_id(&self) -> i64 {
        self.pad_id as i64
    }

    /// The chat template, or an error saying where one was looked for.
    pub fn template(&self) -> Result<&ChatTemplate> {
        self.template.as_ref().ok_or_else(|| {
            anyhow!("the tokenizer has no chat template (tokenizer_config.json `chat_template`); set data.chat_template")
        })
    }
}

fn template_source(dir: &Path, cfg: &Value) -> Result<Option<String>> {
    match cfg.get("chat_template") {
        Some(Value::String(s)) => return Ok(Some(s.clone())),
        Some(Value::Array(named)) => {
            let pick = named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| named.first());
            return match pick.and_then(|t| t.get("template")).and_then(Value::as_str) {
                Some(s) => Ok(Some(s.to_string())),
                None => bail!("{}: `chat_template` list has no `template`", dir.display()),
            };
        }
        _ => {}
    }
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return Ok(Some(
            std::fs::read_to_string(&jinja)
                .with_context(|| format!("reading {}", jinja.display()))?,
        ));
    }
    Ok(None)
}
