//! The plugin template stands alone (issue 36, bug 7): a copy of `examples/plugin-template` outside the checkout,
//! with only its one documented dependency line pointed at this checkout's `plugins/abi`, builds with
//! `cargo build --release --offline`; `ferl plugin list --dir` shows the library, and `ferl sft ...
//! trainer.logger=[console,template]` with `$FERL_PLUGIN_PATH` set, as the template's README runs it, writes the
//! logger's `RUN_DIR/template.log`. The template's spelled-out lints stay those of the workspace.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferl_tests::*;

/// The dependency line of the template's `Cargo.toml` that a copy points at its ferl checkout (README.md says so).
const ABI_LINE: &str = r#"ferl-plugin-abi = { path = "../../plugins/abi" }"#;

/// Copies folder `from` into `to` (created), skipping any `target` folder.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if src.is_dir() {
            if e.file_name() != "target" {
                copy_dir(&src, &dst);
            }
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

/// The `key = value` lines of TOML table `[header]` in `text` (comments and blank lines dropped).
fn table_lines<'a>(text: &'a str, header: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|l| l.trim() != header)
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with('['))
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

#[test]
fn template_lints_are_the_workspace_lints() {
    let root = repo_root();
    let ws = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let tpl = std::fs::read_to_string(root.join("examples/plugin-template/Cargo.toml")).unwrap();
    for kind in ["rust", "clippy"] {
        let want = table_lines(&ws, &format!("[workspace.lints.{kind}]"));
        assert!(
            !want.is_empty(),
            "no [workspace.lints.{kind}] in Cargo.toml"
        );
        assert_eq!(
            table_lines(&tpl, &format!("[lints.{kind}]")),
            want,
            "examples/plugin-template/Cargo.toml's [lints.{kind}] differs from the workspace's"
        );
    }
}

/// Copies the template into `dir/my-plugin`, changes only its documented `ferl-plugin-abi` line to this checkout's
/// `plugins/abi`, builds it there with `cargo build --release --offline` (its own target folder `dir/target`) and
/// copies the library into `dir/my-plugin/plugins`, as the template's README does. Returns `(copy, plugins folder)`.
fn build_copy(dir: &Path) -> (PathBuf, PathBuf) {
    let root = repo_root();
    let copy = dir.join("my-plugin");
    copy_dir(&root.join("examples/plugin-template"), &copy);
    let manifest = copy.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    assert_eq!(text.matches(ABI_LINE).count(), 1, "{text}");
    let abi = root.join("plugins/abi");
    let line = format!(r#"ferl-plugin-abi = {{ path = "{}" }}"#, abi.display());
    std::fs::write(&manifest, text.replace(ABI_LINE, &line)).unwrap();

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = dir.join("target");
    let out = Command::new(cargo)
        .args(["build", "--release", "--offline"])
        .current_dir(&copy)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .expect("run cargo build");
    assert!(
        out.status.success(),
        "building the copied template failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lib = format!(
        "{}ferl_plugin_template{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let plugins = copy.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::fs::copy(target.join("release").join(&lib), plugins.join(&lib)).unwrap();
    (copy, plugins)
}

/// `FERL_PLUGIN_PATH=PLUGINS ferl sft <keys> trainer.logger=[console,template]` in folder `cwd`: one step of the
/// fixture's tiny model into `run_dir`.
fn sft_with_template(ferl: &Path, fx: &Fixture, cwd: &Path, plugins: &Path, run_dir: &Path) {
    let d = fx.dir.path();
    let out = Command::new(ferl)
        .arg("sft")
        .arg(format!(
            "model.partial_pretrain={}",
            d.join("model").display()
        ))
        .arg(format!(
            "data.train_files={}",
            d.join("train.jsonl").display()
        ))
        .args([
            "data.val_files=[]",
            "data.train_batch_size=2",
            "data.micro_batch_size_per_gpu=2",
            "data.max_length=256",
            "data.truncation=right",
            "trainer.total_training_steps=1",
            "trainer.device=cpu",
            "trainer.resume_mode=disable",
            "model.enable_gradient_checkpointing=false",
            "trainer.logger=[console,template]",
        ])
        .arg(format!("trainer.default_local_dir={}", run_dir.display()))
        .current_dir(cwd)
        .env("FERL_PLUGIN_PATH", plugins)
        .env_remove("FERL_NO_DEFAULT_PLUGINS")
        .env("OMP_NUM_THREADS", "1")
        .env("RUST_LOG", "warn")
        .output()
        .expect("start ferl sft");
    assert!(
        out.status.success(),
        "ferl sft with the template logger failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_copy_of_the_template_builds_outside_the_checkout_and_logs_a_run() {
    let tmp = tempfile::tempdir().unwrap();
    let (copy, plugins) = build_copy(tmp.path());

    let ferl = ferl_binary();
    let out = Command::new(&ferl)
        .args(["plugin", "list", "--dir"])
        .arg(&plugins)
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "ferl plugin list --dir: {out:?}");
    let row: Vec<&str> = listed
        .lines()
        .find(|l| l.starts_with("template "))
        .unwrap_or_else(|| panic!("no `template` row:\n{listed}"))
        .split_whitespace()
        .collect();
    assert_eq!(&row[..3], ["template", "logger", "0.1.0"], "{listed}");

    let fx = Fixture::new().unwrap();
    let run_dir = fx.dir.path().join("run");
    sft_with_template(&ferl, &fx, &copy, &plugins, &run_dir);
    let log = std::fs::read_to_string(run_dir.join("template.log"))
        .unwrap_or_else(|e| panic!("RUN_DIR/template.log: {e}"));
    let rows: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert_eq!(rows.len(), 1, "{log}");
    assert_eq!(rows[0]["step"], 1, "{log}");
    let loss = rows[0]["train/loss"].as_f64().unwrap_or(f64::NAN);
    assert!(loss.is_finite() && loss > 0.0, "{log}");
}
