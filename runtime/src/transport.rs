//! Sockets: one quinn endpoint per process, one persistent connection per (caller process → callee process), one
//! long-lived bidirectional stream on it for calls and replies (so calls from one sender stay in order), batched
//! writes, and separate unidirectional streams for bulk payloads larger than [`BULK_THRESHOLD`].
//!
//! A connection that sends an oversized, wrong-version or malformed frame is closed with the reason logged.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use dashmap::DashMap;
use futures::future::BoxFuture;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rkyv::rancor;
use rkyv::util::AlignedVec;
use tokio::io::BufReader;
use tokio::sync::{mpsc, oneshot, OnceCell};

use crate::error::Error;
use crate::host::{Envelope, Payload, Responder};
use crate::protocol::{ArchivedCallKind, ArchivedFrame, CallKind, Frame, RemoteError};
use crate::tls::{self, Credentials};
use crate::wire::{encode_frame, read_frame, FrameError};

/// Payloads larger than this travel on their own stream.
pub const BULK_THRESHOLD: usize = 4 << 20;
/// Largest bulk payload accepted (4 GiB).
pub const MAX_BULK: u64 = 4 << 30;
const WRITE_BATCH: usize = 256 << 10;

/// What the transport hands incoming traffic to.
pub(crate) trait Inbound: Send + Sync + 'static {
    /// Delivers a call to a hosted actor (waits while its mailbox is full).
    fn deliver(&self, actor: u64, env: Envelope) -> BoxFuture<'_, ()>;
    /// Runs the join handshake on a connection without a cluster certificate (only the head accepts joins).
    fn join(&self, conn: quinn::Connection) -> BoxFuture<'static, ()>;
}

fn transport_config(idle: Duration) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(idle.try_into().expect("idle timeout fits")));
    t.keep_alive_interval(Some(idle / 4));
    t.stream_receive_window((64u32 << 20).into());
    t.receive_window((256u32 << 20).into());
    t.send_window(256 << 20);
    t.max_concurrent_uni_streams(4096u32.into());
    t.max_concurrent_bidi_streams(1024u32.into());
    // Probe up to loopback-sized datagrams; on a 1500-byte path the probes fail and the MTU stays at 1452.
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(65_000);
    t.mtu_discovery_config(Some(mtu));
    t
}

/// Lets peers send datagrams up to loopback size (MTU discovery still finds the real path MTU); with the default
/// 1472-byte cap, pacing limits one connection to a few hundred MB/s.
fn endpoint_config() -> Result<quinn::EndpointConfig> {
    let mut cfg = quinn::EndpointConfig::default();
    cfg.max_udp_payload_size(65_000)?;
    Ok(cfg)
}

/// Asks for large socket buffers so bursts of datagrams are not dropped (the kernel caps them at its maximum).
fn enlarge_buffers(socket: &std::net::UdpSocket) {
    use std::os::fd::AsRawFd;
    let size: libc::c_int = 8 << 20;
    for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: a valid socket descriptor and a pointer to a c_int of the size passed.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(
                "setsockopt({opt}) failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Builds the process's endpoint, listening on `bind`.
pub(crate) fn endpoint(
    creds: &Credentials,
    bind: SocketAddr,
    idle: Duration,
) -> Result<quinn::Endpoint> {
    let transport = Arc::new(transport_config(idle));
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(
        tls::server_config(creds)?,
    )?));
    server.transport_config(transport.clone());
    let socket = std::net::UdpSocket::bind(bind).with_context(|| format!("binding UDP {bind}"))?;
    enlarge_buffers(&socket);
    let runtime = quinn::default_runtime().context("no async runtime for the endpoint")?;
    let mut endpoint = quinn::Endpoint::new(endpoint_config()?, Some(server), socket, runtime)?;
    let mut client = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(
        tls::client_config(creds)?,
    )?));
    client.transport_config(transport);
    endpoint.set_default_client_config(client);
    Ok(endpoint)
}

/// A client config for the join handshake (public so tests can act as a joiner without a certificate).
pub fn join_client_config(idle: Duration) -> Result<quinn::ClientConfig> {
    join_client(idle)
}

/// A client config for the join handshake.
pub(crate) fn join_client(idle: Duration) -> Result<quinn::ClientConfig> {
    let mut client = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(
        tls::join_client_config()?,
    )?));
    client.transport_config(Arc::new(transport_config(idle)));
    Ok(client)
}

/// Bulk payloads that arrived (or are awaited) on one connection, by id.
#[derive(Default)]
struct BulkInbox {
    slots: Mutex<HashMap<u64, BulkSlot>>,
}

enum BulkSlot {
    Waiting(oneshot::Sender<AlignedVec>),
    Arrived(AlignedVec),
}

