//! The caller's side of the transport: one connection per peer process, its call stream (on QUIC or a same-host
//! lane), the calls waiting for replies, and the tells paused by the callee.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{Context as _, Result};
use dashmap::DashMap;
use rkyv::rancor;
use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, BufReader};
use tokio::sync::{mpsc, oneshot, OnceCell};

use super::lane;
use super::streams::{BodyReader, Got};
use super::{close, next_frame, Outbox, StreamEnd, LANE_ASK, LANE_GRACE};
use crate::codec::{encode_frame, read_frame};
use crate::protocol::{ArchivedFrame, Body, CallKind, Frame, RemoteError};
use crate::security::tls;
use crate::transport::bulk::{self, BulkInbox};
use crate::transport::config::TransportConfig;
use crate::transport::error::Error;

/// A caller waiting for an answer.
enum Pending {
    Once(u64, oneshot::Sender<Result<AlignedVec, Error>>),
    Stream(u64, mpsc::UnboundedSender<Result<AlignedVec, Error>>),
}

/// What a request returns: a single reply, a stream of items, or nothing (`tell`).
pub(crate) enum ReplyHandle {
    Once(oneshot::Receiver<Result<AlignedVec, Error>>),
    Stream(mpsc::UnboundedReceiver<Result<AlignedVec, Error>>),
    LocalOnce(oneshot::Receiver<Result<AlignedVec, RemoteError>>),
    LocalStream(mpsc::Receiver<Result<AlignedVec, RemoteError>>),
    None,
}

/// An outgoing connection to one peer process, with its call stream.
pub(crate) struct PeerConn {
    addr: SocketAddr,
    conn: quinn::Connection,
    out: Outbox,
    pending: DashMap<u64, Pending>,
    next_req: AtomicU64,
    /// Actors whose callee paused our tells (guarantee 3).
    paused: std::sync::Mutex<std::collections::HashMap<u64, Paused>>,
}

/// One actor's pause state on a connection: the latest pause and the latest resume seen (they may arrive in
/// either order), and the tells waiting for the resume.
#[derive(Default)]
struct Paused {
    paused_at: u64,
    resumed_upto: u64,
    wake: Arc<tokio::sync::Notify>,
}

impl PeerConn {
    async fn open(
        endpoint: &quinn::Endpoint,
        addr: SocketAddr,
        cfg: TransportConfig,
    ) -> Result<Arc<Self>> {
        let conn = endpoint
            .connect(addr, tls::CLUSTER_SERVER_NAME)?
            .await
            .with_context(|| format!("connecting to cluster process {addr}"))?;
        let (mut send, recv) = conn.open_bi().await?;
        let mut recv = BufReader::with_capacity(64 << 10, recv);
        let lane = match ask_for_lane(&mut send, &mut recv, &cfg).await {
            Ok(stream) => Some(stream),
            Err(reason) => {
                tracing::debug!("calls to {addr} stay on QUIC: {reason}");
                None
            }
        };
        let inbox = Arc::new(BulkInbox::new(cfg.bulk));
        bulk::spawn_bulk_reader(conn.clone(), inbox.clone());
        let new = |out| {
            Arc::new(Self {
                addr,
                conn: conn.clone(),
                out,
                pending: DashMap::new(),
                next_req: AtomicU64::new(1),
                paused: Default::default(),
            })
        };
        let peer = match lane {
            Some(stream) => {
                let _ = send.finish();
                let (read, write) = stream.into_split();
                let peer = new(Outbox::start(write, &conn, cfg.shm_bytes));
                let reader = BufReader::with_capacity(64 << 10, read);
                tokio::spawn(read_replies(peer.clone(), reader, inbox, cfg, true));
                peer
            }
            None => {
                let peer = new(Outbox::start(send, &conn, cfg.shm_bytes));
                tokio::spawn(read_replies(peer.clone(), recv, inbox, cfg, false));
                peer
            }
        };
        Ok(peer)
    }

