//! Jobs that belong to the cluster, end to end with real processes on a loopback cluster (`ferl start`):
//! - a driver (`ferl sft --address`) SIGKILLed, then another SIGTERMed, mid-run: within the heartbeat bound the head
//!   removes its resource group and kills its actors, `ferl status` shows the job `failed: driver lost`, and the
//!   next job gets the resources at once;
//! - `--nnodes 2 --nproc-per-node 1` puts one rank on each of two nodes that could each hold both, and `--nnodes 3`
//!   on two nodes is refused at once naming the shortfall.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferl_tests::cluster::{wait_for_step, LoopbackCluster};
use ferl_tests::Fixture;

/// The head's heartbeat bound in these tests (the default).
const BOUND: Duration = Duration::from_secs(3);

/// CPUs reserved on every node now, from `ferl status`.
fn cpus_used(status: &serde_json::Value) -> f64 {
    status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["resources_used"]["CPU"].as_f64())
        .sum()
}

/// Waits until the cluster holds no group and no reserved CPU and the job `name` says `state`; how long that took.
fn wait_freed(cluster: &LoopbackCluster, name: &str, state: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let status = cluster.status();
        let groups = status["groups"].as_array().map_or(0, Vec::len);
        let job = status["jobs"]
            .as_array()
            .and_then(|j| j.iter().find(|j| j["name"] == name).cloned());
        let freed = groups == 0 && cpus_used(&status) == 0.0;
        if freed && job.as_ref().is_some_and(|j| j["state"] == state) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < within,
            "not freed within {within:?} (groups {groups}, job {job:?}):\n{status:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Starts a long `ferl sft --address … --nproc-per-node 2` driver, sends it `signal` at step 2 and asserts the head
/// frees its group, CPUs and actors and marks its job `failed: driver lost` within the bound.
fn kill_driver_mid_run(cluster: &LoopbackCluster, fx: &Fixture, signal: i32, name: &str) {
    let root = fx.dir.path().join(name);
    let mut driver = sft_two_ranks(cluster, fx, 1000, name)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_step(&mut driver, &root, 2, Duration::from_secs(180));
    let running = cluster.status();
    assert_eq!(
        running["groups"].as_array().map(Vec::len),
        Some(1),
        "{running:#}"
    );
    assert_eq!(cpus_used(&running), 2.0, "{running:#}");
    assert_eq!(
        running["drivers"].as_array().map(Vec::len),
        Some(1),
        "{running:#}"
    );
    // SAFETY: kill has no memory preconditions.
    assert_eq!(unsafe { libc::kill(driver.id() as i32, signal) }, 0);
    let killed = Instant::now();
    let job = format!("sft-{}", driver.id());
    driver.wait().unwrap();
    wait_freed(cluster, &job, "failed: driver lost", BOUND * 3);
    let freed = killed.elapsed();
    println!(
        "{name}: the group, its CPUs and the job freed {:.2} s after the signal (bound {BOUND:?})",
        freed.as_secs_f64()
    );
    // The bound, one check period, the stops and a `ferl status` on a loaded 2-core machine.
    assert!(
        freed < BOUND + Duration::from_secs(3),
        "{name}: freed after {freed:?}"
    );
    let status = cluster.status();
    assert_eq!(
        status["drivers"].as_array().map(Vec::len),
        Some(0),
        "{status:#}"
    );
    let alive: Vec<_> = status["actors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["state"] == "alive" || a["state"] == "starting")
        .collect();
    assert!(alive.is_empty(), "{name}: actors left alive: {alive:?}");
}

/// `ferl sft --address … --nproc-per-node 2` of `steps` steps with checkpoints under `name`, on `cluster`.
fn sft_two_ranks(cluster: &LoopbackCluster, fx: &Fixture, steps: usize, name: &str) -> Command {
    let mut cmd = cluster.command();
    cmd.args([
        "sft",
        "--address",
        &cluster.address,
        "--nproc-per-node",
        "2",
    ])
    .args(fx.overrides(steps, name, &EXTRA));
    cmd
}

/// Keys of these runs beyond the fixture's.
const EXTRA: [&str; 2] = ["trainer.logger=[console,jsonl]", "trainer.save_freq=-1"];

#[test]
fn a_killed_or_terminated_driver_frees_its_job_within_the_bound_and_the_next_job_starts_at_once() {
    let fx = Fixture::new().unwrap();
    let cluster = LoopbackCluster::start(&[2]);
    kill_driver_mid_run(&cluster, &fx, libc::SIGKILL, "SIGKILL");
    kill_driver_mid_run(&cluster, &fx, libc::SIGTERM, "SIGTERM");
    // The next job reserves at once: it never waits for busy resources, and finishes.
    let t0 = Instant::now();
    let out = sft_two_ranks(&cluster, &fx, 2, "next").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the next job failed:\n{err}");
    assert!(
        !err.contains("waiting up to"),
        "the next job waited for resources:\n{err}"
    );
    println!("the next job ran in {:.1} s", t0.elapsed().as_secs_f64());
    let status = cluster.status();
    let mut counts = BTreeMap::new();
    for state in status["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|j| j["state"].as_str())
    {
        *counts.entry(state.to_string()).or_insert(0) += 1;
    }
    let want = BTreeMap::from([
        ("failed: driver lost".to_string(), 2),
        ("finished".to_string(), 1),
    ]);
    assert_eq!(counts, want, "{status:#}");
}

#[test]
fn nnodes_puts_nproc_per_node_ranks_on_each_of_that_many_distinct_nodes() {
    let fx = Fixture::new().unwrap();
    // Each node could hold both ranks: packing would put them on one.
    let cluster = LoopbackCluster::start(&[2, 2]);
    let out = cluster
        .command()
        .args([
            "sft",
            "--address",
            &cluster.address,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
        ])
        .args(fx.overrides(1, "nnodes", &[]))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let placed: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("trainer ranks "))
        .collect();
    println!("{}", placed.join("\n"));
    assert_eq!(placed.len(), 2, "a line per node:\n{text}");
    assert!(
        placed
            .iter()
            .any(|l| l.starts_with("trainer ranks [0] on node-")),
        "{text}"
    );
    assert!(
        placed
            .iter()
            .any(|l| l.starts_with("trainer ranks [1] on node-")),
        "{text}"
    );
    let node = |l: &str| {
        l.split(" on ")
            .nth(1)
            .unwrap()
            .split(':')
            .next()
            .unwrap()
            .to_string()
    };
    assert_ne!(node(placed[0]), node(placed[1]), "{text}");

    let t0 = Instant::now();
    let out = cluster
        .command()
        .args([
            "sft",
            "--address",
            &cluster.address,
            "--nnodes",
            "3",
            "--nproc-per-node",
            "1",
        ])
        .args(fx.overrides(1, "nnodes3", &["data.train_batch_size=6"]))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "--nnodes 3 on 2 nodes ran");
    for want in [
        "placing 1 CPU rank(s) on each of 3 distinct nodes (--nnodes 3 --nproc-per-node 1)",
        "3 nodes that can each hold 1 bundles {CPU: 1} are needed; the cluster has 2 such node(s) of 2",
    ] {
        assert!(err.contains(want), "no `{want}` in:\n{err}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "refused only after {:?}",
        t0.elapsed()
    );
}
