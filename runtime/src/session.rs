//! Session folders: where a head or node keeps its token, address, logs and pid files.
//!
//! The root is `$FERL_TMPDIR` or `/tmp/ferl`; each head or node agent makes `session_<time>_<pid>/` under it, and a
//! head points `session_latest` at its own, so commands on the head's machine find the token and address by
//! themselves.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

/// Environment variable overriding the session root.
pub const ROOT_ENV: &str = "FERL_TMPDIR";
/// Environment variable holding the cluster token.
pub const TOKEN_ENV: &str = "FERL_TOKEN";

/// The session root folder.
pub fn root() -> PathBuf {
    std::env::var_os(ROOT_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/ferl"))
}

/// Writes `bytes` to `path` with mode 0600 (created or truncated).
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))
}

/// A session folder of this process.
#[derive(Debug, Clone)]
pub struct Session {
    /// The folder.
    pub dir: PathBuf,
}

impl Session {
    /// Makes a fresh session folder (`kind` is `head` or `node`); a head also becomes `session_latest`.
    pub fn create(kind: &str) -> Result<Self> {
        let root = root();
        std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let dir = root.join(format!(
            "session_{}_{}_{}_{}",
            kind,
            stamp.as_secs(),
            stamp.subsec_millis(),
            std::process::id()
        ));
        std::fs::create_dir_all(dir.join("logs"))
            .with_context(|| format!("creating {}", dir.display()))?;
        if kind == "head" {
            let latest = root.join("session_latest");
            let tmp = root.join(format!(".session_latest_{}", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            std::os::unix::fs::symlink(&dir, &tmp)?;
            std::fs::rename(&tmp, &latest)
                .with_context(|| format!("updating {}", latest.display()))?;
        }
        Ok(Self { dir })
    }

    /// The folder for worker logs.
    pub fn logs(&self) -> PathBuf {
        self.dir.join("logs")
    }

    /// Stores the token (0600) and prints nothing.
    pub fn save_token(&self, token: &str) -> Result<()> {
        write_private(&self.dir.join("token"), token.as_bytes())
    }

    /// Stores the head address.
    pub fn save_address(&self, addr: &str) -> Result<()> {
        std::fs::write(self.dir.join("address"), addr).context("writing the session address file")
    }

    /// Records this process's pid so `ferl stop` can find it.
    pub fn save_pid(&self) -> Result<()> {
        std::fs::write(self.dir.join("pid"), std::process::id().to_string())
            .context("writing the pid file")
    }
}

/// The token of the head on this machine (`session_latest/token`), if any.
pub fn local_token() -> Option<String> {
    std::fs::read_to_string(root().join("session_latest").join("token"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// The address of the head on this machine, if any.
pub fn local_address() -> Option<String> {
    std::fs::read_to_string(root().join("session_latest").join("address"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// The token to join with: the one given, else `FERL_TOKEN`, else the local head's.
pub fn resolve_token(given: Option<String>) -> Result<String> {
    given
        .or_else(|| std::env::var(TOKEN_ENV).ok())
        .or_else(local_token)
        .with_context(|| {
            format!(
                "no cluster token: pass --token or set {TOKEN_ENV} (on the head's machine it is read from {})",
                root().join("session_latest/token").display()
            )
        })
}

/// Makes `cmd` start in a new session, detached from the terminal (for `ferl start` without `--block`).
pub fn detach(cmd: &mut std::process::Command) {
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, || {
            libc::setsid();
            Ok(())
        });
    }
}

/// Sends SIGTERM to every head or node process recorded under the session root; returns how many were signalled.
pub fn stop_local() -> usize {
    let mut stopped = 0;
    for entry in std::fs::read_dir(root()).into_iter().flatten().flatten() {
        let pid_file = entry.path().join("pid");
        let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        else {
            continue;
        };
        if nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        )
        .is_ok()
        {
            stopped += 1;
        }
        let _ = std::fs::remove_file(pid_file);
    }
    stopped
}
