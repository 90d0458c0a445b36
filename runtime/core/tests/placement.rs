//! Resource groups over several node agents (separate processes) with declared resources.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use ferl_runtime::testbed::*;
use ferl_runtime::{bundle, Cluster, Error, SpawnOptions, Strategy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_4_each_strategy_places_as_named_over_three_nodes() {
    let head = common::head(2.0, Duration::from_secs(3)).await;
    let _n2 = common::node(&head, &["--num-cpus", "2"], &[]);
    let _n3 = common::node(&head, &["--num-cpus", "2", "--num-gpus", "2"], &[]);
    let cluster = &head.cluster;
    let one = || bundle(&[("CPU", 1.0)]);
    let t = Duration::from_secs(5);

    let g = cluster
        .create_group(vec![one(); 3], Strategy::StrictSpread, t)
        .await
        .unwrap();
    assert_eq!(
        g.nodes.iter().collect::<BTreeSet<_>>().len(),
        3,
        "STRICT_SPREAD: {:?}",
        g.nodes
    );
    cluster.remove_group(&g).await.unwrap();

    let g = cluster
        .create_group(vec![one(); 2], Strategy::StrictPack, t)
        .await
        .unwrap();
    assert_eq!(g.nodes[0], g.nodes[1], "STRICT_PACK: {:?}", g.nodes);
    cluster.remove_group(&g).await.unwrap();

    let g = cluster
        .create_group(vec![one(); 2], Strategy::Pack, t)
        .await
        .unwrap();
    assert_eq!(
        g.nodes[0], g.nodes[1],
        "PACK fits on one node: {:?}",
        g.nodes
    );
    cluster.remove_group(&g).await.unwrap();

    let g = cluster
        .create_group(vec![one(); 3], Strategy::Spread, t)
        .await
        .unwrap();
    assert_eq!(
        g.nodes.iter().collect::<BTreeSet<_>>().len(),
        3,
        "SPREAD: {:?}",
        g.nodes
    );
    cluster.remove_group(&g).await.unwrap();

    let g = cluster
        .create_group(vec![one(); 5], Strategy::Pack, t)
        .await
        .unwrap();
    assert!(
        g.nodes.iter().collect::<BTreeSet<_>>().len() >= 3,
        "PACK spills over: {:?}",
        g.nodes
    );
    cluster.remove_group(&g).await.unwrap();

    let status = cluster.status().await.unwrap();
    let nodes = status["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3);
    for n in nodes {
        assert_eq!(
            n["resources_used"]["CPU"].as_f64().unwrap(),
            0.0,
            "removing groups frees resources: {n}"
        );
        assert!(n["log_dir"].as_str().unwrap().contains("logs"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_4_infeasible_fails_fast_and_busy_waits_then_times_out() {
    let head = common::head(2.0, Duration::from_secs(3)).await;
    let _n2 = common::node(&head, &["--num-cpus", "2"], &[]);
    let cluster = &head.cluster;
    assert_infeasible_groups_fail_fast(cluster).await;

    let all = cluster
        .create_group(
            vec![bundle(&[("CPU", 2.0)]); 2],
            Strategy::StrictSpread,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_busy_group_times_out_and_own_reservations_do_not_wait(cluster).await;
    // A waiting group is placed as soon as resources are freed.
    let waiter = {
        let c = cluster.clone();
        tokio::spawn(async move {
            c.create_group(
                vec![bundle(&[("CPU", 2.0)])],
                Strategy::Pack,
                Duration::from_secs(30),
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.remove_group(&all).await.unwrap();
    waiter.await.unwrap().expect("placed once freed");
}

/// Groups no node could ever hold fail at once, typed [`Error::Infeasible`], naming why (nodes: 2 CPUs each, no
/// GPU).
async fn assert_infeasible_groups_fail_fast(cluster: &Cluster) {
    let t0 = Instant::now();
    let err = cluster
        .create_group(
            vec![bundle(&[("GPU", 1.0)])],
            Strategy::Pack,
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("infeasible") && err.to_string().contains("GPU"),
        "{err}"
    );
    // The kind crosses the head typed: infeasible is not busy.
    assert!(matches!(err, Error::Infeasible { .. }), "{err:?}");
    let err = cluster
        .create_group(
            vec![bundle(&[("CPU", 1.0)]); 3],
            Strategy::StrictSpread,
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("STRICT_SPREAD"), "{err}");
    assert!(matches!(err, Error::Infeasible { .. }), "{err:?}");
    let err = cluster
        .create_group(
            vec![bundle(&[("CPU", 3.0)])],
            Strategy::Pack,
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("fits no single node"), "{err}");
    assert!(matches!(err, Error::Infeasible { .. }), "{err:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "infeasible groups must fail fast"
    );
}

/// With every CPU held: a group waits, then times out typed [`Error::Busy`]; an actor's own reservation does not
/// wait (busy at once, and infeasible when no node could ever hold it).
async fn assert_busy_group_times_out_and_own_reservations_do_not_wait(cluster: &Cluster) {
    let t0 = Instant::now();
    let err = cluster
        .create_group(
            vec![bundle(&[("CPU", 1.0)])],
            Strategy::Pack,
            Duration::from_millis(700),
        )
        .await
        .unwrap_err();
    assert!(
        t0.elapsed() >= Duration::from_millis(600) && err.to_string().contains("timed out"),
        "{err}"
    );
    assert!(matches!(err, Error::Busy { .. }), "{err:?}");
    let busy = cluster
        .spawn::<Counter>(0, SpawnOptions::new().resources(bundle(&[("CPU", 1.0)])))
        .await
        .unwrap_err();
    assert!(matches!(busy, Error::Busy { .. }), "{busy:?}");
    let never = cluster
        .spawn::<Counter>(0, SpawnOptions::new().resources(bundle(&[("GPU", 1.0)])))
        .await
        .unwrap_err();
    assert!(matches!(never, Error::Infeasible { .. }), "{never:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_4_bundle_workers_get_rank_and_device_environment_and_die_with_their_group() {
    let head = common::head(2.0, Duration::from_secs(3)).await;
    let n2 = common::node(&head, &["--num-cpus", "4", "--num-gpus", "2"], &[]);
    let cluster = &head.cluster;
    let g = cluster
        .create_group(
            vec![bundle(&[("GPU", 1.0), ("CPU", 1.0)]); 2],
            Strategy::StrictPack,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(g.nodes, vec![n2.name.clone(), n2.name.clone()]);
    let mut actors = Vec::new();
    for i in 0..2 {
        actors.push(
            cluster
                .spawn::<Counter>(0, SpawnOptions::new().in_bundle(&g, i).env("EXTRA", "yes"))
                .await
                .unwrap(),
        );
    }
    let env = |a: usize, k: &str| {
        let a = actors[a].clone();
        let k = k.to_string();
        async move { a.call(GetEnv(k)).await.unwrap() }
    };
    assert_eq!(env(0, "CUDA_VISIBLE_DEVICES").await.as_deref(), Some("0"));
    assert_eq!(env(1, "CUDA_VISIBLE_DEVICES").await.as_deref(), Some("1"));
    assert_eq!(env(1, "RANK").await.as_deref(), Some("1"));
    assert_eq!(env(1, "LOCAL_RANK").await.as_deref(), Some("1"));
    assert_eq!(env(0, "WORLD_SIZE").await.as_deref(), Some("2"));
    assert_eq!(env(0, "MASTER_ADDR").await.as_deref(), Some("127.0.0.1"));
    let port: u16 = env(0, "MASTER_PORT").await.unwrap().parse().unwrap();
    assert_eq!(env(1, "MASTER_PORT").await.unwrap(), port.to_string());
    assert_eq!(env(0, "EXTRA").await.as_deref(), Some("yes"));
    // A bundle index outside the group is an error naming the group.
    let err = cluster
        .spawn::<Counter>(0, SpawnOptions::new().in_bundle(&g, 5))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    cluster.remove_group(&g).await.unwrap();
    for a in &actors {
        let err = a.call(Get).await.unwrap_err();
        assert!(
            matches!(&err, Error::ActorDied { reason, .. } if reason.contains("removed")),
            "{err}"
        );
    }
    let again = cluster
        .create_group(
            vec![bundle(&[("GPU", 2.0)])],
            Strategy::Pack,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(
        again.nodes,
        vec![n2.name.clone()],
        "GPUs returned when the group was removed"
    );
}
