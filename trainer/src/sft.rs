//! The SFT run: config → model, data, optimizer → epochs of steps with validation, checkpoints, resume, metrics and
//! a progress bar. Single process; the distributed launcher drives the same pieces per rank.

use crate::batch::{Layout, SampleRef};
use crate::checkpoint::{self, CheckpointContents, TrainerState};
use crate::engine::{Engine, EngineOptions};
use crate::metrics::{LoggerContext, LoggerRegistry};
use crate::model::load_model;
use crate::optim::{AdamW, AdamWConfig, LrSchedule};
use crate::params::LocalParams;
use crate::step::Stepper;
use anyhow::{bail, Context, Result};
use ferl_config::{expand_path, Dtype, LrScheduler, ResumeMode, SftConfig, Supported};
use ferl_data::{epoch_order, global_batch, steps_per_epoch, SftDataset};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{Device, Kind};

/// The config keys the single-process engine honours; every other key a user changes is refused up front.
pub fn supported_keys() -> Supported {
    Supported::new()
        .keys(&[
            "data.train_batch_size",
            "data.micro_batch_size",
            "data.micro_batch_size_per_gpu",
            "data.train_files",
            "data.val_files",
            "data.train_max_samples",
            "data.val_max_samples",
            "data.prompt_key",
            "data.response_key",
            "data.prompt_dict_keys",
            "data.response_dict_keys",
            "data.multiturn.*",
            "data.max_length",
            "data.truncation",
            "data.balance_dp_token",
            "data.chat_template",
            "data.use_shm",
            "data.apply_chat_template_kwargs.*",
            "data.apply_chat_template_kwargs",
            "data.shuffle",
            "data.plugin",
            "data.plugin_options",
            "data.plugin_options.*",
            "model.partial_pretrain",
            "model.use_shm",
            "model.enable_gradient_checkpointing",
            "model.strategy",
            "model.fsdp_config.model_dtype",
            "model.fsdp_config.mixed_precision",
            "model.fsdp_config.mixed_precision.*",
            "model.fsdp_config.wrap_policy.*",
            "model.fsdp_config.reshard_after_forward",
            "model.fsdp_config.forward_prefetch",
            "optim.lr",
            "optim.lr_warmup_steps_ratio",
            "optim.lr_warmup_steps",
            "optim.weight_decay",
            "optim.betas",
            "optim.clip_grad",
            "optim.min_lr_ratio",
            "optim.num_cycles",
            "optim.lr_scheduler",
            "optim.optimizer_impl",
            "trainer.default_local_dir",
            "trainer.project_name",
            "trainer.experiment_name",
            "trainer.total_epochs",
            "trainer.total_training_steps",
            "trainer.seed",
            "trainer.save_freq",
            "trainer.test_freq",
            "trainer.max_ckpt_to_keep",
            "trainer.resume_mode",
            "trainer.resume_from_path",
            "trainer.checkpoint.*",
            "use_remove_padding",
        ])
        .values("optim.optimizer", &["AdamW"])
        .values("model.lora_rank", &["0"])
        .values("model.use_liger", &["false", "true"])
        .values("model.fsdp_config.fsdp_size", &["-1", "1"])
        .values("trainer.nnodes", &["1"])
        .values("trainer.n_gpus_per_node", &["1"])
        .values("trainer.device", &["cpu", "cuda"])
        .values("trainer.logger", &["console", "jsonl"])
        .values("ulysses_sequence_parallel_size", &["1"])
}

/// Knobs of a run that are not config keys.
pub struct RunOptions {
    /// Stop after this many steps of this run (simulates an interruption in tests); `None` runs to the end.
    pub stop_after_steps: Option<i64>,
    /// Draw the progress bar (it also hides itself when stderr is not a terminal).
    pub progress: bool,
    /// Logger kinds `trainer.logger` may name.
    pub loggers: LoggerRegistry,
    /// The op overrides `model.use_liger=true` turns on (the `liger` kernel plugin's RMSNorm, SwiGLU and fused
    /// linear + cross-entropy, from `ferl-plugin-bridge`); ignored when it is false.
    pub kernels: crate::kernels::KernelRegistry,
    /// Called after every training step, before the loggers (e.g. the plugin host's step boundary).
    pub on_step_end: Option<Box<dyn FnMut(i64) + Send>>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            stop_after_steps: None,
            progress: true,
            loggers: LoggerRegistry::default(),
            kernels: crate::kernels::KernelRegistry::builtin(),
            on_step_end: None,
        }
    }
}

