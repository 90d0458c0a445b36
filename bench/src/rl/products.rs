//! The weight products of one decode step, sgemm beside ferl's kernel ([`ferl::trainer::model::skinny`]): every
//! projection matrix of every decoder layer (q, k, v, o, gate, up, down: separate random matrices per layer, so that,
//! as in a real step, they come from memory, not from the caches) and the output matrix, each times `--batch` rows,
//! `W·xᵀ`. sgemm and each kernel the CPU runs (AVX2, and AVX-512 where it has it) take turns, [`ROUNDS`] times, and
//! each reports its median. Rows `gen_step_products_ms_{sgemm,avx2,avx512}_<model>` and
//! `gen_step_products_GBps_<side>_<model>` (weight bytes read ÷ time).

use super::median;
use crate::report::Report;
use ferl::trainer::model::config::ModelConfig;
use ferl::trainer::model::skinny::{self, KernelIsa};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Timed passes per side.
const ROUNDS: usize = 5;

/// One product: a weight matrix, the rows it multiplies and the output it is written into.
struct Product {
    w: Tensor,
    x: Tensor,
    out: Tensor,
}

/// Measures sgemm and every kernel this CPU runs (an AVX-512 CPU runs the AVX2 one too) on `cfg`'s shapes with
/// `batch` rows, taking turns, and prints the rows.
pub(super) fn run(name: &str, cfg: &ModelConfig, batch: i64, out: &mut Report) {
    let products = step_products(cfg, batch);
    let bytes: i64 = products.iter().map(|p| p.w.numel() as i64 * 4).sum();
    let sides: Vec<Option<KernelIsa>> = [None, Some(KernelIsa::Avx2), Some(KernelIsa::Avx512)]
        .into_iter()
        .filter(|side| {
            side.is_none_or(|isa| skinny::cpu_kernel_isa().is_some_and(|cpu| cpu >= isa))
        })
        .collect();
    let pass = |isa: Option<KernelIsa>| {
        let started = Instant::now();
        for p in &products {
            let _ = skinny::w_xt_out_with(isa, &p.out, &p.w, &p.x);
        }
        started.elapsed().as_secs_f64()
    };
    let mut times = vec![Vec::new(); sides.len()];
    // One untimed pass per side warms caches and the allocator.
    for side in &sides {
        pass(*side);
    }
    for _ in 0..ROUNDS {
        for (side, t) in sides.iter().zip(&mut times) {
            t.push(pass(*side));
        }
    }
    for (side, t) in sides.iter().zip(times) {
        let seconds = median(t);
        let label = side.map_or("sgemm", KernelIsa::name);
        out.row(
            &format!("gen_step_products_ms_{label}_{name}"),
            seconds * 1e3,
            "ms",
        );
        out.row(
            &format!("gen_step_products_GBps_{label}_{name}"),
            bytes as f64 / seconds / 1e9,
            "GB/s",
        );
    }
}

/// Every weight product of one decode step of `cfg` with `batch` rows.
fn step_products(cfg: &ModelConfig, batch: i64) -> Vec<Product> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    let layer = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)];
    let shapes = (0..cfg.num_layers)
        .flat_map(|_| layer)
        .chain([(cfg.vocab_size, h)]);
    shapes
        .map(|(rows, cols)| Product {
            w: Tensor::randn([rows, cols], (Kind::Float, Device::Cpu)),
            x: Tensor::randn([batch, cols], (Kind::Float, Device::Cpu)),
            out: Tensor::empty([rows, batch], (Kind::Float, Device::Cpu)),
        })
        .collect()
}
