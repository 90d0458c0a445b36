//! The object store: [`Cluster::put`](crate::Cluster::put) keeps bytes in this process and returns an
//! [`ObjectRef`], a small handle that travels inside messages; any actor reads the bytes with
//! [`Cluster::get`](crate::Cluster::get). A driver passes one large batch to many actors without sending it through
//! itself once per actor (Ray's object store, for the single-controller case).
//!
//! Invariants (guarantee 16 in `runtime/README.md`; tests name them):
//! 1. **Once per node.** A `get` in a worker asks its node agent, which fetches the bytes from the owner once (on the
//!    bulk path) and keeps them in its process-level cache; concurrent gets on one node share that one fetch, and a
//!    worker receives its copy from its node agent on the same-host path. A `get` in the owner's process reads the
//!    owner's copy; one in a process without a node agent (a connected driver) fetches from the owner, uncached.
//! 2. **The owner's handles govern the lifetime.** `put` returns the owner's handle; its clones in the owner process
//!    share it. When the last of them drops, the owner frees the bytes and tells every node that fetched them to drop
//!    its cached copy. Handles decoded from a message (anywhere, the owner's process included) borrow: they read
//!    while the owner still holds a handle, and a `get` after the free fails naming the object and its owner. Bytes a
//!    `get` returned stay valid as long as the caller holds them. Drop the last handle inside a tokio runtime: outside
//!    one the owner frees its copy but cannot tell the nodes.
//! 3. **Same host, no copy.** An object put from an [`ObjectBuffer`] ([`Cluster::object_buffer`](crate::Cluster::object_buffer),
//!    [`Cluster::put_buffer`](crate::Cluster::put_buffer)) lives in a sealed shared-memory blob (`ferl_shm::Blob`):
//!    a `get` in any process of the owner's host (same boot id) maps the owner's pages read-only instead of receiving
//!    a copy, with no node agent in between. The blob is sealed against writes, so every reader sees the bytes the
//!    owner put. When the owner frees the object it closes the blob's descriptor: later opens fail (and fall back
//!    to the owner, which refuses as in 2), while mappings already made stay valid. A process on another host, or
//!    one that cannot open the blob, reads as in 1.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use anyhow::{bail, Result as AnyResult};
use rkyv::{Archive, Deserialize, Serialize};
use tokio::sync::OnceCell;

use ferl_shm::{Blob, BlobOffer, BlobWriter};

use crate::actor::process::{Process, OBJECT_ACTOR};
use crate::actor::{Actor, Context, Handler};
use crate::codec::SharedBytes;
use crate::transport::bulk::MAX_BULK;
use crate::transport::error::{Error, Result};

/// A handle on bytes put into the cluster's object store with [`Cluster::put`](crate::Cluster::put); read them
/// anywhere with [`Cluster::get`](crate::Cluster::get) (fetched once per node). Cheap to clone; on the wire it is
/// its id, size and owner.
///
/// **Lifetime rule: the owner's handles govern.** The handle `put` returns and its clones in the owner process keep
/// the object alive; when the last of them drops, the owner frees the bytes and every node drops its cached copy. A
/// handle decoded from a message (in any process, the owner's included) only borrows: keep an owner handle until
/// the actors that read the object are done, or their `get` fails naming the object and its owner.
#[derive(Archive, Serialize, Deserialize, Clone)]
pub struct ObjectRef {
    id: u64,
    size: u64,
    owner: String,
    owner_node: String,
    /// Where a process of the owner's host maps the object (objects put from an [`ObjectBuffer`]).
    shared: Option<SharedLocation>,
    #[rkyv(with = rkyv::with::Skip)]
    lease: Option<Arc<Lease>>,
}

/// Where an object in shared memory can be mapped: the owner's host (its boot id) and the blob's offer.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
struct SharedLocation {
    host: String,
    pid: u32,
    fd: i32,
    nonce: [u8; ferl_shm::NONCE_LEN],
}

impl std::fmt::Debug for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "object {:#x} ({} bytes, owned by {} on {})",
            self.id, self.size, self.owner, self.owner_node
        )
    }
}

