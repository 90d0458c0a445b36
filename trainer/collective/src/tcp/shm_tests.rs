//! Tests of the shared-memory link: framing over a small ring, closing, peer death, timeouts, offers refused. The
//! ring and segment themselves are tested in `ferl-shm` (another user cannot open a segment; torn headers).

use super::*;
use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

/// Two ends of a link in this process, with the TCP pair that stands for their liveness.
fn pair(ring_bytes: usize, timeout: Duration) -> (ShmLink, ShmLink, TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (b, _) = listener.accept().unwrap();
    let pending = Pending::create(ring_bytes).unwrap();
    let higher = accept(&pending.offer(), b.as_raw_fd(), timeout).unwrap();
    let lower = pending.into_link(a.as_raw_fd(), timeout);
    (lower, higher, a, b)
}

/// Bytes of frame `i`: a length that is a multiple of `unit` but rarely of 8, so padding and wrapping both occur.
fn frame(i: usize, unit: usize) -> Vec<u8> {
    let len = ((i * 7919) % 50_000 + i % 3) * unit;
    (0..len).map(|j| (i * 31 + j * 7) as u8).collect()
}

#[test]
fn frames_of_odd_sizes_cross_a_small_ring_intact_in_order() {
    let (lower, higher, _a, _b) = pair(MIN_RING_BYTES, Duration::from_secs(60));
    let frames = 200;
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..frames {
                let unit = [1, 2, 4, 8][i % 4];
                lower.send(&frame(i, unit)).unwrap();
                lower.end_send_frame().unwrap();
            }
        });
        for i in 0..frames {
            let unit = [1, 2, 4, 8][i % 4];
            let want = frame(i, unit);
            let mut got = vec![0u8; want.len()];
            higher
                .recv_pieces(want.len(), unit, |off, piece| {
                    assert_eq!(piece.len() % unit, 0, "frame {i}: piece splits an element");
                    assert_eq!(
                        piece.as_ptr() as usize % unit,
                        0,
                        "frame {i}: piece misaligned"
                    );
                    got[off..off + piece.len()].copy_from_slice(piece);
                })
                .unwrap();
            higher.end_recv_frame().unwrap();
            assert!(got == want, "frame {i} of {} bytes differs", want.len());
        }
    });
}

#[test]
fn a_closed_link_fails_the_waiting_side_at_once() {
    let (lower, higher, _a, _b) = pair(MIN_RING_BYTES, Duration::from_secs(60));
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            lower.close();
        });
        let mut buf = [0u8; 16];
        let err = higher.recv_exact(&mut buf).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnexpectedEof, "{err}");
    });
    assert!(start.elapsed() < Duration::from_secs(30));
    // Bytes sent before the close are still delivered.
    let (lower, higher, _a, _b) = pair(MIN_RING_BYTES, Duration::from_secs(60));
    lower.send(b"last words").unwrap();
    drop(lower);
    let mut buf = [0u8; 10];
    higher.recv_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"last words");
    assert!(higher.recv_exact(&mut buf).is_err());
}

#[test]
fn a_dead_peer_connection_fails_a_blocked_writer_and_reader() {
    let (lower, higher, a, b) = pair(MIN_RING_BYTES, Duration::from_secs(60));
    // Fill the ring so the writer blocks, then let the peer's "process" die: its socket closes, its link never
    // closes (as after SIGKILL).
    lower.send(&vec![1u8; MIN_RING_BYTES]).unwrap();
    std::mem::forget(higher);
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(b);
        });
        let err = lower.send(&[2u8; 64]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnexpectedEof, "{err}");
    });
    let mut buf = [0u8; 8];
    assert_eq!(
        lower.recv_exact(&mut buf).unwrap_err().kind(),
        ErrorKind::UnexpectedEof
    );
    assert!(start.elapsed() < Duration::from_secs(30));
    drop(a);
}

#[test]
fn a_silent_peer_fails_the_wait_after_the_timeout() {
    let timeout = Duration::from_millis(300);
    let (lower, _higher, _a, _b) = pair(MIN_RING_BYTES, timeout);
    let start = Instant::now();
    let mut buf = [0u8; 8];
    let err = lower.recv_exact(&mut buf).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TimedOut, "{err}");
    assert!(start.elapsed() >= timeout);
}

#[test]
fn the_creators_descriptor_is_closed_once_both_sides_mapped() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let pending = Pending::create(MIN_RING_BYTES).unwrap();
    let offer = pending.offer();
    let higher = accept(&offer, a.as_raw_fd(), Duration::from_secs(5)).unwrap();
    let lower = pending.into_link(a.as_raw_fd(), Duration::from_secs(5));
    // The offer opens nothing any more (or, were its number reused, a file without the offer's nonce).
    assert!(accept(&offer, a.as_raw_fd(), Duration::from_secs(5)).is_err());
    lower.send(b"still mapped").unwrap();
    let mut buf = [0u8; 12];
    higher.recv_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"still mapped");
}

#[test]
fn offers_of_another_descriptor_or_with_the_wrong_nonce_are_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let fd = a.as_raw_fd();
    let pending = Pending::create(MIN_RING_BYTES).unwrap();
    let real = pending.offer();
    // Another descriptor of this process (the TCP socket): not a sealed segment.
    let mut other = real;
    other.fd = fd;
    let err = accept(&other, fd, Duration::from_secs(1)).err().unwrap();
    let err = format!("{err:#}");
    assert!(
        err.contains("cannot open") || err.contains("not a regular file"),
        "{err}"
    );
    let mut offer = real;
    offer.nonce[1] ^= 1;
    let err = accept(&offer, fd, Duration::from_secs(1)).err().unwrap();
    assert!(
        format!("{err:#}").contains("not the segment offered"),
        "{err:#}"
    );
    let mut offer = real;
    offer.rings = 1;
    let err = accept(&offer, fd, Duration::from_secs(1)).err().unwrap();
    assert!(format!("{err:#}").contains("expected 2"), "{err:#}");
    assert!(
        Pending::create(3 << 17).is_err(),
        "ring sizes must be powers of two"
    );
    // Odd sizes are rounded up rather than refused.
    let fitted = Pending::create_fitting(3 << 17).unwrap();
    assert_eq!(fitted.offer().ring_bytes, 1 << 19);
}

#[test]
fn running_out_of_memory_is_told_apart_from_other_failures() {
    let full =
        anyhow::Error::new(std::io::Error::from_raw_os_error(libc::ENOSPC)).context("reserving");
    assert!(out_of_space(&full));
    let denied =
        anyhow::Error::new(std::io::Error::from_raw_os_error(libc::EACCES)).context("opening");
    assert!(!out_of_space(&denied));
}
