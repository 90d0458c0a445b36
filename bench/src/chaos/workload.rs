//! The soak's traffic: slots of [`Peer`] actors pinned to hosts (respawned when their host comes back), callers in
//! the driver that call them directly or through a peer on another host, and the tally of every call's outcome.
//! Each call ends in one of three ways: completed (its echo and exactly-once checks are verified), failed with a
//! named runtime error, or hung (no answer within the bound: the runtime promised a failure by then).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferl::runtime::{bundle, ActorRef, Cluster, SpawnOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::peer::{failure_name, Note, Peer, Ping, Pong, Relay, HANG};
use super::schedule::Kills;

/// One actor position on a host; empty while its actor is dead and not yet replaced. A front relays to backs on
/// other hosts and a back never calls anyone, so no cycle of calls can deadlock actors that handle one message at a
/// time.
pub(super) struct Slot {
    /// Index of the host (1-based: host 0 is the head's).
    pub host: usize,
    /// Whether the driver's relays go through this slot (else relays go to it).
    pub front: bool,
    actor: Mutex<Option<ActorRef<Peer>>>,
}

impl Slot {
    fn get(&self) -> Option<ActorRef<Peer>> {
        self.actor.lock().expect("slot lock").clone()
    }

    /// Empties the slot if it still holds actor `id`.
    pub(super) fn clear_if(&self, id: u64) {
        let mut a = self.actor.lock().expect("slot lock");
        if a.as_ref().is_some_and(|a| a.id() == id) {
            *a = None;
        }
    }
}

/// Outcomes of the soak's calls.
#[derive(Default)]
pub(super) struct Tally {
    /// Calls that returned a verified reply.
    pub completed: u64,
    /// Failed calls by error name.
    pub failed: BTreeMap<String, u64>,
    /// Calls (or relayed inner calls) with no answer within their bound.
    pub hangs: u64,
    /// Replies that were wrong: payload changed, executed twice, or the preceding tell missing.
    pub data_errors: u64,
    /// Latency of each completed call, in ms.
    pub latencies_ms: Vec<f64>,
    /// The longest a failed call took before failing, in s.
    pub worst_failure_s: f64,
    /// Spawns that failed (expected while a slot's host is down: no node has its resource).
    pub spawn_failures: u64,
}

impl Tally {
    /// Calls that failed with a named error.
    pub(super) fn failed_total(&self) -> u64 {
        self.failed.values().sum()
    }
}

/// Everything the soak's tasks share.
pub(super) struct Soak {
    /// The actor slots.
    pub slots: Vec<Slot>,
    /// Call outcomes.
    pub tally: Mutex<Tally>,
    /// Node kills and when they were noticed.
    pub kills: Kills,
    /// When the traffic stops.
    pub end: Instant,
    /// The bound of a driver's call.
    pub bound: Duration,
}

impl Soak {
    /// Slots holding `peers` (host, whether a front, actor); the traffic window of `seconds` starts now.
    pub(super) fn new(
        peers: Vec<(usize, bool, ActorRef<Peer>)>,
        seconds: f64,
        bound: Duration,
    ) -> Self {
        let slots = peers
            .into_iter()
            .map(|(host, front, actor)| Slot {
                host,
                front,
                actor: Mutex::new(Some(actor)),
            })
            .collect();
        Self {
            slots,
            tally: Mutex::new(Tally::default()),
            kills: Kills::default(),
            end: Instant::now() + Duration::from_secs_f64(seconds),
            bound,
        }
    }

    fn running(&self) -> bool {
        Instant::now() < self.end
    }

    /// Empties the slot holding actor `id`, if any (it died).
    pub(super) fn actor_died(&self, id: u64) {
        self.slots.iter().for_each(|s| s.clear_if(id));
    }

    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().expect("tally lock")
    }
}