impl ObjectRef {
    /// The object's id (unique per owner).
    pub fn id(&self) -> u64 {
        self.id
    }
    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
    /// The address of the process that owns it.
    pub fn owner(&self) -> &str {
        &self.owner
    }
    /// The node of the owner (`driver` for a process without a node agent).
    pub fn owner_node(&self) -> &str {
        &self.owner_node
    }
    /// Whether this handle is one of the owner's (it keeps the object alive) rather than a borrowed copy.
    pub fn is_owner_handle(&self) -> bool {
        self.lease.is_some()
    }
}

/// What one process holds in its object store (for tests and `ferl status`-like tools).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjectStats {
    /// Objects this process owns.
    pub owned: u64,
    /// Their bytes.
    pub owned_bytes: u64,
    /// Objects of other owners cached here (node agents only).
    pub cached: u64,
    /// Their bytes.
    pub cached_bytes: u64,
    /// Fetches from owners into this node's cache, over the process's life.
    pub fetched: u64,
    /// Objects this owner sent to each node (by node name), over the process's life.
    pub served: BTreeMap<String, u64>,
    /// Objects of a same-host owner this process mapped from shared memory (no copy), over its life.
    pub mapped: u64,
}

/// The owner's side of an object's lifetime: dropped with the owner's last handle.
struct Lease {
    id: u64,
    process: Weak<Process>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(process) = self.process.upgrade() {
            free(&process, self.id);
        }
    }
}

struct Owned {
    bytes: SharedBytes,
    /// The shared-memory blob holding `bytes`, when put from an [`ObjectBuffer`] (its descriptor closes on free).
    blob: Option<Arc<Blob>>,
    /// Addresses of the node agents that fetched it (told to drop their copy when it is freed).
    holders: BTreeSet<String>,
}

/// A node's copy of an object (owner address, id), filled by the first of concurrent gets.
type Cached = Arc<OnceCell<SharedBytes>>;

/// One process's objects: those it owns and, in a node agent, those it cached for its workers.
#[derive(Default)]
pub(crate) struct ObjectStore {
    owned: Mutex<HashMap<u64, Owned>>,
    cached: Mutex<HashMap<(String, u64), Cached>>,
    served: Mutex<BTreeMap<String, u64>>,
    fetched: AtomicU64,
    mapped: AtomicU64,
    hosted: std::sync::OnceLock<()>,
}

/// Owner → node: the bytes of object `id`; the node at `node_addr` (empty: a process that caches nothing) will be
/// told when it is freed.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub(crate) struct FetchObject {
    id: u64,
    node: String,
    node_addr: String,
}
/// Worker → its node agent: the bytes of an object, fetched once per node.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub(crate) struct GetObject(ObjectRef);
/// Owner → node agent: drop the cached copy of object `id` of `owner`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub(crate) struct DropObject {
    owner: String,
    id: u64,
}
/// This process's [`ObjectStats`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub(crate) struct QueryObjects;

pinned_message! {
    "ferl_runtime::objects";
    FetchObject => SharedBytes;
    GetObject => SharedBytes;
    DropObject => ();
    QueryObjects => ObjectStats;
}

/// A buffer to fill, then put with [`Cluster::put_buffer`](crate::Cluster::put_buffer) without a copy: in shared
/// memory where the host allows it, so that processes on the owner's host map the object (invariant 3) instead of
/// receiving a copy. Made by [`Cluster::object_buffer`](crate::Cluster::object_buffer), zeroed.
pub struct ObjectBuffer(Buffer);

enum Buffer {
    Shared(BlobWriter),
    Heap(Vec<u8>),
}

impl ObjectBuffer {
    /// Whether the buffer is in shared memory (same-host readers will map it).
    pub fn is_shared(&self) -> bool {
        matches!(self.0, Buffer::Shared(_))
    }
}

impl std::ops::Deref for ObjectBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            Buffer::Shared(w) => w.data(),
            Buffer::Heap(v) => v,
        }
    }
}

impl std::ops::DerefMut for ObjectBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Buffer::Shared(w) => w.data_mut(),
            Buffer::Heap(v) => v,
        }
    }
}

