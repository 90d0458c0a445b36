//! How ranks find each other: a small key-value interface (set a key, wait for a key) that the actors layer implements
//! over the cluster head's store, plus an in-process implementation for threads and tests.

use crate::JobSecret;
use anyhow::{anyhow, Result};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// A key-value store the ranks of a group share while they connect: rank addresses, NCCL unique ids.
pub trait Rendezvous: Send + Sync {
    /// Stores `value` under `key`, replacing any earlier value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Returns the value under `key`, waiting up to `timeout` for some rank to set it; an error names the key.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// The secret this store's members proved, which the group's connections then use too (when
    /// [`crate::GroupOptions::job_secret`] names none). `None` by default: such a store cannot vouch for its members.
    fn job_secret(&self) -> Option<JobSecret> {
        None
    }
}

/// A rendezvous inside one process (ranks as threads); clone the `Arc` it lives in for each rank. It holds a fresh
/// random [`JobSecret`] that only the threads sharing it know.
pub struct MemoryRendezvous {
    entries: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    secret: Option<JobSecret>,
}

impl MemoryRendezvous {
    /// An empty store with a fresh secret.
    pub fn new() -> Self {
        Self {
            entries: Mutex::default(),
            changed: Condvar::new(),
            secret: JobSecret::generate()
                .map_err(|e| tracing::warn!("in-process rendezvous without a job secret: {e:#}"))
                .ok(),
        }
    }
}

impl Default for MemoryRendezvous {
    fn default() -> Self {
        Self::new()
    }
}

impl Rendezvous for MemoryRendezvous {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut entries = self
            .entries
            .lock()
            .map_err(|_| anyhow!("rendezvous store lock poisoned"))?;
        entries.insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        wait_for_key(&self.entries, &self.changed, key, timeout)
    }

    fn job_secret(&self) -> Option<JobSecret> {
        self.secret.clone()
    }
}

/// Waits on `changed` until `key` is in `entries` or `timeout` passes; shared by the in-memory and TCP stores.
pub(crate) fn wait_for_key(
    entries: &Mutex<HashMap<String, Vec<u8>>>,
    changed: &Condvar,
    key: &str,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut guard = entries
        .lock()
        .map_err(|_| anyhow!("rendezvous store lock poisoned"))?;
    loop {
        if let Some(value) = guard.get(key) {
            return Ok(value.clone());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(anyhow!(
                "rendezvous key `{key}` was not set within {timeout:?}"
            ));
        }
        guard = changed
            .wait_timeout(guard, deadline - now)
            .map_err(|_| anyhow!("rendezvous store lock poisoned"))?
            .0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn get_waits_for_a_later_set_and_times_out_naming_the_key() {
        let store = Arc::new(MemoryRendezvous::new());
        let writer = store.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            writer.set("a/b", b"hello").unwrap();
        });
        assert_eq!(store.get("a/b", Duration::from_secs(10)).unwrap(), b"hello");
        t.join().unwrap();
        let err = store.get("missing", Duration::from_millis(20)).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }
}
