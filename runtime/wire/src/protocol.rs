//! Every message type the runtime itself puts on the wire, as data: transport frames, the join handshake, and the
//! control messages handled by the head and node agents (which are actors like any other, in the runtime's control
//! layer). Nothing here does anything; the runtime's layers above give these types their behaviour.

use std::collections::BTreeMap;

use rkyv::{Archive, Deserialize, Serialize};

use crate::codec::{Message, StreamMessage};

/// How a call expects its answer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// No reply (`tell`).
    Tell,
    /// One reply (`call`).
    Call,
    /// Zero or more items, then an end marker (`stream`).
    Stream,
}

/// Kinds of failure a remote side reports.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteErrorKind {
    /// The target actor is not (or no longer) hosted where the call went.
    NoSuchActor,
    /// The actor has no handler for the message type.
    NoSuchHandler,
    /// The handler returned an error or panicked.
    Handler,
    /// The message could not be decoded.
    Decode,
    // Appended in wire version 3 (the earlier kinds keep their tags): typed failures of control messages,
    // which the caller turns back into the runtime's matching error.
    /// A resource request the cluster can never satisfy.
    Infeasible,
    /// A feasible resource request that found its resources held (until its timeout, for a group).
    Busy,
    /// An actor of the requested name already exists in its namespace.
    NameTaken,
}

/// A failure reported by the remote side of a call.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RemoteError {
    /// What went wrong.
    pub kind: RemoteErrorKind,
    /// A message naming the actor and message type.
    pub message: String,
}

// Enums with named-field variants live in private modules and are re-exported with their archived forms: rkyv's
// derive also emits a public `*Resolver` enum whose variant fields it leaves undocumented (rkyv 0.8), and keeping
// that enum unexported (nothing names it) satisfies `missing_docs` without an `allow`.
mod body {
    use super::*;

    /// Where the payload of a [`Frame`] is.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Body {
        /// Its `len` raw bytes follow the frame on the same stream.
        Inline(u64),
        /// It arrives on the bulk stream with this id (QUIC, for payloads over the transport's bulk threshold).
        Bulk(u64),
        /// It lies in the sender's shared-memory ring, which the receiver mapped after a [`Frame::ShmOffer`]
        /// (same-host bulk path).
        Shared {
            /// Position of the first byte in the ring: bytes the ring carried before it (its offset in the data area is
            /// this modulo the ring's size).
            offset: u64,
            /// Length in bytes.
            len: u64,
        },
    }
}
pub use body::{ArchivedBody, Body};

// In a private module like `body`, so that rkyv's resolver enum stays unexported.
mod frame {
    use super::*;

    /// A frame on a call stream. Inline payloads are not inside the frame: their raw bytes follow it on the stream
    /// (`Body::Inline`), or lie in the same-host ring or on a bulk stream; large arguments are neither re-serialised nor
    /// re-validated by the transport: the receiver copies them once
    /// into an aligned buffer and validates them when the handler decodes its message.
    #[derive(Archive, Serialize, Deserialize, Debug)]
    pub enum Frame {
        /// A request to an actor hosted by the receiving process.
        Call {
            /// Request id, unique per connection.
            req: u64,
            /// Target actor id.
            actor: u64,
            /// Message type name.
            msg: String,
            /// Reply expectation.
            kind: CallKind,
            /// Where the encoded message is.
            body: Body,
        },
        /// The single reply to a call.
        Reply {
            /// Request id.
            req: u64,
            /// Where the encoded reply is.
            body: Body,
        },
        /// One item of a streaming reply.
        Item {
            /// Request id.
            req: u64,
            /// Where the encoded item is.
            body: Body,
        },
        /// End of a streaming reply (or a failed call).
        End {
            /// Request id.
            req: u64,
            /// Set when the call failed.
            error: Option<RemoteError>,
        },
        /// The sender offers its shared-memory ring for the payloads it sends on this stream: a sealed memfd that the
        /// receiver opens as `/proc/<pid>/fd/<fd>` and recognises by `nonce` (same host, same user only).
        ShmOffer {
            /// Sender's process id.
            pid: u32,
            /// The memfd's descriptor number in the sender.
            fd: i32,
            /// Bytes in the ring's data area.
            capacity: u64,
            /// Random bytes written in the ring's header.
            nonce: Vec<u8>,
        },
        /// Answer to the peer's [`Frame::ShmOffer`]: whether its ring was mapped (else payloads stay on QUIC).
        ShmAnswer {
            /// The ring is mapped and verified.
            accepted: bool,
            /// Why not, when refused.
            reason: String,
        },
        /// The callee queued a tell beyond `actor`'s waiting line: the caller holds its further tells to that actor
        /// until the matching [`Frame::Resume`] (guarantee 3).
        Pause {
            /// The actor whose line is full.
            actor: u64,
            /// Counts the actor's pauses, so a resume that overtakes its pause is recognised.
            epoch: u64,
        },
        /// The actor's line has room again: tells held since pause `epoch` (or earlier) may go.
        Resume {
            /// The actor.
            actor: u64,
            /// The latest pause this resume ends.
            epoch: u64,
        },
        /// A caller's first frame on a new connection: asks for a same-host lane (see `transport::lane`).
        LaneAsk,
        /// The answer to [`Frame::LaneAsk`]: the callee's abstract Unix socket and the bytes that open it for this
        /// connection; an empty `name` offers nothing.
        LaneOffer {
            /// The callee's process id (checked against the socket's peer credentials).
            pid: u32,
            /// The abstract socket's name.
            name: String,
            /// Random bytes the caller sends first on the socket.
            nonce: Vec<u8>,
        },
    }
}
pub use frame::{ArchivedFrame, Frame};