/// What a run did.
#[derive(Debug, Default)]
pub struct RunSummary {
    /// (step, train loss) of every step this run trained.
    pub train_losses: Vec<(i64, f64)>,
    /// (step, validation loss) of every validation.
    pub val_losses: Vec<(i64, f64)>,
    /// Steps completed at the end (including resumed ones).
    pub global_step: i64,
    /// The newest checkpoint written.
    pub last_checkpoint: Option<PathBuf>,
}

/// Whether torch sees a CUDA device. Loads libtorch_cuda first: the linker's `--as-needed` drops it from our
/// binaries (nothing references it by symbol), and without it torch reports no CUDA at all.
pub fn cuda_is_available() -> bool {
    if let Err(e) = ferl_collective::load_torch_cuda() {
        tracing::debug!("{e:#}");
        return false;
    }
    tch::Cuda::is_available()
}

/// The device `trainer.device` names.
pub fn device_of(cfg: &SftConfig) -> Result<Device> {
    match cfg.trainer.device.as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" if cuda_is_available() => Ok(Device::Cuda(0)),
        "cuda" => {
            bail!("trainer.device=cuda but no CUDA device is visible; set trainer.device=cpu")
        }
        other => bail!("trainer.device: `{other}` is not supported (cpu, cuda)"),
    }
}

/// The dtype stages compute in: `mixed_precision.param_dtype` if set, else `model_dtype`.
pub fn compute_kind(cfg: &SftConfig) -> Result<Kind> {
    let fc = &cfg.model.fsdp_config;
    let d = fc
        .mixed_precision
        .as_ref()
        .map(|m| m.param_dtype)
        .unwrap_or(fc.model_dtype);
    match d {
        Dtype::Fp32 => Ok(Kind::Float),
        Dtype::Bf16 => Ok(Kind::BFloat16),
        Dtype::Fp16 => bail!("model.fsdp_config: fp16 is not supported (use fp32 or bf16)"),
    }
}

/// Runs SFT as `cfg` says: loads the datasets named by `data.*` and trains.
pub fn run(cfg: &SftConfig, opts: RunOptions) -> Result<RunSummary> {
    check_supported(cfg, &opts)?;
    let model_dir = expand_path(&cfg.model.partial_pretrain);
    let train = SftDataset::train(&cfg.data, &model_dir).context("loading data.train_files")?;
    let val = if cfg.data.val_files.as_slice().is_empty() {
        None
    } else {
        Some(SftDataset::val(&cfg.data, &model_dir).context("loading data.val_files")?)
    };
    run_with_data(cfg, &train, val.as_ref(), opts)
}

fn check_supported(cfg: &SftConfig, opts: &RunOptions) -> Result<()> {
    // Every registered logger kind (plugins included) is an honoured value of `trainer.logger`.
    let names = opts.loggers.names();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    cfg.validate_supported(&supported_keys().values("trainer.logger", &names))
}

