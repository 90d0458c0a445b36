//! The chaos: node agents started in their hosts' namespaces (this binary's hidden `chaos-node` command, which runs
//! the same `start_node` as `ferl start --address --block`), killed with SIGKILL at random times (their workers die
//! with them) while their host is cut off the network, and restarted a few seconds later; links whose loss flaps up
//! for a few seconds; and the record of when each kill was noticed.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferl::runtime::Event;
use rand::rngs::StdRng;
use rand::Rng;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::broadcast;

use super::net::{Host, Links};
use super::workload::Soak;

/// One kill of a node agent, and when the driver noticed it.
struct Kill {
    node: String,
    at: Instant,
    event: Option<Instant>,
    call: Option<Instant>,
}

/// Every kill of the soak.
#[derive(Default)]
pub(super) struct Kills {
    list: Mutex<Vec<Kill>>,
    spurious: Mutex<Vec<String>>,
}

/// How fast kills were noticed.
#[derive(Debug, Default)]
pub(super) struct Detection {
    /// Kills made.
    pub kills: usize,
    /// Kills never noticed.
    pub undetected: usize,
    /// Worst time from a kill to the first sign of it (a call failing with `ActorDied` or `Event::NodeDied`).
    pub worst_s: f64,
    /// Worst time from a kill to `Event::NodeDied` (the membership decision).
    pub worst_event_s: f64,
    /// Nodes declared dead that were not killed.
    pub spurious: Vec<String>,
}

impl Kills {
    fn killed(&self, node: String, at: Instant) {
        self.list.lock().expect("kills lock").push(Kill {
            node,
            at,
            event: None,
            call: None,
        });
    }

    fn node_died(&self, node: &str, at: Instant) {
        let mut list = self.list.lock().expect("kills lock");
        match list.iter_mut().find(|k| k.node == node) {
            Some(k) => {
                k.event.get_or_insert(at);
            }
            None => self.spurious.lock().expect("kills lock").push(node.into()),
        }
    }

    /// A call failed with `ActorDied` naming `node` at `at`.
    pub(super) fn call_failed(&self, node: &str, at: Instant) {
        let mut list = self.list.lock().expect("kills lock");
        if let Some(k) = list.iter_mut().find(|k| k.node == node && at >= k.at) {
            k.call.get_or_insert(at);
        }
    }

    /// Whether every kill so far was noticed by the membership.
    pub(super) fn all_noticed(&self) -> bool {
        let list = self.list.lock().expect("kills lock");
        list.iter().all(|k| k.event.is_some())
    }

    /// The figures of the soak.
    pub(super) fn detection(&self) -> Detection {
        let list = self.list.lock().expect("kills lock");
        let mut d = Detection {
            kills: list.len(),
            spurious: self.spurious.lock().expect("kills lock").clone(),
            ..Default::default()
        };
        for k in list.iter() {
            let first = [k.event, k.call].into_iter().flatten().min();
            match first {
                Some(t) => d.worst_s = d.worst_s.max((t - k.at).as_secs_f64()),
                None => d.undetected += 1,
            }
            if let Some(t) = k.event {
                d.worst_event_s = d.worst_event_s.max((t - k.at).as_secs_f64());
            }
        }
        d
    }
}

/// Follows the driver's cluster events: empties the slots of dead actors and times node deaths.
pub(super) async fn follow_events(soak: Arc<Soak>, mut events: broadcast::Receiver<Event>) {
    loop {
        match events.recv().await {
            Ok(Event::ActorDied { id, .. }) => soak.actor_died(id),
            Ok(Event::NodeDied { node, .. }) => soak.kills.node_died(&node, Instant::now()),
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => return,
        }
    }
}

/// A running node agent.
struct Agent {
    child: Child,
    node: String,
    _stdout: Lines<BufReader<ChildStdout>>,
}

/// The node agents of hosts `1..`, started, killed and restarted.
pub(super) struct Agents {
    /// This executable.
    pub exe: PathBuf,
    /// The head's address.
    pub address: String,
    /// The cluster token (given to agents in their environment).
    pub token: String,
    /// The heartbeat bound, ms.
    pub heartbeat_ms: u64,
    /// Where agent logs go.
    pub log_dir: PathBuf,
    /// Every host (host 0 is the head's and has no agent here).
    pub hosts: Vec<Host>,
    running: Vec<Option<Agent>>,
    starts: usize,
}

