//! What the process that starts `ferl grpo` checks and builds from a [`PpoConfig`] before its first step: the keys it
//! honours (the config gate), the values and world sizes it can run, the model folder, the actor's view of the
//! config and the prompts of `data.train_files`. What every rank builds (settings, reward, the step) is
//! [`ferl_actors::rl::setup`].

use anyhow::{bail, Context, Result};
use ferl_data::SftTokenizer;
use ferl_fsdp::checkpoint::LoraExport;
use ferl_rl::{
    AdvEstimator, GrpoPrompt, KlPenalty, LossAggMode, AGG_MODES, KL_PENALTIES, OUTCOME_ESTIMATORS,
};
use ferl_trainer::config::{PpoConfig, SftConfig, Supported};
use serde_json::Value;
use std::path::{Path, PathBuf};
use tch::Kind;

/// The keys `ferl grpo` honours with any value.
const HONOURED: &[&str] = &[
    "data.train_files",
    "data.prompt_key",
    "data.reward_fn_key",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.train_batch_size",
    "data.shuffle",
    "data.seed",
    "data.filter_overlong_prompts",
    "data.tokenizer",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora_alpha",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.model.exclude_modules",
    "actor_rollout_ref.model.lora_adapter_path",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.shuffle",
    "actor_rollout_ref.actor.grad_clip",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.betas",
    "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
    "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "actor_rollout_ref.actor.optim.min_lr_ratio",
    "actor_rollout_ref.actor.optim.num_cycles",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_restarts",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "algorithm.norm_adv_by_std_in_grpo",
    "custom_reward_function.path",
    "custom_reward_function.name",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.save_freq",
    "trainer.default_local_dir",
    "trainer.rollout_data_dir",
    "trainer.seed",
];

/// The config gate of `ferl grpo`: what it honours, and with which values where only some are; `loggers` are the
/// logger kinds `trainer.logger` may name (the built-in ones and the loaded logger plugins, as for `ferl sft`).
pub(crate) fn supported(loggers: &[String]) -> Supported {
    let loggers: Vec<&str> = loggers.iter().map(String::as_str).collect();
    Supported::new()
        .keys(HONOURED)
        .values(
            "actor_rollout_ref.actor.loss_agg_mode",
            &AGG_MODES.map(LossAggMode::as_str),
        )
        .values(
            "actor_rollout_ref.actor.kl_loss_type",
            &KL_PENALTIES.map(KlPenalty::as_str),
        )
        .values("actor_rollout_ref.rollout.name", &["ferl"])
        .values("actor_rollout_ref.rollout.do_sample", &["true"])
        // ferl's rollout holds the whole model on each rank: no tensor-parallel generation.
        .values(
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            &["1"],
        )
        .values(
            "algorithm.adv_estimator",
            &OUTCOME_ESTIMATORS.map(AdvEstimator::as_str),
        )
        .values("reward_model.reward_manager", &["naive"])
        .values("trainer.logger", &loggers)
        .values("trainer.device", &["cpu"])
        .values("trainer.resume_mode", &["auto", "disable"])
        .values("trainer.nnodes", &["1"])
        .values("trainer.n_gpus_per_node", &["1"])
        // No validation pass and no critic: only the settings that say so are accepted.
        .values("trainer.val_before_train", &["false"])
        .values("critic.enable", &["false"])
}

/// The prompts of `data.train_files` (verl's RL parquet: `prompt` messages, `reward_model.ground_truth`,
/// `data_source`, `extra_info`), rendered with the chat template and its generation prompt. A prompt longer than
/// `data.max_prompt_length` is skipped with `data.filter_overlong_prompts`, else refused naming its row.
pub(crate) fn prompts(cfg: &PpoConfig, tok: &SftTokenizer) -> Result<Vec<GrpoPrompt>> {
    let mut out = Vec::new();
    let mut skipped = 0;
    for file in cfg.data.train_files.as_slice() {
        let path = ferl_data::expand_path(file);
        let rows = ferl_data::read::read_rows(&path, None)
            .with_context(|| format!("data.train_files: {}", path.display()))?;
        for (i, row) in rows.iter().enumerate() {
            let at = || format!("{} row {i}", path.display());
            let p = prompt(cfg, tok, row).with_context(at)?;
            if p.ids.len() > cfg.data.max_prompt_length {
                if cfg.data.filter_overlong_prompts {
                    skipped += 1;
                    continue;
                }
                bail!(
                    "{}: the prompt has {} tokens, over data.max_prompt_length={} (set data.filter_overlong_prompts=true to skip such rows)",
                    at(), p.ids.len(), cfg.data.max_prompt_length
                );
            }
            out.push(p);
        }
    }
    if skipped > 0 {
        eprintln!("skipped {skipped} prompts over data.max_prompt_length");
    }
    if out.len() < cfg.data.train_batch_size {
        bail!(
            "data.train_files holds {} usable prompts, fewer than data.train_batch_size={}",
            out.len(),
            cfg.data.train_batch_size
        );
    }
    Ok(out)
}

