//! The head's state and every decision on it, with no I/O: no sockets, no tasks, no clock (callers pass `now`).
//! Each method applies one thing that happened (a node joined or was lost, an actor was admitted, started, killed or
//! its worker exited) and returns what the head must do about it as data: events to emit, workers to stop, actors
//! to restart. The head actor ([`super::Head`]) locks this state, calls one method, releases the lock and does the
//! I/O; the unit tests drive it directly.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};

use crate::control::membership::Membership;
use crate::control::placement::{show, BundleSlot, PlaceError, Placement};
use crate::control::supervision::{Life, Supervisor, Verdict};
use crate::protocol::{
    ActorAddress, Event, GroupPlaced, Resources, SpawnSpec, StartWorker, Strategy,
};

/// A node as the head knows it.
#[derive(Debug)]
pub(super) struct NodeEntry {
    /// Address of its node agent.
    pub(super) addr: SocketAddr,
    /// The IP its peers reach it at (a group's `MASTER_ADDR`).
    pub(super) ip: String,
    /// Where its workers' logs go.
    pub(super) log_dir: String,
    /// `false` once it missed its heartbeats: it never comes back under this name.
    pub(super) alive: bool,
    /// Declared resources.
    pub(super) resources: Resources,
}

/// An actor as the head knows it, from admission until it is forgotten.
#[derive(Debug)]
pub(super) struct ActorEntry {
    /// What it runs.
    pub(super) spec: SpawnSpec,
    /// The node it is (to be) on.
    pub(super) node: String,
    /// Its worker's address; empty until started.
    pub(super) addr: String,
    /// Its lifecycle and restart budget.
    pub(super) sup: Supervisor,
    /// The environment the head computed for its worker (ranks, visible GPUs).
    pub(super) env: Vec<(String, String)>,
    /// Its own reservation, for an actor with resources outside a group.
    pub(super) own: Option<BundleSlot>,
}

impl ActorEntry {
    /// Its address as drivers see it.
    pub(super) fn address(&self, id: u64) -> ActorAddress {
        ActorAddress {
            id,
            type_name: self.spec.type_name.clone(),
            addr: self.addr.clone(),
            node: self.node.clone(),
        }
    }
}

/// A resource group: its reserved bundles and the actors placed in them.
#[derive(Debug)]
pub(super) struct GroupEntry {
    /// One reserved slot per bundle.
    pub(super) slots: Vec<BundleSlot>,
    /// How it was placed.
    pub(super) strategy: Strategy,
    /// Actors spawned into its bundles.
    pub(super) actors: Vec<u64>,
    /// The rendezvous port on the first bundle's node, once asked for.
    pub(super) master_port: Option<u16>,
    /// Bundles whose node died, with why: they are not re-placed (their ranks' peers are bound to the old layout).
    pub(super) lost: BTreeMap<usize, String>,
    /// The driver that created it (0: none); the group is removed when that driver is lost.
    pub(super) owner: u64,
}

/// The cluster as the head sees it.
pub(super) struct HeadState {
    /// Every node that ever joined, by name.
    pub(super) nodes: BTreeMap<String, NodeEntry>,
    /// Resources of the live nodes and what is reserved.
    pub(super) placement: Placement,
    /// Heartbeats of the live nodes.
    membership: Membership,
    /// Every actor not yet forgotten, by id.
    pub(super) actors: HashMap<u64, ActorEntry>,
    /// Resource groups, by id.
    pub(super) groups: HashMap<u64, GroupEntry>,
    /// Named actors: (namespace, name) → id.
    named: HashMap<(String, String), u64>,
    /// The key-value store drivers and workers rendezvous through.
    pub(super) kv: HashMap<String, Vec<u8>>,
    /// The drivers that joined and still beat (see `drivers.rs`).
    pub(super) drivers: super::drivers::Drivers,
    next_node: u64,
    next_actor: u64,
    next_group: u64,
}

/// Why an actor was not admitted; the head turns the first three into the typed runtime errors of the same names.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Refusal {
    /// An actor of this name already exists in the namespace.
    NameTaken {
        /// The namespace.
        namespace: String,
        /// The name.
        name: String,
    },
    /// Its resources can never fit this cluster (the message names what is missing).
    Infeasible(String),
    /// Its resources fit the cluster, but not what is free now.
    Busy(String),
    /// Anything else (an unknown group, a bundle out of range or lost, no live node).
    Other(String),
}

