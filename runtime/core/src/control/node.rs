//! The node agent: registers a machine's resources with the head, sends heartbeats, starts one worker process per
//! actor (the driver's binary in worker mode, fetched from the driver by sha256 when this machine lacks it), writes
//! worker logs into the node's log folder (which it serves: `logs.rs`), and reports worker exits to the head at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use crate::actor::process::{Process, BINARY_ACTOR, NODE_ACTOR};
use crate::actor::{Actor, Context, Handler};
use crate::control::worker::env as wenv;
use crate::protocol::*;

mod logs;

pub(crate) use logs::read_log;

/// How long a worker may take from spawn to a constructed actor.
const START_TIMEOUT: Duration = Duration::from_secs(120);

struct WorkerEntry {
    pid: u32,
    spec: SpawnSpec,
    addr: Option<String>,
    ready: Option<oneshot::Sender<Result<(), String>>>,
    log: PathBuf,
}

struct NodeInner {
    process: Arc<Process>,
    head: SocketAddr,
    name: String,
    log_dir: PathBuf,
    creds_path: PathBuf,
    bin_cache: PathBuf,
    force_fetch: bool,
    workers: Mutex<HashMap<u64, WorkerEntry>>,
    fetch_lock: tokio::sync::Mutex<()>,
}

/// The node agent service actor.
#[derive(Clone)]
pub(crate) struct NodeAgent(Arc<NodeInner>);

/// How a node agent is configured.
pub(crate) struct NodeConfig {
    pub resources: Resources,
    pub log_dir: PathBuf,
    /// The private folder (0700) of the worker credentials file (0600), outside `log_dir`.
    pub secrets_dir: PathBuf,
    pub ip: String,
    /// Where fetched driver binaries (and shipped files) are cached (`RuntimeConfig::bin_cache`).
    pub bin_cache: PathBuf,
    /// Always fetch the driver's binary (`RuntimeConfig::force_fetch`).
    pub force_fetch: bool,
}

impl NodeAgent {
    /// Registers with the head at `head`, hosts the node service in `process`, and starts heartbeats.
    pub(crate) async fn start(
        process: &Arc<Process>,
        head: SocketAddr,
        cfg: NodeConfig,
    ) -> Result<NodeAgent> {
        std::fs::create_dir_all(&cfg.log_dir)
            .with_context(|| format!("creating {}", cfg.log_dir.display()))?;
        // Never in the log folder, which `ferl status` advertises and users ship: a private folder beside it.
        crate::security::session::create_private_dir(&cfg.secrets_dir)?;
        let creds_path = cfg
            .secrets_dir
            .join(format!("worker-credentials-{}", std::process::id()));
        process.creds.save(&creds_path)?;
        let register = RegisterNode {
            addr: process.addr.to_string(),
            ip: cfg.ip.clone(),
            resources: cfg.resources.clone(),
            log_dir: cfg.log_dir.display().to_string(),
        };
        // Host first so the head can call back as soon as it knows us.
        let mut agent = NodeAgent(Arc::new(NodeInner {
            process: process.clone(),
            head,
            name: String::new(),
            log_dir: cfg.log_dir.clone(),
            creds_path,
            bin_cache: cfg.bin_cache.clone(),
            force_fetch: cfg.force_fetch,
            workers: Mutex::new(HashMap::new()),
            fetch_lock: tokio::sync::Mutex::new(()),
        }));
        let NodeAdmitted {
            name,
            heartbeat_interval_ms,
        } = process
            .call_at(head, crate::actor::process::HEAD_ACTOR, &register)
            .await
            .context("registering with the head")?;
        Arc::get_mut(&mut agent.0)
            .expect("agent not shared yet")
            .name = name.clone();
        process.host(NODE_ACTOR, agent.clone(), 1024, 4096);
        let _ = process.node.set((process.addr, name.clone()));
        crate::control::objects::host_service(process);
        tracing::info!(node = %name, addr = %process.addr, "node agent registered");
        agent.beat(Duration::from_millis(heartbeat_interval_ms));
        Ok(agent)
    }

