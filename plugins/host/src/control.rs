//! The control channel of a running job, in its run directory (no sockets, works over shared filesystems):
//!
//! - `RUN_DIR/plugins/state.json`: the job's [`PluginStatus`] rows, rewritten (atomically) whenever they change;
//!   `ferl plugin list --run-dir RUN_DIR` prints it.
//! - `RUN_DIR/plugins/requests/ID.request`: `{"action": "reload", "name": NAME}` written by
//!   `ferl plugin reload NAME --run-dir RUN_DIR`; the job takes it at its next poll (every step boundary) and answers
//!   in `ID.response` as `{"ok": bool, "message": "..."}`.

use crate::registry::PluginStatus;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A reload request read by the job.
#[derive(Clone, Debug)]
pub struct Request {
    /// The request id (file stem).
    pub id: String,
    /// Plugin to reload.
    pub name: String,
    /// Where the answer goes: the request's path with the extension `response` (also for a file name that is not
    /// UTF-8, whose `id` is only a lossy spelling of it).
    response: PathBuf,
}

#[derive(Serialize, Deserialize)]
struct RequestFile {
    action: String,
    name: String,
}

/// The answer to a request.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Response {
    /// Whether the reload worked.
    pub ok: bool,
    /// What happened.
    pub message: String,
}

/// `RUN_DIR/plugins`.
#[derive(Clone, Debug)]
pub struct ControlDir {
    root: PathBuf,
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
}

impl ControlDir {
    /// The channel of `run_dir`, without creating anything.
    pub fn new(run_dir: &Path) -> Self {
        Self {
            root: run_dir.join("plugins"),
        }
    }

    /// The channel of `run_dir`, creating its folders (the job side).
    pub fn create(run_dir: &Path) -> Result<Self> {
        let me = Self::new(run_dir);
        std::fs::create_dir_all(me.requests_dir()).with_context(|| {
            format!(
                "cannot create the plugin control folder {}",
                me.requests_dir().display()
            )
        })?;
        Ok(me)
    }

    /// `RUN_DIR/plugins`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn state_path(&self) -> PathBuf {
        self.root.join("state.json")
    }

    fn requests_dir(&self) -> PathBuf {
        self.root.join("requests")
    }

    /// Replaces the state file with `rows`.
    pub fn write_state(&self, rows: &[PluginStatus]) -> Result<()> {
        write_atomic(&self.state_path(), &serde_json::to_vec_pretty(rows)?)
    }

    /// Reads the state file a job wrote.
    pub fn read_state(&self) -> Result<Vec<PluginStatus>> {
        let p = self.state_path();
        let bytes = std::fs::read(&p).with_context(|| {
            format!(
                "cannot read {} (is a job with plugins running with this run directory?)",
                p.display()
            )
        })?;
        serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a plugin state file", p.display()))
    }

    /// Asks the job to reload plugin `name`; returns the request id to wait on.
    pub fn submit_reload(&self, name: &str) -> Result<String> {
        let dir = self.requests_dir();
        if !dir.is_dir() {
            bail!(
                "{} does not exist: no job with plugins runs in this run directory",
                dir.display()
            );
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let id = format!("{nanos}-{}", std::process::id());
        let body = serde_json::to_vec(&RequestFile {
            action: "reload".into(),
            name: name.into(),
        })?;
        write_atomic(&dir.join(format!("{id}.request")), &body)?;
        Ok(id)
    }

    /// Takes (removes) the pending requests, oldest first. Unreadable ones are answered with an error.
    pub fn take_requests(&self) -> Vec<Request> {
        let Ok(entries) = std::fs::read_dir(self.requests_dir()) else {
            return Vec::new();
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("request"))
            .collect();
        paths.sort();
        let mut out = Vec::new();
        for p in paths {
            let id = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let parsed = std::fs::read(&p)
                .ok()
                .and_then(|b| serde_json::from_slice::<RequestFile>(&b).ok());
            let _ = std::fs::remove_file(&p);
            let req = Request {
                id,
                name: String::new(),
                response: p.with_extension("response"),
            };
            match parsed {
                Some(r) if r.action == "reload" => out.push(Request {
                    name: r.name,
                    ..req
                }),
                Some(r) => self.respond(
                    &req,
                    false,
                    &format!(
                        "unknown action `{}` in {} (known: reload)",
                        r.action,
                        p.display()
                    ),
                ),
                None => self.respond(
                    &req,
                    false,
                    &format!("{} is not a valid request", p.display()),
                ),
            }
        }
        out
    }

    /// Answers request `req`.
    pub fn respond(&self, req: &Request, ok: bool, message: &str) {
        let body = serde_json::to_vec(&Response {
            ok,
            message: message.to_string(),
        })
        .unwrap_or_default();
        if let Err(e) = write_atomic(&req.response, &body) {
            tracing::warn!("cannot answer plugin request {}: {e:#}", req.id);
        }
    }

    /// Waits up to `timeout` for the answer to request `id` (the job answers at its next step boundary).
    pub fn wait_response(&self, id: &str, timeout: Duration) -> Result<Response> {
        let path = self.requests_dir().join(format!("{id}.response"));
        let start = Instant::now();
        loop {
            if let Ok(bytes) = std::fs::read(&path) {
                let r: Response = serde_json::from_slice(&bytes)
                    .with_context(|| format!("{} is not a response", path.display()))?;
                let _ = std::fs::remove_file(&path);
                return Ok(r);
            }
            if start.elapsed() > timeout {
                bail!("no answer in {} after {:?}: the job takes requests at step boundaries; is it running?", path.display(), timeout);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
