//! Shared-memory links between two ranks on the same host: one mapped segment per pair holding two single-producer
//! single-consumer byte rings (one per direction). Sending copies into the ring; receiving hands the ring's bytes to
//! the caller in place (a reduction reads them straight from the ring), so a byte crosses memory once on each side
//! instead of passing through the kernel's socket buffers.
//!
//! The lower rank creates the segment as a file under `/dev/shm` (space reserved up front, so a full `/dev/shm`
//! fails here, not later with `SIGBUS`), offers its name and a random nonce over the pair's TCP connection; the higher
//! rank maps it and checks the nonce; the file is unlinked as soon as both have mapped it (or given up). Ranks on
//! different hosts cannot open each other's files, so they keep TCP. Offers travel only over authenticated
//! connections, and the accepting rank opens only regular files of its own user, never through a link; files left by
//! dead creators are swept when a group forms (`shm_sweep.rs`).
//!
//! Waiting sleeps on a futex in the segment, waking every [`POLL_INTERVAL`] to check that the peer is alive: the
//! pair's TCP connection stays open for that purpose, so a rank that dies (even by `SIGKILL`) makes its peer fail
//! within that interval; a peer that stops making progress fails the wait after the group timeout.

use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{Error, ErrorKind};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where segments are created.
pub(super) const SHM_DIR: &str = "/dev/shm";
/// Start of every segment's file name (the rest: see [`super::shm_sweep::segment_file_name`]).
pub(super) const FILE_PREFIX: &str = "ferl-collective-";
const SEGMENT_MAGIC: u64 = 0x4645_524c_5348_4d31; // "FERLSHM1"
/// Bytes before the first ring's data: the segment header page, then the two rings' control blocks.
const DATA_OFFSET: usize = 8192;
const CONTROL_OFFSET: usize = 4096;
const CONTROL_STRIDE: usize = 1024;
/// How often a sleeping wait wakes to check that the peer is still alive.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Busy-wait rounds before a wait yields the CPU, then sleeps.
const SPIN_ROUNDS: u32 = 128;
const YIELD_ROUNDS: u32 = 16;
/// Largest piece a sender publishes at once, so the receiver starts on a chunk before all of it is copied.
const PUBLISH_BYTES: usize = 64 << 10;
/// Frames start at multiples of this, so elements in a ring never straddle its end and are aligned for their type.
const FRAME_ALIGN: u64 = 8;
/// Smallest ring: room for two of the engine's unpipelined frames in flight.
pub(crate) const MIN_RING_BYTES: usize = 128 << 10;

/// A value alone on its cache line (the two sides write different lines).
#[repr(C, align(64))]
struct Line<T>(T);

/// A futex word the other side bumps when it makes progress, and whether this side sleeps on it.
#[repr(C)]
struct Signal {
    seq: AtomicU32,
    sleeping: AtomicU32,
}

/// Control block of one ring, in the segment.
#[repr(C)]
struct RingControl {
    /// Bytes the writer has published (monotonic).
    head: Line<AtomicU64>,
    /// Bytes the reader has consumed (monotonic).
    tail: Line<AtomicU64>,
    /// Bumped by the writer after publishing; the reader sleeps on it.
    data: Line<Signal>,
    /// Bumped by the reader after consuming; the writer sleeps on it.
    space: Line<Signal>,
}

/// The segment's first page.
#[repr(C)]
struct SegmentHeader {
    magic: u64,
    nonce: [u64; 2],
    ring_bytes: u64,
    /// Non-zero once either side closed the link (an error, or the communicator dropped).
    closed: Line<AtomicU32>,
}

const _: () = assert!(std::mem::size_of::<SegmentHeader>() <= CONTROL_OFFSET);
const _: () = assert!(std::mem::size_of::<RingControl>() <= CONTROL_STRIDE);

/// A mapped segment; unmapped on drop.
struct Mapping {
    base: *mut u8,
    len: usize,
}