impl Agents {
    /// Agents for `hosts`, none running yet.
    pub(super) fn new(
        exe: PathBuf,
        address: String,
        token: String,
        heartbeat_ms: u64,
        log_dir: PathBuf,
        hosts: Vec<Host>,
    ) -> Self {
        let running = hosts.iter().map(|_| None).collect();
        Self {
            exe,
            address,
            token,
            heartbeat_ms,
            log_dir,
            hosts,
            running,
            starts: 0,
        }
    }

    /// Starts host `host`'s agent in its namespace and waits until it joined; returns its node name.
    pub(super) async fn start(&mut self, host: usize) -> Result<String> {
        self.starts += 1;
        let log = self
            .log_dir
            .join(format!("agent-h{host}-{}.log", self.starts));
        let err =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.hosts[host].ns])
            .arg(&self.exe)
            .args(["chaos-node", "--address", &self.address])
            .args(["--resources", &format!("h{host}=100")])
            .args(["--heartbeat-ms", &self.heartbeat_ms.to_string()])
            .env("FERL_TOKEN", &self.token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .context("starting a node agent with `ip netns exec`")?;
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let node = tokio::time::timeout(Duration::from_secs(60), joined(&mut lines))
            .await
            .map_err(|_| anyhow::anyhow!("no join within 60 s"))
            .and_then(|r| r)
            .with_context(|| format!("node agent of host {host} (log: {})", log.display()))?;
        self.running[host] = Some(Agent {
            child,
            node: node.clone(),
            _stdout: lines,
        });
        Ok(node)
    }

    /// Kills host `host`'s agent with SIGKILL; returns its node name.
    async fn kill(&mut self, host: usize) -> Option<String> {
        let mut agent = self.running[host].take()?;
        let _ = agent.child.start_kill();
        let _ = agent.child.wait().await;
        Some(agent.node)
    }
}

/// Reads an agent's stdout until it prints `NODE <name>`.
async fn joined(lines: &mut Lines<BufReader<ChildStdout>>) -> Result<String> {
    while let Some(line) = lines.next_line().await? {
        if let Some(name) = line.strip_prefix("NODE ") {
            return Ok(name.trim().to_string());
        }
    }
    bail!("the node agent exited before joining")
}

/// When kills happen.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    /// Mean time between kills (0: no kills).
    pub kill_every: Duration,
    /// Mean time a killed host stays down.
    pub down: Duration,
    /// No kill starts this close to the end (so callers are still running while it is noticed).
    pub quiet_tail: Duration,
}

/// `d` scaled by a random factor in 0.5..1.5.
fn around(d: Duration, rng: &mut StdRng) -> Duration {
    d.mul_f64(rng.random_range(0.5..1.5))
}

/// Kills a random node agent (cutting its host off), restarts it after a while, again and again until the end.
pub(super) async fn kill_nodes(
    soak: Arc<Soak>,
    agents: &mut Agents,
    links: Links,
    plan: Plan,
    mut rng: StdRng,
) -> Result<()> {
    if plan.kill_every.is_zero() {
        return Ok(());
    }
    loop {
        let wake = Instant::now() + around(plan.kill_every, &mut rng);
        if wake + plan.quiet_tail >= soak.end {
            tokio::time::sleep_until(soak.end.into()).await;
            return Ok(());
        }
        tokio::time::sleep_until(wake.into()).await;
        let host = rng.random_range(1..agents.hosts.len());
        links.set_down(host, true);
        let at = Instant::now();
        if let Some(node) = agents.kill(host).await {
            eprintln!("chaos: killed the agent of host {host} ({node})");
            soak.kills.killed(node, at);
        }
        tokio::time::sleep(around(plan.down, &mut rng)).await;
        links.set_down(host, false);
        let node = agents.start(host).await?;
        eprintln!("chaos: restarted host {host} as {node}");
    }
}

/// Raises a random link's loss for 2–4 s every 3–6 s until the end.
pub(super) async fn flap_links(soak: Arc<Soak>, links: Links, hosts: usize, mut rng: StdRng) {
    while Instant::now() < soak.end {
        tokio::time::sleep(Duration::from_secs_f64(rng.random_range(3.0..6.0))).await;
        let host = rng.random_range(0..hosts);
        links.set_flapping(host, true);
        tokio::time::sleep(Duration::from_secs_f64(rng.random_range(2.0..4.0))).await;
        links.set_flapping(host, false);
    }
}
