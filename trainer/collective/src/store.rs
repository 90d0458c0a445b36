//! A standalone TCP key-value store for rendezvous, torchrun-style: rank 0 hosts it at `MASTER_ADDR:MASTER_PORT` and
//! every rank (rank 0 included) talks to it as a client.
//!
//! Every connection first passes the job-secret handshake (`auth.rs`, context `ferl-collective-store-v1`): a client
//! without the job's secret is refused (and named in the server's log and [`TcpStoreServer::refusals`]) before it can
//! read or write a key, and the server keeps serving the others. A client gets [`HANDSHAKE_TIMEOUT`] (see
//! [`TcpStoreServer::set_handshake_timeout`]) to complete it, and at most [`MAX_HANDSHAKING`] connections may be
//! handshaking at once, so silent or garbage clients cannot hang the server or exhaust its threads.
//!
//! Wire format after the handshake, one request at a time per connection: `op:u8, key_len:u32 LE, key`, then for SET
//! `value_len:u32 LE, value`, for GET `timeout_ms:u64 LE`. Replies: `status:u8` (0 ok, 1 timed out), then for GET
//! `value_len:u32, value`.

use crate::auth::{Handshake, HandshakeLimit, HandshakeTicket, HANDSHAKE_TIMEOUT};
use crate::rendezvous::{wait_for_key, Rendezvous};
use crate::{JobSecret, JOB_SECRET_ENV, MAX_HANDSHAKING};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const MAX_KEY: usize = 4096;
const MAX_VALUE: usize = 64 << 20;
/// What the store's handshake proofs are bound to.
const STORE_CONTEXT: &[u8] = b"ferl-collective-store-v1";
/// How many refusals [`TcpStoreServer::refusals`] remembers.
const KEPT_REFUSALS: usize = 16;

struct Shared {
    entries: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stopped: AtomicBool,
    secret: JobSecret,
    handshake_ms: AtomicU64,
    handshaking: Arc<HandshakeLimit>,
    refusals: Mutex<VecDeque<String>>,
}

impl Shared {
    fn new(secret: JobSecret) -> Self {
        Self {
            entries: Mutex::default(),
            changed: Condvar::new(),
            stopped: AtomicBool::new(false),
            secret,
            handshake_ms: AtomicU64::new(HANDSHAKE_TIMEOUT.as_millis() as u64),
            handshaking: Arc::default(),
            refusals: Mutex::default(),
        }
    }

    /// Logs and remembers why the client at `peer` was dropped.
    fn refuse(&self, peer: &str, why: &anyhow::Error) {
        let line = format!("client at {peer}: {why:#}");
        tracing::warn!("rendezvous store: refused the {line}");
        let mut kept = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() == KEPT_REFUSALS {
            kept.pop_front();
        }
        kept.push_back(line);
    }
}

