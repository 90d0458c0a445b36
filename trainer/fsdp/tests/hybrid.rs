//! HSDP (issue #13): sharding within shard groups of `S` consecutive ranks and replicating across them (FSDP2's
//! `[replicate, shard]` mesh) trains exactly what FULL_SHARD over every rank and the single-process trainer train:
//! S=2 at world 4 reduces the same gradient as both within 1e-5 and gives the same per-step losses and gradient
//! norms (fp32); each rank holds 1/S of the model and replicas hold bit-equal shards. Its checkpoints are those of
//! an S-rank run (only the first shard group writes) and resume at another world size and S. The replica group's
//! all-reduce runs once per trainable unit per step, whatever the number of micro-batches.

mod common;

use common::*;
use ferl_collective::{GroupOptions, MemoryRendezvous, TcpCommunicator};
use ferl_fsdp::{
    global_step, load_sharded, read_meta, save_sharded, FsdpOptions, ShardGroups, ShardedParams,
    ShardingStrategy,
};
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::optim::AdamW;
use ferl_trainer::params::ParamStore;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, Tensor};

const STEPS: usize = 4;
const REL: f64 = 1e-5;
const WORLD: usize = 4;
const S: usize = 2;

static GROUPS: AtomicUsize = AtomicUsize::new(0);

fn opts() -> FsdpOptions {
    FsdpOptions::new(ShardingStrategy::FullShard, Kind::Float, Device::Cpu)
}

/// Runs `body(rank, groups)` on one thread per rank of `world`, each in shard group `rank / s` (of `s` ranks) and
/// replica group `rank % s` (of `world / s` ranks), formed over one rendezvous; results in rank order.
fn run_hybrid<T: Send + 'static>(
    world: usize,
    s: usize,
    body: impl Fn(usize, ShardGroups) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let rdv = Arc::new(MemoryRendezvous::new());
    let prefix = format!("hsdp-test-{}", GROUPS.fetch_add(1, Ordering::SeqCst));
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (rdv, body, prefix) = (rdv.clone(), body.clone(), prefix.clone());
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let join = |name: String, r: usize, size: usize| {
                    let options = GroupOptions {
                        prefix: format!("{prefix}/{name}"),
                        ..GroupOptions::default()
                    };
                    let c = TcpCommunicator::connect(r, size, rdv.clone(), &options).unwrap();
                    Arc::new(c) as Arc<dyn ferl_collective::Communicator>
                };
                let (group, index) = (rank / s, rank % s);
                let shard = join(format!("fsdp{group}"), index, s);
                let replicate = join(format!("replica{index}"), group, world / s);
                body(rank, ShardGroups::hybrid(shard, replicate))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// What a rank ends a run with: its curve, its local masters, its master bytes and its communication counters.
struct RankEnd {
    curve: Vec<(f64, f64)>,
    locals: Vec<Tensor>,
    master_bytes: i64,
    stats: ferl_fsdp::CommStats,
}

/// Trains `steps` on `store` as rank `rank` of `WORLD` data-parallel ranks.
fn train(
    store: ShardedParams,
    cfg: &ferl_trainer::model::config::ModelConfig,
    samples: &Samples,
    rank: usize,
    steps: std::ops::Range<usize>,
) -> RankEnd {
    let master_bytes = store.memory_stats().master_bytes;
    let optimizer = AdamW::new(adam(), store.trainable_masters());
    let mut s = stepper(cfg, store, optimizer, 1, true, 0);
    let curve = steps
        .map(|step| {
            let st = global_step(&mut s, &samples.refs(rank_slice(step, rank, WORLD))).unwrap();
            (st.loss, st.grad_norm)
        })
        .collect();
    let store = s.engine.store_mut();
    RankEnd {
        curve,
        locals: store.local_masters().iter().map(Tensor::copy).collect(),
        master_bytes,
        stats: store.comm_stats(),
    }
}

