//! Command-line overrides in Hydra's form: `key=value`, `+key=value`, `++key=value` and `~key`.
//!
//! Values are typed like Hydra's: `512` is an integer, `1e-4` a float, `true`/`False` booleans, `null` (or `~`) is
//! null, `[a,b]` a list, `{a: 1}` a mapping, `'quoted'` a string, anything else a string; `key=` is the empty string.
//! Every ferl key already exists, so `+`/`++` (Hydra's "add" and "add or replace") behave like a plain `key=value`;
//! they are accepted so verl command lines work unchanged. `~key` resets a key to its default.

use anyhow::{bail, Result};
use serde_yaml::Value;

/// One parsed override.
#[derive(Debug, Clone, PartialEq)]
pub enum Override {
    /// Set `key` (dotted) to `value`.
    Set {
        /// The dotted key as written (aliases not yet resolved).
        key: String,
        /// The typed value.
        value: Value,
    },
    /// Reset `key` to its default (`~key`).
    Reset {
        /// The dotted key as written.
        key: String,
    },
}

impl Override {
    /// Parses one override argument.
    pub fn parse(arg: &str) -> Result<Self> {
        if let Some(rest) = arg.strip_prefix('~') {
            let key = rest.split_once('=').map_or(rest, |(k, _)| k).trim();
            check_key_syntax(arg, key)?;
            return Ok(Override::Reset {
                key: key.to_string(),
            });
        }
        let body = arg
            .strip_prefix("++")
            .or_else(|| arg.strip_prefix('+'))
            .unwrap_or(arg);
        let Some((key, text)) = body.split_once('=') else {
            bail!("override `{arg}` has no `=`; write key=value (e.g. data.max_length=512)");
        };
        let key = key.trim();
        check_key_syntax(arg, key)?;
        Ok(Override::Set {
            key: key.to_string(),
            value: parse_value(text),
        })
    }
}

fn check_key_syntax(arg: &str, key: &str) -> Result<()> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.';
    if key.is_empty() || key.split('.').any(str::is_empty) || !key.chars().all(ok_char) {
        bail!("override `{arg}`: `{key}` is not a dotted config key (like trainer.total_epochs)");
    }
    Ok(())
}

/// Types an override's value text the way Hydra does (see the module docs).
pub fn parse_value(text: &str) -> Value {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Value::String(String::new());
    }
    // Interpolations stay strings; they are resolved once every override is applied.
    if trimmed.contains("${") {
        return Value::String(unquote(trimmed).to_string());
    }
    match serde_yaml::from_str::<Value>(trimmed) {
        // `a: b` parses as a one-entry mapping; only a braced value is meant as a mapping.
        Ok(Value::Mapping(_)) if !trimmed.starts_with('{') => Value::String(trimmed.to_string()),
        Ok(Value::Tagged(_)) | Err(_) => Value::String(trimmed.to_string()),
        Ok(v) => v,
    }
}

fn unquote(s: &str) -> &str {
    for q in ['\'', '"'] {
        if let Some(inner) = s.strip_prefix(q).and_then(|r| r.strip_suffix(q)) {
            return inner;
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(arg: &str) -> (String, Value) {
        match Override::parse(arg).unwrap() {
            Override::Set { key, value } => (key, value),
            other => panic!("expected a set, got {other:?}"),
        }
    }

    #[test]
    fn values_are_typed_like_hydra() {
        assert_eq!(set("data.max_length=512").1, Value::from(512));
        assert_eq!(set("optim.lr=1e-4").1, Value::from(1e-4));
        assert_eq!(set("optim.lr=3.5").1, Value::from(3.5));
        assert_eq!(set("data.shuffle=False").1, Value::Bool(false));
        assert_eq!(set("data.shuffle=true").1, Value::Bool(true));
        assert_eq!(set("trainer.total_training_steps=null").1, Value::Null);
        assert_eq!(set("trainer.project_name=").1, Value::String(String::new()));
        assert_eq!(
            set("trainer.project_name='123'").1,
            Value::String("123".into())
        );
        assert_eq!(
            set("data.train_files=~/data/x.parquet").1,
            Value::String("~/data/x.parquet".into())
        );
        assert_eq!(set("x=a: b").1, Value::String("a: b".into()));
        assert_eq!(set("x=a=b").1, Value::String("a=b".into()));
    }

    #[test]
    fn lists_and_mappings() {
        let (_, v) = set("data.prompt_dict_keys=['question']");
        assert_eq!(v, serde_yaml::from_str::<Value>("[question]").unwrap());
        let (_, v) = set("trainer.logger=[console,jsonl]");
        assert_eq!(
            v,
            serde_yaml::from_str::<Value>("[console, jsonl]").unwrap()
        );
        let (_, v) = set("x={a: 1}");
        assert_eq!(v, serde_yaml::from_str::<Value>("a: 1").unwrap());
    }

    #[test]
    fn prefixes_and_interpolations() {
        assert_eq!(
            set("+data.response_dict_keys=[answer]").0,
            "data.response_dict_keys"
        );
        assert_eq!(set("++optim.lr=1").0, "optim.lr");
        assert_eq!(
            Override::parse("~optim.lr").unwrap(),
            Override::Reset {
                key: "optim.lr".into()
            }
        );
        assert_eq!(
            set("a=${oc.env:HOME}/x").1,
            Value::String("${oc.env:HOME}/x".into())
        );
    }

    #[test]
    fn malformed_overrides_are_refused() {
        let err = Override::parse("data.max_length").unwrap_err().to_string();
        assert!(err.contains("`data.max_length` has no `=`"), "{err}");
        let err = Override::parse("data..x=1").unwrap_err().to_string();
        assert!(err.contains("not a dotted config key"), "{err}");
    }
}
