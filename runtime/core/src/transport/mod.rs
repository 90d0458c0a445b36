//! Sockets: one quinn endpoint per process, one persistent connection per (caller process → callee process), one
//! long-lived bidirectional stream on it for calls and replies (so calls from one sender stay in order), batched
//! writes. Large payloads go through [`crate::transport::bulk`]: a shared-memory ring when the peer is on the same host,
//! else their own QUIC streams when larger than [`BULK_THRESHOLD`]. Between processes of one host the call stream
//! itself moves to a Unix socket (`lane`). This file holds the endpoint and the callee's side; `peer` the caller's,
//! `streams` the stream writer and payload reader.
//!
//! A connection that sends an oversized, wrong-version or malformed frame is closed with the reason logged.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use futures::future::BoxFuture;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, AsyncWrite, BufReader};
use tokio::sync::mpsc;

pub(crate) mod bulk;
pub(crate) mod config;
pub(crate) mod delivery;
pub(crate) mod error;
mod lane;
mod peer;
mod streams;

use self::bulk::BulkInbox;
use self::config::TransportConfig;
use self::delivery::{Envelope, Payload, Responder};
pub(crate) use self::lane::lanes_opened;
pub(crate) use self::lane::Lanes;
pub(crate) use self::peer::{Connections, ReplyHandle};
pub(crate) use self::streams::Outgoing;
use self::streams::{write_loop, BodyReader, Got, ShmLink};
use crate::codec::{read_frame, FrameError};
use crate::protocol::{ArchivedCallKind, ArchivedFrame, Body, CallKind, Frame, RemoteError};
use crate::security::tls::{self, Credentials};

/// Payloads larger than this travel on their own QUIC stream (when the same-host ring is not in use).
pub(crate) const BULK_THRESHOLD: usize = 4 << 20;
/// Largest datagram MTU discovery probes for. quinn sends up to 10 datagrams in one GSO call, and the kernel
/// refuses (and quinn silently drops) a GSO call over 64 KiB, which then looks like loss and makes MTU discovery
/// give up on every large size: so the bound keeps ten datagrams within 64 KiB.
const MTU_UPPER_BOUND: u16 = 6_500;
/// Socket buffer asked for (the kernel caps it at `net.core.[rw]mem_max` unless the process may force it).
const SOCKET_BUFFER: libc::c_int = 32 << 20;
/// After a same-host lane ends, how long its caller waits for the QUIC connection to close with the cluster's
/// reason (a dead worker's node reports it) before closing it itself.
const LANE_GRACE: Duration = Duration::from_secs(2);
/// How long a caller waits for the answer to its lane request when opening a connection.
const LANE_ASK: Duration = Duration::from_secs(5);

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
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MTU_UPPER_BOUND);
    t.mtu_discovery_config(Some(mtu));
    t
}

/// Lets peers send datagrams up to [`MTU_UPPER_BOUND`] (MTU discovery still finds the real path MTU).
fn endpoint_config() -> Result<quinn::EndpointConfig> {
    let mut cfg = quinn::EndpointConfig::default();
    cfg.max_udp_payload_size(MTU_UPPER_BOUND)?;
    Ok(cfg)
}

