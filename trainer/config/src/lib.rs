//! ferl's SFT configuration: verl's legacy `sft_trainer.yaml` keys and defaults as typed serde structs, loaded from
//! an optional YAML file plus Hydra-style command-line overrides. [`PpoConfig`] (module [`ppo`]) does the same for
//! verl's `ppo_trainer.yaml` (`ferl grpo`), through the same loader and with the same invariants.
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
mod loader;
pub mod overrides;
pub mod ppo;
mod sections;
pub mod spellings;
mod string_list;
pub mod supported;
pub mod tree;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use serde_yaml::Value;

pub use overrides::Override;
pub use ppo::PpoConfig;
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
        loader::load(file, overrides)
    }

    /// Like [`SftConfig::load`] with the file's contents given as text.
    pub fn from_yaml(yaml: &str, overrides: &[String]) -> Result<Self> {
        loader::build(Some((yaml, "<yaml>")), overrides)
    }

    /// The defaults with interpolations resolved (what `load(None, &[])` returns).
    pub fn resolved_default() -> Self {
        loader::build(None, &[]).expect("the defaults load")
    }

    /// The config as YAML (what `ferl sft --cfg job` prints); it loads back to the same config.
    pub fn to_yaml(&self) -> String {
        loader::to_yaml(self)
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
        check_optim(o, &mut need);
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
        loader::changed_keys(self, &Self::resolved_default())
    }

    /// Refuses, in one error listing them all, every changed key ([`SftConfig::changed_keys`]) that `supported`
    /// does not honour.
    pub fn validate_supported(&self, supported: &Supported) -> Result<()> {
        supported.check(&self.changed_keys())
    }
}

/// [`SftConfig::validate`]'s checks of `optim.*`, reported through `need(ok, key, what)`.
fn check_optim(o: &OptimConfig, need: &mut dyn FnMut(bool, &str, &str)) {
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
}

/// Expands a leading `~/` to `$HOME/` (verl's defaults and users' paths use it).
pub fn expand_path(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    }
}

impl loader::Kind for SftConfig {
    const KEYS: tree::KeyTables = tree::SFT_KEYS;
    const SECTIONS: &'static str = "data, model, optim, trainer";

    fn optional_sections() -> Vec<(&'static str, Value)> {
        let mixed = serde_yaml::to_value(MixedPrecision::default()).expect("serialises");
        vec![
            (spellings::MIXED_PRECISION, mixed),
            (spellings::SHARDING_STRATEGY, Value::Null),
        ]
    }

    fn on_assign(key: &str, value: Value) -> Value {
        spellings::on_assign(key, value)
    }

    fn resolve_spellings(tree: &mut Value, explicit: &BTreeSet<String>) -> Result<()> {
        spellings::resolve(tree, explicit)
    }

    fn check(&self) -> Result<()> {
        self.validate()
    }
}

#[cfg(test)]
fn defaults_tree() -> Value {
    loader::defaults_tree::<SftConfig>()
}

#[cfg(test)]
fn schema(defaults: &Value) -> tree::Schema {
    loader::schema::<SftConfig>(defaults)
}

#[cfg(test)]
mod tests;
