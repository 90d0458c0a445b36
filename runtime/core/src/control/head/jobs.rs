//! Jobs the cluster owns (guarantee 18 in `runtime/README.md`), as `ray job submit` runs them: the head starts a
//! job's driver command on its own host as its child, in a process group of its own, with `FERL_ADDRESS` and
//! `FERL_TOKEN` naming this cluster (so a `ferl sft` driver joins it), its output in `job-N.log` in the head's session
//! `logs/` folder. Any holder of the token reads its state and log and stops it over the control plane
//! ([`SubmitJob`], [`JobStatus`], [`JobLogs`], [`StopJob`], [`ListJobs`]). A stop sends SIGTERM to the job's process
//! group and SIGKILL after the grace period; the driver's actors are then freed by fate-sharing (`drivers.rs`). A
//! job dies with the head process, and `ferl stop` stops every running job first.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context as _, Result};
use tokio::sync::watch;

use super::Head;
use crate::actor::{Context, Handler};
use crate::control::node::read_log;
use crate::protocol::{
    JobInfo, JobLogs, JobState, JobStatus, ListJobs, LogChunk, StopJob, SubmitJob,
};

/// How long a stopped job has to exit after SIGKILL before the stop answers anyway.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How long `ferl stop` (the head's shutdown) lets running jobs exit after SIGTERM before it kills them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

/// What the head needs to run jobs: where their logs go and the token their drivers join with.
#[derive(Debug, Clone)]
pub(crate) struct JobHost {
    /// The head's session `logs/` folder.
    pub(crate) log_dir: PathBuf,
    /// The cluster token, given to drivers as `FERL_TOKEN`.
    pub(crate) token: String,
}

/// A job as the head knows it.
struct Job {
    info: JobInfo,
    /// A stop was asked for: however it ends, it ends `Stopped`.
    stopping: bool,
    /// Becomes `true` once the driver process has been waited for.
    ended: watch::Receiver<bool>,
}

/// The head's jobs, numbered from 1.
pub(super) struct Jobs {
    host: JobHost,
    table: Mutex<(u64, BTreeMap<u64, Job>)>,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Sends `signal` to the process group `pgid`.
fn signal_group(pgid: u32, signal: i32) {
    if pgid == 0 {
        return;
    }
    // SAFETY: killpg has no memory preconditions.
    unsafe { libc::killpg(pgid as i32, signal) };
}

/// How a driver that was not stopped ended.
fn ended_state(status: std::io::Result<ExitStatus>) -> JobState {
    match status {
        Ok(s) if s.success() => JobState::Succeeded,
        Ok(s) => match (s.code(), s.signal()) {
            (Some(code), _) => JobState::Failed(code),
            (None, sig) => JobState::Killed(sig.unwrap_or(0)),
        },
        Err(_) => JobState::Killed(0),
    }
}

impl Jobs {
    /// No jobs yet.
    pub(super) fn new(host: JobHost) -> Self {
        Self {
            host,
            table: Mutex::new((0, BTreeMap::new())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (u64, BTreeMap<u64, Job>)> {
        self.table.lock().expect("jobs lock")
    }

    /// The number of job `id` (`job-N`), or an error naming it and the jobs there are.
    fn find(&self, id: &str) -> Result<u64> {
        let t = self.lock();
        let n = id.strip_prefix("job-").and_then(|n| n.parse::<u64>().ok());
        match n {
            Some(n) if t.1.contains_key(&n) => Ok(n),
            _ => {
                let known: Vec<&str> = t.1.values().map(|j| j.info.id.as_str()).collect();
                let known = if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                };
                bail!("no job `{id}` in this cluster (jobs: {known})")
            }
        }
    }

    fn info(&self, n: u64) -> JobInfo {
        self.lock().1[&n].info.clone()
    }

    /// Every job, oldest first.
    pub(super) fn list(&self) -> Vec<JobInfo> {
        self.lock().1.values().map(|j| j.info.clone()).collect()
    }

    /// The jobs as `ferl status --json` lists them (`submitted_jobs`).
    pub(super) fn json(&self) -> Vec<serde_json::Value> {
        self.list()
            .iter()
            .map(|j| {
                serde_json::json!({
                    "id": j.id, "state": j.state.to_string(), "command": j.command, "working_dir": j.working_dir,
                    "log_file": j.log_file, "pid": j.pid, "start_unix_ms": j.start_unix_ms, "end_unix_ms": j.end_unix_ms,
                })
            })
            .collect()
    }

    /// Records how job `n`'s driver ended.
    fn finish(&self, n: u64, status: std::io::Result<ExitStatus>) {
        let mut t = self.lock();
        let Some(job) = t.1.get_mut(&n) else { return };
        job.info.state = if job.stopping {
            JobState::Stopped
        } else {
            ended_state(status)
        };
        job.info.end_unix_ms = Some(unix_ms());
        tracing::info!(job = %job.info.id, state = %job.info.state, "job ended");
    }

    /// Marks job `n` stopping; its process group and end watch, or `None` when it already ended.
    fn begin_stop(&self, n: u64) -> Option<(u32, watch::Receiver<bool>)> {
        let mut t = self.lock();
        let job = t.1.get_mut(&n)?;
        if job.info.state.is_terminal() {
            return None;
        }
        job.stopping = true;
        Some((job.info.pid, job.ended.clone()))
    }

    /// Job `n`'s log file and whether it had ended (read before the log, so that an ended job's log is complete).
    fn log_of(&self, n: u64) -> (PathBuf, bool) {
        let t = self.lock();
        let job = &t.1[&n];
        (
            PathBuf::from(&job.info.log_file),
            job.info.state.is_terminal(),
        )
    }

    /// Starts `m`'s command (see the module docs) for the head at `head`; the job, running.
    fn submit(self: &Arc<Self>, m: SubmitJob, head: &str) -> Result<JobInfo> {
        let Some(program) = m.command.first() else {
            bail!("a job needs a command to run");
        };
        let cwd = match &m.working_dir {
            Some(d) => PathBuf::from(d),
            None => std::env::current_dir().context("the head's working directory")?,
        };
        if !cwd.is_dir() {
            bail!(
                "working directory `{}` is not a directory on the head's host",
                cwd.display()
            );
        }
        let n = {
            let mut t = self.lock();
            t.0 += 1;
            t.0
        };
        let id = format!("job-{n}");
        let log = self.host.log_dir.join(format!("{id}.log"));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(&m.command[1..])
            .current_dir(&cwd)
            .env("FERL_ADDRESS", head)
            .env("FERL_TOKEN", &self.host.token)
            .env("FERL_JOB_ID", &id)
            .env_remove("FERL_START_DAEMON_CHILD")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .kill_on_drop(false);
        // SAFETY: prctl is async-signal-safe; the driver dies with the head instead of lingering.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {id}: `{program}`"))?;
        let (tx, ended) = watch::channel(false);
        let info = JobInfo {
            id: id.clone(),
            command: m.command.clone(),
            working_dir: cwd.display().to_string(),
            log_file: log.display().to_string(),
            pid: child.id().unwrap_or(0),
            state: JobState::Running,
            start_unix_ms: unix_ms(),
            end_unix_ms: None,
        };
        let job = Job {
            info: info.clone(),
            stopping: false,
            ended,
        };
        self.lock().1.insert(n, job);
        let jobs = self.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            jobs.finish(n, status);
            let _ = tx.send(true);
        });
        tracing::info!(job = %id, pid = info.pid, command = ?m.command, "job started");
        Ok(info)
    }

