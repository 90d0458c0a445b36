//! One rank forming its mesh connections (see `mesh.rs`), each authenticated with the job secret (`auth.rs`):
//! it connects to every lower rank and proves first (its hello: its rank and the world size), and accepts every higher
//! rank (its reply: its own rank). Proofs are bound to [`MESH_CONTEXT`] and the group's prefix.
//!
//! Accepted connections handshake on their own threads (at most [`MAX_HANDSHAKING`] at once, each for at most
//! [`HANDSHAKE_TIMEOUT`]), so a silent or garbage connection never delays the real ranks. A connection that fails
//! (a wrong secret, garbage, silence, a rank already connected) is dropped and named, in the log and in the error
//! should the join deadline pass with ranks missing.

use super::mesh::{addr_key, configure, connect_retrying, set_timeouts, MeshConfig};
use crate::auth::{Handshake, HandshakeLimit, HANDSHAKE_TIMEOUT};
use crate::rendezvous::Rendezvous;
use crate::{JobSecret, MAX_HANDSHAKING};
use anyhow::{anyhow, bail, Context, Result};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the mesh's handshake proofs are bound to (with the group's prefix).
const MESH_CONTEXT: &[u8] = b"ferl-collective-mesh-v1\0";
/// How many refusals a join error names.
const KEPT_REFUSALS: usize = 8;
/// Bytes of a connecting rank's hello: its rank and the world size.
const HELLO_BYTES: usize = 8;

/// An accepted connection's outcome: the peer's rank and connection, or the rank it claimed and why it failed.
type Admitted = Result<(usize, TcpStream), (Option<usize>, anyhow::Error)>;

/// One rank forming its connections.
pub(super) struct Joining<'a> {
    cfg: &'a MeshConfig<'a>,
    admission: Arc<Admission>,
    deadline: Instant,
}

/// What accepted connections are checked against; owned, so their handshakes run on threads of their own.
struct Admission {
    rank: usize,
    world: usize,
    join_timeout: Duration,
    socket_buffer: usize,
    secret: JobSecret,
    context: Vec<u8>,
}

impl Admission {
    fn handshake(&self, timeout: Duration) -> Handshake<'_> {
        Handshake {
            secret: &self.secret,
            context: &self.context,
            timeout: timeout.max(Duration::from_millis(1)),
        }
    }

    /// Authenticates an accepted connection from a higher rank.
    fn admit(&self, mut stream: TcpStream) -> Admitted {
        let (rank, world) = (self.rank, self.world);
        let mut claimed = None;
        let check = |hello: &[u8]| {
            let other = u32::from_le_bytes(hello[..4].try_into()?) as usize;
            let their_world = u32::from_le_bytes(hello[4..].try_into()?) as usize;
            claimed = Some(other);
            if their_world != world || other <= rank || other >= world {
                bail!("unexpected handshake (rank {other}, world {their_world})");
            }
            Ok((rank as u32).to_le_bytes().to_vec())
        };
        let admitted = (|| {
            stream.set_nonblocking(false)?;
            configure(&stream, self.join_timeout, self.socket_buffer)?;
            let timeout = HANDSHAKE_TIMEOUT.min(self.join_timeout);
            self.handshake(timeout)
                .respond(&mut stream, HELLO_BYTES, check)?;
            set_timeouts(&stream, self.join_timeout)?;
            anyhow::Ok(())
        })();
        match (admitted, claimed) {
            (Ok(()), Some(other)) => Ok((other, stream)),
            (Ok(()), None) => Err((None, anyhow!("no rank in the handshake"))),
            (Err(e), claimed) => Err((claimed, e)),
        }
    }
}

