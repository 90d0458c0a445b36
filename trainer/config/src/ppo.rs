//! ferl's PPO/GRPO configuration (`ferl grpo`): verl's `ppo_trainer.yaml` keys and defaults as typed serde structs,
//! loaded like [`SftConfig`](crate::SftConfig) — defaults, an optional YAML file, Hydra-style overrides,
//! `${...}` interpolation — with the same invariants: an unknown key is an error naming the full dotted key and the
//! nearest valid one (by meaning first, [`crate::hints::PPO_SYNONYMS`]), a bad value names its key, `to_yaml()`
//! round-trips, and [`PpoConfig::validate_supported`] refuses every changed key an engine does not honour.
//!
//! # Data model
//! [`PpoConfig`] has verl's sections: [`DataConfig`] (`data.*`), [`ActorRolloutRefConfig`]
//! (`actor_rollout_ref.{model,actor,ref,rollout}.*`), [`CriticConfig`] (`critic.*`, only verl's common keys),
//! [`RewardModelConfig`] (`reward_model.*`), [`CustomRewardFunctionConfig`] (`custom_reward_function.*`),
//! [`AlgorithmConfig`] (`algorithm.*`) and [`TrainerConfig`] (`trainer.*`).
//!
//! The value types of the algorithm keys ([`AdvEstimator`], [`LossAggMode`], [`KlPenalty`], [`PolicyLossConfig`])
//! are defined here once; the trainer's RL code takes them as they are. Where verl spells a section of
//! `ppo_trainer.yaml` as `sft_trainer.yaml` does, the type is [`SftConfig`](crate::SftConfig)'s own:
//! [`CustomClsConfig`](crate::CustomClsConfig), [`WrapPolicy`](crate::WrapPolicy), [`Strategy`](crate::Strategy),
//! [`LrScheduler`](crate::LrScheduler), [`ResumeMode`], [`Dtype`](crate::Dtype). The other sections have types of
//! their own because verl's keys differ: `fsdp_config` (`param_offload`/`optimizer_offload`/`offload_policy` against
//! SFT's `cpu_offload`/`offload_params`/`model_dtype`/`mixed_precision`), `optim` (`lr_scheduler_type`, no
//! `clip_grad`/`optimizer`, against SFT's `lr_scheduler`), `checkpoint` (`async_save`), `data.truncation` (`middle`),
//! and the `data`, `model` and `trainer` sections as a whole.
//!
//! # Keys that follow other keys
//! As in verl, some defaults are references ([`LINKS`]): `actor_rollout_ref.rollout.response_length` is
//! `${data.max_response_length}`, the critic's batch keys are the actor's, and so on. Such a key follows its
//! reference unless the user sets it, and [`PpoConfig::changed_keys`] reports it only when it no longer does (the
//! key it follows is reported instead, if changed).

mod algos;
mod rollout;
mod sections;

use std::path::Path;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use serde_yaml::Value;

pub use algos::*;
pub use rollout::*;
pub use sections::*;

use crate::loader::{self, Kind};
use crate::sections::ResumeMode;
use crate::supported::Supported;
use crate::tree::KeyTables;

/// The whole PPO configuration (verl's `ppo_trainer.yaml`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PpoConfig {
    /// `data.*`.
    pub data: DataConfig,
    /// `actor_rollout_ref.*`.
    pub actor_rollout_ref: ActorRolloutRefConfig,
    /// `critic.*`.
    pub critic: CriticConfig,
    /// `reward_model.*`.
    pub reward_model: RewardModelConfig,
    /// `custom_reward_function.*`.
    pub custom_reward_function: CustomRewardFunctionConfig,
    /// `algorithm.*`.
    pub algorithm: AlgorithmConfig,
    /// `trainer.*`.
    pub trainer: TrainerConfig,
}

/// Older or alternative spellings accepted for verl's PPO keys: `(alias, canonical)` (see [`crate::tree::ALIASES`]).
pub const ALIASES: &[(&str, &str)] = &[
    (
        "actor_rollout_ref.actor.optim.warmup_style",
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
    ),
    (
        "critic.optim.warmup_style",
        "critic.optim.lr_scheduler_type",
    ),
    (
        "actor_rollout_ref.actor.use_remove_padding",
        "actor_rollout_ref.model.use_remove_padding",
    ),
];

/// Keys whose value is a free-form mapping passed on as-is (see [`crate::tree::OPEN_KEYS`]).
pub const OPEN_KEYS: &[&str] = &[
    "data.apply_chat_template_kwargs",
    "actor_rollout_ref.model.override_config",
    "actor_rollout_ref.rollout.engine_kwargs",
];

