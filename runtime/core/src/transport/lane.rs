//! Same-host call lanes (guarantee 13 in `runtime/README.md`): a caller whose callee runs on the same host moves its
//! call stream off QUIC onto a Unix stream socket, where one round trip costs one kernel wake-up per side instead of
//! a UDP datagram, QUIC's packet processing and encryption.
//!
//! Every process listens on an abstract Unix socket (no file anywhere) with a random name. A caller that opens a
//! connection first asks on its (authenticated, encrypted) QUIC call stream; the callee answers with its pid, the
//! socket's name and 32 random bytes kept for this QUIC connection only. The caller connects, checks with
//! `SO_PEERCRED` that the process behind the socket is the offered pid and runs as its own user, and sends the 32
//! bytes; the callee checks them and the caller's user, answers one byte, and from then on serves that connection's
//! calls from the socket. A caller on another host (or in another network namespace) cannot reach the socket and
//! keeps the QUIC stream. The QUIC connection stays up: it carries liveness, bulk streams, and its closing ends the
//! lane too.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::SocketAddr as UnixAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::Notify;

use super::Inbound;
use crate::protocol::Frame;
use crate::transport::bulk::BulkInbox;
use crate::transport::config::{TransportConfig, LANES_ENV};

const NONCE_LEN: usize = 32;

static LANES_OPENED: AtomicU64 = AtomicU64::new(0);

/// Same-host lanes this process has opened as a caller (for tests and benchmarks).
pub(crate) fn lanes_opened() -> u64 {
    LANES_OPENED.load(Ordering::Relaxed)
}

/// How long either side waits for the other's half of the lane handshake.
const HANDSHAKE: Duration = Duration::from_secs(2);
const ACCEPTED: u8 = 1;

/// A lane offered to a caller and not yet taken: the QUIC connection whose calls it will carry.
struct Offered {
    conn: quinn::Connection,
    inbox: Arc<BulkInbox>,
}

/// This process's lane listener and the lanes it has offered.
pub(crate) struct Lanes {
    name: Option<String>,
    offered: DashMap<[u8; NONCE_LEN], Offered>,
    stop: Notify,
}

impl Lanes {
    /// Listens on a fresh abstract socket and serves lanes to `inbound`; without a socket (an error binding it, or
    /// lanes turned off in `cfg`), offers nothing and calls stay on QUIC.
    pub(crate) fn start(inbound: Arc<dyn Inbound>, cfg: TransportConfig) -> Arc<Self> {
        let name = format!(
            "ferl-lane-{}-{}",
            std::process::id(),
            hex::encode(rand::random::<[u8; 16]>())
        );
        let listener = if cfg.lanes {
            Ok(())
        } else {
            Err(std::io::Error::other(format!("{LANES_ENV}=0")))
        }
        .and_then(|()| UnixAddr::from_abstract_name(name.as_bytes()))
        .and_then(|addr| std::os::unix::net::UnixListener::bind_addr(&addr))
        .and_then(|l| {
            l.set_nonblocking(true)?;
            tokio::net::UnixListener::from_std(l)
        });
        let lanes = Arc::new(Self {
            name: listener.is_ok().then_some(name),
            offered: DashMap::new(),
            stop: Notify::new(),
        });
        match listener {
            Ok(listener) => {
                let lanes = lanes.clone();
                tokio::spawn(async move {
                    loop {
                        let stream = tokio::select! {
                            accepted = listener.accept() => match accepted {
                                Ok((stream, _)) => stream,
                                Err(_) => return,
                            },
                            _ = lanes.stop.notified() => return,
                        };
                        let lanes = lanes.clone();
                        let inbound = inbound.clone();
                        tokio::spawn(async move {
                            if let Err(e) = lanes.serve(stream, inbound, cfg).await {
                                tracing::debug!("same-host lane refused: {e}");
                            }
                        });
                    }
                });
            }
            Err(e) => tracing::debug!("no same-host lanes ({e}); calls stay on QUIC"),
        }
        lanes
    }

    /// Stops listening (the process's endpoint closed); lanes already open end with their connections.
    pub(crate) fn stop(&self) {
        self.stop.notify_one();
    }

    /// The answer to a caller's [`Frame::LaneAsk`] on `conn`.
    pub(crate) fn offer(&self, conn: &quinn::Connection, inbox: &Arc<BulkInbox>) -> Frame {
        let Some(name) = &self.name else {
            return Frame::LaneOffer {
                pid: 0,
                name: String::new(),
                nonce: Vec::new(),
            };
        };
        self.offered.retain(|_, o| o.conn.close_reason().is_none());
        let nonce: [u8; NONCE_LEN] = rand::random();
        self.offered.insert(
            nonce,
            Offered {
                conn: conn.clone(),
                inbox: inbox.clone(),
            },
        );
        Frame::LaneOffer {
            pid: std::process::id(),
            name: name.clone(),
            nonce: nonce.to_vec(),
        }
    }

