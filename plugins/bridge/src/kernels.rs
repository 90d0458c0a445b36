//! `model.use_liger=true`: the `liger` kernel plugin's RMSNorm, SwiGLU and fused linear + cross-entropy as the
//! trainer's op overrides ([`ferl_trainer::kernels::KernelRegistry`]).

use anyhow::Result;
use ferl_plugin_host::PluginHost;
use ferl_plugin_tch::kernels::LIGER;
use ferl_plugin_tch::{Kernels, Reduction, RmsNormSaved};
use ferl_trainer::kernels::{HeadLoss, KernelRegistry, RmsNormKernel, SwiGluKernel};
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// The `liger` ops for the trainer: the job's current `liger` plugin version when its host has one (looked up at
/// every call, so a version switched in at a step boundary serves the next step), else the copy built into ferl.
/// The ops of a version are resolved once and reused until the host switches versions.
pub struct LigerKernels {
    host: Option<Arc<PluginHost>>,
    /// `(generation of the host's plugin, or None for the built-in copy; its ops)`.
    cache: Mutex<Option<(Option<u64>, Arc<Kernels>)>>,
}

impl LigerKernels {
    /// Uses `host`'s `liger` plugin when it has one, the built-in kernels otherwise (or when `host` is `None`).
    pub fn new(host: Option<Arc<PluginHost>>) -> Self {
        Self {
            host,
            cache: Mutex::new(None),
        }
    }

    /// The ops serving this call.
    pub fn current(&self) -> Result<Arc<Kernels>> {
        let plugin = self.host.as_ref().and_then(|h| h.current(LIGER));
        let key = plugin.as_ref().map(|(generation, _)| *generation);
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((k, kernels)) = cache.as_ref() {
            if *k == key {
                return Ok(kernels.clone());
            }
        }
        let kernels = Arc::new(match plugin {
            Some((_, p)) => Kernels::from_plugin(p)?,
            None => Kernels::builtin()?,
        });
        *cache = Some((key, kernels.clone()));
        Ok(kernels)
    }
}

/// All three `liger` ops as the trainer's op overrides (what `model.use_liger=true` runs), served by `host`'s
/// `liger` plugin when it has one, else by the built-in kernels.
pub fn liger_kernels(host: Option<Arc<PluginHost>>) -> KernelRegistry {
    let k = Arc::new(LigerKernels::new(host));
    KernelRegistry {
        rms_norm: Some(k.clone()),
        swiglu: Some(k.clone()),
        head: Some(k),
    }
}

impl HeadLoss for LigerKernels {
    fn sum_loss_and_grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        // Low-precision compute: fp32 rows make the kernel keep the softmax, the loss and the gradients in fp32 while
        // its products stay in the weight's dtype (as the built-in head does).
        let rows = x.to_kind(Kind::Float);
        let (loss, gx, gw) = self.current()?.fused_linear_cross_entropy_grads(
            &rows,
            w,
            targets,
            -100,
            Reduction::Sum,
            0,
        )?;
        Ok((loss, gx.to_kind(x.kind()), gw))
    }
}

impl RmsNormKernel for LigerKernels {
    fn forward(&self, x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Vec<Tensor>)> {
        let (y, saved) = self.current()?.rms_norm_forward(x, weight, eps)?;
        Ok((y, saved.into_tensors()))
    }

    fn backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        weight: &Tensor,
        saved: &[Tensor],
    ) -> Result<(Tensor, Tensor)> {
        let saved = RmsNormSaved::from_tensors(saved)?;
        self.current()?.rms_norm_backward(dy, x, weight, &saved)
    }
}

impl SwiGluKernel for LigerKernels {
    fn forward(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        self.current()?.swiglu_forward(gate, up)
    }

    fn backward(&self, dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
        self.current()?.swiglu_backward(dy, gate, up)
    }
}