impl BulkInbox {
    fn wait(&self, id: u64) -> oneshot::Receiver<AlignedVec> {
        let (tx, rx) = oneshot::channel();
        let mut slots = self.slots.lock().expect("bulk inbox lock");
        match slots.remove(&id) {
            Some(BulkSlot::Arrived(bytes)) => {
                let _ = tx.send(bytes);
            }
            _ => {
                slots.insert(id, BulkSlot::Waiting(tx));
            }
        }
        rx
    }
    fn arrive(&self, id: u64, bytes: AlignedVec) {
        let mut slots = self.slots.lock().expect("bulk inbox lock");
        match slots.remove(&id) {
            Some(BulkSlot::Waiting(tx)) => {
                let _ = tx.send(bytes);
            }
            _ => {
                slots.insert(id, BulkSlot::Arrived(bytes));
            }
        }
    }
}

fn close(conn: &quinn::Connection, reason: &str) {
    tracing::warn!(peer = %conn.remote_address(), "closing connection: {reason}");
    conn.close(1u32.into(), reason.as_bytes());
}

/// Reads bulk streams of a connection into its inbox: `[u64 id][u64 len][bytes]`.
fn spawn_bulk_reader(conn: quinn::Connection, inbox: Arc<BulkInbox>) {
    tokio::spawn(async move {
        while let Ok(mut recv) = conn.accept_uni().await {
            let (conn, inbox) = (conn.clone(), inbox.clone());
            tokio::spawn(async move {
                let mut header = [0u8; 16];
                if recv.read_exact(&mut header).await.is_err() {
                    return;
                }
                let id = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
                let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
                if len > MAX_BULK {
                    return close(
                        &conn,
                        &format!("bulk payload of {len} bytes exceeds the maximum of {MAX_BULK}"),
                    );
                }
                let mut bytes = AlignedVec::<16>::with_capacity(len as usize);
                bytes.resize(len as usize, 0);
                if recv.read_exact(bytes.as_mut_slice()).await.is_ok() {
                    inbox.arrive(id, bytes);
                }
            });
        }
    });
}

async fn send_bulk(conn: quinn::Connection, id: u64, bytes: AlignedVec) -> Result<()> {
    let mut send = conn.open_uni().await?;
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&id.to_le_bytes());
    header[8..].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    send.write_all(&header).await?;
    send.write_all(&bytes).await?;
    send.finish()?;
    Ok(())
}

/// What the writer task puts on a call stream: a frame, optionally followed by raw body bytes.
pub(crate) struct Outgoing {
    head: Vec<u8>,
    body: Option<AlignedVec>,
}

/// Drains frames from `rx` into `send`, batching what is queued into one write; large bodies are written as they
/// are, without copying.
async fn write_loop(mut send: quinn::SendStream, mut rx: mpsc::Receiver<Outgoing>) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    let mut next = rx.recv().await;
    while let Some(first) = next.take() {
        batch.clear();
        let mut pending = Some(first);
        let mut big: Option<AlignedVec> = None;
        while let Some(out) = pending.take() {
            batch.extend_from_slice(&out.head);
            match out.body {
                Some(body) if body.len() >= WRITE_BATCH / 4 => {
                    big = Some(body);
                    break;
                }
                Some(body) => batch.extend_from_slice(&body),
                None => {}
            }
            if batch.len() < WRITE_BATCH {
                pending = rx.try_recv().ok();
            }
        }
        if send.write_all(&batch).await.is_err() {
            break;
        }
        if let Some(body) = big {
            if send.write_all(&body).await.is_err() {
                break;
            }
        }
        next = match rx.try_recv() {
            Ok(out) => Some(out),
            Err(_) => rx.recv().await,
        };
    }
    let _ = send.finish();
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
    let mut bytes = AlignedVec::<16>::with_capacity(len as usize);
    bytes.resize(len as usize, 0);
    reader.read_exact(bytes.as_mut_slice()).await?;
    Ok(bytes)
}

/// The sending half of one call stream: frames, stream items, replies and bulk payloads.
#[derive(Clone)]
pub struct Outbox {
    tx: mpsc::Sender<Outgoing>,
    conn: quinn::Connection,
    next_bulk: Arc<AtomicU64>,
}

impl Outbox {
    async fn frame(&self, frame: &Frame, body: Option<AlignedVec>) -> Result<()> {
        let mut head = Vec::with_capacity(64);
        encode_frame(frame, &mut head)?;
        self.tx
            .send(Outgoing { head, body })
            .await
            .map_err(|_| anyhow::anyhow!("connection to {} closed", self.conn.remote_address()))
    }

    fn bulk(&self, bytes: AlignedVec) -> u64 {
        let id = self.next_bulk.fetch_add(1, Ordering::Relaxed) + 1;
        let conn = self.conn.clone();
        tokio::spawn(async move {
            if let Err(e) = send_bulk(conn, id, bytes).await {
                tracing::debug!("bulk stream {id} failed: {e}");
            }
        });
        id
    }

