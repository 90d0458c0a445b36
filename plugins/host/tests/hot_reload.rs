//! Invariants 1, 3 and 4 of the host: versions load beside each other from private copies, switch only at a step
//! boundary, and the old library is unloaded once nothing uses it. Also the run-directory control channel.

mod common;

use ferl_plugin_host::control::ControlDir;
use ferl_plugin_host::{HotLogger, PluginHost, PluginKind};
use std::sync::Arc;
use std::time::Duration;

fn replace_file(src: &std::path::Path, dest: &std::path::Path) {
    // Write beside and rename, as a build or deploy would, so a reader never sees half a file.
    let tmp = dest.with_extension("tmp");
    std::fs::copy(src, &tmp).unwrap();
    std::fs::rename(&tmp, dest).unwrap();
}

#[test]
fn hot_reload_switches_at_step_boundary_and_unloads_old_version() {
    let (v1, v2) = (
        common::testkit_logger("1.0.0"),
        common::testkit_logger("2.0.0"),
    );
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let installed = plugins.join(format!("testkit{}", std::env::consts::DLL_SUFFIX));
    std::fs::copy(&v1, &installed).unwrap();

    let host = Arc::new(PluginHost::new(dir.path().join("copies")));
    assert!(host.watch_dir(&plugins).unwrap().is_empty());
    let out = dir.path().join("metrics.txt");
    let mut logger = HotLogger::new(host.clone(), "testkit", out.to_str().unwrap()).unwrap();
    let old = Arc::downgrade(&host.get("testkit").unwrap());
    let old_copy = host
        .get("testkit")
        .unwrap()
        .copy_path()
        .unwrap()
        .to_path_buf();
    assert_ne!(old_copy, installed, "invariant 1: never loaded in place");

    logger.log(1, &[("loss", 2.0)]).unwrap();
    replace_file(&v2, &installed);
    // Mid-step: the new file is not used yet.
    logger.log(2, &[("loss", 1.5)]).unwrap();
    assert_eq!(logger.version().as_deref(), Some("1.0.0"));

    let switches = host.step_boundary();
    assert_eq!(switches.len(), 1, "{switches:?}");
    assert_eq!(
        (switches[0].from.as_str(), switches[0].to.as_str()),
        ("1.0.0", "2.0.0")
    );
    // The logger still holds v1's instance until its next step, so v1 is still loaded (retired, in use).
    assert!(old.upgrade().is_some());
    assert_eq!(host.loaded_versions("testkit"), 2);

    logger.log(3, &[("loss", 1.25)]).unwrap();
    assert_eq!(logger.version().as_deref(), Some("2.0.0"));
    assert!(
        old.upgrade().is_none(),
        "invariant 4: v1 unloaded once unused"
    );
    assert!(!old_copy.exists(), "v1's private copy is deleted with it");
    assert_eq!(host.loaded_versions("testkit"), 1);
    drop(logger);
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "1.0.0 1 loss=2\n1.0.0 2 loss=1.5\n2.0.0 3 loss=1.25\n"
    );
}

#[test]
fn a_broken_new_file_keeps_the_current_version() {
    let dir = tempfile::tempdir().unwrap();
    let installed = common::build_into("ferl-plugin-testkit", &[], &[], dir.path(), "testkit");
    let host = PluginHost::new(dir.path().join("copies"));
    host.load_file(&installed, Some(PluginKind::Logger))
        .unwrap();
    let broken = common::build("ferl-plugin-testkit", &["abi-mismatch"], &[]);
    replace_file(&broken, &installed);
    assert!(host.step_boundary().is_empty());
    let rows = host.list();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].version, "1.0.0");
    assert!(
        rows[0]
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("ABI version"),
        "{rows:?}"
    );
}

#[test]
fn reload_request_through_the_run_dir_control_channel() {
    let run = tempfile::tempdir().unwrap();
    let file = common::build_into("ferl-plugin-testkit", &[], &[], run.path(), "testkit");
    let host = Arc::new(PluginHost::for_run_dir(run.path()).unwrap());
    host.load_file(&file, None).unwrap();

    let control = ControlDir::new(run.path());
    let rows = control.read_state().unwrap();
    assert_eq!(
        (
            rows[0].name.as_str(),
            rows[0].kind.as_str(),
            rows[0].state.as_str()
        ),
        ("testkit", "logger", "current")
    );

    let v2 = common::testkit_logger("2.0.0");
    std::fs::copy(&v2, &file).unwrap();
    let good = control.submit_reload("testkit").unwrap();
    let bad = control.submit_reload("nosuch").unwrap();
    // The job: a trainer loop calling step_boundary between steps.
    let job = {
        let host = host.clone();
        std::thread::spawn(move || {
            for _ in 0..100 {
                if !host.step_boundary().is_empty() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            false
        })
    };
    let r = control
        .wait_response(&good, Duration::from_secs(30))
        .unwrap();
    assert!(r.ok && r.message.contains("2.0.0"), "{r:?}");
    let r = control
        .wait_response(&bad, Duration::from_secs(30))
        .unwrap();
    assert!(
        !r.ok && r.message.contains("no plugin named `nosuch`"),
        "{r:?}"
    );
    assert!(job.join().unwrap(), "the job switched versions");
    let rows = control.read_state().unwrap();
    let current: Vec<_> = rows.iter().filter(|r| r.state == "current").collect();
    assert_eq!(current.len(), 1);
    assert_eq!(current[0].version, "2.0.0");
}

#[test]
fn reload_request_for_an_unchanged_file_keeps_the_loaded_version() {
    let run = tempfile::tempdir().unwrap();
    let file = common::build_into("ferl-plugin-testkit", &[], &[], run.path(), "testkit");
    let host = PluginHost::for_run_dir(run.path()).unwrap();
    let loaded = host.load_file(&file, None).unwrap();
    let control = ControlDir::new(run.path());
    let id = control.submit_reload("testkit").unwrap();
    assert!(host.step_boundary().is_empty(), "nothing to switch to");
    let r = control.wait_response(&id, Duration::from_secs(5)).unwrap();
    assert!(
        r.ok && r.message.contains("already at version 1.0.0"),
        "{r:?}"
    );
    assert!(Arc::ptr_eq(&loaded, &host.get("testkit").unwrap()));
}
