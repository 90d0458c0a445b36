//! Automatic recovery (`trainer.max_restarts`, `trainer.elastic`), end to end with real processes:
//! - a trainer rank of a `--nproc-per-node 2` run SIGKILLed after step 5: the run restarts, resumes from its newest
//!   checkpoint and trains the uninterrupted run's losses (steps 6–10 within 1e-6);
//! - the node agent of a two-node loopback cluster SIGKILLed and not restarted, with `trainer.elastic=true`: the run
//!   finishes at world size 1 with the 2-rank run's losses within 1e-5, and `ferl status` shows the restart;
//! - the keys refused where they cannot act (under torchrun/SLURM, `elastic` without restarts).

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use ferl_actors::sft::{read_summary, RunSummary};
use ferl_config::SftConfig;
use ferl_tests::cluster::{wait_for_step, LoopbackCluster};
use ferl_tests::{driver_command, reference_run, run_path, Fixture, LaunchPath};
use ferl_trainer::run::{check, LaunchShape};

const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");

/// Processes whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

/// The worker processes under `parent` hosting a trainer rank (their stdout is `worker-<id>-ferl_actors_TrainerRank.log`).
fn trainer_rank_workers(parent: u32) -> Vec<u32> {
    children_of(parent)
        .into_iter()
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/fd/1"))
                .is_ok_and(|p| p.to_string_lossy().ends_with("_TrainerRank.log"))
        })
        .collect()
}

fn sigkill(pid: u32) {
    // SAFETY: kill has no memory preconditions.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill -9 {pid}");
}

