//! ferl's fused kernels, written once against the plugin ABI's host tensor operations
//! ([`ferl_plugin_abi::kernel::HostOps`]) so they serve two ways:
//!
//! - **built in**: a host links this crate and hands [`LIGER_TABLE`] to `ferl-plugin-host` without any file;
//! - **as a plugin**: `ferl-plugin-liger` exports the same table from a `cdylib` that can be replaced while a job runs.
//!
//! The ops (named like Liger-Kernel's, whose idea they follow; `model.use_liger=true` turns them on):
//! - [`fused_ce::FusedLinearCrossEntropy`] `fused_linear_cross_entropy`: `hidden @ weight^T` then cross-entropy,
//!   chunked over rows so the `[tokens, vocab]` logits never exist at once; gradients are computed in the forward pass.
//! - [`rms_norm::RmsNorm`] `rms_norm`: `x / sqrt(mean(x^2) + eps) * weight`.
//! - [`swiglu::SwiGlu`] `swiglu`: `silu(gate) * up`.

pub mod fused_ce;
pub mod rms_norm;
pub mod swiglu;

use ferl_plugin_abi::kernel::{kernel_op, kernel_table, KernelOp, KernelVTable};
use ferl_plugin_abi::Plugin;

/// The kernel plugin's identity (`liger`). Its version is the crate's, or `FERL_LIGER_VERSION` at build time (so a
/// test can build two versions of the same kernels and switch between them in a running job).
pub struct Liger;

impl Plugin for Liger {
    const NAME: &'static str = "liger";
    const VERSION: &'static str = match option_env!("FERL_LIGER_VERSION") {
        Some(v) => v,
        None => env!("CARGO_PKG_VERSION"),
    };
    const DESCRIPTION: &'static str =
        "fused linear+cross-entropy, RMSNorm and SwiGLU over host tensor ops";
}

static LIGER_OPS: [KernelOp; 3] = [
    kernel_op::<fused_ce::FusedLinearCrossEntropy>(),
    kernel_op::<rms_norm::RmsNorm>(),
    kernel_op::<swiglu::SwiGlu>(),
];

/// The table of all three ops.
pub static LIGER_TABLE: KernelVTable = kernel_table(&LIGER_OPS);

/// Reads attribute `i`, or `default` when the caller passed fewer.
pub(crate) fn attr(attrs: &[f64], i: usize, default: f64) -> f64 {
    attrs.get(i).copied().unwrap_or(default)
}
