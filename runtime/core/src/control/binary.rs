//! The file server every driver hosts (actor id [`BINARY_ACTOR`]): node agents on machines that lack the driver's
//! binary ask for its sha256, then fetch it once and cache it by that hash; and they fetch the files a spawn asked to
//! ship ([`crate::SpawnOptions::ship_file`]) by sha256, in chunks, into the node's cache ([`crate::control::blobs`]).
//!
//! The server only hands out files this process offered ([`offer_files`]), by content hash: a member that knows a
//! hash it was not given learns nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, Context as _, Result};
use rkyv::{Archive, Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;

use crate::actor::process::{Process, BINARY_ACTOR};
use crate::actor::{Actor, Context, Handler};
use crate::control::blobs::ShippedFile;
use crate::protocol::{BinaryBlob, BinaryDigest, BinarySpec, FetchBinary};

/// The largest chunk one [`FetchFileChunk`] returns (well under the wire's frame limit).
pub(crate) const FILE_CHUNK_BYTES: u64 = 4 << 20;

/// Node agent → driver: bytes `offset..offset + len` of the offered file with this sha256.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct FetchFileChunk {
    /// sha256 (hex) of the whole file.
    pub sha256: String,
    /// First byte.
    pub offset: u64,
    /// Bytes wanted (at most [`FILE_CHUNK_BYTES`]).
    pub len: u64,
}

pinned_message!("ferl_runtime::binary"; FetchFileChunk => Vec<u8>);

/// Serves the binary workers run and the files this process offered to ship.
#[derive(Clone)]
pub(crate) struct BinaryServer {
    path: PathBuf,
    digest: Arc<OnceCell<String>>,
}

impl BinaryServer {
    /// Hosts a server for `path` in `process` and returns the spec spawns carry.
    pub(crate) fn host(process: &Arc<Process>, path: PathBuf) -> Result<BinarySpec> {
        let meta = std::fs::metadata(&path)
            .with_context(|| format!("worker binary {}", path.display()))?;
        let mtime_ns = mtime_ns(&meta)?;
        let spec = BinarySpec {
            path: path.display().to_string(),
            size: meta.len(),
            mtime_ns,
            server: process.addr.to_string(),
        };
        process.host(
            BINARY_ACTOR,
            BinaryServer {
                path,
                digest: Arc::new(OnceCell::new()),
            },
            4,
            16,
        );
        Ok(spec)
    }

    async fn read(&self) -> Result<Vec<u8>> {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            std::fs::read(&path).with_context(|| format!("reading {}", path.display()))
        })
        .await?
    }

    async fn digest(&self) -> Result<String> {
        let d = self
            .digest
            .get_or_try_init(|| async {
                Ok::<_, anyhow::Error>(hex::encode(Sha256::digest(self.read().await?)))
            })
            .await?;
        Ok(d.clone())
    }
}

fn mtime_ns(meta: &std::fs::Metadata) -> Result<u64> {
    Ok(meta
        .modified()?
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64)
}

impl Actor for BinaryServer {
    type Args = ();
    const NAME: &'static str = "ferl.BinaryServer";
    async fn start(_: (), _: &Context) -> Result<Self> {
        bail!("the binary server is started by the driver, not spawned")
    }
}

crate::actor_dispatch!(BinaryServer, calls: [BinaryDigest, FetchBinary, FetchFileChunk]);

impl Handler<BinaryDigest> for BinaryServer {
    async fn handle(&self, _: BinaryDigest, _: &Context) -> Result<String> {
        self.digest().await
    }
}

impl Handler<FetchBinary> for BinaryServer {
    async fn handle(&self, _: FetchBinary, _: &Context) -> Result<BinaryBlob> {
        let bytes = self.read().await?;
        let sha256 = hex::encode(Sha256::digest(&bytes));
        Ok(BinaryBlob { sha256, bytes })
    }
}

impl Handler<FetchFileChunk> for BinaryServer {
    async fn handle(&self, m: FetchFileChunk, _: &Context) -> Result<Vec<u8>> {
        let path = offered()
            .lock()
            .expect("offered files lock")
            .by_sha
            .get(&m.sha256)
            .cloned()
            .with_context(|| format!("no file with sha256 {} is offered here", m.sha256))?;
        let len = m.len.min(FILE_CHUNK_BYTES);
        let bytes = tokio::task::spawn_blocking(move || read_range(&path, m.offset, len)).await??;
        CHUNKS_SERVED.fetch_add(1, Ordering::Relaxed);
        Ok(bytes)
    }
}

fn read_range(path: &Path, offset: u64, len: u64) -> Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)
        .with_context(|| format!("opening shipped file {}", path.display()))?;
    f.seek(SeekFrom::Start(offset))?;
    let mut out = Vec::with_capacity(len as usize);
    f.take(len)
        .read_to_end(&mut out)
        .with_context(|| format!("reading shipped file {}", path.display()))?;
    Ok(out)
}

/// Files this process offers, by sha256, and the hashes of paths already read (by size and mtime).
#[derive(Default)]
struct Offered {
    by_sha: HashMap<String, PathBuf>,
    hashed: HashMap<PathBuf, (u64, u64, String)>,
}

fn offered() -> &'static Mutex<Offered> {
    static OFFERED: OnceLock<Mutex<Offered>> = OnceLock::new();
    OFFERED.get_or_init(Default::default)
}

static CHUNKS_SERVED: AtomicU64 = AtomicU64::new(0);

/// How many file chunks this process's file server has sent (each transfer of a file sends at least one).
pub(crate) fn file_chunks_served() -> u64 {
    CHUNKS_SERVED.load(Ordering::Relaxed)
}

/// Offers each file of `files` (named by its driver path) from this process's file server at `server`: hashes it
/// (once per path, size and mtime) and fills in its sha256, size and server address. A missing file is an error
/// naming it and the shipped name.
pub(crate) fn offer_files(server: &str, files: &mut [ShippedFile]) -> Result<()> {
    for f in files {
        let path = PathBuf::from(&f.driver_path);
        let meta = std::fs::metadata(&path)
            .with_context(|| format!("file `{}` to ship ({})", f.name, path.display()))?;
        if !meta.is_file() {
            bail!(
                "file `{}` to ship ({}) is not a regular file",
                f.name,
                path.display()
            );
        }
        let (size, mtime) = (meta.len(), mtime_ns(&meta)?);
        let known = offered()
            .lock()
            .expect("offered files lock")
            .hashed
            .get(&path)
            .filter(|(s, m, _)| *s == size && *m == mtime)
            .map(|(_, _, h)| h.clone());
        let sha = match known {
            Some(h) => h,
            None => {
                let bytes = std::fs::read(&path).with_context(|| {
                    format!("reading file `{}` to ship ({})", f.name, path.display())
                })?;
                hex::encode(Sha256::digest(&bytes))
            }
        };
        let mut o = offered().lock().expect("offered files lock");
        o.hashed.insert(path.clone(), (size, mtime, sha.clone()));
        o.by_sha.insert(sha.clone(), path.clone());
        f.sha256 = sha;
        f.size = size;
        f.server = server.to_string();
        if f.file_name.is_empty() {
            f.file_name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
        }
    }
    Ok(())
}
