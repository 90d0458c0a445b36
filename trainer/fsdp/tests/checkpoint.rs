//! Sharded checkpoints outlive the cluster shape: save at world size 4, resume at 2 (and 1) with another strategy and
//! continue — the same losses as an uninterrupted run; the assembled full tensors equal the live model and export to a
//! Hugging Face folder that loads back identically.

mod common;

use common::*;
use ferl_fsdp::checkpoint::{model_file, optim_file, CheckpointMeta, META_FILE};
use ferl_fsdp::units::FlatEntry;
use ferl_fsdp::{
    assemble_full, export_hf, export_sharded, global_step, load_sharded, read_meta, save_sharded,
    FlatUnit, FsdpOptions, ShardedParams, ShardingStrategy, UnitPlan,
};
use ferl_trainer::model::load_model;
use ferl_trainer::model::weights::write_safetensors;
use ferl_trainer::optim::AdamW;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, Tensor};

const STEPS: usize = TOTAL_STEPS as usize;
const SAVE_AT: usize = 3;

fn opts(strategy: ShardingStrategy) -> FsdpOptions {
    FsdpOptions::new(strategy, Kind::Float, Device::Cpu)
}

/// Trains steps `0..SAVE_AT` at world 4, saves, and returns rank 0's full parameters at that point.
fn train_and_save(samples: Arc<Samples>, dir: PathBuf) -> Vec<Tensor> {
    let cfg = tiny_config(true);
    let (layout, params) = init(&cfg);
    let params = Arc::new(Mutex::new(params));
    let mut fulls = run_ranks(4, move |rank, comm| {
        let mine = copies(&params.lock().unwrap());
        let store = ShardedParams::new(
            layout.clone(),
            &mine,
            comm,
            opts(ShardingStrategy::FullShard),
        )
        .unwrap();
        let optimizer = AdamW::new(adam(), store.trainable_masters());
        let mut s = stepper(&cfg, store, optimizer, 1, true, 0);
        for step in 0..SAVE_AT {
            global_step(&mut s, &samples.refs(rank_slice(step, rank, 4))).unwrap();
        }
        let optimizer = std::mem::replace(&mut s.optimizer, AdamW::new(adam(), &[]));
        save_sharded(s.engine.store_mut(), &optimizer, &cfg, SAVE_AT as i64, &dir).unwrap();
        s.engine.store_mut().full_params().unwrap()
    });
    fulls.swap_remove(0)
}

/// Loads `dir` at `world` ranks with `strategy` and trains steps `SAVE_AT..STEPS`; rank 0's curve.
fn resume(
    samples: Arc<Samples>,
    dir: PathBuf,
    world: usize,
    strategy: ShardingStrategy,
) -> Vec<(f64, f64)> {
    let cfg = tiny_config(true);
    let mut curves = run_ranks(world, move |rank, comm| {
        let layout = ferl_trainer::model::layout::ModelLayout::new(&cfg);
        let loaded = load_sharded(&dir, layout, comm, opts(strategy), adam()).unwrap();
        // Design note 14: a rank reads only its new range, never whole old shards: at most the bytes of its own
        // masters and AdamW moments (all units train here), a world-th of the checkpoint when sharded.
        let own = loaded.store.memory_stats().master_bytes as u64 * 3;
        let saved: u64 = loaded
            .meta
            .units
            .iter()
            .map(|u| u.padded(4) as u64 * 12)
            .sum();
        assert!(
            loaded.bytes_read <= own,
            "{strategy:?} world {world} rank {rank}: read {} bytes, its own state is {own}",
            loaded.bytes_read
        );
        eprintln!(
            "{strategy:?} world {world} rank {rank}: read {} of the checkpoint's {saved} tensor bytes",
            loaded.bytes_read
        );
        assert_eq!(loaded.meta.global_step, SAVE_AT as i64);
        assert_eq!(loaded.optimizer.step, SAVE_AT as i64);
        let mut s = stepper(
            &cfg,
            loaded.store,
            loaded.optimizer,
            1,
            false,
            loaded.meta.global_step,
        );
        (SAVE_AT..STEPS)
            .map(|step| {
                let st = global_step(&mut s, &samples.refs(rank_slice(step, rank, world))).unwrap();
                (st.loss, st.grad_norm)
            })
            .collect::<Vec<_>>()
    });
    curves.swap_remove(0)
}

