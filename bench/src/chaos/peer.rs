//! The actor of the chaos soak: it echoes payloads, relays calls to a peer on another host, and remembers enough to
//! prove that every call it answered was executed once (each call carries a cluster-unique id) and that the tell its
//! caller sent just before the call arrived first (per-sender FIFO, guarantee 2 of `runtime/README.md`). Peers
//! handle one message at a time, so relays only go from a front to a back (see `workload::Slot`): a cycle of relays
//! would deadlock.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Result};
use ferl::runtime::ActorAddress;
use ferl::{Actor, Context, Handler};
use rkyv::{Archive, Deserialize, Serialize};

/// A peer of the soak. One per slot; slots are pinned to hosts by a custom resource (`h1`, `h2`, ...).
pub(super) struct Peer {
    seen: Mutex<HashSet<u64>>,
    notes: Mutex<HashMap<u32, u64>>,
    duplicates: Mutex<u64>,
}

/// Sent with `tell` right before each call from the same caller: the call's reply reports the last one seen.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Note {
    /// The calling task.
    pub caller: u32,
    /// The caller's sequence number (the same as the call that follows).
    pub seq: u64,
}

/// Echo `data` back.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Ping {
    /// The calling task.
    pub caller: u32,
    /// The caller's sequence number.
    pub seq: u64,
    /// Cluster-unique call id (caller and sequence).
    pub id: u64,
    /// Payload to echo.
    pub data: Vec<u8>,
}

/// Forward `ping` to the peer at `to` (on another host) and answer with its echo.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Relay {
    /// The peer to call.
    pub to: ActorAddress,
    /// How long the inner call may take before the relay reports a hang.
    pub bound_ms: u64,
    /// The call to forward.
    pub ping: Ping,
}

/// Handled calls and duplicate executions of this instance, asked at the end of the soak.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Stats;

/// The answer to a [`Ping`] or a [`Relay`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Pong {
    /// The call id, echoed.
    pub id: u64,
    /// Whether every actor on the path saw this id for the first time.
    pub first: bool,
    /// The sequence number of the caller's last [`Note`] handled before this call (`u64::MAX`: none).
    pub last_note: u64,
    /// The payload, echoed by the last actor on the path.
    pub data: Vec<u8>,
}

ferl::message! {
    Note => ();
    Ping => Pong;
    Relay => Pong;
    Stats => (u64, u64);
}

impl Actor for Peer {
    type Args = ();
    const NAME: &'static str = "ferl.bench.chaos.Peer";
    async fn start(_: (), _: &Context) -> Result<Self> {
        Ok(Self {
            seen: Mutex::new(HashSet::new()),
            notes: Mutex::new(HashMap::new()),
            duplicates: Mutex::new(0),
        })
    }
}

ferl::register_actor!(Peer, calls: [Note, Ping, Relay, Stats]);

impl Peer {
    /// Records `id`; `true` when it was new to this instance.
    fn first_time(&self, id: u64) -> bool {
        let first = self.seen.lock().expect("seen lock").insert(id);
        if !first {
            *self.duplicates.lock().expect("duplicates lock") += 1;
        }
        first
    }

    fn last_note(&self, caller: u32) -> u64 {
        let notes = self.notes.lock().expect("notes lock");
        notes.get(&caller).copied().unwrap_or(u64::MAX)
    }
}

impl Handler<Note> for Peer {
    async fn handle(&self, m: Note, _: &Context) -> Result<()> {
        self.notes
            .lock()
            .expect("notes lock")
            .insert(m.caller, m.seq);
        Ok(())
    }
}

impl Handler<Ping> for Peer {
    async fn handle(&self, m: Ping, _: &Context) -> Result<Pong> {
        Ok(Pong {
            id: m.id,
            first: self.first_time(m.id),
            last_note: self.last_note(m.caller),
            data: m.data,
        })
    }
}

impl Handler<Relay> for Peer {
    async fn handle(&self, m: Relay, ctx: &Context) -> Result<Pong> {
        let first = self.first_time(m.ping.id);
        let last_note = self.last_note(m.ping.caller);
        let peer = ctx.cluster().actor_ref::<Peer>(m.to.clone());
        let inner = Ping {
            caller: u32::MAX,
            ..m.ping
        };
        let bound = Duration::from_millis(m.bound_ms);
        let pong = match tokio::time::timeout(bound, peer.call(inner)).await {
            Ok(Ok(pong)) => pong,
            Ok(Err(e)) => bail!(
                "relay to {} {} on {} failed [{}]: {e}",
                m.to.type_name,
                m.to.id,
                m.to.node,
                error_name(&e)
            ),
            Err(_) => bail!(
                "relay to {} {} on {} failed [{HANG}]: no reply within {bound:?}",
                m.to.type_name,
                m.to.id,
                m.to.node
            ),
        };
        Ok(Pong {
            first: first && pong.first,
            last_note,
            ..pong
        })
    }
}

impl Handler<Stats> for Peer {
    async fn handle(&self, _: Stats, _: &Context) -> Result<(u64, u64)> {
        let handled = self.seen.lock().expect("seen lock").len() as u64;
        Ok((handled, *self.duplicates.lock().expect("duplicates lock")))
    }
}

/// The name a relay puts between brackets when its inner call passed its bound.
pub(super) const HANG: &str = "hang";

/// A short name for each variant of the runtime's error (how failures are counted).
pub(super) fn error_name(e: &ferl::Error) -> &'static str {
    match e {
        ferl::Error::ActorDied { .. } => "actor_died",
        ferl::Error::Remote { .. } => "remote",
        ferl::Error::Lost { .. } => "lost",
        ferl::Error::Unreachable { .. } => "unreachable",
        ferl::Error::Codec(_) => "codec",
        ferl::Error::Transport(_) => "transport",
        ferl::Error::Cluster(_) => "cluster",
        ferl::Error::Timeout { .. } => "timeout",
        ferl::Error::Rank { cause, .. } => error_name(cause),
        ferl::Error::Infeasible { .. } => "infeasible",
        ferl::Error::Busy { .. } => "busy",
        ferl::Error::NameTaken { .. } => "name_taken",
        ferl::Error::JoinRefused { .. } => "join_refused",
        ferl::Error::Startup(_) => "startup",
        _ => "other",
    }
}

/// The name of a failure: the variant, or for a relay's failure `relay_` and the inner call's name.
pub(super) fn failure_name(e: &ferl::Error) -> String {
    if let ferl::Error::Remote { message, .. } = e {
        if let Some(inner) = message
            .split_once("failed [")
            .and_then(|(_, rest)| rest.split_once(']'))
            .map(|(name, _)| name)
        {
            return format!("relay_{inner}");
        }
    }
    error_name(e).to_string()
}
