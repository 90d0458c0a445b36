//! Forming the TCP group: every rank listens, publishes its address through the rendezvous, then connects to every
//! lower rank and accepts every higher one, so each pair of ranks shares exactly one persistent connection.

use crate::rendezvous::Rendezvous;
use anyhow::{anyhow, bail, Context, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const HELLO_MAGIC: u32 = 0x4645_524c; // "FERL"

/// One connection to another rank: the same socket twice, so one thread can write while another reads.
pub(crate) struct Peer {
    /// The handle this rank reads from.
    pub read: TcpStream,
    /// The handle this rank writes to.
    pub write: TcpStream,
}

/// The connections of one rank to all others (`None` at its own index).
pub(crate) struct Mesh {
    /// This rank.
    pub rank: usize,
    /// Connection per rank.
    pub peers: Vec<Option<Peer>>,
}

impl Mesh {
    /// The connection to `rank`.
    pub fn peer(&self, rank: usize) -> &Peer {
        self.peers[rank].as_ref().expect("no connection to self")
    }

    /// Closes every connection, so blocked reads and writes on this rank and on its peers return at once.
    pub fn shutdown_all(&self) {
        for p in self.peers.iter().flatten() {
            let _ = p.read.shutdown(Shutdown::Both);
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
    pub socket_buffer: usize,
}

fn addr_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/tcp/rank{rank}/addr")
}

fn configure(stream: &TcpStream, timeout: Duration, socket_buffer: usize) -> Result<()> {
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

/// Connects this rank to every other rank of the group.
pub(crate) fn connect_mesh(cfg: &MeshConfig<'_>, rendezvous: &dyn Rendezvous) -> Result<Mesh> {
    let MeshConfig {
        rank,
        world,
        prefix,
        bind_ip,
        timeout,
        socket_buffer,
    } = *cfg;
    if rank >= world {
        bail!("rank {rank} is out of range for world size {world}");
    }
    let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0))
        .with_context(|| format!("rank {rank}: cannot listen on {bind_ip}"))?;
    let my_addr = listener.local_addr()?;
    rendezvous.set(&addr_key(prefix, rank), my_addr.to_string().as_bytes())?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<Peer>> = (0..world).map(|_| None).collect();

    for (other, slot) in peers.iter_mut().enumerate().take(rank) {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let raw = rendezvous.get(&addr_key(prefix, other), remaining)?;
        let addr: SocketAddr = String::from_utf8(raw)?
            .parse()
            .with_context(|| format!("rank {rank}: bad address published by rank {other}"))?;
        let mut stream = connect_retrying(addr, deadline)
            .with_context(|| format!("rank {rank}: connecting to rank {other} at {addr}"))?;
        configure(&stream, timeout, socket_buffer)?;
        let mut hello = [0u8; 12];
        hello[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        hello[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
        hello[8..].copy_from_slice(&(world as u32).to_le_bytes());
        stream.write_all(&hello)?;
        let mut ack = [0u8; 4];
        stream
            .read_exact(&mut ack)
            .with_context(|| format!("rank {rank}: handshake with rank {other}"))?;
        if u32::from_le_bytes(ack) != other as u32 {
            bail!("rank {rank}: the process at {addr} is not rank {other} of this group");
        }
        *slot = Some(Peer {
            write: stream.try_clone()?,
            read: stream,
        });
    }

    listener.set_nonblocking(true)?;
    let mut pending = world - rank - 1;
    while pending > 0 {
        match listener.accept() {
            Ok((mut stream, from)) => {
                stream.set_nonblocking(false)?;
                configure(&stream, timeout, socket_buffer)?;
                let mut hello = [0u8; 12];
                stream
                    .read_exact(&mut hello)
                    .with_context(|| format!("rank {rank}: handshake from {from}"))?;
                let magic = u32::from_le_bytes(hello[..4].try_into()?);
                let other = u32::from_le_bytes(hello[4..8].try_into()?) as usize;
                let their_world = u32::from_le_bytes(hello[8..].try_into()?) as usize;
                if magic != HELLO_MAGIC || their_world != world || other <= rank || other >= world {
                    bail!("rank {rank}: unexpected handshake from {from} (rank {other}, world {their_world})");
                }
                if peers[other].is_some() {
                    bail!("rank {rank}: two connections claim to be rank {other}");
                }
                stream.write_all(&(rank as u32).to_le_bytes())?;
                peers[other] = Some(Peer {
                    write: stream.try_clone()?,
                    read: stream,
                });
                pending -= 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> =
                        (rank + 1..world).filter(|r| peers[*r].is_none()).collect();
                    return Err(anyhow!(
                        "rank {rank}: ranks {missing:?} did not connect within {timeout:?}"
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e).context(format!("rank {rank}: accepting connections")),
        }
    }
    Ok(Mesh { rank, peers })
}

fn connect_retrying(addr: SocketAddr, deadline: Instant) -> Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
