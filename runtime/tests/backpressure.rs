//! Back-pressure per actor on a shared connection (guarantee 3): a slow actor's full mailbox holds up its own
//! callers, never calls to the other actors of its process that travel on the same connection.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferl_runtime::testbed::*;
use ferl_runtime::{Error, SpawnOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantee_3_full_mailbox_holds_its_callers_not_other_actors_on_the_connection() {
    let head = common::head(2.0, Duration::from_secs(3)).await;
    // Two actors hosted by the head process, reached from a second process (a driver that connected): every call
    // below travels on that driver's one connection to the head process.
    let slow_here = head
        .cluster
        .spawn_local(Counter::starting_at(0), SpawnOptions::new().mailbox(2));
    let fast_here = head
        .cluster
        .spawn_local(Counter::starting_at(7), SpawnOptions::new());
    let address = head.cluster.head_address().unwrap().to_string();
    let driver = ferl_runtime::connect(&address, Some(head.token.clone()))
        .await
        .unwrap();
    let slow = driver.actor_ref::<Counter>(slow_here.address().clone());
    let fast = driver.actor_ref::<Counter>(fast_here.address().clone());
    assert_eq!(fast.call(Get).await.unwrap(), 7, "reachable over QUIC");

    let finished = Arc::new(AtomicUsize::new(0));
    let sleep = |ms: u64| {
        let (slow, finished) = (slow.clone(), finished.clone());
        tokio::spawn(async move {
            let r = slow.call(Sleep(ms)).await;
            finished.fetch_add(1, Ordering::SeqCst);
            r
        })
    };
    // One message being handled, then 2 in the mailbox and 2 in its waiting line.
    let mut slow_calls = vec![sleep(2500)];
    tokio::time::sleep(Duration::from_millis(400)).await;
    slow_calls.extend((0..4).map(|_| sleep(2500)));
    tokio::time::sleep(Duration::from_millis(400)).await;

    // The connection still delivers to the other actor at once: its reply comes while the first slow call is
    // still sleeping (the old behaviour blocked the connection's reader until the slow mailbox had room).
    assert_eq!(fast.call(Add(1)).await.unwrap(), 8);
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the fast actor waited behind the slow one"
    );

    // Mailbox and line are full: one more call is refused at once, with an error that says so.
    let err = slow.call(Get).await.unwrap_err();
    assert!(
        matches!(&err, Error::Remote { message, .. } if message.contains("mailbox full")
            && message.contains(&slow.id().to_string())),
        "{err}"
    );
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the refusal came without waiting"
    );

    // The callers that were accepted waited, and every one of them is answered.
    for call in slow_calls {
        assert_eq!(call.await.unwrap().unwrap(), 2500);
    }
    assert_eq!(slow.call(Get).await.unwrap(), 0, "room again once drained");
    driver.shutdown().await;
    head.cluster.shutdown().await;
}
