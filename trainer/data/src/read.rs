//! The built-in [`DataSource`]: parquet and jsonl files, read into JSON rows and turned into [`RawExample`]s by the
//! `data.*` keys (flat columns, nested `*_dict_keys`, or multi-turn `messages`).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use arrow::json::ArrayWriter;
use ferl_config::DataConfig;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;
use serde_json::Value;

use crate::source::{DataSource, Origin, Prompt, RawExample, SourcedExample};

mod bounded;
mod footer;

/// Which columns make an example, taken from `data.*`.
#[derive(Debug, Clone)]
pub enum Fields {
    /// `prompt_key` (+ `prompt_dict_keys`) and `response_key` (+ `response_dict_keys`).
    SingleTurn {
        /// Column of the prompt.
        prompt_key: String,
        /// Keys to descend into inside the prompt column.
        prompt_dict_keys: Vec<String>,
        /// Column of the response.
        response_key: String,
        /// Keys to descend into inside the response column.
        response_dict_keys: Vec<String>,
    },
    /// `multiturn.messages_key`, with the optional `tools_key` and `enable_thinking_key` columns.
    MultiTurn {
        /// Column of the messages list.
        messages_key: String,
        /// Optional column of tool definitions.
        tools_key: String,
        /// Optional column of per-row `enable_thinking`.
        enable_thinking_key: String,
    },
}

impl Fields {
    /// The fields `data.*` asks for.
    pub fn from_config(cfg: &DataConfig) -> Self {
        let keys = |k: &Option<ferl_config::StringList>| {
            k.as_ref()
                .map(|l| l.as_slice().to_vec())
                .unwrap_or_default()
        };
        if cfg.multiturn.enable {
            Fields::MultiTurn {
                messages_key: cfg.multiturn.messages_key.clone(),
                tools_key: cfg.multiturn.tools_key.clone(),
                enable_thinking_key: cfg.multiturn.enable_thinking_key.clone(),
            }
        } else {
            Fields::SingleTurn {
                prompt_key: cfg.prompt_key.clone(),
                prompt_dict_keys: keys(&cfg.prompt_dict_keys),
                response_key: cfg.response_key.clone(),
                response_dict_keys: keys(&cfg.response_dict_keys),
            }
        }
    }

    /// (required columns, optional columns).
    fn columns(&self) -> (Vec<String>, Vec<String>) {
        match self {
            Fields::SingleTurn {
                prompt_key,
                response_key,
                ..
            } => (vec![prompt_key.clone(), response_key.clone()], vec![]),
            Fields::MultiTurn {
                messages_key,
                tools_key,
                enable_thinking_key,
            } => (
                vec![messages_key.clone()],
                vec![tools_key.clone(), enable_thinking_key.clone()],
            ),
        }
    }

    /// The example one row holds.
    pub fn example(&self, row: &Value, origin: &Origin) -> Result<RawExample> {
        match self {
            Fields::SingleTurn {
                prompt_key,
                prompt_dict_keys,
                response_key,
                response_dict_keys,
            } => {
                let prompt = descend(row, prompt_key, prompt_dict_keys, origin)?;
                let response = descend(row, response_key, response_dict_keys, origin)?;
                let prompt = match prompt {
                    Value::String(s) => Prompt::Text(s.clone()),
                    Value::Array(items) if items.iter().all(is_message) && !items.is_empty() => {
                        Prompt::Messages(items.clone())
                    }
                    other => bail!(
                        "{origin}: prompt `{}` must be a string or a list of {{role, content}} messages, got {}",
                        dotted(prompt_key, prompt_dict_keys),
                        short(other)
                    ),
                };
                let response = match response {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    other => bail!(
                        "{origin}: response `{}` must be a string, got {}",
                        dotted(response_key, response_dict_keys),
                        short(other)
                    ),
                };
                Ok(RawExample::PromptResponse { prompt, response })
            }
            Fields::MultiTurn {
                messages_key,
                tools_key,
                enable_thinking_key,
            } => {
                let messages = match descend(row, messages_key, &[], origin)? {
                    Value::Array(items) if !items.is_empty() && items.iter().all(is_message) => items.clone(),
                    other => bail!(
                        "{origin}: `{messages_key}` must be a non-empty list of {{role, content}} messages, got {}",
                        short(other)
                    ),
                };
                let tools = match row.get(tools_key) {
                    None | Some(Value::Null) => None,
                    // Tools are often stored as a JSON string in parquet.
                    Some(Value::String(s)) => Some(
                        serde_json::from_str(s)
                            .with_context(|| format!("{origin}: `{tools_key}` is not JSON"))?,
                    ),
                    Some(v) => Some(v.clone()),
                };
                let enable_thinking = match row.get(enable_thinking_key) {
                    None | Some(Value::Null) => None,
                    Some(Value::Bool(b)) => Some(*b),
                    Some(other) => bail!(
                        "{origin}: `{enable_thinking_key}` must be a boolean, got {}",
                        short(other)
                    ),
                };
                Ok(RawExample::Messages {
                    messages,
                    tools,
                    enable_thinking,
                })
            }
        }
    }
}

fn is_message(v: &Value) -> bool {
    v.get("role").is_some_and(Value::is_string)
}