    /// Sends a heartbeat to the head every `interval` (the head's choice), on a fixed schedule: a slow answer
    /// delays no later beat beyond its slot. Stops the workers and beats no more once the head says this node is dead.
    fn beat(&self, interval: Duration) {
        let beat = self.clone();
        let head = self.0.head;
        let heartbeat = Heartbeat {
            node: self.0.name.clone(),
        };
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let sent =
                    beat.0
                        .process
                        .call_at(head, crate::actor::process::HEAD_ACTOR, &heartbeat);
                match sent.await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::error!(node = %beat.0.name, "the head declared this node dead; stopping its workers");
                        beat.stop_all();
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(node = %beat.0.name, "heartbeat to the head failed: {e}")
                    }
                }
            }
        });
    }

    /// This node's name.
    pub(crate) fn name(&self) -> &str {
        &self.0.name
    }

    /// Kills every worker (the node is shutting down).
    pub(crate) fn stop_all(&self) {
        for w in self.0.workers.lock().expect("workers lock").values() {
            kill(w.pid);
        }
    }

    async fn binary(&self, spec: &BinarySpec) -> Result<PathBuf> {
        let local = Path::new(&spec.path);
        if !self.0.force_fetch {
            if let Ok(meta) = std::fs::metadata(local) {
                let mtime = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_nanos() as u64);
                if meta.len() == spec.size && mtime == Some(spec.mtime_ns) {
                    return Ok(local.to_path_buf());
                }
            }
        }
        let _guard = self.0.fetch_lock.lock().await;
        let server: SocketAddr = spec
            .server
            .parse()
            .with_context(|| format!("binary server address `{}`", spec.server))?;
        let digest = self
            .0
            .process
            .call_at(server, BINARY_ACTOR, &BinaryDigest)
            .await?;
        crate::control::blobs::check_sha256_hex(&digest)
            .with_context(|| format!("the binary digest the driver at {server} sent"))?;
        let cached = self.0.bin_cache.join(&digest);
        if cached.exists() {
            return Ok(cached);
        }
        let blob = self
            .0
            .process
            .call_at(server, BINARY_ACTOR, &FetchBinary)
            .await?;
        let got = hex::encode(Sha256::digest(&blob.bytes));
        if got != blob.sha256 || got != digest {
            bail!("binary fetched from the driver at {server} has sha256 {got}, expected {digest}");
        }
        std::fs::create_dir_all(&self.0.bin_cache)?;
        let tmp = self
            .0
            .bin_cache
            .join(format!(".{digest}.{}", std::process::id()));
        std::fs::write(&tmp, &blob.bytes)?;
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        std::fs::rename(&tmp, &cached)?;
        tracing::info!(sha256 = %digest, path = %cached.display(), "fetched the driver's binary");
        Ok(cached)
    }

    async fn start_worker(&self, m: StartWorker) -> Result<(String, u32)> {
        let binary = self
            .binary(&m.spec.binary)
            .await
            .with_context(|| format!("finding the binary {}", m.spec.binary.path))?;
        let shipped =
            crate::control::blobs::materialise(&self.0.process, &self.0.bin_cache, &m.spec.files)
                .await
                .with_context(|| format!("files for actor {} ({})", m.id, m.spec.type_name))?;
        let short = m
            .spec
            .type_name
            .rsplit("::")
            .next()
            .unwrap_or(&m.spec.type_name)
            .replace(|c: char| !c.is_alphanumeric(), "_");
        let log = self.0.log_dir.join(format!("worker-{}-{short}.log", m.id));
        let mut cmd = self.worker_command(&m, &binary, shipped, &log)?;
        let child = cmd
            .spawn()
            .with_context(|| format!("starting worker {}", binary.display()))?;
        let pid = child.id().unwrap_or(0);
        let (tx, rx) = oneshot::channel();
        self.0.workers.lock().expect("workers lock").insert(
            m.id,
            WorkerEntry {
                pid,
                spec: m.spec.clone(),
                addr: None,
                ready: Some(tx),
                log: log.clone(),
            },
        );
        self.watch_worker(m.id, pid, child);
        wait_until_ready(m.id, pid, rx, &log).await?;
        let addr = self
            .0
            .workers
            .lock()
            .expect("workers lock")
            .get(&m.id)
            .and_then(|w| w.addr.clone());
        Ok((
            addr.ok_or_else(|| anyhow!("worker for actor {} never said hello", m.id))?,
            pid,
        ))
    }

    /// The command that runs worker `m` from `binary`, with its environment (the node's, the spec's, the head's and
    /// the `shipped` files'), its output in `log`, and death with this node agent.
    fn worker_command(
        &self,
        m: &StartWorker,
        binary: &Path,
        shipped: Vec<(String, String)>,
        log: &Path,
    ) -> Result<tokio::process::Command> {
        let out =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = tokio::process::Command::new(binary);
        cmd.env(wenv::ACTOR_ID, m.id.to_string())
            .env(wenv::NODE_ADDR, self.0.process.addr.to_string())
            .env(wenv::HEAD_ADDR, self.0.head.to_string())
            .env(wenv::CREDS, &self.0.creds_path)
            .env(wenv::NODE_NAME, &self.0.name)
            .env(wenv::BIND_IP, self.0.process.addr.ip().to_string())
            .envs(m.spec.env.iter().cloned())
            .envs(m.env.iter().cloned())
            .envs(shipped)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(false);
        // SAFETY: prctl is async-signal-safe; the worker dies with its node agent instead of lingering.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        Ok(cmd)
    }

    /// Reports worker `id` (process `pid`) gone, with why, once `child` exits.
    fn watch_worker(&self, id: u64, pid: u32, mut child: tokio::process::Child) {
        let watcher = self.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let reason = match status {
                Ok(s) => match std::os::unix::process::ExitStatusExt::signal(&s) {
                    Some(sig) => format!("worker process {pid} was killed by signal {sig}"),
                    None => format!("worker process {pid} exited with {s}"),
                },
                Err(e) => format!("worker process {pid} could not be waited for: {e}"),
            };
            watcher.worker_gone(id, pid, reason).await;
        });
    }

    async fn worker_gone(&self, id: u64, pid: u32, reason: String) {
        let entry = {
            let mut workers = self.0.workers.lock().expect("workers lock");
            match workers.get(&id) {
                Some(w) if w.pid == pid => workers.remove(&id),
                _ => None,
            }
        };
        let Some(mut entry) = entry else { return };
        if let Some(ready) = entry.ready.take() {
            let _ = ready.send(Err(format!(
                "{reason} before its actor {} was constructed",
                entry.spec.type_name
            )));
            return;
        }
        tracing::warn!(actor = id, log = %entry.log.display(), "{reason}");
        let report = WorkerExited {
            id,
            reason: format!("{reason} (log: {})", entry.log.display()),
        };
        if let Err(e) = self
            .0
            .process
            .call_at(self.0.head, crate::actor::process::HEAD_ACTOR, &report)
            .await
        {
            tracing::warn!("reporting the exit of actor {id} to the head failed: {e}");
        }
    }
}