/// The store's server side: accepts clients that hold the job secret, on threads, until dropped.
pub struct TcpStoreServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl TcpStoreServer {
    /// Listens on `addr` (port 0 picks a free port) and serves clients holding `secret` in background threads.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug, secret: JobSecret) -> Result<Self> {
        let listener = TcpListener::bind(&addr)
            .with_context(|| format!("rendezvous store: cannot listen on {addr:?}"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(secret));
        let serving = shared.clone();
        std::thread::Builder::new()
            .name("ferl-store".into())
            .spawn(move || accept_loop(&serving, listener))?;
        Ok(Self { shared, addr })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets how long clients accepted from now on get to complete the handshake (default [`HANDSHAKE_TIMEOUT`]).
    pub fn set_handshake_timeout(&self, timeout: Duration) {
        let ms = (timeout.as_millis() as u64).max(1);
        self.shared.handshake_ms.store(ms, Ordering::Release);
    }

    /// Why the latest refused connections were dropped (the last 16), each naming the client's address.
    pub fn refusals(&self) -> Vec<String> {
        let kept = self
            .shared
            .refusals
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        kept.iter().cloned().collect()
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    for conn in listener.incoming() {
        if shared.stopped.load(Ordering::Acquire) {
            break;
        }
        let Ok(conn) = conn else { continue };
        let Some(ticket) = shared.handshaking.enter() else {
            let peer = conn.peer_addr().map_or("?".into(), |a| a.to_string());
            shared.refuse(
                &peer,
                &anyhow!("{MAX_HANDSHAKING} other connections are handshaking"),
            );
            continue;
        };
        let client = shared.clone();
        let _ = std::thread::Builder::new()
            .name("ferl-store-conn".into())
            .spawn(move || serve_client(&client, conn, ticket));
    }
}

/// Serves one connection: the handshake (holding `ticket`), then its requests.
fn serve_client(shared: &Shared, mut conn: TcpStream, ticket: HandshakeTicket) {
    let peer = conn.peer_addr().map_or("?".into(), |a| a.to_string());
    let admitted = admit(shared, &mut conn);
    drop(ticket);
    match admitted {
        Ok(()) => {
            if let Err(e) = serve_requests(shared, conn) {
                tracing::debug!("rendezvous store: client at {peer}: {e:#}");
            }
        }
        Err(e) if !shared.stopped.load(Ordering::Acquire) => shared.refuse(&peer, &e),
        Err(_) => {}
    }
}

/// Runs the server's side of the handshake on `conn`; afterwards its reads wait as long as requests take.
fn admit(shared: &Shared, conn: &mut TcpStream) -> Result<()> {
    conn.set_nodelay(true)?;
    let timeout = Duration::from_millis(shared.handshake_ms.load(Ordering::Acquire));
    let handshake = Handshake {
        secret: &shared.secret,
        context: STORE_CONTEXT,
        timeout,
    };
    handshake.respond(conn, 0, |_| Ok(Vec::new()))?;
    conn.set_read_timeout(None)?;
    conn.set_write_timeout(None)?;
    Ok(())
}

fn serve_requests(shared: &Shared, mut conn: TcpStream) -> Result<()> {
    loop {
        let mut op = [0u8; 1];
        if conn.read_exact(&mut op).is_err() || shared.stopped.load(Ordering::Acquire) {
            return Ok(());
        }
        let key = String::from_utf8(read_blob(&mut conn, MAX_KEY)?)?;
        match op[0] {
            OP_SET => {
                let value = read_blob(&mut conn, MAX_VALUE)?;
                let mut entries = shared
                    .entries
                    .lock()
                    .map_err(|_| anyhow!("store lock poisoned"))?;
                entries.insert(key, value);
                shared.changed.notify_all();
                drop(entries);
                conn.write_all(&[0])?;
            }
            OP_GET => {
                let mut ms = [0u8; 8];
                conn.read_exact(&mut ms)?;
                let timeout = Duration::from_millis(u64::from_le_bytes(ms));
                match wait_for_key(&shared.entries, &shared.changed, &key, timeout) {
                    Ok(value) => {
                        let mut reply = Vec::with_capacity(5 + value.len());
                        reply.push(0);
                        reply.extend_from_slice(&(value.len() as u32).to_le_bytes());
                        reply.extend_from_slice(&value);
                        conn.write_all(&reply)?;
                    }
                    Err(_) => conn.write_all(&[1])?,
                }
            }
            other => bail!("rendezvous store: unknown request op {other}"),
        }
    }
}

fn read_blob(conn: &mut TcpStream, max: usize) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    conn.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        bail!("rendezvous store: entry of {len} bytes exceeds the limit of {max}");
    }
    let mut blob = vec![0u8; len];
    conn.read_exact(&mut blob)?;
    Ok(blob)
}

/// A client of a [`TcpStoreServer`]; implements [`Rendezvous`]. Optionally owns the server (rank 0).
pub struct TcpStore {
    conn: Mutex<TcpStream>,
    server_addr: SocketAddr,
    local_ip: IpAddr,
    secret: JobSecret,
    _server: Option<TcpStoreServer>,
}

impl TcpStore {
    /// Connects to the store at `addr` and proves `secret`, retrying the connection until `timeout` (the host rank may
    /// start later); a refused handshake fails at once.
    pub fn connect(addr: &str, secret: &JobSecret, timeout: Duration) -> Result<Self> {
        Self::connect_with_server(addr, secret, timeout, None)
    }