/// Keeps slot `index` filled until the soak ends: spawns a peer on its host whenever it is empty.
pub(super) async fn keep_slot(soak: Arc<Soak>, cluster: Cluster, index: usize) {
    let slot = &soak.slots[index];
    let need = bundle(&[(&format!("h{}", slot.host), 1.0)]);
    while soak.running() {
        if slot.get().is_some() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let spawn = cluster.spawn::<Peer>((), SpawnOptions::new().resources(need.clone()));
        match tokio::time::timeout(Duration::from_secs(60), spawn).await {
            Ok(Ok(actor)) => *slot.actor.lock().expect("slot lock") = Some(actor),
            Ok(Err(_)) => {
                soak.tally().spawn_failures += 1;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(_) => {
                eprintln!(
                    "chaos: HANG: spawning a peer on host {} took over 60 s",
                    slot.host
                );
                soak.tally().hangs += 1;
            }
        }
    }
}

/// The payload of call `id`: 16 to 2,048 bytes derived from the id.
fn payload(id: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(id);
    let len = rng.random_range(16..=2048);
    (0..len).map(|_| rng.random()).collect()
}

/// A random element of `of`.
fn any<T: Clone>(rng: &mut StdRng, of: &[&T]) -> Option<T> {
    (!of.is_empty()).then(|| of[rng.random_range(0..of.len())].clone())
}

/// Picks a target; for half of the calls a front, with a back on another host for it to relay to.
fn pick(soak: &Soak, rng: &mut StdRng) -> Option<(ActorRef<Peer>, Option<ActorRef<Peer>>)> {
    let live: Vec<(&Slot, ActorRef<Peer>)> = soak
        .slots
        .iter()
        .filter_map(|s| s.get().map(|a| (s, a)))
        .collect();
    if rng.random_bool(0.5) {
        let fronts: Vec<_> = live.iter().filter(|(s, _)| s.front).collect();
        if let Some((front, target)) = any(rng, &fronts) {
            let backs: Vec<_> = live
                .iter()
                .filter(|(s, _)| !s.front && s.host != front.host)
                .collect();
            if let Some((_, via)) = any(rng, &backs) {
                return Some((target, Some(via)));
            }
        }
    }
    let all: Vec<_> = live.iter().collect();
    any(rng, &all).map(|(_, target)| (target, None))
}

/// One caller task: tells a [`Note`] then calls (a [`Ping`], or a [`Relay`] through the target), back to back.
pub(super) async fn caller(soak: Arc<Soak>, caller: u32, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed ^ u64::from(caller));
    let mut seq = 0u64;
    while soak.running() {
        let Some((target, via)) = pick(&soak, &mut rng) else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        seq += 1;
        let id = (u64::from(caller) << 40) | seq;
        let data = payload(id);
        let ping = Ping {
            caller,
            seq,
            id,
            data: data.clone(),
        };
        let inner = soak.bound.mul_f64(0.75);
        let t0 = Instant::now();
        let call = call_once(&target, via.as_ref(), ping, inner);
        let outcome = tokio::time::timeout(soak.bound, call).await;
        let what = describe(&target, via.as_ref());
        record(&soak, &what, t0, outcome, (id, seq, &data));
    }
}

async fn call_once(
    target: &ActorRef<Peer>,
    via: Option<&ActorRef<Peer>>,
    ping: Ping,
    inner: Duration,
) -> ferl::runtime::Result<Pong> {
    target
        .tell(Note {
            caller: ping.caller,
            seq: ping.seq,
        })
        .await?;
    match via {
        None => target.call(ping).await,
        Some(to) => {
            let relay = Relay {
                to: to.address().clone(),
                bound_ms: inner.as_millis() as u64,
                ping,
            };
            target.call(relay).await
        }
    }
}

fn describe(target: &ActorRef<Peer>, via: Option<&ActorRef<Peer>>) -> String {
    let t = target.address();
    match via {
        None => format!("call to peer {} on {}", t.id, t.node),
        Some(v) => {
            let v = v.address();
            format!(
                "relay through peer {} on {} to peer {} on {}",
                t.id, t.node, v.id, v.node
            )
        }
    }
}

type Outcome = Result<ferl::runtime::Result<Pong>, tokio::time::error::Elapsed>;

/// Counts one call's outcome; prints hangs and wrong replies on stderr.
fn record(soak: &Soak, what: &str, t0: Instant, outcome: Outcome, sent: (u64, u64, &[u8])) {
    let took = t0.elapsed();
    let mut tally = soak.tally();
    match outcome {
        Ok(Ok(pong)) => match check(&pong, sent) {
            None => {
                tally.completed += 1;
                tally.latencies_ms.push(took.as_secs_f64() * 1e3);
            }
            Some(why) => {
                eprintln!("chaos: DATA ERROR: {what}: {why}");
                tally.data_errors += 1;
            }
        },
        Ok(Err(e)) => {
            let name = failure_name(&e);
            if name == format!("relay_{HANG}") {
                eprintln!("chaos: HANG: {what}: {e}");
                tally.hangs += 1;
            } else {
                if took > soak.bound.mul_f64(0.75) {
                    eprintln!("chaos: slow failure after {took:.1?}: {what}: {e}");
                }
                *tally.failed.entry(name).or_default() += 1;
                tally.worst_failure_s = tally.worst_failure_s.max(took.as_secs_f64());
            }
            if let ferl::Error::ActorDied { node, .. } = &e {
                soak.kills.call_failed(node, t0 + took);
            }
        }
        Err(_) => {
            eprintln!("chaos: HANG: {what}: no answer within {:?}", soak.bound);
            tally.hangs += 1;
        }
    }
}

/// Why a reply is wrong, or `None` when it is right.
fn check(pong: &Pong, (id, seq, data): (u64, u64, &[u8])) -> Option<String> {
    if pong.id != id {
        return Some(format!("reply for call {} to call {id}", pong.id));
    }
    if pong.data != data {
        return Some(format!(
            "payload changed ({} bytes sent, {} back)",
            data.len(),
            pong.data.len()
        ));
    }
    if !pong.first {
        return Some(format!("call {id} was executed more than once"));
    }
    if pong.last_note != seq {
        return Some(format!(
            "the tell sent just before call {id} was not handled before it (last seen: {})",
            pong.last_note as i64
        ));
    }
    None
}

/// Asks every live peer how many calls it executed twice (must be none).
pub(super) async fn duplicates(soak: &Soak) -> u64 {
    let mut total = 0;
    for slot in &soak.slots {
        let Some(actor) = slot.get() else { continue };
        match tokio::time::timeout(soak.bound, actor.call(super::peer::Stats)).await {
            Ok(Ok((_, dups))) => total += dups,
            Ok(Err(e)) => eprintln!("chaos: asking peer {} for its stats: {e}", actor.id()),
            Err(_) => eprintln!("chaos: asking peer {} for its stats: no answer", actor.id()),
        }
    }
    total
}
