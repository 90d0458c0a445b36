//! The bulk streams of one connection and the inbox that matches their payloads with the frames naming them
//! (guarantee 15 in `runtime/README.md`).
//!
//! A payload whose stream starts before a frame names it is *unclaimed*. What one peer may hold unclaimed is
//! bounded ([`BulkLimits`]): at most `bytes` bytes (counted from each stream's announced length, before anything is
//! allocated) in at most `payloads` payloads. A stream that does not fit waits, unread (QUIC flow control holds the
//! sender), until claims make room; a payload a frame already names is always admitted, so a receiver never waits
//! for room it cannot free. A stream that waits longer than `timeout`, or a payload left unclaimed that long, closes
//! the connection with a reason naming the payload and the limit; closing (for any reason) frees every payload of the
//! connection and fails the calls still waiting for one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rkyv::util::AlignedVec;
use tokio::sync::{oneshot, Notify};

use super::{buffer, MAX_BULK};

/// Default of `FERL_BULK_UNCLAIMED_BYTES` (read by `transport::config`): one payload of the largest size fits.
pub(crate) const DEFAULT_UNCLAIMED_BYTES: u64 = MAX_BULK;
/// Default of `FERL_BULK_UNCLAIMED_PAYLOADS`.
pub(crate) const DEFAULT_UNCLAIMED_PAYLOADS: usize = 1024;
/// Default of `FERL_BULK_UNCLAIMED_TIMEOUT_S`, in seconds.
pub(crate) const DEFAULT_UNCLAIMED_TIMEOUT_S: u64 = 300;

static UNCLAIMED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes of bulk payloads this process holds (or is receiving) unclaimed, over all connections; for tests.
pub(crate) fn unclaimed_bytes() -> u64 {
    UNCLAIMED_BYTES.load(Ordering::Relaxed)
}

/// What one connection's peer may hold unclaimed (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BulkLimits {
    /// Most unclaimed bytes (`FERL_BULK_UNCLAIMED_BYTES`).
    pub bytes: u64,
    /// Most unclaimed payloads (`FERL_BULK_UNCLAIMED_PAYLOADS`).
    pub payloads: usize,
    /// Longest wait for room, and longest time a payload stays unclaimed (`FERL_BULK_UNCLAIMED_TIMEOUT_S`).
    pub timeout: Duration,
}

/// Bulk payloads that arrived (or are awaited) on one connection, by id.
pub(crate) struct BulkInbox {
    state: Mutex<State>,
    room: Notify,
    limits: BulkLimits,
}

#[derive(Default)]
struct State {
    slots: HashMap<u64, Slot>,
    unclaimed_bytes: u64,
    unclaimed: usize,
    prune_at: usize,
    closed: Option<String>,
}

enum Slot {
    /// A frame named this payload; its stream has not completed.
    Waiting(oneshot::Sender<AlignedVec>),
    /// A stream announced this payload and no frame named it yet; `bytes` once it has fully arrived.
    Unclaimed {
        len: u64,
        since: Instant,
        bytes: Option<AlignedVec>,
    },
}

/// How a stream was admitted.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// A frame already named it.
    Claimed,
    /// It counts against the limits until a frame names it.
    Unclaimed,
}

impl Drop for BulkInbox {
    fn drop(&mut self) {
        self.close("the connection is gone");
    }
}

impl BulkInbox {
    /// An empty inbox with these limits.
    pub(crate) fn new(limits: BulkLimits) -> Self {
        Self {
            state: Mutex::new(State::default()),
            room: Notify::new(),
            limits,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("bulk inbox lock")
    }

    /// The payload with this id, now or when it arrives; the receiver fails when its stream fails or the
    /// connection closes.
    pub(crate) fn wait(&self, id: u64) -> oneshot::Receiver<AlignedVec> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.lock();
        if st.closed.is_some() {
            return rx;
        }
        match st.slots.remove(&id) {
            Some(Slot::Unclaimed { len, bytes, .. }) => {
                st.uncount(len);
                self.room.notify_waiters();
                match bytes {
                    Some(bytes) => drop(tx.send(bytes)),
                    None => drop(st.slots.insert(id, Slot::Waiting(tx))),
                }
            }
            _ => {
                st.slots.insert(id, Slot::Waiting(tx));
                st.prune();
            }
        }
        rx
    }

