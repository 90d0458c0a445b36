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
pub mod parallel;
pub mod plan;
mod report;
pub mod restart;
pub mod threads;

pub use gate::{check, compute_kind, cuda_is_available, device_of, LaunchShape};
pub use parallel::RankLayout;
pub use plan::{adamw_config, lr_schedule, RunPlan};
pub use report::{metric, mfu, peak_flops, step_values, MfuInputs};
use restart::{restart_executor, restart_values, ResumePoints};
pub use restart::{RestartPolicy, RestartRecord};

use crate::checkpoint::{read_meta, resume_dir, step_dir, RunMeta};
use crate::metrics::MetricsLogger;
use anyhow::Result;
use ferl_config::{expand_path, SftConfig};
use ferl_data::DataPlan;
pub use ferl_data::{Phase, Progress};
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
    /// Peak memory of each rank in bytes, rank order (0 where unknown): resident memory on CPU, device memory in
    /// use on CUDA.
    pub peak_memory_bytes: Vec<u64>,
    /// The algorithm's own metrics under verl's names (RL: `actor/*`, `critic/*`, `response_length/*`,
    /// `timing_s/*`), logged instead of `train/*`; empty for SFT.
    pub metrics: Vec<(String, f64)>,
}

/// Runs the steps the loop decides; one implementation per launch path.
pub trait StepExecutor {
    /// Data-parallel ranks.
    fn world_size(&self) -> usize;
    /// Trains one global batch: the training-set indices `batch`, in order (the executor splits them by rank).
    fn train_step(&mut self, batch: &[usize]) -> Result<StepOutcome>;
    /// The token-mean validation loss over the whole validation set; `None` when there is none. Reports the rows
    /// done to `progress` (its length, then positions) as it goes.
    fn validate(&mut self, progress: &Phase) -> Result<Option<f64>>;
    /// Writes a complete checkpoint into `dir` and commits it with `meta` (`meta.json` last); with `hf_model` also
    /// its `huggingface/` folder. May finish in the background; [`StepExecutor::finish`] waits.
    fn save(&mut self, dir: &Path, meta: &RunMeta, hf_model: bool) -> Result<()>;
    /// Restores model, optimizer and schedule position from the checkpoint `dir` (any world size).
    fn load(&mut self, dir: &Path) -> Result<()>;
    /// Waits for background checkpoint writes and commits.
    fn finish(&mut self) -> Result<()>;
    /// Rebuilds the ranks after `cause` failed the run: tears down what failed, waits up to `policy.wait` for the
    /// resources of [`StepExecutor::world_size`] ranks, and with `policy.elastic` takes the largest smaller world that
    /// `policy.fits` and the resources allow. The model is fresh afterwards (the loop loads the resume point).
    /// Returns the kind of failure (`rank_lost`, `node_lost`, `collective`, `error`). The default cannot restart.
    fn restart(&mut self, cause: &anyhow::Error, policy: &RestartPolicy<'_>) -> Result<String> {
        let _ = (cause, policy);
        anyhow::bail!("this launch path cannot restart its ranks")
    }
    /// Told of the run's restarts once the loop has resumed after the newest one (the cluster executor shows them
    /// in `ferl status`).
    fn on_restart(&mut self, restarts: &[RestartRecord]) {
        let _ = restarts;
    }
}

/// The parts of a run besides the executor: where metrics go and what runs at step boundaries. Only the
/// coordinating process (the driver, or rank 0 of a launcher run) has loggers and hooks.
#[derive(Default)]
pub struct RunOptions {
    /// Loggers of `trainer.logger`, built by the caller (empty on ranks that do not log).
    pub loggers: Vec<Box<dyn MetricsLogger>>,
    /// Called after every training step, before logging (e.g. the plugin host's step boundary).
    pub on_step_end: Option<Box<dyn FnMut(i64) + Send>>,
    /// The run's progress over its steps, validation inside it ([`progress`]: a bar in a terminal, plain lines in a
    /// log).
    pub progress: Option<Progress>,
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
    /// The run's restarts, oldest first (`trainer.max_restarts`).
    #[serde(default)]
    pub restarts: Vec<RestartRecord>,
}

