//! Jobs the cluster owns, through the CLI on a loopback cluster (`ferl start`), as a user runs them (guarantee 18 in
//! `runtime/README.md`): `ferl job submit` a short `ferl sft` driver that joins the cluster through the
//! `FERL_ADDRESS`/`FERL_TOKEN` the head gives it, follow its log to the end, see it SUCCEEDED; stop a job that
//! ignores SIGTERM (killed after the grace period, its whole process group gone); stop a long `ferl sft` job and see
//! its resource group freed by fate-sharing; a failing job says its exit code; `ferl job list` and
//! `ferl status --json` list them all; an unknown id is refused naming it. `ferl logs` reads the node's log folder
//! through its node agent: the list, a job's log, a finished actor's worker log followed to its end, and refusals.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use ferl_tests::cluster::{logged_step, LoopbackCluster};
use ferl_tests::{ferl_binary, Fixture};

/// `ferl logs --address <cluster> ARGS...`, failing the test if it runs longer than 30 s.
fn logs(cluster: &LoopbackCluster, args: &[&str]) -> Output {
    let mut child = cluster
        .command()
        .args(["logs", "--address", &cluster.address])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("ferl logs {args:?} still runs after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// `ferl logs` on node-1 (the head's node): its files, a job's log, a finished actor's worker log, refusals.
fn read_node_logs(cluster: &LoopbackCluster) {
    let listed = ok("logs --node node-1", logs(cluster, &["--node", "node-1"]));
    let files: Vec<&str> = listed
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    for job in ["job-1.log", "job-2.log", "job-3.log", "job-4.log"] {
        assert!(files.contains(&job), "{listed}");
    }
    let via_node = ok(
        "logs job-1.log",
        logs(cluster, &["--node", "node-1", "job-1.log"]),
    );
    assert_eq!(
        via_node,
        ok("job logs job-1", job(cluster, "logs", &["job-1"]))
    );
    // An actor of job-1, dead since its driver finished: following its worker's log ends at once.
    let status = cluster.status();
    let dead = status["actors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["state"].as_str().is_some_and(|s| s.starts_with("dead")))
        .unwrap_or_else(|| panic!("no dead actor:\n{status:#}"));
    let id = dead["id"].to_string();
    let file = files
        .iter()
        .find(|f| f.starts_with(&format!("worker-{id}-")))
        .unwrap_or_else(|| panic!("no log of actor {id}:\n{listed}"));
    let followed = ok("logs --actor", logs(cluster, &["--actor", &id, "--follow"]));
    assert_eq!(
        followed,
        ok("logs worker", logs(cluster, &["--node", "node-1", file]))
    );
    println!(
        "actor {id}'s worker log ({file}): {} bytes, followed to its end",
        followed.len()
    );
    for (args, want) in [
        (
            vec!["--node", "node-1", "../token"],
            "no log `../token` on node-1",
        ),
        (
            vec!["--node", "node-9"],
            "no node named `node-9` in the cluster (nodes: node-1)",
        ),
        (vec!["--actor", "999"], "no actor 999 in the cluster"),
    ] {
        let out = logs(cluster, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{args:?}: {err}"
        );
    }
}

/// `ferl job SUB --address <cluster> ARGS...`.
fn job(cluster: &LoopbackCluster, sub: &str, args: &[&str]) -> Output {
    cluster
        .command()
        .args(["job", sub, "--address", &cluster.address])
        .args(args)
        .output()
        .unwrap()
}

/// Its stdout, after asserting it succeeded.
fn ok(what: &str, out: Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{what} failed:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The pids of the live processes in process group `pgid` (field 5 of `/proc/PID/stat`; zombies, dead but not yet
/// reaped by whoever inherited them, are left out).
fn group_members(pgid: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp ...`: comm may hold spaces, so count after its closing parenthesis.
        let after = &stat[stat.rfind(')').unwrap_or(0) + 1..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        if fields.get(2) == Some(&pgid.to_string().as_str()) && fields.first() != Some(&"Z") {
            pids.push(pid);
        }
    }
    pids
}

/// `ferl job submit --working-dir <fixture> -- <ferl> sft --nproc-per-node 1 <steps steps, checkpoints off>`; the id.
fn submit_sft(cluster: &LoopbackCluster, fx: &Fixture, steps: usize, root: &str) -> String {
    let ferl = ferl_binary().display().to_string();
    let workdir = fx.dir.path().display().to_string();
    let mut args = vec![
        "--working-dir",
        &workdir,
        "--",
        &ferl,
        "sft",
        "--nproc-per-node",
        "1",
    ];
    let extra = ["trainer.save_freq=-1", "trainer.logger=[console,jsonl]"];
    let overrides = fx.overrides(steps, root, &extra);
    args.extend(overrides.iter().map(String::as_str));
    ok("submit sft", job(cluster, "submit", &args))
        .trim()
        .to_string()
}

/// Waits until `check` holds, failing with `what` after `within`.
fn wait_until(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !check() {
        assert!(t0.elapsed() < within, "{what} not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stops job-2, which ignores SIGTERM as does the `sleep` it started: SIGKILL after the 1 s grace takes its group.
fn stop_the_stubborn_job(cluster: &LoopbackCluster) {
    let running = ok("status job-2", job(cluster, "status", &["job-2"]));
    assert!(running.starts_with("job-2 RUNNING "), "{running}");
    let pid: u32 = ferl_tests::field(&running, "pid=").parse().unwrap();
    wait_until("job-2's sleep", Duration::from_secs(10), || {
        group_members(pid).len() == 2
    });
    let asked = Instant::now();
    let stopped = ok(
        "stop job-2",
        job(cluster, "stop", &["--grace-s", "1", "job-2"]),
    );
    let took = asked.elapsed();
    assert!(stopped.starts_with("job-2 STOPPED "), "{stopped}");
    assert!(took < Duration::from_secs(5), "the stop took {took:?}");
    assert!(
        took >= Duration::from_secs(1),
        "the stop answered before the grace period ended ({took:?}) though the job ignores SIGTERM"
    );
    // SIGKILL reaches the group's other members as the leader dies; give the kernel a moment.
    wait_until("job-2's process group gone", Duration::from_secs(1), || {
        group_members(pid).is_empty()
    });
    println!("job-2 stopped in {:.2} s (grace 1 s)", took.as_secs_f64());
}

/// Follows job-1 (a 2-step `ferl sft`) through its end: SUCCEEDED, with an end time.
fn follow_the_training_job(cluster: &LoopbackCluster) {
    let log = ok(
        "logs --follow job-1",
        job(cluster, "logs", &["--follow", "job-1"]),
    );
    assert!(log.contains("trained steps 1..2 on 1 rank(s)"), "{log}");
    let status = ok("status job-1", job(cluster, "status", &["job-1"]));
    assert!(status.starts_with("job-1 SUCCEEDED start="), "{status}");
    assert!(!status.contains("end=- "), "{status}");
    // A plain `logs` after the end prints the same log.
    assert_eq!(ok("logs job-1", job(cluster, "logs", &["job-1"])), log);
}

/// Stops job-4, a long `ferl sft` that has trained a step: STOPPED, and the head frees its driver's resource group
/// within the heartbeat bound (3 s) and a little.
fn stop_the_long_training_job(cluster: &LoopbackCluster, root: &std::path::Path) {
    wait_until("job-4's first step", Duration::from_secs(60), || {
        logged_step(root) >= 1
    });
    assert_eq!(cluster.status()["groups"].as_array().map(Vec::len), Some(1));
    let asked = Instant::now();
    let stopped = ok("stop job-4", job(cluster, "stop", &["job-4"]));
    assert!(stopped.starts_with("job-4 STOPPED "), "{stopped}");
    wait_until("job-4's group freed", Duration::from_secs(6), || {
        cluster.status()["groups"]
            .as_array()
            .is_some_and(Vec::is_empty)
    });
    println!(
        "job-4 stopped and its resource group freed {:.2} s after `ferl job stop`",
        asked.elapsed().as_secs_f64()
    );
    // Its driver's run record says it was stopped, not lost.
    let status = cluster.status();
    let runs = status["jobs"].as_array().unwrap();
    assert!(
        runs.iter().any(|r| r["state"] == "stopped"),
        "no run record says `stopped`:\n{status:#}"
    );
}

/// `ferl job list` and `ferl status --json` list the four jobs; the 2-step sft ran in this cluster (its run record).
fn check_the_listings(cluster: &LoopbackCluster, workdir: &str) {
    let list = ok("list", job(cluster, "list", &[]));
    let states: Vec<(&str, &str)> = list
        .lines()
        .map(|l| {
            let mut words = l.split(' ');
            (words.next().unwrap(), words.next().unwrap())
        })
        .collect();
    let want = [
        ("job-1", "SUCCEEDED"),
        ("job-2", "STOPPED"),
        ("job-3", "FAILED"),
        ("job-4", "STOPPED"),
    ];
    assert_eq!(states, want, "{list}");
    assert!(list.contains("job-3 FAILED (exit code 3) "), "{list}");
    let status = cluster.status();
    let submitted = status["submitted_jobs"].as_array().unwrap();
    assert_eq!(submitted.len(), 4, "{status:#}");
    assert_eq!(submitted[0]["working_dir"], workdir, "{status:#}");
    assert_eq!(submitted[1]["state"], "STOPPED", "{status:#}");
    let runs = status["jobs"].as_array().unwrap();
    assert!(
        runs.iter().any(|r| r["state"] == "finished"),
        "the submitted sft did not run in this cluster:\n{status:#}"
    );
}

/// An unknown id is refused naming it and the jobs there are; so is a working directory the head lacks.
fn refusals(cluster: &LoopbackCluster) {
    for sub in ["status", "logs", "stop"] {
        let out = job(cluster, sub, &["job-99"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{sub} job-99 succeeded");
        let want = "no job `job-99` in this cluster (jobs: job-1, job-2, job-3, job-4)";
        assert!(err.contains(want), "{sub}: {err}");
    }
    let out = job(
        cluster,
        "submit",
        &["--working-dir", "/no/such/dir", "--", "true"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("`/no/such/dir`"),
        "{err}"
    );
}

#[test]
fn guarantee_18_submitted_jobs_run_on_the_head_and_are_followed_stopped_and_listed_from_the_cli() {
    let fx = Fixture::new().unwrap();
    let cluster = LoopbackCluster::start(&[2]);
    let t0 = Instant::now();
    assert_eq!(submit_sft(&cluster, &fx, 2, "short"), "job-1");
    let stubborn = ["--", "sh", "-c", "trap '' TERM; sleep 600; true"];
    assert_eq!(
        ok("submit sleep", job(&cluster, "submit", &stubborn)).trim(),
        "job-2"
    );
    let failing = ["--", "sh", "-c", "exit 3"];
    assert_eq!(
        ok("submit exit 3", job(&cluster, "submit", &failing)).trim(),
        "job-3"
    );
    assert_eq!(submit_sft(&cluster, &fx, 1000, "long"), "job-4");
    stop_the_stubborn_job(&cluster);
    follow_the_training_job(&cluster);
    read_node_logs(&cluster);
    println!(
        "job-1 trained and was followed to its end in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    stop_the_long_training_job(&cluster, &fx.dir.path().join("long"));
    check_the_listings(&cluster, &fx.dir.path().display().to_string());
    refusals(&cluster);
}