/// [`PpoConfig`]'s key tables: [`ALIASES`], [`OPEN_KEYS`] and [`crate::hints::PPO_SYNONYMS`].
pub const KEYS: KeyTables = KeyTables {
    aliases: ALIASES,
    open_keys: OPEN_KEYS,
    synonyms: crate::hints::PPO_SYNONYMS,
};

/// Keys whose default follows another key, as verl's `ppo_trainer.yaml` writes them: `(key, reference)`.
pub const LINKS: &[(&str, &str)] = &[
    (
        "actor_rollout_ref.actor.checkpoint.load_contents",
        "${actor_rollout_ref.actor.checkpoint.save_contents}",
    ),
    (
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
    ),
    (
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
    ),
    (
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        "${actor_rollout_ref.actor.ulysses_sequence_parallel_size}",
    ),
    (
        "actor_rollout_ref.rollout.prompt_length",
        "${data.max_prompt_length}",
    ),
    (
        "actor_rollout_ref.rollout.response_length",
        "${data.max_response_length}",
    ),
    (
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
    ),
    (
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
    ),
    (
        "critic.model.tokenizer_path",
        "${actor_rollout_ref.model.path}",
    ),
    (
        "critic.ppo_mini_batch_size",
        "${actor_rollout_ref.actor.ppo_mini_batch_size}",
    ),
    (
        "critic.use_dynamic_bsz",
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
    ),
    ("critic.ppo_epochs", "${actor_rollout_ref.actor.ppo_epochs}"),
    ("critic.shuffle", "${actor_rollout_ref.actor.shuffle}"),
    (
        "critic.loss_agg_mode",
        "${actor_rollout_ref.actor.loss_agg_mode}",
    ),
    (
        "reward_model.model.input_tokenizer",
        "${actor_rollout_ref.model.path}",
    ),
    (
        "trainer.default_local_dir",
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
    ),
];