impl Frame {
    /// Validates a received frame body (bytecheck, in place, no copy) and returns its archived form: what the
    /// transport runs on every frame it reads. `bytes` must be 16-byte aligned, as [`crate::codec::read_frame`]
    /// leaves them.
    pub fn access(bytes: &[u8]) -> Result<&ArchivedFrame, crate::codec::WireError> {
        rkyv::access::<ArchivedFrame, rkyv::rancor::Error>(bytes)
            .map_err(|e| crate::codec::WireError::Malformed(format!("frame: {e}")))
    }

    /// The payload placement of a frame that carries one.
    pub fn body_mut(&mut self) -> Option<&mut Body> {
        match self {
            Frame::Call { body, .. } | Frame::Reply { body, .. } | Frame::Item { body, .. } => {
                Some(body)
            }
            _ => None,
        }
    }
}

impl ArchivedBody {
    /// The placement as a native value.
    pub fn to_native(&self) -> Body {
        match self {
            ArchivedBody::Inline(len) => Body::Inline(len.to_native()),
            ArchivedBody::Bulk(id) => Body::Bulk(id.to_native()),
            ArchivedBody::Shared { offset, len } => Body::Shared {
                offset: offset.to_native(),
                len: len.to_native(),
            },
        }
    }
}

// In a private module like `body`, so that rkyv's resolver enum stays unexported.
mod join_msg {
    use super::*;

    /// Messages of the join handshake, on the first stream of a connection without a cluster certificate.
    ///
    /// Both sides prove they know the cluster token without sending it: `proof = sha256(token, label, nonce,
    /// sha256(head certificate))`, so a man in the middle (with another certificate) can neither learn nor relay it.
    #[derive(Archive, Serialize, Deserialize, Debug)]
    pub enum JoinMsg {
        /// Joiner → head: a fresh nonce.
        Hello {
            /// Joiner's nonce.
            nonce: Vec<u8>,
        },
        /// Head → joiner: the head's nonce and its proof over the joiner's nonce.
        Challenge {
            /// Head's nonce.
            nonce: Vec<u8>,
            /// Head's proof.
            proof: Vec<u8>,
        },
        /// Joiner → head: the joiner's proof over the head's nonce.
        Proof {
            /// Joiner's proof.
            proof: Vec<u8>,
        },
        /// Head → joiner: cluster credentials.
        Accepted {
            /// The cluster CA certificate (DER).
            ca_der: Vec<u8>,
            /// A certificate minted for the joiner (DER).
            cert_der: Vec<u8>,
            /// Its private key (PKCS#8 DER).
            key_der: Vec<u8>,
        },
        /// Head → joiner: refusal with the reason.
        Refused {
            /// Why.
            reason: String,
        },
    }
}
pub use join_msg::{ArchivedJoinMsg, JoinMsg};

/// A resource amount per name (`CPU`, `GPU`, `memory`, custom names).
pub type Resources = BTreeMap<String, f64>;

/// How the bundles of a resource group are spread over nodes.
#[derive(
    Archive,
    Serialize,
    Deserialize,
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
)]
pub enum Strategy {
    /// As few nodes as possible, but may use several.
    Pack,
    /// As many nodes as possible, but may share.
    Spread,
    /// All bundles on one node, or fail.
    StrictPack,
    /// Every bundle on a different node, or fail.
    StrictSpread,
    /// Consecutive blocks of this many bundles, each block on one node and every block on a different node, or
    /// fail: torchrun's `--nnodes M --nproc-per-node N` as `M·N` bundles in blocks of `N`.
    NodeBlocks(u32),
}