#[test]
fn save_at_world_4_resume_at_2_and_1_continues_like_an_uninterrupted_run() {
    let cfg = tiny_config(true);
    let samples = Arc::new(Samples::new(GLOBAL_BATCH * STEPS, cfg.vocab_size));
    let uninterrupted = &sharded_run(
        &cfg,
        samples.clone(),
        STEPS,
        true,
        4,
        opts(ShardingStrategy::FullShard),
    )[0];
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(format!("global_step_{SAVE_AT}"));
    train_and_save(samples.clone(), dir.clone());
    for r in 0..4 {
        assert!(dir
            .join(format!("model_world_size_4_rank_{r}.safetensors"))
            .exists());
        assert!(dir
            .join(format!("optim_world_size_4_rank_{r}.safetensors"))
            .exists());
    }
    assert_eq!(read_meta(&dir).unwrap().world_size, 4);
    let tail = &uninterrupted[SAVE_AT..];
    let at2 = resume(
        samples.clone(),
        dir.clone(),
        2,
        ShardingStrategy::ShardGradOp,
    );
    assert_close("resumed at world 2 (SHARD_GRAD_OP)", &at2, tail, 1e-5);
    let at1 = resume(samples, dir, 1, ShardingStrategy::NoShard);
    assert_close("resumed at world 1 (NO_SHARD)", &at1, tail, 1e-5);
}

#[test]
fn assembled_checkpoint_equals_the_live_model_and_exports_to_hugging_face() {
    let cfg = tiny_config(true);
    let samples = Arc::new(Samples::new(GLOBAL_BATCH * SAVE_AT, cfg.vocab_size));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("global_step_3");
    let live = train_and_save(samples, dir.clone());
    let (meta, named) = assemble_full(&dir).unwrap();
    assert_eq!(meta.global_step, 3);
    let layout = ferl_trainer::model::layout::ModelLayout::new(&cfg);
    assert_eq!(named.len(), layout.tensors.len());
    for ((name, t), ((want_name, _), want)) in named.iter().zip(layout.tensors.iter().zip(&live)) {
        assert_eq!(name, want_name);
        assert!(
            t.equal(want),
            "assembled `{name}` differs from the live parameter"
        );
    }
    let out: &Path = &tmp.path().join("huggingface");
    export_hf(&dir, &cfg, out, Kind::Float, &[], Default::default()).unwrap();
    let back = load_model(out).unwrap();
    for (((name, _), a), b) in layout.tensors.iter().zip(&back.params).zip(&live) {
        assert!(a.equal(b), "exported `{name}` differs");
    }
    // Self-contained export (config recorded in the checkpoint) into verl's `huggingface/`, which the engine's
    // `ferl export` then reads.
    export_sharded(
        &dir,
        &dir.join("huggingface"),
        Kind::BFloat16,
        &[],
        Default::default(),
    )
    .unwrap();
    let out2 = tmp.path().join("exported-by-engine");
    ferl_trainer::checkpoint::export(&dir, &out2, "fp32").unwrap();
    let again = load_model(&out2).unwrap();
    for (a, b) in again.params.iter().zip(&live) {
        assert!(a.allclose(
            &b.to_kind(Kind::BFloat16).to_kind(Kind::Float),
            0.0,
            0.0,
            false
        ));
    }
}

#[test]
fn loading_a_checkpoint_of_another_model_names_the_mismatch() {
    let cfg = tiny_config(true);
    let samples = Arc::new(Samples::new(GLOBAL_BATCH * SAVE_AT, cfg.vocab_size));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("global_step_3");
    train_and_save(samples, dir.clone());
    let other = ferl_trainer::model::layout::ModelLayout::new(&tiny_config(false));
    let errs = run_ranks(1, move |_, comm| {
        load_sharded(
            &dir,
            other.clone(),
            comm,
            opts(ShardingStrategy::FullShard),
            adam(),
        )
        .err()
        .map(|e| format!("{e:#}"))
    });
    let err = errs[0].clone().expect("loading must fail");
    assert!(
        err.contains("global_step_3") && err.contains("no tensor `lm_head.weight`"),
        "{err}"
    );
}

#[test]
fn prefetch_hits_after_the_first_micro_batch_and_never_when_off() {
    let cfg = tiny_config(true);
    let samples = Arc::new(Samples::new(GLOBAL_BATCH, cfg.vocab_size));
    for prefetch in [true, false] {
        let cfg = cfg.clone();
        let samples = samples.clone();
        let (layout, params) = init(&cfg);
        let params = Arc::new(Mutex::new(params));
        let stats = run_ranks(2, move |rank, comm| {
            let mut o = opts(ShardingStrategy::FullShard);
            o.prefetch = prefetch;
            let mine = copies(&params.lock().unwrap());
            let store = ShardedParams::new(layout.clone(), &mine, comm, o).unwrap();
            let optimizer = AdamW::new(adam(), store.trainable_masters());
            let mut s = stepper(&cfg, store, optimizer, 1, true, 0);
            global_step(&mut s, &samples.refs(rank_slice(0, rank, 2))).unwrap();
            s.engine.store().comm_stats()
        });
        for st in stats {
            if prefetch {
                assert!(st.prefetch_hits > 0, "{st:?}");
            } else {
                assert_eq!(st.prefetch_hits, 0, "{st:?}");
            }
            assert!(st.all_gathers > 0 && st.reductions > 0, "{st:?}");
        }
    }
}

