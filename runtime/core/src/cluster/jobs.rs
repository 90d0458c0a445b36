//! The client side of the jobs the cluster owns (`ferl job`, guarantee 18): submit a driver command for the head to
//! run on its host, read its state and log, stop it, list them. Any process holding the token can, over the
//! authenticated control plane.

use std::time::Duration;

use super::Cluster;
use crate::protocol::{JobInfo, JobLogs, JobStatus, ListJobs, LogChunk, StopJob, SubmitJob};
use crate::transport::error::Result;

impl Cluster {
    /// Asks the head to run `command` (program and arguments) as a job on its own host, in `working_dir` there
    /// (default: the head's), with `FERL_ADDRESS` and `FERL_TOKEN` naming this cluster; the job, running.
    pub async fn submit_job(
        &self,
        command: Vec<String>,
        working_dir: Option<String>,
    ) -> Result<JobInfo> {
        let m = SubmitJob {
            command,
            working_dir,
        };
        self.process.call_head(&m).await
    }

    /// Where job `id` (`job-N`) stands; an unknown id fails naming it.
    pub async fn job_status(&self, id: &str) -> Result<JobInfo> {
        self.process.call_head(&JobStatus { id: id.into() }).await
    }

    /// Job `id`'s log from byte `offset` (at most 1 MiB; `finished` once it ended and nothing is left).
    pub async fn job_logs(&self, id: &str, offset: u64) -> Result<LogChunk> {
        let m = JobLogs {
            id: id.into(),
            offset,
        };
        self.process.call_head(&m).await
    }

    /// Stops job `id`: SIGTERM to its process group, SIGKILL after `grace`; answers once it is gone, `Stopped` (or
    /// as it already ended).
    pub async fn stop_job(&self, id: &str, grace: Duration) -> Result<JobInfo> {
        let m = StopJob {
            id: id.into(),
            grace_ms: grace.as_millis() as u64,
        };
        self.process.call_head(&m).await
    }

    /// Every job the head runs or ran, oldest first.
    pub async fn list_jobs(&self) -> Result<Vec<JobInfo>> {
        self.process.call_head(&ListJobs).await
    }
}
