//! [`ActorRef`]: a typed handle on an actor anywhere in the cluster. The same code path serves in-process,
//! cross-process and cross-node actors; only the delivery differs (a local mailbox or a connection).

use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use crate::actor::process::{Fate, Process};
use crate::actor::{Actor, Handler, Message, StreamHandler, StreamMessage};
use crate::codec::Wire;
use crate::protocol::{ActorAddress, CallKind};
use crate::transport::error::{Error, Result};
use crate::transport::ReplyHandle;

/// How long a call waits for a restarting actor to come back.
const RESTART_WAIT: Duration = Duration::from_secs(120);
/// How often a request that is not sent yet (its connection still opening) checks whether the actor died meanwhile.
const FATE_POLL: Duration = Duration::from_millis(50);

/// A typed handle on an actor of type `A`. Cheap to clone; `Send + Sync`.
pub struct ActorRef<A> {
    address: Arc<ActorAddress>,
    process: Arc<Process>,
    _actor: PhantomData<fn() -> A>,
}

impl<A> Clone for ActorRef<A> {
    fn clone(&self) -> Self {
        Self {
            address: self.address.clone(),
            process: self.process.clone(),
            _actor: PhantomData,
        }
    }
}

impl<A> std::fmt::Debug for ActorRef<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ActorRef({} {} on {} at {})",
            self.address.type_name, self.address.id, self.address.node, self.address.addr
        )
    }
}

/// Items of a streaming reply.
pub struct ReplyStream<T> {
    handle: ReplyHandle,
    actor: ActorRef<()>,
    _item: PhantomData<fn() -> T>,
}

impl<T: Wire> ReplyStream<T> {
    /// The next item, or `None` when the stream ended.
    pub async fn next(&mut self) -> Option<Result<T>> {
        let item = self.handle.next().await?;
        Some(match item {
            Ok(bytes) => T::from_wire_owned(bytes).map_err(Error::from),
            Err(e) => Err(self.actor.explain(e)),
        })
    }

    /// Collects every item (stops at the first error).
    pub async fn collect(mut self) -> Result<Vec<T>> {
        let mut out = Vec::new();
        while let Some(item) = self.next().await {
            out.push(item?);
        }
        Ok(out)
    }
}

impl<A> ActorRef<A> {
    pub(crate) fn new(address: ActorAddress, process: Arc<Process>) -> Self {
        Self {
            address: Arc::new(address),
            process,
            _actor: PhantomData,
        }
    }

    /// Where the actor lives (id, type, process address, node).
    pub fn address(&self) -> &ActorAddress {
        &self.address
    }

    /// The actor's cluster-unique id.
    pub fn id(&self) -> u64 {
        self.address.id
    }

    fn untyped(&self) -> ActorRef<()> {
        ActorRef {
            address: self.address.clone(),
            process: self.process.clone(),
            _actor: PhantomData,
        }
    }

    fn label(&self) -> String {
        format!("{} {}", self.address.type_name, self.address.id)
    }

    /// Turns transport-level losses into `ActorDied` naming this actor and its node.
    fn explain(&self, e: Error) -> Error {
        let id = self.address.id;
        match e {
            Error::Lost { reason, .. } | Error::Unreachable { reason, .. } => {
                let (node, reason) = match self.process.fates.get(&id).map(|f| f.clone()) {
                    Some(Fate::Dead { node, reason }) => (node, reason),
                    _ => (self.current().node, reason),
                };
                Error::ActorDied {
                    actor: self.label(),
                    id: self.address.id,
                    node,
                    reason,
                }
            }
            Error::Remote { message, .. } => Error::Remote {
                actor: self.label(),
                message,
            },
            other => other,
        }
    }

    fn current(&self) -> ActorAddress {
        self.process
            .moved
            .get(&self.address.id)
            .map(|a| a.clone())
            .unwrap_or_else(|| (*self.address).clone())
    }

