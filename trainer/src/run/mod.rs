//! The one run loop of every launch path (design decision 12): a loop over a [`StepExecutor`] — world 1 in this
//! process, actor ranks under a single controller, or SPMD ranks under an external launcher — with the data order,
//! the run's length, resume, validation, checkpoints, metrics and plugin step boundaries decided here, once.
//!
//! Invariants (tests name them):
//! 1. The loop alone decides what happens when: which samples step `n` trains on ([`ferl_data::DataPlan`]), when
//!    it validates and saves ([`RunPlan`]), and where a resumed run continues (`meta.json`). Executors only do it.
//! 2. Every path logs the same metric names ([`metric`]) and writes the same checkpoint layout
//!    ([`crate::checkpoint`]), so any path resumes any other path's checkpoint at any world size.
//! 3. The config gate ([`gate::check`]) runs before the loop on every path.

pub mod gate;
pub mod plan;
mod report;

pub use gate::{check, compute_kind, cuda_is_available, device_of, LaunchShape};
pub use plan::{adamw_config, lr_schedule, RunPlan};
pub use report::{metric, mfu, peak_flops, step_values, MfuInputs};

use crate::checkpoint::{read_meta, resume_dir, step_dir, RunMeta};
use crate::metrics::MetricsLogger;
use anyhow::Result;
use ferl_config::{expand_path, SftConfig};
use ferl_data::DataPlan;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What one optimizer step did over every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    /// Token-mean cross-entropy over every target of the global batch.
    pub loss: f64,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f64,
    /// Learning rate the update used.
    pub lr: f64,
    /// The update was skipped (non-finite norm).
    pub skipped: bool,
    /// Real (non-pad) tokens of the global batch.
    pub tokens: i64,
    /// Peak resident memory of each rank's process, in bytes, rank order (0 where unknown).
    pub peak_memory_bytes: Vec<u64>,
}

/// Runs the steps the loop decides; one implementation per launch path.
pub trait StepExecutor {
    /// Data-parallel ranks.
    fn world_size(&self) -> usize;
    /// Trains one global batch: the training-set indices `batch`, in order (the executor splits them by rank).
    fn train_step(&mut self, batch: &[usize]) -> Result<StepOutcome>;
    /// The token-mean validation loss over the whole validation set; `None` when there is none.
    fn validate(&mut self) -> Result<Option<f64>>;
    /// Writes a complete checkpoint into `dir` and commits it with `meta` (`meta.json` last); with `hf_model` also
    /// its `huggingface/` folder. May finish in the background; [`StepExecutor::finish`] waits.
    fn save(&mut self, dir: &Path, meta: &RunMeta, hf_model: bool) -> Result<()>;
    /// Restores model, optimizer and schedule position from the checkpoint `dir` (any world size).
    fn load(&mut self, dir: &Path) -> Result<()>;
    /// Waits for background checkpoint writes and commits.
    fn finish(&mut self) -> Result<()>;
}

/// The parts of a run besides the executor: where metrics go and what runs at step boundaries. Only the
/// coordinating process (the driver, or rank 0 of a launcher run) has loggers and hooks.
#[derive(Default)]
pub struct RunOptions {
    /// Loggers of `trainer.logger`, built by the caller (empty on ranks that do not log).
    pub loggers: Vec<Box<dyn MetricsLogger>>,
    /// Called after every training step, before logging (e.g. the plugin host's step boundary).
    pub on_step_end: Option<Box<dyn FnMut(i64) + Send>>,
    /// The progress bar (it hides itself when stderr is not a terminal).
    pub progress: Option<ProgressBar>,
    /// What `perf/mfu` needs; none omits the metric.
    pub mfu: Option<MfuInputs>,
    /// Stop after this many steps of this run (an interruption, in tests); none runs to the end.
    pub stop_after_steps: Option<u64>,
}

/// One optimizer step as the loop saw it.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct StepRecord {
    /// Global step (from 1).
    pub step: u64,
    /// Token-mean loss over the global batch.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
}

/// What a run did.
#[derive(Serialize, Deserialize, Debug, Clone, Default)]
pub struct RunSummary {
    /// Ranks that trained.
    pub world_size: usize,
    /// The step the run resumed from (0 when it started fresh).
    pub resumed_from: u64,
    /// Steps trained by this run.
    pub steps: Vec<StepRecord>,
    /// `(step, token-mean validation loss)` of every validation.
    pub val_losses: Vec<(u64, f64)>,
    /// Steps completed at the end (resumed ones included).
    pub global_step: u64,
    /// The newest checkpoint this run wrote.
    pub last_checkpoint: Option<PathBuf>,
}

