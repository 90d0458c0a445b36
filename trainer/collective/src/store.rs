//! A standalone TCP key-value store for rendezvous, torchrun-style: rank 0 hosts it at `MASTER_ADDR:MASTER_PORT` and
//! every rank (rank 0 included) talks to it as a client.
//!
//! Wire format, one request at a time per connection: `op:u8, key_len:u32 LE, key`, then for SET `value_len:u32 LE,
//! value`, for GET `timeout_ms:u64 LE`. Replies: `status:u8` (0 ok, 1 timed out), then for GET `value_len:u32, value`.

use crate::rendezvous::{wait_for_key, Rendezvous};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const MAX_KEY: usize = 4096;
const MAX_VALUE: usize = 64 << 20;

#[derive(Default)]
struct Shared {
    entries: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stopped: AtomicBool,
}

/// The store's server side: accepts clients on a thread until dropped.
pub struct TcpStoreServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl TcpStoreServer {
    /// Listens on `addr` (port 0 picks a free port) and serves in background threads.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        let listener = TcpListener::bind(&addr)
            .with_context(|| format!("rendezvous store: cannot listen on {addr:?}"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let serving = shared.clone();
        std::thread::Builder::new()
            .name("ferl-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if serving.stopped.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let client = serving.clone();
                    let _ = std::thread::Builder::new()
                        .name("ferl-store-conn".into())
                        .spawn(move || {
                            let _ = serve_client(&client, conn);
                        });
                }
            })?;
        Ok(Self { shared, addr })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn serve_client(shared: &Shared, mut conn: TcpStream) -> Result<()> {
    conn.set_nodelay(true)?;
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
    _server: Option<TcpStoreServer>,
}

impl TcpStore {
    /// Connects to the store at `addr`, retrying until `timeout` (the host rank may start later).
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        Self::connect_with_server(addr, timeout, None)
    }

    /// Hosts the store on `bind` (e.g. `0.0.0.0:29500`) and connects to it as a client.
    pub fn host(bind: &str, timeout: Duration) -> Result<Self> {
        let server = TcpStoreServer::bind(bind)?;
        let port = server.local_addr().port();
        let host = if server.local_addr().ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            server.local_addr().ip().to_string()
        };
        Self::connect_with_server(&format!("{host}:{port}"), timeout, Some(server))
    }

    fn connect_with_server(
        addr: &str,
        timeout: Duration,
        server: Option<TcpStoreServer>,
    ) -> Result<Self> {
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
                    Ok(conn) => {
                        conn.set_nodelay(true)?;
                        let local_ip = conn.local_addr()?.ip();
                        return Ok(Self {
                            conn: Mutex::new(conn),
                            server_addr: *sa,
                            local_ip,
                            _server: server,
                        });
                    }
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

    /// This machine's address on the route to the store: where the other ranks can reach this rank.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// The store's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.server_addr
    }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_share_keys_through_the_hosted_store() {
        let host = TcpStore::host("127.0.0.1:0", Duration::from_secs(5)).unwrap();
        let addr = host.server_addr().to_string();
        let t = std::thread::spawn(move || {
            let client = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
            let v = client.get("from-host", Duration::from_secs(10)).unwrap();
            client.set("from-client", &[v[0] + 1]).unwrap();
        });
        std::thread::sleep(Duration::from_millis(30));
        host.set("from-host", &[41]).unwrap();
        assert_eq!(
            host.get("from-client", Duration::from_secs(10)).unwrap(),
            vec![42]
        );
        t.join().unwrap();
        let err = host
            .get("never", Duration::from_millis(50))
            .unwrap_err()
            .to_string();
        assert!(err.contains("never"), "{err}");
        assert!(host.local_ip().is_loopback());
    }
}
