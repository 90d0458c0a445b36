//! Forming the group: every rank listens, publishes its address through the rendezvous, then connects to every
//! lower rank and accepts every higher one, so each pair of ranks shares exactly one persistent connection. Over it,
//! each pair then tries to set up a shared-memory link (the lower rank offers a segment, the higher one maps it);
//! pairs on different hosts, or where either rank disabled it, keep TCP.
//!
//! Every connection first passes the job-secret handshake (`auth.rs`, context `ferl-collective-mesh-v1` and the
//! group's prefix; the connecting rank's hello carries its rank and the world size, the listener's reply its rank), so
//! only ranks holding the job's secret join, and the shared-memory offers travel over authenticated connections only.
//! A listener drops a connection that fails it, names it, and keeps accepting until its join deadline.

use super::join::Joining;
use super::link::Peer;
use super::shm::{self, Offer, Pending};
use crate::rendezvous::Rendezvous;
use crate::{JobSecret, JOB_SECRET_ENV};
use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const OFFER_MAGIC: u32 = 0x5348_4d3f; // "SHM?"

/// The connections of one rank to all others (`None` at its own index).
pub(crate) struct Mesh {
    /// This rank.
    pub rank: usize,
    /// Connection per rank.
    pub peers: Vec<Option<Peer>>,
}

impl Mesh {
    /// The connection to `rank`.
    pub(super) fn peer(&self, rank: usize) -> &Peer {
        self.peers[rank].as_ref().expect("no connection to self")
    }

    /// Closes every connection, so blocked reads and writes on this rank and on its peers return at once.
    pub(super) fn shutdown_all(&self) {
        for p in self.peers.iter().flatten() {
            p.shutdown();
        }
    }
}

/// Where a rank listens and how long joining may take.
pub(crate) struct MeshConfig<'a> {
    pub rank: usize,
    pub world: usize,
    pub prefix: &'a str,
    pub bind_ip: IpAddr,
    pub timeout: Duration,
    /// Bound on forming the mesh.
    pub join_timeout: Duration,
    pub socket_buffer: usize,
    /// Offer and accept shared-memory links.
    pub shared_memory: bool,
    /// Bytes per direction of each shared-memory ring.
    pub shm_ring_bytes: usize,
    /// The job secret every connection proves; needed when `world > 1`.
    pub secret: Option<&'a JobSecret>,
}

pub(super) fn addr_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/tcp/rank{rank}/addr")
}

pub(super) fn configure(stream: &TcpStream, timeout: Duration, socket_buffer: usize) -> Result<()> {
    stream.set_nodelay(true)?;
    if socket_buffer > 0 {
        use std::os::fd::AsRawFd;
        let size = socket_buffer.min(i32::MAX as usize) as libc::c_int;
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            // SAFETY: a valid socket and a c_int option value of the right length.
            let rc = unsafe {
                libc::setsockopt(
                    stream.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    &size as *const libc::c_int as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc != 0 {
                return Err(std::io::Error::last_os_error())
                    .context("setting the socket buffer size");
            }
        }
    }
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    Ok(())
}

/// Connects this rank to every other rank of the group, authenticating every connection with the job secret.
pub(crate) fn connect_mesh(cfg: &MeshConfig<'_>, rendezvous: &dyn Rendezvous) -> Result<Mesh> {
    let (rank, world) = (cfg.rank, cfg.world);
    if rank >= world {
        bail!("rank {rank} is out of range for world size {world}");
    }
    if world == 1 {
        return Ok(Mesh {
            rank,
            peers: vec![None],
        });
    }
    let Some(secret) = cfg.secret else {
        bail!(
            "rank {rank}: no job secret to authenticate the group's connections: set GroupOptions::job_secret \
             (launcher runs: {JOB_SECRET_ENV}) or use a rendezvous that provides one"
        );
    };
    let join = Joining::new(cfg, secret);
    let listener = TcpListener::bind(SocketAddr::new(cfg.bind_ip, 0))
        .with_context(|| format!("rank {rank}: cannot listen on {}", cfg.bind_ip))?;
    let my_addr = listener.local_addr()?;
    rendezvous.set(&addr_key(cfg.prefix, rank), my_addr.to_string().as_bytes())?;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    for (other, slot) in peers.iter_mut().enumerate().take(rank) {
        *slot = Some(join.connect_lower(other, rendezvous)?);
    }
    join.accept_higher(&listener, &mut peers)?;
    let links = negotiate_shared_memory(cfg, &mut peers)?;
    // Joined: from now on every transfer is bound by the collective timeout.
    for stream in peers.iter().flatten() {
        set_timeouts(stream, cfg.timeout)?;
    }
    let peers = peers
        .into_iter()
        .zip(links)
        .map(|(stream, link)| stream.map(|s| Peer::new(s, link)).transpose())
        .collect::<std::io::Result<_>>()?;
    Ok(Mesh { rank, peers })
}

/// Sets both time-outs of `stream`.
pub(super) fn set_timeouts(stream: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))
}