/// Waits for the run's end (printing how long it took after the kill, and its warnings) and reads its summary.
fn finish(child: Child, summary: &Path) -> RunSummary {
    let killed = Instant::now();
    let out = child.wait_with_output().unwrap();
    eprintln!(
        "the run finished {:.1} s after the kill; its warnings:\n{}",
        killed.elapsed().as_secs_f64(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the run failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    read_summary(summary).unwrap()
}

fn assert_steps_match(what: &str, got: &RunSummary, want: &RunSummary, from: u64, rel: f64) {
    let mut worst: f64 = 0.0;
    for w in want.steps.iter().filter(|s| s.step >= from) {
        let g = got
            .steps
            .iter()
            .find(|s| s.step == w.step)
            .unwrap_or_else(|| panic!("{what}: no step {}", w.step));
        for (name, a, b) in [
            ("loss", g.loss, w.loss),
            ("grad_norm", g.grad_norm, w.grad_norm),
        ] {
            let err = (a - b).abs() / b.abs().max(1e-12);
            worst = worst.max(err);
            assert!(
                err <= rel,
                "{what}: step {} {name} {a} vs {b} ({err:e} > {rel:e})",
                w.step
            );
        }
    }
    eprintln!("{what}: steps {from}.. match within {worst:e} relative (tolerance {rel:e})");
}

#[test]
fn a_killed_rank_restarts_from_the_last_checkpoint_with_the_uninterrupted_losses() {
    let fx = Fixture::new().unwrap();
    let extra = [
        "trainer.save_freq=2",
        "trainer.logger=[console,jsonl]",
        "trainer.max_restarts=1",
    ];
    let clean_o = fx.overrides(10, "clean", &extra);
    let clean = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::Actors(2),
        &clean_o,
        "clean",
    )
    .unwrap();
    assert!(clean.restarts.is_empty());

    let o = fx.overrides(10, "killed", &extra);
    let root = fx.dir.path().join("killed");
    let summary = fx.dir.path().join("summary-killed.json");
    let mut child = driver_command(DRIVER)
        .args(["--nproc-per-node", "2", "--summary"])
        .arg(&summary)
        .args(&o)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_step(&mut child, &root, 5, Duration::from_secs(300));
    let ranks = trainer_rank_workers(child.id());
    assert_eq!(ranks.len(), 2, "trainer rank workers of the run: {ranks:?}");
    sigkill(ranks[1]);
    let got = finish(child, &summary);

    assert_eq!(got.restarts.len(), 1, "{:?}", got.restarts);
    let r = &got.restarts[0];
    assert_eq!(r.cause_kind, "rank_lost", "{r:?}");
    assert_eq!(r.world_size, 2);
    assert!(
        r.resumed_from >= 4 && r.resumed_from.is_multiple_of(2),
        "{r:?}"
    );
    assert_eq!(got.global_step, 10);
    assert_steps_match("after a killed rank", &got, &clean, 6, 1e-6);
    let metrics = std::fs::read_to_string(root.join("metrics.jsonl")).unwrap();
    assert!(
        metrics.contains("\"system/restarts\":1.0")
            && metrics.contains("\"system/restarts/rank_lost\":1.0"),
        "metrics.jsonl has no restart:\n{metrics}"
    );
}

#[test]
fn a_lost_node_with_elastic_finishes_at_world_one_with_the_same_losses() {
    let fx = Fixture::new().unwrap();
    let cluster = LoopbackCluster::start(&[1, 1]);
    let extra = [
        "trainer.save_freq=2",
        "trainer.logger=[console,jsonl]",
        "trainer.max_restarts=1",
        "trainer.elastic=true",
        "trainer.restart_wait_s=6",
    ];
    let o = fx.overrides(10, "elastic", &extra);
    let root = fx.dir.path().join("elastic");
    let summary = fx.dir.path().join("summary-elastic.json");
    let mut child = driver_command(DRIVER)
        .env("FERL_TMPDIR", cluster.dir.path().join("state"))
        .args([
            "--nproc-per-node",
            "1",
            "--nnodes",
            "2",
            "--address",
            &cluster.address,
        ])
        .arg("--summary")
        .arg(&summary)
        .args(&o)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_step(&mut child, &root, 5, Duration::from_secs(300));
    sigkill(cluster.pids[1]);
    let got = finish(child, &summary);

    assert_eq!(got.world_size, 1, "the run should end at world size 1");
    assert_eq!(got.restarts.len(), 1, "{:?}", got.restarts);
    assert_eq!(got.restarts[0].world_size, 1);
    assert_eq!(got.global_step, 10);
    let want = reference_run(&fx.overrides(10, "reference", &[])).unwrap();
    let want = RunSummary {
        steps: want,
        ..RunSummary::default()
    };
    assert_steps_match("elastic 2 -> 1", &got, &want, 1, 1e-5);
    let status = cluster.status();
    let job = status["jobs"]
        .as_array()
        .and_then(|j| j.first())
        .unwrap_or_else(|| panic!("no job in `ferl status`: {status:#}"));
    assert_eq!(job["state"], "finished", "{job:#}");
    assert_eq!(job["restarts"].as_array().map(Vec::len), Some(1), "{job:#}");
    assert_eq!(job["world_size"], 1, "{job:#}");
}

#[test]
fn restart_keys_are_refused_where_they_cannot_act() {
    let fx = Fixture::new().unwrap();
    let shape = |restarts_ranks| LaunchShape {
        world_size: 2,
        local_device: true,
        loggers: vec!["console".into()],
        restarts_ranks,
    };
    let cfg = |extra: &[&str]| SftConfig::load(None, &fx.overrides(2, "refused", extra)).unwrap();
    let restarts = cfg(&["trainer.max_restarts=2"]);
    check(&restarts, &shape(true)).unwrap();
    let err = format!("{:#}", check(&restarts, &shape(false)).unwrap_err());
    assert!(
        err.contains("trainer.max_restarts=2") && err.contains("torchrun --max-restarts"),
        "{err}"
    );
    let elastic = cfg(&["trainer.elastic=true"]);
    let err = format!("{:#}", check(&elastic, &shape(true)).unwrap_err());
    assert!(
        err.contains("trainer.elastic=true") && err.contains("trainer.max_restarts"),
        "{err}"
    );
    // The launcher path refuses before it forms a group.
    let o = fx.overrides(2, "launcher", &["trainer.max_restarts=1"]);
    let err = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::Launcher(2),
        &o,
        "launcher",
    )
    .unwrap_err();
    assert!(err.contains("trainer.max_restarts=1"), "{err}");
}
