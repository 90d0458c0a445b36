//! One cluster process (head, node agent, worker or driver): its endpoint, its outgoing connections, the actors it
//! hosts, and what it has learned about actor deaths and restarts from the head's event stream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Result;
use dashmap::DashMap;
use futures::future::BoxFuture;
use rkyv::util::AlignedVec;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::actor::host::{run_mailbox, Mailbox, Offered};
use crate::actor::{AnyActor, Context, Dispatch, Dispatchable, Message, StreamMessage};
use crate::codec::Wire;
use crate::protocol::{ActorAddress, CallKind, Event, RemoteError, RemoteErrorKind, Subscribe};
use crate::security::tls::Credentials;
use crate::transport::config::TransportConfig;
use crate::transport::delivery::{Envelope, Payload, Responder};
use crate::transport::error::Error;
use crate::transport::{self, Connections, Inbound, Lanes, ReplyHandle};

/// Well-known actor id of the head service (in the head process).
pub(crate) const HEAD_ACTOR: u64 = 1;
/// Well-known actor id of the node agent service (in each node agent process).
pub(crate) const NODE_ACTOR: u64 = 2;
/// Well-known actor id of the binary server (in each driver process).
pub(crate) const BINARY_ACTOR: u64 = 3;
/// Well-known actor id of the object service (in owners of objects and in each node agent; `objects.rs`).
pub(crate) const OBJECT_ACTOR: u64 = 4;
/// Ids of actors hosted only in-process start here (head-assigned ids are small).
const LOCAL_ID_BASE: u64 = 1 << 62;

/// What this process knows about an actor that is not simply alive.
#[derive(Clone, Debug)]
pub(crate) enum Fate {
    Restarting,
    Dead { node: String, reason: String },
}

/// Handles the join handshake (head only).
pub(crate) type JoinHandler =
    Arc<dyn Fn(quinn::Connection) -> BoxFuture<'static, ()> + Send + Sync>;

/// A process of the cluster.
pub(crate) struct Process {
    pub(crate) addr: SocketAddr,
    pub(crate) endpoint: quinn::Endpoint,
    pub(crate) conns: Connections,
    pub(crate) creds: Credentials,
    actors: DashMap<u64, Arc<Mailbox>>,
    pub(crate) fates: DashMap<u64, Fate>,
    pub(crate) moved: DashMap<u64, ActorAddress>,
    pub(crate) events: broadcast::Sender<Event>,
    pub(crate) head: OnceLock<SocketAddr>,
    /// The node agent this process belongs to (address, node name); its own address in a node agent.
    pub(crate) node: OnceLock<(SocketAddr, String)>,
    /// State a layer above keeps per process (the control layer's object store), made on first use.
    upper: OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    join: OnceLock<JoinHandler>,
    next_local: AtomicU64,
}