    /// Checks a caller's handshake and serves its calls from `stream`.
    async fn serve(
        &self,
        mut stream: UnixStream,
        inbound: Arc<dyn Inbound>,
        cfg: TransportConfig,
    ) -> Result<(), String> {
        let cred = stream.peer_cred().map_err(|e| e.to_string())?;
        // SAFETY: getuid has no preconditions.
        if cred.uid() != unsafe { libc::getuid() } {
            return Err(format!("caller runs as uid {}", cred.uid()));
        }
        let mut nonce = [0u8; NONCE_LEN];
        tokio::time::timeout(HANDSHAKE, stream.read_exact(&mut nonce))
            .await
            .map_err(|_| "no handshake in time".to_string())?
            .map_err(|e| e.to_string())?;
        let (_, offered) = self
            .offered
            .remove(&nonce)
            .ok_or("unknown handshake bytes")?;
        stream
            .write_all(&[ACCEPTED])
            .await
            .map_err(|e| e.to_string())?;
        let (read, write) = stream.into_split();
        let out = super::Outbox::start(write, &offered.conn, cfg.shm_bytes);
        super::serve_call_stream(offered.conn, read, out, inbound, offered.inbox, None, cfg).await;
        Ok(())
    }
}

/// The caller's half: connects to an offered lane, or says why not (then calls stay on QUIC; always when `lanes`
/// is off here).
pub(crate) async fn connect(
    pid: u32,
    name: &str,
    nonce: &[u8],
    lanes: bool,
) -> Result<UnixStream, String> {
    if name.is_empty() {
        return Err("the callee offers no lane".into());
    }
    if !lanes {
        return Err(format!("{LANES_ENV}=0"));
    }
    if nonce.len() != NONCE_LEN {
        return Err("malformed lane offer".into());
    }
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    // A Unix connect completes or fails at once: there is no network in between.
    let std = std::os::unix::net::UnixStream::connect_addr(&addr)
        .map_err(|e| format!("not on this host ({e})"))?;
    std.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut stream = UnixStream::from_std(std).map_err(|e| e.to_string())?;
    let cred = stream.peer_cred().map_err(|e| e.to_string())?;
    // SAFETY: getuid has no preconditions.
    if cred.pid() != Some(pid as i32) || cred.uid() != unsafe { libc::getuid() } {
        return Err(format!(
            "the socket belongs to pid {:?} uid {}, not the callee",
            cred.pid(),
            cred.uid()
        ));
    }
    stream.write_all(nonce).await.map_err(|e| e.to_string())?;
    let mut answer = [0u8; 1];
    tokio::time::timeout(HANDSHAKE, stream.read_exact(&mut answer))
        .await
        .map_err(|_| "no answer in time".to_string())?
        .map_err(|e| e.to_string())?;
    if answer[0] != ACCEPTED {
        return Err("the callee refused the lane".into());
    }
    LANES_OPENED.fetch_add(1, Ordering::Relaxed);
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::delivery::Envelope;
    use futures::future::BoxFuture;

    struct Nobody;
    impl Inbound for Nobody {
        fn deliver(&self, _: u64, _: Envelope) -> BoxFuture<'_, ()> {
            Box::pin(async {})
        }
        fn join(&self, _: quinn::Connection) -> BoxFuture<'static, ()> {
            Box::pin(async {})
        }
    }

    #[tokio::test]
    async fn guarantee_13_a_lane_opens_only_with_the_offered_bytes_and_pid() {
        let lanes = Lanes::start(
            Arc::new(Nobody),
            TransportConfig {
                max_frame: 1 << 20,
                ..Default::default()
            },
        );
        let name = lanes.name.clone().expect("an abstract socket on Linux");
        let me = std::process::id();
        // Bytes never offered: the callee hangs up without accepting.
        let err = connect(me, &name, &[7u8; NONCE_LEN], true)
            .await
            .unwrap_err();
        assert!(!err.is_empty());
        // The right name but the wrong pid: refused before any byte is sent.
        let err = connect(me + 1, &name, &[7u8; NONCE_LEN], true)
            .await
            .unwrap_err();
        assert!(err.contains("not the callee"), "{err}");
        // A name nobody listens on (another host's): not reachable.
        let err = connect(me, "ferl-lane-nobody", &[7u8; NONCE_LEN], true)
            .await
            .unwrap_err();
        assert!(err.contains("not on this host"), "{err}");
        // Malformed offers.
        assert!(connect(me, &name, &[1, 2, 3], true).await.is_err());
        assert!(connect(me, "", &[7u8; NONCE_LEN], true).await.is_err());
        // Lanes off here: refused naming the variable, whatever the offer.
        let err = connect(me, &name, &[7u8; NONCE_LEN], false)
            .await
            .unwrap_err();
        assert_eq!(err, "FERL_LANES=0");
        lanes.stop();
    }
}
