//! `ferl-bench chaos`: a bounded chaos soak. Hosts are network namespaces made by the bench (a head's and `--nodes`
//! nodes', joined by a switch that plays netem on every link: delay, jitter, loss; see [`net`]). This process is the
//! driver and the head; each node's agent runs in its namespace. For `--seconds`, caller tasks in the driver call
//! [`peer::Peer`] actors on every node directly or through a peer on another node, while node agents are SIGKILLed
//! (their hosts cut off) and restarted and links' loss flaps up. Every call must complete (its echo intact, executed
//! once, after the tell sent before it) or fail with a named runtime error within its bound; a call that does
//! neither is a hang. Rows: calls completed, failed and hung, the worst time to notice a kill, call latency.
//! The suite fails (non-zero) on any hang, wrong reply or unnoticed kill. Needs root (network namespaces, TUN).

mod net;
mod peer;
mod schedule;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferl::runtime::{bundle, Cluster, HeadOptions, NodeOptions, SpawnOptions};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::report::Report;
use net::{Link, Net};
use schedule::{Agents, Plan};
use workload::{Soak, Tally};

/// Options of the chaos suite.
#[derive(Args, Debug, Clone)]
pub(crate) struct ChaosArgs {
    /// Seconds of traffic.
    #[arg(long, default_value_t = 120.0)]
    seconds: f64,
    /// Node hosts (besides the head's).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Peer actors per node (alternately fronts, which relay, and backs, which are relayed to).
    #[arg(long, default_value_t = 2)]
    actors_per_node: usize,
    /// Caller tasks in the driver, each making one call at a time.
    #[arg(long, default_value_t = 8)]
    callers: u32,
    /// One-way delay of each link, ms (netem `delay`).
    #[arg(long, default_value_t = 20.0)]
    delay_ms: f64,
    /// Jitter of each link, ms (netem `delay D J`, uniform).
    #[arg(long, default_value_t = 5.0)]
    jitter_ms: f64,
    /// Loss of each link, percent (netem `loss`).
    #[arg(long, default_value_t = 1.0)]
    loss_pct: f64,
    /// Loss of a link while it flaps, percent.
    #[arg(long, default_value_t = 5.0)]
    flap_loss_pct: f64,
    /// Mean seconds between node kills (0: none).
    #[arg(long, default_value_t = 12.0)]
    kill_every_s: f64,
    /// Mean seconds a killed node stays down before its agent restarts.
    #[arg(long, default_value_t = 5.0)]
    down_s: f64,
    /// Heartbeat bound, ms (`FERL_HEARTBEAT_BOUND_MS`).
    #[arg(long, default_value_t = 3000)]
    heartbeat_ms: u64,
    /// Bound of each call, s (default: twice the heartbeat bound plus 2 s); relayed calls get 3/4 of it.
    #[arg(long)]
    call_bound_s: Option<f64>,
    /// Seed of the chaos schedule, the links and the payloads.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl ChaosArgs {
    fn bound(&self) -> Duration {
        let default = 2.0 * self.heartbeat_ms as f64 / 1e3 + 2.0;
        Duration::from_secs_f64(self.call_bound_s.unwrap_or(default))
    }

    fn link(&self) -> Link {
        Link {
            delay: Duration::from_secs_f64(self.delay_ms / 1e3),
            jitter: Duration::from_secs_f64(self.jitter_ms / 1e3),
            loss: self.loss_pct / 100.0,
        }
    }
}

/// Options of the hidden `chaos-node` command: a node agent, as `ferl start --address ... --block` runs it.
#[derive(Args, Debug)]
pub(crate) struct NodeArgs {
    /// The head's address.
    #[arg(long)]
    address: String,
    /// Custom resources, `name=amount[,name=amount]`.
    #[arg(long)]
    resources: String,
    /// Heartbeat bound, ms.
    #[arg(long, default_value_t = 3000)]
    heartbeat_ms: u64,
}

/// Runs a node agent until it is killed or loses its head (the token comes from `FERL_TOKEN`).
pub(crate) fn node(args: NodeArgs) -> Result<()> {
    ferl::init_tracing();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let opts = NodeOptions::new()
            .num_cpus(1.0)
            .num_gpus(0)
            .resources(ferl::runtime::parse_resources(&[args.resources])?)
            .heartbeat_bound(Duration::from_millis(args.heartbeat_ms));
        let node = ferl::runtime::start_node(&args.address, None, opts, None).await?;
        println!("NODE {}", node.name);
        Ok(node.wait().await?)
    })
}