    pub(crate) async fn reply(&self, req: u64, result: Result<AlignedVec, RemoteError>) {
        let _ = match result {
            Ok(body) if body.len() > BULK_THRESHOLD => {
                let bulk = self.bulk(body);
                self.frame(&Frame::Reply { req, bulk, len: 0 }, None).await
            }
            Ok(body) => {
                let len = body.len() as u64;
                self.frame(&Frame::Reply { req, bulk: 0, len }, Some(body))
                    .await
            }
            Err(error) => {
                self.frame(
                    &Frame::End {
                        req,
                        error: Some(error),
                    },
                    None,
                )
                .await
            }
        };
    }

    pub(crate) async fn item(&self, req: u64, body: AlignedVec) -> Result<()> {
        let len = body.len() as u64;
        self.frame(&Frame::Item { req, len }, Some(body)).await
    }

    pub(crate) async fn end(&self, req: u64, error: Option<RemoteError>) {
        let _ = self.frame(&Frame::End { req, error }, None).await;
    }
}

/// Serves one accepted connection: the join handshake when the peer has no cluster certificate, else its call
/// streams and bulk streams.
pub(crate) async fn serve_connection(
    incoming: quinn::Incoming,
    inbound: Arc<dyn Inbound>,
    max_frame: usize,
) {
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => return tracing::debug!("incoming connection failed: {e}"),
    };
    if conn.peer_identity().is_none() {
        return inbound.join(conn).await;
    }
    let inbox = Arc::new(BulkInbox::default());
    spawn_bulk_reader(conn.clone(), inbox.clone());
    while let Ok((send, recv)) = conn.accept_bi().await {
        tokio::spawn(serve_call_stream(
            conn.clone(),
            send,
            recv,
            inbound.clone(),
            inbox.clone(),
            max_frame,
        ));
    }
}

async fn serve_call_stream(
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    inbound: Arc<dyn Inbound>,
    inbox: Arc<BulkInbox>,
    max_frame: usize,
) {
    let (tx, rx) = mpsc::channel(1024);
    tokio::spawn(write_loop(send, rx));
    let out = Outbox {
        tx,
        conn: conn.clone(),
        next_bulk: Arc::new(AtomicU64::new(0)),
    };
    let mut reader = BufReader::with_capacity(64 << 10, recv);
    let mut buf = AlignedVec::new();
    loop {
        match read_frame(&mut reader, max_frame, &mut buf).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(FrameError::Io(e)) => return tracing::debug!("call stream ended: {e}"),
            Err(e) => return close(&conn, &e.to_string()),
        }
        let frame = match rkyv::access::<ArchivedFrame, rancor::Error>(&buf) {
            Ok(f) => f,
            Err(e) => return close(&conn, &format!("malformed frame: {e}")),
        };
        let ArchivedFrame::Call {
            req,
            actor,
            msg,
            kind,
            bulk,
            len,
        } = frame
        else {
            return close(
                &conn,
                "unexpected frame on a call stream (only calls flow this way)",
            );
        };
        let kind = match kind {
            ArchivedCallKind::Tell => CallKind::Tell,
            ArchivedCallKind::Call => CallKind::Call,
            ArchivedCallKind::Stream => CallKind::Stream,
        };
        let (req, actor, bulk, len) = (
            req.to_native(),
            actor.to_native(),
            bulk.to_native(),
            len.to_native(),
        );
        let msg = msg.as_str().to_string();
        let payload = if bulk != 0 {
            Payload::Bulk(inbox.wait(bulk))
        } else {
            match read_body(&mut reader, len, max_frame).await {
                Ok(bytes) => Payload::Ready(bytes),
                Err(FrameError::Io(e)) => return tracing::debug!("call stream ended: {e}"),
                Err(e) => return close(&conn, &e.to_string()),
            }
        };
        let reply = match kind {
            CallKind::Tell => Responder::Nobody,
            _ => Responder::Remote {
                req,
                out: out.clone(),
            },
        };
        let env = Envelope {
            msg,
            kind,
            payload,
            reply,
        };
        inbound.deliver(actor, env).await;
    }
}

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
}

