//! The head: the cluster's control state — nodes and their heartbeats, actors and their lifecycles, resource groups,
//! named actors, and the key-value store for rendezvous. It is an actor (id [`HEAD_ACTOR`]) hosted by the head
//! process; its decisions come from the pure modules [`crate::control::placement`], [`crate::control::membership`] and
//! [`crate::control::supervision`], and it talks to node agents by calling their actor.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use tokio::sync::{broadcast, Notify};
use tracing::Instrument;

use crate::actor::process::{Process, HEAD_ACTOR, NODE_ACTOR};
use crate::actor::{Actor, Context, Handler, ItemSink, StreamHandler};
use crate::control::membership::Membership;
use crate::control::placement::{show, BundleSlot, PlaceError, Placement};
use crate::control::supervision::{Life, Supervisor};
use crate::protocol::*;
use crate::transport::error::Error;

mod recovery;
mod status;

pub use status::JOBS_PREFIX;

struct NodeEntry {
    addr: SocketAddr,
    ip: String,
    log_dir: String,
    alive: bool,
    resources: Resources,
}

struct ActorEntry {
    spec: SpawnSpec,
    node: String,
    addr: String,
    sup: Supervisor,
    env: Vec<(String, String)>,
    own: Option<BundleSlot>,
}

impl ActorEntry {
    fn address(&self, id: u64) -> ActorAddress {
        ActorAddress {
            id,
            type_name: self.spec.type_name.clone(),
            addr: self.addr.clone(),
            node: self.node.clone(),
        }
    }
}

struct GroupEntry {
    slots: Vec<BundleSlot>,
    strategy: Strategy,
    actors: Vec<u64>,
    master_port: Option<u16>,
    /// Bundles whose node died, with why: they are not re-placed (their ranks' peers are bound to the old layout).
    lost: BTreeMap<usize, String>,
}

#[derive(Default)]
struct HeadState {
    nodes: BTreeMap<String, NodeEntry>,
    placement: Placement,
    membership: Option<Membership>,
    actors: HashMap<u64, ActorEntry>,
    groups: HashMap<u64, GroupEntry>,
    named: HashMap<(String, String), u64>,
    kv: HashMap<String, Vec<u8>>,
    next_node: u64,
    next_actor: u64,
    next_group: u64,
}

struct HeadInner {
    process: Arc<Process>,
    state: Mutex<HeadState>,
    kv_changed: Notify,
    freed: Notify,
}

/// The head service actor.
#[derive(Clone)]
pub(crate) struct Head(Arc<HeadInner>);