/// Where a new actor goes and how it runs.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default)]
pub struct SpawnSpec {
    /// Registered actor type name.
    pub type_name: String,
    /// Encoded constructor arguments.
    pub args: Vec<u8>,
    /// Resource group and bundle index, if any.
    pub bundle: Option<(u64, u32)>,
    /// Resources the actor reserves when not in a bundle.
    pub resources: Resources,
    /// Extra environment variables for the worker process.
    pub env: Vec<(String, String)>,
    /// Optional name, unique within `namespace`.
    pub name: Option<String>,
    /// Namespace for `name`.
    pub namespace: String,
    /// How many times the constructor is re-run after the worker dies.
    pub max_restarts: u32,
    /// How many messages may be handled at once (1 = strictly in order).
    pub max_concurrency: u32,
    /// Mailbox capacity (senders wait when it is full).
    pub mailbox: u32,
    /// Survive the driver that created it.
    pub detached: bool,
    /// The driver that spawned it ([`DriverAdmitted::id`]), 0 for none (the head's own process, or a worker): a
    /// non-detached actor dies with its driver.
    pub owner: u64,
    /// The binary workers run.
    pub binary: BinarySpec,
    /// Files the node fetches (by sha256, cached) before starting the worker (`SpawnOptions::ship_file` in the runtime).
    pub files: Vec<ShippedFile>,
}

/// One file a spawn ships to the actor's node.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct ShippedFile {
    /// The name the actor looks the file up by.
    pub name: String,
    /// The file's path on the driver.
    pub driver_path: String,
    /// The driver-side file name (its extension is kept in the cache).
    pub file_name: String,
    /// sha256 (hex) of the bytes.
    pub sha256: String,
    /// Size in bytes.
    pub size: u64,
    /// Address of the driver process that serves it.
    pub server: String,
}

/// The driver's binary, found locally by path (same size and mtime) or fetched from the driver by content hash.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default)]
pub struct BinarySpec {
    /// Absolute path on the driver's machine.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time (ns since the epoch).
    pub mtime_ns: u64,
    /// Address of the driver process that serves the binary.
    pub server: String,
}

/// Where an actor lives; enough to call it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ActorAddress {
    /// Cluster-unique actor id.
    pub id: u64,
    /// Actor type name.
    pub type_name: String,
    /// Address of the hosting process.
    pub addr: String,
    /// Node name (e.g. `node-2`).
    pub node: String,
}

// In a private module like `body`, so that rkyv's resolver enum stays unexported.
mod event {
    use super::*;

    /// Something that happened in the cluster; drivers subscribe with `Cluster::events`.
    #[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
    pub enum Event {
        /// A node joined.
        NodeJoined {
            /// Node name.
            node: String,
        },
        /// A node missed heartbeats beyond the bound (or left).
        NodeDied {
            /// Node name.
            node: String,
            /// Why.
            reason: String,
        },
        /// An actor's worker died and the actor will be restarted.
        ActorRestarting {
            /// Actor id.
            id: u64,
            /// Node name.
            node: String,
            /// Why.
            reason: String,
            /// Restart attempt (1-based).
            attempt: u32,
        },
        /// An actor is running again at a new address.
        ActorRestarted {
            /// New address.
            actor: ActorAddress,
        },
        /// An actor is gone for good.
        ActorDied {
            /// Actor id.
            id: u64,
            /// Actor type name.
            type_name: String,
            /// Node name.
            node: String,
            /// Why.
            reason: String,
        },
    }
}
pub use event::{ArchivedEvent, Event};