    /// The connection is closed (the peer process is gone or misbehaved).
    pub(crate) fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }

    /// Resolves when the connection closes.
    pub(crate) async fn closed(&self) {
        self.conn.closed().await;
    }

    /// Sends a request to `actor` in the peer process.
    pub(crate) async fn request(
        &self,
        actor: u64,
        msg: &str,
        kind: CallKind,
        payload: AlignedVec,
    ) -> Result<ReplyHandle, Error> {
        if matches!(kind, CallKind::Tell) {
            self.wait_unpaused(actor).await;
        }
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let handle = match kind {
            CallKind::Tell => ReplyHandle::None,
            CallKind::Call => {
                let (tx, rx) = oneshot::channel();
                self.pending.insert(req, Pending::Once(actor, tx));
                ReplyHandle::Once(rx)
            }
            CallKind::Stream => {
                let (tx, rx) = mpsc::unbounded_channel();
                self.pending.insert(req, Pending::Stream(actor, tx));
                ReplyHandle::Stream(rx)
            }
        };
        let frame = Frame::Call {
            req,
            actor,
            msg: msg.to_string(),
            kind,
            body: Body::Inline(0),
        };
        if let Err(e) = self.out.frame(frame, Some(payload)).await {
            self.pending.remove(&req);
            return Err(Error::Lost {
                actor,
                reason: e.to_string(),
            });
        }
        if self.is_closed() {
            self.fail_all(&self.close_text());
        }
        Ok(handle)
    }

    /// Waits while the callee has paused tells to `actor` (or until the connection closes).
    async fn wait_unpaused(&self, actor: u64) {
        loop {
            let wake = match self.paused.lock().expect("pause lock").get(&actor) {
                Some(p) if p.paused_at > p.resumed_upto => p.wake.clone(),
                _ => return,
            };
            let woken = wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let still = matches!(
                self.paused.lock().expect("pause lock").get(&actor),
                Some(p) if p.paused_at > p.resumed_upto
            );
            if !still {
                return;
            }
            tokio::select! {
                _ = woken => {}
                _ = self.conn.closed() => return,
            }
        }
    }

    /// Records a pause or resume of tells to `actor` from the callee.
    fn flow(&self, actor: u64, pause: Option<u64>, resume: Option<u64>) {
        let mut paused = self.paused.lock().expect("pause lock");
        let p = paused.entry(actor).or_default();
        if let Some(epoch) = pause {
            p.paused_at = p.paused_at.max(epoch);
        }
        if let Some(epoch) = resume {
            p.resumed_upto = p.resumed_upto.max(epoch);
        }
        if p.paused_at <= p.resumed_upto {
            p.wake.notify_waiters();
        }
    }

    fn close_text(&self) -> String {
        match self.conn.close_reason() {
            Some(r) => format!("connection to {} lost: {r}", self.addr),
            None => format!("connection to {} lost", self.addr),
        }
    }

    fn fail_all(&self, reason: &str) {
        let reqs: Vec<u64> = self.pending.iter().map(|e| *e.key()).collect();
        for req in reqs {
            self.fail(req, reason);
        }
    }

    fn fail(&self, req: u64, reason: &str) {
        match self.pending.remove(&req).map(|(_, p)| p) {
            Some(Pending::Once(actor, tx)) => {
                let _ = tx.send(Err(Error::Lost {
                    actor,
                    reason: reason.to_string(),
                }));
            }
            Some(Pending::Stream(actor, tx)) => {
                let _ = tx.send(Err(Error::Lost {
                    actor,
                    reason: reason.to_string(),
                }));
            }
            None => {}
        }
    }

    /// Fails every pending call to `actor` (it died).
    pub(crate) fn fail_actor(&self, actor: u64, reason: &str) {
        let reqs: Vec<u64> = self
            .pending
            .iter()
            .filter(
                |e| matches!(e.value(), Pending::Once(a, _) | Pending::Stream(a, _) if *a == actor),
            )
            .map(|e| *e.key())
            .collect();
        for req in reqs {
            self.fail(req, reason);
        }
    }
}