impl RunSummary {
    /// The training losses of this run, in step order.
    pub fn losses(&self) -> Vec<f64> {
        self.steps.iter().map(|s| s.loss).collect()
    }
}

/// A progress bar over the run's steps, for the process that logs.
pub fn progress_bar(total_steps: u64) -> ProgressBar {
    let pb = ProgressBar::new(total_steps);
    let style = ProgressStyle::with_template(
        "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
    )
    .expect("valid template");
    pb.set_style(style);
    pb
}

/// Trains `cfg` on a training set of `train_len` samples through `exec`: resumes per `trainer.resume_mode`, then
/// steps, validates, logs and saves as the config says (invariant 1).
pub fn run(
    exec: &mut dyn StepExecutor,
    cfg: &SftConfig,
    train_len: usize,
    mut opts: RunOptions,
) -> Result<RunSummary> {
    let plan = RunPlan::new(cfg, train_len)?;
    let d = &cfg.data;
    let mut data = DataPlan::new(train_len, d.train_batch_size, cfg.trainer.seed, d.shuffle)?;
    let root = expand_path(&cfg.trainer.default_local_dir);
    let mut summary = RunSummary {
        world_size: exec.world_size(),
        ..RunSummary::default()
    };
    if let Some(dir) = resume_dir(cfg)? {
        let meta = read_meta(&dir)?;
        exec.load(&dir)?;
        data.set_position(meta.position());
        summary.resumed_from = meta.global_step;
        tracing::info!(checkpoint = %dir.display(), step = meta.global_step, "resumed");
    }
    if let Some(pb) = &opts.progress {
        pb.set_length(plan.total_steps);
        pb.set_position(summary.resumed_from);
    }
    let mut step = summary.resumed_from;
    while step < plan.total_steps && !stopped(&opts, &summary) {
        let started = Instant::now();
        let out = exec.train_step(&data.next_batch())?;
        step += 1;
        let seconds = started.elapsed().as_secs_f64();
        summary.steps.push(StepRecord {
            step,
            loss: out.loss,
            grad_norm: out.grad_norm,
            lr: out.lr,
        });
        if let Some(hook) = opts.on_step_end.as_mut() {
            hook(step as i64);
        }
        let mut values = step_values(&out, seconds, opts.mfu.as_ref());
        if plan.validates_at(step) {
            validate(exec, step, &mut values, &mut summary)?;
        }
        log(&mut opts, step, &values)?;
        show_progress(&opts, step, &out, seconds);
        if plan.saves_at(step) {
            let meta = RunMeta {
                global_step: step,
                epoch: data.position().epoch,
                step_in_epoch: data.position().step_in_epoch,
                world_size: exec.world_size() as u64,
                files: Default::default(),
            };
            let dir = step_dir(&root, step);
            exec.save(&dir, &meta, gate::saves_hf_model(cfg))?;
            summary.last_checkpoint = Some(dir);
        }
    }
    if summary.steps.is_empty() && step >= plan.total_steps {
        // Resumed at the very end: still report the final validation loss.
        let mut values = Vec::new();
        validate(exec, step, &mut values, &mut summary)?;
        log(&mut opts, step, &values)?;
    }
    exec.finish()?;
    for l in opts.loggers.iter_mut() {
        l.finish()?;
    }
    if let Some(pb) = &opts.progress {
        pb.finish();
    }
    summary.global_step = step;
    Ok(summary)
}

fn stopped(opts: &RunOptions, summary: &RunSummary) -> bool {
    opts.stop_after_steps
        .is_some_and(|n| summary.steps.len() as u64 >= n)
}

fn validate(
    exec: &mut dyn StepExecutor,
    step: u64,
    values: &mut Vec<(String, f64)>,
    summary: &mut RunSummary,
) -> Result<()> {
    if let Some(v) = exec.validate()? {
        values.push((metric::VAL_LOSS.to_string(), v));
        summary.val_losses.push((step, v));
    }
    Ok(())
}

fn log(opts: &mut RunOptions, step: u64, values: &[(String, f64)]) -> Result<()> {
    if values.is_empty() {
        return Ok(());
    }
    for l in opts.loggers.iter_mut() {
        l.log(step as i64, values)?;
    }
    Ok(())
}

fn show_progress(opts: &RunOptions, step: u64, out: &StepOutcome, seconds: f64) {
    if let Some(pb) = &opts.progress {
        pb.set_position(step);
        pb.set_message(format!(
            "loss {:.4} lr {:.2e} {:.0} tok/s",
            out.loss,
            out.lr,
            out.tokens as f64 / seconds.max(1e-9)
        ));
    }
}
