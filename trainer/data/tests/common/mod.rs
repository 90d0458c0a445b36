//! Paths to the repository's assets and the optional Python venv used for parity checks.

#![allow(dead_code)]

use std::path::PathBuf;

/// `assets/` at the repository root.
pub(crate) fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets")
}

/// The real Qwen tokenizer folder.
pub(crate) fn qwen_tokenizer() -> PathBuf {
    assets().join("tokenizers/qwen3")
}

/// The GSM8K jsonl folder.
pub(crate) fn gsm8k_raw() -> PathBuf {
    assets().join("data/gsm8k")
}

/// `$FERL_VENV/bin/python` when it exists and imports `module`; otherwise `None` with the reason printed.
pub(crate) fn venv_python(module: &str) -> Option<PathBuf> {
    let Some(venv) = std::env::var_os("FERL_VENV") else {
        println!("skipping the Python check: FERL_VENV is not set (source scripts/env.sh)");
        return None;
    };
    let py = PathBuf::from(venv).join("bin/python");
    let ok = std::process::Command::new(&py)
        .args(["-c", &format!("import {module}")])
        .output();
    match ok {
        Ok(o) if o.status.success() => Some(py),
        _ => {
            println!(
                "skipping the Python check: {} cannot import {module}",
                py.display()
            );
            None
        }
    }
}
