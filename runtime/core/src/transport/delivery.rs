//! What the transport hands to the layer above for each incoming message, and where that message's answer goes: an
//! [`Envelope`] (message name, call kind, [`Payload`], [`Responder`]). Nothing here knows an actor type; the actor
//! layer's mailboxes carry envelopes and its handlers answer through their responders.

use rkyv::util::AlignedVec;
use tokio::sync::{mpsc, oneshot};

use crate::protocol::{CallKind, RemoteError, RemoteErrorKind};
use crate::transport::Outbox;

/// A message's bytes: here already, or still arriving on a bulk stream.
pub(crate) enum Payload {
    Ready(AlignedVec),
    Bulk(oneshot::Receiver<AlignedVec>),
}

impl Payload {
    pub(crate) async fn resolve(self) -> Result<AlignedVec, RemoteError> {
        match self {
            Payload::Ready(b) => Ok(b),
            Payload::Bulk(rx) => rx.await.map_err(|_| RemoteError {
                kind: RemoteErrorKind::Decode,
                message: "bulk payload stream failed before it completed".into(),
            }),
        }
    }
}

/// Where the answer to one message goes.
pub(crate) enum Responder {
    /// `tell`: nobody waits.
    Nobody,
    /// A remote `tell`: nobody waits, but the sender's connection is told to pause when the line is full.
    Told(Outbox),
    /// An in-process `call`.
    Local(oneshot::Sender<Result<AlignedVec, RemoteError>>),
    /// An in-process `stream`: items, then the channel closes (or carries one error).
    LocalStream(mpsc::Sender<Result<AlignedVec, RemoteError>>),
    /// A remote caller: frames written to its connection.
    Remote { req: u64, out: Outbox },
}

impl Responder {
    pub(crate) async fn finish(self, result: Result<AlignedVec, RemoteError>) {
        match self {
            Responder::Nobody | Responder::Told(_) => {
                if let Err(e) = result {
                    tracing::warn!("told message failed: {}", e.message);
                }
            }
            Responder::Local(tx) => {
                let _ = tx.send(result);
            }
            Responder::LocalStream(tx) => {
                if let Err(e) = result {
                    let _ = tx.send(Err(e)).await;
                }
            }
            Responder::Remote { req, out } => out.reply(req, result).await,
        }
    }

    pub(crate) fn sink(&self) -> RawSink {
        match self {
            Responder::LocalStream(tx) => RawSink(Sink::Local(tx.clone())),
            Responder::Remote { req, out } => RawSink(Sink::Remote {
                req: *req,
                out: out.clone(),
            }),
            _ => RawSink(Sink::Nowhere),
        }
    }

    pub(crate) async fn end(self, result: Result<(), RemoteError>) {
        match self {
            Responder::Remote { req, out } => out.end(req, result.err()).await,
            other => other.finish(result.map(|()| AlignedVec::new())).await,
        }
    }
}

/// The untyped side of an actor's `ItemSink`: where the items of a streaming reply go (an in-process channel or a
/// connection). Opaque; it appears in [`StreamFn`](crate::StreamFn), the type-erased stream handler.
pub struct RawSink(Sink);

/// Where a [`RawSink`]'s items go.
enum Sink {
    /// In-process stream.
    Local(mpsc::Sender<Result<AlignedVec, RemoteError>>),
    /// Remote stream.
    Remote {
        /// Request id.
        req: u64,
        /// Connection outbox.
        out: Outbox,
    },
    /// Nobody listens (a stream message sent with `tell`).
    Nowhere,
}

impl RawSink {
    pub(crate) async fn item(&self, bytes: AlignedVec) -> anyhow::Result<()> {
        match &self.0 {
            Sink::Local(tx) => tx
                .send(Ok(bytes))
                .await
                .map_err(|_| anyhow::anyhow!("stream receiver dropped")),
            Sink::Remote { req, out } => out.item(*req, bytes).await,
            Sink::Nowhere => Ok(()),
        }
    }
}

/// One message waiting in a mailbox.
pub(crate) struct Envelope {
    pub msg: String,
    pub kind: CallKind,
    pub payload: Payload,
    pub reply: Responder,
}
