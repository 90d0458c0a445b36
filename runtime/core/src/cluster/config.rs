//! The bootstrap layer's view of the environment: [`lookup`] is the one function of the runtime that reads the
//! process environment; [`RuntimeConfig::from_env`] parses everything through it. `init`, `connect`,
//! `start_head`, `start_node` and worker mode call it once and pass the config down; the session helpers of
//! `ferl start/stop` and [`shipped_files`] read their variables through it too.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::control::blobs::{shipped_files_in, SHIPPED_FILES_ENV};
use crate::control::config::RuntimeConfig;
use crate::security::session;

/// A variable of this process's environment, `None` when it is unset (or not UTF-8). The only place the runtime
/// reads its environment (`tests/layers.rs` checks that no other file does).
pub(crate) fn lookup(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl RuntimeConfig {
    /// The settings of this process's environment (through [`lookup`]), else the defaults.
    pub fn from_env() -> Self {
        Self::from_lookup(lookup)
    }
}

/// Every file shipped to this worker, name → local path (empty outside a worker or when nothing was shipped).
pub fn shipped_files() -> anyhow::Result<BTreeMap<String, PathBuf>> {
    shipped_files_in(lookup(SHIPPED_FILES_ENV))
}

/// The local path of the file shipped to this worker under `name`, if one was.
pub fn shipped_file(name: &str) -> anyhow::Result<Option<PathBuf>> {
    Ok(shipped_files()?.remove(name))
}

/// The session root folder (`FERL_TMPDIR`, default `/tmp/ferl`).
pub fn root() -> PathBuf {
    RuntimeConfig::from_env().session_root
}

/// The token of the head on this machine (`session_latest/token` under the session root), if any.
pub fn local_token() -> Option<String> {
    session::local_token(&root())
}

/// The address of the head on this machine, if any.
pub fn local_address() -> Option<String> {
    session::local_address(&root())
}

/// The token to join with: the one given, else `FERL_TOKEN`, else the local head's.
pub fn resolve_token(given: Option<String>) -> anyhow::Result<String> {
    let cfg = RuntimeConfig::from_env();
    session::resolve_token(given, cfg.token, &cfg.session_root)
}

/// Stops every head or node process that `ferl start` recorded under the session root: SIGTERM, then SIGKILL for
/// any still running after `grace`. Returns the pids that were stopped; none of them runs when this returns.
pub fn stop_local(grace: Duration) -> Vec<i32> {
    session::stop_local(&root(), grace)
}
