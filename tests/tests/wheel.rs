//! Install without building (issue 36, item 5): `scripts/wheel.sh` packs the `ferl` binary this test run uses into a
//! wheel (maturin, the `wheel/` launcher) that depends on `torch==2.11.0`. It is installed with `pip install
//! --no-index` into a fresh venv where torch is present only through a `.pth` line naming another environment's
//! site-packages, so pip resolves the dependency without a download and the launcher can find libtorch only by asking
//! Python where the torch package is: no path to it is baked in or inherited (`LD_LIBRARY_PATH` is cleared). From a
//! folder outside the checkout, `ferl demo` then runs the demo config from the files the wheel carries, with the csv
//! logger plugin the wheel carries beside the binary. Without torch, `ferl` says how to install it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferl_tests::*;

/// Runs `cmd`, failing the test with its output when it does not succeed.
fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_success(&out, what);
    out
}

/// Packs the wheel from this test run's build (`target/<profile>`) and returns its path.
fn build_wheel() -> PathBuf {
    let profile_dir = ferl_binary().parent().unwrap().to_path_buf();
    let target = profile_dir.parent().unwrap();
    let profile = match profile_dir.file_name().unwrap().to_str().unwrap() {
        "debug" => "dev".to_string(),
        other => other.to_string(),
    };
    let out = run_ok(
        Command::new(repo_root().join("scripts/wheel.sh"))
            .env("CARGO_TARGET_DIR", target)
            .env("FERL_WHEEL_PROFILE", profile)
            .env("FERL_WHEEL_PREBUILT", "1"),
        "scripts/wheel.sh",
    );
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        path.is_file(),
        "scripts/wheel.sh printed {}",
        path.display()
    );
    path
}

/// A Python one-liner's stdout.
fn python(python: &Path, code: &str) -> String {
    let out = run_ok(Command::new(python).args(["-c", code]), code);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The wheel's file names and its METADATA's `Requires-Dist` lines.
fn wheel_contents(wheel: &Path) -> (Vec<String>, Vec<String>) {
    let code = format!(
        "import zipfile\nz = zipfile.ZipFile({:?})\nprint('\\n'.join(z.namelist()))\nprint('--')\n\
         m = [n for n in z.namelist() if n.endswith('.dist-info/METADATA')][0]\n\
         print('\\n'.join(l for l in z.read(m).decode().splitlines() if l.startswith('Requires-Dist')))",
        wheel.display().to_string()
    );
    let text = python(Path::new("python3"), &code);
    let (names, requires) = text.split_once("\n--").expect("the listing's separator");
    let lines = |s: &str| {
        s.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    };
    (lines(names), lines(requires))
}

/// `ferl` as the venv's PATH entry runs it, with nothing of this checkout's environment that could find libtorch.
fn venv_ferl(venv: &Path, cwd: &Path) -> Command {
    let mut cmd = Command::new(venv.join("bin/ferl"));
    cmd.current_dir(cwd)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("FERL_TORCH_LIB")
        .env_remove("FERL_PLUGIN_PATH")
        .env_remove("FERL_PYTHON")
        .env(
            "PATH",
            format!("{}:/usr/bin:/bin", venv.join("bin").display()),
        );
    cmd
}

/// Asserts the wheel's metadata and that it carries the binary, a plugin and the demo's files.
fn assert_wheel_contents(wheel: &Path) {
    let (names, requires) = wheel_contents(wheel);
    assert_eq!(
        requires,
        ["Requires-Dist: torch==2.11.0"],
        "{}",
        wheel.display()
    );
    for want in [
        "ferl-0.1.0.data/scripts/ferl",
        "ferl-0.1.0.data/data/lib/ferl/ferl",
        "ferl-0.1.0.data/data/lib/ferl/libferl_plugin_csv.so",
        "ferl-0.1.0.data/data/share/ferl/examples/configs/gsm8k_tiny.yaml",
        "ferl-0.1.0.data/data/share/ferl/assets/tokenizers/qwen3/tokenizer.json",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} is not in {}: {names:?}",
            wheel.display()
        );
    }
}

/// Makes a fresh venv that sees ferl's torch through one `.pth` line and installs the wheel into it
/// with `pip --no-index`; returns that `.pth` file.
fn install_into_fresh_venv(wheel: &Path, venv: &Path) -> PathBuf {
    run_ok(
        Command::new("python3").args(["-m", "venv"]).arg(venv),
        "python3 -m venv",
    );
    let py = venv.join("bin/python");
    let site = PathBuf::from(python(
        &py,
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
    ));
    // torch lives in ferl's own venv; the fresh venv sees that site-packages through one .pth line, no more.
    let torch_site = python(
        Path::new("python3"),
        "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))",
    );
    let pth = site.join("torch-elsewhere.pth");
    std::fs::write(&pth, format!("{torch_site}\n")).unwrap();
    run_ok(
        Command::new(&py)
            .args([
                "-m",
                "pip",
                "install",
                "--no-index",
                "--disable-pip-version-check",
                "-q",
            ])
            .arg(wheel),
        "pip install --no-index <wheel>",
    );
    pth
}

/// Asserts what the 4-step demo wrote under `ckpt`: four jsonl records with falling loss, a
/// validation at step 4, the csv plugin's file and the step-4 checkpoint.
fn assert_demo_outputs(ckpt: &Path) {
    let records: Vec<serde_json::Value> = std::fs::read_to_string(ckpt.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = records
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4], "{}", ckpt.display());
    let loss = |i: usize| records[i]["train/loss"].as_f64().unwrap();
    assert!(
        loss(0).is_finite() && loss(3) < loss(0),
        "train/loss {} -> {}",
        loss(0),
        loss(3)
    );
    assert!(records[3]["val/loss"].is_f64(), "{}", records[3]);
    // The csv logger is a plugin: only the wheel's copy beside the binary can have written this.
    let csv =
        std::fs::read_to_string(ckpt.join("metrics.csv")).expect("the csv plugin's metrics.csv");
    assert!(csv.lines().any(|l| l.starts_with("4,train/loss,")), "{csv}");
    assert!(ckpt.join("global_step_4").is_dir());
}

#[test]
fn the_wheel_installs_into_a_fresh_venv_and_runs_the_demo_config() {
    let wheel = build_wheel();
    assert_wheel_contents(&wheel);
    let dir = tempfile::tempdir().unwrap();
    let venv = dir.path().join("venv");
    let torch_pth = install_into_fresh_venv(&wheel, &venv);

    let work = dir.path().join("elsewhere");
    std::fs::create_dir_all(&work).unwrap();
    let out = run_ok(
        venv_ferl(&venv, &work).args([
            "demo",
            "--out",
            "demo",
            "trainer.total_training_steps=4",
            "trainer.test_freq=2",
            "trainer.save_freq=4",
            "data.val_max_samples=8",
            "trainer.logger=[console,jsonl,csv]",
        ]),
        "the installed `ferl demo`",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("trained steps 1..4 on 2 rank(s)"),
        "{stdout}"
    );
    assert_demo_outputs(&work.join("demo/checkpoints"));

    std::fs::remove_file(torch_pth).unwrap();
    let out = venv_ferl(&venv, &work).arg("--version").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("torch is not installed for")
            && stderr.contains("pip install torch==2.11.0"),
        "{stderr}"
    );
}