    /// Admits the stream of payload `id` announcing `len` bytes, waiting for room up to the time-out; the error
    /// (a time-out, a repeated id, a closed inbox) is the reason to close the connection with.
    pub(crate) async fn admit(&self, id: u64, len: u64) -> Result<Admission, String> {
        let deadline = tokio::time::Instant::now() + self.limits.timeout;
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(admission) = self.try_admit(id, len)? {
                return Ok(admission);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let st = self.lock();
                return Err(format!(
                    "bulk payload {id} of {len} bytes waited {:?} for room: the peer holds {} bytes in {} \
                     payloads that no call claimed (limits: {} bytes, {} payloads; FERL_BULK_UNCLAIMED_*)",
                    self.limits.timeout,
                    st.unclaimed_bytes,
                    st.unclaimed,
                    self.limits.bytes,
                    self.limits.payloads
                ));
            }
        }
    }

    fn try_admit(&self, id: u64, len: u64) -> Result<Option<Admission>, String> {
        let mut st = self.lock();
        if let Some(reason) = &st.closed {
            return Err(reason.clone());
        }
        match st.slots.get(&id) {
            Some(Slot::Waiting(_)) => return Ok(Some(Admission::Claimed)),
            Some(Slot::Unclaimed { .. }) => {
                return Err(format!("bulk payload id {id} announced twice"))
            }
            None => {}
        }
        let fits = st.unclaimed < self.limits.payloads
            && st.unclaimed_bytes.saturating_add(len) <= self.limits.bytes;
        if !fits {
            return Ok(None);
        }
        st.unclaimed += 1;
        st.unclaimed_bytes += len;
        UNCLAIMED_BYTES.fetch_add(len, Ordering::Relaxed);
        let since = Instant::now();
        st.slots.insert(
            id,
            Slot::Unclaimed {
                len,
                since,
                bytes: None,
            },
        );
        Ok(Some(Admission::Unclaimed))
    }

    /// Hands over the completed payload `id`.
    pub(crate) fn arrive(&self, id: u64, bytes: AlignedVec) {
        let mut st = self.lock();
        match st.slots.get_mut(&id) {
            Some(Slot::Unclaimed { bytes: slot, .. }) => *slot = Some(bytes),
            Some(Slot::Waiting(_)) => {
                if let Some(Slot::Waiting(tx)) = st.slots.remove(&id) {
                    let _ = tx.send(bytes);
                }
            }
            None => {}
        }
    }

    /// The stream of payload `id` failed: frees what it held and fails its waiter.
    pub(crate) fn abandon(&self, id: u64) {
        let mut st = self.lock();
        if let Some(Slot::Unclaimed { len, .. }) = st.slots.get(&id) {
            let len = *len;
            st.uncount(len);
            self.room.notify_waiters();
        }
        st.slots.remove(&id);
    }

    /// Why the connection must close, if a payload stayed unclaimed longer than the time-out.
    pub(crate) fn expired(&self, now: Instant) -> Option<String> {
        let st = self.lock();
        st.slots.iter().find_map(|(id, slot)| match slot {
            Slot::Unclaimed { len, since, .. }
                if now.duration_since(*since) > self.limits.timeout =>
            {
                Some(format!(
                    "bulk payload {id} of {len} bytes was not claimed by any call within {:?} \
                 (FERL_BULK_UNCLAIMED_TIMEOUT_S)",
                    self.limits.timeout
                ))
            }
            _ => None,
        })
    }

    /// Frees every payload and fails every waiter; later streams and claims fail at once.
    pub(crate) fn close(&self, reason: &str) {
        let mut st = self.lock();
        if st.closed.is_none() {
            st.closed = Some(format!("the connection is closed: {reason}"));
        }
        UNCLAIMED_BYTES.fetch_sub(st.unclaimed_bytes, Ordering::Relaxed);
        st.unclaimed_bytes = 0;
        st.unclaimed = 0;
        st.slots.clear();
        drop(st);
        self.room.notify_waiters();
    }

    /// Unclaimed payloads and their bytes.
    #[cfg(test)]
    pub(crate) fn unclaimed(&self) -> (usize, u64) {
        let st = self.lock();
        (st.unclaimed, st.unclaimed_bytes)
    }
}

