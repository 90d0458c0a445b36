//! Small actors used by the runtime's tests, its example and `ferl-bench runtime`. They are part of the library so
//! that any binary linking the runtime can host them in worker mode.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Result};
use rkyv::{Archive, Deserialize, Serialize};

use crate::actor::{Actor, Context, Handler, ItemSink, StreamHandler};
use crate::codec::SharedBytes;
use crate::control::objects::{ObjectRef, ObjectStats};

/// A counter: adds, reports, records the order of tagged messages, and can crash or sleep on request.
pub struct Counter {
    total: AtomicU64,
    seen: Mutex<Vec<(u32, u64)>>,
}

/// Add to the counter; replies with the new total.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Add(pub u64);
/// Read the counter.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Get;
/// Record `(sender, seq)`; replies nothing (sent with `tell` in ordering tests).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Record {
    /// Sender id.
    pub sender: u32,
    /// Sequence number within the sender.
    pub seq: u64,
}
/// Everything recorded so far, in handling order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Recorded;
/// Sleep, then reply (tests of concurrency and back-pressure).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Sleep(pub u64);
/// Echo bytes back (1 MiB argument and transfer benchmarks).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Echo(pub Vec<u8>);
/// Receive bytes, reply with their length (transfer benchmark).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Sink(pub Vec<u8>);
/// Receive a shared buffer; replies with its length and whether decoding shared the received message buffer
/// (zero-copy) rather than copying it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct SinkShared(pub SharedBytes);
/// Echo a shared buffer back.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct EchoShared(pub SharedBytes);
/// Report the worker's environment variable (ranks, devices).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct GetEnv(pub String);
/// Report the worker's pid.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Pid;
/// Fail with an error message.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Fail(pub String);
/// Read an object from the store; replies with its length and sha256 (hex).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ObjectDigest(pub ObjectRef);
/// This worker process's object-store stats.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct LocalObjectStats;
/// Stream the numbers `0..n`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct CountTo(pub u64);

crate::message! {
    Add => u64;
    Get => u64;
    Record => ();
    Recorded => Vec<(u32, u64)>;
    Sleep => u64;
    Echo => Vec<u8>;
    Sink => u64;
    SinkShared => (u64, bool);
    EchoShared => SharedBytes;
    GetEnv => Option<String>;
    Pid => u32;
    Fail => ();
    ObjectDigest => (u64, String);
    LocalObjectStats => ObjectStats;
}
crate::stream_message!(CountTo => u64);

impl Actor for Counter {
    type Args = u64;
    async fn start(start: u64, _: &Context) -> Result<Self> {
        if start == u64::MAX {
            bail!("refusing to start at u64::MAX (constructor failure test)");
        }
        Ok(Self {
            total: AtomicU64::new(start),
            seen: Mutex::new(Vec::new()),
        })
    }
}

impl Counter {
    /// A counter built without a cluster (for in-process actors).
    pub fn starting_at(start: u64) -> Self {
        Self {
            total: AtomicU64::new(start),
            seen: Mutex::new(Vec::new()),
        }
    }
}

crate::register_actor!(Counter, calls: [Add, Get, Record, Recorded, Sleep, Echo, Sink, SinkShared, EchoShared, GetEnv, Pid, Fail,
    ObjectDigest, LocalObjectStats],
    streams: [CountTo]);

impl Handler<Add> for Counter {
    async fn handle(&self, m: Add, _: &Context) -> Result<u64> {
        Ok(self.total.fetch_add(m.0, Ordering::SeqCst) + m.0)
    }
}
impl Handler<Get> for Counter {
    async fn handle(&self, _: Get, _: &Context) -> Result<u64> {
        Ok(self.total.load(Ordering::SeqCst))
    }
}
impl Handler<Record> for Counter {
    async fn handle(&self, m: Record, _: &Context) -> Result<()> {
        self.seen.lock().expect("seen lock").push((m.sender, m.seq));
        Ok(())
    }
}
impl Handler<Recorded> for Counter {
    async fn handle(&self, _: Recorded, _: &Context) -> Result<Vec<(u32, u64)>> {
        Ok(self.seen.lock().expect("seen lock").clone())
    }
}
impl Handler<Sleep> for Counter {
    async fn handle(&self, m: Sleep, _: &Context) -> Result<u64> {
        tokio::time::sleep(Duration::from_millis(m.0)).await;
        Ok(m.0)
    }
}
impl Handler<Echo> for Counter {
    async fn handle(&self, m: Echo, _: &Context) -> Result<Vec<u8>> {
        Ok(m.0)
    }
}
impl Handler<Sink> for Counter {
    async fn handle(&self, m: Sink, _: &Context) -> Result<u64> {
        Ok(m.0.len() as u64)
    }
}
impl Handler<SinkShared> for Counter {
    async fn handle(&self, m: SinkShared, _: &Context) -> Result<(u64, bool)> {
        Ok((m.0.len() as u64, m.0.is_shared_with_message()))
    }
}
impl Handler<EchoShared> for Counter {
    async fn handle(&self, m: EchoShared, _: &Context) -> Result<SharedBytes> {
        Ok(m.0)
    }
}
impl Handler<GetEnv> for Counter {
    async fn handle(&self, m: GetEnv, _: &Context) -> Result<Option<String>> {
        Ok(std::env::var(&m.0).ok())
    }
}
impl Handler<Pid> for Counter {
    async fn handle(&self, _: Pid, _: &Context) -> Result<u32> {
        Ok(std::process::id())
    }
}
impl Handler<Fail> for Counter {
    async fn handle(&self, m: Fail, _: &Context) -> Result<()> {
        bail!("asked to fail: {}", m.0)
    }
}
impl Handler<ObjectDigest> for Counter {
    async fn handle(&self, m: ObjectDigest, ctx: &Context) -> Result<(u64, String)> {
        use sha2::Digest;
        let bytes = ctx.cluster().get(&m.0).await?;
        Ok((
            bytes.len() as u64,
            hex::encode(sha2::Sha256::digest(&bytes)),
        ))
    }
}
impl Handler<LocalObjectStats> for Counter {
    async fn handle(&self, _: LocalObjectStats, ctx: &Context) -> Result<ObjectStats> {
        Ok(ctx.cluster().object_stats(None).await?)
    }
}
impl StreamHandler<CountTo> for Counter {
    async fn handle_stream(&self, m: CountTo, items: ItemSink<u64>, _: &Context) -> Result<()> {
        for i in 0..m.0 {
            items.send(i).await?;
        }
        Ok(())
    }
}

/// Keeps this module's registrations linked into every binary that calls it (worker mode does).
pub fn ensure_linked() -> &'static str {
    <Counter as Actor>::NAME
}
