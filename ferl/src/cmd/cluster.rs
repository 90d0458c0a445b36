//! `ferl start`, `ferl status`, `ferl stop`: bootstrap a cluster like `ray start` (a head with its own node agent,
//! or a node agent joining a head), show its state, and stop it.

use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferl_runtime::{session, HeadOptions, NodeOptions};

/// Arguments of `ferl start`.
#[derive(Args, Debug)]
pub(crate) struct StartArgs {
    /// Start a head (with a node agent for this machine).
    #[arg(long, conflicts_with = "address")]
    head: bool,
    /// Join the head at HOST:PORT as a node agent.
    #[arg(long)]
    address: Option<String>,
    /// UDP port of the head.
    #[arg(long, default_value_t = 6390)]
    port: u16,
    /// IP this machine is reached at (default: 127.0.0.1 for a head, the route to the head for a node).
    #[arg(long)]
    node_ip: Option<IpAddr>,
    /// CPUs to declare (default: detected).
    #[arg(long)]
    num_cpus: Option<f64>,
    /// GPUs to declare (default: detected with nvidia-smi).
    #[arg(long)]
    num_gpus: Option<u32>,
    /// Custom resources, `name=amount[,name=amount]`.
    #[arg(long)]
    resources: Vec<String>,
    /// Cluster token: the one a head uses (default: FERL_TOKEN, else random), or the one a node joins with
    /// (default: FERL_TOKEN, else the token of the head on this machine).
    #[arg(long, env = "FERL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Stay in the foreground instead of daemonizing.
    #[arg(long)]
    block: bool,
    /// A node is declared dead after this many milliseconds without heartbeats (default: FERL_HEARTBEAT_BOUND_MS,
    /// else 3000). Set on the head; nodes beat at the rate the head sets.
    #[arg(long)]
    heartbeat_ms: Option<u64>,
}

/// Arguments of `ferl status`.
#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    /// Head address (default: the head started on this machine).
    #[arg(long)]
    address: Option<String>,
    /// Cluster token (default: FERL_TOKEN, else the local head's).
    #[arg(long, env = "FERL_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Print JSON (top-level `nodes`, `actors`, `groups`).
    #[arg(long)]
    json: bool,
}

/// Arguments of `ferl stop`.
#[derive(Args, Debug)]
pub(crate) struct StopArgs {
    /// Head address (default: the head started on this machine).
    #[arg(long)]
    address: Option<String>,
    /// Cluster token (default: FERL_TOKEN, else the local head's).
    #[arg(long, env = "FERL_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

fn node_options(a: &StartArgs) -> Result<NodeOptions> {
    let mut opts = NodeOptions::new().resources(ferl_runtime::parse_resources(&a.resources)?);
    if let Some(ms) = a.heartbeat_ms {
        opts = opts.heartbeat_bound(Duration::from_millis(ms));
    }
    if let Some(n) = a.num_cpus {
        opts = opts.num_cpus(n);
    }
    if let Some(n) = a.num_gpus {
        opts = opts.num_gpus(n);
    }
    Ok(opts)
}

const READY_HEAD: &str = "ferl head listening on ";
const READY_NODE: &str = "ferl node joined as ";

/// `ferl start`.
pub(crate) fn start(args: StartArgs) -> Result<()> {
    if !args.head && args.address.is_none() {
        bail!("`ferl start` needs --head or --address HOST:PORT");
    }
    if !args.block {
        return daemonize();
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        if args.head {
            let ip = args.node_ip.unwrap_or(IpAddr::from([127, 0, 0, 1]));
            let mut opts = HeadOptions::new()
                .ip(ip)
                .port(args.port)
                .node(node_options(&args)?);
            if let Some(token) = args.token.clone() {
                opts = opts.token(token);
            }
            let head = ferl_runtime::start_head(opts).await?;
            head.session.save_pid()?;
            let addr = head.cluster.head_address()?;
            println!("{READY_HEAD}{addr}");
            println!(
                "session folder: {} (token saved there with mode 0600)",
                head.session.dir.display()
            );
            if std::env::var_os("FERL_START_DAEMON_CHILD").is_none() {
                println!("cluster token: {}", head.token);
                println!("join with: ferl start --address {addr} --token <token>");
            }
            std::future::pending::<()>().await;
            Ok(())
        } else {
            let address = args.address.clone().expect("checked above");
            let node = ferl_runtime::start_node(
                &address,
                args.token.clone(),
                node_options(&args)?,
                args.node_ip,
            )
            .await?;
            node.session.save_pid()?;
            println!(
                "{READY_NODE}{} (logs in {})",
                node.name,
                node.session.logs().display()
            );
            Ok(node.wait().await?)
        }
    })
}