/// What the head sends a node agent to start an actor's worker, and names for its logs and errors.
#[derive(Debug)]
pub(super) struct StartRequest {
    /// The node agent's address.
    pub(super) node_addr: SocketAddr,
    /// The message to send it.
    pub(super) msg: StartWorker,
    /// The node's name.
    pub(super) node: String,
    /// The actor's type name.
    pub(super) type_name: String,
}

/// One actor killed on purpose: the worker to stop and the event to emit once it is stopped.
#[derive(Debug)]
pub(super) struct Stop {
    /// The actor.
    pub(super) id: u64,
    /// Its node agent, to ask to stop the worker; `None` when the node is dead (its workers died with it).
    pub(super) node: Option<SocketAddr>,
    /// The `ActorDied` event.
    pub(super) event: Event,
}

/// What losing a node means.
#[derive(Debug)]
pub(super) struct NodeLoss {
    /// The node agent's address, whose connection the head forgets.
    pub(super) addr: SocketAddr,
    /// Events in the order to emit them: each actor's `ActorRestarting` or `ActorDied`, then `NodeDied`.
    pub(super) events: Vec<Event>,
    /// Actors to restart elsewhere.
    pub(super) restarts: Vec<u64>,
}

/// An actor moved off a dead node (for the log).
#[derive(Debug, PartialEq)]
pub(super) struct Moved {
    /// Its type name.
    pub(super) type_name: String,
    /// The dead node.
    pub(super) from: String,
    /// The live node it restarts on.
    pub(super) to: String,
}

/// Where an actor stands for a caller resolving its address.
#[derive(Debug, PartialEq)]
pub(super) enum Resolved {
    /// Running at this address.
    Alive(ActorAddress),
    /// Starting or restarting: ask again.
    Pending,
    /// Dead for good, or never existed: why.
    Gone(String),
}

impl HeadState {
    /// An empty cluster whose nodes die after `heartbeat_bound` without heartbeats.
    pub(super) fn new(heartbeat_bound: Duration) -> Self {
        Self {
            nodes: BTreeMap::new(),
            placement: Placement::default(),
            membership: Membership::new(heartbeat_bound),
            actors: HashMap::new(),
            groups: HashMap::new(),
            named: HashMap::new(),
            kv: HashMap::new(),
            drivers: super::drivers::Drivers::new(heartbeat_bound),
            next_node: 0,
            next_actor: 100,
            next_group: 0,
        }
    }

    /// A node agent registered at `now`: its new name (`node-N`).
    pub(super) fn register_node(
        &mut self,
        addr: SocketAddr,
        ip: String,
        log_dir: String,
        resources: Resources,
        now: Instant,
    ) -> String {
        self.next_node += 1;
        let name = format!("node-{}", self.next_node);
        self.placement.add_node(&name, resources.clone());
        self.membership.join(&name, now);
        let entry = NodeEntry {
            addr,
            ip,
            log_dir,
            alive: true,
            resources,
        };
        self.nodes.insert(name.clone(), entry);
        name
    }

    /// A heartbeat from `node` at `now`; `false` if the node is unknown or already declared dead.
    pub(super) fn heartbeat(&mut self, node: &str, now: Instant) -> bool {
        self.membership.heartbeat(node, now)
    }

    /// How often nodes should beat (a node learns it when it registers).
    pub(super) fn heartbeat_interval(&self) -> Duration {
        self.membership.heartbeat_interval()
    }

    /// How often the head checks for silent nodes with [`HeadState::expire`].
    pub(super) fn check_period(&self) -> Duration {
        self.membership.check_period()
    }

    /// The nodes silent for longer than the heartbeat bound at `now` (each returned once; pass them to
    /// [`HeadState::node_lost`]). Checks later than [`HeadState::check_period`] credit their delay to every node.
    pub(super) fn expire(&mut self, now: Instant) -> Vec<String> {
        self.membership.expire(now)
    }

