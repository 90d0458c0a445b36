//! Helpers shared by the integration tests: finding the project's Python venv and running the reference script.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The venv's python, or `None` (with the reason printed) when the venv is missing.
pub fn venv_python() -> Option<PathBuf> {
    let venv = std::env::var_os("FERL_VENV")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/ferl/venv")))?;
    let py = venv.join("bin/python");
    if py.exists() {
        Some(py)
    } else {
        // Under CI a missing reference environment fails the run: parity tests never pass vacuously there.
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but no Python venv at {}: .ci/run must install it (scripts/setup.sh)",
            venv.display()
        );
        println!(
            "SKIP: no Python venv at {} (run scripts/setup.sh)",
            venv.display()
        );
        None
    }
}

/// The reference script in `trainer/py/`.
pub fn reference_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("py/parity_reference.py")
}

/// Runs `python parity_reference.py args...`, panicking with its stderr on failure.
pub fn run_reference(py: &Path, args: &[&str]) {
    let out = Command::new(py)
        .arg(reference_script())
        .args(args)
        .output()
        .expect("start python");
    assert!(
        out.status.success(),
        "reference script {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Tokenized samples of a `data.json` written by the reference script.
pub struct Samples {
    /// Per sample: token ids.
    pub ids: Vec<Vec<i64>>,
    /// Per sample: loss mask.
    pub masks: Vec<Vec<bool>>,
}

/// Reads `data.json`.
pub fn read_samples(file: &Path) -> Samples {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let mut ids = Vec::new();
    let mut masks = Vec::new();
    for s in v.as_array().unwrap() {
        ids.push(
            s["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect(),
        );
        masks.push(
            s["loss_mask"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_bool().unwrap())
                .collect(),
        );
    }
    Samples { ids, masks }
}

impl Samples {
    /// Borrowed view of sample `i`.
    pub fn get(&self, i: usize) -> ferl_trainer::batch::SampleRef<'_> {
        ferl_trainer::batch::SampleRef {
            input_ids: &self.ids[i],
            loss_mask: &self.masks[i],
        }
    }
}

/// A JSON array of numbers as f64.
pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// A file of raw little-endian float32 values (what the reference script's `logits` writes).
pub fn read_f32s(file: &Path) -> Vec<f32> {
    std::fs::read(file)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}
