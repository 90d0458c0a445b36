//! Immutable blobs in shared memory: one process writes bytes once into a memfd ([`BlobWriter`]), seals it against
//! every change ([`BlobWriter::finish`]), and any process of the same user on the host maps the same pages read-only
//! from a [`BlobOffer`] ([`Blob::open`]) without a copy (Ray's plasma store, for one object at a time).
//!
//! Layout: a header page (the [`BLOB_MAGIC`], a 32-byte random nonce, the data's length), then the data.
//!
//! The creator keeps its descriptor open while the blob may be opened ([`Blob::close_fd`] ends that); the mappings
//! keep the memory alive, so bytes a reader mapped stay valid after the creator closed or dropped its own. The
//! checks of [`Blob::open`] are those of [`Segment::accept`](crate::Segment::accept) (the same user, a sealed
//! regular file of the offered size, a header with the offered nonce), plus the write seal: no process can change
//! a blob's bytes once it was offered.

use std::io::{Error, ErrorKind, Result};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use crate::segment::{invalid, open_offered, random_nonce, sealable_memfd, Mapping};
use crate::{MAX_SEGMENT_BYTES, NONCE_LEN};

/// First bytes of every blob (the layout version is its last character).
pub const BLOB_MAGIC: [u8; 8] = *b"FERLBLB1";
/// Where a blob's data starts (after its header page).
const BLOB_DATA_OFFSET: usize = 4096;
/// The seals of a finished blob.
const BLOB_SEALS: libc::c_int =
    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;

/// A blob's first page.
#[repr(C)]
struct BlobHeader {
    magic: [u8; 8],
    nonce: [u8; NONCE_LEN],
    len: u64,
}

const _: () = assert!(std::mem::size_of::<BlobHeader>() <= BLOB_DATA_OFFSET);

/// What the creator of a [`Blob`] tells another process so that it can map it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobOffer {
    /// The creator's process id.
    pub pid: u32,
    /// The memfd's descriptor number in the creator.
    pub fd: i32,
    /// Bytes of data.
    pub len: u64,
    /// Random bytes written in the blob's header.
    pub nonce: [u8; NONCE_LEN],
}

/// A blob being written: fill [`BlobWriter::data_mut`], then [`BlobWriter::finish`].
pub struct BlobWriter {
    fd: OwnedFd,
    map: Mapping,
    len: usize,
}

impl BlobWriter {
    /// A zeroed blob of `len` bytes, its memory allocated up front (a machine short of shared memory fails here,
    /// see [`crate::out_of_space`], not when a page is first written).
    pub fn create(len: usize) -> Result<Self> {
        let total = len
            .checked_add(BLOB_DATA_OFFSET)
            .filter(|&n| n as u64 <= MAX_SEGMENT_BYTES)
            .ok_or_else(|| Error::new(ErrorKind::InvalidInput, format!("a blob of {len} bytes")))?;
        let fd = sealable_memfd(c"ferl-object", total, true)?;
        let map = Mapping::new(&fd, total, true)?;
        let header = map.at(0) as *mut BlobHeader;
        // SAFETY: the header page is inside the mapping, which nobody else has yet.
        unsafe {
            (*header).magic = BLOB_MAGIC;
            (*header).nonce = random_nonce()?;
            (*header).len = len as u64;
        }
        Ok(Self { fd, map, len })
    }

    /// The data written so far.
    pub fn data(&self) -> &[u8] {
        // SAFETY: the data area lies inside the mapping, which only this writer maps, for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.map.at(BLOB_DATA_OFFSET), self.len) }
    }

    /// The data, to fill.
    pub fn data_mut(&mut self) -> &mut [u8] {
        // SAFETY: the data area lies inside the mapping, which only this writer maps, for as long as `self` lives.
        unsafe { std::slice::from_raw_parts_mut(self.map.at(BLOB_DATA_OFFSET), self.len) }
    }

