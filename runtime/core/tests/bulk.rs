//! Large payloads between processes: the same-host shared-memory ring (guarantee 13) and the QUIC paths it falls
//! back to.

mod common;

use std::time::Duration;

use ferl_runtime::testbed::*;
use ferl_runtime::SpawnOptions;

fn shm_bytes_received() -> u64 {
    ferl_runtime::stats().shm_bytes_received
}
fn unclaimed_bytes() -> u64 {
    ferl_runtime::stats().bulk_unclaimed_bytes
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_13_large_payloads_on_one_host_go_through_shared_memory() {
    let cluster = common::cluster().await;
    let actor = cluster
        .spawn::<Counter>(0, SpawnOptions::new())
        .await
        .unwrap();
    let before = shm_bytes_received();
    // The first large reply offers the worker's ring; later ones travel through it.
    for (round, len) in [(0u8, 8 << 20), (1, 8 << 20), (2, 200 << 10), (3, 64 << 10)] {
        let data = pattern(len, round);
        let back = actor.call(Echo(data.clone())).await.unwrap();
        assert_eq!(back.len(), data.len(), "round {round}");
        assert!(back == data, "round {round}: echoed bytes differ");
    }
    assert_eq!(
        actor.call(Sink(pattern(3 << 20, 9))).await.unwrap(),
        3 << 20
    );
    let received = shm_bytes_received() - before;
    assert!(
        received >= (8 << 20) + (200 << 10),
        "the driver received only {received} bytes through the worker's ring"
    );
}

/// A payload larger than the last one the ring held still travels through it once the ring is drained (each
/// 100 MiB reply after 1 MiB ones used to go to QUIC: the bytes a drained ring skips to restart at its beginning
/// were counted against the payload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_13_100_mib_payloads_after_smaller_ones_go_through_the_ring() {
    let cluster = common::cluster().await;
    let actor = cluster
        .spawn::<Counter>(0, SpawnOptions::new())
        .await
        .unwrap();
    // The first large reply offers the worker's ring; the second one travels through it.
    for round in 0..2u8 {
        let data = pattern(1 << 20, round);
        assert!(actor.call(Echo(data.clone())).await.unwrap() == data);
    }
    for round in 0..3u8 {
        let data = vec![round + 1; 100 << 20];
        let before = shm_bytes_received();
        let back = actor.call(Echo(data.clone())).await.unwrap();
        let received = shm_bytes_received() - before;
        assert!(back == data, "round {round}: echoed bytes differ");
        assert!(
            received >= 100 << 20,
            "round {round}: the 100 MiB reply did not come through the ring ({received} bytes did)"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_13_a_full_ring_falls_back_to_quic_in_order() {
    // A 1 MiB ring cannot hold 24 pipelined 300 KiB calls: some wait for nothing and go inline instead.
    common::set_env("FERL_SHM_BYTES", (1 << 20).to_string());
    let cluster = common::cluster().await;
    let actor = cluster
        .spawn::<Counter>(0, SpawnOptions::new())
        .await
        .unwrap();
    actor.call(Echo(pattern(300 << 10, 0))).await.unwrap();
    let calls: Vec<_> = (0..24u8)
        .map(|i| {
            let actor = actor.clone();
            tokio::spawn(async move { (i, actor.call(Echo(pattern(300 << 10, i))).await) })
        })
        .collect();
    for call in calls {
        let (i, back) = call.await.unwrap();
        assert!(
            back.unwrap() == pattern(300 << 10, i),
            "call {i} came back wrong"
        );
    }
    // Tells of large payloads keep their order with calls (guarantee 2 holds across both paths).
    for seq in 0..5u64 {
        actor
            .tell(Sink(pattern(400 << 10, seq as u8)))
            .await
            .unwrap();
        actor.tell(Record { sender: 1, seq }).await.unwrap();
    }
    let seen = actor.call(Recorded).await.unwrap();
    assert_eq!(seen, (0..5).map(|s| (1, s)).collect::<Vec<_>>());
    assert!(shm_bytes_received() > 0, "the ring was never used");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_13_with_the_ring_off_large_payloads_stay_on_quic() {
    common::set_env("FERL_SHM_BYTES", "0");
    let cluster = common::cluster().await;
    let actor = cluster
        .spawn::<Counter>(0, SpawnOptions::new())
        .await
        .unwrap();
    for len in [6 << 20, 1 << 20] {
        let data = pattern(len, 3);
        assert!(actor.call(Echo(data.clone())).await.unwrap() == data);
    }
    assert_eq!(shm_bytes_received(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_14_shared_bytes_arrive_as_views_of_the_received_buffer() {
    let cluster = common::cluster().await;
    let actor = cluster
        .spawn::<Counter>(0, SpawnOptions::new())
        .await
        .unwrap();
    let data: ferl_runtime::SharedBytes = pattern(1 << 20, 3).into();
    // Sent twice from one buffer: the clones share it, and each arrives as a view, not a copy.
    for _ in 0..2 {
        let (len, shared) = actor.call(SinkShared(data.clone())).await.unwrap();
        assert_eq!(len, 1 << 20);
        assert!(
            shared,
            "the actor's SharedBytes was copied out of the message"
        );
    }
    // Small messages are decoded by copying.
    let (len, shared) = actor
        .call(SinkShared(pattern(1000, 1).into()))
        .await
        .unwrap();
    assert_eq!((len, shared), (1000, false));
    // Replies too: the echo comes back equal, as a view of the reply buffer.
    let back = actor.call(EchoShared(data.clone())).await.unwrap();
    assert!(back == data, "echoed bytes differ");
    assert!(back.is_shared_with_message(), "the reply was copied");
    // A Vec<u8> peer type reads the same bytes (the wire format is that of Vec<u8>).
    assert_eq!(actor.call(Sink(data.to_vec())).await.unwrap(), 1 << 20);
}

/// Opens a bulk stream carrying payload `id` of `len` bytes that no frame will ever name.
fn send_unclaimed(conn: &quinn::Connection, id: u64, len: usize) {
    let conn = conn.clone();
    tokio::spawn(async move {
        let mut send = conn.open_uni().await?;
        send.write_all(&id.to_le_bytes()).await?;
        send.write_all(&(len as u64).to_le_bytes()).await?;
        send.write_all(&vec![7u8; len]).await?;
        send.finish()?;
        anyhow::Ok(())
    });
}

/// Waits up to 10 s for `cond`.
async fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..200 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_15_payloads_announced_and_never_claimed_are_capped_and_reclaimed() {
    // Small limits for this process's connections (one test per process under nextest).
    common::set_env("FERL_BULK_UNCLAIMED_BYTES", (1u64 << 20).to_string());
    common::set_env("FERL_BULK_UNCLAIMED_TIMEOUT_S", "1.5");
    let head = common::head(2.0, Duration::from_secs(3)).await;
    let base = unclaimed_bytes();
    let closed = |conn: quinn::Connection| async move {
        let reason = tokio::time::timeout(Duration::from_secs(10), conn.closed()).await;
        reason.expect("the head closes the connection").to_string()
    };

    // Over the cap: the second payload is never read while the first holds the room.
    let conn = common::member_connection(&head).await;
    send_unclaimed(&conn, 1, 600 << 10);
    eventually("the first payload arrives", || {
        unclaimed_bytes() == base + (600 << 10)
    })
    .await;
    send_unclaimed(&conn, 2, 600 << 10);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        unclaimed_bytes(),
        base + (600 << 10),
        "admitted beyond the cap"
    );
    let reason = closed(conn).await;
    assert!(reason.contains("FERL_BULK_UNCLAIMED_"), "{reason}");
    eventually("the bytes are reclaimed", || unclaimed_bytes() == base).await;

    // Under the cap but never claimed: reclaimed after the time-out, with the reason.
    let conn = common::member_connection(&head).await;
    send_unclaimed(&conn, 7, 100 << 10);
    eventually("the payload arrives", || {
        unclaimed_bytes() == base + (100 << 10)
    })
    .await;
    let reason = closed(conn).await;
    assert!(
        reason.contains("bulk payload 7 of 102400 bytes was not claimed"),
        "{reason}"
    );
    eventually("the bytes are reclaimed", || unclaimed_bytes() == base).await;

    // Reclaimed when the peer goes away, too.
    let conn = common::member_connection(&head).await;
    send_unclaimed(&conn, 9, 100 << 10);
    eventually("the payload arrives", || {
        unclaimed_bytes() == base + (100 << 10)
    })
    .await;
    conn.close(0u32.into(), b"bye");
    eventually("the bytes are reclaimed on disconnect", || {
        unclaimed_bytes() == base
    })
    .await;

    // The head is unharmed.
    head.cluster.kv_put("still", vec![1]).await.unwrap();
    let a = head
        .cluster
        .spawn::<Counter>(1, SpawnOptions::new())
        .await
        .unwrap();
    assert_eq!(a.call(Get).await.unwrap(), 1);
}
