//! Refusing what the engine cannot honour yet: an engine declares the keys (and, where it matters, the values) it
//! honours in a [`Supported`]; [`SftConfig::validate_supported`](crate::SftConfig::validate_supported) then refuses
//! every key the user changed from its default that the engine does not list, all at once, in one message.
//!
//! Keys left at their defaults are never refused, so verl keys that have no meaning in ferl (`trainer.nnodes`,
//! `data.use_shm`, ...) are harmless until someone sets them.

use std::fmt::Write as _;

use anyhow::{bail, Result};
use serde_yaml::Value;

/// The keys an engine honours. Patterns are dotted keys; a trailing `.*` matches everything below a section.
#[derive(Debug, Clone, Default)]
pub struct Supported {
    rules: Vec<Rule>,
}

#[derive(Debug, Clone)]
struct Rule {
    pattern: String,
    allowed: Option<Vec<String>>,
}

impl Supported {
    /// Honours nothing (every changed key is refused).
    pub fn new() -> Self {
        Self::default()
    }

    /// Honours `pattern` with any value.
    pub fn key(mut self, pattern: &str) -> Self {
        self.rules.push(Rule {
            pattern: pattern.to_string(),
            allowed: None,
        });
        self
    }

    /// Honours each of `patterns` with any value.
    pub fn keys(self, patterns: &[&str]) -> Self {
        patterns.iter().fold(self, |s, p| s.key(p))
    }

    /// Honours `pattern` only with these values (for a list, every element must be one of them).
    pub fn values(mut self, pattern: &str, allowed: &[&str]) -> Self {
        let allowed = allowed.iter().map(|s| s.to_string()).collect();
        self.rules.push(Rule {
            pattern: pattern.to_string(),
            allowed: Some(allowed),
        });
        self
    }

    /// `None` if `key` may be set to `value`; otherwise why not.
    pub fn refusal(&self, key: &str, value: &Value) -> Option<String> {
        let matching: Vec<&Rule> = self
            .rules
            .iter()
            .filter(|r| matches(&r.pattern, key))
            .collect();
        if matching.is_empty() {
            return Some("not supported by ferl yet".to_string());
        }
        if matching.iter().any(|r| r.allowed.is_none()) {
            return None;
        }
        let allowed: Vec<&String> = matching
            .iter()
            .flat_map(|r| r.allowed.iter().flatten())
            .collect();
        let items: Vec<String> = match value {
            Value::Sequence(items) => items.iter().map(scalar_text).collect(),
            other => vec![scalar_text(other)],
        };
        let bad: Vec<&String> = items.iter().filter(|i| !allowed.contains(i)).collect();
        if bad.is_empty() {
            return None;
        }
        let ok: Vec<&str> = allowed.iter().map(|s| s.as_str()).collect();
        let plain: Vec<String> = bad
            .iter()
            .filter(|b| instead(key, b, &ok).is_none())
            .map(|b| format!("`{b}`"))
            .collect();
        let mut why: Vec<String> = Vec::new();
        if !plain.is_empty() {
            why.push(format!("{} not supported by ferl yet", plain.join(", ")));
        }
        why.extend(bad.iter().filter_map(|b| instead(key, b, &ok)));
        Some(format!("{} (supported: {})", why.join("; "), ok.join(", ")))
    }

    /// Checks `changed` (key, value) pairs; one error listing every refused key.
    pub fn check(&self, changed: &[(String, Value)]) -> Result<()> {
        let mut msg = String::new();
        for (key, value) in changed {
            if let Some(why) = self.refusal(key, value) {
                let _ = write!(msg, "\n  {key}={}: {why}", inline(value));
            }
        }
        if !msg.is_empty() {
            bail!(
                "these settings cannot be honoured yet; remove them or keep verl's defaults:{msg}"
            );
        }
        Ok(())
    }
}

