//! The first-party plugins and the template, built and loaded through the host.

mod common;

use ferl_plugin_host::{DatasetExample, DatasetInstance, LoggerInstance, PluginHost, PluginKind};
use std::process::Command;

#[test]
fn template_logger_writes_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let f = common::build("ferl-plugin-template", &[], &[]);
    let host = PluginHost::new(dir.path().join("copies"));
    let p = host.load_file(&f, Some(PluginKind::Logger)).unwrap();
    assert_eq!(
        (p.info().name.as_str(), p.info().version.as_str()),
        ("template", env!("CARGO_PKG_VERSION"))
    );
    let out = dir.path().join("m.jsonl");
    let mut l = LoggerInstance::open(p, out.to_str().unwrap()).unwrap();
    l.log(1, &[("train/loss", 2.5), ("lr", 1e-5)]).unwrap();
    l.log(2, &[("train/loss", f64::NAN)]).unwrap();
    l.close().unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "{\"step\":1,\"train/loss\":2.5,\"lr\":0.00001}\n{\"step\":2,\"train/loss\":null}\n"
    );
}

#[test]
fn csv_logger_writes_long_format_rows() {
    let dir = tempfile::tempdir().unwrap();
    let host = PluginHost::new(dir.path().join("copies"));
    let p = host
        .load_file(
            &common::build("ferl-plugin-csv", &[], &[]),
            Some(PluginKind::Logger),
        )
        .unwrap();
    let out = dir.path().join("m.csv");
    let mut l = LoggerInstance::open(p, out.to_str().unwrap()).unwrap();
    l.log(7, &[("loss", 0.25), ("grad,norm", 3.0)]).unwrap();
    l.close().unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "step,name,value\n7,loss,0.25\n7,\"grad,norm\",3\n"
    );
}

#[test]
fn alpaca_dataset_reads_json_and_csv() {
    let dir = tempfile::tempdir().unwrap();
    let host = PluginHost::new(dir.path().join("copies"));
    let p = host
        .load_file(
            &common::build("ferl-plugin-alpaca", &[], &[]),
            Some(PluginKind::Dataset),
        )
        .unwrap();
    let json = dir.path().join("a.json");
    std::fs::write(&json, r#"[{"instruction":"Add","input":"2+2","output":"4"},{"instruction":"Greet","input":"","output":"hi"}]"#).unwrap();
    let csv = dir.path().join("a.csv");
    std::fs::write(&csv, "instruction,input,output\nAdd,2+2,4\n\"Greet\",,hi\n").unwrap();
    for path in [&json, &csv] {
        let mut ds = DatasetInstance::open(p.clone(), path.to_str().unwrap()).unwrap();
        assert_eq!(ds.len(), 2);
        assert_eq!(
            ds.get(0).unwrap(),
            DatasetExample::PromptResponse {
                prompt: "Add\n\n2+2".into(),
                response: "4".into()
            }
        );
        assert_eq!(
            ds.get(1).unwrap(),
            DatasetExample::PromptResponse {
                prompt: "Greet".into(),
                response: "hi".into()
            }
        );
    }
    let e = match DatasetInstance::open(p, dir.path().join("missing.json").to_str().unwrap()) {
        Ok(_) => panic!("opened a missing file"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("alpaca@") && e.contains("missing.json"), "{e}");
}

fn python() -> std::path::PathBuf {
    let venv = std::env::var_os("FERL_VENV")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/ferl/venv")
        });
    let py = venv.join("bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/setup.sh (the venv holds the tensorboard package)",
        py.display()
    );
    py
}

#[test]
fn tensorboard_reads_the_event_files() {
    let dir = tempfile::tempdir().unwrap();
    let host = PluginHost::new(dir.path().join("copies"));
    let p = host
        .load_file(
            &common::build("ferl-plugin-tensorboard", &[], &[]),
            Some(PluginKind::Logger),
        )
        .unwrap();
    let logdir = dir.path().join("tb");
    let mut l = LoggerInstance::open(p, logdir.to_str().unwrap()).unwrap();
    for step in 1..=3u64 {
        l.log(
            step,
            &[
                ("train/loss", 4.0 / step as f64),
                ("train/lr", 1e-5 * step as f64),
            ],
        )
        .unwrap();
    }
    l.close().unwrap();
    let script = r#"
import sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
acc.Reload()
for tag in sorted(acc.Tags()["scalars"]):
    for e in acc.Scalars(tag):
        print(f"{tag} {e.step} {e.value:.6g}")
"#;
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(&logdir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text,
        "train/loss 1 4\ntrain/loss 2 2\ntrain/loss 3 1.33333\ntrain/lr 1 1e-05\ntrain/lr 2 2e-05\ntrain/lr 3 3e-05\n",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
