//! The plugin host of one job, and where plugins are found.
//!
//! A job loads, in this order (a plugin name is loaded once: the first file that holds it wins):
//! 1. the folders its caller names and those of `$FERL_PLUGIN_PATH` (watched: new files are loaded while it runs);
//! 2. the first-party plugins ([`FIRST_PARTY_PLUGINS`]) found in the default folders ([`default_plugin_folders`]):
//!    the running executable's folder, where cargo puts `libferl_plugin_*.so` beside `ferl` when they are built
//!    together (`cargo build --release -p ferl -p ferl-plugin-tensorboard ...`, as `scripts/demo.sh` does), and its
//!    `plugins/` subfolder for installs that keep them there. Only those file names are loaded from the default
//!    folders, so the other libraries of a cargo target folder (test plugins, templates) are never opened.
//!    `FERL_NO_DEFAULT_PLUGINS=1` turns this off.

use anyhow::Result;
use ferl_plugin_host::cargo_build::cdylib_file_name;
use ferl_plugin_host::PluginHost;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Environment variable listing extra plugin folders (`:`-separated), watched by every job.
pub const PLUGIN_PATH_ENV: &str = "FERL_PLUGIN_PATH";

/// Environment variable that turns the default plugin folders off ([`default_plugin_folders`] is empty) when set to
/// anything but empty, `0` or `false`: a job then loads only the folders it is given and `$FERL_PLUGIN_PATH`.
pub const NO_DEFAULT_PLUGINS_ENV: &str = "FERL_NO_DEFAULT_PLUGINS";

/// The first-party plugins, found in the default folders: `(cargo package, plugin name)`. Their files are cargo's
/// cdylib names of the packages ([`cdylib_file_name`], e.g. `libferl_plugin_tensorboard.so`).
pub const FIRST_PARTY_PLUGINS: [(&str, &str); 5] = [
    ("ferl-plugin-tensorboard", "tensorboard"),
    ("ferl-plugin-csv", "csv"),
    ("ferl-plugin-alpaca", "alpaca"),
    ("ferl-plugin-liger", "liger"),
    ("ferl-plugin-gsm8k", "gsm8k"),
];

/// The default plugin folders, searched for the first-party plugins after the job's own folders and
/// `$FERL_PLUGIN_PATH`: the folder of the running executable (`target/release/` for a cargo-built `ferl`, where the
/// first-party plugins land when built with it) and its `plugins/` subfolder when there is one (installs that copy
/// the binaries). Empty when `$FERL_NO_DEFAULT_PLUGINS` is set (see [`NO_DEFAULT_PLUGINS_ENV`]) or the executable's
/// path is unknown.
pub fn default_plugin_folders() -> Vec<PathBuf> {
    let off = std::env::var(NO_DEFAULT_PLUGINS_ENV)
        .is_ok_and(|v| !matches!(v.trim(), "" | "0" | "false"));
    if off {
        return Vec::new();
    }
    let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
    else {
        return Vec::new();
    };
    let sub = dir.join("plugins");
    let mut folders = vec![dir];
    if sub.is_dir() {
        folders.push(sub);
    }
    folders
}

/// The folders of `$FERL_PLUGIN_PATH` (`:`-separated; empty entries skipped).
pub fn plugin_path_folders() -> Vec<PathBuf> {
    std::env::var_os(PLUGIN_PATH_ENV)
        .map(|p| {
            std::env::split_paths(&p)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// The first-party plugin files present in the default folders, as `(plugin name, file)`: for each plugin, the file
/// of the first folder that has one.
pub fn default_plugin_files() -> Vec<(String, PathBuf)> {
    let folders = default_plugin_folders();
    FIRST_PARTY_PLUGINS
        .iter()
        .filter_map(|(package, name)| {
            let file_name = cdylib_file_name(package);
            folders
                .iter()
                .map(|dir| dir.join(&file_name))
                .find(|f| f.is_file())
                .map(|f| (name.to_string(), f))
        })
        .collect()
}

/// Loads into `host` each first-party plugin of the default folders ([`default_plugin_files`]) whose name is not
/// loaded yet (a plugin of the same name from the job's folders or `$FERL_PLUGIN_PATH` wins). The files are watched
/// like any loaded file (a rebuilt one is loaded as a new version). A file that fails to load is logged and skipped.
/// Each load is logged at debug level and all of them in one info line (`loaded first-party plugins csv@0.1.0, ...
/// from DIR`), so a command does not open with a line per plugin. Returns how many were loaded.
pub fn load_default_plugins(host: &PluginHost) -> usize {
    let mut loaded: Vec<String> = Vec::new();
    let mut dirs: Vec<PathBuf> = Vec::new();
    for (name, file) in default_plugin_files() {
        if host.get(&name).is_some() {
            tracing::debug!(
                "first-party plugin `{name}` at {} not loaded: a plugin of that name is loaded already",
                file.display()
            );
            continue;
        }
        match host.load_file(&file, None) {
            Ok(p) => {
                tracing::debug!("loaded plugin {} from {}", p.label(), file.display());
                loaded.push(p.label());
                let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
                if !dirs.contains(&dir) {
                    dirs.push(dir);
                }
            }
            Err(e) => tracing::warn!("plugin skipped: {e:#}"),
        }
    }
    if !loaded.is_empty() {
        let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        tracing::info!(
            "loaded first-party plugins {} from {}",
            loaded.join(", "),
            dirs.join(", ")
        );
    }
    loaded.len()
}

/// A host for the job whose run directory is `run_dir` (its control channel lives there, so
/// `ferl plugin list|reload --run-dir RUN_DIR` reach it), watching `folders` and those in `$FERL_PLUGIN_PATH`, then
/// holding the first-party plugins of the default folders that those did not provide ([`load_default_plugins`]).
/// Files that fail to load are logged and skipped (a bad plugin never stops a job that does not use it).
pub fn job_plugin_host(run_dir: &Path, folders: &[PathBuf]) -> Result<Arc<PluginHost>> {
    let host = PluginHost::for_run_dir(run_dir)?;
    let mut all: Vec<PathBuf> = folders.to_vec();
    all.extend(plugin_path_folders());
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
    load_default_plugins(&host);
    Ok(Arc::new(host))
}
