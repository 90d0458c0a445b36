//! The weight-sync rows: the trainer's weights moved into a rollout running in another process, on an embedded
//! cluster of this machine (4 logical CPUs, workers are this binary re-run in worker mode), beside the transport
//! alone moving the same bytes.
//!
//! - `weight_sync_bytes_<model>`, `weight_sync_s_<model>`, `weight_sync_GBps_<model>`: a
//!   [`PolicyActor`](ferl::actors::rl::PolicyActor) and one [`Rollout`](ferl::actors::rl::Rollout) actor on
//!   separate resource groups ([`Placement::Separate`], one CPU bundle each, fp32, one torch thread each), built from
//!   the same model folder; [`sync_weights`] with an fp32 blob, timed whole: the policy's export of its parameters
//!   into one object-store blob (shared memory on this host), the rollout's read of it (a mapping of the policy's
//!   pages: both roles are on this host), its load into the rollout's model, and the policy's release of the blob.
//!   The seconds are the median of `--sync-repeats` syncs after one untimed warm-up sync; GB/s = bytes ÷ that
//!   median (10⁹ bytes per GB).
//! - `transport_GBps_same_payload_<model>`: after the roles are removed, the same number of bytes as one
//!   [`SharedBytes`] call from the driver to a testbed [`Counter`] actor's [`SinkShared`] handler (the transport
//!   alone: no export, no object store, no load), the median of `--sync-repeats` calls after a warm-up call.
//! - `weight_sync_share_of_transport_<model>`: the sync's GB/s ÷ the transport's (goal ≥ [`GOAL`]).

use super::median;
use super::RlArgs;
use crate::report::Report;
use anyhow::{bail, Result};
use ferl::actors::rl::{spawn_roles, sync_weights, Placement, RoleOptions, WeightSync, WireDtype};
use ferl::rl::GrpoSettings;
use ferl::runtime::testbed::{Counter, SinkShared};
use ferl::runtime::{Cluster, HeadOptions, NodeOptions, SharedBytes, SpawnOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The share of the transport's bandwidth the weight sync aims at.
const GOAL: f64 = 0.5;

/// What one model's weight-sync run measured.
struct SyncFigures {
    /// Bytes of the weights blob.
    bytes: u64,
    /// Median seconds of the timed syncs.
    sync_s: f64,
    /// Median seconds of the timed transport calls of `bytes` bytes.
    transport_s: f64,
}

/// Measures the weight sync of the model folder `model` (named `name` in the rows) and prints its rows.
pub(super) fn run(a: &RlArgs, name: &str, model: &Path, out: &mut Report) -> Result<()> {
    let started = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // On a worker thread, not the calling one (see the runtime suite).
    let f = rt.block_on(rt.spawn(measure(model.to_path_buf(), a.sync_repeats)))??;
    let sync_gbps = f.bytes as f64 / f.sync_s / 1e9;
    let transport_gbps = f.bytes as f64 / f.transport_s / 1e9;
    let share = sync_gbps / transport_gbps;
    out.row(
        &format!("weight_sync_bytes_{name}"),
        f.bytes as f64,
        "bytes",
    );
    out.row(&format!("weight_sync_s_{name}"), f.sync_s, "s");
    out.row(&format!("weight_sync_GBps_{name}"), sync_gbps, "GB/s");
    out.row(
        &format!("transport_GBps_same_payload_{name}"),
        transport_gbps,
        "GB/s",
    );
    out.row(
        &format!("weight_sync_share_of_transport_{name}"),
        share,
        "x",
    );
    let met = if share >= GOAL { "met" } else { "not met" };
    eprintln!(
        "rl: {name}: weight sync at {share:.2}x the transport's GB/s, goal >= {GOAL}x: {met}"
    );
    eprintln!(
        "rl: {name}: weight sync part {:.1} s (cluster start, roles, syncs, transport)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Starts the embedded cluster, runs the syncs then the transport calls, and stops the cluster.
async fn measure(model: PathBuf, repeats: usize) -> Result<SyncFigures> {
    let opts = HeadOptions::new().node(NodeOptions::new().num_cpus(4.0).num_gpus(0));
    let cluster = ferl::runtime::init(opts).await?;
    let result = measure_on(&cluster, &model, repeats).await;
    cluster.shutdown().await;
    result
}

/// The syncs (roles removed afterwards, freeing their memory), then the transport calls of the same bytes.
async fn measure_on(cluster: &Cluster, model: &Path, repeats: usize) -> Result<SyncFigures> {
    let syncs = syncs(cluster, model, repeats).await?;
    let bytes = syncs[0].bytes;
    if let Some(s) = syncs.iter().find(|s| s.bytes != bytes) {
        bail!("weight syncs moved {} and {bytes} bytes", s.bytes);
    }
    let sync_s = median(syncs.iter().map(|s| s.seconds).collect());
    let export_s = median(syncs.iter().map(|s| s.export_seconds).collect());
    let load_s = median(syncs.iter().map(|s| s.load_seconds).collect());
    eprintln!(
        "rl: weight sync {bytes} bytes: {sync_s:.3} s (export into the store {export_s:.3} s, read + load {load_s:.3} s)"
    );
    let transport_s = median(transport(cluster, bytes, repeats).await?);
    Ok(SyncFigures {
        bytes,
        sync_s,
        transport_s,
    })
}

/// Spawns the policy and one rollout on separate groups, syncs once untimed, then `repeats` times; removes the
/// roles whatever happened.
async fn syncs(cluster: &Cluster, model: &Path, repeats: usize) -> Result<Vec<WeightSync>> {
    let mut settings = GrpoSettings::default();
    // No reference copy in the policy actor: only the policy's weights are synced.
    settings.loss.use_kl_loss = false;
    let opts = RoleOptions::default();
    let roles = spawn_roles(cluster, &settings, model, Placement::Separate, &opts).await?;
    let run = async {
        let mut done = Vec::with_capacity(repeats);
        for _ in 0..=repeats {
            done.push(sync_weights(&roles.policy, &roles.rollouts, WireDtype::F32).await?);
        }
        done.remove(0); // the warm-up
        anyhow::Ok(done)
    };
    let result = run.await;
    roles.remove(cluster).await?;
    result
}

/// Seconds of `repeats` calls each sending `bytes` bytes as one [`SharedBytes`] to a testbed actor in a worker
/// process, after one warm-up call.
async fn transport(cluster: &Cluster, bytes: u64, repeats: usize) -> Result<Vec<f64>> {
    let sink = cluster.spawn::<Counter>(0, SpawnOptions::new()).await?;
    let blob = SharedBytes::from(vec![1u8; bytes as usize]);
    sink.call(SinkShared(blob.clone())).await?;
    let mut seconds = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t = Instant::now();
        let (got, _) = sink.call(SinkShared(blob.clone())).await?;
        seconds.push(t.elapsed().as_secs_f64());
        if got != bytes {
            bail!("the sink received {got} of {bytes} bytes");
        }
    }
    Ok(seconds)
}
