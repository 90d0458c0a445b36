//! The single-producer single-consumer byte ring and its wakeups.
//!
//! Invariants (positions are monotonic byte counts; a position's place in the data area is it modulo the capacity):
//! 1. Only the producer advances `head`, only the consumer advances `tail`, and `tail <= head <= from + capacity`
//!    for an honest producer, where `from` is `tail`, or the producer's `restart` while the consumer has not passed
//!    it (the bytes between are the end of the data area a drained ring skipped, invariant 3: they hold nothing).
//! 2. Bytes in `[tail, head)` are published: the producer wrote them before its `Release` store of `head`, and does
//!    not touch them again until the consumer's `Release` store of `tail` passes them.
//! 3. A payload placed by [`Producer::try_put`] never straddles the end of the data area, and a drained ring places
//!    the next payload at the start (the next multiple of the capacity, its `restart`), so the memory a ring touches
//!    is what it had in flight at most. The skipped bytes do not count against that payload, nor the ones after it.
//! 4. A consumer reads only published bytes inside the data area: every position a peer names is checked first.

use std::io::{Error, ErrorKind, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::segment::{closed, Line, Mapping};

/// How often a sleeping wait wakes to ask its [`Watch`] whether the peer is gone.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Busy-wait rounds before a wait yields the CPU, then sleeps.
const SPIN_ROUNDS: u32 = 128;
const YIELD_ROUNDS: u32 = 16;
/// Largest piece [`Producer::send`] publishes at once, so the consumer starts on a chunk before all of it is copied.
const PUBLISH_BYTES: usize = 64 << 10;

/// A futex word the other side bumps when it makes progress, and whether this side sleeps on it.
#[repr(C)]
pub(crate) struct Signal {
    seq: AtomicU32,
    sleeping: AtomicU32,
}

/// Control block of one ring, in the segment.
#[repr(C)]
pub(crate) struct RingControl {
    /// Bytes the producer has published (monotonic).
    head: Line<AtomicU64>,
    /// Bytes the consumer has freed (monotonic).
    tail: Line<AtomicU64>,
    /// Bumped by the producer after publishing; the consumer sleeps on it.
    data: Line<Signal>,
    /// Bumped by the consumer after freeing; the producer sleeps on it.
    space: Line<Signal>,
}

/// What a blocking wait watches besides the ring: whether the peer is gone (asked every [`POLL_INTERVAL`] while
/// asleep), and how long the ring may make no progress before the wait fails with [`ErrorKind::TimedOut`].
#[derive(Clone, Copy)]
pub struct Watch<'a> {
    /// True once the peer is known to be gone (its process died, its connection closed).
    pub peer_gone: &'a dyn Fn() -> bool,
    /// Longest time without progress.
    pub timeout: Duration,
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
    // SAFETY: wakes every waiter of a word of the mapping (in any process that maps it).
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

/// Wakes every waiter on both signals of a ring (the segment is closing).
pub(crate) fn wake_all(control: &RingControl) {
    for s in [&control.data.0, &control.space.0] {
        s.seq.fetch_add(1, Ordering::SeqCst);
        futex_wake(&s.seq);
    }
}

/// Waits until `ready` returns a non-zero amount: spins, yields, then sleeps on `signal` (which the other side bumps
/// on progress). Fails when the segment is closed, the watch says the peer is gone, or nothing changes for its
/// timeout.
fn wait(
    map: &Mapping,
    signal: &Signal,
    watch: &Watch<'_>,
    ready: impl Fn() -> usize,
) -> Result<usize> {
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
        if closed(map) {
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
            if (watch.peer_gone)() {
                return Err(Error::new(
                    ErrorKind::UnexpectedEof,
                    "the peer's connection closed",
                ));
            }
            if last_change.elapsed() >= watch.timeout {
                return Err(Error::new(ErrorKind::TimedOut, "no progress"));
            }
        }
    }
}

/// The writing end of one ring (see [`crate::Segment::producer`]).
pub struct Producer {
    map: Arc<Mapping>,
    control: *const RingControl,
    data: *mut u8,
    capacity: usize,
    /// Where [`Producer::try_put`] last placed a payload into a drained ring: nothing before it is in flight, even
    /// while the consumer's `tail` still lies before it (module invariant 1).
    restart: u64,
}

