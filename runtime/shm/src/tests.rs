//! Unit tests of the shared ring: wrap-around, full and empty, positions, wakeups, and offers that must be refused.

use super::*;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

fn never() -> bool {
    false
}

const WATCH: Watch<'static> = Watch {
    peer_gone: &never,
    timeout: Duration::from_secs(30),
};

/// A one-ring segment and its accepted twin, as two processes would hold them.
fn pair(rings: usize, ring_bytes: usize) -> (Segment, Segment) {
    let created = Segment::create(rings, ring_bytes, false).unwrap();
    let accepted = Segment::accept(&created.offer().unwrap()).unwrap();
    (created, accepted)
}

#[test]
fn offers_round_trip_as_bytes() {
    let (created, _) = pair(2, MIN_RING_BYTES);
    let offer = created.offer().unwrap();
    assert_eq!(Offer::decode(&offer.encode()).unwrap(), offer);
    assert_eq!(offer.pid, std::process::id());
    assert_eq!((offer.rings, offer.ring_bytes), (2, MIN_RING_BYTES as u64));
    assert!(Offer::decode(&offer.encode()[1..]).is_err());
}

#[test]
fn a_stream_wraps_around_the_end_of_a_small_ring_intact() {
    let (created, accepted) = pair(1, MIN_RING_BYTES);
    let (mut tx, mut rx) = (created.producer(0), accepted.consumer(0));
    let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            for chunk in data.chunks(3001) {
                tx.send(chunk, &WATCH).unwrap();
            }
        });
        let mut got = vec![0u8; data.len()];
        rx.recv_exact(&mut got, &WATCH).unwrap();
        assert!(got == data, "bytes differ after wrapping");
    });
}

#[test]
fn pieces_never_split_an_element_across_the_end() {
    let (created, accepted) = pair(1, 64 << 10);
    let (mut tx, mut rx) = (created.producer(0), accepted.consumer(0));
    for round in 0..50u64 {
        let frame: Vec<u8> = (0..(round as usize * 131 % 3000 + 1) * 4)
            .map(|i| i as u8)
            .collect();
        tx.send(&frame, &WATCH).unwrap();
        tx.pad_to(8, &WATCH).unwrap();
        let mut got = Vec::new();
        rx.recv_pieces(frame.len(), 4, &WATCH, |off, piece| {
            assert_eq!(off, got.len());
            assert_eq!(
                piece.len() % 4,
                0,
                "round {round}: a piece splits an element"
            );
            got.extend_from_slice(piece);
        })
        .unwrap();
        rx.skip_to(8, &WATCH).unwrap();
        assert_eq!(got, frame, "round {round}");
    }
}

#[test]
fn payloads_fill_the_ring_then_fit_again_once_taken() {
    let (created, accepted) = pair(1, 64 << 10);
    let (mut tx, mut rx) = (created.producer(0), accepted.consumer(0));
    let a = vec![1u8; 40 << 10];
    let b = vec![2u8; 20 << 10];
    assert_eq!(tx.try_put(&a), Some(0), "an empty ring starts at 0");
    assert_eq!(tx.try_put(&b), Some(40 << 10));
    assert_eq!(tx.try_put(&b), None, "full: only 4 KiB are free");
    assert_eq!(tx.in_flight(), 60 << 10);
    assert_eq!(rx.take(0, 40 << 10, |s| s.to_vec()).unwrap(), a);
    // 20 KiB do not fit before the end (4 KiB left): the payload starts at the ring's next beginning.
    assert_eq!(tx.try_put(&b), Some(64 << 10));
    assert_eq!(tx.try_put(&a), None, "wrapped: [20, 40) KiB free only");
    assert_eq!(rx.take(40 << 10, 20 << 10, |s| s.to_vec()).unwrap(), b);
    assert_eq!(rx.take(64 << 10, 20 << 10, |s| s[0]).unwrap(), 2);
    assert_eq!(tx.in_flight(), 0, "empty");
    // A drained ring starts over at its beginning.
    assert_eq!(tx.try_put(&b), Some(128 << 10));
    assert_eq!(tx.try_put(&[]), None);
    assert_eq!(tx.try_put(&vec![0u8; (64 << 10) + 1]), None);
}

