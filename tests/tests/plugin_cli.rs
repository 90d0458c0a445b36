//! `ferl plugin list` and `ferl plugin reload` against a running `ferl sft` job (the `ferl` binary, issue 5 point 2).
//!
//! The job trains the tiny Qwen2 with `model.use_liger=true` and the `testkit` logger plugin, both loaded from
//! `$FERL_PLUGIN_PATH`. While it runs, `ferl plugin list --run-dir` shows both plugins with their kinds and versions;
//! then each file is replaced by a rebuilt version with the same name, size and modification time (the builds are
//! padded to one size), so the folder watcher cannot notice and only `ferl plugin reload NAME` makes the job load it;
//! the job switches at its next step boundary: the list and the job's log show the new versions, the job keeps
//! training, and its per-step losses and grad norms are exactly those of a run that never reloaded anything.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use ferl::plugins::cargo_build::{build_plugin, workspace_root, PluginBuild};
use ferl_tests::*;

/// Builds plugin `package` with build environment `env` (cached per package and environment, shared with the
/// bridge's tests).
fn build(package: &str, env: &[(&str, &str)]) -> PathBuf {
    let ws = workspace_root(&repo_root()).unwrap();
    let key: String = std::iter::once(package.to_string())
        .chain(env.iter().map(|(k, v)| format!("{k}={v}")))
        .collect::<Vec<_>>()
        .join("-");
    let spec = PluginBuild {
        package: package.into(),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let target = std::env::temp_dir().join("ferl-plugin-builds").join(key);
    build_plugin(&ws, &target, &spec).unwrap_or_else(|e| panic!("{e:#}"))
}

/// A running `ferl sft`, killed when dropped (a failed assertion never leaves it behind).
struct Job {
    child: Child,
    log: PathBuf,
}

impl Job {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics with the job's log if it has exited.
    fn assert_running(&mut self, what: &str) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("{what}: the job exited ({status}):\n{}", self.log());
        }
    }

    /// Waits until `cond` holds, the job still running.
    fn wait_for(&mut self, what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            self.assert_running(what);
            assert!(
                start.elapsed() < timeout,
                "{what}: not within {timeout:?}; job log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `(step, train/loss, train/grad_norm)` of the complete lines of `run_dir/metrics.jsonl` (the last line may be
/// half-written while the job runs).
fn logged_steps(run_dir: &Path) -> Vec<(u64, f64, f64)> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("metrics.jsonl line {l:?}: {e}"));
            (
                v["step"].as_u64().unwrap(),
                v["train/loss"].as_f64().unwrap(),
                v["train/grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn check(out: Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{what} failed:\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `ferl plugin list --run-dir RUN_DIR` as `(name, kind, version, state)` rows.
fn list(ferl: &Path, run_dir: &Path) -> Vec<(String, String, String, String)> {
    let out = Command::new(ferl)
        .args(["plugin", "list", "--run-dir"])
        .arg(run_dir)
        .output()
        .unwrap();
    let text = check(out, "ferl plugin list --run-dir");
    let mut lines = text.lines();
    let header = lines.next().unwrap_or_default();
    assert!(
        header.starts_with("NAME") && header.contains("KIND") && header.contains("VERSION"),
        "{text}"
    );
    lines
        .filter(|l| !l.starts_with(' '))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert!(f.len() >= 5, "list row {l:?}");
            (f[0].into(), f[1].into(), f[2].into(), f[3].into())
        })
        .collect()
}

fn current_version(rows: &[(String, String, String, String)], name: &str) -> Option<String> {
    rows.iter()
        .find(|r| r.0 == name && r.3 == "current")
        .map(|r| r.2.clone())
}

/// `a` and `b` copied into `dir` under their names, the shorter padded with zeros to the longer's size (a loader
/// ignores bytes after an ELF file's last section).
fn same_size_copies(dir: &Path, a: &Path, b: &Path) -> (PathBuf, PathBuf) {
    let (mut x, mut y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    let len = x.len().max(y.len());
    x.resize(len, 0);
    y.resize(len, 0);
    std::fs::create_dir_all(dir).unwrap();
    let stem = a.file_stem().unwrap().to_string_lossy().to_string();
    let (pa, pb) = (
        dir.join(format!("{stem}-v1")),
        dir.join(format!("{stem}-v2")),
    );
    std::fs::write(&pa, x).unwrap();
    std::fs::write(&pb, y).unwrap();
    (pa, pb)
}

/// Replaces `installed` by `new`'s bytes through a rename, keeping `installed`'s modification time.
fn replace_keeping_mtime(installed: &Path, new: &Path) {
    let old = std::fs::metadata(installed).unwrap();
    let tmp = installed.with_extension("replacement");
    std::fs::copy(new, &tmp).unwrap();
    File::options()
        .write(true)
        .open(&tmp)
        .unwrap()
        .set_modified(old.modified().unwrap())
        .unwrap();
    std::fs::rename(&tmp, installed).unwrap();
    let now = std::fs::metadata(installed).unwrap();
    assert_eq!(
        (now.len(), now.modified().unwrap()),
        (old.len(), old.modified().unwrap()),
        "the replaced file keeps size and time"
    );
}

const MINUTE: Duration = Duration::from_secs(60);

/// Replaces `installed` by `new` (same size and time), lets two steps pass to show the job does not notice by itself,
/// then `ferl plugin reload NAME` and waits until `list` shows the new version current.
fn reload(
    job: &mut Job,
    ferl: &Path,
    run_dir: &Path,
    name: &str,
    (installed, new): (&Path, &Path),
    (from, to): (&str, &str),
) {
    replace_keeping_mtime(installed, new);
    let before = logged_steps(run_dir).len();
    job.wait_for("two steps after the replacement", 5 * MINUTE, || {
        logged_steps(run_dir).len() >= before + 2
    });
    assert_eq!(
        current_version(&list(ferl, run_dir), name).as_deref(),
        Some(from),
        "{name}: nothing switches before the reload request"
    );
    let out = Command::new(ferl)
        .args(["plugin", "reload", name, "--timeout-s", "300", "--run-dir"])
        .arg(run_dir)
        .output()
        .unwrap();
    let answer = check(out, &format!("ferl plugin reload {name}"));
    assert!(
        answer.contains(&format!("version {to} loaded")),
        "reload {name}: {answer}"
    );
    job.wait_for(&format!("{name} {to} current"), 5 * MINUTE, || {
        current_version(&list(ferl, run_dir), name).as_deref() == Some(to)
    });
}

/// Starts `ferl ARGS` as a job with `plugins` as its plugin folder (output in `job.out`, log in `job.log` of the
/// fixture's folder) and waits until it logged two steps in `run_dir`.
fn start_job(ferl: &Path, fx: &Fixture, plugins: &Path, args: &[String], run_dir: &Path) -> Job {
    let log = fx.dir.path().join("job.log");
    let child = Command::new(ferl)
        .env("OMP_NUM_THREADS", "1")
        .env("RUST_LOG", "info")
        .env("FERL_PLUGIN_PATH", plugins)
        .args(args)
        .stdout(File::create(fx.dir.path().join("job.out")).unwrap())
        .stderr(File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut job = Job { child, log };
    job.wait_for("two steps trained", 5 * MINUTE, || {
        logged_steps(run_dir).len() >= 2
    });
    job
}

/// `ferl plugin list` of the job in `run_dir`: both plugins, their kinds and versions (before any reload).
fn assert_list_shows_both_plugins(ferl: &Path, run_dir: &Path) {
    let rows = list(ferl, run_dir);
    let row = |name: &str| {
        rows.iter()
            .find(|r| r.0 == name)
            .unwrap_or_else(|| panic!("no `{name}` row in {rows:?}"))
            .clone()
    };
    assert_eq!(
        row("testkit"),
        (
            "testkit".into(),
            "logger".into(),
            "1.0.0".into(),
            "current".into()
        )
    );
    assert_eq!(
        row("liger"),
        (
            "liger".into(),
            "kernel".into(),
            "0.1.0".into(),
            "current".into()
        )
    );
}

/// The `(step, loss, grad norm)` of the job in `run_dir` are exactly those of a run that never reloaded (built-in
/// liger kernels, no plugin folder, overrides `extra`).
fn assert_steps_match_a_run_without_reloads(
    ferl: &Path,
    fx: &Fixture,
    extra: &[&str],
    run_dir: &Path,
) {
    let steps = logged_steps(run_dir);
    let mut reference = fx.overrides(steps.len(), "reference", extra);
    reference.push("trainer.logger=[console,jsonl]".into());
    let out = Command::new(ferl)
        .env("OMP_NUM_THREADS", "1")
        .env_remove("FERL_PLUGIN_PATH")
        .arg("sft")
        .args(&reference)
        .output()
        .unwrap();
    check(out, "the reference ferl sft");
    let want = logged_steps(&fx.dir.path().join("reference"));
    assert_eq!(want.len(), steps.len());
    for (got, want) in steps.iter().zip(&want) {
        assert_eq!(got, want, "(step, loss, grad norm) with reloads vs without");
    }
}

#[test]
fn plugin_list_and_reload_against_a_running_sft_job() {
    let ferl = ferl_binary();
    let fx = Fixture::new().unwrap();
    let builds = fx.dir.path().join("builds");
    let testkit = same_size_copies(
        &builds,
        &build("ferl-plugin-testkit", &[("FERL_TESTKIT_VERSION", "1.0.0")]),
        &build("ferl-plugin-testkit", &[("FERL_TESTKIT_VERSION", "2.0.0")]),
    );
    let liger = same_size_copies(
        &builds,
        &build("ferl-plugin-liger", &[]),
        &build("ferl-plugin-liger", &[("FERL_LIGER_VERSION", "0.2.0")]),
    );
    let folder = fx.dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    let suffix = std::env::consts::DLL_SUFFIX;
    let installed_testkit = folder.join(format!("testkit{suffix}"));
    let installed_liger = folder.join(format!("liger{suffix}"));
    std::fs::copy(&testkit.0, &installed_testkit).unwrap();
    std::fs::copy(&liger.0, &installed_liger).unwrap();

    let extra = [
        "trainer.logger=[console,jsonl,testkit]",
        "model.use_liger=true",
        "optim.lr_scheduler=constant",
        "trainer.resume_mode=disable",
    ];
    // Far more steps than the test waits for: the job is stopped once the checks are done.
    let run_dir = fx.dir.path().join("job");
    let args: Vec<String> = std::iter::once("sft".to_string())
        .chain(fx.overrides(100_000, "job", &extra))
        .collect();
    let mut job = start_job(&ferl, &fx, &folder, &args, &run_dir);

    assert_list_shows_both_plugins(&ferl, &run_dir);

    // `reload`: each plugin's file rebuilt as a new version, then the job told to load it.
    reload(
        &mut job,
        &ferl,
        &run_dir,
        "testkit",
        (&installed_testkit, &testkit.1),
        ("1.0.0", "2.0.0"),
    );
    reload(
        &mut job,
        &ferl,
        &run_dir,
        "liger",
        (&installed_liger, &liger.1),
        ("0.1.0", "0.2.0"),
    );
    let switched_at = logged_steps(&run_dir).len();
    job.wait_for("three more steps after the switch", 5 * MINUTE, || {
        logged_steps(&run_dir).len() >= switched_at + 3
    });
    job.assert_running("after the reloads");
    let _ = job.child.kill();
    let _ = job.child.wait();

    let text = job.log();
    for (name, from, to) in [("testkit", "1.0.0", "2.0.0"), ("liger", "0.1.0", "0.2.0")] {
        let line = format!("plugin `{name}`: version {from} -> {to} after step");
        assert!(text.contains(&line), "no `{line}` in the job log:\n{text}");
    }
    assert_steps_match_a_run_without_reloads(&ferl, &fx, &extra, &run_dir);
}

/// Waits (up to 10 minutes) for `job` to end by itself, and requires success.
fn wait_job_success(job: &mut Job) {
    let start = Instant::now();
    let status = loop {
        if let Some(s) = job.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < 10 * MINUTE,
            "the job did not finish:
{}",
            job.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        status.success(),
        "the job failed ({status}):
{}",
        job.log()
    );
}

/// The `testkit` logger's own log in `run_dir` has every one of the `steps` steps once: version 1.0.0 up to the
/// switch (which happened by step `switched_by`) and 2.0.0 from then on.
fn assert_testkit_switched_once(run_dir: &Path, steps: usize, switched_by: u64) {
    let text = std::fs::read_to_string(run_dir.join("testkit.log")).unwrap();
    let mut seen = std::collections::BTreeMap::new();
    for line in text.lines() {
        let mut f = line.split(' ');
        let (version, step) = (f.next().unwrap(), f.next().unwrap().parse::<u64>().unwrap());
        seen.insert(step, version.to_string());
    }
    assert_eq!(
        seen.len(),
        steps,
        "every step logged once by some version:\n{text}"
    );
    let first_v2 = seen.iter().find(|(_, v)| *v == "2.0.0").map(|(s, _)| *s);
    let first_v2 = first_v2.unwrap_or_else(|| panic!("version 2.0.0 logged nothing:\n{text}"));
    assert!(
        first_v2 <= switched_by + 1,
        "2.0.0 from step {first_v2}, switched by {switched_by}"
    );
    for (step, version) in &seen {
        let want = if *step < first_v2 { "1.0.0" } else { "2.0.0" };
        assert_eq!(version, want, "step {step}:\n{text}");
    }
}

/// The same against `ferl sft --nproc-per-node 2` (an embedded cluster; the driver's plugin host owns the run
/// directory's control channel and the logger plugins): the `testkit` logger is reloaded while the ranks train; it
/// logs every step, version 1.0.0 up to the switch and 2.0.0 after it, and the run's losses are the single-process
/// trainer's.
#[test]
fn plugin_reload_against_a_running_distributed_sft_job() {
    let ferl = ferl_binary();
    let fx = Fixture::new().unwrap();
    let testkit = same_size_copies(
        &fx.dir.path().join("builds"),
        &build("ferl-plugin-testkit", &[("FERL_TESTKIT_VERSION", "1.0.0")]),
        &build("ferl-plugin-testkit", &[("FERL_TESTKIT_VERSION", "2.0.0")]),
    );
    let folder = fx.dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    let installed = folder.join(format!("testkit{}", std::env::consts::DLL_SUFFIX));
    std::fs::copy(&testkit.0, &installed).unwrap();
    let extra = [
        "trainer.logger=[console,jsonl,testkit]",
        "optim.lr_scheduler=constant",
        "trainer.resume_mode=disable",
    ];
    // Enough steps for the reload to happen well inside the run, which then ends by itself.
    let steps = 30;
    let run_dir = fx.dir.path().join("job");
    let args: Vec<String> = ["sft", "--nproc-per-node", "2"]
        .into_iter()
        .map(String::from)
        .chain(fx.overrides(steps, "job", &extra))
        .collect();
    let mut job = start_job(&ferl, &fx, &folder, &args, &run_dir);
    let rows = list(&ferl, &run_dir);
    assert_eq!(
        current_version(&rows, "testkit").as_deref(),
        Some("1.0.0"),
        "{rows:?}"
    );
    reload(
        &mut job,
        &ferl,
        &run_dir,
        "testkit",
        (&installed, &testkit.1),
        ("1.0.0", "2.0.0"),
    );
    let switched_by = logged_steps(&run_dir).len() as u64;
    assert!(
        switched_by < steps as u64,
        "the reload happened while the job ran"
    );
    wait_job_success(&mut job);
    assert_testkit_switched_once(&run_dir, steps, switched_by);

    let reference = reference_run(&fx.overrides(steps, "reference", &extra)).unwrap();
    let got = logged_steps(&run_dir);
    assert_eq!(got.len(), reference.len());
    for ((step, loss, gn), r) in got.iter().zip(&reference) {
        assert_eq!(*step, r.step);
        for (what, a, b) in [("loss", *loss, r.loss), ("grad norm", *gn, r.grad_norm)] {
            let err = (a - b).abs() / b.abs();
            assert!(err <= 1e-5, "step {step} {what}: {a} vs single process {b}");
        }
    }
}

/// Without a job: `list --dir` shows each file's manifest or why it is refused; `list --run-dir` says no job is
/// there; `reload` gives up after `--timeout-s` and takes its request back (a job started later in that run
/// directory must not act on it).
#[test]
fn plugin_cli_without_a_running_job() {
    let ferl = ferl_binary();
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    let suffix = std::env::consts::DLL_SUFFIX;
    std::fs::copy(
        build("ferl-plugin-testkit", &[("FERL_TESTKIT_VERSION", "1.0.0")]),
        folder.join(format!("testkit{suffix}")),
    )
    .unwrap();
    std::fs::write(folder.join(format!("broken{suffix}")), b"not a library").unwrap();
    let out = Command::new(&ferl)
        .args(["plugin", "list", "--dir"])
        .arg(&folder)
        .output()
        .unwrap();
    let text = check(out, "ferl plugin list --dir");
    let testkit = text
        .lines()
        .find(|l| l.starts_with("testkit"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        testkit.contains("logger") && testkit.contains("1.0.0"),
        "{text}"
    );
    let broken = text
        .lines()
        .find(|l| l.contains("broken"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(broken.contains("refused"), "{text}");

    let run_dir = dir.path().join("run");
    let out = Command::new(&ferl)
        .args(["plugin", "list", "--run-dir"])
        .arg(&run_dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is a job with plugins running"),
        "{err}"
    );

    // A run directory a job used to have: the control folder exists, nobody answers.
    let requests = run_dir.join("plugins/requests");
    std::fs::create_dir_all(&requests).unwrap();
    let out = Command::new(&ferl)
        .args([
            "plugin",
            "reload",
            "testkit",
            "--timeout-s",
            "1",
            "--run-dir",
        ])
        .arg(&run_dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no answer"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&requests)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "requests left behind: {left:?}");
}
