//! The driver's API: start an embedded cluster ([`init`], like `ray.init()`), join a running one ([`connect`]), or
//! run the long-lived head and node processes ([`start_head`], [`start_node`]) that `ferl start` uses. A [`Cluster`]
//! spawns actors, reserves resource groups, and reads and writes the head's key-value store.

pub(crate) mod config;
mod jobs;
mod logs;
pub(crate) mod options;
pub(crate) mod worker_group;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::broadcast;

use crate::actor::actor_ref::ActorRef;
use crate::actor::process::Process;
use crate::actor::{Actor, Dispatchable};
use crate::codec::Wire;
use crate::control::binary::BinaryServer;
use crate::control::config::RuntimeConfig;
use crate::control::head::Head;
use crate::control::join::{join, JoinService};
use crate::control::node::{NodeAgent, NodeConfig};
use crate::protocol::*;
use crate::security::session::{self, Session};
use crate::security::tls::{self, ClusterCa};
use crate::transport::error::{Error, Result};

pub use self::options::{HeadOptions, NodeOptions, SpawnOptions};

fn idle_timeout(bound: Duration) -> Duration {
    (bound * 3).max(Duration::from_secs(10))
}

/// A failure while starting or joining, before any cluster operation.
fn startup(e: anyhow::Error) -> Error {
    Error::Startup(format!("{e:#}"))
}

/// A running head (with its own node agent), as `ferl start --head` or [`init`] make it.
pub struct HeadHandle {
    /// The cluster as seen from the head process.
    pub cluster: Cluster,
    /// The head's session folder (token, address, logs).
    pub session: Session,
    /// The cluster token.
    pub token: String,
}

/// The node agent's settings from `opts` and `cfg`.
fn node_config(
    opts: &NodeOptions,
    cfg: &RuntimeConfig,
    session: &Session,
    ip: IpAddr,
) -> NodeConfig {
    NodeConfig {
        resources: crate::control::resources::node_resources(
            opts.num_cpus,
            opts.num_gpus,
            opts.resources.clone(),
        ),
        log_dir: session.logs(),
        secrets_dir: session.secrets(),
        ip: ip.to_string(),
        bin_cache: cfg.bin_cache.clone(),
        force_fetch: cfg.force_fetch,
    }
}

/// Starts a head and a node agent in this process, with `opts.config` or else the environment's settings.
pub async fn start_head(opts: HeadOptions) -> Result<HeadHandle> {
    let cfg = opts.config.clone().unwrap_or_else(RuntimeConfig::from_env);
    let session = Session::create(&cfg.session_root, "head").map_err(startup)?;
    let ca = ClusterCa::mint().map_err(startup)?;
    let creds = ca.issue("head").map_err(startup)?;
    let token = opts.token.clone().unwrap_or_else(tls::new_token);
    session.save_token(&token).map_err(startup)?;
    let bound = opts.node.heartbeat_bound.unwrap_or(cfg.heartbeat_bound);
    let process = Process::start(
        creds.clone(),
        SocketAddr::new(opts.ip, opts.port),
        idle_timeout(bound),
        cfg.transport,
    )
    .map_err(startup)?;
    let service = Arc::new(JoinService {
        token: token.clone(),
        ca,
        head_cert: creds.cert_der,
    });
    process.accept_joins(Arc::new(move |conn| Box::pin(service.clone().serve(conn))));
    let job_host = crate::control::head::JobHost {
        log_dir: session.logs(),
        token: token.clone(),
    };
    Head::start(&process, bound, job_host);
    session
        .save_address(&process.addr.to_string())
        .map_err(startup)?;
    let node_cfg = node_config(&opts.node, &cfg, &session, opts.ip);
    let node = NodeAgent::start(&process, process.addr, node_cfg)
        .await
        .map_err(startup)?;
    let cluster = Cluster::new(process, Some(node));
    if let Some(bin) = opts.worker_binary {
        cluster.set_worker_binary(bin)?;
    }
    Ok(HeadHandle {
        cluster,
        session,
        token,
    })
}

