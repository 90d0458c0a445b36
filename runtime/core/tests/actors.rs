//! Actors across processes: calls, tells, streams, ordering, mailboxes, naming, the KV store, worker groups.

mod common;

use std::time::{Duration, Instant};

use ferl_runtime::testbed::*;
use ferl_runtime::{bundle, Error, SpawnOptions, Strategy, WorkerGroup};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_1_call_tell_and_stream_work_in_and_across_processes() {
    let cluster = common::cluster().await;
    let remote = cluster
        .spawn::<Counter>(10, SpawnOptions::new())
        .await
        .unwrap();
    assert_ne!(
        remote.call(Pid).await.unwrap(),
        std::process::id(),
        "a spawned actor runs in its own process"
    );
    let local = cluster.spawn_local(Counter::starting_at(10), SpawnOptions::new());
    for actor in [&remote] {
        assert_eq!(actor.call(Add(5)).await.unwrap(), 15);
        actor.tell(Add(1)).await.unwrap();
        assert_eq!(actor.call(Get).await.unwrap(), 16);
        let items = actor
            .stream(CountTo(5))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        assert_eq!(items, vec![0, 1, 2, 3, 4]);
        let err = actor.call(Fail("boom".into())).await.unwrap_err();
        assert!(
            matches!(&err, Error::Remote { message, .. } if message.contains("boom")),
            "{err}"
        );
    }
    assert_eq!(local.call(Add(5)).await.unwrap(), 15);
    local.tell(Add(1)).await.unwrap();
    assert_eq!(local.call(Get).await.unwrap(), 16);
    assert_eq!(
        local
            .stream(CountTo(3))
            .await
            .unwrap()
            .collect()
            .await
            .unwrap(),
        vec![0, 1, 2]
    );
    // A large argument goes over a bulk stream and comes back intact.
    let big: Vec<u8> = (0..(6 << 20)).map(|i| (i % 251) as u8).collect();
    assert_eq!(remote.call(Echo(big.clone())).await.unwrap(), big);
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_2_fifo_per_sender() {
    let cluster = common::cluster().await;
    let actor = cluster
        .spawn::<Counter>(0, SpawnOptions::new())
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for sender in 0..4u32 {
        let a = actor.clone();
        tasks.push(tokio::spawn(async move {
            for seq in 0..300u64 {
                if seq % 3 == 0 {
                    a.call(Record { sender, seq }).await.unwrap();
                } else {
                    a.tell(Record { sender, seq }).await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seen = actor.call(Recorded).await.unwrap();
    assert_eq!(seen.len(), 1200);
    for sender in 0..4u32 {
        let seqs: Vec<u64> = seen
            .iter()
            .filter(|(s, _)| *s == sender)
            .map(|(_, q)| *q)
            .collect();
        assert_eq!(
            seqs,
            (0..300).collect::<Vec<_>>(),
            "sender {sender} out of order"
        );
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_3_bounded_mailbox_and_max_concurrency() {
    let cluster = common::cluster().await;
    // Local actor, mailbox of 1, one at a time: the third tell waits until the first message is handled.
    let local = cluster.spawn_local(Counter::starting_at(0), SpawnOptions::new().mailbox(1));
    let t0 = Instant::now();
    for _ in 0..3 {
        local.tell(Sleep(300)).await.unwrap();
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "senders must wait on a full mailbox ({:?})",
        t0.elapsed()
    );
    // Concurrency 4: eight 500 ms sleeps take about 1 s, not 4 s.
    let wide = cluster
        .spawn::<Counter>(0, SpawnOptions::new().max_concurrency(4))
        .await
        .unwrap();
    let t0 = Instant::now();
    let calls: Vec<_> = (0..8).map(|_| wide.call(Sleep(500))).collect();
    futures::future::try_join_all(calls).await.unwrap();
    assert!(
        t0.elapsed() < Duration::from_millis(3000),
        "max_concurrency 4 ran sequentially ({:?})",
        t0.elapsed()
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_9_worker_group_broadcast_split_gather_rank0() {
    let cluster = common::cluster().await;
    let group = cluster
        .create_group(
            vec![bundle(&[("CPU", 1.0)]); 3],
            Strategy::Pack,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let workers = WorkerGroup::<Counter>::spawn(
        &cluster,
        &group,
        |rank| 100 * rank as u64,
        SpawnOptions::new(),
    )
    .await
    .unwrap();
    assert_eq!(workers.call_all(Add(1)).await.unwrap(), vec![1, 101, 201]);
    let sums = workers
        .call_split((1..=10u64).collect(), |_, chunk| Add(chunk.iter().sum()))
        .await
        .unwrap();
    assert_eq!(
        sums,
        vec![1 + 10, 101 + 18, 201 + 27],
        "chunks [1..4], [5..7], [8..10] in rank order"
    );
    assert_eq!(workers.call_rank0(Get).await.unwrap(), 11);
    let ranks = workers.call_all(GetEnv("RANK".into())).await.unwrap();
    assert_eq!(
        ranks,
        vec![Some("0".into()), Some("1".into()), Some("2".into())]
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_10_named_actors_and_kv_rendezvous() {
    let cluster = common::cluster().await;
    let a = cluster
        .spawn::<Counter>(7, SpawnOptions::new().name("jobs", "counter"))
        .await
        .unwrap();
    let found = cluster
        .get_actor::<Counter>("jobs", "counter")
        .await
        .unwrap()
        .expect("named actor found");
    assert_eq!(found.id(), a.id());
    assert_eq!(found.call(Get).await.unwrap(), 7);
    assert!(cluster
        .get_actor::<Counter>("other", "counter")
        .await
        .unwrap()
        .is_none());
    let dup = cluster
        .spawn::<Counter>(0, SpawnOptions::new().name("jobs", "counter"))
        .await
        .unwrap_err();
    assert!(dup.to_string().contains("already exists"), "{dup}");
    match &dup {
        ferl_runtime::Error::NameTaken { namespace, name } => {
            assert_eq!((namespace.as_str(), name.as_str()), ("jobs", "counter"))
        }
        other => panic!("a taken name gives NameTaken, not {other:?}"),
    }

    assert_eq!(cluster.kv_get("k").await.unwrap(), None);
    let waiter = {
        let c = cluster.clone();
        tokio::spawn(async move { c.kv_wait("master", Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    cluster
        .kv_put("master", b"127.0.0.1:29500".to_vec())
        .await
        .unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), b"127.0.0.1:29500");
    assert_eq!(
        cluster.kv_get("master").await.unwrap().unwrap(),
        b"127.0.0.1:29500"
    );
    let err = cluster
        .kv_wait("never", Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("never"), "{err}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_5_calls_to_killed_or_unbuildable_actors_fail_promptly() {
    let cluster = common::cluster().await;
    let a = cluster
        .spawn::<Counter>(1, SpawnOptions::new())
        .await
        .unwrap();
    let pending = {
        let a = a.clone();
        tokio::spawn(async move { a.call(Sleep(60_000)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.kill(&a).await.unwrap();
    let t0 = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(20), pending)
        .await
        .expect("pending call must not hang")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, Error::ActorDied { node, .. } if node.starts_with("node-")),
        "{err}"
    );
    let err = a.call(Get).await.unwrap_err();
    assert!(
        matches!(&err, Error::ActorDied { reason, .. } if reason.contains("killed")),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(20));
    let err = cluster
        .spawn::<Counter>(u64::MAX, SpawnOptions::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("constructor"), "{err}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_10_driver_shutdown_stops_its_actors_but_not_detached_ones() {
    let head = common::head(4.0, Duration::from_secs(3)).await;
    let addr = head.cluster.head_address().unwrap().to_string();
    let driver = ferl_runtime::connect(&addr, Some(head.token.clone()))
        .await
        .unwrap();
    driver.set_worker_binary(common::testbed()).unwrap();
    let owned = driver
        .spawn::<Counter>(1, SpawnOptions::new().name("d", "owned"))
        .await
        .unwrap();
    let kept = driver
        .spawn::<Counter>(2, SpawnOptions::new().name("d", "kept").detached())
        .await
        .unwrap();
    assert_eq!(
        owned.call(Get).await.unwrap() + kept.call(Get).await.unwrap(),
        3
    );
    driver.shutdown().await;
    let kept = head
        .cluster
        .get_actor::<Counter>("d", "kept")
        .await
        .unwrap()
        .expect("detached actor survives");
    assert_eq!(kept.call(Get).await.unwrap(), 2);
    assert!(
        head.cluster
            .get_actor::<Counter>("d", "owned")
            .await
            .unwrap()
            .is_none(),
        "owned actor stopped"
    );
}