/// Asks the callee for a same-host lane on a new connection's call stream and connects to it.
async fn ask_for_lane<R: AsyncRead + Unpin>(
    send: &mut quinn::SendStream,
    recv: &mut R,
    cfg: &TransportConfig,
) -> Result<tokio::net::UnixStream, String> {
    let mut ask = Vec::new();
    encode_frame(&Frame::LaneAsk, &mut ask).map_err(|e| e.to_string())?;
    send.write_all(&ask).await.map_err(|e| e.to_string())?;
    let mut buf = AlignedVec::new();
    match tokio::time::timeout(LANE_ASK, read_frame(recv, cfg.max_frame, &mut buf)).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => return Err("the callee closed the call stream".into()),
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("no answer to the lane request".into()),
    }
    match rkyv::access::<ArchivedFrame, rancor::Error>(&buf) {
        Ok(ArchivedFrame::LaneOffer { pid, name, nonce }) => {
            lane::connect(pid.to_native(), name.as_str(), nonce.as_slice(), cfg.lanes).await
        }
        Ok(_) => Err("the callee answered the lane request with another frame".into()),
        Err(e) => Err(format!("malformed lane offer: {e}")),
    }
}

/// Reads the replies of one call stream (`lane`: a same-host lane rather than QUIC) until it ends, then fails what
/// is still pending once the connection is closed.
async fn read_replies<R: AsyncRead + Unpin>(
    peer: Arc<PeerConn>,
    mut reader: R,
    inbox: Arc<BulkInbox>,
    cfg: TransportConfig,
    lane: bool,
) {
    let max_frame = cfg.max_frame;
    let mut bodies = BodyReader::new(inbox, &cfg);
    let mut buf = AlignedVec::new();
    let closed = peer.conn.closed();
    tokio::pin!(closed);
    loop {
        let frame = match next_frame(&mut reader, max_frame, &mut buf, closed.as_mut()).await {
            Ok(f) => f,
            Err(StreamEnd::Ended(why)) => {
                tracing::debug!("reply stream from {} ended: {why}", peer.addr);
                break;
            }
            Err(StreamEnd::Bad(reason)) => {
                close(&peer.conn, &reason);
                break;
            }
        };
        if let Err(reason) = handle_reply(&peer, frame, &mut reader, &mut bodies).await {
            close(&peer.conn, &reason);
            break;
        }
    }
    if lane
        && tokio::time::timeout(LANE_GRACE, peer.conn.closed())
            .await
            .is_err()
    {
        close(&peer.conn, "its same-host lane closed");
    }
    let reason = peer.conn.closed().await;
    peer.fail_all(&format!("connection to {} lost: {reason}", peer.addr));
}

