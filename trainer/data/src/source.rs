//! Where raw examples come from: the [`DataSource`] trait, implemented by the built-in file reader
//! ([`crate::read::FileSource`]) and, later, by dataset plugins.

use std::fmt;

use anyhow::Result;
use serde_json::Value;

/// Where an example came from, for error messages: a file (or a plugin's name) and a 0-based row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The file path (or the name of the source).
    pub file: String,
    /// 0-based row (line for jsonl, row for parquet).
    pub row: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} row {}", self.file, self.row)
    }
}

/// The prompt of a single-turn example.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A user message's text; it becomes `[{role: user, content: text}]` before the chat template.
    Text(String),
    /// Chat messages (`{role, content, ...}` objects) rendered by the chat template as they are.
    Messages(Vec<Value>),
}

/// One example before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum RawExample {
    /// A prompt (chat-templated with the generation prompt) and the response trained on (followed by EOS).
    PromptResponse {
        /// The prompt.
        prompt: Prompt,
        /// The response text.
        response: String,
    },
    /// A conversation; every assistant message (and the EOS closing it) is trained on, nothing else.
    Messages {
        /// `{role, content, ...}` objects.
        messages: Vec<Value>,
        /// Tool definitions given to the chat template, if any.
        tools: Option<Value>,
        /// Per-example `enable_thinking` given to the chat template, if any.
        enable_thinking: Option<bool>,
    },
    /// Already tokenized: token ids and the loss mask (`loss_mask[t]`: token t is a target).
    Tokens {
        /// Token ids.
        input_ids: Vec<i64>,
        /// Same length as `input_ids`.
        loss_mask: Vec<bool>,
    },
}

/// An example with its origin.
#[derive(Debug, Clone, PartialEq)]
pub struct SourcedExample {
    /// Where it came from.
    pub origin: Origin,
    /// The example.
    pub example: RawExample,
}

/// A source of raw examples (the built-in parquet/jsonl reader, or a dataset plugin).
pub trait DataSource {
    /// A short name for messages (a file path, a plugin name).
    fn name(&self) -> String;
    /// Every example, in the source's order. Errors name the file (or source) and row at fault.
    fn examples(&mut self) -> Result<Vec<SourcedExample>>;
}
