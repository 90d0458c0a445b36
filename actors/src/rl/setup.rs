//! What every GRPO rank builds from verl's `ppo_trainer.yaml` keys ([`PpoConfig`]), on every launch path (one
//! process, torchrun/SLURM ranks, trainer-rank actors of a cluster): the step's settings, the reward, and the one
//! [`GrpoStep`] over a rank's [`RankState`] (its frozen sharded reference, and responses decoded as verl decodes
//! them for the reward).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use ferl_config::PpoConfig;
use ferl_data::SftTokenizer;
use ferl_plugin_bridge::{reward_plugin_for, DataSourceReward, PluginReward};
use ferl_plugin_host::{HotReward, PluginHost, PluginKind};
use ferl_rl::{
    ActorLossConfig, GrpoPrompt, GrpoSettings, GrpoStep, MicroBatching, Reference, Reward,
};
use ferl_trainer::optim::AdamWConfig;

use crate::rank::RankState;

/// The shipped-file key of `custom_reward_function.path`'s plugin in a cluster run: a rank scores with the
/// driver's file, not with whatever its node has at that path.
pub const SHIPPED_REWARD_FILE: &str = "ferl-reward-file";

/// The step's settings from the config; stop and padding tokens from the tokenizer.
pub fn grpo_settings(cfg: &PpoConfig, tok: &SftTokenizer) -> Result<GrpoSettings> {
    let (actor, rollout) = (&cfg.actor_rollout_ref.actor, &cfg.actor_rollout_ref.rollout);
    let micro = actor
        .ppo_micro_batch_size_per_gpu
        .unwrap_or(cfg.data.train_batch_size * rollout.n);
    let reference = &cfg.actor_rollout_ref.reference;
    // Each key sizes its own forward, as in verl: the rollout's the old log-probabilities, the reference's its own;
    // unset, each falls back to the update's micro-batch. With `use_dynamic_bsz` each is a token budget instead.
    let budget = |dynamic: bool, tokens: usize| dynamic.then_some(tokens);
    let log_prob_rows = rollout.log_prob_micro_batch_size_per_gpu.unwrap_or(micro);
    let ref_rows = reference.log_prob_micro_batch_size_per_gpu.unwrap_or(micro);
    Ok(GrpoSettings {
        n: rollout.n,
        temperature: rollout.temperature,
        top_k: rollout.top_k,
        top_p: rollout.top_p,
        seed: cfg.trainer.seed,
        max_response_length: rollout.response_length,
        eos_token_ids: vec![tok.eos_token_id()],
        pad_token_id: tok.pad_token_id(),
        ppo_mini_batch_size: actor.ppo_mini_batch_size,
        ppo_micro_batching: MicroBatching::new(
            micro,
            budget(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu),
        ),
        log_prob_micro_batching: MicroBatching::new(
            log_prob_rows,
            budget(
                rollout.log_prob_use_dynamic_bsz,
                rollout.log_prob_max_token_len_per_gpu,
            ),
        ),
        ref_log_prob_micro_batching: MicroBatching::new(
            ref_rows,
            budget(
                reference.log_prob_use_dynamic_bsz,
                reference.log_prob_max_token_len_per_gpu,
            ),
        ),
        ppo_epochs: actor.ppo_epochs,
        shuffle: actor.shuffle,
        loss: ActorLossConfig::from(actor),
        adv_estimator: cfg.algorithm.adv_estimator,
        norm_adv_by_std_in_grpo: cfg.algorithm.norm_adv_by_std_in_grpo,
        lr: actor.optim.lr,
        optim: AdamWConfig {
            betas: (actor.optim.betas[0], actor.optim.betas[1]),
            eps: 1e-8,
            weight_decay: actor.optim.weight_decay,
        },
        grad_clip: actor.grad_clip,
    })
}

/// The data sources of `prompts` (verl's `data_source` column), which the `naive` reward manager scores by.
pub fn data_sources(prompts: &[GrpoPrompt]) -> BTreeSet<String> {
    prompts
        .iter()
        .map(|p| p.extra["data_source"].as_str().unwrap_or("").to_string())
        .collect()
}

/// The reward: `custom_reward_function.path` (a reward plugin file, loaded into a host of its own; when
/// `custom_reward_function.name` is changed from verl's `compute_score` it must be the plugin's name), else verl's
/// `naive` manager over the data sources `sources`, each scored by ferl's first-party plugin for it (found in
/// `host`).
pub fn reward(
    cfg: &PpoConfig,
    host: impl FnOnce() -> Result<Arc<PluginHost>>,
    sources: &BTreeSet<String>,
) -> Result<Box<dyn Reward>> {
    match &cfg.custom_reward_function.path {
        Some(path) => custom_reward(cfg, path, &ferl_data::expand_path(path)),
        None => naive_reward(host()?, sources),
    }
}

/// The reward plugin in `file` (`path` as the config gives it, for messages).
fn custom_reward(cfg: &PpoConfig, path: &str, file: &std::path::Path) -> Result<Box<dyn Reward>> {
    let key = || format!("custom_reward_function.path={path}");
    let copies = std::env::temp_dir()
        .join("ferl-plugin-copies")
        .join(format!("{}-custom", std::process::id()));
    let host = Arc::new(PluginHost::new(copies));
    let plugin = host
        .load_file(file, Some(PluginKind::Reward))
        .with_context(key)?;
    let name = plugin.info().name.clone();
    let wanted = &cfg.custom_reward_function.name;
    if wanted != "compute_score" && wanted != &name {
        bail!("custom_reward_function.name={wanted}: {path} holds reward plugin `{name}`");
    }
    let reward = HotReward::new(host, &name, "").with_context(key)?;
    Ok(Box::new(PluginReward::new(Box::new(reward))))
}