    /// Stops job `n`: SIGTERM to its group, SIGKILL after `grace`; returns once it ended (or the kill went
    /// unanswered for [`KILL_WAIT`]).
    async fn stop(&self, n: u64, grace: Duration) -> JobInfo {
        if let Some((pgid, mut ended)) = self.begin_stop(n) {
            signal_group(pgid, libc::SIGTERM);
            let exited = tokio::time::timeout(grace, ended.wait_for(|e| *e))
                .await
                .is_ok();
            if !exited {
                tracing::warn!("job-{n} did not exit within {grace:?} of SIGTERM: killing it");
                signal_group(pgid, libc::SIGKILL);
                let _ = tokio::time::timeout(KILL_WAIT, ended.wait_for(|e| *e)).await;
            }
        }
        self.info(n)
    }

    /// Stops every running job (the cluster shuts down).
    pub(super) async fn stop_all(&self) {
        let running: Vec<u64> = self
            .lock()
            .1
            .iter()
            .filter(|(_, j)| !j.info.state.is_terminal())
            .map(|(n, _)| *n)
            .collect();
        futures::future::join_all(running.into_iter().map(|n| self.stop(n, SHUTDOWN_GRACE))).await;
    }
}

impl Handler<SubmitJob> for Head {
    async fn handle(&self, m: SubmitJob, _: &Context) -> Result<JobInfo> {
        self.0.jobs.submit(m, &self.0.process.addr.to_string())
    }
}

impl Handler<JobStatus> for Head {
    async fn handle(&self, m: JobStatus, _: &Context) -> Result<JobInfo> {
        let n = self.0.jobs.find(&m.id)?;
        Ok(self.0.jobs.info(n))
    }
}

impl Handler<JobLogs> for Head {
    async fn handle(&self, m: JobLogs, _: &Context) -> Result<LogChunk> {
        let n = self.0.jobs.find(&m.id)?;
        let (path, ended) = self.0.jobs.log_of(n);
        read_log(&path, ended, m.offset).map_err(|e| anyhow!("the log of {}: {e:#}", m.id))
    }
}

impl Handler<StopJob> for Head {
    async fn handle(&self, m: StopJob, _: &Context) -> Result<JobInfo> {
        let n = self.0.jobs.find(&m.id)?;
        let info = self.0.jobs.stop(n, Duration::from_millis(m.grace_ms)).await;
        // Its driver, if it joined, is freed now rather than when its beats lapse, and its run says `stopped`.
        let drivers = self
            .lock()
            .drivers
            .with_pid(info.pid, &super::drivers::host_name());
        for id in drivers {
            self.free_driver(
                id,
                &format!("was stopped (ferl job stop {})", m.id),
                "stopped",
            )
            .await;
        }
        Ok(info)
    }
}

impl Handler<ListJobs> for Head {
    async fn handle(&self, _: ListJobs, _: &Context) -> Result<Vec<JobInfo>> {
        Ok(self.0.jobs.list())
    }
}
