//! `ferl-bench runtime`: the actor runtime's figures, named like Ray's microbenchmark rows so they compare directly.
//! Ray 2.60 on the reference machine (2 cores): 1:1 sync 1,330 calls/s, 1:1 async 5,900 calls/s, 1 MiB-arg
//! 390 calls/s, placement group create+remove 470/s, `ray.init()` to first call 2.9 s; TCP loopback 3.8 GB/s.
//! Workers are this binary re-run in worker mode; they host `ferl_runtime::testbed::Counter`.
//! The 1 MiB and 100 MiB rows move their payloads through the same-host shared-memory ring (guarantee 13 in
//! `runtime/README.md`); run with `FERL_SHM_BYTES=0` to measure them over QUIC instead. Both send a `SharedBytes`
//! (guarantee 14), as Ray's rows send one numpy array decoded without a copy; the `_vec` rows send a `Vec<u8>`
//! instead, cloned per call and decoded into the actor's own `Vec<u8>`.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use ferl::runtime::testbed::{Counter, Get, Sink, SinkShared};
use ferl::runtime::{ActorRef, Cluster, SharedBytes, SpawnOptions};

use crate::report::Report;

pub(crate) mod remote_head;

/// Options of the runtime suite.
#[derive(Args, Debug)]
pub(crate) struct RuntimeArgs {
    /// Seconds each throughput figure runs for.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Calls in flight for the async rows.
    #[arg(long, default_value_t = 1000)]
    in_flight: usize,
    /// Worker threads of the driver's tokio runtime (default: tokio's, one per core).
    #[arg(long)]
    driver_threads: Option<usize>,
}

/// Runs the suite and prints its rows.
pub(crate) fn run(args: RuntimeArgs, out: &mut Report) -> Result<()> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.driver_threads {
        builder.worker_threads(n.max(1));
    }
    let rt = builder.enable_all().build()?;
    // The figures run in a spawned task, on the runtime's worker threads: a future given to `block_on` runs on the
    // calling thread instead, so each reply would cross threads to reach it (`runtime/README.md`, performance).
    rt.block_on(async {
        let (tx, mut rows) = tokio::sync::mpsc::unbounded_channel();
        let suite = rt.spawn(suite(args, Rows(tx)));
        while let Some((name, value, unit)) = rows.recv().await {
            out.row(name, value, unit);
        }
        suite.await?
    })
}

/// Rows sent from the suite's task to the thread that prints them: name, value, unit.
struct Rows(tokio::sync::mpsc::UnboundedSender<(&'static str, f64, &'static str)>);

impl Rows {
    fn row(&mut self, name: &'static str, value: f64, unit: &'static str) {
        let _ = self.0.send((name, value, unit));
    }
}

async fn suite(args: RuntimeArgs, mut out: Rows) -> Result<()> {
    let window = Duration::from_secs_f64(args.seconds);
    let t0 = Instant::now();
    let cluster = ferl::runtime::init(Default::default()).await?;
    let actor = cluster.spawn::<Counter>(0, SpawnOptions::new()).await?;
    actor.call(Get).await?;
    out.row(
        "local_cluster_start_to_first_call_s",
        t0.elapsed().as_secs_f64(),
        "s",
    );

    out.row(
        "1_1_actor_calls_sync",
        sync_calls(&actor, window).await?,
        "calls/s",
    );
    out.row(
        "1_1_actor_calls_async",
        async_calls(std::slice::from_ref(&actor), args.in_flight, window).await?,
        "calls/s",
    );
    mib_arg_rows(&actor, window, &mut out).await?;

    let mut many = Vec::new();
    for _ in 0..4 {
        many.push(cluster.spawn::<Counter>(0, SpawnOptions::new()).await?);
    }
    out.row(
        "n_n_actor_calls_async",
        async_calls(&many, args.in_flight, window).await?,
        "calls/s",
    );

    transfer_rows(&actor, &mut out).await?;
    out.row(
        "resource_group_create_remove_per_s",
        remote_head::group_churn(&cluster, window).await?,
        "groups/s",
    );
    // Ray's figure is measured against a GCS in another process: the same loop through a head of its own.
    out.row(
        "resource_group_create_remove_remote_head_per_s",
        remote_head::group_churn_remote(window).await?,
        "groups/s",
    );
    out.row(
        "actor_create_per_s",
        actor_creation(&cluster, window).await?,
        "actors/s",
    );
    cluster.shutdown().await;
    Ok(())
}

