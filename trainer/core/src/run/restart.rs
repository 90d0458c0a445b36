//! Restarts of the one run loop (`trainer.max_restarts`, `trainer.elastic`, `trainer.restart_wait_s`): when a step,
//! a validation, a save or the final flush fails, the loop asks the executor to rebuild its ranks
//! ([`super::StepExecutor::restart`]) and resumes from this run's newest complete checkpoint — or from where the run
//! began when it has saved none yet — with the data order, the global batch and the loss unchanged.
//!
//! Invariants (tests name them):
//! 1. A run restarts at most `trainer.max_restarts` times; the failure that exceeds it ends the run with its cause.
//! 2. The resume point is a checkpoint that verifies, never one from before the run's own start (an older run's).
//! 3. After a restart, steps replay from the resume point: the summary and the metrics hold them once more, and
//!    `system/restarts` (total) and `system/restarts/<cause>` are logged at the first step after each restart.

use super::gate::batch_splits;
use super::StepExecutor;
use crate::checkpoint::verify;
use anyhow::{Context as _, Result};
use ferl_config::SftConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// Metric names of restarts.
pub mod restart_metric {
    /// Restarts of the run so far (logged at the first step after each restart); also the prefix of the count per
    /// cause kind, `system/restarts/<cause>`.
    pub const RESTARTS: &str = "system/restarts";
    /// Ranks training after the restart.
    pub const WORLD_SIZE: &str = "system/world_size";
}

/// What an executor may do to come back after a failure.
pub struct RestartPolicy<'a> {
    /// How long to wait for the resources of the current world size.
    pub wait: Duration,
    /// Whether a smaller world size may be taken when they do not come back.
    pub elastic: bool,
    /// Whether a world size keeps the global batch (it splits evenly over the ranks).
    pub fits: &'a dyn Fn(usize) -> bool,
}

/// One restart of a run.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RestartRecord {
    /// The last step the run had finished when it failed.
    pub failed_after_step: u64,
    /// The step it resumed from (the checkpoint's, or where the run began).
    pub resumed_from: u64,
    /// Ranks after the restart.
    pub world_size: usize,
    /// The kind of failure (`rank_lost`, `node_lost`, `collective`, `error`), from the executor.
    pub cause_kind: String,
    /// The failure, as its error chain reads.
    pub cause: String,
}

/// Where a restart resumes: the newest checkpoint this run saved that verifies, else the one the run began from.
pub(super) struct ResumePoints {
    began_from: Option<PathBuf>,
    saved: Vec<(u64, PathBuf)>,
}

impl ResumePoints {
    pub(super) fn new(began_from: Option<PathBuf>) -> Self {
        Self {
            began_from,
            saved: Vec::new(),
        }
    }

    /// Records a save of this run at `step`.
    pub(super) fn saved(&mut self, step: u64, dir: PathBuf) {
        self.saved.push((step, dir));
    }

    /// The checkpoint to resume from (invariant 2); `None` starts over.
    fn newest_good(&mut self) -> Option<PathBuf> {
        while let Some((_, dir)) = self.saved.last() {
            match verify(dir) {
                Ok(_) => return Some(dir.clone()),
                Err(e) => {
                    tracing::warn!("not resuming from {}: {e:#}", dir.display());
                    self.saved.pop();
                }
            }
        }
        self.began_from.clone()
    }

    /// Forgets saves after `step` (they are replayed).
    pub(super) fn truncate(&mut self, step: u64) {
        self.saved.retain(|(s, _)| *s <= step);
    }
}

/// Asks `exec` to come back after `cause` (invariant 1) and returns the checkpoint to resume from (`None`: from the
/// start) with the cause's record, less the step numbers the caller fills in.
pub(super) fn restart_executor(
    exec: &mut dyn StepExecutor,
    cfg: &SftConfig,
    done: usize,
    cause: anyhow::Error,
    points: &mut ResumePoints,
) -> Result<(Option<PathBuf>, RestartRecord)> {
    let max = cfg.trainer.max_restarts;
    if done >= max {
        if max == 0 {
            return Err(cause);
        }
        return Err(cause.context(format!(
            "the run failed again after {done} restarts (trainer.max_restarts={max})"
        )));
    }
    let text = format!("{cause:#}");
    tracing::warn!(
        restart = done + 1,
        max,
        "the run failed; restarting: {text}"
    );
    let fits = |w: usize| batch_splits(cfg, w);
    let policy = RestartPolicy {
        wait: Duration::from_secs_f64(cfg.trainer.restart_wait_s),
        elastic: cfg.trainer.elastic,
        fits: &fits,
    };
    let cause_kind = exec
        .restart(&cause, &policy)
        .with_context(|| format!("restarting after: {text}"))?;
    let from = points.newest_good();
    let record = RestartRecord {
        failed_after_step: 0,
        resumed_from: 0,
        world_size: exec.world_size(),
        cause_kind,
        cause: text,
    };
    Ok((from, record))
}

/// The metric values logged at the first step after a restart (invariant 3).
pub(super) fn restart_values(records: &[RestartRecord]) -> Vec<(String, f64)> {
    let Some(last) = records.last() else {
        return Vec::new();
    };
    let same = records
        .iter()
        .filter(|r| r.cause_kind == last.cause_kind)
        .count();
    vec![
        (restart_metric::RESTARTS.to_string(), records.len() as f64),
        (
            format!("{}/{}", restart_metric::RESTARTS, last.cause_kind),
            same as f64,
        ),
        (
            restart_metric::WORLD_SIZE.to_string(),
            last.world_size as f64,
        ),
    ]
}