/// A shared-memory blob as the owner of a [`bytes::Bytes`].
struct BlobBytes(Arc<Blob>);

impl AsRef<[u8]> for BlobBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.data()
    }
}

/// This host's boot id (the same for every process of one running kernel), read once; `None` where unreadable.
fn host_id() -> Option<&'static str> {
    static ID: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    })
    .as_deref()
}

/// Where same-host readers map `blob`.
fn location(blob: &Blob) -> Option<SharedLocation> {
    let offer = blob.offer()?;
    Some(SharedLocation {
        host: host_id()?.to_string(),
        pid: offer.pid,
        fd: offer.fd,
        nonce: offer.nonce,
    })
}

/// The bytes of `obj` mapped from its owner's shared memory, when it is there and on this host (invariant 3);
/// `None` sends the caller down the copying path.
fn map_shared(process: &Process, obj: &ObjectRef) -> Option<SharedBytes> {
    let at = obj.shared.as_ref()?;
    if host_id() != Some(at.host.as_str()) {
        return None;
    }
    let offer = BlobOffer {
        pid: at.pid,
        fd: at.fd,
        len: obj.size,
        nonce: at.nonce,
    };
    match Blob::open(&offer) {
        Ok(blob) => {
            store_of(process).mapped.fetch_add(1, Ordering::Relaxed);
            Some(bytes::Bytes::from_owner(BlobBytes(Arc::new(blob))).into())
        }
        Err(e) => {
            tracing::debug!(object = obj.id, "mapping {obj:?} from shared memory: {e}");
            None
        }
    }
}

/// The object service every owner and node agent hosts at [`OBJECT_ACTOR`].
pub(crate) struct ObjectService;

impl Actor for ObjectService {
    type Args = ();
    const NAME: &'static str = "ferl.ObjectService";
    async fn start(_: (), _: &Context) -> AnyResult<Self> {
        bail!("the object service is started by its process, not spawned")
    }
}

crate::actor_dispatch!(ObjectService, calls: [FetchObject, GetObject, DropObject, QueryObjects]);

/// This process's object store, kept by the process for this layer (made on first use).
fn store_of(process: &Process) -> &ObjectStore {
    process.upper_state::<ObjectStore>()
}

/// Hosts the object service in `process` (once).
pub(crate) fn host_service(process: &Arc<Process>) {
    store_of(process)
        .hosted
        .get_or_init(|| process.host(OBJECT_ACTOR, ObjectService, 256, 4096));
}

/// Keeps `bytes` in `process` and returns the owner's handle.
pub(crate) fn put(process: &Arc<Process>, bytes: SharedBytes) -> Result<ObjectRef> {
    keep(process, bytes, None)
}

/// A buffer of `len` zero bytes to fill and put with [`put_buffer`]: a shared-memory blob when this host allows it,
/// else (no boot id, no shared memory left) plain memory.
pub(crate) fn buffer(len: usize) -> ObjectBuffer {
    if host_id().is_some() {
        match BlobWriter::create(len) {
            Ok(writer) => return ObjectBuffer(Buffer::Shared(writer)),
            Err(e) => tracing::debug!("an object buffer of {len} bytes in plain memory: {e}"),
        }
    }
    ObjectBuffer(Buffer::Heap(vec![0; len]))
}

/// Keeps the filled `buffer` in `process` (shared with same-host readers when it is in shared memory) and returns
/// the owner's handle.
pub(crate) fn put_buffer(process: &Arc<Process>, buffer: ObjectBuffer) -> Result<ObjectRef> {
    match buffer.0 {
        Buffer::Heap(v) => keep(process, v.into(), None),
        Buffer::Shared(writer) => {
            let blob = Arc::new(writer.finish().map_err(|e| {
                Error::Cluster(format!("sealing an object's shared-memory blob: {e}"))
            })?);
            let bytes = SharedBytes::from(bytes::Bytes::from_owner(BlobBytes(blob.clone())));
            keep(process, bytes, Some(blob))
        }
    }
}

