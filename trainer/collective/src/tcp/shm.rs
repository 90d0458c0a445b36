//! Shared-memory links between two ranks on the same host: one `ferl-shm` segment per pair holding two
//! single-producer single-consumer byte rings (one per direction). Sending copies into the ring; receiving hands the
//! ring's bytes to the caller in place (a reduction reads them straight from the ring), so a byte crosses memory once
//! on each side instead of passing through the kernel's socket buffers.
//!
//! The lower rank creates the segment (a sealed memfd, its memory reserved up front, so a machine short of memory
//! fails here, not later with `SIGBUS`) and offers it over the pair's authenticated TCP connection (`mesh.rs`); the
//! higher rank opens it through `/proc/<pid>/fd/<fd>`, which the kernel allows only to the same user, checks the
//! offer's nonce in its header, and maps it; the lower rank then closes its descriptor. Ranks on different hosts
//! cannot open each other's descriptors, so they keep TCP. Nothing is named in a file system, so nothing is left
//! behind when a rank dies (see `ferl-shm` for the whole security story).
//!
//! Waiting sleeps on a futex in the segment, waking every [`ferl_shm::POLL_INTERVAL`] (20 ms) to check that the peer is alive: the
//! pair's TCP connection stays open for that purpose, so a rank that dies (even by `SIGKILL`) makes its peer fail
//! within that interval; a peer that stops making progress fails the wait after the group timeout.

use anyhow::{bail, Context, Result};
pub(crate) use ferl_shm::Offer;
use ferl_shm::{Consumer, Producer, Segment, Watch};
use std::os::fd::RawFd;
use std::sync::Mutex;
use std::time::Duration;

/// Frames start at multiples of this, so elements in a ring never straddle its end and are aligned for their type.
const FRAME_ALIGN: u64 = 8;
/// Smallest ring: room for two of the engine's unpipelined frames in flight.
pub(crate) const MIN_RING_BYTES: usize = 128 << 10;

/// A shared-memory link to one peer: the ring this rank writes and the ring it reads.
pub(crate) struct ShmLink {
    segment: Segment,
    /// Used by one thread at a time (the engine's sender); the lock is never contended.
    tx: Mutex<Producer>,
    /// Used by one thread at a time (the engine's receiver).
    rx: Mutex<Consumer>,
    /// The pair's TCP connection, watched for the peer's death.
    liveness_fd: RawFd,
    timeout: Duration,
}

/// A segment created by the lower rank, waiting for its peer's answer.
pub(crate) struct Pending {
    segment: Segment,
}

/// Whether `e` says there was no memory left to reserve the segment.
pub(crate) fn out_of_space(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(ferl_shm::out_of_space)
    })
}

impl Pending {
    /// Creates and maps a segment with two rings of `ring_bytes` (a power of two) each.
    pub(super) fn create(ring_bytes: usize) -> Result<Self> {
        if !ring_bytes.is_power_of_two() || ring_bytes < MIN_RING_BYTES {
            bail!("shared-memory ring of {ring_bytes} bytes: must be a power of two of at least {MIN_RING_BYTES}");
        }
        let segment = Segment::create(2, ring_bytes, true).with_context(|| {
            format!("creating a shared-memory segment of 2 × {ring_bytes} bytes")
        })?;
        Ok(Self { segment })
    }

    /// Creates a segment with rings of `ring_bytes` (rounded up to a power of two of at least [`MIN_RING_BYTES`]),
    /// halving the rings while there is no room for them.
    pub(super) fn create_fitting(ring_bytes: usize) -> Result<Self> {
        let mut size = ring_bytes.next_power_of_two().max(MIN_RING_BYTES);
        loop {
            match Self::create(size) {
                Err(e) if size > MIN_RING_BYTES && out_of_space(&e) => size /= 2,
                made => return made,
            }
        }
    }

    /// What to send to the peer.
    pub(super) fn offer(&self) -> Offer {
        self.segment
            .offer()
            .expect("a pending segment keeps its descriptor")
    }

    /// The link of the creating (lower) rank, once the peer has mapped the segment too (the descriptor is closed).
    pub(super) fn into_link(mut self, liveness_fd: RawFd, timeout: Duration) -> ShmLink {
        self.segment.close_fd();
        ShmLink::new(self.segment, true, liveness_fd, timeout)
    }
}

/// Maps the segment the lower rank offered; fails (and the pair keeps TCP) when this rank cannot open it or it is not
/// the segment the offer describes.
pub(crate) fn accept(offer: &Offer, liveness_fd: RawFd, timeout: Duration) -> Result<ShmLink> {
    if offer.rings != 2 {
        bail!("a shared-memory offer of {} rings, expected 2", offer.rings);
    }
    let segment = Segment::accept(offer).context("mapping the offered shared-memory segment")?;
    Ok(ShmLink::new(segment, false, liveness_fd, timeout))
}

/// Whether the TCP connection at `fd` was closed or failed (the peer process exited or was killed).
fn connection_closed(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    // Nothing travels on the TCP connection while the link is in use, so any readiness means it closed.
    n > 0 && pfd.revents != 0
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ShmLink {
    fn new(segment: Segment, creator: bool, liveness_fd: RawFd, timeout: Duration) -> Self {
        // Ring 0 carries lower -> higher, ring 1 higher -> lower.
        let (tx, rx) = if creator { (0, 1) } else { (1, 0) };
        Self {
            tx: Mutex::new(segment.producer(tx)),
            rx: Mutex::new(segment.consumer(rx)),
            segment,
            liveness_fd,
            timeout,
        }
    }

    /// Calls `f` with the watch of this link's waits: the pair's connection, and the group timeout.
    fn watched<T>(&self, f: impl FnOnce(&Watch<'_>) -> T) -> T {
        let fd = self.liveness_fd;
        let gone = move || connection_closed(fd);
        f(&Watch {
            peer_gone: &gone,
            timeout: self.timeout,
        })
    }

    /// Marks the link closed and wakes every waiter on both sides.
    pub(super) fn close(&self) {
        self.segment.close();
    }

    /// Copies `bytes` into the outgoing ring, waiting for room as needed.
    pub(super) fn send(&self, bytes: &[u8]) -> std::io::Result<()> {
        self.watched(|w| lock(&self.tx).send(bytes, w))
    }

    /// Ends an outgoing frame: pads it so the next one starts aligned (waiting for room for the padding).
    pub(super) fn end_send_frame(&self) -> std::io::Result<()> {
        self.watched(|w| lock(&self.tx).pad_to(FRAME_ALIGN, w))
    }

    /// Ends an incoming frame: skips the sender's padding once it is published.
    pub(super) fn end_recv_frame(&self) -> std::io::Result<()> {
        self.watched(|w| lock(&self.rx).skip_to(FRAME_ALIGN, w))
    }

    /// Receives `len` bytes, handing them to `consume(offset, bytes)` in place, in pieces whose lengths are multiples
    /// of `unit` (the element size; frames are aligned so elements never straddle the ring's end).
    pub(super) fn recv_pieces(
        &self,
        len: usize,
        unit: usize,
        consume: impl FnMut(usize, &[u8]),
    ) -> std::io::Result<()> {
        self.watched(|w| lock(&self.rx).recv_pieces(len, unit, w, consume))
    }

    /// Receives exactly `buf.len()` bytes into `buf`.
    pub(super) fn recv_exact(&self, buf: &mut [u8]) -> std::io::Result<()> {
        self.watched(|w| lock(&self.rx).recv_exact(buf, w))
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
#[path = "shm_tests.rs"]
mod tests;