/// The summed gradient of the first global batch, per unit (its padded flat buffer), with shard groups of `s`
/// ranks at `world`: each rank's reduced shard after its micro-batches, the first shard group's concatenated.
fn first_gradient(world: usize, s: usize) -> Vec<Tensor> {
    let cfg = tiny_config(true);
    let samples = Arc::new(Samples::new(GLOBAL_BATCH, cfg.vocab_size));
    let (layout, params) = init(&cfg);
    let params = Arc::new(Mutex::new(params));
    let shards = run_hybrid(world, s, move |rank, groups| {
        let mine = copies(&params.lock().unwrap());
        let store = ShardedParams::new(layout.clone(), &mine, groups, opts()).unwrap();
        let optimizer = AdamW::new(adam(), store.trainable_masters());
        let mut st = stepper(&cfg, store, optimizer, 1, true, 0);
        let all = samples.refs(0..GLOBAL_BATCH);
        let targets: i64 = all.iter().map(|r| r.num_targets()).sum();
        for one in samples.refs(rank_slice(0, rank, world)).chunks(1) {
            let mb = st.micro_batch(one).unwrap();
            st.engine.forward_backward(&mb, targets).unwrap();
        }
        let (_, grads) = st.engine.store_mut().master_and_grads();
        grads.iter().map(Tensor::copy).collect::<Vec<_>>()
    });
    (0..shards[0].len())
        .map(|u| Tensor::cat(&shards[..s].iter().map(|g| &g[u]).collect::<Vec<_>>(), 0))
        .collect()
}

/// The largest difference between two sets of unit gradients, relative to each unit's largest element.
fn max_rel_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let n = x.size()[0].min(y.size()[0]);
            let (x, y) = (x.narrow(0, 0, n), y.narrow(0, 0, n));
            let scale = y.abs().max().double_value(&[]).max(1e-12);
            (&x - &y).abs().max().double_value(&[]) / scale
        })
        .fold(0.0, f64::max)
}

#[test]
fn hsdp_2_at_world_4_reduces_the_same_gradient_as_full_shard_and_one_rank() {
    let one = first_gradient(1, 1);
    let full_shard = first_gradient(WORLD, WORLD);
    let hsdp = first_gradient(WORLD, S);
    for (what, got) in [
        ("HSDP S=2 at world 4", &hsdp),
        ("FULL_SHARD at world 4", &full_shard),
    ] {
        let diff = max_rel_diff(got, &one);
        eprintln!("{what}: gradient vs one rank, largest relative difference {diff:.2e}");
        assert!(diff <= REL, "{what}: the gradient differs by {diff:.2e}");
    }
    let diff = max_rel_diff(&hsdp, &full_shard);
    eprintln!("HSDP vs FULL_SHARD gradient: {diff:.2e}");
    assert!(diff <= REL, "HSDP vs FULL_SHARD gradient: {diff:.2e}");
}

#[test]
fn hsdp_2_at_world_4_matches_full_shard_and_the_local_trainer() {
    let cfg = tiny_config(true);
    let samples = Arc::new(Samples::new(GLOBAL_BATCH * STEPS, cfg.vocab_size));
    let reference = reference_run(&cfg, &samples, STEPS, true);
    let (layout, params) = init(&cfg);
    let params = Arc::new(Mutex::new(params));
    let run = |hybrid: bool| {
        let (layout, params, cfg, samples) =
            (layout.clone(), params.clone(), cfg.clone(), samples.clone());
        let body = move |rank: usize, groups: ShardGroups| {
            let mine = copies(&params.lock().unwrap());
            let store = ShardedParams::new(layout.clone(), &mine, groups, opts()).unwrap();
            train(store, &cfg, &samples, rank, 0..STEPS)
        };
        match hybrid {
            true => run_hybrid(WORLD, S, body),
            false => run_hybrid(WORLD, WORLD, body),
        }
    };
    let full_shard = run(false);
    let hsdp = run(true);
    let plan = ferl_fsdp::UnitPlan::new(&layout);
    let per_rank = |s: usize| plan.units.iter().map(|u| u.shard_len(s) * 4).sum::<i64>();
    let model_bytes = layout.num_params() * 4;
    for (rank, (h, f)) in hsdp.iter().zip(&full_shard).enumerate() {
        assert_close(
            &format!("HSDP rank {rank} vs one process"),
            &h.curve,
            &reference,
            REL,
        );
        assert_close(
            &format!("HSDP rank {rank} vs FULL_SHARD"),
            &h.curve,
            &f.curve,
            REL,
        );
        assert_eq!(h.master_bytes, per_rank(S), "rank {rank}: HSDP holds 1/{S}");
        assert_eq!(
            f.master_bytes,
            per_rank(WORLD),
            "rank {rank}: FULL_SHARD holds 1/{WORLD}"
        );
        // Each rank runs GLOBAL_BATCH / WORLD micro-batches per step, each reduce-scattering its stages within the
        // shard group; across the replicas each trainable unit's shard is summed once per step.
        let units = (plan.trainable_units() * STEPS) as u64;
        eprintln!(
            "HSDP rank {rank}, {STEPS} steps: {} reduce-scatters within the shard group, {} replica all-reduces",
            h.stats.reductions, h.stats.replica_all_reduces
        );
        assert_eq!(h.stats.replica_all_reduces, units, "rank {rank}");
        assert_eq!(f.stats.replica_all_reduces, 0, "rank {rank}");
        assert_eq!(
            h.stats.reductions, f.stats.reductions,
            "rank {rank}: the same reduce-scatters"
        );
        let fraction = h.master_bytes as f64 / model_bytes as f64;
        assert!(
            (fraction - 1.0 / S as f64).abs() < 0.01,
            "rank {rank}: {fraction}"
        );
    }
    for rank in 0..S {
        for (a, b) in hsdp[rank].locals.iter().zip(&hsdp[rank + S].locals) {
            assert!(a.equal(b), "ranks {rank} and {} are replicas", rank + S);
        }
    }
}

