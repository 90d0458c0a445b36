//! A loopback cluster started with the `ferl` binary as a user would (`ferl start --head`, `ferl start --address`),
//! with a private HOME and session folder, and helpers to watch a run in it.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{ferl_binary, field};

/// A head (with its node agent) and more node agents on loopback, each daemonized; all are killed on drop.
pub struct LoopbackCluster {
    /// HOME and `FERL_TMPDIR` (under `state/`) of every command.
    pub dir: tempfile::TempDir,
    /// The head's `HOST:PORT`.
    pub address: String,
    /// The daemons' pids: the head first, then each node in order.
    pub pids: Vec<u32>,
}

impl Drop for LoopbackCluster {
    fn drop(&mut self) {
        for pid in &self.pids {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
    }
}

impl LoopbackCluster {
    /// A head declaring `cpus[0]` CPUs and one more node per further entry, declaring that many.
    pub fn start(cpus: &[u32]) -> Self {
        let mut c = Self {
            dir: tempfile::tempdir().unwrap(),
            address: String::new(),
            pids: Vec::new(),
        };
        let head_cpus = cpus[0].to_string();
        let text = c.start_one(&["start", "--head", "--port", "0", "--num-cpus", &head_cpus]);
        c.address = field(&text, "ferl head started at ").to_string();
        let address = c.address.clone();
        for n in &cpus[1..] {
            c.start_one(&["start", "--address", &address, "--num-cpus", &n.to_string()]);
        }
        c
    }

    /// `ferl` with this cluster's HOME and session folder, and no token or address from the environment.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(ferl_binary());
        cmd.env("HOME", self.dir.path())
            .env("FERL_TMPDIR", self.dir.path().join("state"))
            .env("RUST_LOG", "warn")
            .env_remove("FERL_TOKEN")
            .env_remove("FERL_ADDRESS");
        cmd
    }

    /// Runs `ferl ARGS` (a daemon start), keeps the daemon's pid, returns what it printed.
    fn start_one(&mut self, args: &[&str]) -> String {
        let out = self
            .command()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ferl {args:?}: {text}{err}");
        self.pids.push(field(&text, "(pid ").parse().unwrap());
        text
    }

    /// `ferl status --json`.
    pub fn status(&self) -> serde_json::Value {
        let out = self
            .command()
            .args(["status", "--address", &self.address, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

/// The highest step `metrics.jsonl` under `root` has logged (0 before any).
pub fn logged_step(root: &Path) -> u64 {
    let text = std::fs::read_to_string(root.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["step"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Waits until the run logs step `step`, failing if `child` exits first or `within` passes.
pub fn wait_for_step(child: &mut Child, root: &Path, step: u64, within: Duration) {
    let t0 = Instant::now();
    while logged_step(root) < step {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run exited ({status}) before step {step}");
        }
        assert!(t0.elapsed() < within, "no step {step} within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
