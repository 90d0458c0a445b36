//! The resource-group row against a head in another process, as Ray measures its figure (`ray.init()` starts the
//! GCS as a separate process): this binary re-run in the hidden `runtime-head` mode starts a head on loopback (what
//! `ferl start --head` does), prints its address and token, and lives until its stdin closes; the suite joins it as a
//! driver and creates and removes groups through it, each call crossing a process boundary over QUIC.

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferl::runtime::{bundle, Cluster, HeadOptions, RuntimeConfig, Strategy};

/// Options of the hidden head-process mode (none: it always listens on 127.0.0.1, any free port).
#[derive(Args, Debug)]
pub(crate) struct HeadArgs {}

/// The head-process mode: starts a head on loopback in a private session folder, prints `<address> <token>` on one
/// line, and exits when stdin closes (the suite ended or died).
pub(crate) fn serve(_: HeadArgs) -> Result<()> {
    let session = tempfile::tempdir()?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let mut cfg = RuntimeConfig::from_env();
        cfg.session_root = session.path().to_path_buf();
        let opts = HeadOptions::new()
            .ip(Ipv4Addr::LOCALHOST.into())
            .port(0)
            .config(cfg);
        let head = ferl::runtime::start_head(opts).await?;
        println!("{} {}", head.cluster.head_address()?, head.token);
        std::io::stdout().flush()?;
        tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {
                sink.clear();
            }
        })
        .await?;
        anyhow::Ok(())
    })
}

/// A head running in a child process; killed when dropped.
pub(crate) struct HeadProcess {
    child: Child,
    _stdin: ChildStdin,
    /// The head's `host:port`.
    pub(crate) address: String,
    /// The cluster token.
    pub(crate) token: String,
}

impl HeadProcess {
    /// Starts this binary in `runtime-head` mode and reads the head's address and token.
    pub(crate) fn start() -> Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("runtime-head")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the head process")?;
        let stdin = child.stdin.take().context("head stdin")?;
        let mut line = String::new();
        let stdout = child.stdout.take().context("head stdout")?;
        BufReader::new(stdout).read_line(&mut line)?;
        let Some((address, token)) = line.trim().split_once(' ') else {
            let _ = child.kill();
            bail!(
                "the head process printed `{}`, not `<address> <token>`",
                line.trim()
            );
        };
        Ok(Self {
            address: address.to_string(),
            token: token.to_string(),
            child,
            _stdin: stdin,
        })
    }
}

impl Drop for HeadProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Resource groups of one CPU bundle created and removed one after another until `window` closes, per second.
pub(crate) async fn group_churn(cluster: &Cluster, window: Duration) -> Result<f64> {
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < window {
        let g = cluster
            .create_group(
                vec![bundle(&[("CPU", 1.0)])],
                Strategy::Pack,
                Duration::from_secs(10),
            )
            .await?;
        cluster.remove_group(&g).await?;
        n += 1;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// [`group_churn`] through a head in another process, joined as a driver over loopback.
pub(crate) async fn group_churn_remote(window: Duration) -> Result<f64> {
    let head = HeadProcess::start()?;
    let cluster = ferl::runtime::connect(&head.address, Some(head.token.clone())).await?;
    let rate = group_churn(&cluster, window).await;
    cluster.shutdown().await;
    drop(head);
    rate
}
