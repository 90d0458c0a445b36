//! The head: the cluster's control state — nodes and their heartbeats, actors and their lifecycles, resource groups,
//! named actors, and the key-value store for rendezvous. It is an actor (id [`HEAD_ACTOR`]) hosted by the head
//! process; its decisions come from the pure modules [`crate::control::placement`], [`crate::control::membership`] and
//! [`crate::control::supervision`], and it talks to node agents by calling their actor.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use tokio::sync::{broadcast, Notify};
use tracing::Instrument;

use crate::actor::process::{Process, HEAD_ACTOR, NODE_ACTOR};
use crate::actor::{Actor, Context, Handler, ItemSink, StreamHandler};
use crate::control::placement::PlaceError;
use crate::protocol::*;
use crate::transport::error::Error;

mod drivers;
mod jobs;
mod recovery;
mod state;
mod status;

pub(crate) use drivers::host_name;
pub(crate) use jobs::JobHost;
use state::{HeadState, Refusal, Resolved};
pub use status::JOBS_PREFIX;

struct HeadInner {
    process: Arc<Process>,
    state: Mutex<HeadState>,
    kv_changed: Notify,
    freed: Notify,
    jobs: Arc<jobs::Jobs>,
}

/// The head service actor.
#[derive(Clone)]
pub(crate) struct Head(Arc<HeadInner>);

impl Head {
    /// Starts the head service in `process` with a heartbeat bound; it runs submitted jobs as `jobs` says.
    pub(crate) fn start(process: &Arc<Process>, heartbeat_bound: Duration, jobs: JobHost) -> Head {
        let head = Head(Arc::new(HeadInner {
            process: process.clone(),
            state: Mutex::new(HeadState::new(heartbeat_bound)),
            kv_changed: Notify::new(),
            freed: Notify::new(),
            jobs: Arc::new(jobs::Jobs::new(jobs)),
        }));
        let _ = process.head.set(process.addr);
        process.host(HEAD_ACTOR, head.clone(), 4096, 4096);
        let ticker = head.clone();
        let period = head.lock().check_period();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                if Arc::strong_count(&ticker.0) <= 1 {
                    break;
                }
                let now = Instant::now();
                let expired = ticker.lock().expire(now);
                for node in expired {
                    ticker.node_lost(
                        &node,
                        &format!("node {node} missed heartbeats for more than {heartbeat_bound:?}"),
                    );
                }
                let lost_drivers = ticker.lock().drivers.expire(now);
                for id in lost_drivers {
                    let head = ticker.clone();
                    let why = format!("was lost: no heartbeat for more than {heartbeat_bound:?}");
                    tokio::spawn(
                        async move { head.free_driver(id, &why, "failed: driver lost").await },
                    );
                }
            }
        });
        head
    }

    fn lock(&self) -> MutexGuard<'_, HeadState> {
        self.0.state.lock().expect("head state lock")
    }

    fn emit(&self, event: Event) {
        self.emit_at(event, Loudness::Info);
    }

    /// [`Self::emit`], logged at `loudness`: what a run does to itself on purpose (removing its own groups,
    /// killing its own actors, shutting the cluster down) is DEBUG, so that a run that ends normally logs no actor
    /// death at INFO; a failure stays INFO.
    fn emit_at(&self, event: Event, loudness: Loudness) {
        match loudness {
            Loudness::Info => tracing::info!(?event, "cluster event"),
            Loudness::Debug => tracing::debug!(?event, "cluster event"),
        }
        self.0.process.apply_event(&event);
    }

    async fn ensure_master_port(&self, group: u64) -> Result<()> {
        let target = self.lock().master_port_node(group)?;
        let Some(target) = target else {
            return Ok(());
        };
        let port = self
            .0
            .process
            .call_at(target, NODE_ACTOR, &FreePort)
            .await?;
        self.lock().set_master_port(group, port);
        Ok(())
    }

    async fn spawn(&self, spec: SpawnSpec) -> Result<ActorAddress> {
        if let Some((group, _)) = spec.bundle {
            self.lock().refuse_lost_bundle(&spec).map_err(refused)?;
            self.ensure_master_port(group).await?;
        }
        let id = self.lock().admit(spec).map_err(refused)?;
        let started = self.start_worker(id).await;
        if started.is_err() {
            self.lock().abandon(id);
        }
        started
    }

    async fn start_worker(&self, id: u64) -> Result<ActorAddress> {
        let req = self.lock().start_request(id)?;
        let (node, type_name) = (&req.node, &req.type_name);
        let span =
            tracing::info_span!("start_worker", actor = id, node = %node, r#type = %type_name);
        let (addr, _pid) = self
            .0
            .process
            .call_at(req.node_addr, NODE_ACTOR, &req.msg)
            .instrument(span)
            .await
            .map_err(|e| {
                let e = match e {
                    Error::Remote { message, .. } => strip(message),
                    other => other.to_string(),
                };
                anyhow!("starting actor {type_name} {id} on {node}: {e}")
            })?;
        self.lock().started(id, addr)
    }

    /// Removes a group: stops its actors (the reason says the group was removed because of `why`), then frees its
    /// resources.
    async fn remove_group(&self, group: u64, why: &str) -> Result<()> {
        let g = self.lock().remove_group(group)?;
        let (reason, loudness) = match why {
            "removed" => (
                format!("resource group {group} was removed"),
                Loudness::Debug,
            ),
            why => (
                format!("resource group {group} was removed: {why}"),
                Loudness::Info,
            ),
        };
        self.stop_actors(&g.actors, &reason, loudness).await;
        self.lock().release(&g.slots);
        self.0.freed.notify_waiters();
        Ok(())
    }

    /// Marks actors dead on purpose and stops their workers; their deaths are logged at `loudness`.
    async fn stop_actors(&self, ids: &[u64], reason: &str, loudness: Loudness) {
        let stops = self.lock().kill(ids, reason);
        // All at once, each bounded: a node that died before its heartbeats lapsed cannot hold the others up.
        let stops = stops.into_iter().map(|stop| async move {
            let id = stop.id;
            if let Some(addr) = stop.node {
                let msg = StopWorker { id };
                let call = self.0.process.call_at(addr, NODE_ACTOR, &msg);
                match tokio::time::timeout(STOP_WORKER_TIMEOUT, call).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!("stopping actor {id}: {e}"),
                    Err(_) => tracing::warn!(
                        "stopping actor {id}: its node did not answer within {STOP_WORKER_TIMEOUT:?}"
                    ),
                }
            }
            self.emit_at(stop.event, loudness);
        });
        futures::future::join_all(stops).await;
    }
}

