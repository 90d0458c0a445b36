//! The op-override hook: which implementation the model runs for RMSNorm, the SwiGLU activation and the head's
//! projection + cross-entropy.
//!
//! A [`KernelRegistry`] holds an optional replacement per op; the engine consults it for every decoder layer (both
//! RMSNorms and the MLP activation), the final norm and the training head, and runs the built-in tch op for every
//! slot that is empty. `model.use_liger=true` fills all three slots with the `liger` kernel plugin (adapted by
//! `ferl-plugin-bridge`); a default registry is the built-in model.
//!
//! Kernels compute their gradients themselves (a plugin cannot join libtorch's autograd graph), so each trait has an
//! explicit forward and backward. The engine splits a decoder layer at the replaced ops (see `model::graph`): autograd
//! runs the pieces between them, the kernel's backward runs the op itself. That works the same with gradient
//! checkpointing (the layer is rebuilt from its saved input in backward) and in bf16 (the engine hands kernels fp32
//! tensors and casts their results back to the compute dtype, like the built-in RMSNorm does).

use anyhow::Result;
use std::sync::Arc;
use tch::Tensor;

/// A replacement for the training head's projection + cross-entropy (e.g. the `liger` kernel plugin's fused op):
/// from the normalised target rows `x [n, H]`, the output matrix `w [V, H]` and the targets `[n]`, returns the
/// *summed* cross-entropy (0-d) and its gradients with respect to `x` and `w`.
pub trait HeadLoss: Send + Sync {
    /// `(sum of CE, d/dx, d/dw)`.
    fn sum_loss_and_grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)>;
}

/// A replacement for RMSNorm, `y = x * rsqrt(mean(x^2, last dim) + eps) * weight`.
pub trait RmsNormKernel: Send + Sync {
    /// `y` and the tensors the backward needs (kept by the engine between the two calls).
    fn forward(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Vec<Tensor>)>;
    /// `(dx, dweight)` for the output gradient `dy`, given the forward's inputs and saved tensors.
    fn backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        weight: &Tensor,
        saved: &[Tensor],
    ) -> Result<(Tensor, Tensor)>;
}

/// A replacement for the SwiGLU activation of the MLP, `y = silu(gate) * up`.
pub trait SwiGluKernel: Send + Sync {
    /// `y`.
    fn forward(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor>;
    /// `(dgate, dup)` for the output gradient `dy`.
    fn backward(&self, dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)>;
}

/// The model's op overrides; an empty slot runs the built-in op.
#[derive(Clone, Default)]
pub struct KernelRegistry {
    /// RMSNorm of every decoder layer and of the head.
    pub rms_norm: Option<Arc<dyn RmsNormKernel>>,
    /// The MLP activation of every decoder layer.
    pub swiglu: Option<Arc<dyn SwiGluKernel>>,
    /// The training head's projection + cross-entropy.
    pub head: Option<Arc<dyn HeadLoss>>,
}

impl KernelRegistry {
    /// The built-in ops only.
    pub fn builtin() -> Self {
        Self::default()
    }

    /// Whether every slot is empty.
    pub fn is_builtin(&self) -> bool {
        self.rms_norm.is_none() && self.swiglu.is_none() && self.head.is_none()
    }

    /// Whether a decoder layer has a replaced op (so it runs split at the kernels instead of as one autograd graph).
    pub fn overrides_layer_ops(&self) -> bool {
        self.rms_norm.is_some() || self.swiglu.is_some()
    }

    /// The names of the replaced ops, e.g. `["rms_norm", "swiglu", "head"]` (for logs).
    pub fn replaced(&self) -> Vec<&'static str> {
        [
            ("rms_norm", self.rms_norm.is_some()),
            ("swiglu", self.swiglu.is_some()),
            ("head", self.head.is_some()),
        ]
        .into_iter()
        .filter_map(|(n, on)| on.then_some(n))
        .collect()
    }
}

impl std::fmt::Debug for KernelRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelRegistry")
            .field("replaced", &self.replaced())
            .finish()
    }
}