// SAFETY: the pointers point into `map`, which the producer keeps alive; shared fields are atomics and the bytes it
// writes are free ring space (module invariants 1 and 2). Its methods take `&mut self`, so one thread at a time
// produces.
unsafe impl Send for Producer {}
// SAFETY: `&Producer` only reads atomics (no method with `&self` writes).
unsafe impl Sync for Producer {}

impl Producer {
    pub(crate) fn new(
        map: Arc<Mapping>,
        control: *const RingControl,
        data: *mut u8,
        capacity: usize,
    ) -> Self {
        Self {
            map,
            control,
            data,
            capacity,
            restart: 0,
        }
    }

    fn control(&self) -> &RingControl {
        // SAFETY: points into the mapping `self.map` keeps alive.
        unsafe { &*self.control }
    }

    /// Bytes of the ring's data area.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Where the bytes still in flight start: the consumer's `tail`, or the start of a payload put into the drained
    /// ring that the consumer has not reached yet (module invariant 1).
    fn in_flight_from(&self) -> u64 {
        self.control()
            .tail
            .0
            .load(Ordering::Acquire)
            .max(self.restart)
    }

    /// Bytes published and not yet freed by the consumer.
    pub fn in_flight(&self) -> u64 {
        self.control().head.0.load(Ordering::Relaxed) - self.in_flight_from()
    }

    /// Copies `bytes` into the ring as a stream, waiting for room as needed, in pieces of at most 64 KiB so the
    /// consumer starts on the first before the last is copied.
    pub fn send(&mut self, mut bytes: &[u8], watch: &Watch<'_>) -> Result<()> {
        let c = self.control();
        let cap = self.capacity as u64;
        while !bytes.is_empty() {
            let head = c.head.0.load(Ordering::Relaxed);
            let free = wait(&self.map, &c.space.0, watch, || {
                (cap - (head - c.tail.0.load(Ordering::Acquire))) as usize
            })?;
            let n = free.min(bytes.len()).min(PUBLISH_BYTES);
            let at = (head % cap) as usize;
            let first = n.min(self.capacity - at);
            // SAFETY: [head, head + n) is free ring space (the consumer is past it) and lies in the data area, split
            // at its end.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data.add(at), first);
                std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), self.data, n - first);
            }
            c.head.0.store(head + n as u64, Ordering::Release);
            notify(&c.data.0);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Pads the stream so the next byte starts at a multiple of `align` (a power of two dividing the capacity),
    /// waiting for room for the padding.
    pub fn pad_to(&mut self, align: u64, watch: &Watch<'_>) -> Result<()> {
        let c = self.control();
        let cap = self.capacity as u64;
        let head = c.head.0.load(Ordering::Relaxed);
        let pad = head.next_multiple_of(align) - head;
        if pad > 0 {
            wait(&self.map, &c.space.0, watch, || {
                let free = cap - (head - c.tail.0.load(Ordering::Acquire));
                usize::from(free >= pad)
            })?;
            c.head.0.store(head + pad, Ordering::Release);
            notify(&c.data.0);
        }
        Ok(())
    }

    /// Copies `bytes` into the ring as one contiguous payload without waiting, and returns its position (for
    /// [`Consumer::take`]), or `None` when it does not fit now (or is empty, or larger than the ring). A payload
    /// that would straddle the end of the data area starts at its beginning instead; so does any payload put into a
    /// drained ring, which then fits whenever it is not larger than the ring.
    pub fn try_put(&mut self, bytes: &[u8]) -> Option<u64> {
        let cap = self.capacity as u64;
        let len = bytes.len() as u64;
        if len == 0 || len > cap {
            return None;
        }
        let head = self.control().head.0.load(Ordering::Relaxed);
        let from = self.in_flight_from();
        let drained = head == from;
        let start = if !drained && cap - head % cap >= len {
            head
        } else {
            head.next_multiple_of(cap)
        };
        // Free space ends a capacity past the first byte in flight; in a drained ring nothing is, and the bytes
        // skipped up to `start` hold nothing: the payload fits whole (it was checked against the capacity).
        if !drained && start + len - from > cap {
            return None;
        }
        if drained {
            self.restart = start;
        }
        let c = self.control();
        // SAFETY: [start, start + len) is free ring space (checked against the bytes in flight above, which start at
        // or after `tail`) and does not cross the end of the data area.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.data.add((start % cap) as usize),
                bytes.len(),
            )
        };
        c.head.0.store(start + len, Ordering::Release);
        notify(&c.data.0);
        Some(start)
    }
}