/// Waits for worker `id` (process `pid`, output in `log`) to construct its actor: `ready` answers once it has (or
/// why it could not); a worker not ready within [`START_TIMEOUT`] is killed.
async fn wait_until_ready(
    id: u64,
    pid: u32,
    ready: oneshot::Receiver<Result<(), String>>,
    log: &Path,
) -> Result<()> {
    match tokio::time::timeout(START_TIMEOUT, ready).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(e))) => bail!("{e} (log: {})", log.display()),
        Ok(Err(_)) => bail!(
            "worker for actor {id} vanished while starting (log: {})",
            log.display()
        ),
        Err(_) => {
            kill(pid);
            bail!(
                "worker for actor {id} was not ready within {START_TIMEOUT:?} (log: {})",
                log.display()
            )
        }
    }
}

fn kill(pid: u32) {
    if pid > 0 {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

impl Actor for NodeAgent {
    type Args = ();
    const NAME: &'static str = "ferl.NodeAgent";
    async fn start(_: (), _: &Context) -> Result<Self> {
        bail!("the node agent is started by its process, not spawned")
    }
}

crate::actor_dispatch!(NodeAgent, calls: [StartWorker, StopWorker, FreePort, WorkerHello, WorkerReady, Shutdown,
    ListLogs, ReadLog]);

impl Handler<StartWorker> for NodeAgent {
    async fn handle(&self, m: StartWorker, _: &Context) -> Result<(String, u32)> {
        self.start_worker(m).await
    }
}

impl Handler<StopWorker> for NodeAgent {
    async fn handle(&self, m: StopWorker, _: &Context) -> Result<()> {
        let entry = self.0.workers.lock().expect("workers lock").remove(&m.id);
        if let Some(w) = entry {
            kill(w.pid);
        }
        Ok(())
    }
}

impl Handler<FreePort> for NodeAgent {
    async fn handle(&self, _: FreePort, _: &Context) -> Result<u16> {
        let listener = std::net::TcpListener::bind((self.0.process.addr.ip(), 0))?;
        Ok(listener.local_addr()?.port())
    }
}

impl Handler<WorkerHello> for NodeAgent {
    async fn handle(&self, m: WorkerHello, _: &Context) -> Result<SpawnSpec> {
        let mut workers = self.0.workers.lock().expect("workers lock");
        let w = workers
            .get_mut(&m.id)
            .with_context(|| format!("no worker for actor {} on {}", m.id, self.0.name))?;
        w.addr = Some(m.addr);
        Ok(w.spec.clone())
    }
}

impl Handler<WorkerReady> for NodeAgent {
    async fn handle(&self, m: WorkerReady, _: &Context) -> Result<()> {
        let ready = self
            .0
            .workers
            .lock()
            .expect("workers lock")
            .get_mut(&m.id)
            .and_then(|w| w.ready.take());
        if let Some(tx) = ready {
            let _ = tx.send(match m.error {
                None => Ok(()),
                Some(e) => Err(e),
            });
        }
        Ok(())
    }
}

impl Handler<Shutdown> for NodeAgent {
    async fn handle(&self, _: Shutdown, _: &Context) -> Result<()> {
        self.stop_all();
        tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            std::process::exit(0);
        });
        Ok(())
    }
}
