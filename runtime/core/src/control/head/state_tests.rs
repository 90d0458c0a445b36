//! Unit tests of the head's pure state: admission, groups, heartbeats, node loss, recovery and worker exits, with
//! no processes, sockets or async runtime.

use super::*;

const BOUND: Duration = Duration::from_secs(3);

fn res(pairs: &[(&str, f64)]) -> Resources {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// The agent address of the `i`-th node (1-based, as its name `node-i`).
fn agent(i: usize) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, i as u8], 7000))
}

/// A head state with one node per entry of `nodes` (`node-1`, `node-2`, … at IP `10.0.0.i`), all joined at `t0`.
fn cluster(nodes: &[Resources], t0: Instant) -> HeadState {
    let mut st = HeadState::new(BOUND);
    for (i, r) in nodes.iter().enumerate() {
        let ip = format!("10.0.0.{}", i + 1);
        let name = st.register_node(agent(i + 1), ip, "/tmp/logs".into(), r.clone(), t0);
        assert_eq!(name, format!("node-{}", i + 1));
    }
    st
}

fn spec(type_name: &str) -> SpawnSpec {
    SpawnSpec {
        type_name: type_name.into(),
        ..Default::default()
    }
}

fn named(type_name: &str, namespace: &str, name: &str) -> SpawnSpec {
    SpawnSpec {
        name: Some(name.into()),
        namespace: namespace.into(),
        ..spec(type_name)
    }
}

fn needing(type_name: &str, resources: &[(&str, f64)], max_restarts: u32) -> SpawnSpec {
    SpawnSpec {
        resources: res(resources),
        max_restarts,
        ..spec(type_name)
    }
}

fn in_bundle(type_name: &str, group: u64, bundle: u32) -> SpawnSpec {
    SpawnSpec {
        bundle: Some((group, bundle)),
        ..spec(type_name)
    }
}

/// Admits and starts an actor; its id.
fn running(st: &mut HeadState, spec: SpawnSpec) -> u64 {
    let id = st.admit(spec).expect("admitted");
    st.started(id, format!("10.9.9.9:{id}")).expect("started");
    id
}

fn node_of(st: &HeadState, id: u64) -> &str {
    &st.actors[&id].node
}

fn env_of(st: &HeadState, id: u64, key: &str) -> Option<String> {
    let req = st.start_request(id).expect("start request");
    req.msg
        .env
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
}

fn other(r: Result<u64, Refusal>) -> String {
    match r {
        Err(Refusal::Other(m)) => m,
        other => panic!("expected a plain refusal, got {other:?}"),
    }
}

#[test]
fn admit_places_resource_free_actors_on_the_least_loaded_live_node() {
    let t0 = Instant::now();
    let empty = HeadState::new(BOUND).admit(spec("A"));
    assert_eq!(other(empty), "the cluster has no live node");
    let mut st = cluster(&vec![res(&[("CPU", 4.0)]); 3], t0);
    let ids: Vec<u64> = (0..4).map(|_| st.admit(spec("A")).unwrap()).collect();
    let nodes: Vec<&str> = ids.iter().map(|id| node_of(&st, *id)).collect();
    assert_eq!(nodes, ["node-1", "node-2", "node-3", "node-1"]);
    assert!(
        st.actors[&ids[0]].own.is_none(),
        "no reservation without resources"
    );
    // A dead actor does not count, and a dead node takes none.
    assert_eq!(st.kill(&[ids[1]], "killed on request").len(), 1);
    let e = st.admit(spec("A")).unwrap();
    assert_eq!(node_of(&st, e), "node-2");
    st.node_lost("node-3", "gone").unwrap();
    let f = st.admit(spec("A")).unwrap();
    assert_eq!(node_of(&st, f), "node-2");
}

#[test]
fn admit_refuses_a_name_taken_in_the_same_namespace_only() {
    let mut st = cluster(&[res(&[("CPU", 1.0)])], Instant::now());
    let first = running(&mut st, named("A", "ns", "x"));
    assert_eq!(
        st.admit(named("B", "ns", "x")),
        Err(Refusal::NameTaken {
            namespace: "ns".into(),
            name: "x".into()
        })
    );
    let elsewhere = st.admit(named("B", "other", "x")).unwrap();
    assert_ne!(first, elsewhere);
    assert_eq!(st.lookup("ns", "x").map(|a| a.id), Some(first));
    assert_eq!(st.lookup("other", "x").map(|a| a.id), Some(elsewhere));
    assert_eq!(st.lookup("ns", "y"), None);
    // Killing the holder frees the name.
    st.kill(&[first], "killed on request");
    assert_eq!(st.lookup("ns", "x"), None);
    assert!(st.admit(named("C", "ns", "x")).is_ok());
}