impl Process {
    /// The state a layer above keeps in this process (one type per process: the control layer's object store),
    /// made with `T::default()` on first use and dropped with the process. This is how the actor layer holds it
    /// without knowing its type.
    pub(crate) fn upper_state<T: Default + Send + Sync + 'static>(&self) -> &T {
        self.upper
            .get_or_init(|| Box::new(T::default()))
            .downcast_ref()
            .expect("a process keeps one type of upper-layer state")
    }

    /// Starts a process endpoint bound to `bind` with cluster credentials; its connections follow `config`.
    pub(crate) fn start(
        creds: Credentials,
        bind: SocketAddr,
        idle: Duration,
        config: TransportConfig,
    ) -> Result<Arc<Self>> {
        let endpoint = transport::endpoint(&creds, bind, idle)?;
        let addr = endpoint.local_addr()?;
        let process = Arc::new(Self {
            addr,
            conns: Connections::new(endpoint.clone(), config),
            endpoint: endpoint.clone(),
            creds,
            actors: DashMap::new(),
            fates: DashMap::new(),
            moved: DashMap::new(),
            events: broadcast::channel(1024).0,
            head: OnceLock::new(),
            node: OnceLock::new(),
            upper: OnceLock::new(),
            join: OnceLock::new(),
            next_local: AtomicU64::new(LOCAL_ID_BASE),
        });
        let inbound: Arc<dyn Inbound> = process.clone();
        let lanes = Lanes::start(inbound.clone(), config);
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                tokio::spawn(transport::serve_connection(
                    incoming,
                    inbound.clone(),
                    lanes.clone(),
                    config,
                ));
            }
            lanes.stop();
        });
        Ok(process)
    }

    /// Accept joins on this process (the head).
    pub(crate) fn accept_joins(&self, handler: JoinHandler) {
        let _ = self.join.set(handler);
    }

    /// The head's address.
    pub(crate) fn head_addr(&self) -> Result<SocketAddr, Error> {
        self.head
            .get()
            .copied()
            .ok_or_else(|| Error::Cluster("this process is not connected to a head".into()))
    }

    /// A fresh id for an in-process-only actor.
    pub(crate) fn local_id(&self) -> u64 {
        self.next_local.fetch_add(1, Ordering::Relaxed)
    }

    /// Hosts an already built actor under `id`.
    pub(crate) fn host_any(
        self: &Arc<Self>,
        id: u64,
        actor: AnyActor,
        dispatch: &'static Dispatch,
        conc: usize,
        mailbox: usize,
    ) {
        let ctx = Context {
            actor_id: id,
            process: self.clone(),
        };
        self.actors
            .insert(id, run_mailbox(actor, dispatch, ctx, conc, mailbox));
    }

    /// Hosts a typed actor under `id`.
    pub(crate) fn host<A: Dispatchable>(
        self: &Arc<Self>,
        id: u64,
        actor: A,
        conc: usize,
        mailbox: usize,
    ) {
        self.host_any(id, Arc::new(actor), A::dispatch(), conc, mailbox);
    }

    /// Stops hosting `id` (its mailbox task ends after draining).
    pub(crate) fn unhost(&self, id: u64) {
        self.actors.remove(&id);
    }

    /// Sends a request to actor `id` in the process at `addr` (possibly this one).
    pub(crate) async fn request(
        &self,
        addr: SocketAddr,
        id: u64,
        msg: &str,
        kind: CallKind,
        payload: AlignedVec,
    ) -> Result<ReplyHandle, Error> {
        if addr != self.addr {
            return self
                .conns
                .get(addr)
                .await?
                .request(id, msg, kind, payload)
                .await;
        }
        let (reply, handle) = match kind {
            CallKind::Tell => (Responder::Nobody, ReplyHandle::None),
            CallKind::Call => {
                let (tx, rx) = oneshot::channel();
                (Responder::Local(tx), ReplyHandle::LocalOnce(rx))
            }
            CallKind::Stream => {
                let (tx, rx) = mpsc::channel(64);
                (Responder::LocalStream(tx), ReplyHandle::LocalStream(rx))
            }
        };
        let env = Envelope {
            msg: msg.to_string(),
            kind,
            payload: Payload::Ready(payload),
            reply,
        };
        let mailbox = self.actors.get(&id).map(|m| m.clone());
        match mailbox {
            Some(m) if m.send_local(env).await.is_ok() => Ok(handle),
            _ => Err(Error::Lost {
                actor: id,
                reason: format!("no actor {id} is hosted in process {}", self.addr),
            }),
        }
    }

    /// Calls a typed message on actor `id` at `addr` and waits for the reply.
    pub(crate) async fn call_at<M: Message>(
        &self,
        addr: SocketAddr,
        id: u64,
        msg: &M,
    ) -> Result<M::Reply, Error> {
        let handle = self
            .request(addr, id, M::NAME, CallKind::Call, msg.to_wire()?)
            .await?;
        let bytes = handle.once().await?;
        Ok(M::Reply::from_wire_owned(bytes)?)
    }

    /// Calls the head service.
    pub(crate) async fn call_head<M: Message>(&self, msg: &M) -> Result<M::Reply, Error> {
        let head = self.head_addr()?;
        self.call_at(head, HEAD_ACTOR, msg)
            .await
            .map_err(|e| match e {
                Error::Remote { message, .. } => Error::Cluster(strip_service_prefix(message)),
                Error::Infeasible { message } => Error::Infeasible {
                    message: strip_service_prefix(message),
                },
                Error::Busy { message } => Error::Busy {
                    message: strip_service_prefix(message),
                },
                Error::Lost { reason, .. } => {
                    Error::Cluster(format!("head at {head} lost: {reason}"))
                }
                other => other,
            })
    }

    /// Opens a stream of typed items from actor `id` at `addr`.
    pub(crate) async fn stream_at<M: StreamMessage>(
        &self,
        addr: SocketAddr,
        id: u64,
        msg: &M,
    ) -> Result<ReplyHandle, Error> {
        self.request(addr, id, M::NAME, CallKind::Stream, msg.to_wire()?)
            .await
    }

    /// Records a cluster event: fails pending calls to dead actors, remembers new addresses, tells subscribers.
    pub(crate) fn apply_event(&self, event: &Event) {
        match event {
            Event::ActorDied {
                id, node, reason, ..
            } => {
                self.fates.insert(
                    *id,
                    Fate::Dead {
                        node: node.clone(),
                        reason: reason.clone(),
                    },
                );
                self.conns.fail_actor(*id, reason);
            }
            Event::ActorRestarting { id, reason, .. } => {
                self.fates.insert(*id, Fate::Restarting);
                self.conns.fail_actor(*id, reason);
            }
            Event::ActorRestarted { actor } => {
                self.moved.insert(actor.id, actor.clone());
                self.fates.remove(&actor.id);
            }
            Event::NodeJoined { .. } | Event::NodeDied { .. } => {}
        }
        let _ = self.events.send(event.clone());
    }

    /// Follows the head's event stream for the life of the process.
    pub(crate) async fn follow_head_events(self: &Arc<Self>) -> Result<(), Error> {
        let head = self.head_addr()?;
        let mut stream = self.stream_at(head, HEAD_ACTOR, &Subscribe).await?;
        let process = self.clone();
        tokio::spawn(async move {
            while let Some(item) = stream.next().await {
                match item.and_then(|b| Event::from_wire(&b).map_err(Error::from)) {
                    Ok(event) => process.apply_event(&event),
                    Err(e) => {
                        tracing::debug!("event stream from the head ended: {e}");
                        break;
                    }
                }
            }
        });
        Ok(())
    }

    /// Closes the endpoint (all connections).
    pub(crate) fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutdown");
    }
}