/// verl's `naive` manager: each data source scored by its first-party reward plugin.
fn naive_reward(host: Arc<PluginHost>, sources: &BTreeSet<String>) -> Result<Box<dyn Reward>> {
    let mut rewards = BTreeMap::new();
    for source in sources {
        let Some(plugin) = reward_plugin_for(source) else {
            bail!(
                "data_source `{source}` has no built-in reward: set custom_reward_function.path to a reward plugin"
            );
        };
        let r = HotReward::new(host.clone(), plugin, "")
            .with_context(|| format!("the reward of data_source `{source}`"))?;
        rewards.insert(source.clone(), PluginReward::new(Box::new(r)));
    }
    Ok(Box::new(DataSourceReward::new(rewards)))
}

/// The first-party reward plugins the `naive` manager scores `sources` with (what a cluster run ships to its ranks).
pub fn naive_reward_plugins(sources: &BTreeSet<String>) -> Vec<String> {
    let names: BTreeSet<&str> = sources
        .iter()
        .filter_map(|s| reward_plugin_for(s))
        .collect();
    names.into_iter().map(str::to_string).collect()
}

/// The reward of a trainer-rank actor: the custom reward file the driver shipped (see [`SHIPPED_REWARD_FILE`]), else
/// as [`reward`] builds it in `host` (the plugins shipped to this worker, or its node's own).
pub fn rank_reward(
    cfg: &PpoConfig,
    host: Option<Arc<PluginHost>>,
    sources: &BTreeSet<String>,
) -> Result<Box<dyn Reward>> {
    let shipped = ferl_runtime::shipped_files()?
        .into_iter()
        .find_map(|(k, p)| (k == SHIPPED_REWARD_FILE).then_some(p));
    if let (Some(path), Some(file)) = (&cfg.custom_reward_function.path, shipped) {
        return custom_reward(cfg, path, &file);
    }
    let host = || host.context("no plugin host on this worker for the data sources' rewards");
    reward(cfg, host, sources)
}

/// The tokenizer of the run: `data.tokenizer`, else the model folder's.
pub fn tokenizer(cfg: &PpoConfig, model_dir: &std::path::Path) -> Result<SftTokenizer> {
    let tok_dir = cfg.data.tokenizer.as_deref().map(PathBuf::from);
    SftTokenizer::from_dir(tok_dir.as_deref().unwrap_or(model_dir), None)
}

/// The one GRPO step of a rank over `state`: with a KL loss, its reference is sharded like the policy and frozen
/// (no gradients, no optimizer state, no whole copy); the reward sees responses decoded as verl decodes them
/// (special tokens, such as the EOS that ends a response, skipped).
pub fn grpo_step(
    settings: GrpoSettings,
    state: &RankState,
    tok: Arc<SftTokenizer>,
    reward: Box<dyn Reward>,
) -> Result<GrpoStep> {
    // With LoRA the reference is the policy's base model, its adapters off (verl's): no second copy.
    let reference = match (settings.loss.use_kl_loss, state.has_lora()) {
        (false, _) => None,
        (true, true) => Some(Reference::PolicyBase),
        (true, false) => Some(Reference::Frozen(Box::new(state.frozen_reference()?))),
    };
    let mut step = GrpoStep::with_reference(settings, reference, reward)?;
    step.set_decoder(Box::new(move |ids| {
        tok.decode_skip_special(ids).unwrap_or_default()
    }));
    Ok(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings_of(overrides: &[&str]) -> GrpoSettings {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        let cfg = PpoConfig::load(None, &o).unwrap();
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tokenizers/qwen3");
        let tok = SftTokenizer::from_dir(&dir, None).unwrap();
        grpo_settings(&cfg, &tok).unwrap()
    }

    #[test]
    fn the_rollout_and_reference_log_prob_micro_batches_are_each_their_own_key() {
        let base = [
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        ];
        let both = [
            &base[..],
            &[
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            ],
        ]
        .concat();
        let s = settings_of(&both);
        assert_eq!(
            (s.log_prob_micro_batching, s.ref_log_prob_micro_batching),
            (MicroBatching::Rows(4), MicroBatching::Rows(2))
        );
        let ref_only = [
            &base[..],
            &["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"],
        ]
        .concat();
        let s = settings_of(&ref_only);
        assert_eq!(
            (s.log_prob_micro_batching, s.ref_log_prob_micro_batching),
            (MicroBatching::Rows(8), MicroBatching::Rows(2))
        );
        let s = settings_of(&base);
        assert_eq!(
            (s.log_prob_micro_batching, s.ref_log_prob_micro_batching),
            (MicroBatching::Rows(8), MicroBatching::Rows(8))
        );
    }

    #[test]
    fn use_dynamic_bsz_makes_each_forward_a_token_budget_following_the_actors_keys() {
        let s = settings_of(&[
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=300",
        ]);
        let budgets = [
            s.ppo_micro_batching,
            s.log_prob_micro_batching,
            s.ref_log_prob_micro_batching,
        ];
        assert_eq!(budgets, [MicroBatching::Tokens(300); 3]);
        let s = settings_of(&[
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=500",
        ]);
        assert_eq!(s.log_prob_micro_batching, MicroBatching::Tokens(500));
        assert_eq!(s.ref_log_prob_micro_batching, MicroBatching::Rows(2));
    }
}