    /// The node agents of the live nodes.
    pub(super) fn live_node_addrs(&self) -> Vec<SocketAddr> {
        self.nodes
            .values()
            .filter(|n| n.alive)
            .map(|n| n.addr)
            .collect()
    }

    /// Every actor the head knows.
    pub(super) fn actor_ids(&self) -> Vec<u64> {
        self.actors.keys().copied().collect()
    }

    /// Where to ask for a group's rendezvous port: the first bundle's node agent, or `None` when the group has one.
    pub(super) fn master_port_node(&self, group: u64) -> Result<Option<SocketAddr>> {
        let g = self
            .groups
            .get(&group)
            .with_context(|| format!("resource group {group} does not exist"))?;
        if g.master_port.is_some() {
            return Ok(None);
        }
        let node = &g.slots[0].node;
        let addr = self
            .nodes
            .get(node)
            .filter(|n| n.alive)
            .map(|n| n.addr)
            .with_context(|| format!("node {node} of group {group} is gone"))?;
        Ok(Some(addr))
    }

    /// Records a group's rendezvous port (the first one wins).
    pub(super) fn set_master_port(&mut self, group: u64, port: u16) {
        if let Some(g) = self.groups.get_mut(&group) {
            g.master_port.get_or_insert(port);
        }
    }

    /// Refuses a spawn into a bundle whose node died.
    pub(super) fn refuse_lost_bundle(&self, spec: &SpawnSpec) -> Result<(), Refusal> {
        let Some((group, bundle)) = spec.bundle else {
            return Ok(());
        };
        match self
            .groups
            .get(&group)
            .and_then(|g| g.lost.get(&(bundle as usize)))
        {
            Some(why) => Err(Refusal::Other(format!(
                "cannot spawn {} into a lost bundle: {why}; remove the group and create it again",
                spec.type_name
            ))),
            None => Ok(()),
        }
    }

    /// Admits an actor (the synchronous part of a spawn): checks its name, chooses its node (its bundle's, the least
    /// loaded live one when it needs no resources, else one where its resources are reserved now) and records it as
    /// starting. Its id; start it with [`HeadState::start_request`], or [`HeadState::abandon`] it.
    pub(super) fn admit(&mut self, spec: SpawnSpec) -> Result<u64, Refusal> {
        self.refuse_lost_bundle(&spec)?;
        if let Some(name) = &spec.name {
            if self
                .named
                .contains_key(&(spec.namespace.clone(), name.clone()))
            {
                return Err(Refusal::NameTaken {
                    namespace: spec.namespace.clone(),
                    name: name.clone(),
                });
            }
        }
        let (node, own, env) = self.site(&spec)?;
        self.next_actor += 1;
        let id = self.next_actor;
        if let Some(name) = &spec.name {
            self.named
                .insert((spec.namespace.clone(), name.clone()), id);
        }
        if let Some((group, _)) = spec.bundle {
            if let Some(g) = self.groups.get_mut(&group) {
                g.actors.push(id);
            }
        }
        let sup = Supervisor::new(spec.max_restarts);
        let entry = ActorEntry {
            spec,
            node,
            addr: String::new(),
            sup,
            env,
            own,
        };
        self.actors.insert(id, entry);
        Ok(id)
    }

    /// Where a new actor goes: its node, its own reservation and its worker's environment.
    fn site(&mut self, spec: &SpawnSpec) -> Result<Site, Refusal> {
        if let Some((group, bundle)) = spec.bundle {
            let g = self
                .groups
                .get(&group)
                .ok_or_else(|| Refusal::Other(format!("resource group {group} does not exist")))?;
            let slot = g.slots.get(bundle as usize).ok_or_else(|| {
                Refusal::Other(format!(
                    "bundle {bundle} is out of range: resource group {group} has {} bundles",
                    g.slots.len()
                ))
            })?;
            return Ok((
                slot.node.clone(),
                None,
                rank_env(g, bundle as usize, &self.nodes),
            ));
        }
        if spec.resources.values().all(|v| *v <= 0.0) {
            let node = self
                .least_loaded()
                .ok_or_else(|| Refusal::Other("the cluster has no live node".into()))?;
            return Ok((node, None, Vec::new()));
        }
        match self
            .placement
            .reserve(std::slice::from_ref(&spec.resources), Strategy::Pack)
        {
            Ok(mut slots) => {
                let slot = slots.remove(0);
                let env = gpu_env(&slot);
                Ok((slot.node.clone(), Some(slot), env))
            }
            Err(e) => {
                let message = format!(
                    "cannot place actor {} needing {}: {e}",
                    spec.type_name,
                    show(&spec.resources)
                );
                Err(match e {
                    PlaceError::Infeasible(_) => Refusal::Infeasible(message),
                    PlaceError::Busy(_) => Refusal::Busy(message),
                })
            }
        }
    }

