//! [`PluginHost`]: the plugins of one job by name, their versions, and the step-boundary switch to new versions.

use crate::control::ControlDir;
use crate::library::{sha256_hex, LoadedPlugin};
use anyhow::{anyhow, bail, Context, Result};
use ferl_plugin_abi::PluginKind;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::SystemTime;

/// One row of `ferl plugin list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginStatus {
    /// Plugin name.
    pub name: String,
    /// `dataset`, `logger` or `kernel`.
    pub kind: String,
    /// Plugin version.
    pub version: String,
    /// Source file (or `builtin:NAME`).
    pub file: String,
    /// SHA-256 of the file.
    pub sha256: String,
    /// `current`, `pending` (switches at the next step boundary) or `retired` (still used by someone).
    pub state: String,
    /// Last load error of this plugin's source file, if the newest file could not be loaded.
    pub last_error: Option<String>,
}

/// A version switch made at a step boundary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Switch {
    /// Plugin name.
    pub name: String,
    /// Version before.
    pub from: String,
    /// Version after.
    pub to: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
}

fn stamp(path: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(path).ok()?;
    Some(FileStamp {
        modified: m.modified().ok(),
        len: m.len(),
    })
}

struct Slot {
    current: Arc<LoadedPlugin>,
    generation: u64,
    source: Option<PathBuf>,
    stamp: Option<FileStamp>,
    pending: Option<Arc<LoadedPlugin>>,
    last_error: Option<String>,
}

#[derive(Default)]
struct State {
    slots: BTreeMap<String, Slot>,
    watched_dirs: Vec<PathBuf>,
    /// Files in watched folders that failed to load, with the stamp they had (retried when it changes).
    bad_files: BTreeMap<PathBuf, Option<FileStamp>>,
    retired: Vec<Weak<LoadedPlugin>>,
    next_generation: u64,
}

/// The plugins of one job. Thread-safe; share it as `Arc<PluginHost>`.
pub struct PluginHost {
    copies_dir: PathBuf,
    control: Option<ControlDir>,
    state: Mutex<State>,
}

/// Whether `path` looks like a shared library of this platform.
pub fn is_library_file(path: &Path) -> bool {
    let suffix = std::env::consts::DLL_SUFFIX.trim_start_matches('.');
    path.is_file() && path.extension().and_then(|e| e.to_str()) == Some(suffix)
}

impl PluginHost {
    /// A host that keeps its private copies of plugin files under `copies_dir`.
    pub fn new(copies_dir: impl Into<PathBuf>) -> Self {
        Self {
            copies_dir: copies_dir.into(),
            control: None,
            state: Mutex::new(State::default()),
        }
    }

