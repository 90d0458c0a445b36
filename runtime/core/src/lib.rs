//! # ferl-runtime: a Ray-like actor runtime over QUIC
//!
//! ## Data model
//! - A **cluster** is one **head** process (control state: nodes, actors, resource groups, named actors, a
//!   key-value store), one **node agent** per machine (starts and watches worker processes, reports resources,
//!   heartbeats), **worker** processes (each hosts one actor) and **drivers** (your program).
//! - An **actor** is a value of a type implementing [`Actor`], built by an async constructor from wire-encoded
//!   `Args`, living in one process. Every message is its own type implementing [`Message`] (or [`StreamMessage`]),
//!   and the actor answers it through [`Handler<M>`] (or [`StreamHandler<M>`]). Types are registered by name with
//!   [`register_actor!`] (from any crate) or at run time with [`register`] (plugins).
//! - An [`ActorRef<A>`] names an actor by a cluster-unique id, its type name, the address of its process and its
//!   node. `call` waits for the reply, `tell` does not, `stream` yields items. The same code serves in-process,
//!   cross-process and cross-node actors.
//! - A **resource group** ([`ResourceGroup`]) is a list of bundles (resource maps such as `{"GPU": 1}`) reserved
//!   all-or-nothing with a [`Strategy`]; an actor spawned into bundle *i* gets `RANK=i`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `MASTER_ADDR`/`MASTER_PORT` and, for GPU bundles, `CUDA_VISIBLE_DEVICES`. A [`WorkerGroup`] spawns one actor
//!   per bundle and broadcasts, splits-and-gathers, or calls rank 0.
//! - Every byte between processes is QUIC (quinn) with TLS trusted from the cluster: the head mints a CA and a
//!   certificate per member after a token handshake. Messages are rkyv, validated on receipt ([`Wire`], from the
//!   `ferl-wire` crate, which message-only crates can depend on alone).
//!
//! The runtime's guarantees are listed in `runtime/README.md`; tests are named after them.
//!
//! ## Layers
//! The source is seven layers, each using only those below it (design decision 15; `tests/layers.rs` checks every
//! `use crate::` against the table). All modules are private; this page is the whole API.
//!
//! | layer | where | what |
//! |---|---|---|
//! | codec | `ferl-wire` | rkyv [`Wire`], frames, buffer pool, [`SharedBytes`], the [`Message`] traits |
//! | protocol | `ferl-wire` | what crosses the wire, as data ([`ActorAddress`], [`Event`], frames, control messages) |
//! | security | `src/security` | cluster CA, member credentials, private session files |
//! | transport | `src/transport` | bytes between processes: QUIC, same-host lanes and rings, bulk streams; no actor type |
//! | actor | `src/actor` | typed actors, mailboxes, dispatch, the process, [`ActorRef`] |
//! | control | `src/control` | pure placement, membership, supervision; the head and node agents, join, shipping, objects |
//! | cluster | `src/cluster` | the driver's API: [`Cluster`], [`WorkerGroup`] |
//!
//! Test actors (`testbed`) and test hooks (`testing`) exist only with the `testing` feature.
//!
//! ## A driver
//! ```no_run
//! use ferl_runtime::{bundle, Actor, Context, Handler, SpawnOptions, Strategy, WorkerGroup};
//! #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone)]
//! struct Add(u64);
//! ferl_runtime::message!(Add => u64);
//! struct Counter(std::sync::atomic::AtomicU64);
//! impl Actor for Counter {
//!     type Args = u64;
//!     async fn start(start: u64, _: &Context) -> anyhow::Result<Self> { Ok(Counter(start.into())) }
//! }
//! impl Handler<Add> for Counter {
//!     async fn handle(&self, Add(n): Add, _: &Context) -> anyhow::Result<u64> {
//!         Ok(self.0.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n)
//!     }
//! }
//! ferl_runtime::register_actor!(Counter, calls: [Add]);
//! # async fn run() -> anyhow::Result<()> {
//! ferl_runtime::enter_worker_mode_if_spawned(); // first line of main: workers re-run this binary
//! let cluster = ferl_runtime::init(Default::default()).await?;          // embedded head + node, like ray.init()
//! let group = cluster.create_group(vec![bundle(&[("CPU", 1.0)]); 2], Strategy::Pack,
//!                                  std::time::Duration::from_secs(10)).await?;
//! let workers = WorkerGroup::<Counter>::spawn(&cluster, &group, |rank| rank as u64, SpawnOptions::new()).await?;
//! let totals = workers.call_all(Add(1)).await?;                            // rank order
//! cluster.kv_put("rendezvous", b"10.0.0.1:29500".to_vec()).await?;
//! # Ok(()) }
//! ```
//! ## The API a distributed trainer uses
//! - start: [`init`] (embedded head + node), [`connect`] (running cluster), [`connect_or_init`] (`FERL_ADDRESS`);
//! - reserve: [`Cluster::create_group`] with bundles made by [`bundle`] (`{"CPU": 1}` or `{"GPU": 1}`);
//! - spawn: [`Cluster::spawn`] with [`SpawnOptions::in_bundle`], [`SpawnOptions::env`], `max_restarts`, `name`;
//! - drive: [`WorkerGroup::spawn`], [`WorkerGroup::call_all`], [`WorkerGroup::call_each`],
//!   [`WorkerGroup::call_split`], [`WorkerGroup::call_rank0`]; a deadline: [`Call::timeout`];
//! - share large inputs: [`Cluster::put`] → [`ObjectRef`], read anywhere with [`Cluster::get`] (once per node; mapped
//!   without a copy on the owner's host when put from a [`Cluster::object_buffer`]);
//! - rendezvous: [`Cluster::kv_put`], [`Cluster::kv_get`], [`Cluster::kv_wait`] (also from inside an actor through
//!   [`Context::cluster`]);
//! - failures: [`Error::ActorDied`], [`Error::Rank`], [`Error::Timeout`], [`Error::Infeasible`] / [`Error::Busy`]
//!   (placement), [`Error::NameTaken`], [`Error::JoinRefused`], [`Cluster::events`];
//! - settings: [`RuntimeConfig`] (every environment variable of `runtime/README.md`, read once by the start
//!   functions; [`RuntimeConfig::from_lookup`] builds one from any source), given to [`HeadOptions::config`].
//!
//! Message types from other crates: derive `rkyv::{Archive, Serialize, Deserialize}`, then
//! `ferl_runtime::message!(MyMsg => MyReply);` and `ferl_runtime::register_actor!(MyActor, calls: [MyMsg]);` (both name
//! the type `module_path::Type`; an `impl Actor` that sets `NAME` keeps that name).

