//! `model.use_liger=true`: the `liger` kernel plugin's fused linear + cross-entropy as the trainer's head.

use anyhow::Result;
use ferl_plugin_host::PluginHost;
use ferl_plugin_tch::{Kernels, Reduction};
use ferl_trainer::engine::HeadLoss;
use std::sync::Arc;
use tch::Tensor;

/// The trainer head served by the `liger` kernels: the job's current `liger` plugin version when its host has one
/// (taken at every call, so a reloaded plugin serves the next step), else the copy built into ferl.
pub struct LigerHeadLoss {
    host: Option<Arc<PluginHost>>,
}

impl LigerHeadLoss {
    /// Uses `host`'s `liger` plugin when it has one, the built-in kernels otherwise (or when `host` is `None`).
    pub fn new(host: Option<Arc<PluginHost>>) -> Self {
        Self { host }
    }

    fn kernels(&self) -> Result<Kernels> {
        match &self.host {
            Some(h) => Kernels::from_host(h, "liger"),
            None => Kernels::builtin(),
        }
    }
}

impl HeadLoss for LigerHeadLoss {
    fn sum_loss_and_grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.kernels()?
            .fused_linear_cross_entropy_grads(x, w, targets, -100, Reduction::Sum, 0)
    }
}
