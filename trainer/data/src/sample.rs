//! Turning a [`RawExample`] into a [`TokenizedSample`]: chat template, tokens, loss mask, truncation.
//!
//! Invariants (tests name them):
//! 1. Single-turn: `input_ids = encode(template(prompt, add_generation_prompt)) ++ encode(response) ++ [eos]`;
//!    the mask is false on every prompt token and true on every response token and on the EOS (`single_turn_mask`).
//! 2. Multi-turn: true exactly on each assistant message's tokens and the EOS closing it (`multi_turn_mask`).
//! 3. `input_ids.len() == loss_mask.len() <= max_length`, and `loss_mask[0]` is false (token 0 has no predecessor).
//! 4. `truncation=error` refuses a too-long sample naming its file and row (`truncation_modes`).

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use ferl_config::Truncation;
use serde_json::{json, Value};

use crate::source::{Prompt, RawExample, SourcedExample};
use crate::tokenizer::SftTokenizer;

/// One training sequence: token ids and which of them are targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedSample {
    /// Token ids.
    pub input_ids: Vec<i64>,
    /// `loss_mask[t]`: token `t` is a target (the model predicts it from position `t - 1`). Never true at 0.
    pub loss_mask: Vec<bool>,
}

impl TokenizedSample {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Number of target tokens.
    pub fn num_targets(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m).count()
    }
}

/// Settings for building samples.
pub struct SampleBuilder<'a> {
    /// The tokenizer and chat template.
    pub tokenizer: &'a SftTokenizer,
    /// `data.max_length`.
    pub max_length: usize,
    /// `data.truncation`.
    pub truncation: Truncation,
    /// `data.apply_chat_template_kwargs`.
    pub template_kwargs: &'a BTreeMap<String, Value>,
}

impl SampleBuilder<'_> {
    /// Tokenizes one example; errors name its file and row.
    pub fn build(&self, ex: &SourcedExample) -> Result<TokenizedSample> {
        let sample = self
            .tokens(&ex.example)
            .with_context(|| format!("{}", ex.origin))?;
        self.truncate(sample)
            .with_context(|| format!("{}", ex.origin))
    }

    fn tokens(&self, ex: &RawExample) -> Result<TokenizedSample> {
        let tok = self.tokenizer;
        match ex {
            RawExample::PromptResponse { prompt, response } => {
                let messages = match prompt {
                    Prompt::Text(t) => vec![json!({"role": "user", "content": t})],
                    Prompt::Messages(m) => m.clone(),
                };
                let prompt_text =
                    tok.template()?
                        .render(&messages, true, None, self.template_kwargs)?;
                let mut input_ids = tok.encode(&prompt_text)?;
                let n_prompt = input_ids.len();
                input_ids.extend(tok.encode(response)?);
                input_ids.push(tok.eos_token_id());
                let mut loss_mask = vec![false; n_prompt];
                loss_mask.resize(input_ids.len(), true);
                Ok(TokenizedSample {
                    input_ids,
                    loss_mask,
                })
            }
            RawExample::Messages {
                messages,
                tools,
                enable_thinking,
            } => {
                let mut kwargs = self.template_kwargs.clone();
                if let Some(b) = enable_thinking {
                    kwargs.insert("enable_thinking".into(), Value::Bool(*b));
                }
                let pieces = tok.template()?.split_conversation(
                    messages,
                    tools.as_ref(),
                    &kwargs,
                    tok.eos_token(),
                )?;
                let mut sample = TokenizedSample {
                    input_ids: Vec::new(),
                    loss_mask: Vec::new(),
                };
                for (text, trained) in pieces {
                    let ids = tok.encode(&text)?;
                    sample
                        .loss_mask
                        .extend(std::iter::repeat_n(trained, ids.len()));
                    sample.input_ids.extend(ids);
                }
                Ok(sample)
            }
            RawExample::Tokens {
                input_ids,
                loss_mask,
            } => {
                if input_ids.len() != loss_mask.len() {
                    bail!(
                        "{} token ids but {} loss-mask entries",
                        input_ids.len(),
                        loss_mask.len()
                    );
                }
                Ok(TokenizedSample {
                    input_ids: input_ids.clone(),
                    loss_mask: loss_mask.clone(),
                })
            }
        }
    }

    fn truncate(&self, mut s: TokenizedSample) -> Result<TokenizedSample> {
        let n = s.len();
        if n > self.max_length {
            match self.truncation {
                Truncation::Error => bail!(
                    "the sample has {n} tokens, more than data.max_length={} (raise it, or set \
                     data.truncation=left or right)",
                    self.max_length
                ),
                Truncation::Left => {
                    s.input_ids.drain(..n - self.max_length);
                    s.loss_mask.drain(..n - self.max_length);
                }
                Truncation::Right => {
                    s.input_ids.truncate(self.max_length);
                    s.loss_mask.truncate(self.max_length);
                }
            }
        }
        if s.is_empty() {
            bail!("the sample has no tokens");
        }
        s.loss_mask[0] = false;
        Ok(s)
    }
}