/// One row as a prompt.
fn prompt(cfg: &PpoConfig, tok: &SftTokenizer, row: &Value) -> Result<GrpoPrompt> {
    let (text, ids) =
        super::super::generate::chat_prompt(tok, row, &cfg.data.prompt_key, "data.prompt_key")?;
    let ground_truth = match row.pointer("/reward_model/ground_truth") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    };
    let source_key = &cfg.data.reward_fn_key;
    let extra = serde_json::json!({
        "data_source": row.get(source_key).cloned().unwrap_or(Value::Null),
        "extra_info": row.get("extra_info").cloned().unwrap_or(Value::Null),
    });
    Ok(GrpoPrompt {
        ids,
        text,
        ground_truth,
        extra,
    })
}

/// The actor's training as the trainer ranks run it: the [`SftConfig`] of the same model, sharding, optimizer,
/// schedule and run (verl's actor keys mapped onto the SFT keys that mean the same), so the policy trains on the
/// rank state, checkpoint format and run loop of `ferl sft`. `model_dir` is the resolved model folder.
pub(crate) fn actor_view(cfg: &PpoConfig, model_dir: &Path) -> SftConfig {
    let (actor, model) = (&cfg.actor_rollout_ref.actor, &cfg.actor_rollout_ref.model);
    let mut view = SftConfig::default();
    view.data.train_batch_size = cfg.data.train_batch_size;
    view.data.micro_batch_size_per_gpu = actor
        .ppo_micro_batch_size_per_gpu
        .unwrap_or(cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n);
    view.data.shuffle = cfg.data.shuffle;
    // Every forward of the policy and its reference packs its rows without padding, as verl's remove-padding does.
    view.use_remove_padding = model.use_remove_padding;
    // Ulysses: groups of this many consecutive ranks split every forward's sequences (the reference's too).
    view.ulysses_sequence_parallel_size = actor.ulysses_sequence_parallel_size;
    let m = &mut view.model;
    m.partial_pretrain = model_dir.display().to_string();
    m.enable_gradient_checkpointing = model.enable_gradient_checkpointing;
    // LoRA trains adapters over the frozen base; the reference is then the base with the adapters off.
    m.lora_rank = model.lora_rank;
    m.lora_alpha = model.lora_alpha;
    m.target_modules = model.target_modules.clone();
    m.exclude_modules = model.exclude_modules.clone().unwrap_or_default();
    m.lora_adapter_path = model.lora_adapter_path.clone();
    m.strategy = actor.strategy;
    m.fsdp_config.wrap_policy = actor.fsdp_config.wrap_policy.clone();
    m.fsdp_config.reshard_after_forward = actor.fsdp_config.reshard_after_forward;
    m.fsdp_config.fsdp_size = actor.fsdp_config.fsdp_size;
    m.fsdp_config.mixed_precision = None;
    let (o, a) = (&mut view.optim, &actor.optim);
    o.lr = a.lr;
    o.lr_warmup_steps_ratio = a.lr_warmup_steps_ratio;
    o.lr_warmup_steps = a.lr_warmup_steps;
    o.weight_decay = a.weight_decay;
    o.betas = a.betas;
    o.clip_grad = actor.grad_clip;
    o.min_lr_ratio = a.min_lr_ratio;
    o.num_cycles = a.num_cycles;
    o.lr_scheduler = a.lr_scheduler_type;
    let (t, p) = (&mut view.trainer, &cfg.trainer);
    t.default_local_dir = p.default_local_dir.clone();
    t.project_name = p.project_name.clone();
    t.experiment_name = p.experiment_name.clone();
    t.total_epochs = p.total_epochs;
    t.total_training_steps = p.total_training_steps;
    t.logger = p.logger.clone();
    // verl shuffles the prompts with `data.seed`; ferl's `trainer.seed` when it is unset.
    t.seed = cfg.data.seed.unwrap_or(p.seed);
    t.save_freq = p.save_freq;
    t.test_freq = -1;
    t.max_ckpt_to_keep = p.max_actor_ckpt_to_keep;
    t.resume_mode = p.resume_mode;
    t.resume_from_path = p.resume_from_path.clone();
    t.device = p.device.clone();
    t.max_restarts = p.max_restarts;
    view
}