    /// Hosts the store on `bind` (e.g. `0.0.0.0:29500`) for clients holding `secret`, and connects to it as one.
    pub fn host(bind: &str, secret: &JobSecret, timeout: Duration) -> Result<Self> {
        let server = TcpStoreServer::bind(bind, secret.clone())?;
        let port = server.local_addr().port();
        let host = if server.local_addr().ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            server.local_addr().ip().to_string()
        };
        Self::connect_with_server(&format!("{host}:{port}"), secret, timeout, Some(server))
    }

    fn connect_with_server(
        addr: &str,
        secret: &JobSecret,
        timeout: Duration,
        server: Option<TcpStoreServer>,
    ) -> Result<Self> {
        let (conn, server_addr) = connect_retrying(addr, timeout)?;
        let local_ip = conn.local_addr()?.ip();
        let conn = authenticate(conn, server_addr, secret)?;
        Ok(Self {
            conn: Mutex::new(conn),
            server_addr,
            local_ip,
            secret: secret.clone(),
            _server: server,
        })
    }

    /// This machine's address on the route to the store: where the other ranks can reach this rank.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// The store's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.server_addr
    }
}

/// Connects to the first address of `addr` that answers, retrying until `timeout`.
fn connect_retrying(addr: &str, timeout: Duration) -> Result<(TcpStream, SocketAddr)> {
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        let resolved: Vec<SocketAddr> = match addr.to_socket_addrs() {
            Ok(it) => it.collect(),
            Err(e) => {
                last_err = Some(anyhow!(e));
                Vec::new()
            }
        };
        for sa in &resolved {
            match TcpStream::connect_timeout(sa, Duration::from_secs(2)) {
                Ok(conn) => return Ok((conn, *sa)),
                Err(e) => last_err = Some(anyhow!(e)),
            }
        }
        if Instant::now() >= deadline {
            let why = last_err
                .map(|e| e.to_string())
                .unwrap_or_else(|| "no address".into());
            bail!("rendezvous store at {addr} unreachable for {timeout:?}: {why}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs the client's side of the handshake on `conn`; afterwards its reads wait as long as requests take.
fn authenticate(mut conn: TcpStream, server: SocketAddr, secret: &JobSecret) -> Result<TcpStream> {
    conn.set_nodelay(true)?;
    let handshake = Handshake {
        secret,
        context: STORE_CONTEXT,
        timeout: HANDSHAKE_TIMEOUT,
    };
    handshake.initiate(&mut conn, &[], 0).with_context(|| {
        format!(
            "rendezvous store at {server}: authenticating this rank (every rank needs the same job secret, \
             {JOB_SECRET_ENV} for launcher runs)"
        )
    })?;
    conn.set_read_timeout(None)?;
    conn.set_write_timeout(None)?;
    Ok(conn)
}

impl Rendezvous for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = Vec::with_capacity(9 + key.len() + value.len());
        req.push(OP_SET);
        req.extend_from_slice(&(key.len() as u32).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(&(value.len() as u32).to_le_bytes());
        req.extend_from_slice(value);
        let mut conn = self
            .conn
            .lock()
            .map_err(|_| anyhow!("store client lock poisoned"))?;
        let mut status = [0u8; 1];
        conn.write_all(&req)
            .and_then(|_| conn.read_exact(&mut status))
            .with_context(|| {
                format!(
                    "rendezvous store at {}: setting key `{key}`",
                    self.server_addr
                )
            })?;
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut req = Vec::with_capacity(13 + key.len());
        req.push(OP_GET);
        req.extend_from_slice(&(key.len() as u32).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        let mut conn = self
            .conn
            .lock()
            .map_err(|_| anyhow!("store client lock poisoned"))?;
        let ctx = || {
            format!(
                "rendezvous store at {}: waiting for key `{key}`",
                self.server_addr
            )
        };
        conn.write_all(&req).with_context(ctx)?;
        let mut status = [0u8; 1];
        conn.read_exact(&mut status).with_context(ctx)?;
        if status[0] != 0 {
            bail!(
                "rendezvous key `{key}` was not set within {timeout:?} (store at {})",
                self.server_addr
            );
        }
        read_blob(&mut conn, MAX_VALUE).with_context(ctx)
    }

    fn job_secret(&self) -> Option<JobSecret> {
        Some(self.secret.clone())
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
