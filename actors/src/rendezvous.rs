//! [`ClusterRendezvous`]: the collective layer's [`Rendezvous`] over the runtime head's key-value store, so the
//! ranks of a resource group find each other through the cluster they were spawned in.

use std::time::Duration;

use anyhow::{Context as _, Result};
use ferl_collective::Rendezvous;
use ferl_runtime::Cluster;

/// Keys live under `prefix/` in the head's store. The methods block on the runtime through `handle`, so call them
/// from a thread outside the async executor (the trainer rank builds its communicator in `spawn_blocking`).
pub struct ClusterRendezvous {
    cluster: Cluster,
    handle: tokio::runtime::Handle,
    prefix: String,
}

impl ClusterRendezvous {
    /// A rendezvous over `cluster`'s store; `handle` is the runtime the cluster's connections run on.
    pub fn new(cluster: Cluster, handle: tokio::runtime::Handle, prefix: &str) -> Self {
        Self {
            cluster,
            handle,
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }

    fn full_key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

impl Rendezvous for ClusterRendezvous {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = self.full_key(key);
        self.handle
            .block_on(self.cluster.kv_put(&key, value.to_vec()))
            .with_context(|| format!("rendezvous: storing key `{key}` on the cluster head"))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let key = self.full_key(key);
        self.handle
            .block_on(self.cluster.kv_wait(&key, timeout))
            .with_context(|| {
                format!("rendezvous: waiting {timeout:?} for key `{key}` on the cluster head")
            })
    }
}