/// Drops the "actor ferl.X (n) failed on ferl.Y: " prefix of errors from the runtime's own services.
fn strip_service_prefix(message: String) -> String {
    if message.starts_with("actor ferl.") {
        if let Some((_, rest)) = message.split_once(": ") {
            return strip_service_prefix(rest.to_string());
        }
    }
    message
}

impl Inbound for Process {
    fn deliver(&self, actor: u64, env: Envelope) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let mailbox = self.actors.get(&actor).map(|m| m.clone());
            let (env, error) = match mailbox {
                Some(m) => match m.offer(env) {
                    Offered::Queued => return,
                    Offered::Pause(sender, pause) => {
                        let _ = sender.frame(pause, None).await;
                        return;
                    }
                    Offered::Closed(env) => (env, None),
                    Offered::Full(env) => {
                        let message = format!(
                            "mailbox full: actor {actor} in process {} already holds {} messages and {} more \
                             wait for room; retry later or raise its mailbox (SpawnOptions::mailbox)",
                            self.addr,
                            m.capacity(),
                            m.capacity()
                        );
                        (env, Some(message))
                    }
                },
                None => (env, None),
            };
            let (kind, message) = match error {
                Some(message) => (RemoteErrorKind::Handler, message),
                None => (
                    RemoteErrorKind::NoSuchActor,
                    format!("no actor {actor} is hosted in process {}", self.addr),
                ),
            };
            env.reply.finish(Err(RemoteError { kind, message })).await;
        })
    }

    fn join(&self, conn: quinn::Connection) -> BoxFuture<'static, ()> {
        match self.join.get() {
            Some(handler) => handler(conn),
            None => Box::pin(async move {
                tracing::warn!(peer = %conn.remote_address(), "refused a connection without a cluster certificate");
                conn.close(
                    2u32.into(),
                    b"no cluster certificate: join through the head with the cluster token",
                );
            }),
        }
    }
}

impl ReplyHandle {
    /// Waits for a single reply.
    pub(crate) async fn once(self) -> Result<AlignedVec, Error> {
        match self {
            ReplyHandle::Once(rx) => rx
                .await
                .unwrap_or_else(|_| Err(Error::Transport("reply channel dropped".into()))),
            ReplyHandle::LocalOnce(rx) => match rx.await {
                Ok(Ok(bytes)) => Ok(bytes),
                Ok(Err(e)) => Err(Error::from_remote(0, Some(e))),
                Err(_) => Err(Error::Lost {
                    actor: 0,
                    reason: "actor stopped before replying".into(),
                }),
            },
            _ => Err(Error::Transport("no reply expected".into())),
        }
    }

    /// The next stream item; `None` at the end.
    pub(crate) async fn next(&mut self) -> Option<Result<AlignedVec, Error>> {
        match self {
            ReplyHandle::Stream(rx) => rx.recv().await,
            ReplyHandle::LocalStream(rx) => rx
                .recv()
                .await
                .map(|r| r.map_err(|e| Error::from_remote(0, Some(e)))),
            _ => None,
        }
    }
}
