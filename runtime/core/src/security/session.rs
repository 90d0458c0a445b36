//! Session folders: where a head or node keeps its token, address, logs, pid file and (in `secrets/`, mode 0700) the
//! credentials its workers read.
//!
//! The root is `$FERL_TMPDIR` or `/tmp/ferl` (read by the bootstrap layer and passed here); each head or node agent
//! makes `session_<time>_<pid>/` under it, and a head points `session_latest` at its own, so commands on the head's
//! machine find the token and address by themselves.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};

/// Environment variable overriding the session root (named in messages; the bootstrap layer reads it).
pub(crate) const ROOT_ENV: &str = "FERL_TMPDIR";
/// Environment variable holding the cluster token (named in messages; the bootstrap layer reads it).
pub(crate) const TOKEN_ENV: &str = "FERL_TOKEN";
/// The session's private folder beside `logs/` ([`Session::secrets`]).
const SECRETS: &str = "secrets";

/// Creates the session root `root` private to this user (mode 0700), or checks that an existing one belongs to this
/// user (and makes it private); a root owned by another user is refused, since its owner could read tokens or plant
/// files there.
pub(crate) fn ensure_private_root(root: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .with_context(|| format!("creating {}", root.display()))?;
    let meta =
        std::fs::symlink_metadata(root).with_context(|| format!("reading {}", root.display()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != me {
        anyhow::bail!(
            "the session folder {} is not a directory of yours (owner uid {}, you are uid {me}); set {ROOT_ENV} to a \
             folder you own",
            root.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("making {} private", root.display()))?;
    }
    Ok(())
}

/// Creates the folder `dir` (and any missing parents) private to this user: mode 0700, also when it existed.
pub(crate) fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private", dir.display()))
}

/// Writes `bytes` to `path` with mode 0600 (created or truncated).
pub(crate) fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
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

/// Creates `root/base`, or `root/base_1`, `base_2`… when a session of this process took that name in the same
/// millisecond (two heads started at once in one process must not share logs and worker credentials).
fn create_unique_dir(root: &Path, base: &str) -> Result<PathBuf> {
    for n in 0u32.. {
        let dir = match n {
            0 => root.join(base),
            n => root.join(format!("{base}_{n}")),
        };
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
    unreachable!("u32 names run out")
}

/// A session folder of this process.
#[derive(Debug, Clone)]
pub struct Session {
    /// The folder.
    pub dir: PathBuf,
}

impl Session {
    /// Makes a fresh session folder under `root` (`kind` is `head` or `node`); a head also becomes
    /// `session_latest`.
    pub fn create(root: &Path, kind: &str) -> Result<Self> {
        ensure_private_root(root)?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let base = format!(
            "session_{}_{}_{}_{}",
            kind,
            stamp.as_secs(),
            stamp.subsec_millis(),
            std::process::id()
        );
        let dir = create_unique_dir(root, &base)?;
        std::fs::create_dir_all(dir.join("logs"))
            .with_context(|| format!("creating {}", dir.display()))?;
        create_private_dir(&dir.join(SECRETS))?;
        if kind == "head" {
            let latest = root.join("session_latest");
            // Unique per call: two heads started at once in one process (tests) must not share the temporary link.
            let tmp = root.join(format!(
                ".session_latest_{}_{:016x}",
                std::process::id(),
                rand::random::<u64>()
            ));
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

    /// The private folder (mode 0700) for what workers must read but nobody should ship with the logs: the node's
    /// worker credentials (mode 0600).
    pub fn secrets(&self) -> PathBuf {
        self.dir.join(SECRETS)
    }

    /// Stores the token (0600) and prints nothing.
    pub fn save_token(&self, token: &str) -> Result<()> {
        write_private(&self.dir.join("token"), token.as_bytes())
    }

    /// Stores the head address.
    pub fn save_address(&self, addr: &str) -> Result<()> {
        std::fs::write(self.dir.join("address"), addr).context("writing the session address file")
    }

    /// Removes the folder (an embedded cluster's clean shutdown), and `session_latest` beside it when it points here.
    /// Returns whether it was removed.
    pub(crate) fn remove(&self) -> bool {
        if let Some(root) = self.dir.parent() {
            let latest = root.join("session_latest");
            if std::fs::read_link(&latest).is_ok_and(|to| to == self.dir) {
                let _ = std::fs::remove_file(&latest);
            }
        }
        std::fs::remove_dir_all(&self.dir).is_ok()
    }

    /// Records this process's pid so `ferl stop` can find it.
    pub fn save_pid(&self) -> Result<()> {
        std::fs::write(self.dir.join("pid"), std::process::id().to_string())
            .context("writing the pid file")
    }
}

/// The token of the head on this machine (`session_latest/token` under `root`), if any.
pub(crate) fn local_token(root: &Path) -> Option<String> {
    std::fs::read_to_string(root.join("session_latest").join("token"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// The address of the head on this machine (`session_latest/address` under `root`), if any.
pub(crate) fn local_address(root: &Path) -> Option<String> {
    std::fs::read_to_string(root.join("session_latest").join("address"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// The token to join with: the one given, else `from_env` (`FERL_TOKEN`), else the local head's under `root`.
pub(crate) fn resolve_token(
    given: Option<String>,
    from_env: Option<String>,
    root: &Path,
) -> Result<String> {
    given
        .or(from_env)
        .or_else(|| local_token(root))
        .with_context(|| {
            format!(
                "no cluster token: pass --token or set {TOKEN_ENV} (on the head's machine it is read from {})",
                root.join("session_latest/token").display()
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

/// Stops every head or node process that `ferl start` recorded under the session root `root`: SIGTERM, then
/// SIGKILL for any still running after `grace`. A pid file whose process is gone, or is no longer a `start` command
/// (the pid was reused), is only removed. Returns the pids that were stopped; none of them runs when this returns.
pub(crate) fn stop_local(root: &Path, grace: Duration) -> Vec<i32> {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let mut stopped = Vec::new();
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let pid_file = entry.path().join("pid");
        let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        else {
            continue;
        };
        if is_start_command(pid) && kill(Pid::from_raw(pid), Signal::SIGTERM).is_ok() {
            stopped.push(pid);
        }
        let _ = std::fs::remove_file(pid_file);
    }
    let deadline = Instant::now() + grace;
    while stopped.iter().any(|p| is_running(*p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in stopped.iter().filter(|p| is_running(**p)) {
        let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
    }
    while stopped.iter().any(|p| is_running(*p)) && Instant::now() < deadline + grace {
        std::thread::sleep(Duration::from_millis(50));
    }
    stopped
}

/// Whether `pid` runs (a zombie waiting for its parent to reap it does not).
pub fn is_running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may itself hold spaces or parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Whether `pid` is a `ferl start ...` process (its command line has a `start` argument).
fn is_start_command(pid: i32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| c.split(|b| *b == 0).any(|arg| arg == b"start"))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn the_session_root_is_private_and_another_users_root_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let fresh = tmp.path().join("a/ferl");
        ensure_private_root(&fresh).unwrap();
        assert_eq!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
        let loose = tmp.path().join("loose");
        std::fs::create_dir(&loose).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o777)).unwrap();
        ensure_private_root(&loose).unwrap();
        assert_eq!(std::fs::metadata(&loose).unwrap().mode() & 0o777, 0o700);
        let theirs = tmp.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        if std::os::unix::fs::chown(&theirs, Some(65534), None).is_err() {
            println!("SKIP the foreign-owner case: this user cannot chown");
            return;
        }
        let err = ensure_private_root(&theirs).unwrap_err().to_string();
        assert!(
            err.contains("not a directory of yours") && err.contains(ROOT_ENV),
            "{err}"
        );
    }

    #[test]
    fn sessions_made_in_the_same_millisecond_get_their_own_folders() {
        let tmp = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = (0..20)
            .map(|_| Session::create(tmp.path(), "head").unwrap().dir)
            .collect();
        let distinct: std::collections::HashSet<_> = dirs.iter().collect();
        assert_eq!(distinct.len(), dirs.len(), "{dirs:?}");
        assert!(dirs.iter().all(|d| d.join("logs").is_dir()));
        let latest = std::fs::read_link(tmp.path().join("session_latest")).unwrap();
        assert_eq!(&latest, dirs.last().unwrap());
    }
}