impl Head {
    /// Starts the head service in `process` with a heartbeat bound.
    pub(crate) fn start(process: &Arc<Process>, heartbeat_bound: Duration) -> Head {
        let state = HeadState {
            membership: Some(Membership::new(heartbeat_bound)),
            next_actor: 100,
            ..Default::default()
        };
        let head = Head(Arc::new(HeadInner {
            process: process.clone(),
            state: Mutex::new(state),
            kv_changed: Notify::new(),
            freed: Notify::new(),
        }));
        let _ = process.head.set(process.addr);
        process.host(HEAD_ACTOR, head.clone(), 4096, 4096);
        let ticker = head.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep((heartbeat_bound / 4).max(Duration::from_millis(20))).await;
                if Arc::strong_count(&ticker.0) <= 1 {
                    break;
                }
                let expired = ticker
                    .lock()
                    .membership
                    .as_mut()
                    .map(|m| m.expire(Instant::now()))
                    .unwrap_or_default();
                for node in expired {
                    ticker.node_lost(
                        &node,
                        &format!("node {node} missed heartbeats for more than {heartbeat_bound:?}"),
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
        tracing::info!(?event, "cluster event");
        self.0.process.apply_event(&event);
    }

    async fn ensure_master_port(&self, group: u64) -> Result<()> {
        let target = {
            let st = self.lock();
            let g = st
                .groups
                .get(&group)
                .with_context(|| format!("resource group {group} does not exist"))?;
            if g.master_port.is_some() {
                return Ok(());
            }
            let node = &g.slots[0].node;
            st.nodes
                .get(node)
                .filter(|n| n.alive)
                .map(|n| n.addr)
                .with_context(|| format!("node {node} of group {group} is gone"))?
        };
        let port = self
            .0
            .process
            .call_at(target, NODE_ACTOR, &FreePort)
            .await?;
        if let Some(g) = self.lock().groups.get_mut(&group) {
            g.master_port.get_or_insert(port);
        }
        Ok(())
    }

    async fn spawn(&self, spec: SpawnSpec) -> Result<ActorAddress> {
        if let Some((group, bundle)) = spec.bundle {
            if let Some(why) = self
                .lock()
                .groups
                .get(&group)
                .and_then(|g| g.lost.get(&(bundle as usize)))
            {
                bail!("cannot spawn {} into a lost bundle: {why}; remove the group and create it again", spec.type_name);
            }
            self.ensure_master_port(group).await?;
        }
        let id = {
            let mut st = self.lock();
            if let Some(name) = &spec.name {
                if st
                    .named
                    .contains_key(&(spec.namespace.clone(), name.clone()))
                {
                    return Err(Error::NameTaken {
                        namespace: spec.namespace.clone(),
                        name: name.clone(),
                    }
                    .into());
                }
            }
            let (node, own, env) = match spec.bundle {
                Some((group, bundle)) => {
                    let g = st
                        .groups
                        .get(&group)
                        .with_context(|| format!("resource group {group} does not exist"))?;
                    let slot = g.slots.get(bundle as usize).with_context(|| {
                        format!("bundle {bundle} is out of range: resource group {group} has {} bundles", g.slots.len())
                    })?;
                    (
                        slot.node.clone(),
                        None,
                        rank_env(g, bundle as usize, &st.nodes),
                    )
                }
                None if spec.resources.values().all(|v| *v <= 0.0) => {
                    let node = least_loaded(&st).context("the cluster has no live node")?;
                    (node, None, Vec::new())
                }
                None => {
                    let slot = match st
                        .placement
                        .reserve(std::slice::from_ref(&spec.resources), Strategy::Pack)
                    {
                        Ok(mut s) => s.remove(0),
                        Err(e) => {
                            let message = format!(
                                "cannot place actor {} needing {}: {e}",
                                spec.type_name,
                                show(&spec.resources)
                            );
                            return Err(match e {
                                PlaceError::Infeasible(_) => Error::Infeasible { message },
                                PlaceError::Busy(_) => Error::Busy { message },
                            }
                            .into());
                        }
                    };
                    let env = gpu_env(&slot);
                    (slot.node.clone(), Some(slot), env)
                }
            };
            st.next_actor += 1;
            let id = st.next_actor;
            if let Some(name) = &spec.name {
                st.named.insert((spec.namespace.clone(), name.clone()), id);
            }
            if let Some((group, _)) = spec.bundle {
                if let Some(g) = st.groups.get_mut(&group) {
                    g.actors.push(id);
                }
            }
            let sup = Supervisor::new(spec.max_restarts);
            st.actors.insert(
                id,
                ActorEntry {
                    spec,
                    node,
                    addr: String::new(),
                    sup,
                    env,
                    own,
                },
            );
            id
        };
        match self.start_worker(id).await {
            Ok(addr) => Ok(addr),
            Err(e) => {
                let mut st = self.lock();
                forget_actor(&mut st, id);
                st.actors.remove(&id);
                Err(e)
            }
        }
    }

    async fn start_worker(&self, id: u64) -> Result<ActorAddress> {
        let (node_addr, msg, node, type_name) = {
            let st = self.lock();
            let a = st
                .actors
                .get(&id)
                .with_context(|| format!("actor {id} vanished"))?;
            let n = st
                .nodes
                .get(&a.node)
                .filter(|n| n.alive)
                .with_context(|| format!("node {} is gone", a.node))?;
            (
                n.addr,
                StartWorker {
                    id,
                    spec: a.spec.clone(),
                    env: a.env.clone(),
                },
                a.node.clone(),
                a.spec.type_name.clone(),
            )
        };
        let span =
            tracing::info_span!("start_worker", actor = id, node = %node, r#type = %type_name);
        let (addr, _pid) = self
            .0
            .process
            .call_at(node_addr, NODE_ACTOR, &msg)
            .instrument(span)
            .await
            .map_err(|e| {
                let e = match e {
                    Error::Remote { message, .. } => strip(message),
                    other => other.to_string(),
                };
                anyhow!("starting actor {type_name} {id} on {node}: {e}")
            })?;
        let mut st = self.lock();
        let a = st
            .actors
            .get_mut(&id)
            .with_context(|| format!("actor {id} was removed while starting"))?;
        if let Life::Dead(reason) = &a.sup.life {
            bail!("actor {type_name} {id} was stopped while starting: {reason}");
        }
        a.addr = addr;
        a.sup.started();
        Ok(a.address(id))
    }

    /// Marks actors dead on purpose and stops their workers.
    async fn stop_actors(&self, ids: &[u64], reason: &str) {
        let mut stops = Vec::new();
        {
            let mut st = self.lock();
            for id in ids {
                let Some(a) = st.actors.get_mut(id) else {
                    continue;
                };
                if !a.sup.kill(reason) {
                    continue;
                }
                let ev = Event::ActorDied {
                    id: *id,
                    type_name: a.spec.type_name.clone(),
                    node: a.node.clone(),
                    reason: reason.into(),
                };
                // A node already known dead is not asked: its workers died with it.
                let node = st
                    .nodes
                    .get(&st.actors[id].node)
                    .filter(|n| n.alive)
                    .map(|n| n.addr);
                forget_actor(&mut st, *id);
                stops.push((*id, node, ev));
            }
        }
        // All at once, each bounded: a node that died before its heartbeats lapsed cannot hold the others up.
        let stops = stops.into_iter().map(|(id, node, ev)| async move {
            if let Some(addr) = node {
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
            self.emit(ev);
        });
        futures::future::join_all(stops).await;
    }
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

/// Frees an actor's own reservation and name (it is dead or never started).
fn forget_actor(st: &mut HeadState, id: u64) {
    let Some(a) = st.actors.get_mut(&id) else {
        return;
    };
    let own = a.own.take();
    let name = a.spec.name.clone().map(|n| (a.spec.namespace.clone(), n));
    if let Some(slot) = own {
        st.placement.release(&[slot]);
    }
    if let Some(key) = name {
        if st.named.get(&key) == Some(&id) {
            st.named.remove(&key);
        }
    }
}

fn least_loaded(st: &HeadState) -> Option<String> {
    st.nodes
        .iter()
        .filter(|(_, n)| n.alive)
        .min_by_key(|(name, _)| {
            st.actors
                .values()
                .filter(|a| &a.node == *name && !matches!(a.sup.life, Life::Dead(_)))
                .count()
        })
        .map(|(n, _)| n.clone())
}

fn gpu_env(slot: &BundleSlot) -> Vec<(String, String)> {
    if slot.resources.get("GPU").copied().unwrap_or(0.0) > 0.0 {
        let ids: Vec<String> = slot.gpus.iter().map(|g| g.to_string()).collect();
        vec![("CUDA_VISIBLE_DEVICES".into(), ids.join(","))]
    } else {
        Vec::new()
    }
}

/// Environment of the worker in bundle `b`: rank, world size, local rank, rendezvous address, visible GPUs.
fn rank_env(
    g: &GroupEntry,
    b: usize,
    nodes: &BTreeMap<String, NodeEntry>,
) -> Vec<(String, String)> {
    let slot = &g.slots[b];
    let local_rank = g.slots[..b].iter().filter(|s| s.node == slot.node).count();
    let local_world = g.slots.iter().filter(|s| s.node == slot.node).count();
    let master = nodes
        .get(&g.slots[0].node)
        .map(|n| n.ip.clone())
        .unwrap_or_else(|| "127.0.0.1".into());
    let mut env = vec![
        ("RANK".to_string(), b.to_string()),
        ("WORLD_SIZE".into(), g.slots.len().to_string()),
        ("LOCAL_RANK".into(), local_rank.to_string()),
        ("LOCAL_WORLD_SIZE".into(), local_world.to_string()),
        ("MASTER_ADDR".into(), master),
        (
            "MASTER_PORT".into(),
            g.master_port.unwrap_or(29500).to_string(),
        ),
    ];
    env.extend(gpu_env(slot));
    env
}

impl Actor for Head {
    type Args = ();
    const NAME: &'static str = "ferl.Head";
    async fn start(_: (), _: &Context) -> Result<Self> {
        bail!("the head service is started by the head process, not spawned")
    }
}

crate::actor_dispatch!(Head, calls: [RegisterNode, Heartbeat, CreateGroup, RemoveGroup, SpawnActor, KillActor,
    LookupActor, ResolveActor, KvPut, KvGet, KvWait, Status, WorkerExited, Shutdown], streams: [Subscribe]);

impl Handler<RegisterNode> for Head {
    async fn handle(&self, m: RegisterNode, _: &Context) -> Result<String> {
        let addr: SocketAddr = m
            .addr
            .parse()
            .with_context(|| format!("node address `{}`", m.addr))?;
        let name = {
            let mut st = self.lock();
            st.next_node += 1;
            let name = format!("node-{}", st.next_node);
            st.placement.add_node(&name, m.resources.clone());
            if let Some(mem) = st.membership.as_mut() {
                mem.join(&name, Instant::now());
            }
            st.nodes.insert(
                name.clone(),
                NodeEntry {
                    addr,
                    ip: m.ip,
                    log_dir: m.log_dir,
                    alive: true,
                    resources: m.resources,
                },
            );
            name
        };
        self.emit(Event::NodeJoined { node: name.clone() });
        self.0.freed.notify_waiters();
        Ok(name)
    }
}

impl Handler<Heartbeat> for Head {
    async fn handle(&self, m: Heartbeat, _: &Context) -> Result<bool> {
        Ok(self
            .lock()
            .membership
            .as_mut()
            .is_some_and(|mem| mem.heartbeat(&m.node, Instant::now())))
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
            let outcome = {
                let mut st = self.lock();
                match st.placement.reserve(&m.bundles, m.strategy) {
                    Ok(slots) => {
                        st.next_group += 1;
                        let group = st.next_group;
                        let nodes = slots.iter().map(|s| s.node.clone()).collect();
                        st.groups.insert(
                            group,
                            GroupEntry {
                                slots,
                                strategy: m.strategy,
                                actors: Vec::new(),
                                master_port: None,
                                lost: BTreeMap::new(),
                            },
                        );
                        Ok(GroupPlaced { group, nodes })
                    }
                    Err(e) => Err(e),
                }
            };
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
        let g = self
            .lock()
            .groups
            .remove(&m.group)
            .with_context(|| format!("resource group {} does not exist", m.group))?;
        self.stop_actors(
            &g.actors,
            &format!("resource group {} was removed", m.group),
        )
        .await;
        self.lock().placement.release(&g.slots);
        self.0.freed.notify_waiters();
        Ok(())
    }
}

impl Handler<SpawnActor> for Head {
    async fn handle(&self, m: SpawnActor, _: &Context) -> Result<ActorAddress> {
        self.spawn(m.spec).await
    }
}

impl Handler<KillActor> for Head {
    async fn handle(&self, m: KillActor, _: &Context) -> Result<()> {
        self.stop_actors(&[m.id], "killed on request").await;
        Ok(())
    }
}

impl Handler<LookupActor> for Head {
    async fn handle(&self, m: LookupActor, _: &Context) -> Result<Option<ActorAddress>> {
        let st = self.lock();
        Ok(st
            .named
            .get(&(m.namespace, m.name))
            .and_then(|id| st.actors.get(id).map(|a| a.address(*id))))
    }
}

impl Handler<ResolveActor> for Head {
    async fn handle(&self, m: ResolveActor, _: &Context) -> Result<ActorAddress> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            {
                let st = self.lock();
                let a = st
                    .actors
                    .get(&m.id)
                    .with_context(|| format!("no actor {} in this cluster", m.id))?;
                match &a.sup.life {
                    Life::Alive => return Ok(a.address(m.id)),
                    Life::Dead(r) => bail!(
                        "actor {} {} on {} died: {r}",
                        a.spec.type_name,
                        m.id,
                        a.node
                    ),
                    _ if Instant::now() > deadline => {
                        bail!("actor {} still starting after 120 s", m.id)
                    }
                    _ => {}
                }
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
        let nodes: Vec<SocketAddr> = self
            .lock()
            .nodes
            .values()
            .filter(|n| n.alive)
            .map(|n| n.addr)
            .collect();
        let ids: Vec<u64> = self.lock().actors.keys().copied().collect();
        self.stop_actors(&ids, "cluster shut down").await;
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
