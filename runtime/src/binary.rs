//! The binary server every driver hosts (actor id [`BINARY_ACTOR`]): node agents on machines that lack the driver's
//! binary ask for its sha256, then fetch it once and cache it by that hash.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;

use crate::actor::{Actor, Context, Handler};
use crate::process::{Process, BINARY_ACTOR};
use crate::protocol::{BinaryBlob, BinaryDigest, BinarySpec, FetchBinary};

/// Serves one file (the binary workers run).
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
        let mtime_ns = meta
            .modified()?
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64;
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

impl Actor for BinaryServer {
    type Args = ();
    const NAME: &'static str = "ferl.BinaryServer";
    async fn start(_: (), _: &Context) -> Result<Self> {
        bail!("the binary server is started by the driver, not spawned")
    }
}

crate::actor_dispatch!(BinaryServer, calls: [BinaryDigest, FetchBinary]);

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
