//! Helpers shared by the integration tests: finding the project's Python venv and running the reference script.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The venv's python, or `None` (with the reason printed) when the venv is missing.
pub(crate) fn venv_python() -> Option<PathBuf> {
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
pub(crate) fn reference_script() -> PathBuf {
    py_script("parity_reference.py")
}

/// The script `name` in `trainer/py/`.
pub(crate) fn py_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../py")
        .join(name)
}

/// Runs `python parity_reference.py args...`, panicking with its stderr on failure.
pub(crate) fn run_reference(py: &Path, args: &[&str]) {
    run_script(py, "parity_reference.py", args);
}

/// Runs `python py/<script> args...`, panicking with its stderr on failure.
pub(crate) fn run_script(py: &Path, script: &str, args: &[&str]) {
    let out = Command::new(py)
        .arg(py_script(script))
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
pub(crate) struct Samples {
    /// Per sample: token ids.
    pub ids: Vec<Vec<i64>>,
    /// Per sample: loss mask.
    pub masks: Vec<Vec<bool>>,
}

/// Reads `data.json`.
pub(crate) fn read_samples(file: &Path) -> Samples {
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
    pub(crate) fn get(&self, i: usize) -> ferl_trainer::batch::SampleRef<'_> {
        ferl_trainer::batch::SampleRef {
            input_ids: &self.ids[i],
            loss_mask: &self.masks[i],
        }
    }
}

/// A JSON array of numbers as f64.
pub(crate) fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// A file of raw little-endian float32 values (what the reference script's `logits` writes).
pub(crate) fn read_f32s(file: &Path) -> Vec<f32> {
    std::fs::read(file)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A reference script kept running between requests, so that Python and its imports start once per test: it prints
/// `ready` when its first results are written, then answers each line written to its stdin with `done` (e.g.
/// `py/peft_reference.py train`). Its stderr goes to a file, shown when it fails. Dropping it closes stdin and waits.
pub(crate) struct ReferenceSession {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    stderr: PathBuf,
}

impl ReferenceSession {
    /// Runs `py script args...` (stderr to the file `stderr`) and waits for its `ready`.
    pub(crate) fn start(py: &Path, script: &str, args: &[&str], stderr: &Path) -> Self {
        let mut child = Command::new(py)
            .arg(py_script(script))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(stderr).expect("create the stderr file"))
            .spawn()
            .expect("start python");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut session = Self {
            child,
            stdin,
            stdout,
            stderr: stderr.to_path_buf(),
        };
        session.expect("ready");
        session
    }

    /// Sends one request line and waits for its `done`.
    pub(crate) fn request(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("session open");
        writeln!(stdin, "{line}").expect("write to the reference script");
        stdin.flush().expect("flush to the reference script");
        self.expect("done");
    }

    /// Reads stdout up to the line `word`; panics with the script's stderr when it ends first.
    fn expect(&mut self, word: &str) {
        let mut line = String::new();
        loop {
            line.clear();
            if self.stdout.read_line(&mut line).expect("read stdout") == 0 {
                let status = self.child.wait().expect("wait for python");
                panic!(
                    "reference script ended ({status}) before `{word}`:\n{}",
                    std::fs::read_to_string(&self.stderr).unwrap_or_default()
                );
            }
            if line.trim() == word {
                return;
            }
        }
    }
}

impl Drop for ReferenceSession {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

/// Largest absolute elementwise difference of two tensors of one shape (as f64).
pub(crate) fn max_abs_diff(a: &tch::Tensor, b: &tch::Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    (a.to_kind(tch::Kind::Double) - b.to_kind(tch::Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}