/// Starts an embedded local cluster (head and node agent in this process), like `ray.init()`. Its session folder
/// (token, worker logs) goes with it at [`Cluster::shutdown`] unless kept ([`Cluster::keep_session`], or
/// `FERL_KEEP_SESSION=1`: [`RuntimeConfig::keep_session`]); a process that ends without a clean shutdown leaves it
/// for the post-mortem.
pub async fn init(opts: HeadOptions) -> Result<Cluster> {
    let cfg = opts.config.clone().unwrap_or_else(RuntimeConfig::from_env);
    let keep = cfg.keep_session;
    let head = start_head(opts.config(cfg)).await?;
    let mut cluster = head.cluster;
    cluster.embedded = Some(Arc::new(Embedded {
        session: head.session,
        keep: AtomicBool::new(keep),
    }));
    Ok(cluster)
}

/// Joins the cluster named by `FERL_ADDRESS` when it is set (token from `FERL_TOKEN` or the local head), else starts
/// an embedded one with `opts` (the address and token come from `opts.config` when it is given).
pub async fn connect_or_init(opts: HeadOptions) -> Result<Cluster> {
    let cfg = opts.config.clone().unwrap_or_else(RuntimeConfig::from_env);
    match cfg.address.clone() {
        Some(address) => {
            let cluster = connect_with(&address, opts.token.clone(), cfg, true).await?;
            if let Some(bin) = opts.worker_binary {
                cluster.set_worker_binary(bin)?;
            }
            Ok(cluster)
        }
        None => init(opts.config(cfg)).await,
    }
}

/// The IP this machine uses to reach `head` (no packet is sent).
pub fn local_ip_for(head: SocketAddr) -> Result<IpAddr> {
    if head.ip().is_loopback() {
        return Ok(head.ip());
    }
    let route = || -> std::io::Result<IpAddr> {
        let sock = std::net::UdpSocket::bind(if head.is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        })?;
        sock.connect(head)?;
        Ok(sock.local_addr()?.ip())
    };
    route().map_err(|e| Error::Startup(format!("finding this machine's IP towards {head}: {e}")))
}

fn parse_addr(address: &str) -> Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    address
        .to_socket_addrs()
        .map_err(|e| {
            Error::Startup(format!(
                "cluster address `{address}`: expected HOST:PORT of a running head: {e}"
            ))
        })?
        .next()
        .ok_or_else(|| Error::Startup(format!("cluster address `{address}` does not resolve")))
}

/// The token to join with: `given`, else the config's (`FERL_TOKEN`), else the local head's.
fn token_for(given: Option<String>, cfg: &RuntimeConfig) -> Result<String> {
    session::resolve_token(given, cfg.token.clone(), &cfg.session_root).map_err(startup)
}

/// Joins the cluster at `address` as a driver. The token is `token`, else `FERL_TOKEN`, else the local head's. A
/// head that refuses this process gives [`Error::JoinRefused`] with why.
pub async fn connect(address: &str, token: Option<String>) -> Result<Cluster> {
    connect_with(address, token, RuntimeConfig::from_env(), true).await
}

/// Joins the cluster at `address` to read or administer it (`ferl status`, `ferl stop`), not as a driver: the head
/// does not watch it, and what it spawns is owned by no driver (guarantee 17).
pub async fn connect_observer(address: &str, token: Option<String>) -> Result<Cluster> {
    connect_with(address, token, RuntimeConfig::from_env(), false).await
}

async fn connect_with(
    address: &str,
    token: Option<String>,
    cfg: RuntimeConfig,
    driver: bool,
) -> Result<Cluster> {
    let head = parse_addr(address)?;
    let token = token_for(token, &cfg)?;
    let idle = idle_timeout(cfg.heartbeat_bound);
    let creds = join(head, &token, idle).await?;
    let process = Process::start(
        creds,
        SocketAddr::new(local_ip_for(head)?, 0),
        idle,
        cfg.transport,
    )
    .map_err(startup)?;
    let _ = process.head.set(head);
    process.follow_head_events().await?;
    let mut cluster = Cluster::new(process, None);
    if driver {
        cluster.register_driver().await?;
    }
    Ok(cluster)
}

