//! Training throughput of the sharding strategies on CPU (one thread per rank, TCP collectives on loopback), with
//! and without prefetching the next stage's all-gather. Prints `name value unit` rows.
//!
//! Run: `cargo bench -p ferl-fsdp --profile dev --bench fsdp` (the heavy work is in libtorch, so the dev profile
//! measures the same thing as a release build).

#[path = "../tests/common/mod.rs"]
mod common;

use common::*;
use ferl_fsdp::{global_step, FsdpOptions, ShardedParams, ShardingStrategy};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::optim::AdamW;
use ferl_trainer::params::LocalParams;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tch::{Device, Kind};

const STEPS: usize = 3;

fn bench_config() -> ModelConfig {
    let raw = serde_json::json!({
        "model_type": "qwen2", "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 768, "num_hidden_layers": 4, "vocab_size": 8192,
        "tie_word_embeddings": true, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02
    });
    ModelConfig::from_value(raw, std::path::Path::new("bench config")).unwrap()
}

fn long_samples(n: usize, vocab: i64) -> Samples {
    let mut s = Samples::new(n, vocab);
    for (ids, mask) in s.ids.iter_mut().zip(s.mask.iter_mut()) {
        let base = ids.clone();
        while ids.len() < 192 {
            ids.extend_from_slice(&base);
        }
        *mask = (0..ids.len()).map(|t| t >= 32).collect();
    }
    s
}

/// Returns (tokens per second, summed all-gather wait in ms per step on rank 0).
fn run(cfg: &ModelConfig, samples: Arc<Samples>, world: usize, opts: FsdpOptions) -> (f64, f64) {
    let (layout, params) = init(cfg);
    let params = Arc::new(Mutex::new(params));
    let cfg = cfg.clone();
    let results = run_ranks(world, move |rank, comm| {
        let mine = copies(&params.lock().unwrap());
        let store = ShardedParams::new(layout.clone(), &mine, comm, opts).unwrap();
        let optimizer = AdamW::new(adam(), store.trainable_masters());
        let mut s = stepper(&cfg, store, optimizer, 1, true, 0);
        global_step(&mut s, &samples.refs(rank_slice(0, rank, world))).unwrap();
        let wait0 = s.engine.store().comm_stats().gather_wait;
        let start = Instant::now();
        let mut tokens = 0;
        for step in 1..=STEPS {
            tokens += global_step(&mut s, &samples.refs(rank_slice(step, rank, world)))
                .unwrap()
                .tokens;
        }
        let secs = start.elapsed().as_secs_f64();
        let wait =
            (s.engine.store().comm_stats().gather_wait - wait0).as_secs_f64() * 1e3 / STEPS as f64;
        (tokens as f64 / secs, wait)
    });
    results[0]
}

fn main() {
    tch::set_num_threads(1);
    let cfg = bench_config();
    let samples = Arc::new(long_samples(GLOBAL_BATCH * (STEPS + 1), cfg.vocab_size));
    {
        let (layout, params) = init(&cfg);
        let store = LocalParams::new(layout, params, Kind::Float);
        let optimizer = AdamW::new(adam(), store.master());
        let mut s = stepper(&cfg, store, optimizer, 1, true, 0);
        s.step(&samples.refs(0..GLOBAL_BATCH)).unwrap();
        let start = Instant::now();
        let mut tokens = 0;
        for step in 1..=STEPS {
            tokens += s
                .step(&samples.refs(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH))
                .unwrap()
                .tokens;
        }
        println!(
            "fsdp_local_w1_tokens_per_s {:.1} tok/s",
            tokens as f64 / start.elapsed().as_secs_f64()
        );
    }
    // FERL_FSDP_BENCH_ONLY=shard_grad_op (a substring of the row names) limits the run to matching strategies.
    let only = std::env::var("FERL_FSDP_BENCH_ONLY").unwrap_or_default();
    for (name, strategy) in [
        ("full_shard", ShardingStrategy::FullShard),
        ("shard_grad_op", ShardingStrategy::ShardGradOp),
        ("no_shard", ShardingStrategy::NoShard),
    ] {
        if !name.contains(only.as_str()) {
            continue;
        }
        for world in [1, 2] {
            let mut prefetch_modes = vec![true];
            if strategy == ShardingStrategy::FullShard {
                prefetch_modes.push(false);
            }
            for prefetch in prefetch_modes {
                let mut opts = FsdpOptions::new(strategy, Kind::Float, Device::Cpu);
                opts.prefetch = prefetch;
                let (tps, wait) = run(&cfg, samples.clone(), world, opts);
                let tag = if prefetch { "prefetch" } else { "no_prefetch" };
                println!("fsdp_{name}_w{world}_{tag}_tokens_per_s {tps:.1} tok/s");
                if strategy == ShardingStrategy::FullShard && world > 1 {
                    println!("fsdp_{name}_w{world}_{tag}_gather_wait_per_step {wait:.2} ms");
                }
            }
        }
    }
}
