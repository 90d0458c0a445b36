//! Chat templates: the tokenizer's own Jinja template (`tokenizer_config.json`'s `chat_template`) rendered with
//! minijinja the way Hugging Face's `apply_chat_template` renders it (`trim_blocks`, `lstrip_blocks`, Python string
//! methods, `raise_exception`), and the split of a rendered conversation into trained and untrained text.

use std::collections::BTreeMap;
use std::io;

use anyhow::{anyhow, bail, Result};
use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter};
use serde_json::{Map, Value};

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source` (Jinja). `bos_token`/`eos_token` are given to the template as variables.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| anyhow!("compiling the chat template: {e:#}"))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages` as `apply_chat_template(messages, tools=tools, add_generation_prompt=..., **kwargs)` does.
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        tools: Option<&Value>,
        kwargs: &BTreeMap<String, Value>,
    ) -> Result<String> {
        let mut ctx = Map::new();
        for (k, v) in kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Value::Array(messages.to_vec()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        if let Some(t) = tools {
            ctx.insert("tools".into(), t.clone());
        }
        for (name, tok) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(t) = tok {
                ctx.insert(name.into(), Value::String(t.clone()));
            }
        }
        let tmpl = self.env.get_template(NAME).expect("added in new()");
        tmpl.render(minijinja::Value::from_serialize(&ctx))
            .map_err(|e| anyhow!("rendering the chat template: {e:#}"))
    }

    /// The rendered conversation cut into `(text, trained)` pieces: each assistant message's text from the end of
    /// the generation prompt up to and including the first `eos` after it is trained; everything else is not.
    ///
    /// The start of assistant message `i` is where `render(messages[..i], add_generation_prompt=true)` ends; the
    /// template must render that prefix identically inside the whole conversation (true of Qwen and Llama templates;
    /// an error otherwise).
    pub fn split_conversation(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        kwargs: &BTreeMap<String, Value>,
        eos: &str,
    ) -> Result<Vec<(String, bool)>> {
        let full = self.render(messages, false, tools, kwargs)?;
        let mut pieces = Vec::new();
        let mut pos = 0;
        for (i, m) in messages.iter().enumerate() {
            if m.get("role").and_then(Value::as_str) != Some("assistant") {
                continue;
            }
            if i == 0 {
                bail!("message 0 is from the assistant; a conversation must start with a system or user message");
            }
            let prefix = self.render(&messages[..i], true, tools, kwargs)?;
            if !full.starts_with(&prefix) || prefix.len() < pos {
                bail!(
                    "the chat template renders the conversation before message {i} differently on its own than \
                     inside the whole conversation, so the assistant's tokens cannot be located"
                );
            }
            let start = prefix.len();
            let Some(off) = full[start..].find(eos) else {
                bail!("assistant message {i} is not closed by the EOS token `{eos}` in the rendered conversation");
            };
            let end = start + off + eos.len();
            if start > pos {
                pieces.push((full[pos..start].to_string(), false));
            }
            pieces.push((full[start..end].to_string(), true));
            pos = end;
        }
        if !pieces.iter().any(|(_, trained)| *trained) {
            bail!("the conversation has no assistant message to train on");
        }
        if pos < full.len() {
            pieces.push((full[pos..].to_string(), false));
        }
        Ok(pieces)
    }
}

/// Python's `json.dumps` layout, which Hugging Face's `tojson` filter uses: `", "` and `": "` separators, or
/// `indent=N`; non-ASCII kept, no HTML escaping (minijinja's own `tojson` is compact and HTML-escaped).
fn tojson(value: &minijinja::Value, kwargs: Kwargs) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                PrettyFormatter::with_indent(&pad),
            );
            json.serialize(&mut ser)
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PySeparators,
        )),
    };
    written
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(minijinja::Value::from_safe_string(
        String::from_utf8(out).expect("serde_json writes UTF-8"),
    ))
}

/// `json.dumps`' default separators.
struct PySeparators;

impl Formatter for PySeparators {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SIMPLE: &str =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                          {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn renders_with_generation_prompt_and_python_methods() {
        let t = ChatTemplate::new(SIMPLE, None, Some("<|im_end|>".into())).unwrap();
        let msgs = vec![json!({"role": "user", "content": "hi"})];
        let out = t.render(&msgs, true, None, &BTreeMap::new()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let py = ChatTemplate::new(
            "{{ messages[0].content.strip().upper() }}|{{ 'a</t>b'.split('</t>')[-1] }}",
            None,
            None,
        )
        .unwrap();
        let out = py
            .render(
                &[json!({"role": "user", "content": "  x "})],
                false,
                None,
                &BTreeMap::new(),
            )
            .unwrap();
        assert_eq!(out, "X|b");
        let err = ChatTemplate::new("{{ raise_exception('bad role') }}", None, None)
            .unwrap()
            .render(&msgs, false, None, &BTreeMap::new())
            .unwrap_err();
        assert!(format!("{err:#}").contains("bad role"), "{err:#}");
    }

    #[test]
    fn tojson_uses_pythons_layout() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}",
            None,
            None,
        )
        .unwrap();
        let msgs = [json!({"a": [1, 2.5], "b": "<é>"})];
        let out = t.render(&msgs, false, None, &BTreeMap::new()).unwrap();
        assert_eq!(out, "{\"a\": [1, 2.5], \"b\": \"<é>\"}|{\n  \"a\": [\n    1,\n    2.5\n  ],\n  \"b\": \"<é>\"\n}");
    }

    #[test]
    fn conversation_split_trains_assistant_text_and_eos_only() {
        let t = ChatTemplate::new(SIMPLE, None, None).unwrap();
        let msgs = vec![
            json!({"role": "user", "content": "q1"}),
            json!({"role": "assistant", "content": "a1"}),
            json!({"role": "user", "content": "q2"}),
            json!({"role": "assistant", "content": "a2"}),
        ];
        let pieces = t
            .split_conversation(&msgs, None, &BTreeMap::new(), "<|im_end|>")
            .unwrap();
        let trained: Vec<&str> = pieces
            .iter()
            .filter(|p| p.1)
            .map(|p| p.0.as_str())
            .collect();
        assert_eq!(trained, ["a1<|im_end|>", "a2<|im_end|>"]);
        let joined: String = pieces.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(
            joined,
            t.render(&msgs, false, None, &BTreeMap::new()).unwrap()
        );
        let err = t
            .split_conversation(&msgs[..1], None, &BTreeMap::new(), "<|im_end|>")
            .unwrap_err();
        assert!(err.to_string().contains("no assistant message"), "{err}");
    }
}