    /// Forgets an admitted actor whose first start failed (frees its name and reservation).
    pub(super) fn abandon(&mut self, id: u64) {
        self.forget_actor(id);
        self.actors.remove(&id);
    }

    /// What to send which node agent to start (or restart) an actor's worker.
    pub(super) fn start_request(&self, id: u64) -> Result<StartRequest> {
        let a = self
            .actors
            .get(&id)
            .with_context(|| format!("actor {id} vanished"))?;
        let n = self
            .nodes
            .get(&a.node)
            .filter(|n| n.alive)
            .with_context(|| format!("node {} is gone", a.node))?;
        Ok(StartRequest {
            node_addr: n.addr,
            msg: StartWorker {
                id,
                spec: a.spec.clone(),
                env: a.env.clone(),
            },
            node: a.node.clone(),
            type_name: a.spec.type_name.clone(),
        })
    }

    /// An actor's worker is up at `addr`: it is alive there, unless it was stopped while starting.
    pub(super) fn started(&mut self, id: u64, addr: String) -> Result<ActorAddress> {
        let a = self
            .actors
            .get_mut(&id)
            .with_context(|| format!("actor {id} was removed while starting"))?;
        if let Life::Dead(reason) = &a.sup.life {
            bail!(
                "actor {} {id} was stopped while starting: {reason}",
                a.spec.type_name
            );
        }
        a.addr = addr;
        a.sup.started();
        Ok(a.address(id))
    }

    /// Reserves a resource group's bundles all-or-nothing and records the group.
    pub(super) fn place_group(
        &mut self,
        bundles: &[Resources],
        strategy: Strategy,
        owner: u64,
    ) -> Result<GroupPlaced, PlaceError> {
        let slots = self.placement.reserve(bundles, strategy)?;
        self.next_group += 1;
        let group = self.next_group;
        let nodes = slots.iter().map(|s| s.node.clone()).collect();
        let entry = GroupEntry {
            slots,
            strategy,
            actors: Vec::new(),
            master_port: None,
            lost: BTreeMap::new(),
            owner,
        };
        self.groups.insert(group, entry);
        Ok(GroupPlaced { group, nodes })
    }

    /// Removes a group; the caller kills its actors ([`HeadState::kill`]) and then [`HeadState::release`]s its slots.
    pub(super) fn remove_group(&mut self, group: u64) -> Result<GroupEntry> {
        self.groups
            .remove(&group)
            .with_context(|| format!("resource group {group} does not exist"))
    }

    /// Returns reserved slots to their (live) nodes.
    pub(super) fn release(&mut self, slots: &[BundleSlot]) {
        self.placement.release(slots);
    }

    /// Marks actors dead on purpose (never restarted) and frees their names and reservations: the workers to stop
    /// and the events to emit. Unknown or already dead actors are skipped.
    pub(super) fn kill(&mut self, ids: &[u64], reason: &str) -> Vec<Stop> {
        let mut stops = Vec::new();
        for id in ids {
            let Some(a) = self.actors.get_mut(id) else {
                continue;
            };
            if !a.sup.kill(reason) {
                continue;
            }
            let event = Event::ActorDied {
                id: *id,
                type_name: a.spec.type_name.clone(),
                node: a.node.clone(),
                reason: reason.into(),
            };
            // A node already known dead is not asked: its workers died with it.
            let node = self.nodes.get(&a.node).filter(|n| n.alive).map(|n| n.addr);
            self.forget_actor(*id);
            stops.push(Stop {
                id: *id,
                node,
                event,
            });
        }
        stops
    }

