//! Large payloads, on two paths:
//!
//! - **QUIC bulk streams**: a payload over [`crate::transport::BULK_THRESHOLD`] travels on its own unidirectional
//!   stream (`[u64 id][u64 len][bytes]`) so it does not hold up small frames; the frame names the stream's id.
//!   What a peer may send on such streams before a frame names them is bounded and reclaimed ([`inbox`]).
//! - **Same-host shared-memory ring** (guarantee 13 in `runtime/README.md`): the first time a stream writer has a
//!   payload of at least [`SHM_MIN`] bytes it creates a ring, a sealed memfd only its user can open, and offers it
//!   on the (authenticated, encrypted) QUIC stream. A receiver on the same host opens it as `/proc/<pid>/fd/<fd>`,
//!   checks the 32 random bytes of the offer in its header, maps it and accepts; from then on payloads are copied
//!   into the ring and the QUIC frame carries only their offset and length. The receiver copies each payload out
//!   (then validates it like any other) and counts it consumed in the ring's header, which frees the space for the
//!   writer. A peer on another host cannot open the memfd (or finds other bytes there) and refuses: payloads stay on
//!   QUIC. Nothing is named in a file system: the kernel frees the ring when both processes have let go of it,
//!   whatever way they end.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use rkyv::util::AlignedVec;

use crate::protocol::Frame;

pub mod inbox;

pub use inbox::unclaimed_bytes;
pub(crate) use inbox::{send_bulk, spawn_bulk_reader, BulkInbox};

/// Payloads at least this large go through the shared-memory ring once the peer has mapped it.
pub const SHM_MIN: usize = ferl_wire::codec::pool::LARGE;
/// Default size of a ring's data area; `FERL_SHM_BYTES` overrides it (0 turns the same-host path off). Pages are
/// only backed once written, and a ring drained of payloads starts again at its beginning, so what a ring holds in
/// memory is the most bytes it ever had in flight at once.
pub const DEFAULT_SHM_BYTES: u64 = 256 << 20;
/// Largest ring a receiver maps.
const MAX_SHM_BYTES: u64 = 1 << 40;
/// Largest bulk payload accepted on a QUIC bulk stream (4 GiB).
pub const MAX_BULK: u64 = 4 << 30;
/// Header page of a ring: magic, nonce, and the receiver's count of consumed payloads.
const HEADER: usize = 4096;
const MAGIC: [u8; 8] = *b"FERLSHM1";
const NONCE_AT: usize = 8;
const NONCE_LEN: usize = 32;
const CONSUMED_AT: usize = 64;

static SHM_BYTES_RECEIVED: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has received through shared-memory rings (the same-host path), for tests and benchmarks.
pub fn shm_bytes_received() -> u64 {
    SHM_BYTES_RECEIVED.load(Ordering::Relaxed)
}