#[test]
fn admit_reserves_resources_refuses_infeasible_and_busy_and_frees_them_on_death() {
    let mut st = cluster(&[res(&[("CPU", 2.0), ("GPU", 1.0)])], Instant::now());
    match st.admit(needing("Big", &[("GPU", 2.0)], 0)) {
        Err(Refusal::Infeasible(m)) => {
            assert!(
                m.starts_with("cannot place actor Big needing {GPU: 2}: infeasible:"),
                "{m}"
            );
            assert!(m.contains("GPU (needs 2, cluster has 1)"), "{m}");
        }
        other => panic!("expected Infeasible, got {other:?}"),
    }
    let holder = running(&mut st, needing("G", &[("GPU", 1.0)], 0));
    assert_eq!(
        env_of(&st, holder, "CUDA_VISIBLE_DEVICES").as_deref(),
        Some("0")
    );
    match st.admit(needing("G2", &[("GPU", 1.0)], 0)) {
        Err(Refusal::Busy(m)) => {
            assert!(
                m.starts_with("cannot place actor G2 needing {GPU: 1}: resources busy:"),
                "{m}"
            )
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    // Killed: its reservation is released.
    st.kill(&[holder], "killed on request");
    let second = running(&mut st, needing("G2", &[("GPU", 1.0)], 0));
    assert!(matches!(
        st.admit(needing("G3", &[("GPU", 1.0)], 0)),
        Err(Refusal::Busy(_))
    ));
    // Died (no restart budget): released too.
    let (event, restart) = st.worker_exited(second, "SIGKILL").unwrap();
    assert!(!restart);
    assert!(matches!(event, Event::ActorDied { id, .. } if id == second));
    assert!(st.admit(needing("G3", &[("GPU", 1.0)], 0)).is_ok());
}

#[test]
fn admit_refuses_unknown_groups_out_of_range_bundles_and_lost_bundles() {
    let mut st = cluster(&vec![res(&[("CPU", 2.0)]); 2], Instant::now());
    assert_eq!(
        other(st.admit(in_bundle("A", 7, 0))),
        "resource group 7 does not exist"
    );
    let g = st
        .place_group(&vec![res(&[("CPU", 1.0)]); 2], Strategy::StrictSpread, 0)
        .unwrap();
    assert_eq!(g.nodes, ["node-1", "node-2"]);
    assert_eq!(
        other(st.admit(in_bundle("A", g.group, 5))),
        format!(
            "bundle 5 is out of range: resource group {} has 2 bundles",
            g.group
        )
    );
    assert!(st.admit(in_bundle("A", g.group, 1)).is_ok());
    st.node_lost("node-1", "missed heartbeats").unwrap();
    let lost = in_bundle("A", g.group, 0);
    let why = match st.refuse_lost_bundle(&lost) {
        Err(Refusal::Other(m)) => m,
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert_eq!(
        why,
        format!(
            "cannot spawn A into a lost bundle: bundle 0 of resource group {} was on node node-1, which died \
             (missed heartbeats); remove the group and create it again",
            g.group
        )
    );
    assert_eq!(other(st.admit(lost)), why);
    assert!(
        st.admit(in_bundle("A", g.group, 1)).is_ok(),
        "the other bundle lives on"
    );
}

#[test]
fn groups_pack_and_spread_and_removing_one_releases_its_slots() {
    let mut st = cluster(&vec![res(&[("CPU", 2.0)]); 2], Instant::now());
    let one = res(&[("CPU", 1.0)]);
    let packed = st
        .place_group(&vec![one.clone(); 2], Strategy::Pack, 0)
        .unwrap();
    assert_eq!(packed.nodes, ["node-1", "node-1"]);
    let member = running(&mut st, in_bundle("W", packed.group, 1));
    assert_eq!(node_of(&st, member), "node-1");
    let g = st.remove_group(packed.group).unwrap();
    assert_eq!(g.actors, [member]);
    let stops = st.kill(&g.actors, "resource group 1 was removed");
    assert_eq!(stops.len(), 1);
    assert_eq!(stops[0].node, Some(agent(1)));
    assert_eq!(
        stops[0].event,
        Event::ActorDied {
            id: member,
            type_name: "W".into(),
            node: "node-1".into(),
            reason: "resource group 1 was removed".into()
        }
    );
    st.release(&g.slots);
    assert_eq!(
        st.remove_group(packed.group).unwrap_err().to_string(),
        format!("resource group {} does not exist", packed.group)
    );
    let spread = st.place_group(&vec![one; 2], Strategy::Spread, 0).unwrap();
    assert_eq!(spread.nodes, ["node-1", "node-2"]);
    assert_ne!(spread.group, packed.group);
    let whole = [res(&[("CPU", 2.0)])];
    assert!(matches!(
        st.place_group(&whole, Strategy::StrictPack, 0),
        Err(PlaceError::Busy(_))
    ));
    assert!(matches!(
        st.place_group(&[res(&[("CPU", 3.0)])], Strategy::Pack, 0),
        Err(PlaceError::Infeasible(_))
    ));
    let g = st.remove_group(spread.group).unwrap();
    st.release(&g.slots);
    assert!(st.place_group(&whole, Strategy::StrictPack, 0).is_ok());
}

#[test]
fn rank_env_describes_a_group_over_two_nodes() {
    let mut st = cluster(&vec![res(&[("CPU", 2.0), ("GPU", 2.0)]); 2], Instant::now());
    let bundle = res(&[("CPU", 1.0), ("GPU", 1.0)]);
    let g = st.place_group(&vec![bundle; 3], Strategy::Pack, 0).unwrap();
    assert_eq!(g.nodes, ["node-1", "node-1", "node-2"]);
    assert_eq!(st.master_port_node(g.group).unwrap(), Some(agent(1)));
    st.set_master_port(g.group, 41000);
    st.set_master_port(g.group, 42000);
    assert_eq!(st.master_port_node(g.group).unwrap(), None, "asked once");
    let ids: Vec<u64> = (0..3)
        .map(|b| st.admit(in_bundle("W", g.group, b)).unwrap())
        .collect();
    let expect = [
        ("0", "0", "2", "0"),
        ("1", "1", "2", "1"),
        ("2", "0", "1", "0"),
    ];
    for (id, (rank, local, local_world, gpus)) in ids.iter().zip(expect) {
        let env = |k| env_of(&st, *id, k).unwrap_or_else(|| panic!("{k} missing"));
        assert_eq!(env("RANK"), rank);
        assert_eq!(env("WORLD_SIZE"), "3");
        assert_eq!(env("LOCAL_RANK"), local);
        assert_eq!(env("LOCAL_WORLD_SIZE"), local_world);
        assert_eq!(env("MASTER_ADDR"), "10.0.0.1");
        assert_eq!(env("MASTER_PORT"), "41000");
        assert_eq!(env("CUDA_VISIBLE_DEVICES"), gpus);
    }
    assert_eq!(node_of(&st, ids[2]), "node-2");
    assert_eq!(st.start_request(ids[2]).unwrap().node_addr, agent(2));
}

#[test]
fn a_node_that_stops_heartbeating_expires_after_the_bound_and_not_before() {
    let t0 = Instant::now();
    let at = |s: f64| t0 + Duration::from_secs_f64(s);
    let ms = Duration::from_millis(1);
    let mut st = cluster(&vec![res(&[("CPU", 1.0)]); 2], t0);
    assert!(st.heartbeat("node-1", at(2.0)));
    // The head checks every half second (under its period, so no check counts as a stall of the head).
    for s in [0.5, 1.0, 1.5, 2.0, 2.5] {
        assert!(st.expire(at(s)).is_empty(), "at {s} s");
    }
    assert!(st.expire(t0 + BOUND).is_empty());
    assert_eq!(st.expire(t0 + BOUND + ms), ["node-2"]);
    assert!(st.expire(t0 + BOUND + ms).is_empty(), "returned once");
    assert!(
        !st.heartbeat("node-2", t0 + BOUND + ms),
        "a dead node stays dead"
    );
    assert!(!st.heartbeat("node-9", t0), "an unknown node");
    for s in [3.5, 4.0, 4.5] {
        assert!(st.expire(at(s)).is_empty(), "at {s} s");
    }
    assert!(st.expire(at(2.0) + BOUND).is_empty());
    assert_eq!(st.expire(at(2.0) + BOUND + ms), ["node-1"]);
}

#[test]
fn losing_a_node_loses_its_bundles_and_restarts_or_kills_its_actors() {
    let node1 = res(&[("CPU", 4.0), ("ssd", 3.0)]);
    let mut st = cluster(&[node1, res(&[("CPU", 4.0)])], Instant::now());
    let g = st
        .place_group(&vec![res(&[("CPU", 1.0)]); 2], Strategy::Spread, 0)
        .unwrap();
    assert_eq!(g.nodes, ["node-1", "node-2"]);
    let member = running(&mut st, in_bundle("B", g.group, 0));
    let restartable = running(&mut st, needing("R", &[("ssd", 1.0)], 1));
    let doomed = running(
        &mut st,
        SpawnSpec {
            name: Some("d".into()),
            ..needing("D", &[("ssd", 1.0)], 0)
        },
    );
    let starting = st.admit(needing("S", &[("ssd", 0.5)], 0)).unwrap();
    let elsewhere = running(&mut st, in_bundle("B", g.group, 1));
    for id in [member, restartable, doomed, starting] {
        assert_eq!(node_of(&st, id), "node-1");
    }
    let loss = st.node_lost("node-1", "missed heartbeats").unwrap();
    assert_eq!(loss.addr, agent(1));
    assert_eq!(loss.restarts, [restartable]);
    let lost = format!(
        "bundle 0 of resource group {} was on node node-1, which died (missed heartbeats)",
        g.group
    );
    assert_eq!(st.groups[&g.group].lost.get(&0), Some(&lost));
    assert!(!st.groups[&g.group].lost.contains_key(&1));
    let died = |id: u64, type_name: &str, reason: String| Event::ActorDied {
        id,
        type_name: type_name.into(),
        node: "node-1".into(),
        reason,
    };
    assert_eq!(
        loss.events,
        [
            died(
                member,
                "B",
                lost_bundle_reason(g.group, 0, "node-1", "missed heartbeats")
            ),
            Event::ActorRestarting {
                id: restartable,
                node: "node-1".into(),
                reason: "missed heartbeats".into(),
                attempt: 1
            },
            died(doomed, "D", "missed heartbeats".into()),
            Event::NodeDied {
                node: "node-1".into(),
                reason: "missed heartbeats".into()
            },
        ]
    );
    assert!(
        lost_bundle_reason(g.group, 0, "node-1", "x").starts_with(&format!(
            "bundle 0 of resource group {} was lost with node node-1",
            g.group
        ))
    );
    // The one without budget is forgotten: its name and reservation are free.
    assert_eq!(st.lookup("", "d"), None);
    assert!(st.actors[&doomed].own.is_none());
    assert!(matches!(st.resolve(doomed), Resolved::Gone(m) if m.contains("missed heartbeats")));
    assert_eq!(
        st.resolve(starting),
        Resolved::Pending,
        "a start in flight takes its own path"
    );
    assert!(matches!(st.resolve(elsewhere), Resolved::Alive(_)));
    assert!(
        st.node_lost("node-1", "again").is_none(),
        "losing a node twice does nothing"
    );
    assert!(st.node_lost("node-9", "unknown").is_none());
    assert_eq!(st.live_node_addrs(), [agent(2)]);
}

#[test]
fn recovery_moves_a_free_actor_to_a_live_node_with_its_resources() {
    let ssd = res(&[("CPU", 2.0), ("ssd", 1.0)]);
    let mut st = cluster(&[ssd.clone(), ssd, res(&[("CPU", 2.0)])], Instant::now());
    let r = running(&mut st, needing("R", &[("ssd", 1.0)], 3));
    let free = running(
        &mut st,
        SpawnSpec {
            max_restarts: 1,
            ..spec("F")
        },
    );
    assert_eq!((node_of(&st, r), node_of(&st, free)), ("node-1", "node-2"));
    let loss = st.node_lost("node-1", "gone").unwrap();
    assert_eq!(loss.restarts, [r]);
    assert_eq!(st.move_off_dead_node(free), Ok(None), "its node is alive");
    let moved = st.move_off_dead_node(r).unwrap().unwrap();
    assert_eq!(
        moved,
        Moved {
            type_name: "R".into(),
            from: "node-1".into(),
            to: "node-2".into()
        }
    );
    assert_eq!(
        st.placement.node("node-2").unwrap().free.get("ssd"),
        Some(&0.0)
    );
    assert_eq!(st.resolve(r), Resolved::Pending);
    let req = st.start_request(r).unwrap();
    assert_eq!((req.node_addr, req.node.as_str()), (agent(2), "node-2"));
    let address = st.started(r, "10.0.0.2:9100".into()).unwrap();
    assert_eq!(
        address,
        ActorAddress {
            id: r,
            type_name: "R".into(),
            addr: "10.0.0.2:9100".into(),
            node: "node-2".into()
        }
    );
    assert_eq!(st.resolve(r), Resolved::Alive(address));
    // Node 2 dies too: no live node has an ssd left; the resource-free actor moves to node 3.
    let loss = st.node_lost("node-2", "gone again").unwrap();
    assert_eq!(loss.restarts, [r, free]);
    let why = st.move_off_dead_node(r).unwrap_err();
    assert!(
        why.starts_with(
            "its node node-2 died and no live node can host it ({ssd: 1}): infeasible:"
        ),
        "{why}"
    );
    assert_eq!(st.move_off_dead_node(free).unwrap().unwrap().to, "node-3");
    let event = st.declare_dead(r, why.clone()).unwrap();
    assert!(matches!(event, Event::ActorDied { id, reason, .. } if id == r && reason == why));
    assert_eq!(st.declare_dead(r, "again".into()), None);
    assert!(matches!(st.resolve(r), Resolved::Gone(m) if m.contains("no live node can host it")));
}

#[test]
fn recovery_refuses_to_move_actors_of_bundles_or_with_no_live_node() {
    let mut st = cluster(&[res(&[("CPU", 2.0)])], Instant::now());
    let g = st
        .place_group(&[res(&[("CPU", 1.0)])], Strategy::Pack, 0)
        .unwrap();
    let member = running(&mut st, in_bundle("B", g.group, 0));
    let free = running(
        &mut st,
        SpawnSpec {
            max_restarts: 1,
            ..spec("F")
        },
    );
    let loss = st.node_lost("node-1", "gone").unwrap();
    assert_eq!(loss.restarts, [free]);
    assert_eq!(
        st.move_off_dead_node(member),
        Err(lost_bundle_reason(
            g.group,
            0,
            "node-1",
            "it cannot restart elsewhere"
        ))
    );
    assert_eq!(
        st.move_off_dead_node(free),
        Err("its node node-1 died and no live node is left".into())
    );
    assert_eq!(st.move_off_dead_node(999), Ok(None));
}

#[test]
fn worker_exits_restart_until_max_restarts_then_the_actor_is_dead() {
    let mut st = cluster(&[res(&[("CPU", 1.0)])], Instant::now());
    let id = running(
        &mut st,
        SpawnSpec {
            max_restarts: 2,
            ..named("A", "ns", "a")
        },
    );
    for attempt in 1..=2 {
        let (event, restart) = st.worker_exited(id, "SIGKILL").unwrap();
        assert!(restart);
        assert_eq!(
            event,
            Event::ActorRestarting {
                id,
                node: "node-1".into(),
                reason: "SIGKILL".into(),
                attempt
            }
        );
        assert_eq!(st.resolve(id), Resolved::Pending);
        st.started(id, format!("10.0.0.1:{attempt}")).unwrap();
    }
    let (event, restart) = st.worker_exited(id, "SIGKILL").unwrap();
    assert!(!restart);
    let reason = "SIGKILL (after 2 restarts, max_restarts = 2)".to_string();
    assert_eq!(
        event,
        Event::ActorDied {
            id,
            type_name: "A".into(),
            node: "node-1".into(),
            reason: reason.clone()
        }
    );
    assert_eq!(
        st.resolve(id),
        Resolved::Gone(format!("actor A {id} on node-1 died: {reason}"))
    );
    assert_eq!(st.lookup("ns", "a"), None);
    assert_eq!(st.worker_exited(id, "again"), None);
    assert_eq!(
        st.resolve(12345),
        Resolved::Gone("no actor 12345 in this cluster".into())
    );
}

#[test]
fn an_actor_killed_on_purpose_is_not_restarted() {
    let mut st = cluster(&vec![res(&[("CPU", 1.0)]); 2], Instant::now());
    let id = running(
        &mut st,
        SpawnSpec {
            max_restarts: 5,
            ..spec("A")
        },
    );
    let stops = st.kill(&[id, 777], "killed on request");
    assert_eq!(stops.len(), 1, "unknown ids are skipped");
    assert_eq!((stops[0].id, stops[0].node), (id, Some(agent(1))));
    assert_eq!(st.worker_exited(id, "SIGTERM"), None);
    assert!(st.kill(&[id], "again").is_empty());
    assert!(matches!(st.resolve(id), Resolved::Gone(m) if m.ends_with("died: killed on request")));
    // Killed while starting: the start's answer is refused; on a dead node there is no agent to ask.
    let starting = st.admit(spec("B")).unwrap();
    assert_eq!(
        node_of(&st, starting),
        "node-1",
        "the killed actor does not count"
    );
    assert!(st.node_lost("node-1", "gone").unwrap().restarts.is_empty());
    let stops = st.kill(&[starting], "cluster shut down");
    assert_eq!(stops[0].node, None);
    let err = st.started(starting, "x".into()).unwrap_err().to_string();
    assert_eq!(
        err,
        format!("actor B {starting} was stopped while starting: cluster shut down")
    );
}

#[test]
fn an_abandoned_start_frees_the_name_and_the_reservation() {
    let mut st = cluster(&[res(&[("CPU", 1.0)])], Instant::now());
    let spec = SpawnSpec {
        name: Some("x".into()),
        ..needing("A", &[("CPU", 1.0)], 0)
    };
    let id = st.admit(spec.clone()).unwrap();
    assert!(matches!(
        st.admit(spec.clone()),
        Err(Refusal::NameTaken { .. })
    ));
    st.abandon(id);
    assert_eq!(
        st.start_request(id).unwrap_err().to_string(),
        format!("actor {id} vanished")
    );
    assert_eq!(st.actor_ids(), Vec::<u64>::new());
    assert!(st.admit(spec).is_ok());
}

#[test]
fn guarantee_17_a_lost_driver_frees_its_groups_and_actors_but_not_detached_ones_or_others() {
    use super::super::drivers::DriverEntry;
    let t0 = Instant::now();
    let mut st = cluster(&[res(&[("CPU", 4.0)])], t0);
    let entry = |pid| DriverEntry {
        pid,
        host: "h".into(),
        command: "ferl sft".into(),
    };
    let (a, b) = (
        st.drivers.register(entry(10), t0),
        st.drivers.register(entry(11), t0),
    );
    assert!(a != 0 && b != 0 && a != b, "driver ids {a} {b}");
    let owned = |owner: u64, detached: bool| SpawnSpec {
        owner,
        detached,
        ..spec("A")
    };
    let group = st
        .place_group(&vec![res(&[("CPU", 1.0)]); 2], Strategy::Pack, a)
        .unwrap()
        .group;
    let in_group = running(
        &mut st,
        SpawnSpec {
            owner: a,
            ..in_bundle("R", group, 0)
        },
    );
    let mine = running(&mut st, owned(a, false));
    let detached = running(&mut st, owned(a, true));
    let theirs = running(&mut st, owned(b, false));
    let nobody = running(&mut st, owned(0, false));
    let job = |driver: u64, state: &str| {
        serde_json::json!({"name": "j", "state": state, "driver": driver})
            .to_string()
            .into_bytes()
    };
    st.kv.insert("jobs/a".into(), job(a, "running"));
    st.kv.insert("jobs/a-done".into(), job(a, "finished"));
    st.kv.insert("jobs/b".into(), job(b, "running"));

    // b beats, a falls silent: only a is lost, once the bound has passed.
    let period = st.check_period();
    let mut now = t0;
    let mut lost = Vec::new();
    while now < t0 + BOUND * 2 {
        now += period;
        assert!(st.drivers.heartbeat(b, now));
        lost.extend(st.drivers.expire(now).into_iter().map(|id| (id, now)));
    }
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert_eq!(lost[0].0, a);
    assert!(lost[0].1 > t0 + BOUND && lost[0].1 <= t0 + BOUND + period);
    assert!(!st.drivers.heartbeat(a, now), "a lost driver stays lost");

    let gone = st.driver_gone(a);
    assert_eq!(gone.entry.map(|e| e.pid), Some(10));
    assert_eq!(
        gone.groups,
        [group],
        "its group (whose actors stop with it)"
    );
    assert_eq!(
        gone.actors,
        [mine],
        "its own actor, not {in_group} (in the group) nor {detached} (detached)"
    );
    assert!(![theirs, nobody, detached]
        .iter()
        .any(|id| gone.actors.contains(id)));
    assert_eq!(st.fail_jobs_of(a, "failed: driver lost"), ["jobs/a"]);
    let state =
        |k: &str| serde_json::from_slice::<serde_json::Value>(&st.kv[k]).unwrap()["state"].clone();
    assert_eq!(state("jobs/a"), "failed: driver lost");
    assert_eq!(state("jobs/a-done"), "finished");
    assert_eq!(state("jobs/b"), "running");
    assert_eq!(
        st.drivers.entries().keys().copied().collect::<Vec<_>>(),
        [b]
    );
}
