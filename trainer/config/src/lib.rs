//! ferl's SFT configuration: verl's legacy `sft_trainer.yaml` keys and defaults as typed serde structs, loaded from
//! an optional YAML file plus Hydra-style command-line overrides.
//!
//! # Data model
//! [`SftConfig`] has verl's four sections — [`DataConfig`] (`data.*`), [`ModelConfig`] (`model.*`, with
//! [`FsdpConfig`] under `model.fsdp_config.*`), [`OptimConfig`] (`optim.*`), [`TrainerConfig`] (`trainer.*`) — and
//! verl's two top-level keys `use_remove_padding` and `ulysses_sequence_parallel_size`.
//!
//! # Loading ([`SftConfig::load`])
//! 1. Start from the defaults (verl's, except where a field's doc says otherwise).
//! 2. Apply the YAML file's keys, then each override in order (`key=value`, `+key=value`, `++key=value`, `~key`;
//!    see [`overrides`]). Old spellings are accepted ([`tree::ALIASES`]: `optim.warmup_steps_ratio`,
//!    `trainer.save_interval`, `model.use_remove_padding`, ...). A Hydra `defaults:` list at the top of a file is
//!    ignored.
//! 3. Resolve `${path.to.key}`, `${oc.env:VAR}` and `${oc.env:VAR,default}` ([`interpolate`]).
//! 4. Map spellings that set other keys onto them ([`spellings`]: `model.fsdp_config.sharding_strategy`,
//!    `model.fsdp_config.mixed_precision: true`); a conflict with a key the user set is an error naming both.
//! 5. Convert to the typed structs and check ranges ([`SftConfig::validate`]). `optim.optimizer` is normalised to
//!    its `torch.optim` spelling ([`canonical_optimizer`]).
//!
//! # Invariants (tests name them)
//! 1. An unknown key is an error naming the full dotted key and the nearest valid one, by meaning first
//!    ([`hints::SYNONYMS`]), then by spelling (`unknown_keys_*`).
//! 2. A bad value is an error naming the full dotted key (`bad_values_*`).
//! 3. `to_yaml()` of a loaded config loads back to the same config (`to_yaml_round_trips`).
//! 4. Nothing the engine cannot honour is silently ignored: the engine lists what it honours in a [`Supported`] and
//!    calls [`SftConfig::validate_supported`], which refuses every other key the user changed (`unsupported_*`).

pub mod hints;
pub mod interpolate;
pub mod overrides;
mod sections;
pub mod spellings;
mod string_list;
pub mod supported;
pub mod tree;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_yaml::Value;

pub use overrides::Override;
pub use sections::*;
pub use string_list::StringList;
pub use supported::Supported;

/// The whole SFT configuration (verl's `sft_trainer.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    /// `data.*`.
    pub data: DataConfig,
    /// `model.*`.
    pub model: ModelConfig,
    /// `optim.*`.
    pub optim: OptimConfig,
    /// `trainer.*`.
    pub trainer: TrainerConfig,
    /// verl: Ulysses sequence-parallel degree; 1 disables it.
    pub ulysses_sequence_parallel_size: usize,
    /// Pack micro-batches without padding (ferl: the packed batch form with `cu_seqlens`).
    pub use_remove_padding: bool,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            data: DataConfig::default(),
            model: ModelConfig::default(),
            optim: OptimConfig::default(),
            trainer: TrainerConfig::default(),
            ulysses_sequence_parallel_size: 1,
            use_remove_padding: false,
        }
    }
}

