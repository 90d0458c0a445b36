//! The weight products of one decode step, sgemm beside ferl's kernel ([`ferl::trainer::model::skinny`]): every
//! projection matrix of every decoder layer (q, k, v, o, gate, up, down: separate random matrices per layer, so that,
//! as in a real step, they come from memory, not from the caches) and the output matrix, each times `--batch` rows,
//! `W·xᵀ`. The two take turns, [`ROUNDS`] times, and each reports its median. Rows
//! `gen_step_products_ms_{sgemm,kernel}_<model>` and the kernel's `gen_step_products_GBps_kernel_<model>` (weight bytes
//! read ÷ time); on a CPU without AVX-512F the kernel row is sgemm again.

use super::median;
use crate::report::Report;
use ferl::trainer::model::config::ModelConfig;
use ferl::trainer::model::skinny;
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

/// Measures both sides on `cfg`'s shapes with `batch` rows and prints the rows.
pub(super) fn run(name: &str, cfg: &ModelConfig, batch: i64, out: &mut Report) {
    let products = step_products(cfg, batch);
    let bytes: i64 = products.iter().map(|p| p.w.numel() as i64 * 4).sum();
    let pass = |kernel: bool| {
        let started = Instant::now();
        for p in &products {
            if kernel {
                let _ = skinny::w_xt_out(&p.out, &p.w, &p.x);
            } else {
                let _ = p.w.mm_out(&p.out, &p.x.tr());
            }
        }
        started.elapsed().as_secs_f64()
    };
    let (mut sgemm, mut kernel) = (Vec::new(), Vec::new());
    pass(false);
    pass(true);
    for _ in 0..ROUNDS {
        sgemm.push(pass(false));
        kernel.push(pass(true));
    }
    let (sgemm, kernel) = (median(sgemm), median(kernel));
    out.row(
        &format!("gen_step_products_ms_sgemm_{name}"),
        sgemm * 1e3,
        "ms",
    );
    out.row(
        &format!("gen_step_products_ms_kernel_{name}"),
        kernel * 1e3,
        "ms",
    );
    out.row(
        &format!("gen_step_products_GBps_kernel_{name}"),
        bytes as f64 / kernel / 1e9,
        "GB/s",
    );
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
