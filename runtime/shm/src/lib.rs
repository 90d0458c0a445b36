//! # ferl-shm: same-host shared memory between two processes
//!
//! One mechanism for both users of shared memory in ferl: the runtime's same-host bulk path (guarantee 13 of
//! `runtime/README.md`, one ring per call-stream direction) and the collectives' links between ranks on one host
//! (two rings per pair, one per direction).
//!
//! ## Data model
//! - A [`Segment`] is a sealed memfd (`memfd_create`, sealed against shrinking and growing) mapped by two processes:
//!   a header page (the [`MAGIC`], a 32-byte random nonce, the ring count and size, a `closed` flag), a page of ring
//!   control blocks, then the rings' data areas.
//! - A ring is a single-producer single-consumer byte ring of a power-of-two capacity: a [`Producer`] publishes bytes
//!   by advancing a monotonic `head`, a [`Consumer`] frees them by advancing a monotonic `tail`. Bytes are used either
//!   as a stream ([`Producer::send`] / [`Consumer::recv_pieces`], the collectives) or as contiguous payloads named by
//!   their position ([`Producer::try_put`] / [`Consumer::take`], the runtime, whose frames carry the position).
//! - Waiting spins, then yields, then sleeps on a futex word in the segment that the other side bumps on progress,
//!   waking every [`POLL_INTERVAL`] to ask the caller's [`Watch`] whether the peer is gone.
//!
//! - A [`Blob`] is one immutable byte buffer in a memfd sealed against every change (the object store's same-host
//!   path): written once by its creator ([`BlobWriter`]), mapped read-only by any process of the host that holds
//!   its [`BlobOffer`], with the same checks as a segment's offer (below) plus the write seal.
//!
//! ## Offer and accept
//! The creator sends an [`Offer`] (its pid, the memfd's descriptor number, the ring geometry and the nonce) over a
//! connection that is already authenticated (QUIC with cluster TLS; the collectives' job-secret handshake). The peer
//! opens `/proc/<pid>/fd/<fd>` ([`Segment::accept`]), checks that it is a sealed regular file of its own user of the
//! offered size, and that its header holds the magic, the offered geometry and the nonce; only then does it map the
//! rings. A process on another host opens nothing (or another file, whose header does not match) and refuses; the
//! pair then keeps its network path.
//!
//! ## Security
//! 1. Nothing is named in a file system: no other process can find the segment by name, and the kernel frees it when
//!    both processes have let go of it, however they end (no sweeping of stale files).
//! 2. The kernel lets a process open `/proc/<pid>/fd/<fd>` only with ptrace read access to the creator (the same
//!    user, or a privileged one): another user cannot map or write a ring even knowing the offer.
//! 3. Offers travel only on authenticated connections, and a segment is used only when its header carries the nonce
//!    of the offer received there: a peer without the cluster credentials or the job secret cannot make a process
//!    map a ring of its choosing, nor learn the nonce of a ring it could open.
//! 4. The creator closes its descriptor once the peer has answered ([`Segment::close_fd`]), so the offer cannot be
//!    opened again later.
//! 5. The seals keep the file at its size while mapped (no `SIGBUS`), and every position a peer names is
//!    bounds-checked against the ring before a byte is read.

mod blob;
mod ring;
mod segment;

pub use blob::{Blob, BlobOffer, BlobWriter, BLOB_MAGIC};
pub use ring::{Consumer, Producer, Watch, POLL_INTERVAL};
pub use segment::Segment;

use std::io::{Error, ErrorKind};

/// First bytes of every segment (the layout version is its last character).
pub const MAGIC: [u8; 8] = *b"FERLSHM2";
/// Bytes of the random nonce in an offer and in the segment's header.
pub const NONCE_LEN: usize = 32;
/// Most rings in one segment.
pub const MAX_RINGS: usize = 4;
/// Smallest ring (one page).
pub const MIN_RING_BYTES: usize = 4096;
/// Largest segment a peer maps (1 TiB).
pub const MAX_SEGMENT_BYTES: u64 = 1 << 40;

/// What the creator of a [`Segment`] tells its peer so that the peer can map it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// The creator's process id.
    pub pid: u32,
    /// The memfd's descriptor number in the creator.
    pub fd: i32,
    /// Rings in the segment.
    pub rings: u32,
    /// Bytes of each ring's data area (a power of two).
    pub ring_bytes: u64,
    /// Random bytes written in the segment's header.
    pub nonce: [u8; NONCE_LEN],
}

impl Offer {
    /// Bytes of [`Offer::encode`].
    pub const ENCODED_LEN: usize = 4 + 4 + 4 + 8 + NONCE_LEN;

    /// The offer as bytes (little-endian fields in declaration order), for connections that carry raw bytes.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.fd.to_le_bytes());
        out[8..12].copy_from_slice(&self.rings.to_le_bytes());
        out[12..20].copy_from_slice(&self.ring_bytes.to_le_bytes());
        out[20..].copy_from_slice(&self.nonce);
        out
    }

    /// Reads what [`Offer::encode`] wrote; any other length is an error.
    pub fn decode(bytes: &[u8]) -> std::io::Result<Self> {
        if bytes.len() != Self::ENCODED_LEN {
            return Err(Error::new(
                ErrorKind::InvalidData,
                format!(
                    "a shared-memory offer of {} bytes, expected {}",
                    bytes.len(),
                    Self::ENCODED_LEN
                ),
            ));
        }
        let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        Ok(Self {
            pid: word(0),
            fd: word(4) as i32,
            rings: word(8),
            ring_bytes: u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes")),
            nonce: bytes[20..].try_into().expect("32 bytes"),
        })
    }
}

/// Whether `e` says the memory for a segment could not be reserved (`ENOSPC`), as opposed to any other failure.
pub fn out_of_space(e: &Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSPC)
}

#[cfg(test)]
mod blob_tests;
#[cfg(test)]
mod tests;