impl SftConfig {
    /// Loads the config: defaults, then `file` (YAML) if given, then `overrides` (`key=value`...), then
    /// interpolation, then typing and range checks. Every error names the file or the dotted key at fault.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<Self> {
        let text = match file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .with_context(|| format!("reading config {}", f.display()))?,
            ),
            None => None,
        };
        let source = file.map(|f| f.display().to_string()).unwrap_or_default();
        Self::build(text.as_deref().map(|t| (t, source.as_str())), overrides)
    }

    /// Like [`SftConfig::load`] with the file's contents given as text.
    pub fn from_yaml(yaml: &str, overrides: &[String]) -> Result<Self> {
        Self::build(Some((yaml, "<yaml>")), overrides)
    }

    fn build(file: Option<(&str, &str)>, overrides: &[String]) -> Result<Self> {
        let mut loader = Loader::new();
        if let Some((text, name)) = file {
            loader.file(text, name)?;
        }
        for arg in overrides {
            loader.override_arg(arg)?;
        }
        loader.finish()
    }

    /// The defaults with interpolations resolved (what `load(None, &[])` returns).
    pub fn resolved_default() -> Self {
        Self::build(None, &[]).expect("the defaults load")
    }

    /// The config as YAML (what `ferl sft --cfg job` prints); it loads back to the same config.
    pub fn to_yaml(&self) -> String {
        let mut tree = serde_yaml::to_value(self).expect("a config always serialises");
        interpolate::escape(&mut tree);
        serde_yaml::to_string(&tree).expect("a config always serialises")
    }

    /// Range and consistency checks that types alone cannot express; errors name the key.
    pub fn validate(&self) -> Result<()> {
        let (d, o, t) = (&self.data, &self.optim, &self.trainer);
        let mut bad = Vec::new();
        let mut need = |ok: bool, key: &str, what: &str| {
            if !ok {
                bad.push(format!("{key}: {what}"));
            }
        };
        need(
            d.train_batch_size >= 1,
            "data.train_batch_size",
            "must be at least 1",
        );
        need(
            d.micro_batch_size_per_gpu >= 1,
            "data.micro_batch_size_per_gpu",
            "must be at least 1",
        );
        need(d.max_length >= 2, "data.max_length", "must be at least 2");
        need(
            d.max_token_len_per_gpu >= 1,
            "data.max_token_len_per_gpu",
            "must be at least 1",
        );
        need(
            !d.train_files.as_slice().is_empty(),
            "data.train_files",
            "needs at least one file",
        );
        need(
            o.lr.is_finite() && o.lr >= 0.0,
            "optim.lr",
            "must be a finite number >= 0",
        );
        for (i, b) in o.betas.iter().enumerate() {
            need(
                (0.0..1.0).contains(b),
                &format!("optim.betas[{i}]"),
                "must be in [0, 1)",
            );
        }
        need(o.weight_decay >= 0.0, "optim.weight_decay", "must be >= 0");
        need(o.clip_grad > 0.0, "optim.clip_grad", "must be > 0");
        need(
            (0.0..=1.0).contains(&o.min_lr_ratio),
            "optim.min_lr_ratio",
            "must be in [0, 1]",
        );
        need(
            (0.0..=1.0).contains(&o.lr_warmup_steps_ratio),
            "optim.lr_warmup_steps_ratio",
            "must be in [0, 1]",
        );
        need(o.num_cycles >= 0.0, "optim.num_cycles", "must be >= 0");
        need(
            t.total_training_steps != Some(0),
            "trainer.total_training_steps",
            "must be at least 1 (or null)",
        );
        need(
            t.total_epochs >= 1 || t.total_training_steps.is_some(),
            "trainer.total_epochs",
            "must be at least 1 when trainer.total_training_steps is null",
        );
        need(
            t.resume_mode != ResumeMode::ResumePath || t.resume_from_path.is_some(),
            "trainer.resume_from_path",
            "must be set when trainer.resume_mode=resume_path",
        );
        need(
            t.restart_wait_s.is_finite() && t.restart_wait_s > 0.0,
            "trainer.restart_wait_s",
            "must be a positive number of seconds",
        );
        need(
            self.ulysses_sequence_parallel_size >= 1,
            "ulysses_sequence_parallel_size",
            "must be at least 1",
        );
        if !bad.is_empty() {
            bail!("invalid config:\n  {}", bad.join("\n  "));
        }
        Ok(())
    }

    /// Every leaf key whose value differs from [`SftConfig::resolved_default`], with its value, in key order.
    pub fn changed_keys(&self) -> Vec<(String, Value)> {
        let defaults: std::collections::HashMap<String, Value> =
            tree::leaves(&to_tree(&Self::resolved_default()))
                .into_iter()
                .collect();
        tree::leaves(&to_tree(self))
            .into_iter()
            .filter(|(k, v)| defaults.get(k) != Some(v))
            .collect()
    }

    /// Refuses, in one error listing them all, every changed key ([`SftConfig::changed_keys`]) that `supported`
    /// does not honour.
    pub fn validate_supported(&self, supported: &Supported) -> Result<()> {
        supported.check(&self.changed_keys())
    }
}

/// Expands a leading `~/` to `$HOME/` (verl's defaults and users' paths use it).
pub fn expand_path(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    }
}

fn to_tree(cfg: &SftConfig) -> Value {
    serde_yaml::to_value(cfg).expect("a config always serialises")
}