impl<'a> Joining<'a> {
    /// Starts joining as `cfg` says, proving `secret`; the join deadline starts now.
    pub(super) fn new(cfg: &'a MeshConfig<'a>, secret: &JobSecret) -> Self {
        let admission = Admission {
            rank: cfg.rank,
            world: cfg.world,
            join_timeout: cfg.join_timeout,
            socket_buffer: cfg.socket_buffer,
            secret: secret.clone(),
            context: [MESH_CONTEXT, cfg.prefix.as_bytes()].concat(),
        };
        Self {
            cfg,
            admission: Arc::new(admission),
            deadline: Instant::now() + cfg.join_timeout,
        }
    }

    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Connects to rank `other` at the address it published and authenticates both ways. The lower rank may still be
    /// joining its own lower ranks, so its answer may take until the join deadline.
    pub(super) fn connect_lower(
        &self,
        other: usize,
        rendezvous: &dyn Rendezvous,
    ) -> Result<TcpStream> {
        let (rank, world) = (self.cfg.rank, self.cfg.world);
        let raw = rendezvous.get(&addr_key(self.cfg.prefix, other), self.remaining())?;
        let addr: SocketAddr = String::from_utf8(raw)?
            .parse()
            .with_context(|| format!("rank {rank}: bad address published by rank {other}"))?;
        let mut stream = connect_retrying(addr, self.deadline)
            .with_context(|| format!("rank {rank}: connecting to rank {other} at {addr}"))?;
        configure(&stream, self.cfg.join_timeout, self.cfg.socket_buffer)?;
        let hello = [(rank as u32).to_le_bytes(), (world as u32).to_le_bytes()].concat();
        let reply = self
            .admission
            .handshake(self.remaining())
            .initiate(&mut stream, &hello, 4)
            .with_context(|| format!("rank {rank}: joining rank {other} at {addr}"))?;
        if reply[..] != (other as u32).to_le_bytes() {
            bail!("rank {rank}: the process at {addr} is not rank {other} of this group");
        }
        set_timeouts(&stream, self.cfg.join_timeout)?;
        Ok(stream)
    }

    /// Accepts every higher rank on `listener` into `peers`, until the join deadline.
    pub(super) fn accept_higher(
        &self,
        listener: &TcpListener,
        peers: &mut [Option<TcpStream>],
    ) -> Result<()> {
        let rank = self.cfg.rank;
        let limit = Arc::new(HandshakeLimit::default());
        let (tx, rx) = channel();
        let mut refused = Vec::new();
        listener.set_nonblocking(true)?;
        while peers[rank + 1..].iter().any(Option::is_none) {
            if let Ok((from, admitted)) = rx.try_recv() {
                self.settle(from, admitted, peers, &mut refused);
                continue;
            }
            match listener.accept() {
                Ok((stream, from)) => {
                    if let Err(why) = self.start_admission(stream, from, &limit, &tx) {
                        self.refuse(format!("{from}: {why:#}"), &mut refused);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= self.deadline {
                        return Err(self.missing_ranks(peers, &refused));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e).context(format!("rank {rank}: accepting connections")),
            }
        }
        Ok(())
    }

    /// Runs the handshake of an accepted connection on a thread of its own, which reports to `tx`.
    fn start_admission(
        &self,
        stream: TcpStream,
        from: SocketAddr,
        limit: &Arc<HandshakeLimit>,
        tx: &Sender<(SocketAddr, Admitted)>,
    ) -> Result<()> {
        let Some(ticket) = limit.enter() else {
            bail!("{MAX_HANDSHAKING} other connections are handshaking");
        };
        let (admission, tx) = (self.admission.clone(), tx.clone());
        std::thread::Builder::new()
            .name("ferl-mesh-admit".into())
            .spawn(move || {
                let admitted = admission.admit(stream);
                drop(ticket);
                let _ = tx.send((from, admitted));
            })
            .context("starting its handshake")?;
        Ok(())
    }

    /// Keeps an admitted peer's connection, or names why the connection from `from` was dropped.
    fn settle(
        &self,
        from: SocketAddr,
        admitted: Admitted,
        peers: &mut [Option<TcpStream>],
        refused: &mut Vec<String>,
    ) {
        match admitted {
            Ok((other, stream)) if peers[other].is_none() => peers[other] = Some(stream),
            Ok((other, _)) => self.refuse(
                format!("{from} claiming rank {other}: rank {other} is connected already"),
                refused,
            ),
            Err((claimed, e)) => {
                let who = claimed.map_or(String::new(), |r| format!(" claiming rank {r}"));
                self.refuse(format!("{from}{who}: {e:#}"), refused);
            }
        }
    }

    /// Logs why a connection was dropped, and keeps the first [`KEPT_REFUSALS`] reasons for the join error.
    fn refuse(&self, why: String, refused: &mut Vec<String>) {
        tracing::warn!("rank {}: refused the connection from {why}", self.cfg.rank);
        if refused.len() < KEPT_REFUSALS {
            refused.push(why);
        }
    }

    /// The error when the deadline passed before every higher rank connected, with the connections refused meanwhile.
    fn missing_ranks(&self, peers: &[Option<TcpStream>], refused: &[String]) -> anyhow::Error {
        let (rank, world) = (self.cfg.rank, self.cfg.world);
        let missing: Vec<usize> = (rank + 1..world).filter(|r| peers[*r].is_none()).collect();
        let mut msg = format!(
            "rank {rank}: ranks {missing:?} did not connect within {:?}",
            self.cfg.join_timeout
        );
        if !refused.is_empty() {
            msg.push_str(&format!("; refused: {}", refused.join("; ")));
        }
        anyhow!(msg)
    }
}