/// Asks for large socket buffers so bursts of datagrams are not dropped: forced past the system maximum when the
/// process may (CAP_NET_ADMIN), else as much as the maximum allows.
fn enlarge_buffers(socket: &std::net::UdpSocket) {
    use std::os::fd::AsRawFd;
    let set = |opt: libc::c_int| {
        // SAFETY: a valid socket descriptor and a pointer to a c_int of the size passed.
        unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&SOCKET_BUFFER as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        }
    };
    for (forced, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        if set(forced) != 0 && set(plain) != 0 {
            tracing::debug!(
                "setsockopt({plain}) failed: {}",
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
#[cfg(feature = "testing")]
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

pub(crate) fn close(conn: &quinn::Connection, reason: &str) {
    tracing::warn!(peer = %conn.remote_address(), "closing connection: {reason}");
    conn.close(1u32.into(), reason.as_bytes());
}

/// Why a call or reply stream stopped reading: it ended (end of stream, closed connection, an I/O error), or the
/// peer sent a frame that closes the connection for this reason (guarantee 8).
pub(crate) enum StreamEnd {
    /// Nobody is to blame: why it ended.
    Ended(String),
    /// The reason to close the connection with.
    Bad(String),
}

/// Reads and validates the next frame of a call or reply stream into `buf`, unless `closed` (the connection's
/// `closed()` future) resolves first.
pub(crate) async fn next_frame<'b, R: AsyncRead + Unpin>(
    reader: &mut R,
    max_frame: usize,
    buf: &'b mut AlignedVec,
    closed: std::pin::Pin<&mut impl std::future::Future>,
) -> Result<&'b ArchivedFrame, StreamEnd> {
    let read = tokio::select! {
        biased;
        r = read_frame(reader, max_frame, buf) => r,
        _ = closed => return Err(StreamEnd::Ended("the connection closed".into())),
    };
    match read {
        Ok(true) => {}
        Ok(false) => return Err(StreamEnd::Ended("end of stream".into())),
        Err(FrameError::Io(e)) => return Err(StreamEnd::Ended(e.to_string())),
        Err(e) => return Err(StreamEnd::Bad(e.to_string())),
    }
    Frame::access(buf).map_err(|e| StreamEnd::Bad(e.to_string()))
}

/// The sending half of one call stream: frames, stream items and replies.
#[derive(Clone)]
pub(crate) struct Outbox {
    tx: mpsc::Sender<Outgoing>,
    /// The peer's address, to name it when its stream is gone.
    peer: SocketAddr,
    link: Arc<ShmLink>,
}

impl Outbox {
    /// Starts the writer task of `send` (a QUIC stream, or a same-host lane), which offers a ring of `shm_bytes`
    /// (none when 0) for large payloads.
    fn start<W: AsyncWrite + Unpin + Send + 'static>(
        send: W,
        conn: &quinn::Connection,
        shm_bytes: u64,
    ) -> Self {
        let (tx, rx) = mpsc::channel(1024);
        let link = Arc::new(ShmLink::default());
        tokio::spawn(write_loop(send, rx, conn.clone(), link.clone(), shm_bytes));
        Self {
            tx,
            peer: conn.remote_address(),
            link,
        }
    }

    /// An outbox without a connection or writer task, for tests: what is written to it comes out of the receiver
    /// (the buffer holds 1024 frames, like a real stream's).
    #[cfg(test)]
    pub(crate) fn in_memory(peer: SocketAddr) -> (Self, mpsc::Receiver<Outgoing>) {
        let (tx, rx) = mpsc::channel(1024);
        let link = Arc::new(ShmLink::default());
        (Self { tx, peer, link }, rx)
    }

    /// Whether `other` writes to the same stream.
    pub(crate) fn same_stream(&self, other: &Outbox) -> bool {
        self.tx.same_channel(&other.tx)
    }

    pub(crate) async fn frame(&self, frame: Frame, body: Option<AlignedVec>) -> Result<()> {
        self.tx
            .send(Outgoing { frame, body })
            .await
            .map_err(|_| anyhow::anyhow!("connection to {} closed", self.peer))
    }

    pub(crate) async fn reply(&self, req: u64, result: Result<AlignedVec, RemoteError>) {
        let _ = match result {
            Ok(body) => {
                let frame = Frame::Reply {
                    req,
                    body: Body::Inline(0),
                };
                self.frame(frame, Some(body)).await
            }
            Err(error) => {
                self.frame(
                    Frame::End {
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
        let frame = Frame::Item {
            req,
            body: Body::Inline(0),
        };
        self.frame(frame, Some(body)).await
    }

    pub(crate) async fn end(&self, req: u64, error: Option<RemoteError>) {
        let _ = self.frame(Frame::End { req, error }, None).await;
    }
}

#[cfg(test)]
impl Outgoing {
    /// The frame written (tests read what an in-memory [`Outbox`] was given).
    pub(crate) fn frame(&self) -> &Frame {
        &self.frame
    }
}

/// Serves one accepted connection: the join handshake when the peer has no cluster certificate, else its call
/// streams and bulk streams.
pub(crate) async fn serve_connection(
    incoming: quinn::Incoming,
    inbound: Arc<dyn Inbound>,
    lanes: Arc<Lanes>,
    cfg: TransportConfig,
) {
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => return tracing::debug!("incoming connection failed: {e}"),
    };
    if conn.peer_identity().is_none() {
        return inbound.join(conn).await;
    }
    let inbox = Arc::new(BulkInbox::new(cfg.bulk));
    bulk::spawn_bulk_reader(conn.clone(), inbox.clone());
    while let Ok((send, recv)) = conn.accept_bi().await {
        let (conn, inbound, inbox, lanes) =
            (conn.clone(), inbound.clone(), inbox.clone(), lanes.clone());
        tokio::spawn(async move {
            let out = Outbox::start(send, &conn, cfg.shm_bytes);
            serve_call_stream(conn, recv, out, inbound, inbox, Some(lanes), cfg).await
        });
    }
}

/// Serves one call stream (on QUIC, or a same-host lane): reads calls and hands them to `inbound`, whose replies
/// go to `out`. Ends with the stream or the connection.
async fn serve_call_stream<R: AsyncRead + Unpin>(
    conn: quinn::Connection,
    recv: R,
    out: Outbox,
    inbound: Arc<dyn Inbound>,
    inbox: Arc<BulkInbox>,
    lanes: Option<Arc<Lanes>>,
    cfg: TransportConfig,
) {
    let max_frame = cfg.max_frame;
    let mut reader = BufReader::with_capacity(64 << 10, recv);
    let mut bodies = BodyReader::new(inbox, &cfg);
    let mut buf = AlignedVec::new();
    let closed = conn.closed();
    tokio::pin!(closed);
    loop {
        let frame = match next_frame(&mut reader, max_frame, &mut buf, closed.as_mut()).await {
            Ok(f) => f,
            Err(StreamEnd::Ended(why)) => return tracing::debug!("call stream ended: {why}"),
            Err(StreamEnd::Bad(reason)) => return close(&conn, &reason),
        };
        let Some(call) = IncomingCall::from_frame(frame) else {
            if !answer_stream_frame(frame, &out, &mut bodies, lanes.as_deref(), &conn).await {
                return close(
                    &conn,
                    "unexpected frame on a call stream (only calls flow this way)",
                );
            }
            continue;
        };
        let payload = match read_payload(&mut bodies, &mut reader, call.body).await {
            Ok(p) => p,
            Err(StreamEnd::Ended(why)) => return tracing::debug!("call stream ended: {why}"),
            Err(StreamEnd::Bad(reason)) => return close(&conn, &reason),
        };
        let reply = match call.kind {
            CallKind::Tell => Responder::Told(out.clone()),
            _ => Responder::Remote {
                req: call.req,
                out: out.clone(),
            },
        };
        let env = Envelope {
            msg: call.msg,
            kind: call.kind,
            payload,
            reply,
        };
        inbound.deliver(call.actor, env).await;
    }
}

/// The fields of a [`Frame::Call`] read off a call stream, before its payload.
struct IncomingCall {
    req: u64,
    actor: u64,
    msg: String,
    kind: CallKind,
    body: Body,
}

impl IncomingCall {
    /// The call `frame` carries; `None` when it is another kind of frame.
    fn from_frame(frame: &ArchivedFrame) -> Option<Self> {
        let ArchivedFrame::Call {
            req,
            actor,
            msg,
            kind,
            body,
        } = frame
        else {
            return None;
        };
        Some(Self {
            req: req.to_native(),
            actor: actor.to_native(),
            msg: msg.as_str().to_string(),
            kind: match kind {
                ArchivedCallKind::Tell => CallKind::Tell,
                ArchivedCallKind::Call => CallKind::Call,
                ArchivedCallKind::Stream => CallKind::Stream,
            },
            body: body.to_native(),
        })
    }
}

/// Handles a frame about the call stream itself rather than a call: the peer's ring offer, its answer to ours, a
/// lane request. Returns false when `frame` is none of these (the connection is then to be closed).
async fn answer_stream_frame(
    frame: &ArchivedFrame,
    out: &Outbox,
    bodies: &mut BodyReader,
    lanes: Option<&Lanes>,
    conn: &quinn::Connection,
) -> bool {
    match frame {
        ArchivedFrame::ShmOffer { .. } => bodies.offer(frame, out).await,
        ArchivedFrame::ShmAnswer { accepted, .. } => out.link.answered(*accepted),
        ArchivedFrame::LaneAsk => {
            let answer = match lanes {
                Some(lanes) => lanes.offer(conn, &bodies.inbox),
                None => Frame::LaneOffer {
                    pid: 0,
                    name: String::new(),
                    nonce: Vec::new(),
                },
            };
            let _ = out.frame(answer, None).await;
        }
        _ => return false,
    }
    true
}

/// Reads the payload of a call whose frame said `body`: its bytes, or the bulk stream that brings them. An I/O error
/// on an inline payload ends the stream; any other error closes the connection.
async fn read_payload<R: AsyncRead + Unpin>(
    bodies: &mut BodyReader,
    reader: &mut R,
    body: Body,
) -> Result<Payload, StreamEnd> {
    match bodies.read(reader, body).await {
        Ok(Got::Here(bytes)) => Ok(Payload::Ready(bytes)),
        Ok(Got::Bulk(id)) => Ok(Payload::Bulk(bodies.inbox.wait(id))),
        Err(FrameError::Io(e)) if matches!(body, Body::Inline(_)) => {
            Err(StreamEnd::Ended(e.to_string()))
        }
        Err(e) => Err(StreamEnd::Bad(e.to_string())),
    }
}