impl Mapping {
    fn of(file: &File, len: usize) -> Result<Self> {
        // SAFETY: mapping a file we hold open, shared, at a kernel-chosen address; checked for failure.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::last_os_error()).context("mapping the shared-memory segment");
        }
        Ok(Self {
            base: base as *mut u8,
            len,
        })
    }

    fn header(&self) -> &SegmentHeader {
        // SAFETY: the mapping starts with a zero-initialised or creator-written header, page aligned.
        unsafe { &*(self.base as *const SegmentHeader) }
    }

    fn header_mut(&mut self) -> &mut SegmentHeader {
        // SAFETY: as above; only the creator writes it, before offering the segment.
        unsafe { &mut *(self.base as *mut SegmentHeader) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `of` mapped; nothing refers to it any more.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

fn segment_len(ring_bytes: usize) -> usize {
    DATA_OFFSET + 2 * ring_bytes
}

/// One direction of a link.
struct Ring {
    control: *const RingControl,
    data: *mut u8,
    capacity: usize,
}

impl Ring {
    fn control(&self) -> &RingControl {
        // SAFETY: points into the mapping the link owns, which outlives every use.
        unsafe { &*self.control }
    }
}

/// A shared-memory link to one peer: the ring this rank writes and the ring it reads.
pub(crate) struct ShmLink {
    mapping: Mapping,
    tx: Ring,
    rx: Ring,
    /// The pair's TCP connection, watched for the peer's death.
    liveness_fd: RawFd,
    timeout: Duration,
}

// SAFETY: the rings are single-producer single-consumer: the engine uses `tx` from one thread and `rx` from one
// thread at a time, and every shared field is an atomic; ring bytes are only touched in the ranges the head/tail
// protocol hands to the caller.
unsafe impl Send for ShmLink {}
unsafe impl Sync for ShmLink {}

/// The offer the lower rank sends over TCP: the segment's path and nonce.
pub(crate) struct Offer {
    /// File under `/dev/shm`.
    pub path: PathBuf,
    /// Random value written into the segment, so the peer knows it opened the right one.
    pub nonce: [u64; 2],
}

/// A segment created by the lower rank, waiting for its peer's answer.
pub(crate) struct Pending {
    mapping: Mapping,
    file: SegmentFile,
    nonce: [u64; 2],
}

/// The segment's file, unlinked on drop (the mappings stay valid).
struct SegmentFile(PathBuf);

impl Drop for SegmentFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Whether `e` says the file system is full.
pub(crate) fn out_of_space(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<Error>()
            .and_then(Error::raw_os_error)
            .is_some_and(|code| code == libc::ENOSPC)
    })
}

fn random_nonce() -> Result<[u64; 2]> {
    let bytes = crate::auth::random_bytes::<16>().context("the segment nonce")?;
    Ok([
        u64::from_le_bytes(bytes[..8].try_into()?),
        u64::from_le_bytes(bytes[8..].try_into()?),
    ])
}

