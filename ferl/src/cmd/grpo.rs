//! `ferl grpo`: GRPO (or RLOO) with verl's `ppo_trainer.yaml` keys, in one process with the rollout colocated with
//! the actor (its weights are re-snapshotted after every update). Each step takes `data.train_batch_size` prompts of
//! `data.train_files` (reshuffled every epoch with `data.seed`, else `trainer.seed`), generates
//! `actor_rollout_ref.rollout.n` responses to each, scores them with the reward, and updates the policy
//! ([`ferl_trainer::rl::GrpoTrainer`]). Metrics carry verl's names; `trainer.save_freq` writes
//! `global_step_N/` folders under `trainer.default_local_dir`, and `trainer.resume_mode=auto` resumes from the newest.

mod setup;

use anyhow::{Context, Result};
use clap::Args;
use ferl_data::SftTokenizer;
use ferl_trainer::checkpoint::{latest_step, step_dir, write_atomic, LATEST_FILE};
use ferl_trainer::config::PpoConfig;
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::metrics::{config_params, LoggerContext, LoggerRegistry, MetricsLogger};
use ferl_trainer::params::LocalParams;
use ferl_trainer::rl::{GrpoPrompt, GrpoTrainer};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tch::Kind;

/// Arguments of `ferl grpo`.
#[derive(Args, Debug)]
pub(crate) struct GrpoArgs {
    /// The config file, overrides and `--cfg job`.
    #[command(flatten)]
    pub config: super::ConfigArgs,
}

