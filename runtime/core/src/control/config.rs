//! The runtime's one configuration ([`RuntimeConfig`]): every setting the environment can give, parsed in one
//! place from a lookup function (a variable's value by name). The bootstrap layer (`init`, `connect`,
//! `start_head`, `start_node`, worker mode) builds it once, from the process environment with
//! `RuntimeConfig::from_env`, and passes it down; no module below the bootstrap layer reads the environment.

use std::path::PathBuf;
use std::time::Duration;

pub(crate) use crate::security::session::{ROOT_ENV, TOKEN_ENV};
use crate::transport::config::TransportConfig;

/// Environment variable: heartbeat bound in milliseconds (default 3000).
pub(crate) const HEARTBEAT_BOUND_ENV: &str = "FERL_HEARTBEAT_BOUND_MS";
/// Environment variable naming a running cluster's head (`HOST:PORT`) for `connect_or_init`.
pub(crate) const ADDRESS_ENV: &str = "FERL_ADDRESS";
/// Environment variable: where a node caches fetched driver binaries (default `~/.cache/ferl/bin`).
pub(crate) const BIN_CACHE_ENV: &str = "FERL_BIN_CACHE";
/// Environment variable: `1` makes a node always fetch the driver's binary (tests the fetch path).
pub(crate) const FORCE_FETCH_ENV: &str = "FERL_NODE_FORCE_FETCH";
/// Environment variable: set (and not `0`), an embedded cluster keeps its session folder after a clean shutdown.
pub(crate) const KEEP_SESSION_ENV: &str = "FERL_KEEP_SESSION";
/// Environment variable: worker threads of a worker process's tokio runtime (default: one per core).
pub(crate) const WORKER_THREADS_ENV: &str = "FERL_WORKER_THREADS";

/// Default heartbeat bound.
pub(crate) const DEFAULT_HEARTBEAT_BOUND: Duration = Duration::from_millis(3000);

/// Every setting of the runtime that the environment can give (the variables are listed in `runtime/README.md`).
/// Build it with `RuntimeConfig::from_env()` (the process environment) or [`RuntimeConfig::from_lookup`] (any
/// source, e.g. a map in a test), then change fields as needed; `Default` is what an empty environment gives.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeConfig {
    /// Lanes, rings and bulk limits (`FERL_LANES`, `FERL_SHM_BYTES`, `FERL_BULK_UNCLAIMED_*`).
    pub transport: TransportConfig,
    /// A node is declared dead after this long without heartbeats (`FERL_HEARTBEAT_BOUND_MS`, default 3 s; a
    /// value that is not a number of milliseconds means the default).
    pub heartbeat_bound: Duration,
    /// The running cluster `connect_or_init` joins (`FERL_ADDRESS`; unset or empty: start an embedded one).
    pub address: Option<String>,
    /// The cluster token to join with when none is given (`FERL_TOKEN`).
    pub token: Option<String>,
    /// The session root (`FERL_TMPDIR`, default `/tmp/ferl`).
    pub session_root: PathBuf,
    /// Where a node caches fetched driver binaries (`FERL_BIN_CACHE`, default `$HOME/.cache/ferl/bin`, or
    /// `/tmp/.cache/ferl/bin` without `HOME`).
    pub bin_cache: PathBuf,
    /// A node always fetches the driver's binary (`FERL_NODE_FORCE_FETCH=1`).
    pub force_fetch: bool,
    /// Worker threads of a worker process's runtime (`FERL_WORKER_THREADS`; unset, 0 or not a number: one per
    /// core).
    pub worker_threads: Option<usize>,
    /// An embedded cluster ([`crate::init`]) keeps its session folder, worker logs included, after a clean shutdown
    /// (`FERL_KEEP_SESSION` set and not `0`; by default it is removed).
    pub keep_session: bool,
    /// Values that were ignored, each naming its variable (also logged as warnings when read).
    pub warnings: Vec<String>,
}

impl Default for RuntimeConfig {
    /// What an empty environment gives.
    fn default() -> Self {
        Self::from_lookup(|_| None)
    }
}

