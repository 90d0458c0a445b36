//! Hosting actors in this process: one task per actor drains a bounded mailbox (senders wait when it is full) and
//! runs handlers one at a time, or up to `max_concurrency` at once. Replies go back through a `Responder`, which
//! is either an in-process channel or a connection's outbox; both paths run the same code.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use rkyv::util::AlignedVec;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tracing::Instrument;

use crate::actor::{AnyActor, Context, Dispatch};
use crate::protocol::{CallKind, RemoteError, RemoteErrorKind};
use crate::transport::Outbox;

/// A message's bytes: here already, or still arriving on a bulk stream.
pub(crate) enum Payload {
    Ready(AlignedVec),
    Bulk(oneshot::Receiver<AlignedVec>),
}

impl Payload {
    async fn resolve(self) -> Result<AlignedVec, RemoteError> {
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
            Responder::Nobody => {
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

    fn sink(&self) -> RawSink {
        match self {
            Responder::LocalStream(tx) => RawSink::Local(tx.clone()),
            Responder::Remote { req, out } => RawSink::Remote {
                req: *req,
                out: out.clone(),
            },
            _ => RawSink::Nowhere,
        }
    }

    async fn end(self, result: Result<(), RemoteError>) {
        match self {
            Responder::Remote { req, out } => out.end(req, result.err()).await,
            other => other.finish(result.map(|()| AlignedVec::new())).await,
        }
    }
}

/// The untyped side of an [`crate::ItemSink`].
pub enum RawSink {
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
        match self {
            RawSink::Local(tx) => tx
                .send(Ok(bytes))
                .await
                .map_err(|_| anyhow::anyhow!("stream receiver dropped")),
            RawSink::Remote { req, out } => out.item(*req, bytes).await,
            RawSink::Nowhere => Ok(()),
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

/// Starts the task that runs an actor's mailbox; returns the mailbox's sending side. The task ends when every sender
/// is dropped (the process forgets the actor) after draining what was queued.
pub(crate) fn run_mailbox(
    actor: AnyActor,
    dispatch: &'static Dispatch,
    ctx: Context,
    max_concurrency: usize,
    capacity: usize,
) -> mpsc::Sender<Envelope> {
    let (tx, mut rx) = mpsc::channel::<Envelope>(capacity.max(1));
    tokio::spawn(async move {
        let limit = Arc::new(Semaphore::new(max_concurrency.max(1)));
        while let Some(env) = rx.recv().await {
            if max_concurrency <= 1 {
                handle_one(actor.clone(), dispatch, ctx.clone(), env).await;
            } else {
                let permit = limit
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("semaphore never closed");
                let (actor, ctx) = (actor.clone(), ctx.clone());
                tokio::spawn(async move {
                    handle_one(actor, dispatch, ctx, env).await;
                    drop(permit);
                });
            }
        }
    });
    tx
}

fn panicked(msg: &str, actor: u64) -> RemoteError {
    RemoteError {
        kind: RemoteErrorKind::Handler,
        message: format!("handler of {msg} panicked in actor {actor}"),
    }
}

async fn handle_one(actor: AnyActor, dispatch: &'static Dispatch, ctx: Context, env: Envelope) {
    let Envelope {
        msg,
        kind,
        payload,
        reply,
    } = env;
    let bytes = match payload.resolve().await {
        Ok(b) => b,
        Err(e) => return reply.finish(Err(e)).await,
    };
    let id = ctx.actor_id;
    match kind {
        CallKind::Tell | CallKind::Call => {
            let Some(handler) = dispatch.calls.get(msg.as_str()) else {
                let message = format!("actor {id} has no handler for message {msg}");
                return reply
                    .finish(Err(RemoteError {
                        kind: RemoteErrorKind::NoSuchHandler,
                        message,
                    }))
                    .await;
            };
            let span = tracing::debug_span!("call", actor = id, msg = %msg);
            let result = AssertUnwindSafe(handler(actor, bytes, ctx).instrument(span))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(panicked(&msg, id)));
            reply.finish(result).await;
        }
        CallKind::Stream => {
            let Some(handler) = dispatch.streams.get(msg.as_str()) else {
                let message = format!("actor {id} has no stream handler for message {msg}");
                return reply
                    .end(Err(RemoteError {
                        kind: RemoteErrorKind::NoSuchHandler,
                        message,
                    }))
                    .await;
            };
            let sink = reply.sink();
            let span = tracing::debug_span!("stream", actor = id, msg = %msg);
            let result = AssertUnwindSafe(handler(actor, bytes, ctx, sink).instrument(span))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(panicked(&msg, id)));
            reply.end(result).await;
        }
    }
}
