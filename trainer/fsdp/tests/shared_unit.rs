//! Store invariant 5 (design note 14): the unit several stages share (the embedding unit holding a tied output matrix)
//! is reduced like any other — once per stage that uses it, per micro-batch — so no full-size gradient buffer of it
//! lives through the step (the parity tests check that the values still equal the single-process trainer; this one
//! checks the counts). Where the matrix is split by vocabulary rows (`ferl_trainer::vocab_parallel`), the head and
//! the embedding compute each rank's rows' gradient whole, and the unit is never reduced.

mod common;

use common::*;
use ferl_fsdp::{global_step, FsdpOptions, ShardedParams, ShardingStrategy};
use ferl_trainer::optim::AdamW;
use std::sync::{Arc, Mutex};
use tch::{Device, Kind};

/// Reductions each rank submits in each of two steps (world size 2, micro-batch 1).
fn reductions_per_step(
    cfg: ferl_trainer::model::config::ModelConfig,
    vocab_parallel: bool,
) -> Vec<Vec<u64>> {
    let samples = Arc::new(Samples::new(GLOBAL_BATCH * 2, cfg.vocab_size));
    let (layout, params) = init(&cfg);
    let params = Arc::new(Mutex::new(params));
    run_ranks(2, move |rank, comm| {
        let mine = copies(&params.lock().unwrap());
        let mut opts = FsdpOptions::new(ShardingStrategy::FullShard, Kind::Float, Device::Cpu);
        opts.vocab_parallel = vocab_parallel;
        let store = ShardedParams::new(layout.clone(), &mine, comm, opts).unwrap();
        let optimizer = AdamW::new(adam(), store.trainable_masters());
        let mut s = stepper(&cfg, store, optimizer, 1, true, 0);
        (0..2)
            .map(|step| {
                let before = s.engine.store().comm_stats().reductions;
                global_step(&mut s, &samples.refs(rank_slice(step, rank, 2))).unwrap();
                s.engine.store().comm_stats().reductions - before
            })
            .collect()
    })
}

#[test]
fn tied_embedding_unit_is_reduced_per_stage_like_every_other_unit() {
    let layers = tiny_config(true).num_layers as u64;
    let per_step = |extra: u64| vec![(GLOBAL_BATCH / 2) as u64 * (layers + extra); 2];
    let cases = [
        // Tied, gathered: per micro-batch every decoder layer, the head's own unit (the final norm), and the
        // embedding unit twice (the head's gradient of the output matrix and the embedding's own).
        ("tied, gathered", tiny_config(true), false, 3),
        // Tied and split: every decoder layer and the final norm's unit.
        ("tied, split", tiny_config(true), true, 1),
        // Untied and gathered: the embedding, the layers, the final norm's unit and the output matrix's unit.
        ("untied, gathered", tiny_config(false), false, 3),
        // Untied and split (uneven rows): the layers and the final norm's unit.
        ("untied, split", tiny_config_with_vocab(false, 61), true, 1),
    ];
    for (what, cfg, vocab_parallel, extra) in cases {
        for (rank, counts) in reductions_per_step(cfg, vocab_parallel)
            .into_iter()
            .enumerate()
        {
            assert_eq!(counts, per_step(extra), "{what}, rank {rank}");
        }
    }
}