    /// A node is gone: its bundles are lost, the actors of those bundles die, and each of its other actors restarts
    /// on another node when its budget allows (guarantee 12), else dies. `None` if the node is unknown or was already
    /// lost.
    pub(super) fn node_lost(&mut self, node: &str, reason: &str) -> Option<NodeLoss> {
        let entry = self.nodes.get_mut(node).filter(|n| n.alive)?;
        entry.alive = false;
        let addr = entry.addr;
        self.placement.remove_node(node);
        for (gid, g) in self.groups.iter_mut() {
            for (b, slot) in g.slots.iter().enumerate() {
                if slot.node == node {
                    g.lost.insert(
                        b,
                        format!("bundle {b} of resource group {gid} was on node {node}, which died ({reason})"),
                    );
                }
            }
        }
        let mut on_node: Vec<u64> = self
            .actors
            .iter()
            .filter(|(_, a)| a.node == node)
            .map(|(id, _)| *id)
            .collect();
        on_node.sort_unstable();
        let (mut events, mut restarts) = (Vec::new(), Vec::new());
        for id in on_node {
            match self.actor_lost_with_node(id, node, reason) {
                Verdict::Restart(attempt) => {
                    events.push(Event::ActorRestarting {
                        id,
                        node: node.into(),
                        reason: reason.into(),
                        attempt,
                    });
                    restarts.push(id);
                }
                Verdict::Dead(why) => {
                    let type_name = self.actors[&id].spec.type_name.clone();
                    events.push(Event::ActorDied {
                        id,
                        type_name,
                        node: node.into(),
                        reason: why,
                    });
                    self.forget_actor(id);
                }
                Verdict::Ignore => {}
            }
        }
        events.push(Event::NodeDied {
            node: node.into(),
            reason: reason.into(),
        });
        Some(NodeLoss {
            addr,
            events,
            restarts,
        })
    }

    /// The verdict on one actor of a lost node: an actor of a bundle dies with it, a free one counts it as a worker
    /// exit.
    fn actor_lost_with_node(&mut self, id: u64, node: &str, reason: &str) -> Verdict {
        let a = self.actors.get_mut(&id).expect("an actor of the node");
        match (&a.sup.life, a.spec.bundle) {
            // A start in flight fails when the connection to the node closes, and takes the restart path.
            (Life::Dead(_) | Life::Starting | Life::Restarting(_), _) => Verdict::Ignore,
            (Life::Alive, Some((group, bundle))) => {
                let why = lost_bundle_reason(group, bundle, node, reason);
                a.sup.kill(&why);
                Verdict::Dead(why)
            }
            (Life::Alive, None) => a.sup.worker_exited(reason),
        }
    }

    /// Chooses a live node for an actor whose node died: one with the resources it reserved (reserving them there),
    /// or the least loaded one when it reserved none. An actor of a resource-group bundle cannot move (its bundle is
    /// lost). `Ok(None)` when the actor is unknown or its node is alive; `Err` says why it cannot restart.
    pub(super) fn move_off_dead_node(&mut self, id: u64) -> Result<Option<Moved>, String> {
        let Some(a) = self.actors.get(&id) else {
            return Ok(None);
        };
        if self.nodes.get(&a.node).is_some_and(|n| n.alive) {
            return Ok(None);
        }
        let (old, type_name) = (a.node.clone(), a.spec.type_name.clone());
        if let Some((group, bundle)) = a.spec.bundle {
            return Err(lost_bundle_reason(
                group,
                bundle,
                &old,
                "it cannot restart elsewhere",
            ));
        }
        let need = a.spec.resources.clone();
        let (node, own, env) = if need.values().any(|v| *v > 0.0) {
            match self
                .placement
                .reserve(std::slice::from_ref(&need), Strategy::Pack)
            {
                Ok(mut slots) => {
                    let slot = slots.remove(0);
                    let env = gpu_env(&slot);
                    (slot.node.clone(), Some(slot), env)
                }
                Err(e) => {
                    return Err(format!(
                        "its node {old} died and no live node can host it ({}): {e}",
                        show(&need)
                    ))
                }
            }
        } else {
            let node = self
                .least_loaded()
                .ok_or_else(|| format!("its node {old} died and no live node is left"))?;
            (node, None, Vec::new())
        };
        let a = self.actors.get_mut(&id).expect("looked up above");
        a.node = node.clone();
        a.own = own;
        a.env = env;
        a.addr = String::new();
        Ok(Some(Moved {
            type_name,
            from: old,
            to: node,
        }))
    }