/// How loudly the head logs a cluster event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loudness {
    /// What a user should see: failures, nodes joining and leaving, restarts.
    Info,
    /// What a run did to itself on purpose.
    Debug,
}

/// How long the head waits for a node to confirm it stopped a worker.
const STOP_WORKER_TIMEOUT: Duration = Duration::from_secs(5);

/// Drops the "actor ferl.NodeAgent (2) failed on ferl.StartWorker: " prefix of a node agent's error.
fn strip(message: String) -> String {
    match message.split_once(": ") {
        Some((head, rest)) if head.starts_with("actor ferl.") => rest.to_string(),
        _ => message,
    }
}

/// The error a refused spawn answers with: the typed runtime error for a name taken, an infeasible or a busy
/// reservation, else a plain message.
fn refused(refusal: Refusal) -> anyhow::Error {
    match refusal {
        Refusal::NameTaken { namespace, name } => Error::NameTaken { namespace, name }.into(),
        Refusal::Infeasible(message) => Error::Infeasible { message }.into(),
        Refusal::Busy(message) => Error::Busy { message }.into(),
        Refusal::Other(message) => anyhow!(message),
    }
}

impl Actor for Head {
    type Args = ();
    const NAME: &'static str = "ferl.Head";
    async fn start(_: (), _: &Context) -> Result<Self> {
        bail!("the head service is started by the head process, not spawned")
    }
}

crate::actor_dispatch!(Head, calls: [RegisterNode, Heartbeat, RegisterDriver, DriverHeartbeat, DriverExit,
    CreateGroup, RemoveGroup, SpawnActor, KillActor, LookupActor, ResolveActor, KvPut, KvGet, KvWait, Status,
    SubmitJob, JobStatus, JobLogs, StopJob, ListJobs, WorkerExited, Shutdown], streams: [Subscribe]);

impl Handler<RegisterNode> for Head {
    async fn handle(&self, m: RegisterNode, _: &Context) -> Result<NodeAdmitted> {
        let addr: SocketAddr = m
            .addr
            .parse()
            .with_context(|| format!("node address `{}`", m.addr))?;
        let (name, interval) = {
            let mut st = self.lock();
            let name = st.register_node(addr, m.ip, m.log_dir, m.resources, Instant::now());
            (name, st.heartbeat_interval())
        };
        self.emit(Event::NodeJoined { node: name.clone() });
        self.0.freed.notify_waiters();
        Ok(NodeAdmitted {
            name,
            heartbeat_interval_ms: interval.as_millis().max(1) as u64,
        })
    }
}

impl Handler<Heartbeat> for Head {
    async fn handle(&self, m: Heartbeat, _: &Context) -> Result<bool> {
        Ok(self.lock().heartbeat(&m.node, Instant::now()))
    }
}

