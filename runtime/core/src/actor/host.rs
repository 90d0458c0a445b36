//! Hosting actors in this process: one task per actor drains a bounded mailbox (senders wait when it is full) and
//! runs handlers one at a time, or up to `max_concurrency` at once. Replies go back through a `Responder`, which
//! is either an in-process channel or a connection's outbox; both paths run the same code.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use tokio::sync::{mpsc, Semaphore};
use tracing::Instrument;

use crate::actor::{AnyActor, Context, Dispatch};
use crate::protocol::{CallKind, Frame, RemoteError, RemoteErrorKind};
use crate::transport::delivery::{Envelope, Responder};
use crate::transport::Outbox;

/// An actor's mailbox as its process sees it: the bounded channel its task drains, plus a waiting line for remote
/// messages that find the channel full (guarantee 3 in `runtime/README.md`).
///
/// A connection carries calls to every actor of this process, so its reader must never wait on one actor's full
/// mailbox: such a message joins this actor's line instead (in arrival order; while the line is not empty every
/// later remote message for the actor joins it too, so per-sender order holds) and one task moves the line into the
/// channel as room frees. The line holds `capacity` messages; a remote call or stream that finds it full is refused
/// at once with a "mailbox full" error. A remote tell cannot be refused: it is queued anyway and its sender is
/// paused (a [`Frame::Pause`] on its connection), so that sender's later tells to this actor wait in `tell()` until
/// the line has room again (a [`Frame::Resume`]). The line exceeds `capacity` by at most the tells already in flight
/// when the pause reached their sender.
pub(crate) struct Mailbox {
    actor: u64,
    tx: mpsc::Sender<Envelope>,
    capacity: usize,
    line: Mutex<Line>,
}

#[derive(Default)]
struct Line {
    waiting: VecDeque<Envelope>,
    /// A task is moving `waiting` into the channel (set from the first message queued until the line is empty).
    draining: bool,
    /// Connections told to pause their tells, to resume when the line has room.
    paused: Vec<Outbox>,
    /// Pauses sent so far.
    epoch: u64,
}

/// What became of a message offered to a [`Mailbox`] from a connection.
pub(crate) enum Offered {
    /// In the mailbox or in its waiting line.
    Queued,
    /// The actor is no longer hosted: the message comes back.
    Closed(Envelope),
    /// Mailbox and line are full and the message is a call or stream: it comes back to be refused.
    Full(Envelope),
    /// A tell queued beyond a full line: send this pause to its sender.
    Pause(Outbox, Frame),
}

impl Mailbox {
    /// A mailbox for `actor` holding `capacity` messages (at least 1), and the receiving end its task drains.
    pub(crate) fn new(actor: u64, capacity: usize) -> (Arc<Self>, mpsc::Receiver<Envelope>) {
        let capacity = capacity.max(1);
        let (tx, rx) = mpsc::channel::<Envelope>(capacity);
        let mailbox = Arc::new(Mailbox {
            actor,
            tx,
            capacity,
            line: Mutex::new(Line::default()),
        });
        (mailbox, rx)
    }

    /// How many messages the mailbox holds.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// An in-process sender: waits while the mailbox is full. Gives the message back if the actor stopped.
    pub(crate) async fn send_local(&self, env: Envelope) -> Result<(), Envelope> {
        self.tx.send(env).await.map_err(|e| e.0)
    }

    /// A message from a connection: never waits (see the type's docs).
    pub(crate) fn offer(self: &Arc<Self>, env: Envelope) -> Offered {
        let mut line = self.line.lock().expect("mailbox line lock");
        if !line.draining {
            match self.tx.try_send(env) {
                Ok(()) => return Offered::Queued,
                Err(mpsc::error::TrySendError::Closed(e)) => return Offered::Closed(e),
                Err(mpsc::error::TrySendError::Full(e)) => {
                    line.waiting.push_back(e);
                    line.draining = true;
                    tokio::spawn(self.clone().drain());
                    return Offered::Queued;
                }
            }
        }
        if line.waiting.len() < self.capacity {
            line.waiting.push_back(env);
            return Offered::Queued;
        }
        let sender = match &env.reply {
            Responder::Told(out) => out.clone(),
            _ => return Offered::Full(env),
        };
        line.waiting.push_back(env);
        if line.paused.iter().any(|o| o.same_stream(&sender)) {
            return Offered::Queued;
        }
        line.epoch += 1;
        line.paused.push(sender.clone());
        let pause = Frame::Pause {
            actor: self.actor,
            epoch: line.epoch,
        };
        Offered::Pause(sender, pause)
    }

    /// Moves the waiting line into the channel, in order, as room frees; resumes paused senders once the line
    /// has room.
    async fn drain(self: Arc<Self>) {
        loop {
            let Ok(permit) = self.tx.reserve().await else {
                // The actor's task is gone: refuse what still waits so no caller hangs.
                return self.refuse_waiting().await;
            };
            let (more, resume) = {
                let mut line = self.line.lock().expect("mailbox line lock");
                if let Some(env) = line.waiting.pop_front() {
                    permit.send(env);
                }
                line.draining = !line.waiting.is_empty();
                let resume = if line.waiting.len() < self.capacity {
                    std::mem::take(&mut line.paused)
                } else {
                    Vec::new()
                };
                (line.draining, (resume, line.epoch))
            };
            self.resume(resume).await;
            if !more {
                return;
            }
        }
    }

    /// Tells paused senders that they may send again.
    async fn resume(&self, (senders, epoch): (Vec<Outbox>, u64)) {
        for out in senders {
            let _ = out
                .frame(
                    Frame::Resume {
                        actor: self.actor,
                        epoch,
                    },
                    None,
                )
                .await;
        }
    }

    async fn refuse_waiting(&self) {
        let (left, resume): (Vec<Envelope>, _) = {
            let mut line = self.line.lock().expect("mailbox line lock");
            line.draining = false;
            let resume = (std::mem::take(&mut line.paused), line.epoch);
            (line.waiting.drain(..).collect(), resume)
        };
        self.resume(resume).await;
        for env in left {
            env.reply
                .finish(Err(RemoteError {
                    kind: RemoteErrorKind::NoSuchActor,
                    message: "the actor stopped before this message was delivered".into(),
                }))
                .await;
        }
    }
}

/// Starts the task that runs an actor's mailbox. The task ends when every sender is dropped (the process forgets the
/// actor and the waiting line is empty) after draining what was queued.
pub(crate) fn run_mailbox(
    actor: AnyActor,
    dispatch: &'static Dispatch,
    ctx: Context,
    max_concurrency: usize,
    capacity: usize,
) -> Arc<Mailbox> {
    let (mailbox, mut rx) = Mailbox::new(ctx.actor_id, capacity);
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
    mailbox
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

#[cfg(test)]
#[path = "host_tests.rs"]
mod tests;
