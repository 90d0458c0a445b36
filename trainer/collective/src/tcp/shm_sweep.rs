//! Naming shared-memory segments after their creator, and sweeping the ones dead jobs left behind.
//!
//! A segment's file exists only while its pair joins (it is unlinked once both ranks mapped it, or gave up), so a
//! file stays behind only when its creator died in that window (e.g. `SIGKILL`). Its name carries the creator's pid
//! namespace and pid: `ferl-collective-<pidns>-<pid>-<nonce>`. When a group forms, [`sweep_stale_segments`] removes
//! this user's segment files whose creator is gone. Invariants:
//! 1. Only regular files owned by this user are removed, found with `lstat`: links, directories and other users'
//!    files are never touched nor followed.
//! 2. Only files whose creator ran in this pid namespace (so its pid means the same process here) and no longer
//!    exists (`kill(pid, 0)` fails with `ESRCH`) are removed, and only once older than [`STALE_AGE`].

use super::shm::{FILE_PREFIX, SHM_DIR};
use std::fs::DirEntry;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

/// How old a dead creator's segment file must be before it is swept.
pub(crate) const STALE_AGE: Duration = Duration::from_secs(5);

/// This process's pid namespace (the inode number of `/proc/self/ns/pid`), or 0 where it cannot be read.
fn pid_namespace() -> u64 {
    static NAMESPACE: OnceLock<u64> = OnceLock::new();
    *NAMESPACE.get_or_init(|| {
        let link = std::fs::read_link("/proc/self/ns/pid").unwrap_or_default();
        let text = link.to_string_lossy();
        let digits = text.trim_start_matches("pid:[").trim_end_matches(']');
        digits.parse().unwrap_or(0)
    })
}

/// The file name of a segment this process creates, with random `nonce`.
pub(crate) fn segment_file_name(nonce: u64) -> String {
    format!(
        "{FILE_PREFIX}{}-{}-{nonce:016x}",
        pid_namespace(),
        std::process::id()
    )
}

/// The pid namespace and pid of the process that created the segment named `name`, if it is one of ours.
fn creator_of(name: &str) -> Option<(u64, libc::pid_t)> {
    let mut fields = name.strip_prefix(FILE_PREFIX)?.split('-');
    let namespace = fields.next()?.parse().ok()?;
    let pid = fields.next()?.parse().ok().filter(|pid| *pid > 0)?;
    u64::from_str_radix(fields.next()?, 16).ok()?;
    fields.next().is_none().then_some((namespace, pid))
}

/// Whether no process `pid` exists (any other answer, a permission error included, counts as alive).
fn is_dead(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the (positive, so single) process exists; nothing is sent.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Whether `entry` is a segment file of this user whose creator is dead and which is older than `min_age`.
fn is_stale(entry: &DirEntry, min_age: Duration, uid: u32) -> bool {
    let name = entry.file_name();
    let Some((namespace, pid)) = name.to_str().and_then(creator_of) else {
        return false;
    };
    // `DirEntry::metadata` does not follow links (lstat).
    let Ok(meta) = entry.metadata() else {
        return false;
    };
    let old = meta
        .modified()
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .is_some_and(|age| age >= min_age);
    meta.file_type().is_file()
        && meta.uid() == uid
        && old
        && namespace == pid_namespace()
        && is_dead(pid)
}

/// Removes the stale segment files in `dir` (see the module's invariants); returns the paths removed.
pub(crate) fn sweep_stale(dir: &Path, min_age: Duration) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    entries
        .flatten()
        .filter(|entry| is_stale(entry, min_age, uid))
        .map(|entry| entry.path())
        // `remove_file` unlinks the name itself: a name swapped for a link meanwhile loses only the link.
        .filter(|path| std::fs::remove_file(path).is_ok())
        .collect()
}

/// Sweeps `/dev/shm` of the segments dead jobs of this user left behind (called when a group forms).
pub(crate) fn sweep_stale_segments() {
    for path in sweep_stale(Path::new(SHM_DIR), STALE_AGE) {
        tracing::info!(
            "removed {}: a shared-memory segment of a process that is gone",
            path.display()
        );
    }
}

#[cfg(test)]
#[path = "shm_sweep_tests.rs"]
mod tests;