/// Writes, as a `world`-rank run of an older build would have, a checkpoint of `full` (moments: `full · 0.5` and
/// `full²`) whose units are `units`, cut at one element (`row_len` 1).
fn write_checkpoint_with_units(dir: &Path, units: &[FlatUnit], full: &[Tensor], world: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let flat = |u: &FlatUnit, f: &dyn Fn(&Tensor) -> Tensor| {
        let parts: Vec<Tensor> = u.entries.iter().map(|e| f(&full[e.layout_index])).collect();
        let refs: Vec<Option<&Tensor>> = parts.iter().map(Some).collect();
        u.flatten(&refs, world, Kind::Float, Device::Cpu)
    };
    for rank in 0..world {
        let (mut model, mut optim) = (Vec::new(), Vec::new());
        for u in units {
            let shard = u.shard_len(world);
            let cut = |t: Tensor| t.narrow(0, rank as i64 * shard, shard).copy();
            model.push((u.name.clone(), cut(flat(u, &|t| t.copy()))));
            optim.push((format!("{}.exp_avg", u.name), cut(flat(u, &|t| t * 0.5))));
            optim.push((format!("{}.exp_avg_sq", u.name), cut(flat(u, &|t| t * t))));
        }
        write_safetensors(&model_file(dir, world, rank), &model).unwrap();
        write_safetensors(&optim_file(dir, world, rank), &optim).unwrap();
    }
    let meta = CheckpointMeta {
        format: "ferl-fsdp/1".into(),
        world_size: world,
        replica_groups: 1,
        global_step: 3,
        optimizer_step: 3,
        units: units.to_vec(),
        model_config: None,
    };
    std::fs::write(dir.join(META_FILE), serde_json::to_vec(&meta).unwrap()).unwrap();
}

#[test]
fn a_checkpoint_grouping_its_units_otherwise_loads_tensor_by_tensor() {
    // Before vocabulary matrices had units of their own cut by rows, an untied head's norm and output matrix shared
    // the unit `head` and every unit was cut at one element: such a checkpoint loads into today's units.
    let cfg = tiny_config(false);
    let (layout, full) = init(&cfg);
    let mut old: Vec<FlatUnit> = UnitPlan::new(&layout).units;
    let output = old.iter().position(|u| u.name == "head.output").unwrap();
    let matrix = old.remove(output).entries.remove(0);
    let head = old.iter_mut().find(|u| u.name == "head").unwrap();
    head.entries.push(FlatEntry {
        offset: head.numel,
        ..matrix
    });
    head.numel += head.entries[1].numel;
    old.iter_mut().for_each(|u| u.row_len = 1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("global_step_3");
    write_checkpoint_with_units(&dir, &old, &full, 2);
    let want = copies(&full);
    let shared = Arc::new(Mutex::new(full));
    let got = run_ranks(3, move |_, comm| {
        let full = copies(&shared.lock().unwrap());
        let opts = opts(ShardingStrategy::FullShard);
        let mut loaded = load_sharded(&dir, layout.clone(), comm, opts, adam()).unwrap();
        assert!(loaded.store.splits_head(), "the new units split the head");
        let store = &mut loaded.store;
        let moments: Vec<(Tensor, Tensor)> = (0..store.plan().units.len())
            .map(|u| {
                let unit = &store.plan().units[u];
                let flat = |f: &dyn Fn(&Tensor) -> Tensor| {
                    let parts: Vec<Tensor> = unit
                        .entries
                        .iter()
                        .map(|e| f(&full[e.layout_index]))
                        .collect();
                    let refs: Vec<Option<&Tensor>> = parts.iter().map(Some).collect();
                    let (start, len) = store.local_range(u);
                    let (_, world) = store.rank_and_world();
                    unit.flatten(&refs, world, Kind::Float, Device::Cpu)
                        .narrow(0, start, len)
                };
                (flat(&|t| t * 0.5), flat(&|t| t * t))
            })
            .collect();
        for (u, (avg, sq)) in moments.iter().enumerate() {
            assert!(
                loaded.optimizer.exp_avg[u].equal(avg),
                "exp_avg of unit {u}"
            );
            assert!(
                loaded.optimizer.exp_avg_sq[u].equal(sq),
                "exp_avg_sq of unit {u}"
            );
        }
        assert_eq!(loaded.optimizer.step, 3);
        loaded.store.full_params().unwrap()
    });
    for rank in got {
        for ((name, _), (a, b)) in init(&cfg).0.tensors.iter().zip(want.iter().zip(&rank)) {
            assert!(a.equal(b), "`{name}` differs after loading");
        }
    }
}
