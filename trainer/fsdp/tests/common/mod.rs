//! Shared pieces of the sharding tests: a tiny random Qwen2, synthetic SFT samples, the single-process reference run
//! and a multi-rank run with one thread per rank over loopback TCP collectives.
#![allow(dead_code)]

use ferl_collective::{Communicator, GroupOptions, MemoryRendezvous, TcpCommunicator};
use ferl_fsdp::{global_step, FsdpOptions, ShardedParams};
use ferl_trainer::batch::{Layout, SampleRef};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::weights::init_params;
use ferl_trainer::optim::{AdamW, AdamWConfig, LrSchedule};
use ferl_trainer::params::{LocalParams, ParamStore};
use ferl_trainer::step::Stepper;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// Samples per global batch (divisible by 1, 2, 3 and 4 ranks).
pub(crate) const GLOBAL_BATCH: usize = 12;
/// Total optimizer steps of a run (the schedule length).
pub(crate) const TOTAL_STEPS: i64 = 6;

/// A tiny Qwen2: 3 layers, GQA, a vocabulary of 64 (the vocabulary matrices split by rows over the ranks,
/// `ferl_trainer::vocab_parallel`).
pub(crate) fn tiny_config(tie: bool) -> ModelConfig {
    tiny_config_with_vocab(tie, 64)
}

/// [`tiny_config`] with `vocab` words (61: uneven rows per rank).
pub(crate) fn tiny_config_with_vocab(tie: bool, vocab: i64) -> ModelConfig {
    let raw = serde_json::json!({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
        "num_hidden_layers": 3, "vocab_size": vocab, "tie_word_embeddings": tie, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "initializer_range": 0.2, "hidden_act": "silu", "torch_dtype": "float32"
    });
    ModelConfig::from_value(raw, std::path::Path::new("tiny test config")).unwrap()
}

/// Tokenized samples: prompt tokens are not targets, response tokens are.
pub(crate) struct Samples {
    /// Token ids per sample.
    pub ids: Vec<Vec<i64>>,
    /// Loss mask per sample.
    pub mask: Vec<Vec<bool>>,
}

impl Samples {
    /// `n` deterministic pseudo-random samples of varying lengths.
    pub(crate) fn new(n: usize, vocab: i64) -> Self {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let len = 6 + (next() % 14) as usize;
            let prompt = 2 + (next() % 4) as usize;
            ids.push((0..len).map(|_| (next() % vocab as u64) as i64).collect());
            mask.push((0..len).map(|t| t >= prompt).collect());
        }
        Self { ids, mask }
    }

    /// Sample refs of `range`.
    pub(crate) fn refs(&self, range: std::ops::Range<usize>) -> Vec<SampleRef<'_>> {
        range
            .map(|i| SampleRef {
                input_ids: &self.ids[i],
                loss_mask: &self.mask[i],
            })
            .collect()
    }
}

