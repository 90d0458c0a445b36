//! The option types of the driver's API, all in one style: a builder that starts from `new()` (the defaults) and
//! sets what differs, `HeadOptions::new().node(NodeOptions::new().num_cpus(4.0))`.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use super::ResourceGroup;
use crate::control::config::RuntimeConfig;
use crate::protocol::{Resources, SpawnSpec};

/// Settings of a head or an embedded cluster.
#[derive(Debug, Clone)]
pub struct HeadOptions {
    pub(crate) ip: IpAddr,
    pub(crate) port: u16,
    pub(crate) node: NodeOptions,
    pub(crate) worker_binary: Option<PathBuf>,
    pub(crate) token: Option<String>,
    pub(crate) config: Option<RuntimeConfig>,
}

impl Default for HeadOptions {
    fn default() -> Self {
        Self {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            node: NodeOptions::default(),
            worker_binary: None,
            token: None,
            config: None,
        }
    }
}

impl HeadOptions {
    /// Defaults: 127.0.0.1, any port, a node of detected resources, this executable for workers, a fresh token,
    /// the environment's settings.
    pub fn new() -> Self {
        Self::default()
    }
    /// IP to bind and advertise.
    pub fn ip(mut self, ip: IpAddr) -> Self {
        self.ip = ip;
        self
    }
    /// UDP port (0 = any).
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }
    /// Resources and heartbeat bound of the head's own node agent.
    pub fn node(mut self, node: NodeOptions) -> Self {
        self.node = node;
        self
    }
    /// Binary workers run (default: this executable; it must call `enter_worker_mode_if_spawned` first).
    pub fn worker_binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.worker_binary = Some(path.into());
        self
    }
    /// Cluster token to use (default: a fresh random one); for `connect_or_init`, the token to join with.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }
    /// The runtime's settings (default: read from the environment when the head starts,
    /// `RuntimeConfig::from_env`).
    pub fn config(mut self, config: RuntimeConfig) -> Self {
        self.config = Some(config);
        self
    }
}

/// Settings of a node agent.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    pub(crate) num_cpus: Option<f64>,
    pub(crate) num_gpus: Option<u32>,
    pub(crate) resources: Resources,
    pub(crate) heartbeat_bound: Option<Duration>,
}

impl NodeOptions {
    /// Defaults: detected CPUs and GPUs, no custom resources, the config's heartbeat bound.
    pub fn new() -> Self {
        Self::default()
    }
    /// CPUs to declare (default: detected).
    pub fn num_cpus(mut self, n: f64) -> Self {
        self.num_cpus = Some(n);
        self
    }
    /// GPUs to declare (default: detected with nvidia-smi).
    pub fn num_gpus(mut self, n: u32) -> Self {
        self.num_gpus = Some(n);
        self
    }
    /// Custom resources.
    pub fn resources(mut self, resources: Resources) -> Self {
        self.resources = resources;
        self
    }
    /// A head declares a node dead after this long without heartbeats (default: the config's,
    /// `FERL_HEARTBEAT_BOUND_MS`, else 3 s). Nodes beat at the rate their head sets (a quarter of its bound); a
    /// joining node uses its own bound only to size its connections' idle timeout.
    pub fn heartbeat_bound(mut self, bound: Duration) -> Self {
        self.heartbeat_bound = Some(bound);
        self
    }
}

/// How to spawn an actor.
#[derive(Debug, Clone)]
pub struct SpawnOptions {
    pub(crate) spec: SpawnSpec,
}

impl Default for SpawnOptions {
    fn default() -> Self {
        Self {
            spec: SpawnSpec {
                max_concurrency: 1,
                mailbox: 1024,
                namespace: "default".into(),
                ..Default::default()
            },
        }
    }
}

impl SpawnOptions {
    /// Defaults: no group, no reserved resources, concurrency 1, mailbox 1024, no restarts.
    pub fn new() -> Self {
        Self::default()
    }
    /// Place the actor in bundle `index` of `group` (it gets the rank environment of that bundle).
    pub fn in_bundle(mut self, group: &ResourceGroup, index: usize) -> Self {
        self.spec.bundle = Some((group.id, index as u32));
        self
    }
    /// Reserve these resources for the actor (outside any group).
    pub fn resources(mut self, resources: Resources) -> Self {
        self.spec.resources = resources;
        self
    }
    /// Set an environment variable in the worker process.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.spec.env.push((key.into(), value.into()));
        self
    }
    /// Name the actor within a namespace (find it with [`Cluster::get_actor`](super::Cluster::get_actor)).
    pub fn name(mut self, namespace: &str, name: &str) -> Self {
        self.spec.namespace = namespace.into();
        self.spec.name = Some(name.into());
        self
    }
    /// Re-run the constructor up to `n` times after the worker dies.
    pub fn max_restarts(mut self, n: u32) -> Self {
        self.spec.max_restarts = n;
        self
    }
    /// Handle up to `n` messages at once (default 1: strictly in order).
    pub fn max_concurrency(mut self, n: u32) -> Self {
        self.spec.max_concurrency = n.max(1);
        self
    }
    /// Mailbox capacity; senders wait when it is full.
    pub fn mailbox(mut self, n: u32) -> Self {
        self.spec.mailbox = n.max(1);
        self
    }
    /// Ship the file at `path` to the actor's node before its worker starts (by sha256, cached on the node, so it
    /// travels at most once per node); the actor finds its local copy with [`crate::shipped_file`]`(name)`.
    pub fn ship_file(mut self, name: &str, path: impl Into<PathBuf>) -> Self {
        self.spec.files.push(crate::control::blobs::ShippedFile {
            name: name.into(),
            driver_path: path.into().display().to_string(),
            ..Default::default()
        });
        self
    }
    /// Keep the actor alive after this driver's [`Cluster::shutdown`](super::Cluster::shutdown).
    pub fn detached(mut self) -> Self {
        self.spec.detached = true;
        self
    }
}
