//! Issue #13 item 4 (design note 14, "FULL_SHARD means it"): the bytes a rank holds fall with the number of ranks.
//!
//! The law checked, per rank, at world 1, 2 and 4, fp32, FULL_SHARD, with and without gradient checkpointing:
//! - sharded state (fp32 masters + gradients + AdamW's two moments) ≤ `16 · P / world + 16 · Σ row_len` bytes (`P`
//!   the model's parameters; the second term is each unit's padding to whole rows per rank, under one row each: one
//!   element for most units, `hidden` for the vocabulary matrices' units);
//! - gathered parameters at any moment (resident buffers by their storages, which the autograd graphs kept without
//!   checkpointing share, plus all-gathers in flight) ≤ `2 · stage`: the stage computing and the prefetched next one,
//!   where `stage` is the largest stage's gathered bytes (here one decoder layer). Holding every layer's gathered
//!   parameters until backward — what the kept graphs did before — is `layers · stage`, four times the bound here;
//! - everything together, with full-size gradient buffers queued for reduce-scatter (counted until applied: at most
//!   the store's `MAX_PENDING_REDUCTIONS = 4` units plus the stage just accumulated), ≤ state bound +
//!   `2 · stage + 4 · unit + stage`, `unit` the largest unit's bytes.
//!
//! Item (c) is checked too: a rank building its store from the safetensors files reads only its shard's bytes and
//! gets the same masters as sharding full tensors.

mod common;

use common::*;
use ferl_fsdp::{global_step, FsdpOptions, MemoryStats, ShardedParams, ShardingStrategy, UnitPlan};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::weights::{save_hf_folder, WeightReader};
use ferl_trainer::optim::AdamW;
use std::sync::{Arc, Mutex};
use tch::{Device, Kind};

const LAYERS: usize = 8;
const STEPS: usize = 2;
/// The store's `MAX_PENDING_REDUCTIONS`: reductions left queued when `accumulate_grads` returns.
const QUEUED_REDUCTIONS: i64 = 4;

/// A Qwen2 whose decoder layers dominate its parameters: 8 layers, hidden 64, tied 61-token vocabulary.
fn memory_config() -> ModelConfig {
    let raw = serde_json::json!({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "num_hidden_layers": LAYERS, "vocab_size": 61, "tie_word_embeddings": true, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "initializer_range": 0.2, "hidden_act": "silu", "torch_dtype": "float32"
    });
    ModelConfig::from_value(raw, std::path::Path::new("memory test config")).unwrap()
}

/// What one rank held: its store's accounting (peaks over the whole run), AdamW's bytes, all-gathers submitted.
struct RankMemory {
    store: MemoryStats,
    optimizer_bytes: i64,
    all_gathers: u64,
    losses: Vec<f64>,
}

fn measure(cfg: &ModelConfig, world: usize, checkpointing: bool) -> Vec<RankMemory> {
    let samples = Arc::new(Samples::new(GLOBAL_BATCH * STEPS, cfg.vocab_size));
    let (layout, params) = init(cfg);
    let params = Arc::new(Mutex::new(params));
    let cfg = cfg.clone();
    run_ranks(world, move |rank, comm| {
        let mine = copies(&params.lock().unwrap());
        let opts = FsdpOptions::new(ShardingStrategy::FullShard, Kind::Float, Device::Cpu);
        let mut store = ShardedParams::new(layout.clone(), &mine, comm, opts).unwrap();
        drop(mine);
        store.reset_peak();
        let optimizer = AdamW::new(adam(), store.trainable_masters());
        let mut s = stepper(&cfg, store, optimizer, 1, checkpointing, 0);
        let losses = (0..STEPS)
            .map(|step| {
                let st = global_step(&mut s, &samples.refs(rank_slice(step, rank, world))).unwrap();
                st.loss
            })
            .collect();
        let bytes = |ts: &[tch::Tensor]| ts.iter().map(|t| t.numel() as i64 * 4).sum::<i64>();
        RankMemory {
            store: s.engine.store().memory_stats(),
            optimizer_bytes: bytes(&s.optimizer.exp_avg) + bytes(&s.optimizer.exp_avg_sq),
            all_gathers: s.engine.store().comm_stats().all_gathers,
            losses,
        }
    })
}

