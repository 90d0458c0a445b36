//! Plugins in a distributed run.
//!
//! - The driver opens the job's plugin host as `ferl sft` does in one process (the run directory's, watching
//!   `$FERL_PLUGIN_PATH`, so `ferl plugin list|reload --run-dir` reach it) — [`DriverPlugins::open`] — and resolves
//!   verl's `data.custom_cls.path`/`name` (here: a dataset plugin file and its name) into `data.plugin`.
//! - Each spawn ships the files of the plugins that actor uses ([`DriverPlugins::ship`]): the dataset plugin to
//!   the data loader, the `liger` kernel plugin to the trainer ranks. The file shipped is a snapshot of the loaded
//!   version, kept in the run's content-addressed [`PluginStore`] (`RUN_DIR/plugins/store`), so a plugin rebuilt
//!   while the run goes on cannot change bytes mid-transfer; the runtime moves it by sha256 and each node caches it.
//! - A worker loads what was shipped to it into a plugin host of its own ([`actor_plugin_host`]); without shipped
//!   plugins it watches the node's own `$FERL_PLUGIN_PATH`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use ferl_config::SftConfig;
pub use ferl_plugin_bridge::dataset::resolve_custom_cls;
use ferl_plugin_bridge::job_plugin_host;
use ferl_plugin_bridge::setup::{default_plugin_files, load_default_plugins, plugin_path_folders};
use ferl_plugin_host::{PluginHost, PluginKind, PluginStore};
use ferl_runtime::SpawnOptions;
use ferl_trainer::kernels::KernelRegistry;

/// Shipped-file names of plugin libraries start with this (the rest is the plugin's name).
pub const SHIPPED_PLUGIN_PREFIX: &str = "ferl-plugin:";

/// The name of the fused-kernel plugin `model.use_liger=true` uses.
pub const LIGER: &str = "liger";

/// The driver's plugins of one run.
pub struct DriverPlugins {
    host: Arc<PluginHost>,
    store: PluginStore,
}

impl DriverPlugins {
    /// The job's plugin host in the run directory (`trainer.default_local_dir`), watching `$FERL_PLUGIN_PATH`;
    /// `data.custom_cls.path` (a dataset plugin file) is loaded and becomes `data.plugin` in `cfg`, so the actors
    /// only ever see `data.plugin`.
    pub fn open(cfg: &mut SftConfig) -> Result<Self> {
        Self::open_with(cfg, &[])
    }

    /// [`DriverPlugins::open`], also watching the plugin folders `folders`.
    pub fn open_with(cfg: &mut SftConfig, folders: &[PathBuf]) -> Result<Self> {
        let run_dir = ferl_config::expand_path(&cfg.trainer.default_local_dir);
        let host = job_plugin_host(&run_dir, folders)?;
        resolve_custom_cls(&host, cfg)?;
        if let Some(name) = &cfg.data.plugin {
            host.get_kind(name, PluginKind::Dataset)
                .with_context(|| format!("data.plugin={name}"))?;
        }
        Ok(Self {
            host,
            store: PluginStore::new(run_dir.join("plugins").join("store")),
        })
    }

    /// The plugins of a run whose driver already holds its plugin host `host` (`ferl grpo`'s); what it ships is
    /// snapshotted under `run_dir`.
    pub fn from_host(host: Arc<PluginHost>, run_dir: &Path) -> Self {
        Self {
            host,
            store: PluginStore::new(run_dir.join("plugins").join("store")),
        }
    }

    /// Adds a snapshot of the plugin file `file` to the files `opts` ships, under `key`.
    pub fn ship_file(&self, opts: SpawnOptions, key: &str, file: &Path) -> Result<SpawnOptions> {
        let (_, stored) = self
            .store
            .insert_file(file)
            .with_context(|| format!("snapshotting {} to ship it", file.display()))?;
        Ok(opts.ship_file(key, stored))
    }

    /// The job's plugin host.
    pub fn host(&self) -> &Arc<PluginHost> {
        &self.host
    }

    /// The plugins the data loader uses: the dataset plugin `data.plugin` names.
    pub fn for_data_loader(cfg: &SftConfig) -> Vec<String> {
        cfg.data.plugin.iter().cloned().collect()
    }

    /// The plugins a trainer rank uses: `liger` when `model.use_liger=true` (ranks fall back to the built-in
    /// kernels when the driver has no `liger` plugin loaded).
    pub fn for_trainer_rank(cfg: &SftConfig) -> Vec<String> {
        if cfg.model.use_liger {
            vec![LIGER.to_string()]
        } else {
            Vec::new()
        }
    }