/// The 1 MiB-argument rows. Ray's row passes one numpy array again and again and decodes it without a copy:
/// `SharedBytes` does both. The `_vec` row sends a fresh `Vec<u8>` (the caller's clone) decoded into the actor's own
/// `Vec`.
async fn mib_arg_rows(actor: &ActorRef<Counter>, window: Duration, out: &mut Rows) -> Result<()> {
    let mib = SharedBytes::from(vec![7u8; 1 << 20]);
    out.row(
        "1_1_actor_calls_1MiB_arg",
        payload_calls(window, || actor.call(SinkShared(mib.clone()))).await?,
        "calls/s",
    );
    let mib_vec = mib.to_vec();
    out.row(
        "1_1_actor_calls_1MiB_arg_vec",
        payload_calls(window, || actor.call(Sink(mib_vec.clone()))).await?,
        "calls/s",
    );
    Ok(())
}

/// The 100 MiB transfer rows, as `SharedBytes` and as a `Vec<u8>` (the first blob is dropped before the second row).
async fn transfer_rows(actor: &ActorRef<Counter>, out: &mut Rows) -> Result<()> {
    let blob = SharedBytes::from(vec![1u8; 100 << 20]);
    out.row(
        "transfer_100MiB_GBps",
        transfer(blob.len(), || actor.call(SinkShared(blob.clone()))).await?,
        "GB/s",
    );
    let blob_vec = blob.to_vec();
    drop(blob);
    out.row(
        "transfer_100MiB_vec_GBps",
        transfer(blob_vec.len(), || actor.call(Sink(blob_vec.clone()))).await?,
        "GB/s",
    );
    Ok(())
}

/// Calls issued one after another until the window closes, per second.
async fn payload_calls<F, R>(window: Duration, mut call: impl FnMut() -> F) -> Result<f64>
where
    F: std::future::Future<Output = ferl::runtime::Result<R>>,
{
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < window {
        call().await?;
        n += 1;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// GB/s of `len`-byte payloads sent one after another (after one warm-up call).
async fn transfer<F, R>(len: usize, mut call: impl FnMut() -> F) -> Result<f64>
where
    F: std::future::Future<Output = ferl::runtime::Result<R>>,
{
    call().await?;
    let rounds = 5;
    let t = Instant::now();
    for _ in 0..rounds {
        call().await?;
    }
    Ok((rounds * len) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

async fn sync_calls(actor: &ActorRef<Counter>, window: Duration) -> Result<f64> {
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < window {
        for _ in 0..100 {
            actor.call(Get).await?;
        }
        n += 100;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// `in_flight` callers spread over `actors`, each issuing calls back to back until the window closes.
async fn async_calls(
    actors: &[ActorRef<Counter>],
    in_flight: usize,
    window: Duration,
) -> Result<f64> {
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..in_flight {
        let a = actors[i % actors.len()].clone();
        tasks.spawn(async move {
            let mut n = 0u64;
            while t.elapsed() < window {
                a.call(Get).await?;
                n += 1;
            }
            anyhow::Ok(n)
        });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r??;
    }
    Ok(total as f64 / t.elapsed().as_secs_f64())
}

async fn actor_creation(cluster: &Cluster, window: Duration) -> Result<f64> {
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < window {
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let c = cluster.clone();
            set.spawn(async move { c.spawn::<Counter>(0, SpawnOptions::new()).await });
        }
        let mut actors = Vec::new();
        while let Some(r) = set.join_next().await {
            actors.push(r??);
        }
        n += actors.len() as u64;
        for a in &actors {
            cluster.kill(a).await?;
        }
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}
