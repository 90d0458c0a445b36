use super::*;
use crate::{GroupOptions, MemoryRendezvous, Rendezvous, TcpCommunicator};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

/// The pid of a process that has exited and been reaped.
fn dead_pid() -> libc::pid_t {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id() as libc::pid_t;
    child.wait().unwrap();
    assert!(is_dead(pid), "pid {pid} was reused already");
    pid
}

fn name(namespace: u64, pid: libc::pid_t) -> String {
    format!("{FILE_PREFIX}{namespace}-{pid}-{:016x}", 0x1234u64)
}

/// Sets the modification time of `path` itself (not of a link's target) to `age` ago.
fn age(path: &Path, age: Duration) {
    let then = SystemTime::now() - age;
    let secs = then
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let times = [libc::timespec {
        tv_sec: secs as libc::time_t,
        tv_nsec: 0,
    }; 2];
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and two timespecs.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
}

/// A fresh empty folder for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferl-sweep-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn segment_names_carry_the_creator_and_parse_back() {
    let name = segment_file_name(0xabc);
    let me = std::process::id() as libc::pid_t;
    assert_eq!(creator_of(&name), Some((pid_namespace(), me)));
    assert!(name.starts_with(FILE_PREFIX) && name.ends_with("0000000000000abc"));
    for bad in [
        "ferl-collective-1-0-ab",
        "ferl-collective-1--5-ab",
        "ferl-collective-12-ab",
        "other-1-2-ab",
    ] {
        assert_eq!(creator_of(bad), None, "{bad}");
    }
    assert!(!is_dead(me));
}

#[test]
fn invariant_1_2_only_old_files_of_dead_creators_in_this_namespace_are_swept() {
    let dir = scratch("rules");
    let ns = pid_namespace();
    let (dead, me) = (dead_pid(), std::process::id() as libc::pid_t);
    let file = |n: String, old: bool| {
        let p = dir.join(n);
        std::fs::write(&p, b"segment").unwrap();
        if old {
            age(&p, Duration::from_secs(60));
        }
        p
    };
    let stale = file(name(ns, dead), true);
    let live = file(name(ns, me), true);
    let young = file(name(ns, dead + 1_000_000), false);
    let elsewhere = file(name(ns + 1, dead), true);
    let unrelated = file(format!("other-{ns}-{dead}-1234"), true);
    // A link named like a stale segment, to a file that must survive, and a folder named like one.
    let target = file("target".into(), true);
    let link = dir.join(name(ns, dead).replace("1234", "5678"));
    std::os::unix::fs::symlink(&target, &link).unwrap();
    age(&link, Duration::from_secs(60));
    let folder = dir.join(name(ns, dead).replace("1234", "9abc"));
    std::fs::create_dir(&folder).unwrap();
    age(&folder, Duration::from_secs(60));

    let removed = sweep_stale(&dir, Duration::from_secs(5));
    assert_eq!(removed, vec![stale.clone()]);
    assert!(!stale.exists());
    for kept in [&live, &young, &elsewhere, &unrelated, &target, &folder] {
        assert!(kept.exists(), "{} was removed", kept.display());
    }
    assert!(link.symlink_metadata().is_ok(), "the link was removed");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn forming_a_group_sweeps_dev_shm() {
    let stale = Path::new(SHM_DIR).join(name(pid_namespace(), dead_pid()));
    if std::fs::write(&stale, b"left by a killed rank").is_err() {
        return; // no /dev/shm here
    }
    age(&stale, STALE_AGE * 2);
    let live = Path::new(SHM_DIR).join(segment_file_name(0x5eed));
    std::fs::write(&live, b"this process's").unwrap();
    age(&live, STALE_AGE * 2);
    let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
    let options = GroupOptions {
        prefix: "sweep-test".into(),
        shared_memory: true,
        ..GroupOptions::default()
    };
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (store, options) = (store.clone(), options.clone());
            s.spawn(move || TcpCommunicator::connect(rank, 2, store, &options).unwrap());
        }
    });
    assert!(!stale.exists(), "{} was not swept", stale.display());
    assert!(live.exists(), "a live process's segment was swept");
    std::fs::remove_file(&live).unwrap();
}
