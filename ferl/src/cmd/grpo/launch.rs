//! `ferl grpo --nproc-per-node N`: starts N ranks of this command on this machine with the environment torchrun's
//! standalone mode gives them (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, a
//! free `MASTER_PORT`, a fresh `FERL_JOB_SECRET` unless one is set), so each runs the launcher path. The ranks split the cores; rank 0 logs and commits
//! checkpoints. When a rank fails the others are stopped and the command fails naming the rank; when the launcher
//! itself is killed, its ranks are killed with it (`PR_SET_PDEATHSIG`).

use anyhow::{bail, Context, Result};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::Duration;

/// Runs `n` ranks of this invocation (without `--nproc-per-node`) and waits for them. When a rank fails, every rank
/// is stopped and, up to `max_restarts` times (`trainer.max_restarts`), all are started again resuming from the run's
/// newest checkpoint (`trainer.resume_mode=auto`), as torchrun's `--max-restarts` restarts its workers.
pub(super) fn local_ranks(n: usize, max_restarts: usize) -> Result<()> {
    if n == 0 {
        bail!("--nproc-per-node 0: give at least 1 rank");
    }
    let mut args = rank_args(std::env::args().skip(1));
    for restart in 0..=max_restarts {
        let failed = match start_and_wait(n, &args) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if restart == max_restarts {
            return Err(failed.context(format!(
                "the run failed after {restart} restarts (trainer.max_restarts={max_restarts})"
            )));
        }
        eprintln!(
            "{failed:#}: restarting the {n} ranks from the newest checkpoint (restart {} of {max_restarts})",
            restart + 1
        );
        args.push("trainer.resume_mode=auto".into());
    }
    unreachable!("the last attempt returns")
}

/// Starts `n` ranks with `args` and waits for them.
fn start_and_wait(n: usize, args: &[String]) -> Result<()> {
    let port = free_port()?;
    let exe = std::env::current_exe().context("finding the ferl binary")?;
    // The ranks authenticate their rendezvous and collective group with a secret of this job's.
    let secret = std::env::var("FERL_JOB_SECRET").unwrap_or_else(|_| job_secret());
    let mut ranks = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        // SAFETY: prctl is async-signal-safe; a rank dies with its launcher instead of holding its cores.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("FERL_JOB_SECRET", &secret)
            .spawn()
            .with_context(|| format!("starting rank {rank} ({})", exe.display()));
        match child {
            Ok(c) => ranks.push(c),
            Err(e) => {
                stop(&mut ranks);
                return Err(e);
            }
        }
    }
    wait_all(&mut ranks)
}

/// This invocation's arguments without `--nproc-per-node N` / `--nproc-per-node=N`.
fn rank_args(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if skip_value {
            skip_value = false;
        } else if a == "--nproc-per-node" || a == "--nproc_per_node" {
            skip_value = true;
        } else if !a.starts_with("--nproc-per-node=") && !a.starts_with("--nproc_per_node=") {
            out.push(a);
        }
    }
    out
}

/// 32 random bytes in hex.
fn job_secret() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A port on 127.0.0.1 nothing listens on now (rank 0's rendezvous store takes it).
fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// Waits until every rank has exited; the first to fail stops the others and fails the run.
fn wait_all(ranks: &mut [Child]) -> Result<()> {
    let mut done = vec![false; ranks.len()];
    while done.iter().any(|d| !d) {
        for (rank, child) in ranks.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                done[rank] = true;
                if !status.success() {
                    stop(ranks);
                    bail!("rank {rank} failed ({status}); the other ranks were stopped");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Kills and reaps every rank still running.
fn stop(ranks: &mut [Child]) {
    for child in ranks.iter_mut() {
        if let Ok(None) = child.try_wait() {
            child.kill().ok();
        }
        child.wait().ok();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranks_get_every_argument_but_the_rank_count() {
        let args = [
            "grpo",
            "--nproc-per-node",
            "2",
            "a.b=1",
            "--nproc-per-node=3",
            "--config",
            "x",
        ];
        let got = rank_args(args.iter().map(|s| s.to_string()));
        assert_eq!(got, ["grpo", "a.b=1", "--config", "x"]);
    }
}