/// Runs SFT on already-tokenized datasets (tests and callers with their own data).
pub fn run_with_data(
    cfg: &SftConfig,
    train: &SftDataset,
    val: Option<&SftDataset>,
    mut opts: RunOptions,
) -> Result<RunSummary> {
    check_supported(cfg, &opts)?;
    let device = device_of(cfg)?;
    let kind = compute_kind(cfg)?;
    let (bs, mbs) = (cfg.data.train_batch_size, cfg.data.micro_batch_size_per_gpu);
    if mbs == 0 || bs % mbs != 0 {
        bail!(
            "data.train_batch_size {bs} must be a multiple of data.micro_batch_size_per_gpu {mbs}"
        );
    }
    let per_epoch = steps_per_epoch(train.len(), bs);
    if per_epoch == 0 {
        bail!(
            "data.train_files: {} samples is fewer than one batch (data.train_batch_size={bs})",
            train.len()
        );
    }
    let total_steps = match cfg.trainer.total_training_steps {
        Some(n) => n as i64,
        None => (per_epoch * cfg.trainer.total_epochs) as i64,
    };
    let model_dir = expand_path(&cfg.model.partial_pretrain);
    let loaded = load_model(&model_dir)?;
    let (model_cfg, layout) = (loaded.config.clone(), loaded.layout.clone());
    let master: Vec<_> = loaded
        .params
        .into_iter()
        .map(|t| t.to_device(device))
        .collect();
    let store = LocalParams::new(layout.clone(), master, kind);
    let engine_opts = EngineOptions {
        gradient_checkpointing: cfg.model.enable_gradient_checkpointing,
        ..EngineOptions::default()
    };
    let mut engine = Engine::new(model_cfg.clone(), store, kind, engine_opts);
    if cfg.model.use_liger {
        if opts.kernels.is_builtin() {
            bail!("model.use_liger=true needs the liger kernels (RunOptions::kernels; `ferl sft` sets them up)");
        }
        tracing::info!(ops = ?opts.kernels.replaced(), "model.use_liger=true: ops replaced by kernels");
        engine.set_kernels(opts.kernels.clone());
    }
    let o = &cfg.optim;
    let adam = AdamWConfig {
        betas: (o.betas[0], o.betas[1]),
        eps: 1e-8,
        weight_decay: o.weight_decay,
    };
    let optimizer = AdamW::new(adam, engine.store().master());
    let sched_name = match o.lr_scheduler {
        LrScheduler::Cosine => "cosine",
        LrScheduler::Constant => "constant",
    };
    let mut schedule = LrSchedule::from_verl(
        sched_name,
        o.lr,
        o.lr_warmup_steps_ratio,
        total_steps,
        o.min_lr_ratio,
    )?;
    schedule.num_cycles = o.num_cycles;
    if o.lr_warmup_steps > 0 {
        schedule.warmup_steps = o.lr_warmup_steps;
    }
    let layout_kind = if cfg.use_remove_padding {
        Layout::Packed
    } else {
        Layout::Padded
    };
    let mut stepper = Stepper {
        engine,
        optimizer,
        schedule,
        clip_grad: o.clip_grad,
        micro_batch_size: mbs,
        layout: layout_kind,
        device,
        completed_steps: 0,
    };
    let root = expand_path(&cfg.trainer.default_local_dir);
    let (mut epoch, mut step_in_epoch) = (0u64, 0usize);
    if let Some(ckpt) = resume_point(cfg, &root)? {
        let c = checkpoint::load(&ckpt, &layout)?;
        let store = stepper.engine.store_mut();
        store.set_master(&c.params);
        let _g = tch::no_grad_guard();
        for (dst, src) in stepper.optimizer.exp_avg.iter_mut().zip(&c.exp_avg) {
            dst.copy_(src);
        }
        for (dst, src) in stepper.optimizer.exp_avg_sq.iter_mut().zip(&c.exp_avg_sq) {
            dst.copy_(src);
        }
        stepper.optimizer.step = c.state.optimizer_step;
        stepper.completed_steps = c.state.global_step;
        (epoch, step_in_epoch) = (c.state.epoch, c.state.step_in_epoch);
        if c.state.total_steps != total_steps {
            tracing::warn!(
                checkpoint = %ckpt.display(),
                was = c.state.total_steps,
                now = total_steps,
                "the checkpoint was planned for a different number of steps; the schedule follows the new total"
            );
        }
        tracing::info!(checkpoint = %ckpt.display(), step = c.state.global_step, epoch, step_in_epoch, "resumed");
    }

    let progress = if opts.progress {
        let pb = ProgressBar::new(total_steps as u64);
        pb.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("valid template"),
        );
        pb.set_position(stepper.completed_steps as u64);
        Some(pb)
    } else {
        None
    };
    let ctx = LoggerContext {
        run_dir: root.clone(),
        project: cfg.trainer.project_name.clone(),
        experiment: cfg.trainer.experiment_name.clone(),
        progress: progress.clone(),
    };
    let mut loggers = opts.loggers.build(cfg.trainer.logger.as_slice(), &ctx)?;
    let side: Vec<&Path> = vec![model_dir.as_path()];
    let mut summary = RunSummary {
        global_step: stepper.completed_steps,
        ..RunSummary::default()
    };
    let mut trained_this_run = 0i64;
    let val_refs: Vec<SampleRef> = val
        .map(|v| {
            v.samples()
                .iter()
                .map(|s| SampleRef {
                    input_ids: &s.input_ids,
                    loss_mask: &s.loss_mask,
                })
                .collect()
        })
        .unwrap_or_default();
    let mut validated_at = -1i64;

    'outer: while stepper.completed_steps < total_steps {
        let order = epoch_order(train.len(), cfg.trainer.seed, epoch, cfg.data.shuffle);
        while step_in_epoch < per_epoch {
            if stepper.completed_steps >= total_steps
                || opts.stop_after_steps.is_some_and(|n| trained_this_run >= n)
            {
                break 'outer;
            }
            let batch: Vec<SampleRef> = global_batch(&order, bs, step_in_epoch)
                .iter()
                .map(|&i| {
                    let s = train.get(i);
                    SampleRef {
                        input_ids: &s.input_ids,
                        loss_mask: &s.loss_mask,
                    }
                })
                .collect();
            let t0 = Instant::now();
            let stats = stepper.step(&batch)?;
            let secs = t0.elapsed().as_secs_f64();
            trained_this_run += 1;
            step_in_epoch += 1;
            let step = stepper.completed_steps;
            let tokens_per_s = stats.tokens as f64 / secs.max(1e-9);
            let mut metrics = vec![
                ("train/loss".to_string(), stats.loss),
                ("train/lr".to_string(), stats.lr),
                ("train/grad_norm".to_string(), stats.grad_norm),
                ("train/tokens".to_string(), stats.tokens as f64),
                ("perf/tokens_per_s".to_string(), tokens_per_s),
            ];
            if stats.skipped {
                metrics.push(("train/skipped_step".to_string(), 1.0));
            }
            summary.train_losses.push((step, stats.loss));
            if let Some(hook) = opts.on_step_end.as_mut() {
                hook(step);
            }
            let last = step >= total_steps;
            let test_freq = cfg.trainer.test_freq;
            if !val_refs.is_empty() && (last || (test_freq > 0 && step % test_freq == 0)) {
                let v = stepper.validate(&val_refs)?;
                metrics.push(("val/loss".to_string(), v));
                summary.val_losses.push((step, v));
                validated_at = step;
            }
            for l in loggers.iter_mut() {
                l.log(step, &metrics)?;
            }
            if let Some(pb) = &progress {
                pb.set_position(step as u64);
                pb.set_message(format!(
                    "loss {:.4} lr {:.2e} {:.0} tok/s",
                    stats.loss, stats.lr, tokens_per_s
                ));
            }
            let save_freq = cfg.trainer.save_freq;
            if last || (save_freq > 0 && step % save_freq == 0) {
                // The data position of the *next* batch: a checkpoint at the end of an epoch points at the start of
                // the next one, so resuming there trains on (verl #7401 silently trained nothing).
                let (next_epoch, next_step) = if step_in_epoch == per_epoch {
                    (epoch + 1, 0)
                } else {
                    (epoch, step_in_epoch)
                };
                let state = TrainerState {
                    global_step: step,
                    optimizer_step: stepper.optimizer.step,
                    epoch: next_epoch,
                    step_in_epoch: next_step,
                    seed: cfg.trainer.seed,
                    total_steps,
                };
                let store = stepper.engine.store();
                let contents = CheckpointContents {
                    config: &model_cfg,
                    layout: &layout,
                    params: store.master(),
                    optimizer: &stepper.optimizer,
                    state: &state,
                    side_files_from: &side,
                };
                summary.last_checkpoint = Some(checkpoint::save(
                    &root,
                    &contents,
                    cfg.trainer.max_ckpt_to_keep,
                )?);
            }
        }
        if step_in_epoch >= per_epoch {
            (epoch, step_in_epoch) = (epoch + 1, 0);
        }
    }
    if stepper.completed_steps >= total_steps
        && validated_at != stepper.completed_steps
        && !val_refs.is_empty()
    {
        // Resumed at the very end: still report the final validation loss.
        let v = stepper.validate(&val_refs)?;
        summary.val_losses.push((stepper.completed_steps, v));
        for l in loggers.iter_mut() {
            l.log(stepper.completed_steps, &[("val/loss".to_string(), v)])?;
        }
    }
    for l in loggers.iter_mut() {
        l.finish()?;
    }
    if let Some(pb) = progress {
        pb.finish();
    }
    summary.global_step = stepper.completed_steps;
    Ok(summary)
}

/// The checkpoint to resume from, per `trainer.resume_mode`.
fn resume_point(cfg: &SftConfig, root: &Path) -> Result<Option<PathBuf>> {
    match cfg.trainer.resume_mode {
        ResumeMode::Disable => Ok(None),
        ResumeMode::Auto => checkpoint::latest(root),
        ResumeMode::ResumePath => {
            let p = cfg
                .trainer
                .resume_from_path
                .as_deref()
                .context("trainer.resume_mode=resume_path needs trainer.resume_from_path")?;
            let p = expand_path(p);
            if !p.join("trainer_state.json").exists() {
                bail!(
                    "trainer.resume_from_path: {} is not a ferl checkpoint (no trainer_state.json)",
                    p.display()
                );
            }
            Ok(Some(p))
        }
    }
}