/// Sets up a shared-memory link with every peer that can map this rank's segments: offers to every higher rank
/// first (small writes that never block), then answers every lower rank's offer, then collects the answers.
fn negotiate_shared_memory(
    cfg: &MeshConfig<'_>,
    streams: &mut [Option<TcpStream>],
) -> Result<Vec<Option<shm::ShmLink>>> {
    let (rank, timeout) = (cfg.rank, cfg.timeout);
    let mut links: Vec<Option<shm::ShmLink>> = (0..cfg.world).map(|_| None).collect();
    let mut pending: Vec<Option<Pending>> = (0..cfg.world).map(|_| None).collect();
    for other in rank + 1..cfg.world {
        let stream = streams[other].as_mut().expect("connected above");
        let segment = if cfg.shared_memory {
            Pending::create_fitting(cfg.shm_ring_bytes)
                .map_err(|e| {
                    if shm::out_of_space(&e) {
                        tracing::warn!(
                            "rank {rank}: no memory for a shared-memory segment, rank {other} gets TCP: {e:#}"
                        );
                    } else {
                        tracing::debug!("rank {rank}: no shared memory with rank {other}: {e:#}");
                    }
                })
                .ok()
        } else {
            None
        };
        send_offer(stream, segment.as_ref().map(Pending::offer).as_ref())
            .with_context(|| format!("rank {rank}: offering shared memory to rank {other}"))?;
        pending[other] = segment;
    }
    for (other, link) in links.iter_mut().enumerate().take(rank) {
        let stream = streams[other].as_mut().expect("connected above");
        let offer = read_offer(stream)
            .with_context(|| format!("rank {rank}: reading rank {other}'s shared-memory offer"))?;
        *link = match offer {
            Some(offer) if cfg.shared_memory => shm::accept(&offer, stream.as_raw_fd(), timeout)
                .map_err(|e| {
                    tracing::debug!("rank {rank}: no shared memory with rank {other}: {e:#}")
                })
                .ok(),
            _ => None,
        };
        stream
            .write_all(&[u8::from(link.is_some())])
            .with_context(|| {
                format!("rank {rank}: answering rank {other}'s shared-memory offer")
            })?;
    }
    for other in rank + 1..cfg.world {
        // Every offer is answered, an empty one too: read the answer so no byte is left on the connection.
        let stream = streams[other].as_mut().expect("connected above");
        let mut answer = [0u8; 1];
        stream
            .read_exact(&mut answer)
            .with_context(|| format!("rank {rank}: reading rank {other}'s shared-memory answer"))?;
        match (pending[other].take(), answer[0]) {
            (Some(segment), 1) => {
                links[other] = Some(segment.into_link(stream.as_raw_fd(), timeout))
            }
            (None, 1) => {
                bail!("rank {rank}: rank {other} accepted a shared-memory offer never made")
            }
            _ => {}
        }
    }
    Ok(links)
}

fn send_offer(stream: &mut TcpStream, offer: Option<&Offer>) -> std::io::Result<()> {
    let mut msg = OFFER_MAGIC.to_le_bytes().to_vec();
    match offer {
        None => msg.extend_from_slice(&0u32.to_le_bytes()),
        Some(offer) => {
            msg.extend_from_slice(&(Offer::ENCODED_LEN as u32).to_le_bytes());
            msg.extend_from_slice(&offer.encode());
        }
    }
    stream.write_all(&msg)
}

fn read_offer(stream: &mut TcpStream) -> Result<Option<Offer>> {
    let mut head = [0u8; 8];
    stream.read_exact(&mut head)?;
    let magic = u32::from_le_bytes(head[..4].try_into()?);
    let len = u32::from_le_bytes(head[4..].try_into()?) as usize;
    if magic != OFFER_MAGIC || (len != 0 && len != Offer::ENCODED_LEN) {
        bail!("malformed shared-memory offer (magic {magic:#x}, {len} bytes)");
    }
    if len == 0 {
        return Ok(None);
    }
    let mut body = [0u8; Offer::ENCODED_LEN];
    stream.read_exact(&mut body)?;
    Ok(Some(Offer::decode(&body)?))
}

pub(super) fn connect_retrying(addr: SocketAddr, deadline: Instant) -> Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
