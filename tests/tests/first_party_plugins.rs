//! The first-party plugins out of the box ("One trainer", item 6): built with `ferl` (cargo puts
//! `libferl_plugin_*.so` beside `target/<profile>/ferl`), they are found next to the binary with no
//! `$FERL_PLUGIN_PATH`: `ferl sft ... trainer.logger=[console,tensorboard,csv] data.plugin=alpaca
//! model.use_liger=true` trains and writes the TensorBoard event file and the CSV file into its run folder.
//! `FERL_NO_DEFAULT_PLUGINS=1` turns the default folder off. Its log, on a stderr redirected to a pipe, is plain text
//! (no colour codes) with one line for the five plugins loaded (issue 36, bug 9).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferl_tests::*;

/// The first-party plugin packages and their plugin names.
const FIRST_PARTY: [(&str, &str); 5] = [
    ("ferl-plugin-tensorboard", "tensorboard"),
    ("ferl-plugin-csv", "csv"),
    ("ferl-plugin-alpaca", "alpaca"),
    ("ferl-plugin-liger", "liger"),
    ("ferl-plugin-gsm8k", "gsm8k"),
];

/// The file cargo gives package `package`'s cdylib.
fn cdylib(package: &str) -> String {
    format!(
        "{}{}{}",
        std::env::consts::DLL_PREFIX,
        package.replace('-', "_"),
        std::env::consts::DLL_SUFFIX
    )
}

/// `target/<profile>/ferl`, with the first-party plugin libraries beside it (built first when one is missing;
/// `scripts/test.sh` builds them with every other target).
fn ferl_with_plugins() -> PathBuf {
    let ferl = ferl_binary();
    let dir = ferl.parent().unwrap().to_path_buf();
    let missing = || {
        FIRST_PARTY
            .iter()
            .any(|(p, _)| !dir.join(cdylib(p)).is_file())
    };
    if missing() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--lib"]).current_dir(repo_root());
        for (p, _) in FIRST_PARTY {
            cmd.args(["-p", p]);
        }
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        assert!(
            cmd.status().expect("run cargo build").success(),
            "building the first-party plugins failed"
        );
    }
    assert!(
        !missing(),
        "first-party plugins missing in {}",
        dir.display()
    );
    ferl
}

fn output(out: Output) -> (bool, String) {
    let text = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// 8 Alpaca-style records (a format only the `alpaca` dataset plugin reads).
fn write_alpaca(file: &Path) {
    let rows: Vec<serde_json::Value> = (0..8)
        .map(|i| {
            serde_json::json!({
                "instruction": format!("Add {i} and {i}."),
                "input": "",
                "output": format!("{}", 2 * i),
            })
        })
        .collect();
    std::fs::write(file, serde_json::Value::Array(rows).to_string()).unwrap();
}

/// `ferl sft` on the fixture's tiny model and its file `data` for 2 steps into the fixture's folder `run`, with
/// `extra` overrides, no `$FERL_PLUGIN_PATH`, and `no_defaults` as `$FERL_NO_DEFAULT_PLUGINS`; logs at the default
/// level (`info`), on stderr redirected to a pipe.
fn ferl_sft(
    ferl: &Path,
    fx: &Fixture,
    data: &str,
    run: &str,
    extra: &[&str],
    no_defaults: bool,
) -> Output {
    let d = fx.dir.path();
    let mut o = vec![
        format!("model.partial_pretrain={}", d.join("model").display()),
        format!("data.train_files={}", d.join(data).display()),
        "data.val_files=[]".into(),
        "data.train_batch_size=4".into(),
        "data.micro_batch_size_per_gpu=2".into(),
        "data.max_length=64".into(),
        "data.truncation=right".into(),
        "trainer.total_training_steps=2".into(),
        format!("trainer.default_local_dir={}", d.join(run).display()),
        "trainer.device=cpu".into(),
        "trainer.resume_mode=disable".into(),
        "model.enable_gradient_checkpointing=false".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    let mut cmd = Command::new(ferl);
    cmd.arg("sft")
        .args(&o)
        .env_remove("FERL_PLUGIN_PATH")
        .env("OMP_NUM_THREADS", "1")
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR");
    if no_defaults {
        cmd.env("FERL_NO_DEFAULT_PLUGINS", "1");
    } else {
        cmd.env_remove("FERL_NO_DEFAULT_PLUGINS");
    }
    cmd.output().expect("start ferl sft")
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
    {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn first_party_plugins_are_found_next_to_ferl_without_plugin_path() {
    let ferl = ferl_with_plugins();
    let fx = Fixture::new().unwrap();
    write_alpaca(&fx.dir.path().join("alpaca.json"));
    let out = ferl_sft(
        &ferl,
        &fx,
        "alpaca.json",
        "run",
        &[
            "trainer.logger=[console,tensorboard,csv]",
            "data.plugin=alpaca",
            "model.use_liger=true",
        ],
        false,
    );
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let (ok, text) = output(out);
    assert!(ok, "ferl sft with the first-party plugins failed:\n{text}");
    let run_dir = fx.dir.path().join("run");

    // Issue 36 bug 9: a redirected log is plain text, and the five default plugins make one line, not five.
    assert!(
        !stderr.contains("\x1b["),
        "colour codes on a redirected stderr:\n{stderr}"
    );
    let load_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("plugin") && l.contains("loaded"))
        .collect();
    assert_eq!(load_lines.len(), 1, "plugin-load lines:\n{stderr}");
    for (_, name) in FIRST_PARTY {
        assert!(
            load_lines[0].contains(&format!("{name}@")),
            "`{name}` missing from {load_lines:?}"
        );
    }

    let csv = std::fs::read_to_string(run_dir.join("metrics.csv"))
        .unwrap_or_else(|e| panic!("metrics.csv: {e}\n{text}"));
    assert!(
        csv.starts_with("step,name,value\n") && csv.contains("\n2,train/loss,"),
        "{csv}"
    );
    let events: Vec<PathBuf> = walk(&run_dir.join("tensorboard_log"))
        .into_iter()
        .filter(|p| p.to_string_lossy().contains("tfevents"))
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(std::fs::metadata(&events[0]).unwrap().len() > 100);

    // The run's plugin state: every first-party plugin, loaded from the file beside the binary.
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("plugins/state.json")).unwrap())
            .unwrap();
    let rows = state
        .as_array()
        .or_else(|| state["plugins"].as_array())
        .unwrap_or_else(|| panic!("plugins/state.json: {state}"));
    let bin_dir = ferl.parent().unwrap();
    for (package, name) in FIRST_PARTY {
        let row = rows
            .iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("no `{name}` in plugins/state.json: {state}"));
        assert_eq!(
            row["file"].as_str().map(PathBuf::from),
            Some(bin_dir.join(cdylib(package))),
            "{row}"
        );
    }
}

#[test]
fn no_default_plugins_turns_the_folder_beside_ferl_off() {
    let ferl = ferl_with_plugins();
    let fx = Fixture::new().unwrap();
    // The fixture's GSM8K rows: read without a dataset plugin, so only the logger can be refused.
    let (ok, text) = output(ferl_sft(
        &ferl,
        &fx,
        "train.jsonl",
        "run",
        &["trainer.logger=[console,tensorboard]"],
        true,
    ));
    assert!(
        !ok,
        "FERL_NO_DEFAULT_PLUGINS=1 without FERL_PLUGIN_PATH still found plugins:\n{text}"
    );
    assert!(
        text.contains("`tensorboard`"),
        "the refusal names the missing logger:\n{text}"
    );
}