impl State {
    fn uncount(&mut self, len: u64) {
        self.unclaimed -= 1;
        self.unclaimed_bytes -= len;
        UNCLAIMED_BYTES.fetch_sub(len, Ordering::Relaxed);
    }

    /// Forgets claims whose caller is gone (a frame naming a payload that never comes, for a call nobody awaits).
    fn prune(&mut self) {
        if self.slots.len() < self.prune_at.max(1024) {
            return;
        }
        self.slots
            .retain(|_, slot| !matches!(slot, Slot::Waiting(tx) if tx.is_closed()));
        self.prune_at = 2 * self.slots.len();
    }
}

/// Reads the bulk streams of a connection into its inbox, and closes the connection when a peer breaks the limits
/// of the inbox or sends an oversized payload. The inbox is closed (emptied) when the connection ends.
pub(crate) fn spawn_bulk_reader(conn: quinn::Connection, inbox: Arc<BulkInbox>) {
    tokio::spawn(async move {
        let reaper = tokio::spawn(reap(conn.clone(), inbox.clone()));
        while let Ok(recv) = conn.accept_uni().await {
            tokio::spawn(read_bulk_stream(conn.clone(), inbox.clone(), recv));
        }
        reaper.abort();
        inbox.close("the connection closed");
    });
}

/// Closes the connection once a payload stays unclaimed beyond the time-out.
async fn reap(conn: quinn::Connection, inbox: Arc<BulkInbox>) {
    let period =
        (inbox.limits.timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(5));
    loop {
        tokio::time::sleep(period).await;
        if let Some(reason) = inbox.expired(Instant::now()) {
            crate::transport::close(&conn, &reason);
            return inbox.close(&reason);
        }
    }
}

/// Reads one bulk stream: `[u64 id][u64 len][bytes]`.
async fn read_bulk_stream(
    conn: quinn::Connection,
    inbox: Arc<BulkInbox>,
    mut recv: quinn::RecvStream,
) {
    let mut header = [0u8; 16];
    if recv.read_exact(&mut header).await.is_err() {
        return;
    }
    let id = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
    if len > MAX_BULK {
        return crate::transport::close(
            &conn,
            &format!("bulk payload of {len} bytes exceeds the maximum of {MAX_BULK}"),
        );
    }
    if let Err(reason) = inbox.admit(id, len).await {
        crate::transport::close(&conn, &reason);
        return inbox.close(&reason);
    }
    // Chunks straight from quinn's receive buffers into the payload: no zeroing pass, one copy.
    let len = len as usize;
    let mut bytes = buffer(len);
    while bytes.len() < len {
        match recv.read_chunk(len - bytes.len(), true).await {
            Ok(Some(chunk)) => bytes.extend_from_slice(&chunk.bytes),
            _ => return inbox.abandon(id),
        }
    }
    inbox.arrive(id, bytes);
}

/// Sends one payload on a new bulk stream.
pub(crate) async fn send_bulk(
    conn: quinn::Connection,
    id: u64,
    bytes: AlignedVec,
) -> anyhow::Result<()> {
    let mut send = conn.open_uni().await?;
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&id.to_le_bytes());
    header[8..].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    send.write_all(&header).await?;
    send.write_all(&bytes).await?;
    send.finish()?;
    Ok(())
}

#[cfg(test)]
#[path = "inbox_tests.rs"]
mod tests;
