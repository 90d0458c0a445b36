//! The segment: a sealed memfd, its header, and the offer/accept checks.

use std::fs::File;
use std::io::{Error, ErrorKind, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::ring::{wake_all, Consumer, Producer, RingControl};
use crate::{Offer, MAGIC, MAX_RINGS, MAX_SEGMENT_BYTES, MIN_RING_BYTES, NONCE_LEN};

/// Where the rings' control blocks start, and the bytes each takes.
pub(crate) const CONTROL_OFFSET: usize = 4096;
pub(crate) const CONTROL_STRIDE: usize = 1024;
/// Where the first ring's data starts.
pub(crate) const DATA_OFFSET: usize = 8192;

/// Header flag: the segment's memory was reserved and populated by its creator.
const RESERVED: u32 = 1;

/// A value alone on its cache line (the two sides write different lines).
#[repr(C, align(64))]
pub(crate) struct Line<T>(pub(crate) T);

/// The segment's first page.
#[repr(C)]
pub(crate) struct Header {
    magic: [u8; 8],
    nonce: [u8; NONCE_LEN],
    rings: u32,
    /// [`RESERVED`] when the creator reserved the memory (then the peer maps it populated too).
    flags: u32,
    ring_bytes: u64,
    /// Non-zero once either side closed the segment.
    closed: Line<AtomicU32>,
}

const _: () = assert!(std::mem::size_of::<Header>() <= CONTROL_OFFSET);
const _: () = assert!(std::mem::size_of::<RingControl>() <= CONTROL_STRIDE);
const _: () = assert!(CONTROL_OFFSET + MAX_RINGS * CONTROL_STRIDE <= DATA_OFFSET);

/// A shared mapping of a whole segment, unmapped on drop.
pub(crate) struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory that lives until drop; every field both sides write is an atomic, and
// ring bytes are only touched in the ranges the head/tail protocol gives to one side at a time.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn new(fd: &impl AsRawFd, len: usize, populate: bool) -> Result<Self> {
        Self::with_protection(fd, len, libc::PROT_READ | libc::PROT_WRITE, populate)
    }

    /// A shared mapping of the first `len` bytes of `fd` with the protection `prot` (`PROT_*` flags).
    pub(crate) fn with_protection(
        fd: &impl AsRawFd,
        len: usize,
        prot: libc::c_int,
        populate: bool,
    ) -> Result<Self> {
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        // SAFETY: a fresh shared mapping of a descriptor we hold, at a kernel-chosen address; checked for failure.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast()).ok_or_else(Error::last_os_error)?;
        Ok(Self { base, len })
    }

    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the mapping starts with the page-aligned header (zeroed by the kernel, then written by the creator
        // before the offer); its shared field is an atomic.
        unsafe { &*(self.base.as_ptr() as *const Header) }
    }

    pub(crate) fn at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len);
        self.base.as_ptr().wrapping_add(offset)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped; no reference into it outlives the last `Arc` of `self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

fn segment_len(rings: usize, ring_bytes: usize) -> usize {
    DATA_OFFSET + rings * ring_bytes
}

pub(crate) fn invalid(msg: String) -> Error {
    Error::new(ErrorKind::InvalidData, msg)
}

pub(crate) fn random_nonce() -> Result<[u8; NONCE_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    let mut filled = 0;
    while filled < NONCE_LEN {
        // SAFETY: writes at most the remaining bytes of `nonce`.
        let n =
            unsafe { libc::getrandom(nonce[filled..].as_mut_ptr().cast(), NONCE_LEN - filled, 0) };
        if n < 0 {
            let e = Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(nonce)
}

/// A new memfd named `name` (for `/proc/<pid>/fd` listings) of `len` bytes, close-on-exec, that accepts seals.
pub(crate) fn sealable_memfd(name: &std::ffi::CStr, len: usize, reserve: bool) -> Result<OwnedFd> {
    // SAFETY: a NUL-terminated name and valid flags.
    let raw =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(Error::last_os_error());
    }
    // SAFETY: a descriptor just returned to us and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: a plain call on a descriptor we own; its result is checked.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(Error::last_os_error());
    }
    if reserve {
        // SAFETY: a plain call on a descriptor we own; its result is checked.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, len as libc::off_t) };
        if rc != 0 {
            return Err(Error::from_raw_os_error(rc));
        }
    }
    Ok(fd)
}

/// Opens the memfd a peer offered as `/proc/<pid>/fd/<fd>` (for writing too with `write`), and checks that it is a
/// regular file of this user, of `len` bytes, carrying at least the seals `seals`. Returns it and its path.
pub(crate) fn open_offered(
    pid: u32,
    fd: i32,
    write: bool,
    len: u64,
    seals: libc::c_int,
) -> Result<(File, String)> {
    let path = format!("/proc/{pid}/fd/{fd}");
    // Non-blocking and never a controlling terminal: a stale number may name a FIFO or a device now.
    let file = File::options()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(&path)
        .map_err(|e| {
            Error::new(
                e.kind(),
                format!("cannot open {path} (another host or user?): {e}"),
            )
        })?;
    let meta = file
        .metadata()
        .map_err(|e| Error::new(e.kind(), format!("{path}: {e}")))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.file_type().is_file() || meta.uid() != me {
        return Err(invalid(format!(
            "{path} is not a regular file of this user (uid {me})"
        )));
    }
    if meta.len() != len {
        return Err(invalid(format!(
            "{path} holds {} bytes, the offer says {len}",
            meta.len()
        )));
    }
    // SAFETY: a query on a descriptor we own.
    let found = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if found < 0 || found & seals != seals {
        return Err(invalid(format!("{path} is not sealed as offered")));
    }
    Ok((file, path))
}

/// A mapped segment of rings (see the crate's documentation). Cloning the rings' handles keeps the mapping alive.
pub struct Segment {
    map: Arc<Mapping>,
    /// The creator's descriptor, until the peer has answered.
    fd: Option<OwnedFd>,
    rings: usize,
    ring_bytes: usize,
}

impl Segment {
    /// Creates a segment of `rings` rings of `ring_bytes` (a power of two of at least [`MIN_RING_BYTES`]) each. With
    /// `reserve`, its memory is allocated and mapped up front (a machine short of memory fails here, with `ENOSPC`,
    /// not later); without, pages are backed only once written.
    pub fn create(rings: usize, ring_bytes: usize, reserve: bool) -> Result<Self> {
        if !(1..=MAX_RINGS).contains(&rings)
            || !ring_bytes.is_power_of_two()
            || ring_bytes < MIN_RING_BYTES
        {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "a segment of {rings} rings of {ring_bytes} bytes: expected 1..={MAX_RINGS} rings of a power of \
                     two of at least {MIN_RING_BYTES} bytes"
                ),
            ));
        }
        let len = rings
            .checked_mul(ring_bytes)
            .and_then(|n| n.checked_add(DATA_OFFSET))
            .filter(|&n| n as u64 <= MAX_SEGMENT_BYTES)
            .ok_or_else(|| Error::new(ErrorKind::InvalidInput, "segment too large"))?;
        let fd = sealable_memfd(c"ferl-shm", len, reserve)?;
        // The peer checks these seals: the segment can never shrink under its mapping.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: a plain call on a descriptor we own; its result is checked.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(Error::last_os_error());
        }
        let map = Mapping::new(&fd, len, reserve)?;
        let nonce = random_nonce()?;
        let header = map.base.as_ptr() as *mut Header;
        // SAFETY: the header page is inside the mapping and nobody else has it yet; the plain fields are written
        // before the offer leaves this process and never after.
        unsafe {
            (*header).magic = MAGIC;
            (*header).nonce = nonce;
            (*header).rings = rings as u32;
            (*header).flags = if reserve { RESERVED } else { 0 };
            (*header).ring_bytes = ring_bytes as u64;
        }
        Ok(Self {
            map: Arc::new(map),
            fd: Some(fd),
            rings,
            ring_bytes,
        })
    }

    /// What to send to the peer, or `None` once [`Segment::close_fd`] was called (and on the accepting side).
    pub fn offer(&self) -> Option<Offer> {
        let header = self.map.header();
        self.fd.as_ref().map(|fd| Offer {
            pid: std::process::id(),
            fd: fd.as_raw_fd(),
            rings: self.rings as u32,
            ring_bytes: self.ring_bytes as u64,
            nonce: header.nonce,
        })
    }

    /// Closes the creator's descriptor (the mapping stays): call it once the peer has answered the offer, so the
    /// segment cannot be opened again.
    pub fn close_fd(&mut self) {
        self.fd = None;
    }

    /// Opens and maps the segment a peer offered. The error says why it cannot be used: another host, another
    /// user, a file that is not a sealed segment of the offered size, or a header without the magic, the offered
    /// geometry and the offered nonce.
    pub fn accept(offer: &Offer) -> Result<Self> {
        let rings = offer.rings as usize;
        let ring_bytes = usize::try_from(offer.ring_bytes).unwrap_or(0);
        if !(1..=MAX_RINGS).contains(&rings)
            || !ring_bytes.is_power_of_two()
            || ring_bytes < MIN_RING_BYTES
            || offer.ring_bytes.saturating_mul(offer.rings as u64) > MAX_SEGMENT_BYTES
        {
            return Err(invalid(format!(
                "an offer of {} rings of {} bytes is outside 1..={MAX_RINGS} rings of a power of two of \
                 {MIN_RING_BYTES}..={MAX_SEGMENT_BYTES} bytes",
                offer.rings, offer.ring_bytes
            )));
        }
        let len = segment_len(rings, ring_bytes);
        let sealed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        let (file, path) = open_offered(offer.pid, offer.fd, true, len as u64, sealed)?;
        let probe = Mapping::new(&file, DATA_OFFSET, false)
            .map_err(|e| Error::new(e.kind(), format!("mapping {path}: {e}")))?;
        let header = probe.header();
        if header.magic != MAGIC || header.nonce != offer.nonce {
            return Err(invalid(format!("{path} is not the segment offered")));
        }
        if header.rings != offer.rings || header.ring_bytes != offer.ring_bytes {
            return Err(invalid(format!(
                "{path}: its header says {} rings of {} bytes, the offer {} of {}",
                header.rings, header.ring_bytes, offer.rings, offer.ring_bytes
            )));
        }
        let populate = header.flags & RESERVED != 0;
        drop(probe);
        let map = Mapping::new(&file, len, populate)
            .map_err(|e| Error::new(e.kind(), format!("mapping {path}: {e}")))?;
        Ok(Self {
            map: Arc::new(map),
            fd: None,
            rings,
            ring_bytes,
        })
    }

    /// Rings in the segment.
    pub fn rings(&self) -> usize {
        self.rings
    }

    /// Bytes of each ring.
    pub fn ring_bytes(&self) -> usize {
        self.ring_bytes
    }

    fn control(&self, ring: usize) -> *const RingControl {
        assert!(
            ring < self.rings,
            "ring {ring} of a {}-ring segment",
            self.rings
        );
        self.map.at(CONTROL_OFFSET + ring * CONTROL_STRIDE) as *const RingControl
    }

    /// The writing end of ring `ring`. The two processes agree which side writes which ring; each ring must have one
    /// producer (and one consumer) at a time.
    pub fn producer(&self, ring: usize) -> Producer {
        let control = self.control(ring);
        let data = self.map.at(DATA_OFFSET + ring * self.ring_bytes);
        Producer::new(self.map.clone(), control, data, self.ring_bytes)
    }

    /// The reading end of ring `ring` (see [`Segment::producer`]).
    pub fn consumer(&self, ring: usize) -> Consumer {
        let control = self.control(ring);
        let data = self.map.at(DATA_OFFSET + ring * self.ring_bytes);
        Consumer::new(self.map.clone(), control, data, self.ring_bytes)
    }

    /// Marks the segment closed and wakes every waiter of both processes: their waits fail once they have nothing
    /// left to read (bytes published before the close are still delivered).
    pub fn close(&self) {
        self.map.header().closed.0.store(1, Ordering::SeqCst);
        for ring in 0..self.rings {
            // SAFETY: a control block inside the mapping, which `self` keeps alive.
            wake_all(unsafe { &*self.control(ring) });
        }
    }

    /// Whether either side closed the segment.
    pub fn is_closed(&self) -> bool {
        closed(&self.map)
    }
}

/// Whether the segment of `map` was closed.
pub(crate) fn closed(map: &Mapping) -> bool {
    map.header().closed.0.load(Ordering::SeqCst) != 0
}

#[cfg(test)]
impl Segment {
    /// The header, for tests that tear it.
    pub(crate) fn header_ptr(&self) -> *mut u8 {
        self.map.base.as_ptr()
    }
}