/// The working alternative to a value ferl will not honour, naming only what this engine supports (`allowed`):
/// `trainer.logger=wandb` (wandb has no Rust client) points at the TensorBoard files `wandb sync` uploads and at
/// mlflow. The same text on every path that honours the same loggers.
fn instead(key: &str, value: &str, allowed: &[&str]) -> Option<String> {
    if key != "trainer.logger" || value != "wandb" {
        return None;
    }
    let mut ways = Vec::new();
    if allowed.contains(&"tensorboard") {
        ways.push(
            "log with trainer.logger=[console,tensorboard] and upload with `wandb sync --sync-tensorboard \
             <trainer.default_local_dir>/tensorboard_log/<trainer.project_name>/<trainer.experiment_name>` (the \
             folder is $TENSORBOARD_DIR when set)"
                .to_string(),
        );
    }
    if allowed.contains(&"mlflow") {
        ways.push("use trainer.logger=[console,mlflow]".to_string());
    }
    let ways = if ways.is_empty() {
        String::new()
    } else {
        format!(": {}", ways.join(", or "))
    };
    Some(format!("`wandb` has no Rust client in ferl{ways}"))
}

fn matches(pattern: &str, key: &str) -> bool {
    match pattern.strip_suffix(".*") {
        Some(section) => key
            .strip_prefix(section)
            .is_some_and(|r| r.starts_with('.')),
        None => {
            pattern == key
                || key
                    .strip_prefix(pattern)
                    .is_some_and(|r| r.starts_with('.'))
        }
    }
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => inline(other),
    }
}

/// A value on one line, as a user would type it in an override.
pub fn inline(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "null".into(),
        Value::Sequence(items) => format!(
            "[{}]",
            items.iter().map(inline).collect::<Vec<_>>().join(",")
        ),
        other => serde_yaml::to_string(other)
            .map(|s| s.trim().replace('\n', " "))
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_values_and_lists() {
        let s = Supported::new()
            .key("model.fsdp_config.*")
            .keys(&["optim.lr", "data.multiturn"])
            .values("trainer.logger", &["console", "jsonl"]);
        assert!(s
            .refusal("model.fsdp_config.cpu_offload", &Value::Bool(true))
            .is_none());
        assert!(s.refusal("model.fsdp_config", &Value::Null).is_some());
        assert!(s.refusal("optim.lr", &Value::from(0.1)).is_none());
        assert!(s
            .refusal("optim.lr_warmup_steps", &Value::from(1))
            .is_some());
        assert!(s
            .refusal("data.multiturn.enable", &Value::Bool(true))
            .is_none());
        let list: Value = serde_yaml::from_str("[console, jsonl]").unwrap();
        assert!(s.refusal("trainer.logger", &list).is_none());
        let list: Value = serde_yaml::from_str("[console, wandb]").unwrap();
        let why = s.refusal("trainer.logger", &list).unwrap();
        assert_eq!(
            why,
            "`wandb` has no Rust client in ferl (supported: console, jsonl)"
        );
        let list: Value = serde_yaml::from_str("[swanlab, wandb]").unwrap();
        let why = s.refusal("trainer.logger", &list).unwrap();
        assert_eq!(
            why,
            "`swanlab` not supported by ferl yet; `wandb` has no Rust client in ferl (supported: console, jsonl)"
        );
    }

    #[test]
    fn wandb_is_refused_naming_the_supported_alternatives() {
        let s = Supported::new().values("trainer.logger", &["console", "tensorboard", "mlflow"]);
        let list: Value = serde_yaml::from_str("[console, wandb]").unwrap();
        let why = s.refusal("trainer.logger", &list).unwrap();
        assert!(
            why.starts_with(
                "`wandb` has no Rust client in ferl: log with trainer.logger=[console,tensorboard]"
            ),
            "{why}"
        );
        assert!(
            why.contains(
                "`wandb sync --sync-tensorboard <trainer.default_local_dir>/tensorboard_log/"
            ),
            "{why}"
        );
        assert!(
            why.contains("or use trainer.logger=[console,mlflow]"),
            "{why}"
        );
        assert!(s
            .refusal("trainer.logger", &Value::from("wandb2"))
            .unwrap()
            .starts_with("`wandb2` not supported by ferl yet"));
    }

    #[test]
    fn check_lists_every_refused_key() {
        let s = Supported::new().key("optim.lr");
        let changed = vec![
            ("optim.lr".to_string(), Value::from(0.1)),
            ("model.lora_rank".to_string(), Value::from(32)),
            ("model.use_liger".to_string(), Value::Bool(true)),
        ];
        let err = s.check(&changed).unwrap_err().to_string();
        assert!(
            err.contains("model.lora_rank=32: not supported by ferl yet"),
            "{err}"
        );
        assert!(err.contains("model.use_liger=true: not supported"), "{err}");
        assert!(!err.contains("optim.lr="), "{err}");
    }
}