/// Re-runs this command with `--block` in a new session in the background, and waits until it is ready.
fn daemonize() -> Result<()> {
    let root = session::root();
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let log: PathBuf = root.join(format!("ferl-start-{}.log", std::process::id()));
    let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1))
        .arg("--block")
        .env("FERL_START_DAEMON_CHILD", "1");
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    session::detach(&mut cmd);
    let mut child = cmd.spawn().context("starting the background process")?;
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            // The log holds only the error, shown here: a failed start leaves nothing behind.
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            bail!(
                "the background process exited with {status}:\n{}",
                text.trim_end()
            );
        }
        let file = std::fs::File::open(&log)?;
        for line in BufReader::new(file).lines() {
            let line = line?;
            if let Some(addr) = line.strip_prefix(READY_HEAD) {
                println!(
                    "ferl head started at {addr} (pid {}, log {})",
                    child.id(),
                    log.display()
                );
                if let Some(token) = session::local_token() {
                    println!("cluster token: {token}");
                }
                println!("join with: ferl start --address {addr} --token <token>");
                return Ok(());
            }
            if let Some(rest) = line.strip_prefix(READY_NODE) {
                println!(
                    "ferl node started: {rest} (pid {}, log {})",
                    child.id(),
                    log.display()
                );
                return Ok(());
            }
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!(
                "the background process did not become ready within 60 s; see {}",
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `given`, else the address of the head started on this machine.
pub(crate) fn head_address(given: Option<String>) -> Result<String> {
    given.or_else(session::local_address).with_context(|| {
        format!(
            "no head address: pass --address (no head started on this machine under {})",
            session::root().display()
        )
    })
}

/// `ferl status`.
pub(crate) fn status(args: StatusArgs) -> Result<()> {
    let address = head_address(args.address)?;
    let rt = tokio::runtime::Runtime::new()?;
    let status = rt.block_on(async {
        let cluster = ferl_runtime::connect_observer(&address, args.token).await?;
        let s = cluster.status().await?;
        cluster.shutdown().await;
        anyhow::Ok(s)
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(());
    }
    println!("head {}", status["head"].as_str().unwrap_or("?"));
    for n in status["nodes"].as_array().into_iter().flatten() {
        println!(
            "node {} {} alive={} total={} used={} actors={} logs={}",
            n["name"].as_str().unwrap_or("?"),
            n["address"].as_str().unwrap_or("?"),
            n["alive"],
            n["resources_total"],
            n["resources_used"],
            n["actors"].as_array().map_or(0, |a| a.len()),
            n["log_dir"].as_str().unwrap_or("?"),
        );
    }
    for a in status["actors"].as_array().into_iter().flatten() {
        println!(
            "actor {} {} on {}: {}",
            a["id"],
            a["type"].as_str().unwrap_or("?"),
            a["node"].as_str().unwrap_or("?"),
            a["state"].as_str().unwrap_or("?")
        );
    }
    for g in status["groups"].as_array().into_iter().flatten() {
        println!(
            "group {} {} bundles={}",
            g["id"],
            g["strategy"].as_str().unwrap_or("?"),
            g["bundles"]
        );
    }
    for j in status["jobs"].as_array().into_iter().flatten() {
        print_job(j);
    }
    Ok(())
}

/// One job line of `ferl status`, and a line per restart with its cause.
fn print_job(j: &serde_json::Value) {
    let restarts = j["restarts"].as_array().cloned().unwrap_or_default();
    println!(
        "job {} {}: world_size={} restarts={}",
        j["name"].as_str().unwrap_or("?"),
        j["state"].as_str().unwrap_or("?"),
        j["world_size"],
        restarts.len()
    );
    for r in &restarts {
        println!(
            "  restart at step {} ({}, now {} ranks): {}",
            r["failed_after_step"],
            r["cause_kind"].as_str().unwrap_or("?"),
            r["world_size"],
            r["cause"].as_str().unwrap_or("?")
        );
    }
}

/// How long `ferl stop` lets local head and node processes exit after SIGTERM before it kills them.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// `ferl stop`: asks the head to stop the cluster, then stops what this machine started and waits until it is gone.
pub(crate) fn stop(args: StopArgs) -> Result<()> {
    let local = session::local_address();
    let address = head_address(args.address.clone()).ok();
    // A head named with --address that could not be asked (wrong token, unreachable) fails the command, after the
    // local processes are stopped: the cluster may still run.
    let mut refused = None;
    if let Some(address) = &address {
        let rt = tokio::runtime::Runtime::new()?;
        let asked = rt.block_on(async {
            let cluster = ferl_runtime::connect_observer(address, args.token).await?;
            cluster.shutdown_cluster().await?;
            anyhow::Ok(())
        });
        match asked {
            Ok(()) => println!("asked the head at {address} to stop the cluster"),
            Err(e) if args.address.is_some() => refused = Some(e),
            Err(e) => eprintln!("could not reach the head at {address}: {e:#}"),
        }
    }
    let stopped = session::stop_local(STOP_GRACE);
    if address.is_some() && address == local {
        // The head this machine pointed at is gone: local commands must not keep reaching for it.
        let _ = std::fs::remove_file(session::root().join("session_latest"));
    }
    let pids: Vec<String> = stopped.iter().map(|p| p.to_string()).collect();
    println!(
        "stopped {} local ferl process(es){}",
        stopped.len(),
        if pids.is_empty() {
            String::new()
        } else {
            format!(" (pids {})", pids.join(", "))
        }
    );
    match refused {
        Some(e) => Err(e.context(format!(
            "the head at {} was not stopped",
            args.address.unwrap_or_default()
        ))),
        None => Ok(()),
    }
}