/// What `world` data-parallel ranks need of the batch keys, refused by key before anything is loaded: every
/// rank takes an even share of each step's rows and of each mini-batch, and `fsdp_size` groups the ranks.
pub(crate) fn check_world(cfg: &PpoConfig, world: usize) -> Result<()> {
    let n = cfg.actor_rollout_ref.rollout.n;
    let actor = &cfg.actor_rollout_ref.actor;
    let rows = [
        ("data.train_batch_size", cfg.data.train_batch_size),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            actor.ppo_mini_batch_size,
        ),
    ];
    for (key, prompts) in rows {
        if !(prompts * n).is_multiple_of(world) {
            bail!(
                "{key}={prompts} × actor_rollout_ref.rollout.n={n} = {} rows cannot be split evenly over {world} ranks",
                prompts * n
            );
        }
    }
    let sp = actor.ulysses_sequence_parallel_size;
    if !world.is_multiple_of(sp) {
        bail!(
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} must divide the run's {world} ranks (each \
             group of {sp} consecutive ranks splits every sequence)"
        );
    }
    let size = actor.fsdp_config.fsdp_size;
    if !(size == -1 || size == 1 || (size > 1 && world.is_multiple_of(size as usize))) {
        bail!(
            "actor_rollout_ref.actor.fsdp_config.fsdp_size={size} must divide the run's {world} ranks (HSDP shards \
             within groups of fsdp_size ranks; -1 shards over all of them)"
        );
    }
    Ok(())
}

/// Values `ferl grpo` cannot run even where they are verl's defaults (an unchanged key passes the gate).
pub(crate) fn check_values(cfg: &PpoConfig) -> Result<()> {
    let estimator = cfg.algorithm.adv_estimator;
    if !OUTCOME_ESTIMATORS.contains(&estimator) {
        bail!(
            "algorithm.adv_estimator={estimator}: ferl grpo runs `grpo` or `rloo` (critic-free estimators); set algorithm.adv_estimator=grpo"
        );
    }
    let rollout = &cfg.actor_rollout_ref.rollout;
    if rollout.name != "ferl" {
        bail!(
            "actor_rollout_ref.rollout.name={}: ferl generates with its own engine (`ferl`)",
            rollout.name
        );
    }
    if !rollout.do_sample {
        bail!("actor_rollout_ref.rollout.do_sample=false: GRPO compares sampled responses; keep it true");
    }
    check_token_budgets(cfg)?;
    let (actor_sp, ref_sp) = (
        cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size,
        cfg.actor_rollout_ref
            .reference
            .ulysses_sequence_parallel_size,
    );
    if ref_sp != actor_sp {
        bail!(
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size={ref_sp}: the reference is sharded over the policy's \
             ranks and splits its sequences as the actor does; leave it following \
             actor_rollout_ref.actor.ulysses_sequence_parallel_size={actor_sp}"
        );
    }
    if cfg.trainer.device != "cpu" {
        bail!(
            "trainer.device={}: ferl grpo trains on the CPU for now (its CUDA path is not built yet); set trainer.device=cpu",
            cfg.trainer.device
        );
    }
    Ok(())
}

