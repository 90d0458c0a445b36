//! Large payloads, on two paths:
//!
//! - **QUIC bulk streams**: a payload over [`crate::transport::BULK_THRESHOLD`] travels on its own unidirectional
//!   stream (`[u64 id][u64 len][bytes]`) so it does not hold up small frames; the frame names the stream's id.
//!   What a peer may send on such streams before a frame names them is bounded and reclaimed ([`inbox`]).
//! - **Same-host shared-memory ring** (guarantee 13 in `runtime/README.md`): the first time a stream writer has a
//!   payload of at least [`SHM_MIN`] bytes it creates a ring (a `ferl-shm` segment: a sealed memfd only its user can
//!   open), and offers it on the (authenticated, encrypted) QUIC stream. A receiver on the same host opens it as
//!   `/proc/<pid>/fd/<fd>`, checks the 32 random bytes of the offer in its header, maps it and accepts; from then on
//!   payloads are copied into the ring and the QUIC frame carries only their position and length ([`ring`]). The
//!   receiver copies each payload out (then validates it like any other) and frees its space in the ring for the
//!   writer. A peer on another host cannot open the memfd (or finds other bytes there) and refuses: payloads stay on
//!   QUIC. Nothing is named in a file system: the kernel frees the ring when both processes have let go of it,
//!   whatever way they end.

use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) mod inbox;
mod ring;

pub(crate) use inbox::unclaimed_bytes;
pub(crate) use inbox::{send_bulk, spawn_bulk_reader, BulkInbox};
pub(crate) use ring::{RecvRing, SendRing};

/// Payloads at least this large go through the shared-memory ring once the peer has mapped it.
pub(crate) const SHM_MIN: usize = ferl_wire::codec::pool::LARGE;
/// Default size of a ring's data area; `FERL_SHM_BYTES` overrides it (0 turns the same-host path off). Pages are
/// only backed once written, and a ring drained of payloads starts again at its beginning, so what a ring holds in
/// memory is the most bytes it ever had in flight at once.
pub(crate) const DEFAULT_SHM_BYTES: u64 = 256 << 20;
/// Largest ring a receiver maps (and a process offers: `transport::config` caps `FERL_SHM_BYTES` to it).
pub(crate) const MAX_SHM_BYTES: u64 = 1 << 40;
/// Largest bulk payload accepted on a QUIC bulk stream (4 GiB).
pub(crate) const MAX_BULK: u64 = 4 << 30;

static SHM_BYTES_RECEIVED: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has received through shared-memory rings (the same-host path), for tests and benchmarks.
pub(crate) fn shm_bytes_received() -> u64 {
    SHM_BYTES_RECEIVED.load(Ordering::Relaxed)
}

pub(crate) use ferl_wire::codec::pool::{aligned_buffer, buffer, recycle};