/// Stores `bytes` (held by `blob` when it is shared) under a new id and returns the owner's handle.
fn keep(process: &Arc<Process>, bytes: SharedBytes, blob: Option<Arc<Blob>>) -> Result<ObjectRef> {
    if bytes.len() as u64 > MAX_BULK {
        return Err(Error::Cluster(format!(
            "cannot put {} bytes: an object holds at most {MAX_BULK} bytes",
            bytes.len()
        )));
    }
    host_service(process);
    let id = rand::random::<u64>();
    let size = bytes.len() as u64;
    let shared = blob.as_ref().and_then(|b| location(b));
    let owned = Owned {
        bytes,
        blob,
        holders: BTreeSet::new(),
    };
    lock(&store_of(process).owned).insert(id, owned);
    Ok(ObjectRef {
        id,
        size,
        owner: process.addr.to_string(),
        owner_node: process
            .node
            .get()
            .map_or_else(|| "driver".to_string(), |(_, name)| name.clone()),
        shared,
        lease: Some(Arc::new(Lease {
            id,
            process: Arc::downgrade(process),
        })),
    })
}

/// The bytes of `obj`, read as invariant 1 says.
pub(crate) async fn get(process: &Arc<Process>, obj: &ObjectRef) -> Result<SharedBytes> {
    read(process, obj).await.map_err(|e| match e {
        Error::Cluster(m) => Error::Cluster(format!("getting {obj:?}: {m}")),
        Error::Remote { message, .. } => Error::Cluster(format!("getting {obj:?}: {message}")),
        other => Error::Cluster(format!("getting {obj:?}: {other}")),
    })
}

/// The bytes of `obj`: the owner's copy here, else through this node's cache (invariant 1).
async fn read(process: &Arc<Process>, obj: &ObjectRef) -> Result<SharedBytes> {
    if obj.owner == process.addr.to_string() {
        return owned_copy(process, obj.id).map_err(Error::Cluster);
    }
    // Mapping populates every page (2 GB for a 0.5B model's weights): off the async workers.
    let (owner, wanted) = (Arc::clone(process), obj.clone());
    let mapped = tokio::task::spawn_blocking(move || map_shared(&owner, &wanted)).await;
    if let Ok(Some(bytes)) = mapped {
        return Ok(bytes);
    }
    match process.node.get() {
        Some((addr, _)) if *addr == process.addr => node_get(process, obj).await,
        Some((addr, _)) => {
            process
                .call_at(*addr, OBJECT_ACTOR, &GetObject(obj.clone()))
                .await
        }
        None => fetch(process, obj, &format!("process {}", process.addr), "").await,
    }
}

/// This process's stats.
pub(crate) fn stats(process: &Process) -> ObjectStats {
    let store = &store_of(process);
    let (owned, owned_bytes) = {
        let owned = lock(&store.owned);
        let bytes = owned.values().map(|o| o.bytes.len() as u64).sum();
        (owned.len() as u64, bytes)
    };
    let (cached, cached_bytes) = {
        let cached = lock(&store.cached);
        let filled: Vec<u64> = cached
            .values()
            .filter_map(|c| c.get().map(|b| b.len() as u64))
            .collect();
        (filled.len() as u64, filled.iter().sum())
    };
    ObjectStats {
        owned,
        owned_bytes,
        cached,
        cached_bytes,
        fetched: store.fetched.load(Ordering::Relaxed),
        served: lock(&store.served).clone(),
        mapped: store.mapped.load(Ordering::Relaxed),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().expect("object store lock")
}

fn owned_copy(process: &Process, id: u64) -> Result<SharedBytes, String> {
    lock(&store_of(process).owned)
        .get(&id)
        .map(|o| o.bytes.clone())
        .ok_or_else(|| freed(process, id))
}

fn freed(process: &Process, id: u64) -> String {
    format!(
        "object {id:#x} is not held by its owner at {}: the owner's last ObjectRef was dropped (a handle decoded \
         from a message does not keep an object alive)",
        process.addr
    )
}

/// In a node agent: the cached copy of `obj`, fetched from its owner by the first of concurrent callers.
async fn node_get(process: &Arc<Process>, obj: &ObjectRef) -> Result<SharedBytes> {
    let key = (obj.owner.clone(), obj.id);
    let cell = lock(&store_of(process).cached)
        .entry(key.clone())
        .or_default()
        .clone();
    let (addr, node) = process.node.get().cloned().expect("a node agent");
    let addr = addr.to_string();
    let got = cell
        .get_or_try_init(|| fetch(process, obj, &node, &addr))
        .await
        .cloned();
    if got.is_err() {
        let mut cached = lock(&store_of(process).cached);
        if cached.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
            cached.remove(&key);
        }
    }
    got
}