fn defaults_tree() -> Value {
    to_tree(&SftConfig::default())
}

fn schema(defaults: &Value) -> tree::Schema {
    let mixed = serde_yaml::to_value(MixedPrecision::default()).expect("serialises");
    tree::Schema::new(
        defaults,
        &[
            (spellings::MIXED_PRECISION, mixed),
            (spellings::SHARDING_STRATEGY, Value::Null),
        ],
    )
}

/// The tree of defaults with the file's and the overrides' assignments applied, and the canonical keys the user
/// set (which [`spellings::resolve`] needs to tell a conflicting key from a default).
struct Loader {
    defaults: Value,
    schema: tree::Schema,
    tree: Value,
    explicit: BTreeSet<String>,
}

impl Loader {
    fn new() -> Self {
        let defaults = defaults_tree();
        Self {
            schema: schema(&defaults),
            tree: defaults.clone(),
            defaults,
            explicit: BTreeSet::new(),
        }
    }

    /// Applies a YAML file's keys (a Hydra `defaults:` list is ignored).
    fn file(&mut self, text: &str, name: &str) -> Result<()> {
        let parsed: Value =
            serde_yaml::from_str(text).with_context(|| format!("parsing config {name}"))?;
        let mut sets = Vec::new();
        match parsed {
            Value::Null => {}
            Value::Mapping(mut map) => {
                map.remove("defaults");
                tree::assignments("", &Value::Mapping(map), &mut sets);
            }
            _ => {
                bail!("config {name}: expected a mapping of sections (data, model, optim, trainer)")
            }
        }
        for (key, value) in sets {
            self.assign(&key, value)
                .with_context(|| format!("in config {name}"))?;
        }
        Ok(())
    }

    /// Applies one command-line override.
    fn override_arg(&mut self, arg: &str) -> Result<()> {
        let result = match Override::parse(arg)? {
            Override::Set { key, value } => {
                let mut sets = Vec::new();
                tree::assignments(&key, &value, &mut sets);
                sets.into_iter().try_for_each(|(k, v)| self.assign(&k, v))
            }
            Override::Reset { key } => self.reset(&key),
        };
        result.with_context(|| format!("in override `{arg}`"))
    }

    /// Applies one assignment after checking its key.
    fn assign(&mut self, key: &str, value: Value) -> Result<()> {
        let key = tree::canonical_key(key);
        self.schema.check_key(&key)?;
        // `section:` with nothing under it in YAML is null: it leaves the section's defaults alone.
        let is_section =
            matches!(self.schema.default_at(&key), Some(Value::Mapping(m)) if !m.is_empty());
        if value.is_null() && is_section && !tree::is_under_open_key(&key) {
            let optional = matches!(tree::get(&self.defaults, &key), Some(Value::Null));
            if !optional {
                return Ok(());
            }
        }
        tree::set(&mut self.tree, &key, spellings::on_assign(&key, value))?;
        self.explicit.insert(key);
        Ok(())
    }

    /// `~key`: back to the default (or absent), and no longer set by the user.
    fn reset(&mut self, key: &str) -> Result<()> {
        let key = tree::canonical_key(key);
        self.schema.check_key(&key)?;
        match tree::get(&self.defaults, &key) {
            Some(v) => tree::set(&mut self.tree, &key, v.clone())?,
            None => {
                tree::remove(&mut self.tree, &key);
            }
        }
        self.explicit.retain(|k| !tree::is_at_or_below(k, &key));
        Ok(())
    }

    /// Interpolation, spellings, typing and range checks.
    fn finish(mut self) -> Result<SftConfig> {
        interpolate::resolve_all(&mut self.tree)?;
        spellings::resolve(&mut self.tree, &self.explicit)?;
        let cfg = from_tree(&self.tree)?;
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Types a resolved tree. Going through YAML text lets a plain scalar fill a string key (`experiment_name=123`).
fn from_tree(tree: &Value) -> Result<SftConfig> {
    let text = serde_yaml::to_string(tree)?;
    serde_yaml::from_str(&text).map_err(|e| {
        let msg = e.to_string();
        let msg = match msg.find(" at line ") {
            Some(i) => &msg[..i],
            None => &msg,
        };
        match msg.split_once(": ") {
            Some((path, what)) if !path.contains(' ') => {
                anyhow::anyhow!("bad value for `{path}`: {what}")
            }
            _ => anyhow::anyhow!("bad config value: {msg}"),
        }
    })
}

#[cfg(test)]
mod tests;