/// The reading end of one ring (see [`crate::Segment::consumer`]).
pub struct Consumer {
    map: Arc<Mapping>,
    control: *const RingControl,
    data: *mut u8,
    capacity: usize,
}

// SAFETY: as for `Producer`: the mapping is kept alive, shared fields are atomics, the bytes read are published
// (module invariant 2), and the methods that consume take `&mut self`.
unsafe impl Send for Consumer {}
// SAFETY: `&Consumer` only reads atomics.
unsafe impl Sync for Consumer {}

impl Consumer {
    pub(crate) fn new(
        map: Arc<Mapping>,
        control: *const RingControl,
        data: *mut u8,
        capacity: usize,
    ) -> Self {
        Self {
            map,
            control,
            data,
            capacity,
        }
    }

    fn control(&self) -> &RingControl {
        // SAFETY: points into the mapping `self.map` keeps alive.
        unsafe { &*self.control }
    }

    /// Bytes of the ring's data area.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Receives `len` bytes of the stream, handing them to `consume(offset, bytes)` in place, in pieces whose
    /// lengths are multiples of `unit` (the element size: the producer pads frames so that elements never straddle
    /// the ring's end).
    pub fn recv_pieces(
        &mut self,
        len: usize,
        unit: usize,
        watch: &Watch<'_>,
        mut consume: impl FnMut(usize, &[u8]),
    ) -> Result<()> {
        let c = self.control();
        let cap = self.capacity as u64;
        let mut done = 0;
        while done < len {
            let tail = c.tail.0.load(Ordering::Relaxed);
            let at = (tail % cap) as usize;
            let want = (len - done).min(self.capacity - at);
            let n = wait(&self.map, &c.data.0, watch, || {
                let avail = (c.head.0.load(Ordering::Acquire) - tail) as usize;
                let n = avail.min(want);
                if n == want {
                    n
                } else {
                    n - n % unit
                }
            })?;
            // SAFETY: [tail, tail + n) was published by the producer and lies before the ring's end.
            consume(done, unsafe {
                std::slice::from_raw_parts(self.data.add(at), n)
            });
            c.tail.0.store(tail + n as u64, Ordering::Release);
            notify(&c.space.0);
            done += n;
        }
        Ok(())
    }

    /// Receives exactly `buf.len()` bytes of the stream into `buf`.
    pub fn recv_exact(&mut self, buf: &mut [u8], watch: &Watch<'_>) -> Result<()> {
        let len = buf.len();
        self.recv_pieces(len, 1, watch, |off, piece| {
            buf[off..off + piece.len()].copy_from_slice(piece)
        })
    }

    /// Skips the producer's padding up to the next multiple of `align` (see [`Producer::pad_to`]) once published.
    pub fn skip_to(&mut self, align: u64, watch: &Watch<'_>) -> Result<()> {
        let c = self.control();
        let tail = c.tail.0.load(Ordering::Relaxed);
        let next = tail.next_multiple_of(align);
        if next > tail {
            wait(&self.map, &c.data.0, watch, || {
                usize::from(c.head.0.load(Ordering::Acquire) >= next)
            })?;
            c.tail.0.store(next, Ordering::Release);
            notify(&c.space.0);
        }
        Ok(())
    }

    /// Hands the payload the producer put at `pos` ([`Producer::try_put`]) to `read`, then frees it and every
    /// byte before it. Payloads must be taken in the order they were put; a region that is not published, was
    /// already freed or crosses the end of the data area is an error and nothing is read.
    pub fn take<T>(&mut self, pos: u64, len: u64, read: impl FnOnce(&[u8]) -> T) -> Result<T> {
        let c = self.control();
        let cap = self.capacity as u64;
        let tail = c.tail.0.load(Ordering::Relaxed);
        let head = c.head.0.load(Ordering::Acquire);
        let end = match pos.checked_add(len) {
            Some(end) if len > 0 && pos >= tail && end <= head && pos % cap + len <= cap => end,
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidData,
                    format!(
                        "a shared payload at {pos}+{len} lies outside the published bytes [{tail}, {head}) of the \
                         {cap}-byte ring"
                    ),
                ))
            }
        };
        // SAFETY: [pos, end) is published (module invariant 2) and inside the data area (checked above).
        let out = read(unsafe {
            std::slice::from_raw_parts(self.data.add((pos % cap) as usize), len as usize)
        });
        c.tail.0.store(end, Ordering::Release);
        notify(&c.space.0);
        Ok(out)
    }
}