    /// Declares an actor dead for good (no restart): the `ActorDied` event, or `None` if it is unknown or already
    /// dead.
    pub(super) fn declare_dead(&mut self, id: u64, reason: String) -> Option<Event> {
        let a = self.actors.get_mut(&id)?;
        if !a.sup.kill(&reason) {
            return None;
        }
        let event = Event::ActorDied {
            id,
            type_name: a.spec.type_name.clone(),
            node: a.node.clone(),
            reason,
        };
        self.forget_actor(id);
        Some(event)
    }

    /// An actor's worker exited: the event to emit (`ActorRestarting` while its budget allows, else `ActorDied`)
    /// and whether to restart it. `None` when the actor is unknown or already dead (killed on purpose).
    pub(super) fn worker_exited(&mut self, id: u64, reason: &str) -> Option<(Event, bool)> {
        let a = self.actors.get_mut(&id)?;
        match a.sup.worker_exited(reason) {
            Verdict::Restart(attempt) => {
                let event = Event::ActorRestarting {
                    id,
                    node: a.node.clone(),
                    reason: reason.into(),
                    attempt,
                };
                Some((event, true))
            }
            Verdict::Dead(why) => {
                let event = Event::ActorDied {
                    id,
                    type_name: a.spec.type_name.clone(),
                    node: a.node.clone(),
                    reason: why,
                };
                self.forget_actor(id);
                Some((event, false))
            }
            Verdict::Ignore => None,
        }
    }

    /// The actor named `name` in `namespace`, if any.
    pub(super) fn lookup(&self, namespace: &str, name: &str) -> Option<ActorAddress> {
        self.named
            .get(&(namespace.to_string(), name.to_string()))
            .and_then(|id| self.actors.get(id).map(|a| a.address(*id)))
    }

    /// Where actor `id` stands: alive at an address, still (re)starting, or gone (with why).
    pub(super) fn resolve(&self, id: u64) -> Resolved {
        let Some(a) = self.actors.get(&id) else {
            return Resolved::Gone(format!("no actor {id} in this cluster"));
        };
        match &a.sup.life {
            Life::Alive => Resolved::Alive(a.address(id)),
            Life::Dead(r) => Resolved::Gone(format!(
                "actor {} {id} on {} died: {r}",
                a.spec.type_name, a.node
            )),
            Life::Starting | Life::Restarting(_) => Resolved::Pending,
        }
    }

    /// Frees an actor's own reservation and name (it is dead or never started).
    fn forget_actor(&mut self, id: u64) {
        let Some(a) = self.actors.get_mut(&id) else {
            return;
        };
        let own = a.own.take();
        let name = a.spec.name.clone().map(|n| (a.spec.namespace.clone(), n));
        if let Some(slot) = own {
            self.placement.release(&[slot]);
        }
        if let Some(key) = name {
            if self.named.get(&key) == Some(&id) {
                self.named.remove(&key);
            }
        }
    }

    /// The live node with the fewest actors that are not dead.
    fn least_loaded(&self) -> Option<String> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.alive)
            .min_by_key(|(name, _)| {
                self.actors
                    .values()
                    .filter(|a| &a.node == *name && !matches!(a.sup.life, Life::Dead(_)))
                    .count()
            })
            .map(|(n, _)| n.clone())
    }
}

/// A new actor's node, own reservation and worker environment.
type Site = (String, Option<BundleSlot>, Vec<(String, String)>);

/// `CUDA_VISIBLE_DEVICES` for a slot that holds GPUs.
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

/// Why an actor of bundle `bundle` in `group` cannot live on: the bundle's node died.
fn lost_bundle_reason(group: u64, bundle: u32, node: &str, reason: &str) -> String {
    format!(
        "bundle {bundle} of resource group {group} was lost with node {node} ({reason}); an actor placed in a \
         bundle is not moved to another node: remove the group and create it again"
    )
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