fn dotted(key: &str, dict_keys: &[String]) -> String {
    std::iter::once(key)
        .chain(dict_keys.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(".")
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        format!(
            "{}...",
            &s[..s.char_indices().nth(77).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

/// `row[key][dict_keys[0]][dict_keys[1]]...`, unwrapping one-element lists on the way (as verl does).
fn descend<'a>(
    row: &'a Value,
    key: &str,
    dict_keys: &[String],
    origin: &Origin,
) -> Result<&'a Value> {
    let mut v = row.get(key).ok_or_else(|| {
        let cols: Vec<&str> = row
            .as_object()
            .map(|o| o.keys().map(String::as_str).collect())
            .unwrap_or_default();
        anyhow!("{origin}: no column `{key}`{}", nearest_hint(key, &cols))
    })?;
    for (i, dk) in dict_keys.iter().enumerate() {
        while let Value::Array(items) = v {
            match items.as_slice() {
                [one] => v = one,
                _ => break,
            }
        }
        let path = dotted(key, &dict_keys[..i]);
        v = match v {
            Value::Object(map) => map.get(dk).ok_or_else(|| {
                let keys: Vec<&str> = map.keys().map(String::as_str).collect();
                anyhow!(
                    "{origin}: `{path}` has no key `{dk}`{}",
                    nearest_hint(dk, &keys)
                )
            })?,
            other => bail!(
                "{origin}: `{path}` is not a mapping (cannot take key `{dk}`), got {}",
                short(other)
            ),
        };
    }
    Ok(v)
}

fn nearest_hint(key: &str, options: &[&str]) -> String {
    match options.iter().min_by_key(|o| strsim::levenshtein(key, o)) {
        Some(best) => format!(" (nearest: `{best}`; present: {})", options.join(", ")),
        None => String::new(),
    }
}

/// Reads a parquet (`.parquet`) or JSON-lines (anything else) file into one JSON object per row. For parquet, only
/// `columns` are read when given (all must exist unless listed in `optional`).
pub fn read_rows(path: &Path, columns: Option<(&[String], &[String])>) -> Result<Vec<Value>> {
    if path.extension().is_some_and(|e| e == "parquet") {
        read_parquet(path, columns)
    } else {
        read_jsonl(path)
    }
}

/// Reads a parquet file; a malformed file is an error naming it, also where the parquet crate panics on it (some
/// corrupt pages and footers do: found by fuzzing, `fuzz/corpus/data-parquet`).
fn read_parquet(path: &Path, columns: Option<(&[String], &[String])>) -> Result<Vec<Value>> {
    let read = std::panic::catch_unwind(AssertUnwindSafe(|| read_parquet_unguarded(path, columns)));
    read.unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        bail!("{}: malformed parquet file ({why})", path.display())
    })
}

fn read_parquet_unguarded(
    path: &Path,
    columns: Option<(&[String], &[String])>,
) -> Result<Vec<Value>> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    footer::check_file(&mut file)
        .with_context(|| format!("reading parquet {}: malformed footer", path.display()))?;
    let mut builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .with_context(|| format!("reading parquet {}", path.display()))?;
    if let Some((required, optional)) = columns {
        let schema = builder.schema().clone();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        for col in required {
            if !names.contains(&col.as_str()) {
                bail!(
                    "{}: no column `{col}`{}",
                    path.display(),
                    nearest_hint(col, &names)
                );
            }
        }
        let wanted: Vec<usize> = (0..names.len())
            .filter(|&i| required.iter().chain(optional).any(|c| c == names[i]))
            .collect();
        let mask = ProjectionMask::roots(builder.parquet_schema(), wanted);
        builder = builder.with_projection(mask);
    }
    let reader = builder
        .build()
        .with_context(|| format!("reading parquet {}", path.display()))?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.with_context(|| format!("decoding parquet {}", path.display()))?;
        let mut writer = ArrayWriter::new(Vec::new());
        writer.write(&batch)?;
        writer.finish()?;
        let bytes = writer.into_inner();
        if bytes.is_empty() {
            continue;
        }
        let Value::Array(batch_rows) = serde_json::from_slice(&bytes)? else {
            bail!(
                "{}: arrow's JSON writer did not produce an array",
                path.display()
            );
        };
        rows.extend(batch_rows);
    }
    Ok(rows)
}

fn read_jsonl(path: &Path) -> Result<Vec<Value>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {} line {}", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let row = serde_json::from_str(&line).with_context(|| {
            format!(
                "{} row {}: not a JSON object (line {})",
                path.display(),
                rows.len(),
                i + 1
            )
        })?;
        rows.push(row);
    }
    Ok(rows)
}

/// The built-in source: one parquet or jsonl file, read with the `data.*` keys.
pub struct FileSource {
    path: PathBuf,
    fields: Fields,
}

impl FileSource {
    /// A source reading `path` with `fields`.
    pub fn new(path: impl Into<PathBuf>, fields: Fields) -> Self {
        Self {
            path: path.into(),
            fields,
        }
    }
}

impl DataSource for FileSource {
    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn examples(&mut self) -> Result<Vec<SourcedExample>> {
        let (required, optional) = self.fields.columns();
        let rows = read_rows(&self.path, Some((&required, &optional)))?;
        let file = self.name();
        rows.iter()
            .enumerate()
            .map(|(row, value)| {
                let origin = Origin {
                    file: file.clone(),
                    row,
                };
                let example = self.fields.example(value, &origin)?;
                Ok(SourcedExample { origin, example })
            })
            .collect()
    }
}