impl Pending {
    /// Creates and maps a segment with two rings of `ring_bytes` (a power of two) each.
    pub fn create(ring_bytes: usize) -> Result<Self> {
        if !ring_bytes.is_power_of_two() || ring_bytes < MIN_RING_BYTES {
            bail!("shared-memory ring of {ring_bytes} bytes: must be a power of two of at least {MIN_RING_BYTES}");
        }
        let nonce = random_nonce()?;
        let path = Path::new(SHM_DIR).join(super::shm_sweep::segment_file_name(nonce[0]));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let len = segment_len(ring_bytes);
        let made = (|| {
            // SAFETY: reserving blocks of a file we own; returns an errno value.
            let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
            if rc != 0 {
                return Err(Error::from_raw_os_error(rc))
                    .with_context(|| format!("reserving {len} bytes in {}", path.display()));
            }
            let mut mapping = Mapping::of(&file, len)?;
            let header = mapping.header_mut();
            header.magic = SEGMENT_MAGIC;
            header.nonce = nonce;
            header.ring_bytes = ring_bytes as u64;
            Ok(mapping)
        })();
        match made {
            Ok(mapping) => Ok(Self {
                mapping,
                file: SegmentFile(path),
                nonce,
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Creates a segment with rings of `ring_bytes` (rounded up to a power of two of at least [`MIN_RING_BYTES`]),
    /// halving the rings while `/dev/shm` has no room for them (containers often get a small one).
    pub fn create_fitting(ring_bytes: usize) -> Result<Self> {
        let mut size = ring_bytes.next_power_of_two().max(MIN_RING_BYTES);
        loop {
            match Self::create(size) {
                Err(e) if size > MIN_RING_BYTES && out_of_space(&e) => size /= 2,
                made => return made,
            }
        }
    }

    /// What to send to the peer.
    pub fn offer(&self) -> Offer {
        Offer {
            path: self.file.0.clone(),
            nonce: self.nonce,
        }
    }

    /// The link of the creating (lower) rank, once the peer has mapped the segment too (the file is removed).
    pub fn into_link(self, liveness_fd: RawFd, timeout: Duration) -> ShmLink {
        drop(self.file);
        ShmLink::new(self.mapping, true, liveness_fd, timeout)
    }
}

/// Maps the segment the lower rank offered; fails (and the pair keeps TCP) when this rank cannot open it or it is not
/// the segment the offer describes.
pub(crate) fn accept(offer: &Offer, liveness_fd: RawFd, timeout: Duration) -> Result<ShmLink> {
    let ours = offer.path.parent() == Some(Path::new(SHM_DIR))
        && offer
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(FILE_PREFIX));
    if !ours {
        bail!(
            "{} is not a segment name this crate creates",
            offer.path.display()
        );
    }
    // Never through a link, and only a regular file of this user: a segment planted by someone else is refused.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&offer.path)
        .with_context(|| format!("opening {}", offer.path.display()))?;
    let meta = file.metadata()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.file_type().is_file() || std::os::unix::fs::MetadataExt::uid(&meta) != me {
        bail!(
            "{} is not a regular file of this user (uid {me}); refused",
            offer.path.display()
        );
    }
    let size = meta.len() as usize;
    if size < DATA_OFFSET {
        bail!("{} is too small to be a segment", offer.path.display());
    }
    let probe = Mapping::of(&file, DATA_OFFSET)?;
    let header = probe.header();
    let ring_bytes = header.ring_bytes as usize;
    if header.magic != SEGMENT_MAGIC || header.nonce != offer.nonce {
        bail!("{} is not the segment offered", offer.path.display());
    }
    if !ring_bytes.is_power_of_two() || size != segment_len(ring_bytes) {
        bail!(
            "{}: ring size {ring_bytes} does not match the file",
            offer.path.display()
        );
    }
    drop(probe);
    Ok(ShmLink::new(
        Mapping::of(&file, size)?,
        false,
        liveness_fd,
        timeout,
    ))
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

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a shared (not process-private) futex wait on a word of the mapping, with a relative timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: waking every waiter of a word of the mapping (in any process that maps it).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Tells a side that may be asleep on `signal` that something changed.
fn notify(signal: &Signal) {
    signal.seq.fetch_add(1, Ordering::SeqCst);
    if signal.sleeping.load(Ordering::SeqCst) != 0 {
        futex_wake(&signal.seq);
    }
}

impl ShmLink {
    fn new(mapping: Mapping, creator: bool, liveness_fd: RawFd, timeout: Duration) -> Self {
        let capacity = mapping.header().ring_bytes as usize;
        let ring = |i: usize| Ring {
            control: mapping
                .base
                .wrapping_add(CONTROL_OFFSET + i * CONTROL_STRIDE)
                as *const RingControl,
            data: mapping.base.wrapping_add(DATA_OFFSET + i * capacity),
            capacity,
        };
        // Ring 0 carries lower -> higher, ring 1 higher -> lower.
        let (tx, rx) = if creator {
            (ring(0), ring(1))
        } else {
            (ring(1), ring(0))
        };
        Self {
            tx,
            rx,
            mapping,
            liveness_fd,
            timeout,
        }
    }

    fn closed(&self) -> bool {
        self.mapping.header().closed.0.load(Ordering::SeqCst) != 0
    }

    /// Marks the link closed and wakes every waiter on both sides.
    pub fn close(&self) {
        self.mapping.header().closed.0.store(1, Ordering::SeqCst);
        for ring in [&self.tx, &self.rx] {
            let c = ring.control();
            for s in [&c.data.0, &c.space.0] {
                s.seq.fetch_add(1, Ordering::SeqCst);
                futex_wake(&s.seq);
            }
        }
    }

    /// Waits until `ready` returns a non-zero amount, sleeping on `signal` (which the other side bumps on progress).
    /// Fails when the link is closed, the peer's connection closes, or nothing changes for the group timeout.
    fn wait(&self, signal: &Signal, ready: impl Fn() -> usize) -> std::io::Result<usize> {
        for round in 0..SPIN_ROUNDS + YIELD_ROUNDS {
            let n = ready();
            if n > 0 {
                return Ok(n);
            }
            if round < SPIN_ROUNDS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let mut last_change = Instant::now();
        let mut seen = signal.seq.load(Ordering::SeqCst);
        loop {
            signal.sleeping.store(1, Ordering::SeqCst);
            let n = ready();
            if n > 0 {
                signal.sleeping.store(0, Ordering::SeqCst);
                return Ok(n);
            }
            if self.closed() {
                signal.sleeping.store(0, Ordering::SeqCst);
                return Err(Error::new(
                    ErrorKind::UnexpectedEof,
                    "the shared-memory link was closed",
                ));
            }
            futex_wait(&signal.seq, seen, POLL_INTERVAL);
            signal.sleeping.store(0, Ordering::SeqCst);
            let now = signal.seq.load(Ordering::SeqCst);
            if now != seen {
                seen = now;
                last_change = Instant::now();
            } else if ready() == 0 {
                if connection_closed(self.liveness_fd) {
                    return Err(Error::new(
                        ErrorKind::UnexpectedEof,
                        "the peer's connection closed",
                    ));
                }
                if last_change.elapsed() >= self.timeout {
                    return Err(Error::new(ErrorKind::TimedOut, "no progress"));
                }
            }
        }
    }

    /// Copies `bytes` into the outgoing ring, waiting for room as needed.
    pub fn send(&self, mut bytes: &[u8]) -> std::io::Result<()> {
        let ring = &self.tx;
        let c = ring.control();
        let cap = ring.capacity as u64;
        while !bytes.is_empty() {
            let head = c.head.0.load(Ordering::Relaxed);
            let free = self.wait(&c.space.0, || {
                (cap - (head - c.tail.0.load(Ordering::Acquire))) as usize
            })?;
            let n = free.min(bytes.len()).min(PUBLISH_BYTES);
            let at = (head % cap) as usize;
            let first = n.min(ring.capacity - at);
            // SAFETY: [head, head + n) is free ring space (the reader is past it) and lies in the data area.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), ring.data.add(at), first);
                std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), ring.data, n - first);
            }
            c.head.0.store(head + n as u64, Ordering::Release);
            notify(&c.data.0);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Ends an outgoing frame: pads it so the next one starts aligned (waiting for room for the padding).
    pub fn end_send_frame(&self) -> std::io::Result<()> {
        let c = self.tx.control();
        let cap = self.tx.capacity as u64;
        let head = c.head.0.load(Ordering::Relaxed);
        let pad = head.next_multiple_of(FRAME_ALIGN) - head;
        if pad > 0 {
            self.wait(&c.space.0, || {
                let free = cap - (head - c.tail.0.load(Ordering::Acquire));
                usize::from(free >= pad)
            })?;
            c.head.0.store(head + pad, Ordering::Release);
            notify(&c.data.0);
        }
        Ok(())
    }

    /// Ends an incoming frame: skips the sender's padding once it is published.
    pub fn end_recv_frame(&self) -> std::io::Result<()> {
        let c = self.rx.control();
        let tail = c.tail.0.load(Ordering::Relaxed);
        let next = tail.next_multiple_of(FRAME_ALIGN);
        if next > tail {
            self.wait(&c.data.0, || {
                usize::from(c.head.0.load(Ordering::Acquire) >= next)
            })?;
            c.tail.0.store(next, Ordering::Release);
            notify(&c.space.0);
        }
        Ok(())
    }

    /// Receives `len` bytes, handing them to `consume(offset, bytes)` in place, in pieces whose lengths are multiples
    /// of `unit` (the element size; frames are aligned so elements never straddle the ring's end).
    pub fn recv_pieces(
        &self,
        len: usize,
        unit: usize,
        mut consume: impl FnMut(usize, &[u8]),
    ) -> std::io::Result<()> {
        let ring = &self.rx;
        let c = ring.control();
        let cap = ring.capacity as u64;
        let mut done = 0;
        while done < len {
            let tail = c.tail.0.load(Ordering::Relaxed);
            let at = (tail % cap) as usize;
            let want = (len - done).min(ring.capacity - at);
            let n = self.wait(&c.data.0, || {
                let avail = (c.head.0.load(Ordering::Acquire) - tail) as usize;
                let n = avail.min(want);
                if n == want {
                    n
                } else {
                    n - n % unit
                }
            })?;
            // SAFETY: [tail, tail + n) was published by the writer and lies before the ring's end.
            consume(done, unsafe {
                std::slice::from_raw_parts(ring.data.add(at), n)
            });
            c.tail.0.store(tail + n as u64, Ordering::Release);
            notify(&c.space.0);
            done += n;
        }
        Ok(())
    }

    /// Receives exactly `buf.len()` bytes into `buf`.
    pub fn recv_exact(&self, buf: &mut [u8]) -> std::io::Result<()> {
        let len = buf.len();
        self.recv_pieces(len, 1, |off, piece| {
            buf[off..off + piece.len()].copy_from_slice(piece)
        })
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