impl PpoConfig {
    /// Loads the config: defaults, then `file` (YAML) if given, then `overrides` (`key=value`...), then
    /// interpolation, then typing and range checks. Every error names the file or the dotted key at fault.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<Self> {
        loader::load(file, overrides)
    }

    /// Like [`PpoConfig::load`] with the file's contents given as text.
    pub fn from_yaml(yaml: &str, overrides: &[String]) -> Result<Self> {
        loader::build(Some((yaml, "<yaml>")), overrides)
    }

    /// The defaults with interpolations resolved (what `load(None, &[])` returns; equal to `default()`).
    pub fn resolved_default() -> Self {
        loader::build(None, &[]).expect("the defaults load")
    }

    /// The config as YAML (what `ferl grpo --cfg job` prints); it loads back to the same config.
    pub fn to_yaml(&self) -> String {
        loader::to_yaml(self)
    }

    /// Every leaf key whose value differs from [`PpoConfig::resolved_default`], with its value, in key order; a key
    /// that still follows its reference ([`LINKS`]) is not reported.
    pub fn changed_keys(&self) -> Vec<(String, Value)> {
        loader::changed_keys(self, &Self::resolved_default())
    }

    /// Refuses, in one error listing them all, every changed key ([`PpoConfig::changed_keys`]) that `supported`
    /// does not honour.
    pub fn validate_supported(&self, supported: &Supported) -> Result<()> {
        supported.check(&self.changed_keys())
    }

    /// Whether a critic is trained: `critic.enable`, else verl's rule (`algorithm.adv_estimator` is `gae`).
    pub fn uses_critic(&self) -> bool {
        self.critic
            .enable
            .unwrap_or(self.algorithm.adv_estimator == AdvEstimator::Gae)
    }

    /// Range and consistency checks that types alone cannot express (verl's `validate_config` where it does not
    /// depend on the device count); errors name the key, all at once.
    pub fn validate(&self) -> Result<()> {
        let mut c = Checks::default();
        self.check_data(&mut c);
        self.check_actor(&mut c);
        self.check_rollout(&mut c);
        self.check_rest(&mut c);
        c.finish()
    }

    fn check_data(&self, c: &mut Checks) {
        let d = &self.data;
        c.at_least_1(d.train_batch_size, "data.train_batch_size");
        c.at_least_1(d.max_prompt_length, "data.max_prompt_length");
        c.at_least_1(d.max_response_length, "data.max_response_length");
        c.need(
            !d.train_files.as_slice().is_empty(),
            "data.train_files",
            "needs at least one file",
        );
        c.need(
            d.val_batch_size != Some(0),
            "data.val_batch_size",
            "must be at least 1 (or null)",
        );
    }

    fn check_actor(&self, c: &mut Checks) {
        let a = &self.actor_rollout_ref.actor;
        let batch = self.data.train_batch_size;
        let mini = a.ppo_mini_batch_size;
        c.at_least_1(mini, "actor_rollout_ref.actor.ppo_mini_batch_size");
        let n = self.actor_rollout_ref.rollout.n;
        if mini > batch {
            c.need(
                false,
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                &format!("must be at most data.train_batch_size ({batch})"),
            );
        } else if mini > 0 && !batch.is_multiple_of(mini) {
            // verl's semantics: both count prompts; a mini-batch is `mini × n` of the step's `batch × n` responses.
            c.need(
                false,
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                &format!(
                    "{mini} does not divide data.train_batch_size ({batch}): both count prompts, and each optimizer \
                     step takes ppo_mini_batch_size × actor_rollout_ref.rollout.n = {} of the step's {} responses",
                    mini * n,
                    batch * n
                ),
            );
        }
        c.micro_batch(
            "actor_rollout_ref.actor",
            "ppo_micro_batch_size",
            a.ppo_micro_batch_size,
            a.ppo_micro_batch_size_per_gpu,
        );
        c.at_least_1(
            a.ppo_max_token_len_per_gpu,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        );
        c.non_negative(a.clip_ratio, "actor_rollout_ref.actor.clip_ratio");
        if let Some(low) = a.clip_ratio_low {
            c.non_negative(low, "actor_rollout_ref.actor.clip_ratio_low");
        }
        if let Some(high) = a.clip_ratio_high {
            c.non_negative(high, "actor_rollout_ref.actor.clip_ratio_high");
        }
        c.need(
            a.clip_ratio_c.is_finite() && a.clip_ratio_c > 1.0,
            "actor_rollout_ref.actor.clip_ratio_c",
            "must be above 1 (dual-clip PPO's lower bound)",
        );
        c.need(
            a.entropy_coeff.is_finite(),
            "actor_rollout_ref.actor.entropy_coeff",
            "must be a finite number",
        );
        c.non_negative(a.kl_loss_coef, "actor_rollout_ref.actor.kl_loss_coef");
        c.at_least_1(a.ppo_epochs, "actor_rollout_ref.actor.ppo_epochs");
        c.positive(a.grad_clip, "actor_rollout_ref.actor.grad_clip");
        c.at_least_1(
            a.ulysses_sequence_parallel_size,
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        );
        c.optim(&a.optim, "actor_rollout_ref.actor.optim");
        let r = &self.actor_rollout_ref.reference;
        c.micro_batch(
            "actor_rollout_ref.ref",
            "log_prob_micro_batch_size",
            r.log_prob_micro_batch_size,
            r.log_prob_micro_batch_size_per_gpu,
        );
    }

    fn check_rollout(&self, c: &mut Checks) {
        let r = &self.actor_rollout_ref.rollout;
        c.at_least_1(r.n, "actor_rollout_ref.rollout.n");
        let est = self.algorithm.adv_estimator;
        if est.needs_groups() && r.n == 1 {
            let others: Vec<&str> = AdvEstimator::group_estimators()
                .filter(|e| *e != est)
                .map(AdvEstimator::as_str)
                .collect();
            c.need(
                false,
                "actor_rollout_ref.rollout.n",
                &format!(
                    "must be above 1 with algorithm.adv_estimator={est}: {est} compares each response with the \
                     others of its prompt (a group of rollout.n responses), so one response per prompt has no group \
                     ({} need groups too)",
                    others.join(" and ")
                ),
            );
        }
        c.sampling(
            "actor_rollout_ref.rollout",
            r.temperature,
            r.top_p,
            r.top_k,
            r.do_sample,
        );
        let v = &r.val_kwargs;
        c.at_least_1(v.n, "actor_rollout_ref.rollout.val_kwargs.n");
        let val = "actor_rollout_ref.rollout.val_kwargs";
        c.sampling(val, v.temperature, v.top_p, v.top_k, v.do_sample);
        c.at_least_1(r.prompt_length, "actor_rollout_ref.rollout.prompt_length");
        c.at_least_1(
            r.response_length,
            "actor_rollout_ref.rollout.response_length",
        );
        c.need(
            r.gpu_memory_utilization > 0.0 && r.gpu_memory_utilization <= 1.0,
            "actor_rollout_ref.rollout.gpu_memory_utilization",
            "must be in (0, 1]",
        );
        c.at_least_1(
            r.tensor_model_parallel_size,
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
        );
        c.micro_batch(
            "actor_rollout_ref.rollout",
            "log_prob_micro_batch_size",
            r.log_prob_micro_batch_size,
            r.log_prob_micro_batch_size_per_gpu,
        );
    }

    fn check_rest(&self, c: &mut Checks) {
        let (al, t) = (&self.algorithm, &self.trainer);
        c.unit(al.gamma, "algorithm.gamma");
        c.unit(al.lam, "algorithm.lam");
        c.non_negative(al.kl_ctrl.kl_coef, "algorithm.kl_ctrl.kl_coef");
        c.non_negative(al.kl_ctrl.target_kl, "algorithm.kl_ctrl.target_kl");
        c.need(
            al.kl_ctrl.horizon >= 1,
            "algorithm.kl_ctrl.horizon",
            "must be at least 1",
        );
        c.optim(&self.critic.optim, "critic.optim");
        c.positive(self.critic.grad_clip, "critic.grad_clip");
        c.non_negative(self.critic.cliprange_value, "critic.cliprange_value");
        c.need(
            t.total_training_steps != Some(0),
            "trainer.total_training_steps",
            "must be at least 1 (or null)",
        );
        c.need(
            t.total_epochs >= 1 || t.total_training_steps.is_some(),
            "trainer.total_epochs",
            "must be at least 1 when trainer.total_training_steps is null",
        );
        c.need(
            t.resume_mode != ResumeMode::ResumePath || t.resume_from_path.is_some(),
            "trainer.resume_from_path",
            "must be set when trainer.resume_mode=resume_path",
        );
        c.at_least_1(t.nnodes, "trainer.nnodes");
        c.at_least_1(t.n_gpus_per_node, "trainer.n_gpus_per_node");
    }
}

