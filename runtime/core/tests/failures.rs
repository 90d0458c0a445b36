//! Failures: a worker killed with SIGKILL, a node agent killed, a head stalled, and the events the driver sees.

mod common;

use std::time::{Duration, Instant};

use ferl_runtime::testbed::*;
use ferl_runtime::{bundle, Error, Event, SpawnOptions, Strategy};

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
    let actor_id = actor.id();
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
        matches!(&err, Error::ActorDied { actor, id, node, .. }
            if actor.contains("Counter") && *id == actor_id && node.starts_with("node-")),
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

/// Flags of a node agent with 2 CPUs, one `special` resource and its own heartbeat bound.
fn special_node_flags(bound_ms: &str) -> [&str; 6] {
    [
        "--num-cpus",
        "2",
        "--resources",
        "special=1",
        "--heartbeat-ms",
        bound_ms,
    ]
}

/// A head with heartbeat bound `bound`, a node agent process started with `--heartbeat-ms node_bound_ms` and one
/// `special` resource, and a counter actor placed on that node.
async fn head_and_node_with_an_actor(
    bound: Duration,
    node_bound_ms: &str,
) -> (
    ferl_runtime::HeadHandle,
    common::NodeProc,
    ferl_runtime::ActorRef<Counter>,
) {
    let head = common::head(2.0, bound).await;
    let node = common::node(&head, &special_node_flags(node_bound_ms), &[]);
    let actor = head
        .cluster
        .spawn::<Counter>(
            1,
            SpawnOptions::new().resources(bundle(&[("special", 1.0)])),
        )
        .await
        .unwrap();
    assert_eq!(actor.address().node, node.name);
    (head, node, actor)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_6_killed_node_agent_is_detected_within_the_bound() {
    let bound = Duration::from_millis(1500);
    let (head, mut node, actor) = head_and_node_with_an_actor(bound, "1500").await;
    let cluster = &head.cluster;
    let mut events = cluster.events();
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

/// Fails if `events` holds a `NodeDied` now or within `wait`.
async fn assert_no_node_dies(
    events: &mut tokio::sync::broadcast::Receiver<Event>,
    wait: Duration,
    when: &str,
) {
    let deadline = Instant::now() + wait;
    while let Ok(ev) = tokio::time::timeout_at(deadline.into(), events.recv()).await {
        if let Ok(Event::NodeDied { node, reason }) = ev {
            panic!("{when}: {node} declared dead: {reason}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_6_nodes_beat_at_the_heads_rate_and_a_stalled_head_keeps_them() {
    let bound = Duration::from_millis(1500);
    // The node's own bound would have it beat every 15 s; it must beat at the head's rate instead.
    let (head, _node, actor) = head_and_node_with_an_actor(bound, "60000").await;
    let cluster = &head.cluster;
    let mut events = cluster.events();
    assert_no_node_dies(&mut events, bound * 3, "a node started with a longer bound").await;
    // Stall the head's process: both runtime threads block for 4 s, beyond the bound, while the node keeps
    // beating into unread sockets. The barrier proves both threads are held.
    let stalled = std::sync::Arc::new(std::sync::Barrier::new(2));
    let blockers: Vec<_> = (0..2)
        .map(|_| {
            let stalled = stalled.clone();
            tokio::spawn(async move {
                stalled.wait();
                std::thread::sleep(Duration::from_secs(4));
            })
        })
        .collect();
    for b in blockers {
        b.await.unwrap();
    }
    assert_no_node_dies(&mut events, bound * 2, "after the head's stall").await;
    assert_eq!(actor.call(Add(1)).await.unwrap(), 2);
    let status = cluster.status().await.unwrap();
    let nodes = status["nodes"].as_array().unwrap();
    assert!(nodes.iter().all(|n| n["alive"] == true), "{status}");
}

/// Waits (generously) for a call to succeed again after a failure.
async fn answer_again(actor: &ferl_runtime::ActorRef<Counter>) -> u32 {
    let t0 = Instant::now();
    loop {
        match actor.call(Pid).await {
            Ok(p) => return p,
            Err(e) if t0.elapsed() < Duration::from_secs(60) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("the actor never answered again: {e}"),
        }
    }
}

/// A head (1.5 s heartbeat bound) and two node agents, each with 2 CPUs and one `special` resource.
async fn head_and_two_special_nodes(
) -> (ferl_runtime::HeadHandle, common::NodeProc, common::NodeProc) {
    let head = common::head(2.0, Duration::from_millis(1500)).await;
    let flags = special_node_flags("1500");
    let first = common::node(&head, &flags, &[]);
    let second = common::node(&head, &flags, &[]);
    (head, first, second)
}

/// Calls `actor` until it answers `ActorDied` with a reason containing `reason_part` (within 60 s); returns the
/// reason and the node the error names.
async fn final_death(
    actor: &ferl_runtime::ActorRef<Counter>,
    reason_part: &str,
) -> (String, String) {
    let t0 = Instant::now();
    loop {
        match actor.call(Get).await {
            Err(Error::ActorDied { reason, node, .. }) if reason.contains(reason_part) => {
                return (reason, node)
            }
            other => {
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "no `{reason_part}` verdict yet: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The entry of node `name` in a `ferl status` JSON.
fn status_node(status: &serde_json::Value, name: &str) -> serde_json::Value {
    status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == name)
        .unwrap()
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_12_actors_of_a_dead_node_restart_on_another_node() {
    let (head, mut first, second) = head_and_two_special_nodes().await;
    let cluster = &head.cluster;
    let mut events = cluster.events();
    let actor = cluster
        .spawn::<Counter>(
            5,
            SpawnOptions::new()
                .resources(bundle(&[("special", 1.0)]))
                .max_restarts(2)
                .name("ns", "movable"),
        )
        .await
        .unwrap();
    // Placement packs onto the first node that has `special`.
    assert_eq!(actor.address().node, first.name);
    assert_eq!(actor.call(Add(10)).await.unwrap(), 15);
    let old_pid = actor.call(Pid).await.unwrap();
    let pending = {
        let a = actor.clone();
        tokio::spawn(async move { a.call(Sleep(60_000)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    first.child.kill().unwrap(); // SIGKILL: its workers die with it
    let err = tokio::time::timeout(Duration::from_secs(20), pending)
        .await
        .expect("the pending call fails instead of hanging")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, Error::ActorDied { actor: a, node, .. }
            if a.contains("Counter") && a.contains(&actor.id().to_string()) && *node == first.name),
        "{err}"
    );
    // The head notices within the bound, then re-creates the actor on the node that still has `special`.
    let t0 = Instant::now();
    let moved = loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), events.recv())
            .await
            .expect("a restart on another node")
            .unwrap();
        match ev {
            Event::ActorRestarting { id, node, .. } if id == actor.id() => {
                assert_eq!(node, first.name, "the restart names the dead node");
            }
            Event::ActorRestarted { actor: a } if a.id == actor.id() => break a,
            Event::ActorDied { id, reason, .. } if id == actor.id() => {
                panic!("died instead of moving: {reason}")
            }
            _ => {}
        }
    };
    assert!(t0.elapsed() < Duration::from_secs(60));
    assert_eq!(moved.node, second.name);
    // The same handle reaches the new instance; its constructor ran again (the count is back at 5).
    let new_pid = answer_again(&actor).await;
    assert_ne!(new_pid, old_pid);
    assert_eq!(actor.call(Get).await.unwrap(), 5);
    // The name resolves to the new instance.
    let named = cluster
        .get_actor::<Counter>("ns", "movable")
        .await
        .unwrap()
        .expect("the name survives the move");
    assert_eq!(named.id(), actor.id());
    assert_eq!(named.address().node, second.name);
    assert_eq!(named.call(Pid).await.unwrap(), new_pid);
    // Its reservation moved with it: the second node's `special` is in use, the dead node holds nothing.
    let status = cluster.status().await.unwrap();
    assert_eq!(
        status_node(&status, &second.name)["resources_used"]["special"],
        1.0
    );
    assert_eq!(status_node(&status, &first.name)["alive"], false);
    // With no node left that has `special`, the next node death is final (restarts left or not) and says why.
    let second_name = second.name.clone();
    drop(second);
    let (reason, node) = final_death(&actor, "no live node can host it").await;
    assert!(reason.contains("special"), "{reason}");
    assert_eq!(node, second_name);
    head.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_12_actors_of_a_lost_bundle_die_with_the_reason_and_the_group_stays_removable() {
    let (head, mut doomed, survivor) = head_and_two_special_nodes().await;
    let cluster = &head.cluster;
    let group = cluster
        .create_group(
            vec![bundle(&[("special", 1.0)]); 2],
            Strategy::StrictSpread,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let on = |name: &str| group.nodes.iter().position(|n| n == name).unwrap();
    let (lost_b, kept_b) = (on(&doomed.name), on(&survivor.name));
    let spawn = |b: usize| {
        cluster.spawn::<Counter>(
            b as u64,
            SpawnOptions::new().in_bundle(&group, b).max_restarts(3),
        )
    };
    let lost = spawn(lost_b).await.unwrap();
    let kept = spawn(kept_b).await.unwrap();
    doomed.child.kill().unwrap();
    let (reason, node) = final_death(&lost, "bundle").await;
    assert_eq!(node, doomed.name);
    assert!(
        reason.contains(&format!("bundle {lost_b} of resource group {}", group.id))
            && reason.contains("remove the group"),
        "{reason}"
    );
    // max_restarts does not move it: it stays dead.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(matches!(lost.call(Get).await, Err(Error::ActorDied { .. })));
    // The other bundle's actor is untouched.
    assert_eq!(kept.call(Get).await.unwrap(), kept_b as u64);
    // Spawning into the lost bundle fails at once, saying why.
    let err = spawn(lost_b).await.unwrap_err().to_string();
    assert!(err.contains("lost bundle"), "{err}");
    let status = cluster.status().await.unwrap();
    let g = status["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["id"] == group.id)
        .unwrap()
        .clone();
    assert!(g["bundles"][lost_b]["lost"]
        .as_str()
        .unwrap()
        .contains(&doomed.name));
    assert!(g["bundles"][kept_b]["lost"].is_null());
    // Removing the group stops the surviving actor and frees the survivor's reservation.
    cluster.remove_group(&group).await.unwrap();
    assert!(matches!(kept.call(Get).await, Err(Error::ActorDied { .. })));
    let status = cluster.status().await.unwrap();
    assert_eq!(
        status_node(&status, &survivor.name)["resources_used"]["special"],
        0.0
    );
    head.cluster.shutdown().await;
}
