//! Failures: a worker killed with SIGKILL, a node agent killed, and the events the driver sees.

mod common;

use std::time::{Duration, Instant};

use ferl_runtime::testbed::*;
use ferl_runtime::{bundle, Error, Event, SpawnOptions};

fn sigkill(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_5_sigkilled_worker_fails_callers_and_restartable_actor_returns() {
    let cluster = common::cluster().await;
    let mut events = cluster.events();
    let actor = cluster
        .spawn::<Counter>(5, SpawnOptions::new().max_restarts(1))
        .await
        .unwrap();
    let pid = actor.call(Pid).await.unwrap();
    let pending = {
        let a = actor.clone();
        tokio::spawn(async move { a.call(Sleep(60_000)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    sigkill(pid);
    let err = tokio::time::timeout(Duration::from_secs(20), pending)
        .await
        .expect("never hang")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, Error::ActorDied { actor, node, .. } if actor.contains("Counter") && node.starts_with("node-")),
        "{err}"
    );
    // The constructor runs again: the count restarts at 5, in a new process.
    let t0 = Instant::now();
    let new_pid = loop {
        match actor.call(Pid).await {
            Ok(p) => break p,
            Err(_) if t0.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("restarted actor never answered: {e}"),
        }
    };
    assert_ne!(new_pid, pid);
    assert_eq!(actor.call(Get).await.unwrap(), 5);
    let mut saw_restart = false;
    while let Ok(ev) = events.try_recv() {
        saw_restart |= matches!(ev, Event::ActorRestarted { actor: ref a } if a.id == actor.id());
    }
    assert!(saw_restart, "the driver is told about the restart");
    // No restarts left: the next kill is final.
    sigkill(new_pid);
    let t0 = Instant::now();
    loop {
        match actor.call(Get).await {
            Err(Error::ActorDied { reason, .. }) => {
                assert!(reason.contains("max_restarts = 1"), "{reason}");
                break;
            }
            other => {
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "still answering after SIGKILL: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_6_killed_node_agent_is_detected_within_the_bound() {
    let bound = Duration::from_millis(1500);
    let head = common::head(2.0, bound).await;
    let mut node = common::node(
        &head,
        &[
            "--num-cpus",
            "2",
            "--resources",
            "special=1",
            "--heartbeat-ms",
            "1500",
        ],
        &[],
    );
    let cluster = &head.cluster;
    let mut events = cluster.events();
    let actor = cluster
        .spawn::<Counter>(
            1,
            SpawnOptions::new().resources(bundle(&[("special", 1.0)])),
        )
        .await
        .unwrap();
    assert_eq!(actor.address().node, node.name);
    let pending = {
        let a = actor.clone();
        tokio::spawn(async move { a.call(Sleep(60_000)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    node.child.kill().unwrap();
    let t0 = Instant::now();
    let deadline = bound * 4 + Duration::from_secs(5);
    loop {
        let ev = tokio::time::timeout(deadline, events.recv())
            .await
            .expect("node death detected")
            .unwrap();
        if let Event::NodeDied { node: n, reason } = ev {
            assert_eq!(n, node.name);
            assert!(reason.contains("heartbeats"), "{reason}");
            break;
        }
    }
    assert!(t0.elapsed() < deadline, "detected after {:?}", t0.elapsed());
    let err = tokio::time::timeout(Duration::from_secs(5), pending)
        .await
        .expect("pending call fails")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, Error::ActorDied { node: n, .. } if *n == node.name),
        "{err}"
    );
    let status = cluster.status().await.unwrap();
    let dead = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == node.name.as_str())
        .unwrap()
        .clone();
    assert_eq!(dead["alive"], false);
}
