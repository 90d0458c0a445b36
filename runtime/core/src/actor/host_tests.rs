//! The mailbox's back-pressure against in-memory outboxes: channel, waiting line, refusals, pauses and resumes
//! (guarantee 3 in `runtime/README.md`).

use std::net::SocketAddr;
use std::time::Duration;

use rkyv::util::AlignedVec;
use tokio::sync::{mpsc, oneshot};

use super::{Mailbox, Offered};
use crate::protocol::{CallKind, Frame, RemoteError, RemoteErrorKind};
use crate::transport::delivery::{Envelope, Payload, Responder};
use crate::transport::{Outbox, Outgoing};

const ACTOR: u64 = 7;
const CAPACITY: usize = 2;
/// Long enough for any step of these tests: a bug fails them instead of hanging them.
const WAIT: Duration = Duration::from_secs(5);

fn envelope(tag: &str, kind: CallKind, reply: Responder) -> Envelope {
    let mut bytes = AlignedVec::new();
    bytes.extend_from_slice(tag.as_bytes());
    Envelope {
        msg: "m".into(),
        kind,
        payload: Payload::Ready(bytes),
        reply,
    }
}

/// A tell nobody answers (as an in-process `tell` sends it).
fn tell(tag: &str) -> Envelope {
    envelope(tag, CallKind::Tell, Responder::Nobody)
}

/// A remote tell from the stream of `out`.
fn told(tag: &str, out: &Outbox) -> Envelope {
    envelope(tag, CallKind::Tell, Responder::Told(out.clone()))
}

/// A remote call from the stream of `out`.
fn remote_call(tag: &str, out: &Outbox) -> Envelope {
    envelope(
        tag,
        CallKind::Call,
        Responder::Remote {
            req: 1,
            out: out.clone(),
        },
    )
}

/// An in-process call, and where its answer arrives.
type Answer = oneshot::Receiver<Result<AlignedVec, RemoteError>>;
fn local_call(tag: &str) -> (Envelope, Answer) {
    let (tx, rx) = oneshot::channel();
    (envelope(tag, CallKind::Call, Responder::Local(tx)), rx)
}

fn outbox(port: u16) -> (Outbox, mpsc::Receiver<Outgoing>) {
    Outbox::in_memory(SocketAddr::from(([127, 0, 0, 1], port)))
}

fn tag(env: &Envelope) -> String {
    match &env.payload {
        Payload::Ready(bytes) => String::from_utf8(bytes.to_vec()).expect("utf-8 tag"),
        Payload::Bulk(_) => panic!("a test envelope has its bytes"),
    }
}

fn describe(offered: &Offered) -> String {
    match offered {
        Offered::Queued => "Queued".into(),
        Offered::Closed(env) => format!("Closed({})", tag(env)),
        Offered::Full(env) => format!("Full({})", tag(env)),
        Offered::Pause(_, frame) => format!("Pause({frame:?})"),
    }
}

fn expect_queued(offered: Offered) {
    assert!(
        matches!(offered, Offered::Queued),
        "expected Queued, got {}",
        describe(&offered)
    );
}

/// The message came back refused as "full"; returns it.
fn expect_full(offered: Offered) -> Envelope {
    match offered {
        Offered::Full(env) => env,
        other => panic!("expected Full, got {}", describe(&other)),
    }
}

fn expect_pause(offered: Offered, sender: &Outbox, want: u64) {
    match offered {
        Offered::Pause(out, Frame::Pause { actor, epoch }) => {
            assert!(
                out.same_stream(sender),
                "the pause goes to the tell's sender"
            );
            assert_eq!((actor, epoch), (ACTOR, want));
        }
        other => panic!("expected a pause of epoch {want}, got {}", describe(&other)),
    }
}

/// The tags of the messages waiting in the line.
fn waiting(mailbox: &Mailbox) -> Vec<String> {
    let line = mailbox.line.lock().expect("line lock");
    line.waiting.iter().map(tag).collect()
}

fn paused(mailbox: &Mailbox) -> usize {
    mailbox.line.lock().expect("line lock").paused.len()
}

async fn recv_tag(rx: &mut mpsc::Receiver<Envelope>) -> String {
    let env = tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("timed out waiting for the mailbox")
        .expect("mailbox channel open");
    tag(&env)
}