    /// A host for a job whose run directory is `run_dir`: copies go to `run_dir/plugins/copies`, and the control
    /// channel of [`crate::control`] (state file + reload requests) lives in `run_dir/plugins`.
    pub fn for_run_dir(run_dir: &Path) -> Result<Self> {
        let control = ControlDir::create(run_dir)?;
        let host = Self {
            copies_dir: control.root().join("copies"),
            control: Some(control),
            state: Mutex::new(State::default()),
        };
        host.publish_state();
        Ok(host)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Loads `file` as a new plugin (its manifest name must not be loaded yet), checking its kind when `expect` is
    /// given. The file is watched: a changed file is reloaded by [`PluginHost::step_boundary`].
    pub fn load_file(&self, file: &Path, expect: Option<PluginKind>) -> Result<Arc<LoadedPlugin>> {
        let plugin = Arc::new(LoadedPlugin::load(file, &self.copies_dir, expect)?);
        let mut st = self.lock();
        let name = plugin.info().name.clone();
        if let Some(slot) = st.slots.get(&name) {
            bail!(
                "plugin {}: a plugin named `{name}` is already loaded from {}",
                file.display(),
                slot.current.info().file.display()
            );
        }
        let generation = next_gen(&mut st);
        st.slots.insert(
            name,
            Slot {
                current: plugin.clone(),
                generation,
                source: Some(file.to_path_buf()),
                stamp: stamp(file),
                pending: None,
                last_error: None,
            },
        );
        drop(st);
        self.publish_state();
        Ok(plugin)
    }

    /// Adds a plugin that has no file (a built-in kernel table).
    pub fn add_builtin(&self, plugin: LoadedPlugin) -> Result<Arc<LoadedPlugin>> {
        let plugin = Arc::new(plugin);
        let mut st = self.lock();
        let name = plugin.info().name.clone();
        if st.slots.contains_key(&name) {
            bail!("built-in plugin `{name}`: a plugin of that name is already loaded");
        }
        let generation = next_gen(&mut st);
        st.slots.insert(
            name,
            Slot {
                current: plugin.clone(),
                generation,
                source: None,
                stamp: None,
                pending: None,
                last_error: None,
            },
        );
        drop(st);
        self.publish_state();
        Ok(plugin)
    }

    /// Watches `dir`: loads every library in it now and any new one at later polls. Returns the files that could
    /// not be loaded, with why (they are retried once they change).
    pub fn watch_dir(&self, dir: &Path) -> Result<Vec<anyhow::Error>> {
        if !dir.is_dir() {
            bail!("plugins folder {} does not exist", dir.display());
        }
        self.lock().watched_dirs.push(dir.to_path_buf());
        Ok(self.scan_dirs())
    }

    fn scan_dirs(&self) -> Vec<anyhow::Error> {
        let (dirs, known): (Vec<PathBuf>, Vec<PathBuf>) = {
            let st = self.lock();
            let known = st.slots.values().filter_map(|s| s.source.clone()).collect();
            (st.watched_dirs.clone(), known)
        };
        let mut errors = Vec::new();
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_library_file(p))
                .collect();
            files.sort();
            for file in files {
                if known.contains(&file) {
                    continue;
                }
                let now = stamp(&file);
                if self.lock().bad_files.get(&file).is_some_and(|s| *s == now) {
                    continue;
                }
                match self.load_file(&file, None) {
                    Ok(p) => {
                        self.lock().bad_files.remove(&file);
                        tracing::info!("loaded plugin {} from {}", p.label(), file.display());
                    }
                    Err(e) => {
                        tracing::warn!("{e:#}");
                        self.lock().bad_files.insert(file, now);
                        errors.push(e);
                    }
                }
            }
        }
        errors
    }

    /// The current version of plugin `name` and its generation (a number that changes at every switch).
    pub fn current(&self, name: &str) -> Option<(u64, Arc<LoadedPlugin>)> {
        self.lock()
            .slots
            .get(name)
            .map(|s| (s.generation, s.current.clone()))
    }

    /// The current version of plugin `name`.
    pub fn get(&self, name: &str) -> Option<Arc<LoadedPlugin>> {
        self.current(name).map(|(_, p)| p)
    }

    /// The current version of plugin `name`, which must be of kind `kind`; the error lists what is loaded.
    pub fn get_kind(&self, name: &str, kind: PluginKind) -> Result<Arc<LoadedPlugin>> {
        let st = self.lock();
        match st.slots.get(name) {
            Some(s) if s.current.info().kind == kind => Ok(s.current.clone()),
            Some(s) => Err(anyhow!(
                "plugin `{name}` is a {} plugin, not a {}",
                s.current.info().kind.as_str(),
                kind.as_str()
            )),
            None => {
                let have: Vec<&str> = st
                    .slots
                    .iter()
                    .filter(|(_, s)| s.current.info().kind == kind)
                    .map(|(n, _)| n.as_str())
                    .collect();
                Err(anyhow!(
                    "no {} plugin named `{name}` is loaded (loaded {} plugins: {})",
                    kind.as_str(),
                    kind.as_str(),
                    if have.is_empty() {
                        "none".to_string()
                    } else {
                        have.join(", ")
                    }
                ))
            }
        }
    }

    /// Loads plugin `name` again from its source file, beside the current version; it becomes current at the next
    /// step boundary. Returns the new version.
    pub fn reload(&self, name: &str) -> Result<String> {
        let (source, kind) = {
            let st = self.lock();
            let slot = st
                .slots
                .get(name)
                .ok_or_else(|| anyhow!("no plugin named `{name}` is loaded"))?;
            let source = slot
                .source
                .clone()
                .ok_or_else(|| anyhow!("plugin `{name}` is built in; it has no file to reload"))?;
            (source, slot.current.info().kind)
        };
        let loaded = LoadedPlugin::load(&source, &self.copies_dir, Some(kind));
        let mut st = self.lock();
        let slot = st
            .slots
            .get_mut(name)
            .ok_or_else(|| anyhow!("plugin `{name}` was removed while reloading"))?;
        slot.stamp = stamp(&source);
        match loaded {
            Ok(p) if p.info().name != name => {
                let e = format!(
                    "plugin {}: the new file's manifest is named `{}`, not `{name}`",
                    source.display(),
                    p.info().name
                );
                slot.last_error = Some(e.clone());
                bail!(e)
            }
            Ok(p) => {
                let v = p.info().version.clone();
                slot.pending = Some(Arc::new(p));
                slot.last_error = None;
                Ok(v)
            }
            Err(e) => {
                slot.last_error = Some(format!("{e:#}"));
                Err(e)
            }
        }
    }

    /// Checks watched files and folders and the control channel; loads changed files as pending versions. Returns
    /// the names that got a pending version.
    pub fn poll(&self) -> Vec<String> {
        let changed: Vec<(String, PathBuf)> = {
            let st = self.lock();
            st.slots
                .iter()
                .filter_map(|(n, s)| {
                    let src = s.source.as_ref()?;
                    let now = stamp(src);
                    (now.is_some() && now != s.stamp).then(|| (n.clone(), src.clone()))
                })
                .collect()
        };
        let mut staged = Vec::new();
        for (name, src) in changed {
            // Same bytes under a new mtime (a `touch`, a copy of the same build): nothing to load.
            let same = std::fs::read(&src)
                .ok()
                .map(|b| sha256_hex(&b))
                .is_some_and(|h| {
                    let st = self.lock();
                    st.slots.get(&name).is_some_and(|s| {
                        s.pending.as_ref().unwrap_or(&s.current).info().sha256 == h
                    })
                });
            if same {
                if let Some(s) = self.lock().slots.get_mut(&name) {
                    s.stamp = stamp(&src);
                }
                continue;
            }
            match self.reload(&name) {
                Ok(v) => {
                    tracing::info!("plugin `{name}`: version {v} loaded from {}, switching at the next step boundary", src.display());
                    staged.push(name);
                }
                Err(e) => tracing::warn!("plugin `{name}`: keeping the current version: {e:#}"),
            }
        }
        self.scan_dirs();
        self.serve_requests(&mut staged);
        staged
    }

    fn serve_requests(&self, staged: &mut Vec<String>) {
        let Some(control) = &self.control else { return };
        for req in control.take_requests() {
            if let Some(v) = self.unchanged_version(&req.name) {
                let msg = format!(
                    "plugin `{}` is already at version {v}: its file has not changed",
                    req.name
                );
                control.respond(&req, true, &msg);
                continue;
            }
            let result = self.reload(&req.name);
            let (ok, message) = match &result {
                Ok(v) => {
                    staged.push(req.name.clone());
                    (true, format!("plugin `{}` version {v} loaded; it becomes current at the next step boundary", req.name))
                }
                Err(e) => (false, format!("{e:#}")),
            };
            control.respond(&req, ok, &message);
        }
    }

    /// The version plugin `name` has (pending, else current) when its source file still holds the same bytes.
    fn unchanged_version(&self, name: &str) -> Option<String> {
        let source = self.lock().slots.get(name)?.source.clone()?;
        let hash = sha256_hex(&std::fs::read(&source).ok()?);
        let st = self.lock();
        let slot = st.slots.get(name)?;
        let newest = slot.pending.as_ref().unwrap_or(&slot.current);
        (newest.info().sha256 == hash).then(|| newest.info().version.clone())
    }

    /// The step boundary: [`PluginHost::poll`], then every pending version becomes current. Users holding the old
    /// `Arc` keep it until they let go; then the old library is unloaded.
    pub fn step_boundary(&self) -> Vec<Switch> {
        self.poll();
        let mut switches = Vec::new();
        let mut st = self.lock();
        let names: Vec<String> = st
            .slots
            .iter()
            .filter(|(_, s)| s.pending.is_some())
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let generation = next_gen(&mut st);
            let slot = st.slots.get_mut(&name).expect("slot listed above");
            let new = slot.pending.take().expect("pending checked above");
            let old = std::mem::replace(&mut slot.current, new);
            slot.generation = generation;
            switches.push(Switch {
                name,
                from: old.info().version.clone(),
                to: slot.current.info().version.clone(),
            });
            st.retired.push(Arc::downgrade(&old));
        }
        st.retired.retain(|w| w.strong_count() > 0);
        drop(st);
        if !switches.is_empty() {
            self.publish_state();
        }
        switches
    }

    /// Every version still loaded: current, pending and retired-but-in-use.
    pub fn list(&self) -> Vec<PluginStatus> {
        let st = self.lock();
        let row = |p: &LoadedPlugin, state: &str, last_error: Option<String>| PluginStatus {
            name: p.info().name.clone(),
            kind: p.info().kind.as_str().to_string(),
            version: p.info().version.clone(),
            file: p.info().file.display().to_string(),
            sha256: p.info().sha256.clone(),
            state: state.to_string(),
            last_error,
        };
        let mut rows = Vec::new();
        for s in st.slots.values() {
            rows.push(row(&s.current, "current", s.last_error.clone()));
            if let Some(p) = &s.pending {
                rows.push(row(p, "pending", None));
            }
        }
        for p in st.retired.iter().filter_map(Weak::upgrade) {
            rows.push(row(&p, "retired", None));
        }
        rows
    }

    /// How many versions of plugin `name` are still loaded (current + pending + retired still in use).
    pub fn loaded_versions(&self, name: &str) -> usize {
        self.list().iter().filter(|r| r.name == name).count()
    }

    /// Writes the state file of the control channel, if this host has one.
    pub fn publish_state(&self) {
        if let Some(control) = &self.control {
            if let Err(e) = control.write_state(&self.list()) {
                tracing::warn!("cannot write the plugin state file: {e:#}");
            }
        }
    }

    /// The folder private copies of plugin files go to.
    pub fn copies_dir(&self) -> &Path {
        &self.copies_dir
    }
}

fn next_gen(st: &mut State) -> u64 {
    st.next_generation += 1;
    st.next_generation
}

/// Loads every library in `dir` into a throw-away host and reports each file's manifest or error (what
/// `ferl plugin list --dir` prints).
pub fn inspect_dir(dir: &Path) -> Result<Vec<(PathBuf, Result<crate::PluginInfo>)>> {
    let copies = std::env::temp_dir().join(format!("ferl-plugin-inspect-{}", std::process::id()));
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read plugins folder {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| is_library_file(p))
        .collect();
    files.sort();
    for f in files {
        let r = LoadedPlugin::load(&f, &copies, None).map(|p| p.info().clone());
        out.push((f, r));
    }
    let _ = std::fs::remove_dir_all(&copies);
    Ok(out)
}
