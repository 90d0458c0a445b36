//! Multi-process test harness: a test re-executes its own binary once per rank (`--exact <test>`), with the
//! launcher's environment variables set, and the child runs the rank's side of the same test function.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// The variable telling a re-executed test binary that it is a rank.
pub(crate) const ROLE_VAR: &str = "FERL_COLLECTIVE_TEST_ROLE";

/// Whether this process is a rank started by [`spawn_ranks`].
pub(crate) fn is_rank() -> bool {
    std::env::var(ROLE_VAR).is_ok()
}

/// This rank's number (children only).
pub(crate) fn my_rank() -> usize {
    std::env::var("RANK")
        .or_else(|_| std::env::var("SLURM_PROCID"))
        .unwrap()
        .parse()
        .unwrap()
}

/// A started rank and the lines it prints.
pub(crate) struct RankProcess {
    pub child: Child,
    pub lines: Receiver<String>,
}

impl RankProcess {
    /// Waits for a line containing `prefix` (libtest may print before it on the same line) and returns the line from
    /// `prefix` on; panics after `timeout`.
    pub(crate) fn wait_line(&self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(prefix) => {
                    return line[line.find(prefix).unwrap()..].to_string()
                }
                Ok(_) => continue,
                Err(e) => panic!("no line containing {prefix:?} within {timeout:?}: {e}"),
            }
        }
    }

    /// Waits for the process to exit; kills it and panics after `timeout`.
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!(
                    "rank process {} did not exit within {timeout:?}",
                    self.child.id()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RankProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts `world` copies of this test binary running `test`, each with `env(rank)` plus the role marker.
pub(crate) fn spawn_ranks(
    test: &str,
    world: usize,
    env: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<RankProcess> {
    (0..world)
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(ROLE_VAR, "rank")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            for (k, v) in env(rank) {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().unwrap();
            let stdout = child.stdout.take().unwrap();
            let (tx, rx) = channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    println!("[rank {rank}] {line}");
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            RankProcess { child, lines: rx }
        })
        .collect()
}

/// This test process's job secret (hex), the same for every group it starts.
pub(crate) fn job_secret_hex() -> String {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET
        .get_or_init(|| ferl_collective::JobSecret::generate().unwrap().to_hex())
        .clone()
}

/// torchrun-style variables for `rank` of `world` with the store at 127.0.0.1:`port`, and the job secret.
pub(crate) fn torchrun_env(rank: usize, world: usize, port: u16) -> Vec<(String, String)> {
    vec![
        ("FERL_JOB_SECRET".into(), job_secret_hex()),
        ("RANK".into(), rank.to_string()),
        ("WORLD_SIZE".into(), world.to_string()),
        ("LOCAL_RANK".into(), rank.to_string()),
        ("MASTER_ADDR".into(), "127.0.0.1".into()),
        ("MASTER_PORT".into(), port.to_string()),
    ]
}