macro_rules! control {
    ($($(#[$m:meta])* $name:ident => $reply:ty),* $(,)?) => {$(
        $(#[$m])*
        impl Message for $name {
            type Reply = $reply;
            const NAME: &'static str = concat!("ferl.", stringify!($name));
        }
    )*};
}

/// Node agent → head: join the cluster.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct RegisterNode {
    /// Address of the node agent.
    pub addr: String,
    /// Reachable IP of the node.
    pub ip: String,
    /// Declared resources.
    pub resources: Resources,
    /// Folder holding worker logs.
    pub log_dir: String,
}
/// Head → node agent: the answer to [`RegisterNode`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct NodeAdmitted {
    /// The node's name in the cluster (`node-N`).
    pub name: String,
    /// How often the node must send [`Heartbeat`]s: the head's bound sets it, whatever the node was started with.
    pub heartbeat_interval_ms: u64,
}
/// Node agent → head: still alive.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Heartbeat {
    /// Node name.
    pub node: String,
}
/// Driver → head: a driver joins. It beats with [`DriverHeartbeat`]; when it stops (killed, disconnected, stalled past
/// the bound) or says [`DriverExit`], the head frees its non-detached actors and its resource groups.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct RegisterDriver {
    /// The driver's process id.
    pub pid: u32,
    /// The driver's host name.
    pub host: String,
    /// The driver's command line (for `ferl status`).
    pub command: String,
}
/// Head → driver: the answer to [`RegisterDriver`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct DriverAdmitted {
    /// The driver's id in the cluster (never 0).
    pub id: u64,
    /// How often the driver must send [`DriverHeartbeat`]s (the head's bound / 4).
    pub heartbeat_interval_ms: u64,
}
/// Driver → head: still alive; `false` when the head already declared it lost.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct DriverHeartbeat {
    /// The driver's id.
    pub id: u64,
}
/// Driver → head: the driver is leaving; free what it still owns now.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct DriverExit {
    /// The driver's id.
    pub id: u64,
}
/// Create a resource group.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct CreateGroup {
    /// Bundles.
    pub bundles: Vec<Resources>,
    /// Strategy.
    pub strategy: Strategy,
    /// How long to wait for busy resources (ms).
    pub timeout_ms: u64,
    /// The driver that owns it ([`DriverAdmitted::id`]), 0 for none: the group is removed when its driver is lost.
    pub owner: u64,
}
/// Remove a resource group, stopping its actors.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct RemoveGroup {
    /// Group id.
    pub group: u64,
}
/// Placement of a created group: node of each bundle.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct GroupPlaced {
    /// Group id.
    pub group: u64,
    /// Node name per bundle.
    pub nodes: Vec<String>,
}
/// Spawn an actor (driver → head).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct SpawnActor {
    /// What to spawn.
    pub spec: SpawnSpec,
}
/// Stop an actor.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct KillActor {
    /// Actor id.
    pub id: u64,
}
/// Look an actor up by name.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct LookupActor {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}
/// Current address of an actor id (waits while it restarts).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ResolveActor {
    /// Actor id.
    pub id: u64,
}
/// Store a value.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct KvPut {
    /// Key.
    pub key: String,
    /// Value.
    pub value: Vec<u8>,
}
/// Read a value.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct KvGet {
    /// Key.
    pub key: String,
}
/// Wait until a key exists (up to a timeout), then read it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct KvWait {
    /// Key.
    pub key: String,
    /// Timeout (ms).
    pub timeout_ms: u64,
}
/// Subscribe to cluster events (a streaming message).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Subscribe;
/// Cluster state as JSON (what `ferl status --json` prints).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Status;
/// Node agent → head: a worker process exited.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct WorkerExited {
    /// Actor id it hosted.
    pub id: u64,
    /// Exit description.
    pub reason: String,
}
/// Ask the head to shut the cluster down (`ferl stop`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Shutdown;

/// Where a job submitted to the head ([`SubmitJob`]) stands.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    /// Its driver process runs.
    Running,
    /// Its driver exited with status 0.
    Succeeded,
    /// Its driver exited with this non-zero status.
    Failed(i32),
    /// Its driver was killed by this signal, not on request (or, with 0, could not be waited for).
    Killed(i32),
    /// Stopped on request ([`StopJob`]).
    Stopped,
}

impl JobState {
    /// Whether the driver has ended.
    pub fn is_terminal(&self) -> bool {
        *self != JobState::Running
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobState::Running => f.write_str("RUNNING"),
            JobState::Succeeded => f.write_str("SUCCEEDED"),
            JobState::Failed(code) => write!(f, "FAILED (exit code {code})"),
            JobState::Killed(sig) => write!(f, "FAILED (signal {sig})"),
            JobState::Stopped => f.write_str("STOPPED"),
        }
    }
}