#[test]
fn full_shard_bytes_per_rank_fall_as_one_over_world_plus_one_gathered_stage() {
    let cfg = memory_config();
    let layout = ModelLayout::new(&cfg);
    let plan = UnitPlan::new(&layout);
    let params = layout.num_params();
    let pad_rows: i64 = plan.units.iter().map(|u| u.row_len).sum();
    let mut gathers = Vec::new();
    for checkpointing in [false, true] {
        let mut totals = Vec::new();
        for world in [1usize, 2, 4] {
            let stage = plan
                .stage_units
                .values()
                .map(|us| {
                    us.iter()
                        .map(|&u| plan.units[u].padded(world) * 4)
                        .sum::<i64>()
                })
                .max()
                .unwrap();
            let unit = plan
                .units
                .iter()
                .map(|u| u.padded(world) * 4)
                .max()
                .unwrap();
            let state_bound = 16 * params / world as i64 + 16 * pad_rows;
            let bound = state_bound + 3 * stage + QUEUED_REDUCTIONS * unit;
            let mut worst = 0;
            for (rank, m) in measure(&cfg, world, checkpointing).into_iter().enumerate() {
                let s = &m.store;
                let state = s.master_bytes + s.grad_bytes + m.optimizer_bytes;
                let total = state + s.peak_transient_bytes;
                let what = format!("checkpointing={checkpointing} world {world} rank {rank}");
                eprintln!(
                    "{what}: state {state} B (bound {state_bound}), peak gathered {} B (bound {} = 2 stages of {stage}), \
                     peak total {total} B (bound {bound}); full model state {} B",
                    s.peak_gathered_bytes,
                    2 * stage,
                    16 * params
                );
                assert!(
                    state <= state_bound,
                    "{what}: state {state} > {state_bound}"
                );
                assert!(
                    s.peak_gathered_bytes <= 2 * stage,
                    "{what}: gathered parameters peaked at {} bytes, more than 2 stages ({stage} each)",
                    s.peak_gathered_bytes
                );
                assert!(total <= bound, "{what}: {total} > {bound}");
                assert_eq!(
                    s.gathered_bytes, 0,
                    "{what}: nothing stays gathered after the step"
                );
                worst = worst.max(total);
                gathers.push((checkpointing, world, m.all_gathers, m.losses));
            }
            totals.push(worst);
        }
        assert!(
            totals.windows(2).all(|w| w[1] < w[0]),
            "checkpointing={checkpointing}: per-rank peaks {totals:?} must fall from world 1 to 2 to 4"
        );
    }
    // Without checkpointing the kept graphs' parameters are gathered again for backward exactly as often as the
    // checkpointed recomputation gathers them, and the losses are the same.
    for (ck, world, n, losses) in gathers.iter().filter(|g| !g.0) {
        let (_, _, m, ref_losses) = gathers
            .iter()
            .find(|g| g.0 && g.1 == *world)
            .expect("a checkpointed run at the same world size");
        assert_eq!(n, m, "checkpointing={ck} world {world}: all-gathers");
        for (a, b) in losses.iter().zip(ref_losses) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "world {world}: loss {a} vs {b}"
            );
        }
    }
}

#[test]
fn ranks_read_only_their_shard_of_the_safetensors_files() {
    let cfg = tiny_config(true);
    let (layout, params) = init(&cfg);
    let dir = tempfile::tempdir().unwrap();
    save_hf_folder(dir.path(), &cfg, &layout, &params, Kind::Float, &[]).unwrap();
    let file_bytes = 4 * layout.num_params() as u64;
    let pad_rows: i64 = UnitPlan::new(&layout).units.iter().map(|u| u.row_len).sum();
    let params = Arc::new(Mutex::new(params));
    for world in [1usize, 2, 4] {
        let (layout, params, path) = (layout.clone(), params.clone(), dir.path().to_path_buf());
        let read = run_ranks(world, move |_, comm| {
            let opts = FsdpOptions::new(ShardingStrategy::FullShard, Kind::Float, Device::Cpu);
            let mut files = WeightReader::open(&path, &layout).unwrap();
            let from_files =
                ShardedParams::from_source(layout.clone(), &mut files, comm.clone(), opts).unwrap();
            let mine = copies(&params.lock().unwrap());
            let from_full = ShardedParams::new(layout.clone(), &mine, comm, opts).unwrap();
            for (a, b) in from_files
                .local_masters()
                .iter()
                .zip(from_full.local_masters())
            {
                assert!(a.equal(b), "world {world}: masters from the files differ");
            }
            files.bytes_read()
        });
        for (rank, bytes) in read.into_iter().enumerate() {
            // Each unit's shard is under one row (`row_len` elements) over a world-th of it.
            let bound = file_bytes / world as u64 + 4 * pad_rows as u64;
            eprintln!("world {world} rank {rank}: read {bytes} of {file_bytes} tensor bytes (bound {bound})");
            assert!(
                bytes <= bound,
                "world {world} rank {rank}: read {bytes} > {bound}"
            );
        }
    }
}

#[test]
fn freeing_gathered_layers_after_forward_changes_no_bit_of_training() {
    // FULL_SHARD without checkpointing frees each layer's gathered parameters under its kept graph and all-gathers
    // them back for backward; SHARD_GRAD_OP keeps them. Same collectives otherwise, so the curves are bit-identical.
    let cfg = tiny_config(true);
    let samples = Arc::new(Samples::new(GLOBAL_BATCH * 2, cfg.vocab_size));
    for world in [1, 2] {
        let run = |strategy| {
            let opts = FsdpOptions::new(strategy, Kind::Float, Device::Cpu);
            sharded_run(&cfg, samples.clone(), 2, false, world, opts)
        };
        let freed = run(ShardingStrategy::FullShard);
        let kept = run(ShardingStrategy::ShardGradOp);
        assert_eq!(
            freed, kept,
            "world {world}: freeing and refilling changed the results"
        );
    }
}