    /// Where to send now: fails at once for a dead actor, waits while it restarts.
    async fn target(&self) -> Result<SocketAddr> {
        let id = self.address.id;
        let deadline = Instant::now() + RESTART_WAIT;
        loop {
            match self.process.fates.get(&id).map(|f| f.clone()) {
                Some(Fate::Dead { node, reason }) => {
                    return Err(Error::ActorDied {
                        actor: self.label(),
                        id: self.address.id,
                        node,
                        reason,
                    })
                }
                Some(Fate::Restarting) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                Some(Fate::Restarting) => {
                    return Err(Error::ActorDied {
                        actor: self.label(),
                        id: self.address.id,
                        node: self.current().node,
                        reason: format!("still restarting after {RESTART_WAIT:?}"),
                    })
                }
                None => break,
            }
        }
        let addr = self.current().addr;
        addr.parse()
            .map_err(|_| Error::Codec(format!("actor {} has a bad address `{addr}`", self.label())))
    }

    async fn send(
        &self,
        msg: &str,
        kind: CallKind,
        payload: rkyv::util::AlignedVec,
    ) -> Result<ReplyHandle> {
        let target = self.target().await?;
        let request = self
            .process
            .request(target, self.address.id, msg, kind, payload);
        let handle = self
            .unless_dead(request)
            .await
            .map_err(|e| self.explain(e))?;
        // A death learned while the request was being queued would otherwise leave it pending.
        if let Some(Fate::Dead { node, reason }) =
            self.process.fates.get(&self.address.id).map(|f| f.clone())
        {
            return Err(Error::ActorDied {
                actor: self.label(),
                id: self.address.id,
                node,
                reason,
            });
        }
        Ok(handle)
    }

    /// Runs `request`, ending it with `ActorDied` as soon as this process learns that the actor died or is
    /// restarting (guarantee 5): opening a connection to a process whose host is cut off would otherwise wait for
    /// the QUIC idle timeout. A request that is ready at once never starts the check's timer.
    async fn unless_dead<T>(
        &self,
        request: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let mut request = std::pin::pin!(request);
        if let std::task::Poll::Ready(done) = futures::poll!(&mut request) {
            return done;
        }
        loop {
            if let Ok(done) = tokio::time::timeout(FATE_POLL, &mut request).await {
                return done;
            }
            let fate = self.process.fates.get(&self.address.id).map(|f| f.clone());
            let (node, reason) = match fate {
                None => continue,
                Some(Fate::Dead { node, reason }) => (node, reason),
                Some(Fate::Restarting) => (
                    self.current().node,
                    "it is restarting; the request was still waiting for a connection".into(),
                ),
            };
            return Err(Error::ActorDied {
                actor: self.label(),
                id: self.address.id,
                node,
                reason,
            });
        }
    }
}

/// A call on its way: await it for the reply, or give it a deadline with [`Call::timeout`]. Nothing is sent until
/// it is first polled.
#[must_use = "a call does nothing until it is awaited"]
pub struct Call<'a, R> {
    actor: ActorRef<()>,
    message: &'static str,
    reply: BoxFuture<'a, Result<R>>,
}

impl<R> Future for Call<'_, R> {
    type Output = Result<R>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<R>> {
        self.get_mut().reply.as_mut().poll(cx)
    }
}

impl<'a, R: Send + 'a> Call<'a, R> {
    /// The reply, or [`Error::Timeout`] (naming the actor, its node and the message) when none came within
    /// `after`. The actor may still handle the message; its late reply is dropped.
    pub async fn timeout(self, after: Duration) -> Result<R> {
        match tokio::time::timeout(after, self.reply).await {
            Ok(reply) => reply,
            Err(_) => Err(Error::Timeout {
                actor: self.actor.label(),
                node: self.actor.current().node,
                message: self.message.to_string(),
                after,
            }),
        }
    }
}