/// Runs the suite and prints its rows.
pub(crate) fn run(args: ChaosArgs, out: &mut Report) -> Result<()> {
    if args.nodes < 2 || args.actors_per_node < 2 {
        bail!("--nodes and --actors-per-node must be at least 2 (relays go from a front to a back on another node)");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "ferl-bench chaos needs root (CAP_NET_ADMIN) to create network namespaces and TUN devices; run it as root"
        );
    }
    let dir = std::env::temp_dir().join(format!("ferl-chaos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Set before any thread starts: sessions, tokens and logs stay in this run's folder.
    std::env::set_var("FERL_TMPDIR", &dir);
    std::env::set_var("FERL_HEARTBEAT_BOUND_MS", args.heartbeat_ms.to_string());
    let prefix = format!("ferl-chaos-{}", std::process::id());
    let flap = args.flap_loss_pct / 100.0;
    let net = Net::create(&prefix, args.nodes + 1, args.link(), flap, args.seed)?;
    net::enter_netns(&net.hosts[0].ns)?;
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(interruptible(soak(&args, &net, dir.clone(), out)));
    rt.shutdown_timeout(Duration::from_secs(5));
    drop(net);
    match &result {
        Ok(()) => {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Err(_) => eprintln!("chaos: logs kept in {}", dir.display()),
    }
    result
}

/// Ends early with an error on Ctrl-C or SIGTERM (the caller's guards then clean up).
async fn interruptible(work: impl std::future::Future<Output = Result<()>>) -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
        _ = term.recv() => bail!("terminated"),
    }
}

/// Starts the head here and the node agents in their hosts, runs the soak, prints the rows.
async fn soak(args: &ChaosArgs, net: &Net, dir: PathBuf, out: &mut Report) -> Result<()> {
    let head = ferl::runtime::start_head(
        HeadOptions::new().ip(net.hosts[0].ip.into()).node(
            NodeOptions::new()
                .num_cpus(1.0)
                .num_gpus(0)
                .heartbeat_bound(Duration::from_millis(args.heartbeat_ms)),
        ),
    )
    .await?;
    let cluster = head.cluster.clone();
    let mut agents = Agents::new(
        std::env::current_exe()?,
        cluster.head_address()?.to_string(),
        head.token.clone(),
        args.heartbeat_ms,
        dir,
        net.hosts.clone(),
    );
    for host in 1..net.hosts.len() {
        agents.start(host).await?;
    }
    let soak = Arc::new(Soak::new(
        first_peers(&cluster, args).await?,
        args.seconds,
        args.bound(),
    ));
    let t0 = Instant::now();
    traffic(args, &soak, &cluster, &mut agents, net).await?;
    let took = t0.elapsed();
    wait_for_detection(&soak, args.bound()).await;
    let duplicates = workload::duplicates(&soak).await;
    cluster.shutdown().await;
    rows(args, &soak, duplicates, took, out)
}

/// Spawns the first peers, `actors_per_node` on each node host, alternately fronts and backs.
async fn first_peers(
    cluster: &Cluster,
    args: &ChaosArgs,
) -> Result<Vec<(usize, bool, ferl::ActorRef<peer::Peer>)>> {
    let mut peers = Vec::new();
    for host in 1..=args.nodes {
        for i in 0..args.actors_per_node {
            let opts = SpawnOptions::new().resources(bundle(&[(&format!("h{host}"), 1.0)]));
            peers.push((
                host,
                i % 2 == 0,
                cluster.spawn::<peer::Peer>((), opts).await?,
            ));
        }
    }
    Ok(peers)
}