/// Fetches `obj` from its owner for the node `node` (whose agent at `node_addr` caches it).
async fn fetch(
    process: &Arc<Process>,
    obj: &ObjectRef,
    node: &str,
    node_addr: &str,
) -> Result<SharedBytes> {
    let owner = obj.owner.parse().map_err(|_| {
        Error::Cluster(format!("{obj:?} names a bad owner address `{}`", obj.owner))
    })?;
    let request = FetchObject {
        id: obj.id,
        node: node.into(),
        node_addr: node_addr.into(),
    };
    let bytes = process.call_at(owner, OBJECT_ACTOR, &request).await?;
    if bytes.len() as u64 != obj.size {
        return Err(Error::Cluster(format!(
            "the owner sent {} bytes, the handle says {}",
            bytes.len(),
            obj.size
        )));
    }
    if !node_addr.is_empty() {
        store_of(process).fetched.fetch_add(1, Ordering::Relaxed);
    }
    Ok(bytes)
}

/// The owner's last handle dropped: free the bytes and tell the nodes that fetched them.
fn free(process: &Arc<Process>, id: u64) {
    let Some(owned) = lock(&store_of(process).owned).remove(&id) else {
        return;
    };
    if let Some(blob) = &owned.blob {
        blob.close_fd();
    }
    let holders: Vec<std::net::SocketAddr> = owned
        .holders
        .iter()
        .filter_map(|h| h.parse().ok())
        .collect();
    drop(owned);
    if holders.is_empty() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(
            object = id,
            "the last handle of an object dropped outside a tokio runtime: nodes keep their copies"
        );
        return;
    };
    let process = process.clone();
    runtime.spawn(async move {
        let owner = process.addr.to_string();
        let drops = holders.iter().map(|addr| {
            let msg = DropObject {
                owner: owner.clone(),
                id,
            };
            let process = process.clone();
            async move {
                if let Err(e) = process.call_at(*addr, OBJECT_ACTOR, &msg).await {
                    tracing::debug!(object = id, node = %addr, "telling a node to drop an object: {e}");
                }
            }
        });
        futures::future::join_all(drops).await;
    });
}

impl Handler<FetchObject> for ObjectService {
    async fn handle(&self, m: FetchObject, ctx: &Context) -> AnyResult<SharedBytes> {
        let store = &store_of(&ctx.process);
        let bytes = {
            let mut owned = lock(&store.owned);
            let Some(o) = owned.get_mut(&m.id) else {
                bail!("{}", freed(&ctx.process, m.id));
            };
            if !m.node_addr.is_empty() {
                o.holders.insert(m.node_addr);
            }
            o.bytes.clone()
        };
        *lock(&store.served).entry(m.node).or_default() += 1;
        Ok(bytes)
    }
}

impl Handler<GetObject> for ObjectService {
    async fn handle(&self, m: GetObject, ctx: &Context) -> AnyResult<SharedBytes> {
        if ctx
            .process
            .node
            .get()
            .is_none_or(|(a, _)| *a != ctx.process.addr)
        {
            bail!("process {} is not a node agent", ctx.process.addr);
        }
        Ok(read(&ctx.process, &m.0).await?)
    }
}

impl Handler<DropObject> for ObjectService {
    async fn handle(&self, m: DropObject, ctx: &Context) -> AnyResult<()> {
        lock(&store_of(&ctx.process).cached).remove(&(m.owner, m.id));
        Ok(())
    }
}

impl Handler<QueryObjects> for ObjectService {
    async fn handle(&self, _: QueryObjects, ctx: &Context) -> AnyResult<ObjectStats> {
        Ok(stats(&ctx.process))
    }
}