/// Lets the line's drain task refill the channel to `len` messages.
async fn channel_holds(rx: &mpsc::Receiver<Envelope>, len: usize) {
    tokio::time::timeout(WAIT, async {
        while rx.len() < len {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the line's drain task refills the channel");
}

async fn expect_resume(written: &mut mpsc::Receiver<Outgoing>, want: u64) {
    let out = tokio::time::timeout(WAIT, written.recv())
        .await
        .expect("timed out waiting for a resume")
        .expect("outbox open");
    match out.frame() {
        Frame::Resume { actor, epoch } => assert_eq!((*actor, *epoch), (ACTOR, want)),
        other => panic!("expected a resume of epoch {want}, got {other:?}"),
    }
}

#[tokio::test]
async fn offers_fill_the_channel_then_the_line_and_keep_their_order() {
    let (mailbox, mut rx) = Mailbox::new(ACTOR, CAPACITY);
    assert_eq!(mailbox.capacity(), CAPACITY);
    for t in ["m0", "m1"] {
        expect_queued(mailbox.offer(tell(t)));
    }
    assert_eq!(rx.len(), 2, "while it has room, offers go to the channel");
    assert!(waiting(&mailbox).is_empty());
    assert!(!mailbox.line.lock().expect("line lock").draining);

    for t in ["m2", "m3"] {
        expect_queued(mailbox.offer(tell(t)));
    }
    assert_eq!(waiting(&mailbox), ["m2", "m3"]);
    assert!(mailbox.line.lock().expect("line lock").draining);

    for want in ["m0", "m1", "m2", "m3"] {
        assert_eq!(recv_tag(&mut rx).await, want);
    }
    // The line is empty and its drain task done: the next offer goes straight to the channel again.
    assert!(!mailbox.line.lock().expect("line lock").draining);
    expect_queued(mailbox.offer(tell("m4")));
    assert!(waiting(&mailbox).is_empty());
    assert_eq!(recv_tag(&mut rx).await, "m4");
}

#[tokio::test]
async fn a_line_with_room_takes_later_messages_even_when_the_channel_has_room() {
    let (mailbox, mut rx) = Mailbox::new(ACTOR, CAPACITY);
    for t in ["m0", "m1", "m2"] {
        expect_queued(mailbox.offer(tell(t)));
    }
    assert_eq!(waiting(&mailbox), ["m2"]);
    // The test takes m0 without letting the drain task run: the channel has room, but m3 must not overtake m2.
    let first = rx.try_recv().expect("m0 in the channel");
    assert_eq!(tag(&first), "m0");
    expect_queued(mailbox.offer(tell("m3")));
    assert_eq!(waiting(&mailbox), ["m2", "m3"]);
    for want in ["m1", "m2", "m3"] {
        assert_eq!(recv_tag(&mut rx).await, want);
    }
}

#[tokio::test]
async fn a_full_line_refuses_calls_streams_and_unanswered_tells() {
    let (mailbox, mut rx) = Mailbox::new(ACTOR, CAPACITY);
    let (out, mut written) = outbox(1);
    for t in ["m0", "m1", "m2", "m3"] {
        expect_queued(mailbox.offer(tell(t)));
    }
    let call = expect_full(mailbox.offer(remote_call("call", &out)));
    assert_eq!((tag(&call), call.kind), ("call".into(), CallKind::Call));
    assert!(matches!(call.reply, Responder::Remote { req: 1, .. }));
    let stream = expect_full(mailbox.offer(envelope(
        "stream",
        CallKind::Stream,
        Responder::Remote {
            req: 2,
            out: out.clone(),
        },
    )));
    assert_eq!(tag(&stream), "stream");
    // A tell without a sender's stream to pause is refused too (only `Responder::Told` is queued beyond the line).
    let nobody = expect_full(mailbox.offer(tell("nobody")));
    assert_eq!(tag(&nobody), "nobody");
    let (local, _answer) = local_call("local");
    assert_eq!(tag(&expect_full(mailbox.offer(local))), "local");

    assert_eq!(
        waiting(&mailbox),
        ["m2", "m3"],
        "refusals leave the line as it was"
    );
    assert_eq!(paused(&mailbox), 0);
    assert!(
        written.try_recv().is_err(),
        "the mailbox writes nothing itself"
    );
    for want in ["m0", "m1", "m2", "m3"] {
        assert_eq!(recv_tag(&mut rx).await, want);
    }
}

#[tokio::test]
async fn a_full_line_queues_remote_tells_pauses_each_sender_once_and_resumes_them() {
    let (mailbox, mut rx) = Mailbox::new(ACTOR, CAPACITY);
    let (a, mut a_written) = outbox(1);
    let (b, mut b_written) = outbox(2);
    expect_queued(mailbox.offer(told("m0", &a)));
    expect_queued(mailbox.offer(tell("m1")));
    expect_queued(mailbox.offer(told("m2", &b)));
    expect_queued(mailbox.offer(told("m3", &a)));
    assert_eq!(waiting(&mailbox).len(), CAPACITY);

    expect_pause(mailbox.offer(told("a1", &a)), &a, 1);
    expect_queued(mailbox.offer(told("a2", &a)));
    expect_pause(mailbox.offer(told("b1", &b)), &b, 2);
    assert_eq!(paused(&mailbox), 2);
    assert_eq!(waiting(&mailbox), ["m2", "m3", "a1", "a2", "b1"]);
    // Calls are still refused while the line is over capacity.
    expect_full(mailbox.offer(remote_call("call", &a)));

    // Taking m0 and m1 moves m2 and m3 into the channel; a1, a2, b1 still fill the line: nobody is resumed.
    assert_eq!(recv_tag(&mut rx).await, "m0");
    assert_eq!(recv_tag(&mut rx).await, "m1");
    channel_holds(&rx, 2).await;
    assert_eq!(waiting(&mailbox), ["a1", "a2", "b1"]);
    assert!(a_written.try_recv().is_err() && b_written.try_recv().is_err());
    // Taking m2 moves a1: two wait, still no room.
    assert_eq!(recv_tag(&mut rx).await, "m2");
    channel_holds(&rx, 2).await;
    assert_eq!(waiting(&mailbox), ["a2", "b1"]);
    assert!(a_written.try_recv().is_err() && b_written.try_recv().is_err());
    // Taking m3 moves a2: the line has room, both senders are resumed with the latest epoch.
    assert_eq!(recv_tag(&mut rx).await, "m3");
    expect_resume(&mut a_written, 2).await;
    expect_resume(&mut b_written, 2).await;
    assert_eq!(paused(&mailbox), 0);

    for want in ["a1", "a2", "b1"] {
        assert_eq!(recv_tag(&mut rx).await, want);
    }
    assert!(waiting(&mailbox).is_empty());
    assert!(
        a_written.try_recv().is_err() && b_written.try_recv().is_err(),
        "one resume each"
    );

    // A later pause continues the epochs.
    for t in ["n0", "n1", "n2", "n3"] {
        expect_queued(mailbox.offer(tell(t)));
    }
    expect_pause(mailbox.offer(told("a3", &a)), &a, 3);
}

#[tokio::test]
async fn the_line_exceeds_capacity_only_by_queued_tells() {
    let (mailbox, _rx) = Mailbox::new(ACTOR, CAPACITY);
    let (a, _a_written) = outbox(1);
    let (b, _b_written) = outbox(2);
    let (mut tells_beyond, mut pauses) = (0, Vec::new());
    for i in 0..40 {
        let t = format!("x{i}");
        let full = waiting(&mailbox).len() >= CAPACITY;
        let env = match i % 3 {
            0 => remote_call(&t, &a),
            1 => told(&t, &a),
            _ => told(&t, &b),
        };
        match mailbox.offer(env) {
            Offered::Queued if full => tells_beyond += 1,
            Offered::Queued => {}
            Offered::Pause(_, Frame::Pause { epoch, .. }) => {
                tells_beyond += 1;
                pauses.push(epoch);
            }
            Offered::Full(env) => {
                assert!(full, "refused before the line was full");
                assert_eq!(env.kind, CallKind::Call);
            }
            other => panic!("unexpected {}", describe(&other)),
        }
        assert!(
            waiting(&mailbox).len() <= CAPACITY + tells_beyond,
            "line of {} with capacity {CAPACITY} and {tells_beyond} tells beyond it",
            waiting(&mailbox).len()
        );
    }
    assert_eq!(pauses, [1, 2], "one pause per sender");
    assert_eq!(waiting(&mailbox).len(), CAPACITY + tells_beyond);
}

#[tokio::test]
async fn a_stopped_actor_refuses_waiting_calls_and_resumes_paused_senders() {
    let (mailbox, rx) = Mailbox::new(ACTOR, CAPACITY);
    let (a, mut a_written) = outbox(1);
    let mut answers = Vec::new();
    for t in ["c0", "c1", "c2", "c3"] {
        let (env, answer) = local_call(t);
        expect_queued(mailbox.offer(env));
        answers.push(answer);
    }
    expect_pause(mailbox.offer(told("a1", &a)), &a, 1);
    assert_eq!(waiting(&mailbox), ["c2", "c3", "a1"]);

    drop(rx);
    let waited = answers.split_off(2);
    for answer in waited {
        let error = tokio::time::timeout(WAIT, answer)
            .await
            .expect("a waiting call is answered")
            .expect("answered, not dropped")
            .expect_err("refused");
        assert_eq!(error.kind, RemoteErrorKind::NoSuchActor);
    }
    // Calls already in the channel went with it: their callers see the answer dropped rather than waiting.
    for answer in answers {
        let got = tokio::time::timeout(WAIT, answer)
            .await
            .expect("not left waiting");
        assert!(got.is_err());
    }
    expect_resume(&mut a_written, 1).await;
    assert!(waiting(&mailbox).is_empty());
    assert_eq!(paused(&mailbox), 0);

    match mailbox.offer(told("late", &a)) {
        Offered::Closed(env) => assert_eq!(tag(&env), "late"),
        other => panic!("expected Closed, got {}", describe(&other)),
    }
}
