//! What a run does when, decided once from the config for every launch path: its length, the learning-rate
//! schedule, and the cadence of validation and checkpoints.

use crate::optim::{AdamWConfig, LrSchedule};
use anyhow::{bail, Result};
use ferl_config::{LrScheduler, SftConfig};
use ferl_data::steps_per_epoch;

/// Length and cadence of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlan {
    /// Optimizer steps of the whole run (`trainer.total_training_steps`, else `total_epochs` whole epochs).
    pub total_steps: u64,
    /// `trainer.test_freq`: validate every N steps; at the last step always (as verl does).
    pub test_freq: i64,
    /// `trainer.save_freq`: checkpoint every N steps; at the last step always (as verl does).
    pub save_freq: i64,
}

impl RunPlan {
    /// The plan of `cfg` over a training set of `train_len` samples.
    pub fn new(cfg: &SftConfig, train_len: usize) -> Result<Self> {
        let per_epoch = steps_per_epoch(train_len, cfg.data.train_batch_size);
        if per_epoch == 0 {
            bail!(
                "data.train_files={}: {train_len} samples is fewer than one batch (data.train_batch_size={})",
                cfg.data.train_files.as_slice().join(","),
                cfg.data.train_batch_size
            );
        }
        let total = match cfg.trainer.total_training_steps {
            Some(n) => n,
            None => per_epoch * cfg.trainer.total_epochs,
        };
        Ok(Self {
            total_steps: total as u64,
            test_freq: cfg.trainer.test_freq,
            save_freq: cfg.trainer.save_freq,
        })
    }

    /// Whether step `step` (1-based) is followed by a validation.
    pub fn validates_at(&self, step: u64) -> bool {
        due(self.test_freq, step, self.total_steps)
    }

    /// Whether step `step` (1-based) is followed by a checkpoint.
    pub fn saves_at(&self, step: u64) -> bool {
        due(self.save_freq, step, self.total_steps)
    }
}

fn due(freq: i64, step: u64, total: u64) -> bool {
    step == total || (freq > 0 && step.is_multiple_of(freq as u64))
}

/// verl's schedule: warmup of `optim.lr_warmup_steps` steps when positive, else `lr_warmup_steps_ratio` of the
/// total (verl's rule: `None`, 0 or negative delegate to the ratio), then cosine (with `num_cycles` and
/// `min_lr_ratio`) or constant.
pub fn lr_schedule(cfg: &SftConfig, total_steps: u64) -> Result<LrSchedule> {
    let o = &cfg.optim;
    let name = match o.lr_scheduler {
        LrScheduler::Cosine => "cosine",
        LrScheduler::Constant => "constant",
    };
    let mut s = LrSchedule::from_verl(
        name,
        o.lr,
        o.lr_warmup_steps_ratio,
        total_steps as i64,
        o.min_lr_ratio,
    )?;
    s.num_cycles = o.num_cycles;
    if o.lr_warmup_steps > 0 {
        s.warmup_steps = o.lr_warmup_steps;
    }
    Ok(s)
}

/// AdamW's settings from `optim.*`.
pub fn adamw_config(cfg: &SftConfig) -> AdamWConfig {
    let o = &cfg.optim;
    AdamWConfig {
        betas: (o.betas[0], o.betas[1]),
        eps: 1e-8,
        weight_decay: o.weight_decay,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(overrides: &[&str]) -> SftConfig {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        SftConfig::load(None, &o).unwrap()
    }

    #[test]
    fn last_step_always_validates_and_saves() {
        let c = cfg(&["data.train_batch_size=4", "trainer.total_epochs=2"]);
        let plan = RunPlan::new(&c, 10).unwrap();
        assert_eq!(plan.total_steps, 4);
        assert!(!plan.saves_at(3) && plan.saves_at(4) && plan.validates_at(4));
        let c = cfg(&["data.train_batch_size=4", "trainer.save_freq=2"]);
        let plan = RunPlan::new(&c, 8).unwrap();
        assert!(plan.saves_at(2) && !plan.saves_at(3));
    }

    #[test]
    fn warmup_steps_win_when_positive_and_zero_means_the_ratio() {
        let s = lr_schedule(&cfg(&["optim.lr_warmup_steps=29"]), 100).unwrap();
        assert_eq!(s.warmup_steps, 29);
        let s = lr_schedule(
            &cfg(&["optim.lr_warmup_steps=0", "optim.lr_warmup_steps_ratio=0.2"]),
            100,
        )
        .unwrap();
        assert_eq!(s.warmup_steps, 20);
        let s = lr_schedule(&cfg(&["optim.num_cycles=1.5"]), 100).unwrap();
        assert_eq!(s.num_cycles, 1.5);
    }
}
