//! One call stream's two halves: the writer task (batches frames and places payloads inline, in the same-host
//! ring or on bulk streams) and the reader's payload side (inline bytes, the peer's ring, bulk streams).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use rkyv::util::AlignedVec;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use super::config::TransportConfig;
use super::{Outbox, BULK_THRESHOLD};
use crate::codec::{encode_frame, FrameError};
use crate::protocol::{ArchivedFrame, Body, Frame};
use crate::transport::bulk::{self, BulkInbox, RecvRing, SendRing};

const WRITE_BATCH: usize = 256 << 10;

/// Where a stream writer stands with its shared-memory ring; shared with the reader of the same stream pair, which
/// receives the peer's answer.
#[derive(Default)]
pub(super) struct ShmLink(AtomicU8);

const SHM_NOT_OFFERED: u8 = 0;
const SHM_OFFERED: u8 = 1;
const SHM_ACCEPTED: u8 = 2;
const SHM_REFUSED: u8 = 3;

impl ShmLink {
    fn get(&self) -> u8 {
        self.0.load(Ordering::Acquire)
    }
    /// Records the peer's answer to our offer.
    pub(super) fn answered(&self, accepted: bool) {
        let _ = self.0.compare_exchange(
            SHM_OFFERED,
            if accepted { SHM_ACCEPTED } else { SHM_REFUSED },
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// What the writer task puts on a call stream: a frame and the payload it carries, placed by the writer.
pub(crate) struct Outgoing {
    pub(super) frame: Frame,
    pub(super) body: Option<AlignedVec>,
}

/// The writer of one stream: batches frames, and places payloads inline, in the shared-memory ring or on bulk
/// streams. Only it allocates ring space, so payloads enter the ring in the order their frames are written.
struct Writer {
    conn: quinn::Connection,
    link: Arc<ShmLink>,
    ring: Option<SendRing>,
    /// Size of the ring to offer (`TransportConfig::shm_bytes`); 0: none.
    shm_bytes: u64,
    next_bulk: u64,
    batch: Vec<u8>,
}

impl Writer {
    /// Decides where `body` goes; returns the bytes to write after the frame, if any.
    fn place(&mut self, frame: &mut Frame, body: AlignedVec) -> Option<AlignedVec> {
        let len = body.len();
        if len >= bulk::SHM_MIN {
            match self.link.get() {
                SHM_ACCEPTED => {
                    if let Some(offset) = self.ring.as_mut().and_then(|r| r.put(&body)) {
                        set_body(
                            frame,
                            Body::Shared {
                                offset,
                                len: len as u64,
                            },
                        );
                        bulk::recycle(body);
                        return None;
                    }
                }
                SHM_NOT_OFFERED => self.offer_ring(),
                _ => {}
            }
        }
        // Stream items stay inline: a separate stream could overtake the items around it.
        if len > BULK_THRESHOLD && !matches!(frame, Frame::Item { .. }) {
            self.next_bulk += 1;
            let (conn, id) = (self.conn.clone(), self.next_bulk);
            tokio::spawn(async move {
                if let Err(e) = bulk::send_bulk(conn, id, body).await {
                    tracing::debug!("bulk stream {id} failed: {e}");
                }
            });
            set_body(frame, Body::Bulk(id));
            return None;
        }
        set_body(frame, Body::Inline(len as u64));
        Some(body)
    }

    /// Creates the ring and queues its offer ahead of the current frame.
    fn offer_ring(&mut self) {
        let capacity = self.shm_bytes;
        if capacity == 0 {
            self.link.0.store(SHM_REFUSED, Ordering::Release);
            return;
        }
        match SendRing::create(capacity) {
            Ok(ring) => {
                if encode_frame(&ring.offer(), &mut self.batch).is_ok() {
                    self.ring = Some(ring);
                    self.link.0.store(SHM_OFFERED, Ordering::Release);
                }
            }
            Err(e) => {
                tracing::debug!("no shared-memory ring ({e}); large payloads stay on QUIC");
                self.link.0.store(SHM_REFUSED, Ordering::Release);
            }
        }
    }
}

fn set_body(frame: &mut Frame, body: Body) {
    if let Some(b) = frame.body_mut() {
        *b = body;
    }
}

/// Drains frames from `rx` into `send`, batching what is queued into one write; large inline bodies are written
/// as they are, without copying.
pub(super) async fn write_loop<W: tokio::io::AsyncWrite + Unpin>(
    mut send: W,
    mut rx: mpsc::Receiver<Outgoing>,
    conn: quinn::Connection,
    link: Arc<ShmLink>,
    shm_bytes: u64,
) {
    let mut w = Writer {
        conn,
        link,
        ring: None,
        shm_bytes,
        next_bulk: 0,
        batch: Vec::with_capacity(WRITE_BATCH),
    };
    let mut next = rx.recv().await;
    while let Some(first) = next.take() {
        w.batch.clear();
        let mut pending = Some(first);
        let mut big: Option<AlignedVec> = None;
        while let Some(Outgoing { mut frame, body }) = pending.take() {
            let raw = body.and_then(|b| w.place(&mut frame, b));
            if let Err(e) = encode_frame(&frame, &mut w.batch) {
                tracing::error!("could not encode a frame: {e}");
                continue;
            }
            match raw {
                Some(body) if body.len() >= WRITE_BATCH / 4 => {
                    big = Some(body);
                    break;
                }
                Some(body) => {
                    w.batch.extend_from_slice(&body);
                    bulk::recycle(body);
                }
                None => {}
            }
            if w.batch.len() < WRITE_BATCH {
                pending = rx.try_recv().ok();
            }
        }
        if send.write_all(&w.batch).await.is_err() {
            break;
        }
        if let Some(body) = big {
            if send.write_all(&body).await.is_err() {
                break;
            }
            bulk::recycle(body);
        }
        next = match rx.try_recv() {
            Ok(out) => Some(out),
            Err(_) => rx.recv().await,
        };
    }
    let _ = send.shutdown().await;
}

/// The reading side's state of one stream: the peer's ring (once offered), and the bulk inbox.
pub(super) struct BodyReader {
    ring: Option<RecvRing>,
    pub(super) inbox: Arc<BulkInbox>,
    max_frame: usize,
    /// Whether this process takes rings offered by peers (`TransportConfig::shm_bytes` > 0).
    shm_on: bool,
}

/// A payload as read from the stream: here, or still arriving on a bulk stream.
pub(super) enum Got {
    Here(AlignedVec),
    Bulk(u64),
}

impl BodyReader {
    /// A reader of payloads, before any ring is offered.
    pub(super) fn new(inbox: Arc<BulkInbox>, cfg: &TransportConfig) -> Self {
        Self {
            ring: None,
            inbox,
            max_frame: cfg.max_frame,
            shm_on: cfg.shm_bytes > 0,
        }
    }

    /// Reads the payload a frame announces.
    pub(super) async fn read<R: tokio::io::AsyncRead + Unpin>(
        &mut self,
        reader: &mut R,
        body: Body,
    ) -> Result<Got, FrameError> {
        match body {
            Body::Inline(len) => read_body(reader, len, self.max_frame).await.map(Got::Here),
            Body::Bulk(id) => Ok(Got::Bulk(id)),
            Body::Shared { offset, len } => match self.ring.as_mut() {
                Some(ring) => ring
                    .take(offset, len)
                    .map(Got::Here)
                    .map_err(|e| FrameError::Io(std::io::Error::other(e))),
                None => Err(FrameError::Io(std::io::Error::other(
                    "shared payload without a mapped ring",
                ))),
            },
        }
    }

    /// Answers the peer's ring offer on `out` (the writer of the opposite direction).
    pub(super) async fn offer(&mut self, frame: &ArchivedFrame, out: &Outbox) {
        let ArchivedFrame::ShmOffer {
            pid,
            fd,
            capacity,
            nonce,
        } = frame
        else {
            return;
        };
        let opened = if !self.shm_on {
            Err("the same-host path is off here (FERL_SHM_BYTES=0)".to_string())
        } else {
            RecvRing::open(
                pid.to_native(),
                fd.to_native(),
                capacity.to_native(),
                nonce.as_slice(),
            )
        };
        let answer = match opened {
            Ok(ring) => {
                self.ring = Some(ring);
                Frame::ShmAnswer {
                    accepted: true,
                    reason: String::new(),
                }
            }
            Err(reason) => {
                tracing::debug!("refusing the peer's shared-memory ring: {reason}");
                Frame::ShmAnswer {
                    accepted: false,
                    reason,
                }
            }
        };
        let _ = out.frame(answer, None).await;
    }
}

/// Reads the raw body of `len` bytes that follows a frame.
async fn read_body<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut R,
    len: u64,
    max: usize,
) -> Result<AlignedVec, FrameError> {
    use tokio::io::AsyncReadExt;
    if len as usize > max {
        return Err(FrameError::TooLarge {
            len: len as usize,
            max,
        });
    }
    let mut bytes = bulk::aligned_buffer(len as usize);
    bytes.resize(len as usize, 0);
    reader.read_exact(bytes.as_mut_slice()).await?;
    Ok(bytes)
}
