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
//!   certificate per member after a token handshake ([`join`]). Messages are rkyv, validated on receipt ([`wire`]).
//!
//! The runtime's guarantees are listed in `runtime/README.md`; tests are named after them.
//!
//! ## Where things happen
//! - a call is routed: [`actor_ref`] → [`process`] (local mailbox or connection) → [`transport`] → [`host`]
//! - placement: [`placement`] (pure) applied by [`head`]; liveness: [`membership`]; restarts: [`supervision`]
//! - worker processes: [`node`] starts them, [`worker`] is their side
//! - objects put once and read on every node: [`objects`] (owner store, node caches, lifetime rule)
//!
//! ## A driver
//! ```no_run
//! use ferl_runtime::testbed::{Add, Counter};
//! use ferl_runtime::{bundle, Strategy, SpawnOptions, WorkerGroup};
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
//! - share large inputs: [`Cluster::put`] → [`ObjectRef`], read anywhere with [`Cluster::get`] (once per node);
//! - rendezvous: [`Cluster::kv_put`], [`Cluster::kv_get`], [`Cluster::kv_wait`] (also from inside an actor through
//!   [`Context::cluster`]);
//! - failures: [`Error::ActorDied`], [`Error::Rank`], [`Error::Timeout`], [`Cluster::events`].
//!
//! Message types from other crates: derive `rkyv::{Archive, Serialize, Deserialize}`, then
//! `ferl_runtime::message!(MyMsg => MyReply);` and `ferl_runtime::register_actor!(MyActor, calls: [MyMsg]);` (both name
//! the type `module_path::Type`; an `impl Actor` that sets `NAME` keeps that name).

pub mod actor;
pub mod actor_ref;
mod binary;
pub mod blobs;
pub mod bulk;
pub mod cluster;
pub mod error;
pub mod head;
pub mod host;
pub mod join;
pub mod membership;
pub mod node;
pub mod objects;
pub mod placement;
pub mod process;
pub mod protocol;
pub mod resources;
pub mod session;
pub mod shared_bytes;
pub mod supervision;
pub mod testbed;
pub mod tls;
pub mod transport;
pub mod wire;
pub mod worker;
pub mod worker_group;

pub use actor::{
    call_entry, lookup, register, registered_names, stream_entry, Actor, ActorFactory, ActorName,
    Context, Dispatch, Dispatchable, Handler, ItemSink, Message, StreamHandler, StreamMessage,
};
pub use actor_ref::{ActorRef, Call, ReplyStream};
pub use binary::file_chunks_served;
pub use blobs::{shipped_file, shipped_files};
pub use cluster::{
    bundle, connect, connect_or_init, init, start_head, start_node, Cluster, HeadHandle,
    HeadOptions, NodeHandle, NodeOptions, ResourceGroup, SpawnOptions,
};
pub use error::{Error, Result};
pub use head::JOBS_PREFIX;
pub use inventory;
pub use objects::{ObjectRef, ObjectStats};
pub use protocol::{ActorAddress, Event, Resources, Strategy};
pub use shared_bytes::SharedBytes;
pub use wire::Wire;
pub use worker_group::{split_even, WorkerGroup};

/// If this process was started as a worker, host its actor and never return; otherwise return at once. Call it
/// first thing in `main` of every binary that spawns actors.
pub fn enter_worker_mode_if_spawned() {
    testbed::ensure_linked();
    worker::enter_worker_mode_if_spawned();
}