/// A drained ring restarts at its beginning whatever the last payload's size was: the bytes it skips to get there
/// hold nothing and must not count against the next payload (they did, and a payload larger than the previous one
/// never fitted again: every 100 MiB call after a 1 MiB one went to QUIC).
#[test]
fn a_drained_ring_takes_a_payload_larger_than_the_last_one() {
    let (created, accepted) = pair(1, 64 << 10);
    let (mut tx, mut rx) = (created.producer(0), accepted.consumer(0));
    let small = vec![3u8; 4 << 10];
    let big = vec![4u8; 48 << 10];
    let mut round_start = 0;
    for round in 0..4u64 {
        let at = tx.try_put(&small).unwrap();
        assert_eq!(
            at % (64 << 10),
            0,
            "round {round}: a drained ring starts over"
        );
        assert!(at >= round_start);
        rx.take(at, small.len() as u64, |s| assert!(s == small.as_slice()))
            .unwrap();
        assert_eq!(tx.in_flight(), 0, "round {round}: drained");
        let at = tx
            .try_put(&big)
            .unwrap_or_else(|| panic!("round {round}: 48 KiB do not fit a drained 64 KiB ring"));
        assert_eq!(at % (64 << 10), 0, "round {round}: at the beginning");
        assert_eq!(
            tx.in_flight(),
            48 << 10,
            "round {round}: only the payload is in flight"
        );
        // Only 16 KiB are free: behind the payload.
        assert_eq!(
            tx.try_put(&vec![5u8; (16 << 10) + 1]),
            None,
            "round {round}"
        );
        let c = tx.try_put(&vec![5u8; 16 << 10]).unwrap();
        assert_eq!(c, at + (48 << 10), "round {round}: right behind");
        assert_eq!(tx.try_put(&[6u8; 1]), None, "round {round}: full");
        rx.take(at, big.len() as u64, |s| assert!(s == big.as_slice()))
            .unwrap();
        // 48 KiB free again at the beginning, while 16 KiB are still in flight at the end.
        let d = tx.try_put(&big).unwrap();
        assert_eq!(
            d,
            at + (64 << 10),
            "round {round}: wrapped behind the last payload"
        );
        rx.take(c, 16 << 10, |s| assert_eq!(s[0], 5)).unwrap();
        rx.take(d, big.len() as u64, |s| assert!(s == big.as_slice()))
            .unwrap();
        round_start = d + (48 << 10);
    }
}

/// The runtime's 100 MiB transfers through its default 256 MiB ring, after a 1 MiB payload: each one is taken
/// before the next is put, and every one fits the ring.
#[test]
fn payloads_of_100_mib_fit_a_256_mib_ring_again_and_again() {
    let (created, accepted) = pair(1, 256 << 20);
    let (mut tx, mut rx) = (created.producer(0), accepted.consumer(0));
    let mib = vec![1u8; 1 << 20];
    let at = tx.try_put(&mib).unwrap();
    rx.take(at, mib.len() as u64, |s| assert_eq!(s.len(), 1 << 20))
        .unwrap();
    let big = vec![2u8; 100 << 20];
    for round in 0..4 {
        let at = tx
            .try_put(&big)
            .unwrap_or_else(|| panic!("round {round}: 100 MiB do not fit a drained 256 MiB ring"));
        rx.take(at, big.len() as u64, |s| {
            assert_eq!((s.len(), s[0], s[s.len() - 1]), (100 << 20, 2, 2))
        })
        .unwrap();
        // A payload of another size in between, as calls of several sizes share a stream's ring.
        let at = tx.try_put(&mib[..(round + 1) << 16]).unwrap();
        rx.take(at, ((round + 1) << 16) as u64, |_| ()).unwrap();
    }
}

#[test]
fn positions_outside_the_published_bytes_are_refused() {
    let (created, accepted) = pair(1, 64 << 10);
    let (mut tx, mut rx) = (created.producer(0), accepted.consumer(0));
    let at = tx.try_put(&[7u8; 1000]).unwrap();
    for (pos, len) in [
        (at, 1001),
        (at + 1, 1000),
        (u64::MAX, 2),
        (at, 0),
        (60 << 10, 8 << 10),
    ] {
        let err = rx.take(pos, len, |_| ()).unwrap_err();
        assert!(err.to_string().contains("outside"), "{pos}+{len}: {err}");
    }
    rx.take(at, 1000, |s| assert_eq!(s, &[7u8; 1000][..]))
        .unwrap();
    let err = rx.take(at, 1000, |_| ()).unwrap_err();
    assert!(err.to_string().contains("outside"), "taken twice: {err}");
}