/// Runs the callers, the slot keepers and the chaos until the end of the window.
async fn traffic(
    args: &ChaosArgs,
    soak: &Arc<Soak>,
    cluster: &Cluster,
    agents: &mut Agents,
    net: &Net,
) -> Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(schedule::follow_events(soak.clone(), cluster.events()));
    for i in 0..soak.slots.len() {
        tasks.spawn(workload::keep_slot(soak.clone(), cluster.clone(), i));
    }
    tasks.spawn(schedule::flap_links(
        soak.clone(),
        net.links(),
        net.hosts.len(),
        StdRng::seed_from_u64(args.seed ^ 0xf1a9),
    ));
    let mut callers = tokio::task::JoinSet::new();
    for c in 0..args.callers {
        callers.spawn(workload::caller(soak.clone(), c, args.seed));
    }
    let plan = Plan {
        kill_every: Duration::from_secs_f64(args.kill_every_s),
        down: Duration::from_secs_f64(args.down_s),
        quiet_tail: Duration::from_millis(args.heartbeat_ms + 1000),
    };
    let rng = StdRng::seed_from_u64(args.seed ^ 0x4b11);
    let chaos = schedule::kill_nodes(soak.clone(), agents, net.links(), plan, rng);
    let (chaos, _) = tokio::join!(chaos, async {
        while callers.join_next().await.is_some() {}
    });
    tasks.abort_all();
    chaos
}

/// Waits (up to twice the call bound) until the membership noticed every kill.
async fn wait_for_detection(soak: &Soak, bound: Duration) {
    let until = Instant::now() + bound * 2;
    while !soak.kills.all_noticed() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// Prints the rows; fails when a call hung, a reply was wrong or a kill went unnoticed.
fn rows(
    args: &ChaosArgs,
    soak: &Soak,
    duplicates: u64,
    took: Duration,
    out: &mut Report,
) -> Result<()> {
    let tally = std::mem::take(&mut *soak.tally.lock().expect("tally lock"));
    let d = soak.kills.detection();
    out.row("chaos_link_delay_ms", args.delay_ms, "ms");
    out.row("chaos_link_jitter_ms", args.jitter_ms, "ms");
    out.row("chaos_link_loss_pct", args.loss_pct, "%");
    out.row("chaos_link_flap_loss_pct", args.flap_loss_pct, "%");
    out.row("chaos_call_bound_s", args.bound().as_secs_f64(), "s");
    out.row("chaos_seconds", took.as_secs_f64(), "s");
    out.row("node_kills", d.kills as f64, "kills");
    out.row("calls_completed", tally.completed as f64, "calls");
    out.row("calls_failed", tally.failed_total() as f64, "calls");
    out.row("calls_hung", tally.hangs as f64, "calls");
    out.row(
        "data_errors",
        (tally.data_errors + duplicates) as f64,
        "calls",
    );
    out.row("worst_detection_s", d.worst_s, "s");
    out.row("worst_node_died_event_s", d.worst_event_s, "s");
    out.row("worst_failed_call_s", tally.worst_failure_s, "s");
    latency_rows(&tally, took, out);
    explain(&tally, &d, duplicates);
    verdict(&tally, &d, duplicates)
}

fn latency_rows(tally: &Tally, took: Duration, out: &mut Report) {
    let mut ms = tally.latencies_ms.clone();
    ms.sort_by(f64::total_cmp);
    out.row("call_p50_ms", percentile(&ms, 0.5), "ms");
    out.row("call_p99_ms", percentile(&ms, 0.99), "ms");
    out.row(
        "calls_completed_per_s",
        tally.completed as f64 / took.as_secs_f64(),
        "calls/s",
    );
}

/// Failures by name, and the oddities, on stderr.
fn explain(tally: &Tally, d: &schedule::Detection, duplicates: u64) {
    for (name, n) in &tally.failed {
        eprintln!("chaos: failed with {name}: {n}");
    }
    eprintln!(
        "chaos: spawns refused while a host was down: {}",
        tally.spawn_failures
    );
    if duplicates > 0 {
        eprintln!("chaos: peers executed {duplicates} calls twice");
    }
    if !d.spurious.is_empty() {
        eprintln!(
            "chaos: nodes declared dead without a kill: {:?}",
            d.spurious
        );
    }
}

fn verdict(tally: &Tally, d: &schedule::Detection, duplicates: u64) -> Result<()> {
    let mut wrong = Vec::new();
    if tally.hangs > 0 {
        wrong.push(format!("{} calls hung", tally.hangs));
    }
    if tally.data_errors + duplicates > 0 {
        wrong.push(format!("{} wrong replies", tally.data_errors + duplicates));
    }
    if d.undetected > 0 {
        wrong.push(format!("{} kills never noticed", d.undetected));
    }
    if tally.completed == 0 {
        wrong.push("no call completed".into());
    }
    if !wrong.is_empty() {
        bail!("chaos soak failed: {}", wrong.join(", "));
    }
    Ok(())
}
