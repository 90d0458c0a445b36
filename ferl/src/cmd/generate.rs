//! `ferl generate`: responses to a file of chat prompts, like verl's `main_generation`.
//!
//! Each row's prompt (`--prompt-key`, verl's `prompt` column: a list of `{role, content}` messages, or a plain
//! string taken as one user message) is rendered with the tokenizer's chat template and the generation prompt, then
//! `--n-samples` responses are generated with the trainer's model code ([`ferl_trainer::rollout`]). The output is the
//! input's rows and columns with a `responses` column added: per row a list of `--n-samples` texts, decoded with
//! special tokens skipped (no EOS `<|im_end|>` at the end of a response that stopped on it, no padding), as verl's
//! `main_generation` writes them (`tokenizer.decode(ids, skip_special_tokens=True)`).
//!
//! Prompts run in batches of `--batch-size` sequences (row-major: a row's samples are consecutive); batch `k` samples
//! with seed `--seed + k`, so a run is reproducible for a given batch size. A sequence stops at the model folder's
//! EOS tokens (`generation_config.json`, else `config.json`) or the tokenizer's EOS, or after `--response-length`
//! tokens.

use anyhow::{bail, Context, Result};
use clap::Args;
use ferl_data::SftTokenizer;
use ferl_trainer::rollout::{self, GenerationConfig, RolloutModel, SamplingParams};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Arguments of `ferl generate`.
#[derive(Args)]
pub(crate) struct GenerateArgs {
    /// Model folder or Hugging Face Hub id (resolved as `model.partial_pretrain` is).
    #[arg(long)]
    pub model: String,
    /// Folder with the tokenizer files (default: the model folder).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Parquet (or JSON-lines) file of prompts.
    #[arg(long)]
    pub input: PathBuf,
    /// Parquet file to write (the input's columns plus `responses`).
    #[arg(long)]
    pub output: PathBuf,
    /// Column holding each row's prompt.
    #[arg(long, default_value = "prompt")]
    pub prompt_key: String,
    /// Responses per prompt (more than one needs `--do-sample`).
    #[arg(long, default_value_t = 1)]
    pub n_samples: usize,
    /// Most tokens per response (the EOS token included).
    #[arg(long, default_value_t = 512)]
    pub response_length: usize,
    /// Sample (else greedy).
    #[arg(long)]
    pub do_sample: bool,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Sample among the k most likely tokens only (-1: all).
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub top_k: i64,
    /// Sample among the most likely tokens of total probability top_p only (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Seed of the first batch (batch k uses seed + k).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sequences generated together.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype: fp32 or bf16.
    #[arg(long, default_value = "fp32")]
    pub dtype: String,
}

/// Runs `ferl generate`.
pub(crate) fn run(a: GenerateArgs) -> Result<()> {
    check_args(&a)?;
    let device = rollout::parse_device(&a.device).context("--device")?;
    let kind = rollout::parse_dtype(&a.dtype).context("--dtype")?;
    let model_dir = ferl_trainer::model::hub::resolve_model(&a.model)?;
    let tokenizer = SftTokenizer::from_dir(a.tokenizer.as_deref().unwrap_or(&model_dir), None)?;
    let mut rows = ferl_data::read::read_rows(&a.input, None)?;
    let prompts = rows
        .iter()
        .enumerate()
        .map(|(i, row)| prompt_ids(&tokenizer, row, &a.prompt_key, &a.input, i))
        .collect::<Result<Vec<_>>>()?;
    let model = RolloutModel::load(&model_dir, device, kind)?;
    let config = generation_config(&a, &model_dir, &tokenizer)?;
    let texts = generate_texts(&model, &tokenizer, &prompts, &a, &config)?;
    for (row, responses) in rows.iter_mut().zip(texts.chunks(a.n_samples)) {
        let obj = row.as_object_mut().context("a row is not an object")?;
        obj.insert("responses".into(), Value::from(responses.to_vec()));
    }
    ferl_data::write::write_rows_parquet(&rows, &a.output)?;
    println!(
        "wrote {} rows x {} responses to {}",
        rows.len(),
        a.n_samples,
        a.output.display()
    );
    Ok(())
}

/// Refuses argument combinations that cannot be honoured.
fn check_args(a: &GenerateArgs) -> Result<()> {
    if a.n_samples == 0 || a.batch_size == 0 {
        bail!("--n-samples and --batch-size must be at least 1");
    }
    if a.n_samples > 1 && !(a.do_sample && a.temperature > 0.0) {
        bail!("--n-samples {} needs --do-sample and a positive --temperature (greedy responses are all the same)", a.n_samples);
    }
    Ok(())
}

/// The token ids of row `i`'s prompt: its messages through the chat template with the generation prompt.
fn prompt_ids(
    tok: &SftTokenizer,
    row: &Value,
    key: &str,
    file: &Path,
    i: usize,
) -> Result<Vec<i64>> {
    let at = || format!("{} row {i}", file.display());
    let (_, ids) = chat_prompt(tok, row, key, "--prompt-key").with_context(at)?;
    Ok(ids)
}

/// A row's prompt in column `key` (verl's list of `{role, content}` messages, or a plain string taken as one user
/// message) rendered with the chat template and its generation prompt: the text and its token ids. `setting` names
/// what chooses the column, for the error when it is missing. Shared by `ferl generate` and `ferl grpo`.
pub(crate) fn chat_prompt(
    tok: &SftTokenizer,
    row: &Value,
    key: &str,
    setting: &str,
) -> Result<(String, Vec<i64>)> {
    let messages = match row.get(key) {
        Some(Value::Array(m)) => m.clone(),
        Some(Value::String(s)) => vec![serde_json::json!({"role": "user", "content": s})],
        Some(other) => bail!("`{key}` is {other}, not a list of chat messages or a string"),
        None => bail!("no `{key}` column (set {setting})"),
    };
    let text = tok
        .template()?
        .render(&messages, true, None, &BTreeMap::new())?;
    let ids = tok.encode(&text)?;
    Ok((text, ids))
}

/// Sampling from the arguments; stop tokens from the model folder plus the tokenizer's EOS; the tokenizer's pad.
fn generation_config(
    a: &GenerateArgs,
    model_dir: &Path,
    tok: &SftTokenizer,
) -> Result<GenerationConfig> {
    let sampling = SamplingParams {
        do_sample: a.do_sample,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    };
    sampling.validate()?;
    let mut config = GenerationConfig::from_model_dir(model_dir, a.response_length, sampling)?;
    if !config.eos_token_ids.contains(&tok.eos_token_id()) {
        config.eos_token_ids.push(tok.eos_token_id());
    }
    config.pad_token_id = tok.pad_token_id();
    Ok(config)
}

/// The decoded responses, `n_samples` consecutive ones per prompt, generated in batches (batch `k`: seed + k).
fn generate_texts(
    model: &RolloutModel,
    tok: &SftTokenizer,
    prompts: &[Vec<i64>],
    a: &GenerateArgs,
    config: &GenerationConfig,
) -> Result<Vec<String>> {
    let seqs: Vec<Vec<i64>> = prompts
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), a.n_samples))
        .collect();
    let mut texts = Vec::with_capacity(seqs.len());
    for (k, batch) in seqs.chunks(a.batch_size).enumerate() {
        let mut c = config.clone();
        c.sampling.seed = config.sampling.seed.wrapping_add(k as u64);
        for g in model.generate(batch, &c)? {
            texts.push(tok.decode_skip_special(&g.response)?);
        }
        eprintln!("generated {} of {} responses", texts.len(), seqs.len());
    }
    Ok(texts)
}
