//! The plugin host of one job.

use anyhow::Result;
use ferl_plugin_host::PluginHost;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Environment variable listing extra plugin folders (`:`-separated), watched by every job.
pub const PLUGIN_PATH_ENV: &str = "FERL_PLUGIN_PATH";

/// A host for the job whose run directory is `run_dir` (its control channel lives there, so
/// `ferl plugin list|reload --run-dir RUN_DIR` reach it), watching `folders` and those in `$FERL_PLUGIN_PATH`.
/// Files that fail to load are logged and skipped (a bad plugin never stops a job that does not use it).
pub fn job_plugin_host(run_dir: &Path, folders: &[PathBuf]) -> Result<Arc<PluginHost>> {
    let host = PluginHost::for_run_dir(run_dir)?;
    let mut all: Vec<PathBuf> = folders.to_vec();
    if let Some(p) = std::env::var_os(PLUGIN_PATH_ENV) {
        all.extend(std::env::split_paths(&p).filter(|p| !p.as_os_str().is_empty()));
    }
    for dir in all {
        match host.watch_dir(&dir) {
            Ok(errors) => {
                for e in errors {
                    tracing::warn!("plugin skipped: {e:#}");
                }
            }
            Err(e) => tracing::warn!("{e:#}"),
        }
    }
    Ok(Arc::new(host))
}