/// AdamW settings of every run.
pub(crate) fn adam() -> AdamWConfig {
    AdamWConfig {
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

/// The learning-rate schedule of every run.
pub(crate) fn schedule() -> LrSchedule {
    LrSchedule::from_verl("cosine", 2e-3, 0.2, TOTAL_STEPS, 0.1).unwrap()
}

/// A stepper over `store`, computing in fp32 on the CPU.
pub(crate) fn stepper<P: ParamStore>(
    cfg: &ModelConfig,
    store: P,
    optimizer: AdamW,
    micro: usize,
    checkpointing: bool,
    completed: i64,
) -> Stepper<P> {
    stepper_on(
        cfg,
        store,
        optimizer,
        micro,
        checkpointing,
        completed,
        Kind::Float,
        Device::Cpu,
    )
}

/// A stepper over `store` computing in `kind` on `device`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn stepper_on<P: ParamStore>(
    cfg: &ModelConfig,
    store: P,
    optimizer: AdamW,
    micro: usize,
    checkpointing: bool,
    completed: i64,
    kind: Kind,
    device: Device,
) -> Stepper<P> {
    let opts = EngineOptions {
        gradient_checkpointing: checkpointing,
        logits_chunk_elements: 61 * 16,
        ..Default::default()
    };
    Stepper {
        engine: Engine::new(cfg.clone(), store, kind, opts),
        optimizer,
        schedule: schedule(),
        clip_grad: 1.0,
        micro_batch_size: micro,
        layout: Layout::Padded,
        device,
        completed_steps: completed,
        sequence_parallel: None,
    }
}

/// Initial parameters (seeded) of the tiny model.
pub(crate) fn init(cfg: &ModelConfig) -> (ModelLayout, Vec<Tensor>) {
    let layout = ModelLayout::new(cfg);
    let params = init_params(cfg, &layout, 7);
    (layout, params)
}

/// Per-step (loss, grad norm) of the single-process trainer, micro-batch 2.
pub(crate) fn reference_run(
    cfg: &ModelConfig,
    samples: &Samples,
    steps: usize,
    checkpointing: bool,
) -> Vec<(f64, f64)> {
    reference_run_on(cfg, samples, steps, checkpointing, Kind::Float, Device::Cpu)
}

/// Per-step (loss, grad norm) of the single-process trainer computing in `kind` on `device`, micro-batch 2.
pub(crate) fn reference_run_on(
    cfg: &ModelConfig,
    samples: &Samples,
    steps: usize,
    checkpointing: bool,
    kind: Kind,
    device: Device,
) -> Vec<(f64, f64)> {
    tch::set_num_threads(1);
    let (layout, params) = init(cfg);
    let params = params.iter().map(|t| t.to_device(device)).collect();
    let store = LocalParams::new(layout, params, kind);
    let optimizer = AdamW::new(adam(), store.master());
    let mut s = stepper_on(cfg, store, optimizer, 2, checkpointing, 0, kind, device);
    (0..steps)
        .map(|step| {
            let batch = samples.refs(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH);
            let st = s.step(&batch).unwrap();
            assert!(!st.skipped);
            (st.loss, st.grad_norm)
        })
        .collect()
}

/// This rank's contiguous slice of global batch `step`.
pub(crate) fn rank_slice(step: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let per = GLOBAL_BATCH / world;
    let start = step * GLOBAL_BATCH + rank * per;
    start..start + per
}

static GROUP: AtomicUsize = AtomicUsize::new(0);

/// Connects `world` loopback TCP communicators (one per rank) and runs `body(rank, comm)` on one thread per rank;
/// returns the results in rank order.
pub(crate) fn run_ranks<T: Send + 'static>(
    world: usize,
    body: impl Fn(usize, Arc<dyn Communicator>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let rdv = Arc::new(MemoryRendezvous::new());
    let prefix = format!("fsdp-test-{}", GROUP.fetch_add(1, Ordering::SeqCst));
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let rdv = rdv.clone();
            let body = body.clone();
            let options = GroupOptions {
                prefix: prefix.clone(),
                ..GroupOptions::default()
            };
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let comm: Arc<dyn Communicator> =
                    Arc::new(TcpCommunicator::connect(rank, world, rdv, &options).unwrap());
                body(rank, comm)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Deep copies of `params` (tensors are not shared between rank threads).
pub(crate) fn copies(params: &[Tensor]) -> Vec<Tensor> {
    params.iter().map(Tensor::copy).collect()
}

/// Per-step global (loss, grad norm) of a `world`-rank run with `opts`, micro-batch 1 (gradient accumulation on every
/// rank), as seen by every rank.
pub(crate) fn sharded_run(
    cfg: &ModelConfig,
    samples: Arc<Samples>,
    steps: usize,
    checkpointing: bool,
    world: usize,
    opts: FsdpOptions,
) -> Vec<Vec<(f64, f64)>> {
    let (layout, params) = init(cfg);
    let params = Arc::new(std::sync::Mutex::new(params));
    let cfg = cfg.clone();
    run_ranks(world, move |rank, comm| {
        let mine = copies(&params.lock().unwrap());
        let store = ShardedParams::new(layout.clone(), &mine, comm, opts).unwrap();
        let optimizer = AdamW::new(adam(), store.trainable_masters());
        let mut s = stepper_on(
            &cfg,
            store,
            optimizer,
            1,
            checkpointing,
            0,
            opts.compute_kind,
            opts.device,
        );
        (0..steps)
            .map(|step| {
                let batch = samples.refs(rank_slice(step, rank, world));
                let st = global_step(&mut s, &batch).unwrap();
                assert!(!st.skipped);
                (st.loss, st.grad_norm)
            })
            .collect()
    })
}

/// Asserts two curves agree within `rel` relative, naming the step and quantity that differs.
pub(crate) fn assert_close(what: &str, got: &[(f64, f64)], want: &[(f64, f64)], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: number of steps");
    let mut worst = 0.0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        for (name, a, b) in [("loss", g.0, w.0), ("grad_norm", g.1, w.1)] {
            let err = (a - b).abs() / b.abs().max(1e-12);
            worst = worst.max(err);
            assert!(
                err <= rel,
                "{what}: step {} {name} {a} vs reference {b} (relative error {err:.2e})",
                i + 1
            );
        }
    }
    eprintln!("{what}: largest relative difference {worst:.2e}");
}
