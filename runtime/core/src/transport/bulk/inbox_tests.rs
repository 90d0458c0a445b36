//! Guarantee 15: what a peer holds unclaimed is bounded, and reclaimed by claims, time-outs and closing.

use super::*;

fn limits(bytes: u64, payloads: usize, timeout_ms: u64) -> BulkLimits {
    BulkLimits {
        bytes,
        payloads,
        timeout: Duration::from_millis(timeout_ms),
    }
}

fn payload(len: usize) -> AlignedVec {
    let mut v = AlignedVec::new();
    v.resize(len, 7);
    v
}

#[tokio::test]
async fn guarantee_15_unclaimed_bytes_and_payloads_are_capped_and_claims_make_room() {
    let inbox = Arc::new(BulkInbox::new(limits(1000, 3, 60_000)));
    assert_eq!(inbox.admit(1, 600).await, Ok(Admission::Unclaimed));
    inbox.arrive(1, payload(600));
    assert_eq!(inbox.admit(2, 400).await, Ok(Admission::Unclaimed));
    assert_eq!(inbox.unclaimed(), (2, 1000));
    // Over the byte cap: the third stream waits for room...
    let waiting = tokio::spawn({
        let inbox = inbox.clone();
        async move { inbox.admit(3, 1).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "admitted beyond the byte cap");
    // ...which a claim makes.
    let got = inbox.wait(1).await.unwrap();
    assert_eq!(got.len(), 600);
    assert_eq!(waiting.await.unwrap(), Ok(Admission::Unclaimed));
    assert_eq!(inbox.unclaimed(), (2, 401));
    // The payload cap.
    assert_eq!(inbox.admit(4, 0).await, Ok(Admission::Unclaimed));
    let capped = tokio::time::timeout(Duration::from_millis(50), inbox.admit(5, 0)).await;
    assert!(capped.is_err(), "admitted beyond the payload cap");
    // A payload a frame already names is admitted whatever is held, and never counted.
    let rx = inbox.wait(6);
    assert_eq!(inbox.admit(6, 5000).await, Ok(Admission::Claimed));
    inbox.arrive(6, payload(5000));
    assert_eq!(rx.await.unwrap().len(), 5000);
    assert_eq!(inbox.unclaimed(), (3, 401));
}

#[tokio::test]
async fn guarantee_15_a_stream_waiting_too_long_for_room_gets_an_error_naming_the_limits() {
    let inbox = BulkInbox::new(limits(100, 8, 100));
    assert_eq!(inbox.admit(1, 100).await, Ok(Admission::Unclaimed));
    let err = inbox.admit(2, 1).await.unwrap_err();
    assert!(err.contains("bulk payload 2 of 1 bytes waited"), "{err}");
    assert!(
        err.contains("100 bytes in 1 payloads that no call claimed"),
        "{err}"
    );
    assert!(err.contains("FERL_BULK_UNCLAIMED_"), "{err}");
    let err = inbox.admit(1, 1).await.unwrap_err();
    assert!(err.contains("announced twice"), "{err}");
}

#[tokio::test]
async fn guarantee_15_time_outs_and_closing_reclaim_everything() {
    let before = unclaimed_bytes();
    let inbox = BulkInbox::new(limits(1 << 20, 8, 50));
    inbox.admit(1, 300).await.unwrap();
    inbox.arrive(1, payload(300));
    inbox.admit(2, 200).await.unwrap();
    assert!(unclaimed_bytes() >= before + 500);
    assert_eq!(inbox.expired(Instant::now()), None);
    let later = Instant::now() + Duration::from_millis(60);
    let reason = inbox.expired(later).expect("expired");
    assert!(
        reason.contains("was not claimed by any call within"),
        "{reason}"
    );
    // A call waiting for a payload fails when the connection closes, and the bytes are freed.
    let waiter = inbox.wait(3);
    inbox.close(&reason);
    assert_eq!(inbox.unclaimed(), (0, 0));
    assert!(waiter.await.is_err(), "a waiter outlived the connection");
    assert!(
        inbox.wait(1).await.is_err(),
        "a claim after closing succeeded"
    );
    let err = inbox.admit(4, 1).await.unwrap_err();
    assert!(err.contains("the connection is closed"), "{err}");
}

#[tokio::test]
async fn guarantee_15_a_failed_stream_frees_its_room_and_fails_its_waiter() {
    let inbox = BulkInbox::new(limits(100, 8, 60_000));
    inbox.admit(1, 100).await.unwrap();
    inbox.abandon(1);
    assert_eq!(inbox.unclaimed(), (0, 0));
    let rx = inbox.wait(2);
    assert_eq!(inbox.admit(2, 10).await, Ok(Admission::Claimed));
    inbox.abandon(2);
    assert!(rx.await.is_err(), "the waiter of a failed stream hangs");
}

#[test]
fn guarantee_15_claims_nobody_awaits_are_forgotten() {
    let inbox = BulkInbox::new(limits(100, 8, 60_000));
    for id in 0..10_000 {
        drop(inbox.wait(id));
    }
    let slots = inbox.lock().slots.len();
    assert!(slots <= 2048, "{slots} abandoned claims kept");
}