/// A node agent joined to a cluster (`ferl start --address`).
pub struct NodeHandle {
    /// The node's session folder (logs).
    pub session: Session,
    /// The node's name given by the head.
    pub name: String,
    agent: NodeAgent,
    process: Arc<Process>,
}

impl NodeHandle {
    /// Waits until the head forgets this node or the connection to it is lost (always an error).
    pub async fn wait(&self) -> Result<()> {
        let head = self.process.head_addr()?;
        let conn = self.process.conns.get(head).await?;
        conn.closed().await;
        self.agent.stop_all();
        Err(Error::Unreachable {
            addr: head.to_string(),
            reason: format!("lost the connection to the head at {head}"),
        })
    }
}

/// Starts a node agent in this process and joins the head at `address`, with the environment's settings. A head
/// that refuses this node gives [`Error::JoinRefused`] with why.
pub async fn start_node(
    address: &str,
    token: Option<String>,
    opts: NodeOptions,
    ip: Option<IpAddr>,
) -> Result<NodeHandle> {
    let cfg = RuntimeConfig::from_env();
    let head = parse_addr(address)?;
    let token = token_for(token, &cfg)?;
    let bound = opts.heartbeat_bound.unwrap_or(cfg.heartbeat_bound);
    let idle = idle_timeout(bound);
    let creds = join(head, &token, idle).await?;
    let ip = match ip {
        Some(ip) => ip,
        None => local_ip_for(head)?,
    };
    let process =
        Process::start(creds, SocketAddr::new(ip, 0), idle, cfg.transport).map_err(startup)?;
    let _ = process.head.set(head);
    let session = Session::create(&cfg.session_root, "node").map_err(startup)?;
    let node_cfg = node_config(&opts, &cfg, &session, ip);
    let agent = NodeAgent::start(&process, head, node_cfg)
        .await
        .map_err(startup)?;
    Ok(NodeHandle {
        session,
        name: agent.name().to_string(),
        agent,
        process,
    })
}

/// A reserved resource group: its bundles and the node each landed on.
#[derive(Debug, Clone)]
pub struct ResourceGroup {
    /// Group id.
    pub id: u64,
    /// Bundles as requested.
    pub bundles: Vec<Resources>,
    /// Node of each bundle.
    pub nodes: Vec<String>,
}

impl ResourceGroup {
    /// Number of bundles.
    pub fn len(&self) -> usize {
        self.bundles.len()
    }
    /// Whether the group has no bundles (never true for a created group).
    pub fn is_empty(&self) -> bool {
        self.bundles.is_empty()
    }
}