/// A job the head runs: its driver process on the head's host.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct JobInfo {
    /// `job-N`.
    pub id: String,
    /// The driver's command line.
    pub command: Vec<String>,
    /// Its working directory on the head's host.
    pub working_dir: String,
    /// Its log file (stdout and stderr) on the head's host.
    pub log_file: String,
    /// Its process id (and process group) on the head's host.
    pub pid: u32,
    /// Where it stands.
    pub state: JobState,
    /// When it started (ms since the Unix epoch).
    pub start_unix_ms: u64,
    /// When it ended (ms since the Unix epoch).
    pub end_unix_ms: Option<u64>,
}
/// Start a job (`ferl job submit`): the head runs `command` detached on its own host, in its own process group, with
/// `FERL_ADDRESS` and `FERL_TOKEN` naming this cluster, output to a log in the head's session `logs/`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct SubmitJob {
    /// Program and arguments.
    pub command: Vec<String>,
    /// Working directory on the head's host (default: the head's own).
    pub working_dir: Option<String>,
}
/// Where a job stands (`ferl job status`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct JobStatus {
    /// `job-N`.
    pub id: String,
}
/// A piece of a job's log from a byte offset (`ferl job logs`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct JobLogs {
    /// `job-N`.
    pub id: String,
    /// Where to read from.
    pub offset: u64,
}
/// A piece of a log file: the answer to [`JobLogs`] and [`ReadLog`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LogChunk {
    /// Bytes from the offset (at most 1 MiB).
    pub data: Vec<u8>,
    /// The offset to ask from next.
    pub next_offset: u64,
    /// Its writer has ended (a job's driver, a worker process) and nothing is left after `next_offset`.
    pub finished: bool,
}
/// Stop a job (`ferl job stop`): SIGTERM to its process group, SIGKILL after `grace_ms`; answers once it is gone.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct StopJob {
    /// `job-N`.
    pub id: String,
    /// How long it has to exit after SIGTERM (ms).
    pub grace_ms: u64,
}
/// Every job the head ran or runs (`ferl job list`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ListJobs;
/// → node agent: the files in its logs folder, with their sizes in bytes (`ferl logs --node`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ListLogs;
/// → node agent: a piece of one file of its logs folder from a byte offset (`ferl logs`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ReadLog {
    /// The file's name in the node's logs folder (a plain name, as [`ListLogs`] gives it).
    pub file: String,
    /// Where to read from.
    pub offset: u64,
}

/// Head → node agent: start a worker hosting one actor.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct StartWorker {
    /// Actor id.
    pub id: u64,
    /// What to run.
    pub spec: SpawnSpec,
    /// Environment computed by the head (ranks, devices, rendezvous).
    pub env: Vec<(String, String)>,
}
/// Head → node agent: kill a worker.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct StopWorker {
    /// Actor id.
    pub id: u64,
}
/// Head → node agent: a free TCP port on that node (for `MASTER_PORT`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct FreePort;
/// Worker → node agent: ready to host the actor; returns what to construct.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct WorkerHello {
    /// Actor id.
    pub id: u64,
    /// The worker's listen address.
    pub addr: String,
}
/// Worker → node agent: construction finished (`error` set when the constructor failed).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct WorkerReady {
    /// Actor id.
    pub id: u64,
    /// Constructor error, if any.
    pub error: Option<String>,
}
/// Node agent → driver: the sha256 (hex) of the binary workers run.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct BinaryDigest;
/// Node agent → driver: send me your binary.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct FetchBinary;
/// The driver's binary and its sha256 (hex).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct BinaryBlob {
    /// sha256 of `bytes`, hex.
    pub sha256: String,
    /// The file.
    pub bytes: Vec<u8>,
}

control! {
    RegisterNode => NodeAdmitted,
    Heartbeat => bool,
    RegisterDriver => DriverAdmitted,
    DriverHeartbeat => bool,
    DriverExit => (),
    CreateGroup => GroupPlaced,
    RemoveGroup => (),
    SpawnActor => ActorAddress,
    KillActor => (),
    LookupActor => Option<ActorAddress>,
    ResolveActor => ActorAddress,
    KvPut => (),
    KvGet => Option<Vec<u8>>,
    KvWait => Vec<u8>,
    Status => String,
    SubmitJob => JobInfo,
    JobStatus => JobInfo,
    JobLogs => LogChunk,
    StopJob => JobInfo,
    ListJobs => Vec<JobInfo>,
    WorkerExited => (),
    Shutdown => (),
    StartWorker => (String, u32),
    StopWorker => (),
    FreePort => u16,
    ListLogs => Vec<(String, u64)>,
    ReadLog => LogChunk,
    WorkerHello => SpawnSpec,
    WorkerReady => (),
    BinaryDigest => String,
    FetchBinary => BinaryBlob,
}

impl StreamMessage for Subscribe {
    type Item = Event;
    const NAME: &'static str = "ferl.Subscribe";
}