/// The ring size this process offers (`FERL_SHM_BYTES`, default [`DEFAULT_SHM_BYTES`]); 0 means no ring.
pub(crate) fn ring_capacity() -> u64 {
    std::env::var("FERL_SHM_BYTES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_SHM_BYTES)
        .min(MAX_SHM_BYTES)
}

pub(crate) use ferl_wire::codec::pool::{aligned_buffer, buffer, recycle};

/// A shared mapping of a whole ring (header and data), unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; the consumed counter is only accessed atomically and payload bytes
// are copied in and out of regions that the ring protocol gives to one side at a time.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize) -> std::io::Result<Self> {
        // SAFETY: a fresh shared mapping of a descriptor we hold, of a size the file has.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(std::io::Error::last_os_error)?;
        Ok(Self { ptr, len })
    }

    fn consumed(&self) -> &AtomicU64 {
        // SAFETY: inside the header page, 8-byte aligned (the mapping is page aligned), shared only as an atomic.
        unsafe { &*(self.ptr.as_ptr().add(CONSUMED_AT) as *const AtomicU64) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the data area starts after the header page, inside the mapping.
        unsafe { self.ptr.as_ptr().add(HEADER) }
    }

    fn header(&self) -> [u8; NONCE_AT + NONCE_LEN] {
        let mut out = [0u8; NONCE_AT + NONCE_LEN];
        // SAFETY: the header page is inside the mapping.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), out.as_mut_ptr(), out.len()) };
        out
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped; no references into it outlive `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The space of a ring: regions are handed out in order and released in the same order (the receiver consumes
/// payloads in stream order). When every region is released the next one starts at offset 0 again.
#[derive(Debug)]
pub(crate) struct RingSpace {
    capacity: u64,
    head: u64,
    live: VecDeque<(u64, u64)>,
    released: u64,
    handed_out: u64,
}

impl RingSpace {
    /// An empty ring of `capacity` bytes.
    pub(crate) fn new(capacity: u64) -> Self {
        Self {
            capacity,
            head: 0,
            live: VecDeque::new(),
            released: 0,
            handed_out: 0,
        }
    }

    /// Frees the oldest regions until `consumed` of all regions ever handed out are released.
    pub(crate) fn release_through(&mut self, consumed: u64) {
        let consumed = consumed.min(self.handed_out);
        while self.released < consumed && self.live.pop_front().is_some() {
            self.released += 1;
        }
        if self.live.is_empty() {
            self.head = 0;
        }
    }

    /// Hands out `len` contiguous bytes and returns their offset, or `None` when they do not fit now.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        if len == 0 || len > self.capacity {
            return None;
        }
        let start = match (self.live.front(), self.live.back()) {
            (Some(&(tail, _)), Some(&(newest, _))) if newest >= tail => {
                // Live regions lie in [tail, head): free space is [head, capacity) then [0, tail).
                if self.capacity - self.head >= len {
                    self.head
                } else if tail >= len {
                    0
                } else {
                    return None;
                }
            }
            (Some(&(tail, _)), Some(_)) => {
                // Wrapped: live regions lie in [tail, capacity) and [0, head): free space is [head, tail).
                if tail - self.head >= len {
                    self.head
                } else {
                    return None;
                }
            }
            _ => 0,
        };
        self.head = start + len;
        self.live.push_back((start, start + len));
        self.handed_out += 1;
        Some(start)
    }
}

/// The writer's side of a ring: a sealed memfd mapped read-write.
pub(crate) struct SendRing {
    map: Mapping,
    fd: OwnedFd,
    nonce: [u8; NONCE_LEN],
    space: RingSpace,
}

impl SendRing {
    /// Creates a ring with `capacity` bytes of data area.
    pub(crate) fn create(capacity: u64) -> std::io::Result<Self> {
        let len = HEADER + usize::try_from(capacity).map_err(std::io::Error::other)?;
        // SAFETY: a C string literal and valid flags.
        let raw = unsafe {
            libc::memfd_create(
                c"ferl-bulk-ring".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned to us and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain calls on a descriptor we own.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The receiver checks these seals: the ring can never shrink under its mapping (no SIGBUS).
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        let map = Mapping::new(&fd, len)?;
        let nonce: [u8; NONCE_LEN] = rand::random();
        // SAFETY: the header page is inside the mapping and nobody else has it yet.
        unsafe {
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), map.ptr.as_ptr(), MAGIC.len());
            std::ptr::copy_nonoverlapping(
                nonce.as_ptr(),
                map.ptr.as_ptr().add(NONCE_AT),
                NONCE_LEN,
            );
        }
        Ok(Self {
            map,
            fd,
            nonce,
            space: RingSpace::new(capacity),
        })
    }

    /// The frame that offers this ring to the peer.
    pub(crate) fn offer(&self) -> Frame {
        Frame::ShmOffer {
            pid: std::process::id(),
            fd: self.fd.as_raw_fd(),
            capacity: self.space.capacity,
            nonce: self.nonce.to_vec(),
        }
    }

    /// Copies `bytes` into the ring and returns their offset, or `None` when the ring has no room for them now.
    pub(crate) fn put(&mut self, bytes: &[u8]) -> Option<u64> {
        let consumed = self.map.consumed().load(Ordering::Acquire);
        self.space.release_through(consumed);
        let offset = self.space.alloc(bytes.len() as u64)?;
        // SAFETY: `alloc` returned a region inside the data area that the receiver no longer reads.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.data().add(offset as usize),
                bytes.len(),
            )
        };
        Some(offset)
    }
}

/// The reader's side of a peer's ring, mapped after checking its offer.
pub(crate) struct RecvRing {
    map: Mapping,
    capacity: u64,
    taken: u64,
}

impl RecvRing {
    /// Opens and maps the ring a peer offered; the error says why it cannot be used (then payloads stay on QUIC).
    pub(crate) fn open(pid: u32, fd: i32, capacity: u64, nonce: &[u8]) -> Result<Self, String> {
        if nonce.len() != NONCE_LEN {
            return Err(format!(
                "ring offer has a {}-byte nonce, expected {NONCE_LEN}",
                nonce.len()
            ));
        }
        if capacity == 0 || capacity > MAX_SHM_BYTES {
            return Err(format!(
                "ring offer of {capacity} bytes is outside 1..={MAX_SHM_BYTES}"
            ));
        }
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open {path} (another host?): {e}"))?;
        let len = HEADER as u64 + capacity;
        let size = file.metadata().map_err(|e| format!("{path}: {e}"))?.len();
        if size != len {
            return Err(format!("{path} holds {size} bytes, the offer says {len}"));
        }
        let fd = OwnedFd::from(file);
        // SAFETY: a query on a descriptor we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(format!("{path} is not sealed against shrinking"));
        }
        let map = Mapping::new(&fd, len as usize).map_err(|e| format!("mapping {path}: {e}"))?;
        let header = map.header();
        if header[..NONCE_AT] != MAGIC || header[NONCE_AT..] != *nonce {
            return Err(format!("{path} is not the ring that was offered"));
        }
        Ok(Self {
            map,
            capacity,
            taken: 0,
        })
    }

    /// Copies the payload at `offset` out of the ring and frees its space; an out-of-bounds region is an error
    /// (the connection is then closed).
    pub(crate) fn take(&mut self, offset: u64, len: u64) -> Result<AlignedVec, String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity && len > 0 => {}
            _ => {
                return Err(format!(
                    "shared payload at {offset}+{len} lies outside the {}-byte ring",
                    self.capacity
                ))
            }
        }
        let mut out = buffer(len as usize);
        // SAFETY: the region is inside the data area (checked above) and belongs to us until we count it consumed.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(self.map.data().add(offset as usize), len as usize)
        });
        self.taken += 1;
        self.map.consumed().store(self.taken, Ordering::Release);
        SHM_BYTES_RECEIVED.fetch_add(len, Ordering::Relaxed);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarantee_13_ring_space_reuses_released_regions_in_order() {
        let mut ring = RingSpace::new(100);
        assert_eq!(ring.alloc(40), Some(0));
        assert_eq!(ring.alloc(40), Some(40));
        assert_eq!(ring.alloc(40), None, "only 20 bytes are left");
        ring.release_through(1);
        // [0, 40) is free again, [80, 100) too: 30 bytes fit at the start, not at the end.
        assert_eq!(ring.alloc(30), Some(0));
        assert_eq!(ring.alloc(15), None, "wrapped: only [30, 40) is free");
        assert_eq!(ring.alloc(10), Some(30));
        assert_eq!(ring.alloc(1), None, "full");
        ring.release_through(2);
        assert_eq!(ring.alloc(61), None, "[30, 40) is still live");
        assert_eq!(ring.alloc(60), Some(40));
        ring.release_through(5);
        assert_eq!(ring.alloc(100), Some(0), "a drained ring starts over at 0");
        assert_eq!(ring.alloc(0), None);
        assert_eq!(ring.alloc(101), None);
    }

    #[test]
    fn guarantee_13_ring_ignores_a_consumed_count_beyond_what_was_handed_out() {
        let mut ring = RingSpace::new(10);
        assert_eq!(ring.alloc(5), Some(0));
        ring.release_through(1_000);
        assert_eq!(ring.alloc(10), Some(0));
        assert_eq!(ring.alloc(1), None);
    }

    #[test]
    fn guarantee_13_a_ring_round_trips_through_proc_and_rejects_wrong_offers() {
        let mut send = SendRing::create(1 << 20).unwrap();
        let Frame::ShmOffer {
            pid,
            fd,
            capacity,
            nonce,
        } = send.offer()
        else {
            panic!("offer frame");
        };
        let mut recv = RecvRing::open(pid, fd, capacity, &nonce).unwrap();
        let payload: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let at = send.put(&payload).unwrap();
        let before = shm_bytes_received();
        let got = recv.take(at, payload.len() as u64).unwrap();
        assert_eq!(got.as_slice(), payload.as_slice());
        assert_eq!(shm_bytes_received() - before, payload.len() as u64);
        // Consumed: the next payload starts at 0 again.
        assert_eq!(send.put(&payload), Some(0));

        let err = recv.take(capacity - 10, 11).err().unwrap();
        assert!(err.contains("outside"), "{err}");
        let err = recv.take(u64::MAX, 2).err().unwrap();
        assert!(err.contains("outside"), "{err}");

        let mut wrong = nonce.clone();
        wrong[0] ^= 1;
        let err = RecvRing::open(pid, fd, capacity, &wrong).err().unwrap();
        assert!(err.contains("not the ring that was offered"), "{err}");
        let err = RecvRing::open(pid, fd, capacity + 1, &nonce).err().unwrap();
        assert!(err.contains("the offer says"), "{err}");
        let err = RecvRing::open(pid, 1_000_000, capacity, &nonce)
            .err()
            .unwrap();
        assert!(err.contains("cannot open"), "{err}");
    }
}