    /// Unmaps the writable view, seals the blob against any change, and maps it read-only.
    pub fn finish(self) -> Result<Blob> {
        let Self { fd, map, len } = self;
        // The write seal refuses while a writable shared mapping exists.
        drop(map);
        // SAFETY: a plain call on a descriptor we own; its result is checked.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, BLOB_SEALS) } != 0 {
            return Err(Error::last_os_error());
        }
        let map = Mapping::with_protection(&fd, len + BLOB_DATA_OFFSET, libc::PROT_READ, false)?;
        Ok(Blob {
            map,
            fd: Mutex::new(Some(fd)),
            len,
        })
    }
}

/// A sealed blob mapped read-only: the creator's (which can [`Blob::offer`] it) or one opened from an offer.
pub struct Blob {
    map: Mapping,
    /// The creator's descriptor, until [`Blob::close_fd`].
    fd: Mutex<Option<OwnedFd>>,
    len: usize,
}

impl Blob {
    /// The data.
    pub fn data(&self) -> &[u8] {
        // SAFETY: the data area lies inside the mapping, which lives as long as `self`; the write seal keeps every
        // process from changing it.
        unsafe { std::slice::from_raw_parts(self.map.at(BLOB_DATA_OFFSET), self.len) }
    }

    fn header(&self) -> &BlobHeader {
        // SAFETY: the mapping starts with the header page, written before the seals and never after.
        unsafe { &*(self.map.at(0) as *const BlobHeader) }
    }

    /// What another process needs to map this blob, or `None` once [`Blob::close_fd`] was called (and on an
    /// opened blob).
    pub fn offer(&self) -> Option<BlobOffer> {
        let fd = self.fd.lock().expect("blob descriptor lock");
        fd.as_ref().map(|fd| BlobOffer {
            pid: std::process::id(),
            fd: fd.as_raw_fd(),
            len: self.len as u64,
            nonce: self.header().nonce,
        })
    }

    /// Closes the creator's descriptor: offers made before can no longer be opened (mappings stay valid).
    pub fn close_fd(&self) {
        self.fd.lock().expect("blob descriptor lock").take();
    }

    /// Opens and maps the blob another process offered. The error says why it cannot be used: another host or
    /// user, a file that is not a sealed blob of the offered size, or a header without the magic, the offered
    /// length and the offered nonce.
    pub fn open(offer: &BlobOffer) -> Result<Self> {
        let len = usize::try_from(offer.len)
            .ok()
            .filter(|&n| n as u64 + BLOB_DATA_OFFSET as u64 <= MAX_SEGMENT_BYTES)
            .ok_or_else(|| invalid(format!("an offer of a {}-byte blob", offer.len)))?;
        let total = len + BLOB_DATA_OFFSET;
        let (file, path) = open_offered(offer.pid, offer.fd, false, total as u64, BLOB_SEALS)?;
        // The header first: a descriptor number reused by another blob of the same size fails here, before its
        // pages are mapped.
        let mut header = [0u8; std::mem::size_of::<BlobHeader>()];
        file.read_exact_at(&mut header, 0)
            .map_err(|e| Error::new(e.kind(), format!("reading {path}: {e}")))?;
        let nonce_at = BLOB_MAGIC.len();
        let len_at = nonce_at + NONCE_LEN;
        if header[..nonce_at] != BLOB_MAGIC
            || header[nonce_at..len_at] != offer.nonce
            || header[len_at..len_at + 8] != offer.len.to_ne_bytes()
        {
            return Err(invalid(format!("{path} is not the blob offered")));
        }
        // Populated: a reader typically reads every byte (a weight sync), and one call maps the pages far faster
        // than a fault per page.
        let map = Mapping::with_protection(&file, total, libc::PROT_READ, true)
            .map_err(|e| Error::new(e.kind(), format!("mapping {path}: {e}")))?;
        Ok(Self {
            map,
            fd: Mutex::new(None),
            len,
        })
    }
}

impl AsRef<[u8]> for Blob {
    fn as_ref(&self) -> &[u8] {
        self.data()
    }
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shared-memory blob of {} bytes", self.len)
    }
}