#[test]
fn a_closed_segment_fails_the_waiting_side_after_delivering_what_was_sent() {
    let (created, accepted) = pair(2, MIN_RING_BYTES);
    let (mut tx, mut rx) = (created.producer(1), accepted.consumer(1));
    tx.send(b"last words", &WATCH).unwrap();
    created.close();
    assert!(accepted.is_closed());
    let mut buf = [0u8; 10];
    rx.recv_exact(&mut buf, &WATCH).unwrap();
    assert_eq!(&buf, b"last words");
    let start = Instant::now();
    let err = rx.recv_exact(&mut buf, &WATCH).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_gone_peer_or_a_silent_one_fails_the_wait() {
    let (created, accepted) = pair(1, MIN_RING_BYTES);
    let mut rx = accepted.consumer(0);
    let gone = || true;
    let watch = Watch {
        peer_gone: &gone,
        timeout: Duration::from_secs(30),
    };
    let err = rx.recv_exact(&mut [0u8; 4], &watch).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
    let mut tx = created.producer(0);
    tx.send(&[0u8; MIN_RING_BYTES], &WATCH).unwrap();
    let silent = Watch {
        peer_gone: &never,
        timeout: Duration::from_millis(200),
    };
    let err = tx.send(&[1], &silent).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
}

#[test]
fn offers_with_a_wrong_nonce_geometry_or_descriptor_are_refused() {
    let created = Segment::create(2, MIN_RING_BYTES, true).unwrap();
    let offer = created.offer().unwrap();
    let refused = |o: Offer| Segment::accept(&o).err().unwrap().to_string();
    let mut wrong = offer;
    wrong.nonce[0] ^= 1;
    assert!(refused(wrong).contains("not the segment offered"));
    let mut wrong = offer;
    wrong.ring_bytes *= 2;
    assert!(refused(wrong).contains("the offer says"));
    let mut wrong = offer;
    wrong.rings = 1;
    assert!(refused(wrong).contains("the offer says"));
    let mut wrong = offer;
    wrong.rings = 9;
    assert!(refused(wrong).contains("outside"));
    let mut wrong = offer;
    wrong.ring_bytes = 3 << 12;
    assert!(refused(wrong).contains("outside"));
    let mut wrong = offer;
    wrong.fd = 1_000_000;
    assert!(refused(wrong).contains("cannot open"));
    // Any other file of this process, here an unsealed one of the right size: refused.
    let file = tempfile_of(offer.ring_bytes as usize * 2 + 8192);
    let mut wrong = offer;
    wrong.fd = file.as_raw_fd();
    assert!(refused(wrong).contains("not sealed"));
    // Once the creator closed its descriptor, the offer opens nothing.
    let mut created = created;
    created.close_fd();
    assert!(created.offer().is_none());
    assert!(Segment::accept(&offer).is_err(), "a closed offer opened");
}

/// An unlinked regular file of `len` bytes.
fn tempfile_of(len: usize) -> std::fs::File {
    let path = std::env::temp_dir().join(format!("ferl-shm-test-{}", std::process::id()));
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    file.set_len(len as u64).unwrap();
    file
}

#[test]
fn a_torn_or_foreign_header_is_refused() {
    for (at, what) in [
        (0usize, "magic"),
        (7, "version"),
        (8, "nonce"),
        (40, "rings"),
        (48, "ring size"),
    ] {
        let created = Segment::create(1, MIN_RING_BYTES, false).unwrap();
        let offer = created.offer().unwrap();
        // SAFETY: a byte of the header page of a mapping `created` keeps alive; nobody else maps it.
        unsafe { *created.header_ptr().add(at) ^= 0x5a };
        let err = Segment::accept(&offer).err().unwrap().to_string();
        assert!(
            err.contains("not the segment offered") || err.contains("the offer"),
            "{what}: {err}"
        );
    }
}

#[test]
fn another_user_cannot_open_the_segment() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP: only root can switch to another user here");
        return;
    }
    let created = Segment::create(1, MIN_RING_BYTES, false).unwrap();
    let offer = created.offer().unwrap();
    let path = std::ffi::CString::new(format!("/proc/{}/fd/{}", offer.pid, offer.fd)).unwrap();
    // SAFETY: the child only calls async-signal-safe functions (setgid, setuid, open, _exit) before exiting.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: see above; the child never returns into the test harness.
        unsafe {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                libc::_exit(2);
            }
            let fd = libc::open(path.as_ptr(), libc::O_RDWR);
            libc::_exit(if fd < 0 { 0 } else { 1 });
        }
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status));
    match libc::WEXITSTATUS(status) {
        0 => {}
        1 => panic!("user 65534 opened another user's segment"),
        _ => println!("SKIP: could not switch to user 65534"),
    }
}