/// Loads the config, checks it, and trains.
pub(crate) fn run(args: GrpoArgs) -> Result<()> {
    let c = &args.config;
    let cfg = PpoConfig::load(c.config.as_deref(), &c.overrides)?;
    if c.print_job(|| cfg.to_yaml())? {
        return Ok(());
    }
    // One plugin host for the run: its logger plugins are `trainer.logger` kinds (as for `ferl sft`), its reward
    // plugins score when no `custom_reward_function.path` is given.
    let host = plugin_host()?;
    let registry = ferl_actors::metrics::logger_registry(Some(&host));
    cfg.validate_supported(&setup::supported(&registry.names()))?;
    setup::check_values(&cfg)?;
    let (model_dir, _exported) = setup::model_dir(&cfg)?;
    let tok_dir = cfg.data.tokenizer.as_deref().map(PathBuf::from);
    let tok = Arc::new(SftTokenizer::from_dir(
        tok_dir.as_deref().unwrap_or(&model_dir),
        None,
    )?);
    let prompts = setup::prompts(&cfg, &tok)?;
    let reward = setup::reward(&cfg, || Ok(Arc::clone(&host)), &prompts)?;
    let mut trainer = build_trainer(&cfg, &model_dir, &tok, reward)?;
    let run_dir = ferl_data::expand_path(&cfg.trainer.default_local_dir);
    if cfg.trainer.resume_mode == ferl_trainer::config::ResumeMode::Auto {
        resume(&mut trainer, &run_dir)?;
    }
    let fresh = !run_dir.exists();
    let trained = train(&cfg, &mut trainer, &prompts, &run_dir, &registry);
    if trained.is_err() && fresh && trainer.global_step() == 0 {
        // A run that made the folder and failed in its first step (a reward scoring NaN, say) leaves nothing.
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    trained
}

/// The policy (fp32, on the CPU) from the model folder, with its reward and tokenizer.
fn build_trainer(
    cfg: &PpoConfig,
    model_dir: &Path,
    tok: &Arc<SftTokenizer>,
    reward: Box<dyn ferl_trainer::rl::Reward>,
) -> Result<GrpoTrainer<LocalParams>> {
    let settings = setup::settings(cfg, tok)?;
    let loaded = ferl_trainer::model::load_model(model_dir)?;
    let store = LocalParams::new(loaded.layout, loaded.params, Kind::Float);
    let opts = EngineOptions {
        gradient_checkpointing: cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
        ..Default::default()
    };
    let engine = Engine::new(loaded.config, store, Kind::Float, opts);
    let mut trainer = GrpoTrainer::new(settings, engine, reward)?;
    let decoder = Arc::clone(tok);
    // As verl hands responses to its reward functions: special tokens (the EOS that ends a response) skipped.
    trainer.set_decoder(Box::new(move |ids| {
        decoder.decode_skip_special(ids).unwrap_or_default()
    }));
    Ok(trainer)
}

/// The run's plugin host (logger plugins, and rewards when no `custom_reward_function.path` is given): the
/// first-party plugins beside this binary and `$FERL_PLUGIN_PATH`.
fn plugin_host() -> Result<Arc<ferl_plugin_host::PluginHost>> {
    match ferl_actors::plugins::actor_plugin_host()? {
        Some(host) => Ok(host),
        None => {
            let dir = std::env::temp_dir()
                .join("ferl-plugin-copies")
                .join(std::process::id().to_string());
            Ok(Arc::new(ferl_plugin_host::PluginHost::new(dir)))
        }
    }
}

/// Restores the newest `global_step_N/` of `run_dir`, if any.
fn resume(trainer: &mut GrpoTrainer<LocalParams>, run_dir: &Path) -> Result<()> {
    let Some(step) = latest_step(run_dir)? else {
        return Ok(());
    };
    let dir = step_dir(run_dir, step);
    trainer
        .load(&dir)
        .with_context(|| format!("resuming from {}", dir.display()))?;
    eprintln!("resumed from {} (step {step})", dir.display());
    Ok(())
}

/// Steps until `trainer.total_training_steps` (else `trainer.total_epochs` epochs of whole batches).
fn train(
    cfg: &PpoConfig,
    trainer: &mut GrpoTrainer<LocalParams>,
    prompts: &[GrpoPrompt],
    run_dir: &Path,
    registry: &LoggerRegistry,
) -> Result<()> {
    let batch = cfg.data.train_batch_size;
    let per_epoch = (prompts.len() / batch) as u64;
    let total = cfg
        .trainer
        .total_training_steps
        .map(|s| s as u64)
        .unwrap_or(per_epoch * cfg.trainer.total_epochs as u64);
    let progress = ferl_data::Progress::new("training", "steps", total);
    progress.set_position(trainer.global_step());
    let mut loggers = loggers(cfg, run_dir, &progress, registry)?;
    while trainer.global_step() < total {
        let step = trainer.global_step();
        let order = epoch_order(cfg, prompts.len(), step / per_epoch);
        let at = (step % per_epoch) as usize * batch;
        let chosen: Vec<GrpoPrompt> = order[at..at + batch]
            .iter()
            .map(|&i| prompts[i].clone())
            .collect();
        let out = trainer.step(&chosen)?;
        let metrics: Vec<(String, f64)> = out.metrics.into_iter().collect();
        for l in loggers.iter_mut() {
            l.log(out.step as i64, &metrics)?;
        }
        progress.set_position(out.step);
        let save = cfg.trainer.save_freq > 0 && out.step % cfg.trainer.save_freq as u64 == 0;
        if save || (cfg.trainer.save_freq > 0 && out.step == total) {
            save_step(trainer, run_dir, out.step)?;
        }
    }
    progress.finish();
    for l in loggers.iter_mut() {
        l.finish()?;
    }
    Ok(())
}

/// The prompt order of epoch `epoch`: shuffled with the data seed when `data.shuffle`, else as read.
fn epoch_order(cfg: &PpoConfig, n: usize, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if cfg.data.shuffle {
        let seed = cfg.data.seed.unwrap_or(cfg.trainer.seed);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch));
        order.shuffle(&mut rng);
    }
    order
}

/// `trainer.logger`'s loggers from `registry`, writing under `run_dir` (the console's lines printed through
/// `progress`).
fn loggers(
    cfg: &PpoConfig,
    run_dir: &Path,
    progress: &ferl_data::Progress,
    registry: &LoggerRegistry,
) -> Result<Vec<Box<dyn MetricsLogger>>> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let ctx = LoggerContext {
        run_dir: run_dir.to_path_buf(),
        project: cfg.trainer.project_name.clone(),
        experiment: cfg.trainer.experiment_name.clone(),
        progress: Some(progress.clone()),
        params: config_params(cfg),
    };
    let names: Vec<String> = cfg.trainer.logger.as_slice().to_vec();
    registry.build(&names, &ctx)
}

/// Writes `global_step_N/` and then points [`LATEST_FILE`] at it, atomically (a temporary file renamed over it,
/// with the writer SFT's checkpoints use): a crash never leaves a half-written pointer.
fn save_step(trainer: &mut GrpoTrainer<LocalParams>, run_dir: &Path, step: u64) -> Result<()> {
    let dir = step_dir(run_dir, step);
    trainer.save(&dir)?;
    write_atomic(&run_dir.join(LATEST_FILE), step.to_string().as_bytes())
}