impl PeerConn {
    async fn open(
        endpoint: &quinn::Endpoint,
        addr: SocketAddr,
        max_frame: usize,
    ) -> Result<Arc<Self>> {
        let conn = endpoint
            .connect(addr, tls::CLUSTER_SERVER_NAME)?
            .await
            .with_context(|| format!("connecting to cluster process {addr}"))?;
        let (send, recv) = conn.open_bi().await?;
        let (tx, rx) = mpsc::channel(1024);
        tokio::spawn(write_loop(send, rx));
        let out = Outbox {
            tx,
            conn: conn.clone(),
            next_bulk: Arc::new(AtomicU64::new(0)),
        };
        let peer = Arc::new(Self {
            addr,
            conn: conn.clone(),
            out,
            pending: DashMap::new(),
            next_req: AtomicU64::new(1),
        });
        let inbox = Arc::new(BulkInbox::default());
        spawn_bulk_reader(conn.clone(), inbox.clone());
        tokio::spawn(read_replies(peer.clone(), recv, inbox, max_frame));
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
        let (bulk, len, body) = if payload.len() > BULK_THRESHOLD {
            (self.out.bulk(payload), 0, None)
        } else {
            (0, payload.len() as u64, Some(payload))
        };
        let frame = Frame::Call {
            req,
            actor,
            msg: msg.to_string(),
            kind,
            bulk,
            len,
        };
        if let Err(e) = self.out.frame(&frame, body).await {
            self.pending.remove(&req);
            return Err(Error::Transport(e.to_string()));
        }
        if self.is_closed() {
            self.fail_all(&self.close_text());
        }
        Ok(handle)
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

async fn read_replies(
    peer: Arc<PeerConn>,
    recv: quinn::RecvStream,
    inbox: Arc<BulkInbox>,
    max_frame: usize,
) {
    let mut reader = BufReader::with_capacity(64 << 10, recv);
    let mut buf = AlignedVec::new();
    loop {
        match read_frame(&mut reader, max_frame, &mut buf).await {
            Ok(true) => {}
            Ok(false) => break,
            Err(FrameError::Io(e)) => {
                tracing::debug!("reply stream from {} ended: {e}", peer.addr);
                break;
            }
            Err(e) => {
                close(&peer.conn, &e.to_string());
                break;
            }
        }
        let frame = match rkyv::access::<ArchivedFrame, rancor::Error>(&buf) {
            Ok(f) => f,
            Err(e) => {
                close(&peer.conn, &format!("malformed frame: {e}"));
                break;
            }
        };
        match frame {
            ArchivedFrame::Reply { req, bulk, len } => {
                let (req, bulk, len) = (req.to_native(), bulk.to_native(), len.to_native());
                let body = if bulk == 0 {
                    match read_body(&mut reader, len, max_frame).await {
                        Ok(b) => Some(b),
                        Err(e) => {
                            close(&peer.conn, &e.to_string());
                            break;
                        }
                    }
                } else {
                    None
                };
                let Some((_, Pending::Once(_, tx))) = peer.pending.remove(&req) else {
                    continue;
                };
                match body {
                    Some(bytes) => {
                        let _ = tx.send(Ok(bytes));
                    }
                    None => {
                        let rx = inbox.wait(bulk);
                        tokio::spawn(async move {
                            let r = rx
                                .await
                                .map_err(|_| Error::Transport("bulk reply stream failed".into()));
                            let _ = tx.send(r);
                        });
                    }
                }
            }
            ArchivedFrame::Item { req, len } => {
                let (req, len) = (req.to_native(), len.to_native());
                let bytes = match read_body(&mut reader, len, max_frame).await {
                    Ok(b) => b,
                    Err(e) => {
                        close(&peer.conn, &e.to_string());
                        break;
                    }
                };
                if let Some(p) = peer.pending.get(&req) {
                    if let Pending::Stream(_, tx) = p.value() {
                        let _ = tx.send(Ok(bytes));
                    }
                }
            }
            ArchivedFrame::End { req, error } => {
                let error: Option<RemoteError> =
                    match rkyv::deserialize::<Option<RemoteError>, rancor::Error>(error) {
                        Ok(e) => e,
                        Err(e) => {
                            close(&peer.conn, &format!("malformed error in frame: {e}"));
                            break;
                        }
                    };
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
            ArchivedFrame::Call { .. } => {
                close(&peer.conn, "unexpected call frame on a reply stream");
                break;
            }
        }
    }
    let reason = peer.conn.closed().await;
    peer.fail_all(&format!("connection to {} lost: {reason}", peer.addr));
}

/// This process's outgoing connections, one per peer, opened on first use.
pub(crate) struct Connections {
    endpoint: quinn::Endpoint,
    peers: DashMap<SocketAddr, Arc<OnceCell<Arc<PeerConn>>>>,
    max_frame: usize,
}

impl Connections {
    pub(crate) fn new(endpoint: quinn::Endpoint, max_frame: usize) -> Self {
        Self {
            endpoint,
            peers: DashMap::new(),
            max_frame,
        }
    }

    /// The connection to `addr`, opening it if needed (or if the previous one closed).
    pub(crate) async fn get(&self, addr: SocketAddr) -> Result<Arc<PeerConn>, Error> {
        for _ in 0..2 {
            let cell = self.peers.entry(addr).or_default().clone();
            let peer = cell
                .get_or_try_init(|| PeerConn::open(&self.endpoint, addr, self.max_frame))
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