/// Builds a bundle: `bundle(&[("CPU", 1.0)])`.
pub fn bundle(pairs: &[(&str, f64)]) -> Resources {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// A handle on a cluster, from a driver, a worker (see [`crate::Context::cluster`]) or a head.
#[derive(Clone)]
pub struct Cluster {
    process: Arc<Process>,
    node: Option<NodeAgent>,
    binary: Arc<OnceLock<BinarySpec>>,
    owned: Arc<Mutex<Vec<u64>>>,
    /// This driver's id at the head (0: not a registered driver: the head's own process, or a worker).
    driver: u64,
    /// Set when this driver leaves: its heartbeat stops.
    leaving: Arc<AtomicBool>,
    /// The session of the embedded cluster [`init`] started, removed at [`Cluster::shutdown`].
    embedded: Option<Arc<Embedded>>,
}

/// An embedded cluster's session folder and whether to keep it.
struct Embedded {
    session: Session,
    keep: AtomicBool,
}

/// The cluster layer gives an actor's [`Context`](crate::actor::Context) its handle on the cluster (the actor layer
/// below knows no `Cluster`).
impl crate::actor::Context {
    /// A handle on the cluster this actor runs in (KV store, spawning, lookups).
    pub fn cluster(&self) -> Cluster {
        Cluster::from_process(self.process.clone())
    }
}

impl Cluster {
    fn new(process: Arc<Process>, node: Option<NodeAgent>) -> Self {
        Self {
            process,
            node,
            binary: Arc::new(OnceLock::new()),
            owned: Arc::new(Mutex::new(Vec::new())),
            driver: 0,
            leaving: Arc::new(AtomicBool::new(false)),
            embedded: None,
        }
    }

    /// Registers this process as a driver with the head and beats at the head's rate until it leaves: when the beats
    /// stop, the head frees this driver's non-detached actors and resource groups (guarantee 17).
    async fn register_driver(&mut self) -> Result<()> {
        let host = crate::control::head::host_name();
        let command: Vec<String> = std::env::args().collect();
        let admitted = self
            .process
            .call_head(&RegisterDriver {
                pid: std::process::id(),
                host,
                command: command.join(" "),
            })
            .await?;
        self.driver = admitted.id;
        let interval = Duration::from_millis(admitted.heartbeat_interval_ms.max(1));
        let (process, leaving) = (Arc::downgrade(&self.process), self.leaving.clone());
        let beat = DriverHeartbeat { id: admitted.id };
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(process) = process.upgrade() else {
                    break;
                };
                if leaving.load(Ordering::Acquire) {
                    break;
                }
                match process.call_head(&beat).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::error!(
                            "the head declared this driver ({}) lost and freed its actors and resource groups",
                            beat.id
                        );
                        break;
                    }
                    Err(e) => tracing::warn!("driver heartbeat to the head failed: {e}"),
                }
            }
        });
        Ok(())
    }

    /// This driver's id at the head, when it joined a running cluster as a driver ([`connect`]); jobs it publishes
    /// under [`JOBS_PREFIX`](crate::JOBS_PREFIX) with this id as `driver` are marked failed if it is lost.
    pub fn driver_id(&self) -> Option<u64> {
        (self.driver != 0).then_some(self.driver)
    }

    pub(crate) fn from_process(process: Arc<Process>) -> Self {
        Self::new(process, None)
    }

    /// Workers run this binary instead of the current executable (it must call
    /// [`crate::enter_worker_mode_if_spawned`] first and register the actor types).
    pub fn set_worker_binary(&self, path: PathBuf) -> Result<()> {
        let spec = BinaryServer::host(&self.process, path)
            .map_err(|e| Error::Cluster(format!("{e:#}")))?;
        self.binary
            .set(spec)
            .map_err(|_| Error::Cluster("the worker binary is already set".into()))
    }

    fn binary_spec(&self) -> Result<BinarySpec> {
        if let Some(b) = self.binary.get() {
            return Ok(b.clone());
        }
        let exe = std::env::current_exe()
            .map_err(|e| Error::Cluster(format!("finding this executable: {e}")))?;
        let spec =
            BinaryServer::host(&self.process, exe).map_err(|e| Error::Cluster(format!("{e:#}")))?;
        Ok(self.binary.get_or_init(|| spec).clone())
    }

    /// The head's address.
    pub fn head_address(&self) -> Result<SocketAddr> {
        self.process.head_addr()
    }

    /// Spawns an actor of type `A` in a new worker process. A name already used in its namespace gives
    /// [`Error::NameTaken`]; resources of its own that no node could ever hold, [`Error::Infeasible`], and that
    /// are held now, [`Error::Busy`] (an actor's reservation does not wait).
    pub async fn spawn<A: Actor>(&self, args: A::Args, opts: SpawnOptions) -> Result<ActorRef<A>> {
        let mut spec = opts.spec;
        spec.type_name = A::NAME.to_string();
        spec.args = args.to_wire()?.to_vec();
        spec.binary = self.binary_spec()?;
        crate::control::binary::offer_files(&spec.binary.server, &mut spec.files)
            .map_err(|e| Error::Cluster(format!("{e:#}")))?;
        let detached = spec.detached;
        spec.owner = self.driver;
        let named = spec.name.clone().map(|name| (spec.namespace.clone(), name));
        let address = self
            .process
            .call_head(&SpawnActor { spec })
            .await
            .map_err(|e| match (e, named) {
                // The head names it; the exact names are the ones asked for.
                (Error::NameTaken { .. }, Some((namespace, name))) => {
                    Error::NameTaken { namespace, name }
                }
                (e, _) => e,
            })?;
        if !detached {
            self.owned.lock().expect("owned lock").push(address.id);
        }
        Ok(ActorRef::new(address, self.process.clone()))
    }

    /// Hosts `actor` in this process (no worker); calls go through the same mailbox and codec.
    pub fn spawn_local<A: Dispatchable>(&self, actor: A, opts: SpawnOptions) -> ActorRef<A> {
        let id = self.process.local_id();
        self.process.host(
            id,
            actor,
            opts.spec.max_concurrency as usize,
            opts.spec.mailbox as usize,
        );
        let address = ActorAddress {
            id,
            type_name: A::NAME.into(),
            addr: self.process.addr.to_string(),
            node: "local".into(),
        };
        ActorRef::new(address, self.process.clone())
    }

    /// A handle on the actor at `address` that another process passed on (e.g. one it hosts with
    /// [`Cluster::spawn_local`]); calls from here go through this process's own connections.
    pub fn actor_ref<A: Actor>(&self, address: ActorAddress) -> ActorRef<A> {
        ActorRef::new(address, self.process.clone())
    }

    /// Stops an actor (no restart); calls to it fail with `ActorDied`.
    pub async fn kill<A>(&self, actor: &ActorRef<A>) -> Result<()> {
        if actor.id() >= (1 << 62) {
            self.process.unhost(actor.id());
            return Ok(());
        }
        self.process.call_head(&KillActor { id: actor.id() }).await
    }

    /// Finds a named actor.
    pub async fn get_actor<A: Actor>(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<ActorRef<A>>> {
        let found = self
            .process
            .call_head(&LookupActor {
                namespace: namespace.into(),
                name: name.into(),
            })
            .await?;
        match found {
            Some(a) if a.type_name != A::NAME => Err(Error::Cluster(format!(
                "actor `{name}` in `{namespace}` is a {}, not a {}",
                a.type_name,
                A::NAME
            ))),
            Some(a) => Ok(Some(ActorRef::new(a, self.process.clone()))),
            None => Ok(None),
        }
    }

    /// Reserves bundles all-or-nothing: fails at once with [`Error::Infeasible`] when the cluster can never hold
    /// them, waits up to `timeout` while they are feasible but busy, then fails with [`Error::Busy`].
    pub async fn create_group(
        &self,
        bundles: Vec<Resources>,
        strategy: Strategy,
        timeout: Duration,
    ) -> Result<ResourceGroup> {
        let placed = self
            .process
            .call_head(&CreateGroup {
                bundles: bundles.clone(),
                strategy,
                timeout_ms: timeout.as_millis() as u64,
                owner: self.driver,
            })
            .await?;
        Ok(ResourceGroup {
            id: placed.group,
            bundles,
            nodes: placed.nodes,
        })
    }

    /// Frees a group's resources and stops its actors.
    pub async fn remove_group(&self, group: &ResourceGroup) -> Result<()> {
        self.process
            .call_head(&RemoveGroup { group: group.id })
            .await
    }

    /// Stores `value` under `key` on the head.
    pub async fn kv_put(&self, key: &str, value: Vec<u8>) -> Result<()> {
        self.process
            .call_head(&KvPut {
                key: key.into(),
                value,
            })
            .await
    }

    /// Reads `key` from the head.
    pub async fn kv_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.process.call_head(&KvGet { key: key.into() }).await
    }

    /// Waits until `key` exists (up to `timeout`), then reads it.
    pub async fn kv_wait(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.process
            .call_head(&KvWait {
                key: key.into(),
                timeout_ms: timeout.as_millis() as u64,
            })
            .await
    }

    /// Keeps `bytes` in this process's object store and returns the owner's handle: pass it (or clones) in
    /// messages, and any actor reads the bytes with [`Cluster::get`], fetched once per node. The bytes are freed
    /// when the last handle in this process drops (the rule is on [`ObjectRef`](crate::control::objects::ObjectRef)).
    pub fn put(
        &self,
        bytes: impl Into<crate::codec::SharedBytes>,
    ) -> Result<crate::control::objects::ObjectRef> {
        crate::control::objects::put(&self.process, bytes.into())
    }

    /// A zeroed buffer of `len` bytes to fill and then [`Cluster::put_buffer`]: in shared memory where the host
    /// allows it, so that every process of this host maps the object instead of receiving a copy (a rollout reading
    /// a trainer's weights, a batch read by many colocated actors).
    pub fn object_buffer(&self, len: usize) -> crate::control::objects::ObjectBuffer {
        crate::control::objects::buffer(len)
    }

    /// Puts a buffer filled from [`Cluster::object_buffer`] without copying it; otherwise as [`Cluster::put`].
    pub fn put_buffer(
        &self,
        buffer: crate::control::objects::ObjectBuffer,
    ) -> Result<crate::control::objects::ObjectRef> {
        crate::control::objects::put_buffer(&self.process, buffer)
    }

    /// The bytes of an object, from this process, its node's cache, or (once per node) its owner.
    pub async fn get(
        &self,
        object: &crate::control::objects::ObjectRef,
    ) -> Result<crate::codec::SharedBytes> {
        crate::control::objects::get(&self.process, object).await
    }

    /// What the object store holds: this process's with `None`, else the node agent's of the node so named.
    pub async fn object_stats(
        &self,
        node: Option<&str>,
    ) -> Result<crate::control::objects::ObjectStats> {
        let Some(name) = node else {
            return Ok(crate::control::objects::stats(&self.process));
        };
        let status = self.status().await?;
        let address = status["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| n["name"] == name)
            .and_then(|n| n["address"].as_str())
            .ok_or_else(|| Error::Cluster(format!("no node named `{name}` in the cluster")))?;
        let addr: SocketAddr = address
            .parse()
            .map_err(|_| Error::Cluster(format!("node `{name}` has a bad address `{address}`")))?;
        let query = crate::control::objects::QueryObjects;
        self.process
            .call_at(addr, crate::actor::process::OBJECT_ACTOR, &query)
            .await
    }

    /// Cluster events (node joins and deaths, actor restarts and deaths) from now on.
    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.process.events.subscribe()
    }

    /// The cluster's state as JSON (what `ferl status --json` prints: `nodes`, `actors`, `groups`).
    pub async fn status(&self) -> Result<serde_json::Value> {
        let text = self.process.call_head(&Status).await?;
        serde_json::from_str(&text).map_err(|e| Error::Codec(format!("status JSON: {e}")))
    }

    /// Stops the cluster's processes (head, node agents, workers).
    pub async fn shutdown_cluster(&self) -> Result<()> {
        self.process.call_head(&Shutdown).await
    }

    /// Kills the non-detached actors this handle spawned, and a registered driver tells the head it leaves (the head
    /// frees what it still owns); an embedded cluster also stops its workers and endpoint, and one that [`init`]
    /// started removes its session folder unless it is kept ([`Cluster::keep_session`]).
    pub async fn shutdown(self) {
        let owned: Vec<u64> = std::mem::take(&mut *self.owned.lock().expect("owned lock"));
        for id in owned {
            let _ = self.process.call_head(&KillActor { id }).await;
        }
        if self.driver != 0 {
            self.leaving.store(true, Ordering::Release);
            let _ = self
                .process
                .call_head(&DriverExit { id: self.driver })
                .await;
        }
        if let Some(node) = &self.node {
            node.stop_all();
        }
        self.process.close();
        if let Some(e) = &self.embedded {
            if !e.keep.load(Ordering::Acquire) {
                e.session.remove();
            }
        }
    }

    /// Keeps the session folder of the embedded cluster [`init`] started after [`Cluster::shutdown`] (e.g. for the
    /// worker logs of a failed run, in its `logs/`), and returns it; `None` for any other cluster handle.
    pub fn keep_session(&self) -> Option<PathBuf> {
        let e = self.embedded.as_ref()?;
        e.keep.store(true, Ordering::Release);
        Some(e.session.dir.clone())
    }
}