impl<A: Actor> ActorRef<A> {
    /// Sends `msg` and waits for the reply; `.timeout(d)` bounds the wait ([`Call::timeout`]).
    pub fn call<M: Message>(&self, msg: M) -> Call<'_, M::Reply>
    where
        A: Handler<M>,
    {
        let payload = msg.to_wire();
        Call {
            actor: self.untyped(),
            message: M::NAME,
            reply: Box::pin(async move {
                let handle = self.send(M::NAME, CallKind::Call, payload?).await?;
                let bytes = handle.once().await.map_err(|e| self.explain(e))?;
                Ok(M::Reply::from_wire_owned(bytes)?)
            }),
        }
    }

    /// The node this actor lives on now (it changes when a restart moves it).
    pub fn node(&self) -> String {
        self.current().node
    }

    /// The actor's type and id, as errors name it (`ferl_runtime::testbed::Counter 7`).
    pub fn name(&self) -> String {
        self.label()
    }

    /// Sends `msg` without waiting for it to be handled (it is queued in order with this sender's other messages).
    pub async fn tell<M: Message>(&self, msg: M) -> Result<()>
    where
        A: Handler<M>,
    {
        self.send(M::NAME, CallKind::Tell, msg.to_wire()?)
            .await
            .map(|_| ())
    }

    /// Sends `msg` and returns the stream of items the actor answers with.
    pub async fn stream<M: StreamMessage>(&self, msg: M) -> Result<ReplyStream<M::Item>>
    where
        A: StreamHandler<M>,
    {
        let handle = self.send(M::NAME, CallKind::Stream, msg.to_wire()?).await?;
        Ok(ReplyStream {
            handle,
            actor: self.untyped(),
            _item: PhantomData,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::Context;
    use crate::protocol::Event;
    use crate::security::tls::ClusterCa;

    /// An actor of this layer's own (the test actors of `testbed` sit above it); never started here.
    struct Counter;
    #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug)]
    struct Get;
    crate::message!(Get => u64);
    impl Actor for Counter {
        type Args = ();
        async fn start(_: (), _: &Context) -> anyhow::Result<Self> {
            Ok(Counter)
        }
    }
    impl Handler<Get> for Counter {
        async fn handle(&self, _: Get, _: &Context) -> anyhow::Result<u64> {
            Ok(0)
        }
    }
    crate::actor_dispatch!(Counter, calls: [Get]);

    /// Guarantee 5: a call whose connection is still opening (its host is cut off, nothing answers) fails with
    /// `ActorDied` as soon as this process learns the actor died, not after the QUIC idle timeout.
    #[tokio::test]
    async fn guarantee_5_a_call_still_connecting_fails_when_the_actor_dies() {
        let creds = ClusterCa::mint().unwrap().issue("driver").unwrap();
        let bind = "127.0.0.1:0".parse().unwrap();
        let process =
            Process::start(creds, bind, Duration::from_secs(30), Default::default()).unwrap();
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let address = ActorAddress {
            id: 7,
            type_name: Counter::NAME.into(),
            addr: silent.local_addr().unwrap().to_string(),
            node: "node-9".into(),
        };
        let actor = ActorRef::<Counter>::new(address, process.clone());
        let call = tokio::spawn(async move { actor.call(Get).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!call.is_finished(), "nothing answers, so the call waits");
        process.apply_event(&Event::ActorDied {
            id: 7,
            type_name: Counter::NAME.into(),
            node: "node-9".into(),
            reason: "node node-9 missed heartbeats".into(),
        });
        let outcome = tokio::time::timeout(Duration::from_secs(2), call)
            .await
            .expect("the call still waits for its connection")
            .unwrap();
        match outcome {
            Err(Error::ActorDied { node, reason, .. }) => {
                assert_eq!(node, "node-9");
                assert!(reason.contains("missed heartbeats"), "{reason}");
            }
            other => panic!("expected ActorDied, got {other:?}"),
        }
    }
}