impl RuntimeConfig {
    /// The settings `lookup` gives (a variable's value by name, `None` when unset), else the defaults. Values it
    /// ignores are kept in [`RuntimeConfig::warnings`], naming the variable, and logged.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let mut warnings = Vec::new();
        let transport = TransportConfig::from_lookup(&lookup, &mut |w: String| warnings.push(w));
        for w in &warnings {
            tracing::warn!("{w}");
        }
        let heartbeat_bound = lookup(HEARTBEAT_BOUND_ENV)
            .and_then(|v| v.parse().ok())
            .map_or(DEFAULT_HEARTBEAT_BOUND, Duration::from_millis);
        let bin_cache = lookup(BIN_CACHE_ENV).map(PathBuf::from).unwrap_or_else(|| {
            lookup("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/tmp".into())
                .join(".cache/ferl/bin")
        });
        Self {
            transport,
            heartbeat_bound,
            address: lookup(ADDRESS_ENV).filter(|a| !a.is_empty()),
            token: lookup(TOKEN_ENV),
            session_root: lookup(ROOT_ENV).map_or_else(|| "/tmp/ferl".into(), PathBuf::from),
            bin_cache,
            force_fetch: lookup(FORCE_FETCH_ENV).is_some_and(|v| v == "1"),
            worker_threads: lookup(WORKER_THREADS_ENV)
                .and_then(|v| v.trim().parse().ok())
                .filter(|n| *n > 0),
            keep_session: lookup(KEEP_SESSION_ENV).is_some_and(|v| !v.is_empty() && v != "0"),
            warnings,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn from(pairs: &[(&str, &str)]) -> RuntimeConfig {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RuntimeConfig::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn a_map_gives_every_setting_without_the_process_environment() {
        let cfg = from(&[
            ("FERL_HEARTBEAT_BOUND_MS", "750"),
            ("FERL_LANES", "0"),
            ("FERL_SHM_BYTES", "4096"),
            ("FERL_BULK_UNCLAIMED_BYTES", "1000"),
            ("FERL_BULK_UNCLAIMED_PAYLOADS", "3"),
            ("FERL_BULK_UNCLAIMED_TIMEOUT_S", "1.5"),
            ("FERL_ADDRESS", "10.0.0.1:4000"),
            ("FERL_TOKEN", "t0k"),
            ("FERL_TMPDIR", "/x/ferl"),
            ("HOME", "/home/u"),
            ("FERL_NODE_FORCE_FETCH", "1"),
            ("FERL_WORKER_THREADS", "3"),
            ("FERL_KEEP_SESSION", "1"),
        ]);
        assert_eq!(cfg.heartbeat_bound, Duration::from_millis(750));
        assert!(!cfg.transport.lanes);
        assert_eq!(cfg.transport.shm_bytes, 4096);
        assert_eq!(cfg.transport.bulk.bytes, 1000);
        assert_eq!(cfg.transport.bulk.payloads, 3);
        assert_eq!(cfg.transport.bulk.timeout, Duration::from_millis(1500));
        assert_eq!(cfg.address.as_deref(), Some("10.0.0.1:4000"));
        assert_eq!(cfg.token.as_deref(), Some("t0k"));
        assert_eq!(cfg.session_root, PathBuf::from("/x/ferl"));
        assert_eq!(cfg.bin_cache, PathBuf::from("/home/u/.cache/ferl/bin"));
        assert!(cfg.force_fetch);
        assert_eq!(cfg.worker_threads, Some(3));
        assert!(cfg.keep_session);
        assert!(!from(&[("FERL_KEEP_SESSION", "0")]).keep_session && !from(&[]).keep_session);
        assert!(cfg.warnings.is_empty());
        assert_eq!(
            from(&[("FERL_BIN_CACHE", "/c"), ("FERL_SHM_BYTES", "0")]).bin_cache,
            PathBuf::from("/c")
        );
    }

    #[test]
    fn an_empty_lookup_gives_the_documented_defaults() {
        let cfg = from(&[]);
        assert_eq!(cfg, RuntimeConfig::default());
        assert_eq!(cfg.heartbeat_bound, Duration::from_secs(3));
        assert!(cfg.transport.lanes);
        assert_eq!(cfg.transport.shm_bytes, 256 << 20);
        assert_eq!(cfg.transport.bulk.bytes, 4 << 30);
        assert_eq!(cfg.transport.bulk.payloads, 1024);
        assert_eq!(cfg.transport.bulk.timeout, Duration::from_secs(300));
        assert_eq!(cfg.address, None);
        assert_eq!(cfg.session_root, PathBuf::from("/tmp/ferl"));
        assert_eq!(cfg.bin_cache, PathBuf::from("/tmp/.cache/ferl/bin"));
        assert!(!cfg.force_fetch);
        assert_eq!(cfg.worker_threads, None);
        assert_eq!(from(&[("FERL_ADDRESS", "")]).address, None);
    }

    #[test]
    fn a_bad_value_is_reported_naming_its_variable_and_ignored() {
        let cfg = from(&[
            ("FERL_BULK_UNCLAIMED_PAYLOADS", "many"),
            ("FERL_BULK_UNCLAIMED_TIMEOUT_S", "-1"),
        ]);
        assert_eq!(cfg.transport.bulk.payloads, 1024);
        assert_eq!(cfg.transport.bulk.timeout, Duration::from_secs(300));
        assert_eq!(
            cfg.warnings,
            [
                "FERL_BULK_UNCLAIMED_PAYLOADS=\"many\" is not a non-negative number; using 1024",
                "FERL_BULK_UNCLAIMED_TIMEOUT_S=\"-1\" is not a non-negative number; using 300",
            ]
        );
        // As before: variables without a reported check fall back to their defaults.
        let cfg = from(&[
            ("FERL_HEARTBEAT_BOUND_MS", "soon"),
            ("FERL_SHM_BYTES", "big"),
            ("FERL_WORKER_THREADS", "0"),
        ]);
        assert_eq!(cfg.heartbeat_bound, Duration::from_secs(3));
        assert_eq!(cfg.transport.shm_bytes, 256 << 20);
        assert_eq!(cfg.worker_threads, None);
    }
}