/// With `use_dynamic_bsz`, each forward's token budget must hold one row of the longest kind (a prompt of
/// `data.max_prompt_length` and a response of `rollout.response_length` tokens).
fn check_token_budgets(cfg: &PpoConfig) -> Result<()> {
    let (actor, rollout, reference) = (
        &cfg.actor_rollout_ref.actor,
        &cfg.actor_rollout_ref.rollout,
        &cfg.actor_rollout_ref.reference,
    );
    let longest = cfg.data.max_prompt_length + rollout.response_length;
    let budgets = [
        (
            actor.use_dynamic_bsz,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            actor.ppo_max_token_len_per_gpu,
        ),
        (
            rollout.log_prob_use_dynamic_bsz,
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            rollout.log_prob_max_token_len_per_gpu,
        ),
        (
            reference.log_prob_use_dynamic_bsz,
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            reference.log_prob_max_token_len_per_gpu,
        ),
    ];
    for (dynamic, key, budget) in budgets {
        if dynamic && budget < longest {
            bail!(
                "{key}={budget}: a micro-batch must hold one row of up to data.max_prompt_length + \
                 actor_rollout_ref.rollout.response_length = {longest} tokens (use_dynamic_bsz is on)"
            );
        }
    }
    Ok(())
}

/// The keys that must fit the model in `model_dir`, checked before a rank is started:
/// - LoRA's (`actor_rollout_ref.model.lora_rank`, `lora_alpha`, `target_modules`, `exclude_modules`,
///   `lora_adapter_path`): an adapter folder that contradicts the keys, or modules that match none of the model's
///   projections, are refused by key;
/// - `actor_rollout_ref.actor.ulysses_sequence_parallel_size`, whose groups split the model's attention heads.
pub(crate) fn check_model_keys(view: &SftConfig, model_dir: &Path) -> Result<()> {
    let file = model_dir.join("config.json");
    let config = ferl_trainer::model::config::ModelConfig::from_file(&file)
        .with_context(|| format!("actor_rollout_ref.model.path: {}", file.display()))?;
    let sp = view.ulysses_sequence_parallel_size as i64;
    ferl_trainer::model::ulysses::check_heads(sp, config.num_heads, config.num_kv_heads)
        .context("actor_rollout_ref.actor.ulysses_sequence_parallel_size")?;
    let key = "actor_rollout_ref.model (LoRA keys)";
    if let Some((spec, _)) = ferl_trainer::run::gate::lora_of(view).context(key)? {
        spec.projections(config.num_layers).context(key)?;
    }
    Ok(())
}

/// The policy's starting weights as a Hugging Face folder: `actor_rollout_ref.model.path` itself (a folder or Hub
/// id), or, for a sharded `ferl sft` checkpoint (`global_step_N/` with `fsdp_meta.json`), its model exported into a
/// temporary folder (kept alive by the returned guard) with the tokenizer files of `data.tokenizer`.
pub(crate) fn model_dir(cfg: &PpoConfig) -> Result<(PathBuf, Option<tempfile::TempDir>)> {
    let spec = &cfg.actor_rollout_ref.model.path;
    let key = || format!("actor_rollout_ref.model.path={spec}");
    let given = ferl_data::expand_path(spec);
    if given.join("fsdp_meta.json").is_file() {
        let Some(tok) = cfg.data.tokenizer.as_deref() else {
            bail!("{}: an SFT checkpoint holds no tokenizer; set data.tokenizer to the folder of the model the SFT run started from", key());
        };
        ferl_trainer::checkpoint::verify(&given).with_context(key)?;
        let tmp = tempfile::tempdir()?;
        let side = [Path::new(tok)];
        ferl_fsdp::checkpoint::export_sharded(
            &given,
            tmp.path(),
            Kind::Float,
            &side,
            LoraExport::Merge,
        )
        .with_context(key)?;
        return Ok((tmp.path().to_path_buf(), Some(tmp)));
    }
    let dir = ferl_trainer::model::hub::resolve_model(spec).with_context(key)?;
    if !dir.join("config.json").exists() {
        bail!("{}: no config.json in {}", key(), dir.display());
    }
    Ok((dir, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// verl's `use_remove_padding`, under either of its names, reaches the ranks' view of the config, whose
    /// engines then pack every forward's rows (`ferl_actors::rank`'s `engine_options`).
    #[test]
    fn remove_padding_reaches_the_actor_view_under_either_name() {
        for key in [
            "actor_rollout_ref.model.use_remove_padding",
            "actor_rollout_ref.actor.use_remove_padding",
        ] {
            let cfg = PpoConfig::load(None, &[format!("{key}=true")]).unwrap();
            assert!(actor_view(&cfg, Path::new("m")).use_remove_padding, "{key}");
        }
        let cfg = PpoConfig::load(None, &[]).unwrap();
        assert!(!actor_view(&cfg, Path::new("m")).use_remove_padding);
    }
}
