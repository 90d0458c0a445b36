//! The `mlflow` logger end to end (issue 36): `ferl sft ... trainer.logger=[console,jsonl,mlflow]` with
//! `MLFLOW_TRACKING_URI=file://...` writes MLflow's file store, and the mlflow Python package reads it back
//! (`trainer/py/mlflow_read.py`): the experiment named `trainer.project_name`, one FINISHED run named
//! `trainer.experiment_name`, `train/loss` per step equal to `metrics.jsonl`'s (and to the console's to its 6
//! decimals), the resolved config as params and the run name as the `mlflow.runName` tag.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferl_tests::*;

/// The venv's Python; required (the venv holds the mlflow package), under CI and off it.
fn python() -> PathBuf {
    let venv = std::env::var_os("FERL_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/ferl/venv"));
    let py = venv.join("bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/setup.sh (the venv holds the mlflow package)",
        py.display()
    );
    py
}

/// What the mlflow package reads from the store at `uri` for experiment `name`.
fn read_store(uri: &str, name: &str) -> serde_json::Value {
    let script = repo_root().join("trainer/py/mlflow_read.py");
    let out = Command::new(python())
        .arg(script)
        .args([uri, name])
        .output()
        .expect("run mlflow_read.py");
    assert!(
        out.status.success(),
        "mlflow_read.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("mlflow_read.py prints JSON")
}

/// `(step, train/loss)` of each line of `metrics.jsonl`.
fn jsonl_losses(run_dir: &Path) -> Vec<(i64, f64)> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_i64().unwrap(),
                v["train/loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// `train/loss` of each `step N | ...` console line.
fn console_losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .filter_map(|l| l.split(" | ").find_map(|p| p.strip_prefix("train/loss ")))
        .map(|v| v.trim().parse().unwrap())
        .collect()
}

#[test]
fn mlflow_logger_writes_a_file_store_mlflow_reads() {
    let fx = Fixture::new().unwrap();
    let store = fx.dir.path().join("tracking");
    let uri = format!("file://{}", store.display());
    let o = fx.overrides(
        3,
        "run",
        &[
            "trainer.logger=[console,jsonl,mlflow]",
            "trainer.project_name=ferl-proj",
            "trainer.experiment_name=mlflow-run",
            "trainer.resume_mode=disable",
        ],
    );
    let out = Command::new(ferl_binary())
        .arg("sft")
        .args(&o)
        .env("MLFLOW_TRACKING_URI", &uri)
        .env("OMP_NUM_THREADS", "1")
        .env("FERL_NO_DEFAULT_PLUGINS", "1")
        .env_remove("FERL_PLUGIN_PATH")
        .output()
        .expect("start ferl sft");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "ferl sft failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let got = read_store(&uri, "ferl-proj");
    let exp = &got["experiment"];
    assert_eq!(exp["name"], "ferl-proj", "{got}");
    assert_eq!(exp["lifecycle_stage"], "active", "{got}");
    let runs = got["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{got}");
    let run = &runs[0];
    assert_eq!(run["run_name"], "mlflow-run", "{got}");
    assert_eq!(run["status"], "FINISHED", "{got}");
    assert!(run["end_time"].as_i64().unwrap() >= run["start_time"].as_i64().unwrap());
    assert_eq!(run["tags"]["mlflow.runName"], "mlflow-run", "{got}");
    assert_eq!(run["params"]["trainer.experiment_name"], "mlflow-run");
    assert_eq!(run["params"]["data.train_batch_size"], "8");
    assert_eq!(
        run["params"]["trainer.logger"], "[console,jsonl,mlflow]",
        "{got}"
    );
    assert!(store.join(".trash").is_dir() && store.join("0/meta.yaml").is_file());

    let history: Vec<(i64, f64)> = run["metrics"]["train/loss"]
        .as_array()
        .expect("train/loss history")
        .iter()
        .map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap()))
        .collect();
    let jsonl = jsonl_losses(&fx.dir.path().join("run"));
    assert_eq!(jsonl.len(), 3, "{jsonl:?}");
    assert_eq!(history, jsonl, "mlflow's train/loss against metrics.jsonl");
    let console = console_losses(&stdout);
    assert_eq!(console.len(), 3, "{stdout}");
    for ((_, m), c) in history.iter().zip(&console) {
        assert!((m - c).abs() <= 5e-7, "mlflow {m} vs console {c}");
    }
    for key in ["train/lr", "train/grad_norm"] {
        let n = run["metrics"][key].as_array().map_or(0, Vec::len);
        assert_eq!(n, 3, "{key}: {got}");
    }
}