/// Trains `0..save_at` under HSDP S=2 at world 4 and saves into `dir`.
fn save_hsdp(samples: Arc<Samples>, dir: PathBuf, save_at: usize) {
    let cfg = tiny_config(true);
    let (layout, params) = init(&cfg);
    let params = Arc::new(Mutex::new(params));
    run_hybrid(WORLD, S, move |rank, groups| {
        let mine = copies(&params.lock().unwrap());
        let store = ShardedParams::new(layout.clone(), &mine, groups, opts()).unwrap();
        let optimizer = AdamW::new(adam(), store.trainable_masters());
        let mut s = stepper(&cfg, store, optimizer, 1, true, 0);
        for step in 0..save_at {
            global_step(&mut s, &samples.refs(rank_slice(step, rank, WORLD))).unwrap();
        }
        let optimizer = std::mem::replace(&mut s.optimizer, AdamW::new(adam(), &[]));
        save_sharded(s.engine.store_mut(), &optimizer, &cfg, save_at as i64, &dir).unwrap();
    });
}

/// Resumes `dir` at `world` ranks in shard groups of `s` and trains `from..TOTAL_STEPS`; every rank's curve.
fn resume(
    samples: Arc<Samples>,
    dir: &Path,
    world: usize,
    s: usize,
    from: usize,
) -> Vec<Vec<(f64, f64)>> {
    let cfg = tiny_config(true);
    let dir = dir.to_path_buf();
    run_hybrid(world, s, move |rank, groups| {
        let groups = match s == world {
            true => ShardGroups::from(groups.shard),
            false => groups,
        };
        let layout = ModelLayout::new(&cfg);
        let loaded = load_sharded(&dir, layout, groups, opts(), adam()).unwrap();
        assert_eq!(loaded.meta.global_step, from as i64);
        let optimizer = loaded.optimizer;
        let mut st = stepper(&cfg, loaded.store, optimizer, 1, true, from as i64);
        (from..TOTAL_STEPS as usize)
            .map(|step| {
                let per = GLOBAL_BATCH / world;
                let start = step * GLOBAL_BATCH + rank * per;
                let out = global_step(&mut st, &samples.refs(start..start + per)).unwrap();
                (out.loss, out.grad_norm)
            })
            .collect()
    })
}

#[test]
fn an_hsdp_checkpoint_is_an_s_rank_checkpoint_and_resumes_at_other_shapes() {
    let cfg = tiny_config(true);
    let steps = TOTAL_STEPS as usize;
    let samples = Arc::new(Samples::new(GLOBAL_BATCH * steps, cfg.vocab_size));
    let reference = reference_run(&cfg, &samples, steps, true);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("global_step_3");
    save_hsdp(samples.clone(), dir.clone(), 3);
    let meta = read_meta(&dir).unwrap();
    assert_eq!((meta.world_size, meta.replica_groups), (S, WORLD / S));
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "fsdp_meta.json",
            "model_world_size_2_rank_0.safetensors",
            "model_world_size_2_rank_1.safetensors",
            "optim_world_size_2_rank_0.safetensors",
            "optim_world_size_2_rank_1.safetensors",
        ],
        "only the first shard group writes"
    );
    // FULL_SHARD at world 2, and HSDP with shard groups of 1 at world 2 (a replica per rank).
    for (world, s) in [(2, 2), (2, 1)] {
        for (rank, curve) in resume(samples.clone(), &dir, world, s, 3)
            .iter()
            .enumerate()
        {
            let what = format!("resumed at world {world}, shard groups of {s}, rank {rank}");
            assert_close(&what, curve, &reference[3..], REL);
        }
    }
}
