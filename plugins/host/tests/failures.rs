//! Invariants 2 and 5 of the host: bad files are refused with the file and the problem named; plugin panics never
//! reach the host.

mod common;

use ferl_plugin_host::{
    DatasetExample, DatasetInstance, HotLogger, LoadedPlugin, PluginHost, PluginKind,
};
use std::sync::Arc;

fn load_err(file: &std::path::Path, expect: Option<PluginKind>) -> String {
    let copies = tempfile::tempdir().unwrap();
    match LoadedPlugin::load(file, copies.path(), expect) {
        Ok(p) => panic!("{} loaded but should have been refused", p.label()),
        Err(e) => {
            // Nothing is left behind in the copies folder by a refused file.
            assert_eq!(std::fs::read_dir(copies.path()).unwrap().count(), 0);
            format!("{e:#}")
        }
    }
}

#[test]
fn refuses_wrong_abi_version() {
    let dir = tempfile::tempdir().unwrap();
    let f = common::build_into(
        "ferl-plugin-testkit",
        &["abi-mismatch"],
        &[],
        dir.path(),
        "future",
    );
    let e = load_err(&f, None);
    assert!(e.contains(&f.display().to_string()), "{e}");
    assert!(
        e.contains("ABI version 1001") && e.contains("speaks version 1"),
        "{e}"
    );
}

#[test]
fn refuses_missing_table_symbol() {
    let dir = tempfile::tempdir().unwrap();
    let f = common::build_into(
        "ferl-plugin-testkit",
        &["missing-table"],
        &[],
        dir.path(),
        "notable",
    );
    let e = load_err(&f, None);
    assert!(e.contains(&f.display().to_string()), "{e}");
    assert!(
        e.contains("logger plugin") && e.contains("`ferl_plugin_logger` is missing"),
        "{e}"
    );
}

#[test]
fn refuses_manifest_of_wrong_kind() {
    let dir = tempfile::tempdir().unwrap();
    let f = common::build_into("ferl-plugin-testkit", &["dataset"], &[], dir.path(), "ds");
    let e = load_err(&f, Some(PluginKind::Logger));
    assert!(e.contains(&f.display().to_string()), "{e}");
    assert!(
        e.contains("says kind dataset, but a logger plugin was expected"),
        "{e}"
    );
}

#[test]
fn refuses_file_that_is_not_a_library() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir
        .path()
        .join(format!("junk{}", std::env::consts::DLL_SUFFIX));
    std::fs::write(&f, b"not an ELF file").unwrap();
    let e = load_err(&f, None);
    assert!(
        e.contains(&f.display().to_string()) && e.contains("cannot load the library"),
        "{e}"
    );
}

#[test]
fn watch_dir_reports_bad_files_and_loads_good_ones() {
    let dir = tempfile::tempdir().unwrap();
    common::build_into(
        "ferl-plugin-testkit",
        &["abi-mismatch"],
        &[],
        dir.path(),
        "bad",
    );
    common::build_into("ferl-plugin-template", &[], &[], dir.path(), "good");
    let copies = tempfile::tempdir().unwrap();
    let host = PluginHost::new(copies.path());
    let errors = host.watch_dir(dir.path()).unwrap();
    assert_eq!(errors.len(), 1);
    assert!(
        format!("{:#}", errors[0]).contains("bad"),
        "{:#}",
        errors[0]
    );
    assert_eq!(
        host.get("template").expect("template loaded").info().kind,
        PluginKind::Logger
    );
    // The bad file is not retried (nor reported again) until it changes.
    host.poll();
    assert_eq!(host.list().len(), 1);
}

#[test]
fn logger_panic_disables_the_logger_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let f = common::testkit_logger("1.0.0");
    let host = Arc::new(PluginHost::new(dir.path().join("copies")));
    host.load_file(&f, Some(PluginKind::Logger)).unwrap();
    let out = dir.path().join("out.txt");
    let mut logger = HotLogger::new(
        host.clone(),
        "testkit",
        &format!("{};panic_at=2", out.display()),
    )
    .unwrap();
    logger.log(1, &[("loss", 1.5)]).unwrap();
    logger
        .log(2, &[("loss", 1.25)])
        .expect("a logger panic is not an error of the step");
    let why = logger.disabled_reason().expect("disabled").to_string();
    assert!(
        why.contains("panicked") && why.contains("panic at step 2"),
        "{why}"
    );
    logger.log(3, &[("loss", 1.0)]).unwrap();
    drop(logger);
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "1.0.0 1 loss=1.5\n");
}

#[test]
fn dataset_panic_is_an_error_of_the_call() {
    let dir = tempfile::tempdir().unwrap();
    let f = common::build_into("ferl-plugin-testkit", &["dataset"], &[], dir.path(), "ds");
    let host = PluginHost::new(dir.path().join("copies"));
    let plugin = host.load_file(&f, Some(PluginKind::Dataset)).unwrap();
    let mut ds = DatasetInstance::open(plugin, "count=3;panic_at=1").unwrap();
    assert_eq!(ds.len(), 3);
    assert_eq!(
        ds.get(0).unwrap(),
        DatasetExample::Tokens {
            input_ids: vec![0, 1],
            loss_mask: vec![0, 1]
        }
    );
    let e = ds.get(1).unwrap_err();
    assert!(
        e.panicked && e.message.contains("panic at example 1"),
        "{e}"
    );
    assert!(
        e.to_string().contains("testkit@1.0.0") && e.to_string().contains("get(1)"),
        "{e}"
    );
    let e = ds.get(2).unwrap_err();
    assert!(!e.panicked && e.message.contains("earlier panic"), "{e}");
    // Out-of-range is an ordinary error from the ABI layer, not a panic.
    let mut fresh = DatasetInstance::open(host.get("testkit").unwrap(), "count=1").unwrap();
    let e = fresh.get(5).unwrap_err();
    assert!(!e.panicked && e.message.contains("out of range"), "{e}");
}
