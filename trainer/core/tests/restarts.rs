//! The run loop's restarts (`trainer/core/src/run/restart.rs`) over a scripted executor: a deterministic "model" (a
//! running sum of the batches' indices) that fails on chosen steps, saves and loads real checkpoint folders, and
//! rebuilds when asked — so each invariant is checked exactly, without ranks or libtorch work.

use anyhow::{bail, Result};
use ferl_config::SftConfig;
use ferl_trainer::checkpoint::{commit, RunMeta};
use ferl_trainer::run::{
    self, Phase, RestartPolicy, RestartRecord, RunOptions, StepExecutor, StepOutcome,
};
use std::path::Path;

/// A fake executor: `state` evolves with every batch; steps in `fail_at` fail once, before they train.
struct Scripted {
    state: f64,
    world: usize,
    fail_at: Vec<u64>,
    steps_seen: u64,
    /// World size a restart comes back at (elastic: smaller).
    restart_world: usize,
    rebuilt: usize,
    told: Vec<usize>,
}

impl Scripted {
    fn new(fail_at: &[u64]) -> Self {
        Self {
            state: 1.0,
            world: 2,
            fail_at: fail_at.to_vec(),
            steps_seen: 0,
            restart_world: 2,
            rebuilt: 0,
            told: Vec::new(),
        }
    }
}

impl StepExecutor for Scripted {
    fn world_size(&self) -> usize {
        self.world
    }

    fn train_step(&mut self, batch: &[usize]) -> Result<StepOutcome> {
        self.steps_seen += 1;
        if let Some(i) = self.fail_at.iter().position(|&s| s == self.steps_seen) {
            self.fail_at.remove(i);
            bail!("trainer rank 1 died (scripted at call {})", self.steps_seen);
        }
        let sum: usize = batch.iter().sum();
        self.state = self.state * 0.9 + sum as f64 / 100.0;
        Ok(StepOutcome {
            loss: self.state,
            grad_norm: 1.0,
            lr: 1e-3,
            skipped: false,
            tokens: batch.len() as i64,
            peak_memory_bytes: vec![0; self.world],
            metrics: Vec::new(),
        })
    }

    fn validate(&mut self, _progress: &Phase) -> Result<Option<f64>> {
        Ok(None)
    }

    fn save(&mut self, dir: &Path, meta: &RunMeta, _hf: bool) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("state.json"), self.state.to_string())?;
        commit(dir.parent().unwrap(), meta, None)
    }

    fn load(&mut self, dir: &Path) -> Result<()> {
        self.state = std::fs::read_to_string(dir.join("state.json"))?.parse()?;
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }

    fn restart(&mut self, _cause: &anyhow::Error, policy: &RestartPolicy<'_>) -> Result<String> {
        self.rebuilt += 1;
        self.state = 1.0;
        self.world = self.restart_world;
        assert!(
            (policy.fits)(self.world),
            "the loop offered a world size that does not split the batch"
        );
        Ok("rank_lost".into())
    }

    fn on_restart(&mut self, restarts: &[RestartRecord]) {
        self.told.push(restarts.len());
    }
}

fn config(root: &Path, extra: &[&str]) -> SftConfig {
    let mut o = vec![
        "data.train_batch_size=4".to_string(),
        "trainer.total_training_steps=10".into(),
        "trainer.save_freq=2".into(),
        format!("trainer.default_local_dir={}", root.display()),
        "trainer.resume_mode=auto".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    SftConfig::load(None, &o).unwrap()
}

fn losses(s: &run::RunSummary) -> Vec<(u64, f64)> {
    s.steps.iter().map(|r| (r.step, r.loss)).collect()
}

#[test]
fn a_failure_restarts_from_the_newest_checkpoint_and_replays_the_same_steps() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let clean = run::run(
        &mut Scripted::new(&[]),
        &config(a.path(), &[]),
        64,
        RunOptions::default(),
    )
    .unwrap();
    let cfg = config(b.path(), &["trainer.max_restarts=1"]);
    let mut exec = Scripted::new(&[5]);
    let got = run::run(&mut exec, &cfg, 64, RunOptions::default()).unwrap();
    assert_eq!(
        losses(&got),
        losses(&clean),
        "steps after the restart differ from an uninterrupted run"
    );
    assert_eq!(got.global_step, 10);
    assert_eq!(exec.rebuilt, 1);
    assert_eq!(exec.told, vec![1]);
    let r = &got.restarts[..];
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].failed_after_step, r[0].resumed_from, r[0].world_size),
        (4, 4, 2)
    );
    assert_eq!(r[0].cause_kind, "rank_lost");
    assert!(r[0].cause.contains("scripted"), "{}", r[0].cause);
}

#[test]
fn restarts_are_bounded_by_max_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &["trainer.max_restarts=1"]);
    let err = run::run(&mut Scripted::new(&[3, 6]), &cfg, 64, RunOptions::default()).unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("after 1 restarts (trainer.max_restarts=1)"),
        "{text}"
    );
    assert!(text.contains("scripted at call 6"), "{text}");
    let none = config(tempfile::tempdir().unwrap().path(), &[]);
    let err = run::run(&mut Scripted::new(&[3]), &none, 64, RunOptions::default()).unwrap_err();
    assert!(
        format!("{err:#}").contains("scripted at call 3"),
        "max_restarts=0 fails at the first loss"
    );
}

#[test]
fn a_failure_before_the_first_save_starts_over_never_from_an_older_runs_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    // An older run left a checkpoint at step 2; this run starts fresh (resume_mode=disable) and fails at step 1.
    let old = config(dir.path(), &["trainer.total_training_steps=2"]);
    run::run(&mut Scripted::new(&[]), &old, 64, RunOptions::default()).unwrap();
    let clean_dir = tempfile::tempdir().unwrap();
    let clean = run::run(
        &mut Scripted::new(&[]),
        &config(clean_dir.path(), &[]),
        64,
        RunOptions::default(),
    )
    .unwrap();
    let cfg = config(
        dir.path(),
        &["trainer.max_restarts=2", "trainer.resume_mode=disable"],
    );
    let got = run::run(&mut Scripted::new(&[1]), &cfg, 64, RunOptions::default()).unwrap();
    assert_eq!(got.restarts[0].resumed_from, 0);
    assert_eq!(losses(&got), losses(&clean));
}

#[test]
fn an_elastic_restart_continues_at_the_smaller_world_with_the_same_data_order() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let clean = run::run(
        &mut Scripted::new(&[]),
        &config(a.path(), &[]),
        64,
        RunOptions::default(),
    )
    .unwrap();
    let cfg = config(
        b.path(),
        &["trainer.max_restarts=1", "trainer.elastic=true"],
    );
    let mut exec = Scripted::new(&[7]);
    exec.restart_world = 1;
    let got = run::run(&mut exec, &cfg, 64, RunOptions::default()).unwrap();
    assert_eq!(got.world_size, 1);
    assert_eq!(got.restarts[0].world_size, 1);
    assert_eq!(got.restarts[0].resumed_from, 6);
    assert_eq!(losses(&got), losses(&clean));
}