impl RunSummary {
    /// The training losses of this run, in step order.
    pub fn losses(&self) -> Vec<f64> {
        self.steps.iter().map(|s| s.loss).collect()
    }
}

/// The progress of the run's steps, for the process that logs: a bar in a terminal, plain lines (at least every few
/// seconds, validation's rows included) when stderr is a log file ([`ferl_data::progress`]).
pub fn progress(total_steps: u64) -> Progress {
    Progress::new("training", "steps", total_steps)
}

/// Trains `cfg` on a training set of `train_len` samples through `exec`: resumes per `trainer.resume_mode`, then
/// steps, validates, logs and saves as the config says (invariant 1), restarting after failures as
/// `trainer.max_restarts` allows ([`restart`]).
pub fn run(
    exec: &mut dyn StepExecutor,
    cfg: &SftConfig,
    train_len: usize,
    mut opts: RunOptions,
) -> Result<RunSummary> {
    let began_from = resume_dir(cfg)?;
    let mut lp = Loop {
        plan: RunPlan::new(cfg, train_len)?,
        data: fresh_data(cfg, train_len)?,
        root: expand_path(&cfg.trainer.default_local_dir),
        step: 0,
        summary: RunSummary {
            world_size: exec.world_size(),
            ..RunSummary::default()
        },
        points: ResumePoints::new(began_from.clone()),
        after_restart: Vec::new(),
    };
    if let Some(pb) = &opts.progress {
        pb.set_length(lp.plan.total_steps);
    }
    let mut load = began_from;
    let mut first = true;
    loop {
        let attempt = lp.attempt(exec, cfg, load.take(), first, &mut opts);
        let Err(cause) = attempt else { break };
        first = false;
        let done = lp.summary.restarts.len();
        let (from, mut record) = restart_executor(exec, cfg, done, cause, &mut lp.points)?;
        record.failed_after_step = lp.step;
        lp.data = fresh_data(cfg, train_len)?;
        lp.step = 0;
        lp.summary.restarts.push(record);
        lp.summary.world_size = exec.world_size();
        lp.after_restart = restart_values(&lp.summary.restarts);
        load = from;
    }
    for l in opts.loggers.iter_mut() {
        l.finish()?;
    }
    if let Some(pb) = &opts.progress {
        pb.finish();
    }
    lp.summary.global_step = lp.step;
    Ok(lp.summary)
}

fn fresh_data(cfg: &SftConfig, train_len: usize) -> Result<DataPlan> {
    let d = &cfg.data;
    DataPlan::new(train_len, d.train_batch_size, cfg.trainer.seed, d.shuffle)
}

/// The loop's position and what it has done.
struct Loop {
    plan: RunPlan,
    data: DataPlan,
    root: PathBuf,
    step: u64,
    summary: RunSummary,
    points: ResumePoints,
    /// Values logged with the first step after a restart.
    after_restart: Vec<(String, f64)>,
}

impl Loop {
    /// Loads `load` (the run's start, or a restart's resume point), trains to the end and flushes.
    fn attempt(
        &mut self,
        exec: &mut dyn StepExecutor,
        cfg: &SftConfig,
        load: Option<PathBuf>,
        first: bool,
        opts: &mut RunOptions,
    ) -> Result<()> {
        if let Some(dir) = &load {
            self.resume(exec, dir, first)?;
            if let Some(pb) = &opts.progress {
                pb.println(format!(
                    "resumed from {} (step {})",
                    dir.display(),
                    self.step
                ));
            }
        }
        if !first {
            if let Some(restart) = self.summary.restarts.last_mut() {
                restart.resumed_from = self.step;
            }
            exec.on_restart(&self.summary.restarts);
        }
        if let Some(pb) = &opts.progress {
            pb.set_position(self.step);
        }
        self.train_to_end(exec, cfg, opts)?;
        exec.finish()
    }

