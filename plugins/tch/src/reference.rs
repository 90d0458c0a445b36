//! The plain-tch definitions of the `liger` ops: what the kernels must equal, and what runs when they are off.

use crate::Reduction;
use tch::{Kind, Tensor};

/// `cross_entropy(hidden @ weight^T, targets)` with the full `[N, V]` logits, ignoring `ignore_index` targets.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
    reduction: Reduction,
) -> Tensor {
    let logits = hidden.matmul(&weight.tr());
    let r = match reduction {
        Reduction::Sum => tch::Reduction::Sum,
        Reduction::Mean => tch::Reduction::Mean,
    };
    logits.cross_entropy_loss::<Tensor>(targets, None, r, ignore_index, 0.0)
}

/// `x / sqrt(mean(x^2, last dim) + eps) * weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let rstd = (x.square().mean_dim([-1i64].as_slice(), true, None::<Kind>) + eps).rsqrt();
    x * rstd * weight
}

/// `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    gate.silu() * up
}
