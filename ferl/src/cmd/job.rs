//! `ferl job submit/status/logs/stop/list`: jobs the cluster owns, like `ray job`. The head runs a job's driver
//! command on its own host (its child, in its own process group, output to `job-N.log` in the head's session `logs/`
//! folder, with `FERL_ADDRESS` and `FERL_TOKEN` naming the cluster); these commands reach it from any machine
//! holding the token.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use ferl_runtime::{Cluster, JobInfo, LogChunk};

/// The head to talk to.
#[derive(Args, Debug)]
pub(crate) struct HeadArgs {
    /// Head address, HOST:PORT (default: FERL_ADDRESS, else the head started on this machine).
    #[arg(long, env = "FERL_ADDRESS")]
    address: Option<String>,
    /// Cluster token (default: FERL_TOKEN, else the local head's).
    #[arg(long, env = "FERL_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

/// `ferl job` subcommands.
#[derive(Subcommand, Debug)]
pub(crate) enum JobCommand {
    /// Run a driver command as a job on the head's host: `ferl job submit -- ferl sft --nproc-per-node 2 ...`.
    /// Prints the job's id.
    Submit(SubmitArgs),
    /// Where a job stands: RUNNING, SUCCEEDED, FAILED (exit code or signal) or STOPPED, with its times.
    Status(IdArgs),
    /// A job's output (stdout and stderr).
    Logs(LogsArgs),
    /// Stop a job: SIGTERM to its process group, SIGKILL after the grace period.
    Stop(StopArgs),
    /// Every job of the cluster.
    List(HeadArgs),
}

/// Arguments of `ferl job submit`.
#[derive(Args, Debug)]
pub(crate) struct SubmitArgs {
    #[command(flatten)]
    head: HeadArgs,
    /// Working directory of the job: a path on the head's host, not this one (default: the head's working
    /// directory).
    #[arg(long)]
    working_dir: Option<String>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

/// A job id.
#[derive(Args, Debug)]
pub(crate) struct IdArgs {
    #[command(flatten)]
    head: HeadArgs,
    /// The job's id (`job-N`, as `submit` printed it).
    id: String,
}

/// Arguments of `ferl job logs`.
#[derive(Args, Debug)]
pub(crate) struct LogsArgs {
    #[command(flatten)]
    job: IdArgs,
    /// Keep printing the log as it grows, until the job ends.
    #[arg(long, short)]
    follow: bool,
}

/// Arguments of `ferl job stop`.
#[derive(Args, Debug)]
pub(crate) struct StopArgs {
    #[command(flatten)]
    job: IdArgs,
    /// Seconds the job has to exit after SIGTERM before it is killed.
    #[arg(long, default_value_t = 5.0)]
    grace_s: f64,
}

impl HeadArgs {
    /// Connects to the head as an observer (not a driver).
    pub(crate) async fn connect(&self) -> Result<Cluster> {
        let address = super::cluster::head_address(self.address.clone())?;
        Ok(ferl_runtime::connect_observer(&address, self.token.clone()).await?)
    }
}

/// Runs a `ferl job` subcommand.
pub(crate) fn run(command: JobCommand) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let head = match &command {
            JobCommand::Submit(a) => &a.head,
            JobCommand::Status(a) => &a.head,
            JobCommand::Logs(a) => &a.job.head,
            JobCommand::Stop(a) => &a.job.head,
            JobCommand::List(a) => a,
        };
        let cluster = head.connect().await?;
        let done = dispatch(&cluster, command).await;
        cluster.shutdown().await;
        done
    })
}

async fn dispatch(cluster: &Cluster, command: JobCommand) -> Result<()> {
    match command {
        JobCommand::Submit(a) => {
            let job = cluster.submit_job(a.command, a.working_dir).await?;
            println!("{}", job.id);
            eprintln!(
                "submitted {} (pid {} on the head's host, log {}); follow it with `ferl job logs --follow {}`",
                job.id, job.pid, job.log_file, job.id
            );
        }
        JobCommand::Status(a) => print_job(&cluster.job_status(&a.id).await?),
        JobCommand::Logs(a) => {
            let id = a.job.id.as_str();
            print_log(a.follow, async |offset| {
                Ok(cluster.job_logs(id, offset).await?)
            })
            .await?
        }
        JobCommand::Stop(a) => {
            if !(a.grace_s >= 0.0 && a.grace_s.is_finite()) {
                bail!("--grace-s {}: expected seconds, 0 or more", a.grace_s);
            }
            let grace = Duration::from_secs_f64(a.grace_s);
            print_job(&cluster.stop_job(&a.job.id, grace).await?);
        }
        JobCommand::List(_) => {
            for job in cluster.list_jobs().await? {
                print_job(&job);
            }
        }
    }
    Ok(())
}

/// Prints a log read piece by piece with `fetch` (from a byte offset); with `follow`, until it is finished.
pub(crate) async fn print_log(
    follow: bool,
    mut fetch: impl AsyncFnMut(u64) -> Result<LogChunk>,
) -> Result<()> {
    let mut offset = 0;
    let mut out = std::io::stdout();
    loop {
        let chunk = fetch(offset).await?;
        out.write_all(&chunk.data)?;
        out.flush()?;
        let caught_up = chunk.next_offset == offset;
        offset = chunk.next_offset;
        if !follow || chunk.finished {
            return Ok(());
        }
        if caught_up {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// One line per job: `job-N STATE start=... end=... pid=N cmd=...`.
fn print_job(job: &JobInfo) {
    let end = job.end_unix_ms.map_or("-".to_string(), utc);
    println!(
        "{} {} start={} end={} pid={} log={} cmd={}",
        job.id,
        job.state,
        utc(job.start_unix_ms),
        end,
        job.pid,
        job.log_file,
        job.command.join(" ")
    );
}

/// Milliseconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc(ms: u64) -> String {
    let secs = Duration::from_millis(ms).as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_796_618_405_500), "2026-12-07T04:40:05Z");
    }
}
