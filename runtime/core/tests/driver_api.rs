//! The single controller's API: `WorkerGroup::call_each`, `Call::timeout`, derived actor names, and the object
//! store (guarantee 16) over two node agents started as separate processes.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use ferl_runtime::testbed::*;
use ferl_runtime::{bundle, Actor, Error, SpawnOptions, Strategy, Wire, WorkerGroup};
use sha2::Digest;

async fn counters(cluster: &ferl_runtime::Cluster, n: usize) -> WorkerGroup<Counter> {
    let group = cluster
        .create_group(
            vec![bundle(&[("CPU", 1.0)]); n],
            Strategy::Pack,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    WorkerGroup::spawn(cluster, &group, |r| 100 * r as u64, SpawnOptions::new())
        .await
        .unwrap()
}

#[test]
fn register_actor_derives_the_name_as_message_does() {
    assert_eq!(Counter::NAME, "ferl_runtime::testbed::Counter");
    assert!(ferl_runtime::lookup(Counter::NAME).is_some());
    assert_eq!(
        <Add as ferl_runtime::Message>::NAME,
        "ferl_runtime::testbed::Add"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_9_call_each_keeps_rank_order_and_names_the_failing_rank() {
    let cluster = common::cluster().await;
    let group = counters(&cluster, 3).await;
    let replies = group.call_each(vec![Add(1), Add(2), Add(3)]).await.unwrap();
    assert_eq!(replies, vec![1, 102, 203]);

    let err = group
        .call_each(vec![Add(1)])
        .await
        .expect_err("one message for three ranks");
    assert!(err.to_string().contains("1 messages"), "{err}");

    let err = group
        .call_each(vec![
            Fail("not me".into()),
            Fail("me".into()),
            Fail("nor me".into()),
        ])
        .await
        .unwrap_err();
    let Error::Rank { rank, node, .. } = &err else {
        panic!("expected Error::Rank, got {err:?}")
    };
    assert_eq!((*rank, node.as_str()), (0, group.rank(0).node().as_str()));
    assert!(
        err.to_string().contains("rank 0") && err.to_string().contains("not me"),
        "{err}"
    );

    // Rank 2 dies: its death is the cause, not rank 0's failure that happens alongside.
    cluster.kill(group.rank(2)).await.unwrap();
    let err = group
        .call_each(vec![Fail("collateral".into()); 3])
        .await
        .unwrap_err();
    match &err {
        Error::Rank {
            rank: 2,
            actor,
            cause,
            ..
        } if matches!(cause.as_ref(), Error::ActorDied { .. }) => {
            assert_eq!(*actor, group.rank(2).name())
        }
        other => panic!("expected rank 2's death, got {other:?}"),
    }
    assert!(err.is_actor_death(), "{err}");
    assert!(err.to_string().contains("rank 2"), "{err}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_with_a_timeout_fails_typed_and_the_actor_still_answers() {
    let cluster = common::cluster().await;
    let actor = cluster
        .spawn::<Counter>(5, SpawnOptions::new())
        .await
        .unwrap();
    let err = actor
        .call(Sleep(3_000))
        .timeout(Duration::from_millis(200))
        .await
        .unwrap_err();
    match &err {
        Error::Timeout {
            actor: name,
            message,
            after,
            ..
        } => {
            assert_eq!(name, &actor.name());
            assert!(message.ends_with("Sleep"), "{message}");
            assert_eq!(*after, Duration::from_millis(200));
        }
        other => panic!("expected Error::Timeout, got {other:?}"),
    }
    assert!(err.to_string().contains("200ms"), "{err}");
    let total = actor
        .call(Add(1))
        .timeout(Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(total, 6);
    assert_eq!(actor.call(Get).await.unwrap(), 6);
    cluster.shutdown().await;
}

/// Polls `stats` of `node` until `done` holds (the owner tells nodes to drop their copies after it frees them).
async fn wait_for(
    cluster: &ferl_runtime::Cluster,
    node: &str,
    done: impl Fn(&ferl_runtime::ObjectStats) -> bool,
) -> ferl_runtime::ObjectStats {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let stats = cluster.object_stats(Some(node)).await.unwrap();
        if done(&stats) || Instant::now() > deadline {
            return stats;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_16_an_object_crosses_to_each_node_once_and_is_freed_with_its_last_handle() {
    let head = common::head(0.0, Duration::from_secs(3)).await;
    let n1 = common::node(&head, &["--num-cpus", "2"], &[]);
    let n2 = common::node(&head, &["--num-cpus", "2"], &[]);
    let cluster = &head.cluster;
    let group = counters(cluster, 4).await;
    let per_node: BTreeMap<String, usize> =
        group.members().iter().fold(BTreeMap::new(), |mut m, a| {
            *m.entry(a.node()).or_default() += 1;
            m
        });
    let nodes = BTreeSet::from([n1.name.clone(), n2.name.clone()]);
    assert_eq!(per_node.keys().cloned().collect::<BTreeSet<_>>(), nodes);
    assert!(per_node.values().all(|n| *n == 2), "{per_node:?}");

    let size = 100usize << 20;
    let bytes: Vec<u8> = (0..size as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8)
        .collect();
    let want = hex::encode(sha2::Sha256::digest(&bytes));
    let object = cluster.put(bytes).unwrap();
    assert!(object.is_owner_handle());
    let borrowed = ferl_runtime::ObjectRef::from_wire(&object.to_wire().unwrap()).unwrap();
    assert!(!borrowed.is_owner_handle());
    assert_eq!((borrowed.id(), borrowed.size()), (object.id(), size as u64));

    let local = cluster.get(&borrowed).await.unwrap();
    assert_eq!(
        hex::encode(sha2::Sha256::digest(&local)),
        want,
        "the owner reads its own copy"
    );
    for round in 0..2 {
        let reads = group
            .call_each(vec![ObjectDigest(object.clone()); 4])
            .await
            .unwrap();
        for (rank, (len, sha)) in reads.iter().enumerate() {
            assert_eq!(
                (*len, sha.as_str()),
                (size as u64, want.as_str()),
                "round {round} rank {rank}"
            );
        }
    }
    let owner = cluster.object_stats(None).await.unwrap();
    assert_eq!((owner.owned, owner.owned_bytes), (1, size as u64));
    let crossed: BTreeMap<String, u64> = nodes.iter().map(|n| (n.clone(), 1)).collect();
    assert_eq!(
        owner.served, crossed,
        "one transfer to each node, for 8 reads"
    );
    for node in &nodes {
        let stats = cluster.object_stats(Some(node)).await.unwrap();
        assert_eq!(
            (stats.fetched, stats.cached, stats.cached_bytes),
            (1, 1, size as u64),
            "{node}"
        );
    }

    drop(object);
    let owner = cluster.object_stats(None).await.unwrap();
    assert_eq!(
        (owner.owned, owner.owned_bytes),
        (0, 0),
        "freed with the last handle"
    );
    for node in &nodes {
        let stats = wait_for(cluster, node, |s| s.cached == 0).await;
        assert_eq!(
            (stats.cached, stats.cached_bytes),
            (0, 0),
            "{node} dropped its copy"
        );
    }
    let err = group
        .rank(0)
        .call(ObjectDigest(borrowed))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not held by its owner"), "{err}");
    assert_eq!(cluster.object_stats(None).await.unwrap().served, crossed);
    head.cluster.clone().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_16_same_host_readers_map_an_object_put_from_a_buffer_without_a_copy() {
    let cluster = common::cluster().await;
    let group = counters(&cluster, 2).await;
    let size = (40usize << 20) + 3;
    let mut buffer = cluster.object_buffer(size);
    assert!(buffer.is_shared(), "a Linux host gives shared memory");
    assert!(buffer.iter().all(|b| *b == 0), "a new buffer is zeroed");
    for (i, b) in buffer.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes()[7];
    }
    let want = hex::encode(sha2::Sha256::digest(&buffer[..]));
    let object = cluster.put_buffer(buffer).unwrap();
    let borrowed = ferl_runtime::ObjectRef::from_wire(&object.to_wire().unwrap()).unwrap();
    for round in 0..2 {
        let reads = group
            .call_each(vec![ObjectDigest(object.clone()); 2])
            .await
            .unwrap();
        for (rank, read) in reads.iter().enumerate() {
            assert_eq!(
                read,
                &(size as u64, want.clone()),
                "round {round} rank {rank}"
            );
        }
    }
    let workers = group.call_all(LocalObjectStats).await.unwrap();
    assert!(
        workers.iter().all(|s| s.mapped == 2),
        "each worker mapped the object on each read: {workers:?}"
    );
    let owner = cluster.object_stats(None).await.unwrap();
    assert!(owner.served.is_empty(), "no copy left the owner: {owner:?}");
    let node = group.rank(0).node();
    let agent = cluster.object_stats(Some(&node)).await.unwrap();
    assert_eq!(
        (agent.fetched, agent.cached),
        (0, 0),
        "no node agent in between"
    );

    drop(object);
    let err = group
        .rank(0)
        .call(ObjectDigest(borrowed))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not held by its owner"), "{err}");
    cluster.shutdown().await;
}