impl Kind for PpoConfig {
    const KEYS: KeyTables = KEYS;
    const SECTIONS: &'static str =
        "data, actor_rollout_ref, critic, reward_model, custom_reward_function, algorithm, trainer";
    const LINKS: &'static [(&'static str, &'static str)] = LINKS;

    fn check(&self) -> Result<()> {
        self.validate()
    }
}

/// The problems found so far, each as `key: what is wrong`.
#[derive(Default)]
struct Checks(Vec<String>);

impl Checks {
    fn need(&mut self, ok: bool, key: &str, what: &str) {
        if !ok {
            self.0.push(format!("{key}: {what}"));
        }
    }

    fn at_least_1(&mut self, n: usize, key: &str) {
        self.need(n >= 1, key, "must be at least 1");
    }

    fn non_negative(&mut self, x: f64, key: &str) {
        self.need(
            x.is_finite() && x >= 0.0,
            key,
            "must be a finite number >= 0",
        );
    }

    fn positive(&mut self, x: f64, key: &str) {
        self.need(x.is_finite() && x > 0.0, key, "must be a finite number > 0");
    }

    fn unit(&mut self, x: f64, key: &str) {
        self.need((0.0..=1.0).contains(&x), key, "must be in [0, 1]");
    }

    /// verl's `check_mutually_exclusive`: the deprecated global size and the per-GPU one are not both set, and a
    /// set one is at least 1.
    fn micro_batch(
        &mut self,
        section: &str,
        name: &str,
        global: Option<usize>,
        per_gpu: Option<usize>,
    ) {
        self.need(
            global.is_none() || per_gpu.is_none(),
            &format!("{section}.{name}"),
            &format!("set only one of {section}.{name} and {section}.{name}_per_gpu (the latter is verl's)"),
        );
        self.need(
            global != Some(0),
            &format!("{section}.{name}"),
            "must be at least 1 (or null)",
        );
        self.need(
            per_gpu != Some(0),
            &format!("{section}.{name}_per_gpu"),
            "must be at least 1 (or null)",
        );
    }

    fn sampling(
        &mut self,
        section: &str,
        temperature: f64,
        top_p: f64,
        top_k: i64,
        do_sample: bool,
    ) {
        self.non_negative(temperature, &format!("{section}.temperature"));
        self.need(
            !do_sample || temperature > 0.0,
            &format!("{section}.temperature"),
            &format!("must be above 0 when {section}.do_sample is true"),
        );
        self.need(
            top_p > 0.0 && top_p <= 1.0,
            &format!("{section}.top_p"),
            "must be in (0, 1]",
        );
        self.need(
            top_k >= -1,
            &format!("{section}.top_k"),
            "must be -1, 0 (off) or above",
        );
    }

    fn optim(&mut self, o: &OptimConfig, section: &str) {
        self.non_negative(o.lr, &format!("{section}.lr"));
        self.unit(
            o.lr_warmup_steps_ratio,
            &format!("{section}.lr_warmup_steps_ratio"),
        );
        self.non_negative(o.weight_decay, &format!("{section}.weight_decay"));
        for (i, b) in o.betas.iter().enumerate() {
            self.need(
                (0.0..1.0).contains(b),
                &format!("{section}.betas[{i}]"),
                "must be in [0, 1)",
            );
        }
        self.unit(o.min_lr_ratio, &format!("{section}.min_lr_ratio"));
        self.non_negative(o.num_cycles, &format!("{section}.num_cycles"));
    }

    fn finish(self) -> Result<()> {
        if !self.0.is_empty() {
            bail!("invalid config:\n  {}", self.0.join("\n  "));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