/// Handles one frame of a reply stream; an error closes the connection with that reason.
async fn handle_reply<R: tokio::io::AsyncRead + Unpin>(
    peer: &PeerConn,
    frame: &ArchivedFrame,
    reader: &mut R,
    bodies: &mut BodyReader,
) -> Result<(), String> {
    match frame {
        ArchivedFrame::Reply { req, body } => {
            let got = bodies
                .read(reader, body.to_native())
                .await
                .map_err(|e| e.to_string())?;
            let Some((_, Pending::Once(_, tx))) = peer.pending.remove(&req.to_native()) else {
                return Ok(());
            };
            match got {
                Got::Here(bytes) => {
                    let _ = tx.send(Ok(bytes));
                }
                Got::Bulk(id) => {
                    let rx = bodies.inbox.wait(id);
                    tokio::spawn(async move {
                        let r = rx
                            .await
                            .map_err(|_| Error::Transport("bulk reply stream failed".into()));
                        let _ = tx.send(r);
                    });
                }
            }
        }
        ArchivedFrame::Item { req, body } => {
            let got = bodies
                .read(reader, body.to_native())
                .await
                .map_err(|e| e.to_string())?;
            let Got::Here(bytes) = got else {
                return Err("a stream item on a bulk stream".into());
            };
            if let Some(p) = peer.pending.get(&req.to_native()) {
                if let Pending::Stream(_, tx) = p.value() {
                    let _ = tx.send(Ok(bytes));
                }
            }
        }
        ArchivedFrame::End { req, error } => {
            let error = rkyv::deserialize::<Option<RemoteError>, rancor::Error>(error)
                .map_err(|e| format!("malformed error in frame: {e}"))?;
            match peer.pending.remove(&req.to_native()).map(|(_, p)| p) {
                Some(Pending::Once(actor, tx)) => {
                    let _ = tx.send(Err(Error::from_remote(actor, error)));
                }
                Some(Pending::Stream(actor, tx)) => {
                    if let Some(e) = error {
                        let _ = tx.send(Err(Error::from_remote(actor, Some(e))));
                    }
                }
                None => {}
            }
        }
        ArchivedFrame::ShmOffer { .. } => bodies.offer(frame, &peer.out).await,
        ArchivedFrame::ShmAnswer { accepted, .. } => peer.out.link.answered(*accepted),
        ArchivedFrame::Pause { actor, epoch } => {
            peer.flow(actor.to_native(), Some(epoch.to_native()), None)
        }
        ArchivedFrame::Resume { actor, epoch } => {
            peer.flow(actor.to_native(), None, Some(epoch.to_native()))
        }
        ArchivedFrame::Call { .. } | ArchivedFrame::LaneAsk | ArchivedFrame::LaneOffer { .. } => {
            return Err("unexpected call or lane frame on a reply stream".into())
        }
    }
    Ok(())
}

/// This process's outgoing connections, one per peer, opened on first use.
pub(crate) struct Connections {
    endpoint: quinn::Endpoint,
    peers: DashMap<SocketAddr, Arc<OnceCell<Arc<PeerConn>>>>,
    cfg: TransportConfig,
}

impl Connections {
    /// No connection yet; each one opened from `endpoint` follows `cfg`.
    pub(crate) fn new(endpoint: quinn::Endpoint, cfg: TransportConfig) -> Self {
        Self {
            endpoint,
            peers: DashMap::new(),
            cfg,
        }
    }

    /// The connection to `addr`, opening it if needed (or if the previous one closed).
    pub(crate) async fn get(&self, addr: SocketAddr) -> Result<Arc<PeerConn>, Error> {
        for _ in 0..2 {
            let cell = self.peers.entry(addr).or_default().clone();
            let peer = cell
                .get_or_try_init(|| PeerConn::open(&self.endpoint, addr, self.cfg))
                .await
                .map_err(|e| {
                    self.peers.remove_if(&addr, |_, c| Arc::ptr_eq(c, &cell));
                    Error::Unreachable {
                        addr: addr.to_string(),
                        reason: format!("{e:#}"),
                    }
                })?
                .clone();
            if !peer.is_closed() {
                return Ok(peer);
            }
            self.peers.remove_if(&addr, |_, c| Arc::ptr_eq(c, &cell));
        }
        Err(Error::Unreachable {
            addr: addr.to_string(),
            reason: "connection closed".into(),
        })
    }

    /// Fails pending calls to `actor` on every connection.
    pub(crate) fn fail_actor(&self, actor: u64, reason: &str) {
        for peer in self.peers.iter() {
            if let Some(p) = peer.value().get() {
                p.fail_actor(actor, reason);
            }
        }
    }

    /// Drops the cached connection to `addr` (its process is gone).
    pub(crate) fn forget(&self, addr: SocketAddr) {
        if let Some((_, cell)) = self.peers.remove(&addr) {
            if let Some(p) = cell.get() {
                p.conn.close(0u32.into(), b"peer gone");
            }
        }
    }
}