    /// Adds the current version of each plugin of `names` that the driver loaded from a file to the files `opts`
    /// ships (names the host lacks, or built-in ones, are skipped: the actor falls back as in one process).
    pub fn ship(&self, mut opts: SpawnOptions, names: &[String]) -> Result<SpawnOptions> {
        for name in names {
            let Some(plugin) = self.host.get(name) else {
                continue;
            };
            let Some(copy) = plugin.copy_path() else {
                continue;
            };
            let (_, stored) = self
                .store
                .insert_file(copy)
                .with_context(|| format!("snapshotting plugin {} to ship it", plugin.label()))?;
            opts = opts.ship_file(&format!("{SHIPPED_PLUGIN_PREFIX}{name}"), stored);
        }
        Ok(opts)
    }
}

/// The plugin host of an actor in this process: the plugins shipped to this worker (see the module docs), else the
/// folders of this machine's `$FERL_PLUGIN_PATH` and then the first-party plugins found beside this executable
/// ([`ferl_plugin_bridge::setup::default_plugin_folders`]), as a job's host loads them; `None` when there are none
/// of these.
pub fn actor_plugin_host() -> Result<Option<Arc<PluginHost>>> {
    let shipped: Vec<(String, PathBuf)> = ferl_runtime::shipped_files()?
        .into_iter()
        .filter_map(|(k, p)| {
            k.strip_prefix(SHIPPED_PLUGIN_PREFIX)
                .map(|n| (n.to_string(), p))
        })
        .collect();
    if !shipped.is_empty() {
        let host = PluginHost::new(copies_dir()?);
        for (name, file) in shipped {
            let p = host
                .load_file(&file, None)
                .with_context(|| format!("loading plugin `{name}` shipped from the driver"))?;
            if p.info().name != name {
                bail!(
                    "the file shipped as plugin `{name}` ({}) holds plugin `{}`",
                    file.display(),
                    p.info().name
                );
            }
            tracing::info!(plugin = %p.label(), file = %file.display(), "loaded a shipped plugin");
        }
        return Ok(Some(Arc::new(host)));
    }
    let folders = plugin_path_folders();
    if folders.is_empty() && default_plugin_files().is_empty() {
        return Ok(None);
    }
    let host = PluginHost::new(copies_dir()?);
    for dir in folders {
        for e in host.watch_dir(&dir)? {
            tracing::warn!("plugin skipped: {e:#}");
        }
    }
    load_default_plugins(&host);
    Ok(Some(Arc::new(host)))
}

/// A private folder for this process's plugin copies (`$TMPDIR/ferl-plugin-copies/PID`).
fn copies_dir() -> Result<PathBuf> {
    copies_dir_in(&std::env::temp_dir().join("ferl-plugin-copies"))
}

/// `root/PID`, after removing the folders of processes that are gone (a worker killed with its node never drops
/// its plugins, so their copies would stay).
fn copies_dir_in(root: &Path) -> Result<PathBuf> {
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            let pid = e.file_name().to_string_lossy().into_owned();
            if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(&pid).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let dir = root.join(std::process::id().to_string());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// The op overrides `model.use_liger=true` trains with (RMSNorm, SwiGLU, fused linear + cross-entropy): `host`'s
/// `liger` plugin when it has one, else the built-in kernels (as the single-process `ferl sft`).
pub fn liger_kernels(host: Option<Arc<PluginHost>>) -> KernelRegistry {
    ferl_plugin_bridge::kernels::liger_kernels(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn custom_cls_without_path_leaves_the_config_alone() {
        let dir = tempfile::tempdir().unwrap();
        let host = PluginHost::new(dir.path());
        let mut cfg = SftConfig::resolved_default();
        resolve_custom_cls(&host, &mut cfg).unwrap();
        assert_eq!(cfg.data.plugin, None);
    }

    #[test]
    fn custom_cls_path_that_is_not_a_plugin_is_refused_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let host = PluginHost::new(dir.path().join("copies"));
        let bogus = dir.path().join("libnot_a_plugin.so");
        std::fs::write(&bogus, b"not a library").unwrap();
        let mut cfg = SftConfig::resolved_default();
        cfg.data.custom_cls.path = Some(bogus.display().to_string());
        let e = format!("{:#}", resolve_custom_cls(&host, &mut cfg).unwrap_err());
        assert!(
            e.contains("data.custom_cls.path") && e.contains("libnot_a_plugin.so"),
            "{e}"
        );
    }

    #[test]
    fn copies_of_dead_processes_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        // Pid 0 never names a live process's /proc entry.
        let stale = dir.path().join("0");
        std::fs::create_dir_all(&stale).unwrap();
        let mine = copies_dir_in(dir.path()).unwrap();
        assert!(mine.ends_with(std::process::id().to_string()) && mine.is_dir());
        assert!(!stale.exists());
    }
}