impl Handler<CreateGroup> for Head {
    async fn handle(&self, m: CreateGroup, _: &Context) -> Result<GroupPlaced> {
        if m.bundles.is_empty() {
            bail!("a resource group needs at least one bundle");
        }
        let deadline = Instant::now() + Duration::from_millis(m.timeout_ms);
        loop {
            let freed = self.0.freed.notified();
            let outcome = self.lock().place_group(&m.bundles, m.strategy, m.owner);
            match outcome {
                Ok(placed) => {
                    tracing::debug!(group = placed.group, nodes = ?placed.nodes, strategy = ?m.strategy, "resource group placed");
                    return Ok(placed);
                }
                Err(PlaceError::Infeasible(why)) => {
                    return Err(Error::Infeasible {
                        message: format!("resource group is infeasible: {why}"),
                    }
                    .into())
                }
                Err(PlaceError::Busy(why)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::Busy {
                            message: format!(
                                "timed out after {} ms waiting for resources: {why}",
                                m.timeout_ms
                            ),
                        }
                        .into());
                    }
                    let _ = tokio::time::timeout(left.min(Duration::from_millis(200)), freed).await;
                }
            }
        }
    }
}

impl Handler<RemoveGroup> for Head {
    async fn handle(&self, m: RemoveGroup, _: &Context) -> Result<()> {
        self.remove_group(m.group, "removed").await
    }
}

impl Handler<SpawnActor> for Head {
    async fn handle(&self, m: SpawnActor, _: &Context) -> Result<ActorAddress> {
        self.spawn(m.spec).await
    }
}

impl Handler<KillActor> for Head {
    async fn handle(&self, m: KillActor, _: &Context) -> Result<()> {
        self.stop_actors(&[m.id], "killed on request", Loudness::Debug)
            .await;
        Ok(())
    }
}

impl Handler<LookupActor> for Head {
    async fn handle(&self, m: LookupActor, _: &Context) -> Result<Option<ActorAddress>> {
        Ok(self.lock().lookup(&m.namespace, &m.name))
    }
}

impl Handler<ResolveActor> for Head {
    async fn handle(&self, m: ResolveActor, _: &Context) -> Result<ActorAddress> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let resolved = self.lock().resolve(m.id);
            match resolved {
                Resolved::Alive(address) => return Ok(address),
                Resolved::Gone(why) => bail!("{why}"),
                Resolved::Pending if Instant::now() > deadline => {
                    bail!("actor {} still starting after 120 s", m.id)
                }
                Resolved::Pending => {}
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Handler<KvPut> for Head {
    async fn handle(&self, m: KvPut, _: &Context) -> Result<()> {
        self.lock().kv.insert(m.key, m.value);
        self.0.kv_changed.notify_waiters();
        Ok(())
    }
}

impl Handler<KvGet> for Head {
    async fn handle(&self, m: KvGet, _: &Context) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().kv.get(&m.key).cloned())
    }
}

impl Handler<KvWait> for Head {
    async fn handle(&self, m: KvWait, _: &Context) -> Result<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_millis(m.timeout_ms);
        loop {
            let changed = self.0.kv_changed.notified();
            if let Some(v) = self.lock().kv.get(&m.key) {
                return Ok(v.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("key `{}` did not appear within {} ms", m.key, m.timeout_ms);
            }
            let _ = tokio::time::timeout(left, changed).await;
        }
    }
}

impl Handler<Status> for Head {
    async fn handle(&self, _: Status, _: &Context) -> Result<String> {
        Ok(self.status_json().to_string())
    }
}

impl Handler<WorkerExited> for Head {
    async fn handle(&self, m: WorkerExited, _: &Context) -> Result<()> {
        self.worker_exited(m.id, m.reason);
        Ok(())
    }
}

impl Handler<Shutdown> for Head {
    async fn handle(&self, _: Shutdown, _: &Context) -> Result<()> {
        self.0.jobs.stop_all().await;
        let nodes = self.lock().live_node_addrs();
        let ids = self.lock().actor_ids();
        self.stop_actors(&ids, "cluster shut down", Loudness::Debug)
            .await;
        for addr in nodes {
            let _ = self.0.process.call_at(addr, NODE_ACTOR, &Shutdown).await;
        }
        tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            std::process::exit(0);
        });
        Ok(())
    }
}

impl StreamHandler<Subscribe> for Head {
    async fn handle_stream(&self, _: Subscribe, items: ItemSink<Event>, _: &Context) -> Result<()> {
        let mut rx = self.0.process.events.subscribe();
        loop {
            match rx.recv().await {
                Ok(ev) => {
                    if items.send(ev).await.is_err() {
                        return Ok(());
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!("an event subscriber lagged by {n} events")
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            }
        }
    }
}