// The layers, bottom up (see "Layers" above). Every module is private: what drivers and other crates use is the
// `pub use` list below.
use ferl_wire::{codec, protocol};

mod actor;
mod cluster;
mod control;
mod security;
#[cfg(feature = "testing")]
pub mod testbed;
#[cfg(feature = "testing")]
pub mod testing;
mod transport;

/// The session folders of this machine's head and node agents (token, address, pid files), for the commands that
/// start, find and stop them (`ferl start/status/stop`).
pub mod session {
    pub use crate::cluster::config::{local_address, local_token, resolve_token, root, stop_local};
    pub use crate::security::session::{detach, is_running};
}

pub use actor::actor_ref::{ActorRef, Call, ReplyStream};
pub use actor::{
    call_entry, lookup, register, registered_names, stream_entry, Actor, ActorFactory, ActorName,
    AnyActor, CallFn, ConstructFn, Context, Dispatch, Dispatchable, Handler, ItemSink, StreamFn,
    StreamHandler,
};
pub use cluster::config::{shipped_file, shipped_files};
pub use cluster::worker_group::{split_even, WorkerGroup};
pub use cluster::{
    bundle, connect, connect_observer, connect_or_init, init, local_ip_for, start_head, start_node,
    Cluster, HeadHandle, HeadOptions, NodeHandle, NodeOptions, ResourceGroup, SpawnOptions,
};
pub use control::blobs::SHIPPED_FILES_ENV;
pub use control::config::RuntimeConfig;
pub use control::head::JOBS_PREFIX;
pub use control::objects::{ObjectBuffer, ObjectRef, ObjectStats};
pub use control::resources::parse_pairs as parse_resources;
pub use ferl_wire::protocol::{
    ActorAddress, Event, JobInfo, JobState, LogChunk, Resources, Strategy,
};
pub use ferl_wire::{
    message, stream_message, Message, SharedBytes, StreamMessage, Wire, WireError,
};
pub use inventory;
pub use transport::bulk::inbox::BulkLimits;
pub use transport::config::TransportConfig;
pub use transport::delivery::RawSink;
pub use transport::error::{Error, Result};

/// Counters of this process's runtime, for tests, benchmarks and monitoring ([`stats`]). New fields may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RuntimeStats {
    /// Same-host lanes this process has opened as a caller (guarantee 13).
    pub lanes_opened: u64,
    /// Bytes this process has received through same-host shared-memory rings (guarantee 13).
    pub shm_bytes_received: u64,
    /// Bytes of QUIC bulk payloads this process holds (or is receiving) that no frame has claimed yet, over all
    /// connections (guarantee 15).
    pub bulk_unclaimed_bytes: u64,
    /// File chunks this process's file server has sent (binaries and shipped files; each transfer sends at least
    /// one).
    pub file_chunks_served: u64,
}

/// This process's [`RuntimeStats`], read now.
pub fn stats() -> RuntimeStats {
    RuntimeStats {
        lanes_opened: transport::lanes_opened(),
        shm_bytes_received: transport::bulk::shm_bytes_received(),
        bulk_unclaimed_bytes: transport::bulk::unclaimed_bytes(),
        file_chunks_served: control::binary::file_chunks_served(),
    }
}

/// If this process was started as a worker, host its actor and never return; otherwise return at once. Call it
/// first thing in `main` of every binary that spawns actors.
pub fn enter_worker_mode_if_spawned() {
    #[cfg(feature = "testing")]
    testbed::ensure_linked();
    control::worker::enter_worker_mode_if_spawned(cluster::config::lookup);
}