    /// Loads checkpoint `dir` and moves the data order and step there; later steps of this run are replayed.
    fn resume(&mut self, exec: &mut dyn StepExecutor, dir: &Path, first: bool) -> Result<()> {
        let meta = read_meta(dir)?;
        exec.load(dir)?;
        self.data.set_position(meta.position());
        self.step = meta.global_step;
        if first {
            self.summary.resumed_from = meta.global_step;
        }
        let s = &mut self.summary;
        s.steps.retain(|r| r.step <= meta.global_step);
        s.val_losses.retain(|(v, _)| *v <= meta.global_step);
        s.last_checkpoint = (!first)
            .then(|| dir.to_path_buf())
            .or(s.last_checkpoint.take());
        self.points.truncate(meta.global_step);
        tracing::info!(checkpoint = %dir.display(), step = meta.global_step, "resumed");
        Ok(())
    }

    fn train_to_end(
        &mut self,
        exec: &mut dyn StepExecutor,
        cfg: &SftConfig,
        opts: &mut RunOptions,
    ) -> Result<()> {
        if self.step == 0 {
            let s = &mut self.summary;
            s.steps.clear();
            s.val_losses.clear();
            s.last_checkpoint = None;
            self.points.truncate(0);
        }
        while self.step < self.plan.total_steps && !stopped(opts, &self.summary) {
            self.one_step(exec, cfg, opts)?;
        }
        if self.summary.steps.is_empty() && self.step >= self.plan.total_steps {
            // Resumed at the very end: still report the final validation loss.
            let mut values = Vec::new();
            validate(exec, opts, self.step, &mut values, &mut self.summary)?;
            log(opts, self.step, &values)?;
        }
        Ok(())
    }

    fn one_step(
        &mut self,
        exec: &mut dyn StepExecutor,
        cfg: &SftConfig,
        opts: &mut RunOptions,
    ) -> Result<()> {
        let started = Instant::now();
        let out = exec.train_step(&self.data.next_batch())?;
        self.step += 1;
        let step = self.step;
        let seconds = started.elapsed().as_secs_f64();
        self.summary.steps.push(StepRecord {
            step,
            loss: out.loss,
            grad_norm: out.grad_norm,
            lr: out.lr,
        });
        if let Some(hook) = opts.on_step_end.as_mut() {
            hook(step as i64);
        }
        let mut values = step_values(&out, seconds, opts.mfu.as_ref());
        values.append(&mut self.after_restart);
        if self.plan.validates_at(step) {
            validate(exec, opts, step, &mut values, &mut self.summary)?;
        }
        log(opts, step, &values)?;
        show_progress(opts, step, &out, seconds);
        if self.plan.saves_at(step) {
            self.save(exec, cfg, step)?;
        }
        Ok(())
    }

    fn save(&mut self, exec: &mut dyn StepExecutor, cfg: &SftConfig, step: u64) -> Result<()> {
        let position = self.data.position();
        let meta = RunMeta {
            global_step: step,
            epoch: position.epoch,
            step_in_epoch: position.step_in_epoch,
            world_size: exec.world_size() as u64,
            files: Default::default(),
        };
        let dir = step_dir(&self.root, step);
        exec.save(&dir, &meta, gate::saves_hf_model(cfg))?;
        self.points.saved(step, dir.clone());
        self.summary.last_checkpoint = Some(dir);
        Ok(())
    }
}

fn stopped(opts: &RunOptions, summary: &RunSummary) -> bool {
    opts.stop_after_steps
        .is_some_and(|n| summary.steps.len() as u64 >= n)
}

fn validate(
    exec: &mut dyn StepExecutor,
    opts: &RunOptions,
    step: u64,
    values: &mut Vec<(String, f64)>,
    summary: &mut RunSummary,
) -> Result<()> {
    let phase = match &opts.progress {
        Some(p) => p.phase("validation", "rows", 0),
        None => Phase::hidden(),
    };
    let loss = exec.validate(&phase)?;
    phase.finish();
    if let Some(v) = loss {
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
