//! [`Kernels`]: the `liger` kernel plugin's ops as tch functions.
//!
//! Autograd: a plugin computes gradients itself, and tch offers no custom autograd functions, so
//! - `fused_linear_cross_entropy` returns a loss whose graph is `loss + (s - s.detach())` with
//!   `s = sum(hidden * dhidden) + sum(weight * dweight)` (the gradients the kernel computed): its value is the loss
//!   exactly and its gradients are the kernel's, scaled by whatever multiplies the loss downstream;
//! - `swiglu` is element-wise, so `y + sum_i (input_i - input_i.detach()) * dy/dinput_i` does the same;
//! - `rms_norm` couples a row's elements, so it is offered as explicit forward/backward
//!   ([`Kernels::rms_norm_forward`], [`Kernels::rms_norm_backward`]) for engines that run their own backward.

use crate::host_ops::{from_handle, into_handle, tch_host_ops};
use anyhow::{anyhow, Result};
use ferl_plugin_abi::kernel::TensorHandle;
use ferl_plugin_host::{KernelOpRef, LoadedPlugin, PluginHost, PluginKind};
use std::sync::Arc;
use tch::Tensor;

/// How the cross-entropy of many targets is reduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Sum over the non-ignored targets (the trainer divides by the global token count itself).
    Sum,
    /// Mean over the non-ignored targets.
    Mean,
}

/// What `rms_norm`'s forward keeps for its backward (`rstd`, one value per row).
pub struct RmsNormSaved {
    rstd: Tensor,
}

impl RmsNormSaved {
    /// The saved tensors, in the op's order (for callers that keep them in a list).
    pub fn into_tensors(self) -> Vec<Tensor> {
        vec![self.rstd]
    }

    /// Back from [`RmsNormSaved::into_tensors`].
    pub fn from_tensors(saved: &[Tensor]) -> Result<Self> {
        match saved {
            [rstd] => Ok(Self {
                rstd: rstd.shallow_clone(),
            }),
            _ => Err(anyhow!(
                "rms_norm backward: expected 1 saved tensor (rstd), got {}",
                saved.len()
            )),
        }
    }
}

/// The three `liger` ops of one kernel plugin version. `Send + Sync`: the [`ferl_plugin_abi::kernel::HostOps`]
/// table a call lends the plugin is made per call (it is stateless).
pub struct Kernels {
    fused_ce: KernelOpRef,
    rms_norm: KernelOpRef,
    swiglu: KernelOpRef,
}

/// The name of the kernel plugin and of the built-in copy.
pub const LIGER: &str = "liger";

impl Kernels {
    /// The ops of `ferl-kernels` compiled into this binary (no file needed).
    pub fn builtin() -> Result<Self> {
        use ferl_plugin_abi::Plugin;
        let p = LoadedPlugin::builtin_kernel(
            ferl_kernels::Liger::NAME,
            ferl_kernels::Liger::VERSION,
            ferl_kernels::Liger::DESCRIPTION,
            &ferl_kernels::LIGER_TABLE,
        )?;
        Self::from_plugin(Arc::new(p))
    }

    /// The ops of a loaded kernel plugin version (it must provide all three).
    pub fn from_plugin(plugin: Arc<LoadedPlugin>) -> Result<Self> {
        Ok(Self {
            fused_ce: KernelOpRef::find(plugin.clone(), "fused_linear_cross_entropy")?,
            rms_norm: KernelOpRef::find(plugin.clone(), "rms_norm")?,
            swiglu: KernelOpRef::find(plugin, "swiglu")?,
        })
    }

    /// The current version of kernel plugin `name` in `host` (take it once per step for hot reload), or the
    /// built-in ops when the host has no plugin of that name and `name` is `liger`.
    pub fn from_host(host: &PluginHost, name: &str) -> Result<Self> {
        match host.get_kind(name, PluginKind::Kernel) {
            Ok(p) => Self::from_plugin(p),
            Err(_) if name == LIGER && host.get(name).is_none() => Self::builtin(),
            Err(e) => Err(e),
        }
    }

    /// The plugin version serving these ops.
    pub fn plugin(&self) -> &Arc<LoadedPlugin> {
        self.fused_ce.plugin()
    }

    fn forward(&self, op: &KernelOpRef, inputs: &[&Tensor], attrs: &[f64]) -> Result<Vec<Tensor>> {
        let handles: Vec<TensorHandle> = inputs.iter().map(|t| into_handle(t.detach())).collect();
        let r = tch::no_grad(|| op.forward(&tch_host_ops(), &handles, attrs));
        for h in handles {
            // SAFETY: made above, released once.
            drop(unsafe { from_handle(h) });
        }
        // SAFETY: on success every output handle is new and ours.
        Ok(r?.into_iter().map(|h| unsafe { from_handle(h) }).collect())
    }

    fn backward(
        &self,
        op: &KernelOpRef,
        grads: &[&Tensor],
        inputs: &[&Tensor],
        saved: &[&Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let mk = |ts: &[&Tensor]| {
            ts.iter()
                .map(|t| into_handle(t.detach()))
                .collect::<Vec<_>>()
        };
        let (g, i, s) = (mk(grads), mk(inputs), mk(saved));
        let r = tch::no_grad(|| op.backward(&tch_host_ops(), &g, &i, &s, &[]));
        for h in g.into_iter().chain(i).chain(s) {
            // SAFETY: made above, released once.
            drop(unsafe { from_handle(h) });
        }
        // SAFETY: on success every non-null handle is new and ours.
        Ok(r?
            .into_iter()
            .map(|h| (!h.is_null()).then(|| unsafe { from_handle(h) }))
            .collect())
    }

    /// `cross_entropy(hidden [N, H] @ weight [V, H]^T, targets [N])` without the `[N, V]` logits, `chunk_rows` rows
    /// at a time (0: automatic). Differentiable with respect to `hidden` and `weight`.
    pub fn fused_linear_cross_entropy(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
        reduction: Reduction,
        chunk_rows: usize,
    ) -> Result<Tensor> {
        let (loss, dh, dw) = self.fused_linear_cross_entropy_grads(
            hidden,
            weight,
            targets,
            ignore_index,
            reduction,
            chunk_rows,
        )?;
        let mut s: Option<Tensor> = None;
        for (x, g) in [(hidden, &dh), (weight, &dw)] {
            if x.requires_grad() {
                let term = (x * g).sum(None::<tch::Kind>);
                s = Some(match s {
                    Some(acc) => acc + term,
                    None => term,
                });
            }
        }
        Ok(match s {
            Some(s) => &loss + (&s - s.detach()),
            None => loss,
        })
    }

    /// The fused op without autograd: `(loss, d loss / d hidden, d loss / d weight)` (for engines that run their own
    /// backward, such as the trainer's layer-wise head). When `hidden` and `weight` differ in dtype (fp32 rows, bf16
    /// weight) the products run in the weight's dtype and everything else, both gradients included, in the rows'.
    pub fn fused_linear_cross_entropy_grads(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
        reduction: Reduction,
        chunk_rows: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let attrs = [
            ignore_index as f64,
            (reduction == Reduction::Mean) as u8 as f64,
            chunk_rows as f64,
            (hidden.kind() != weight.kind()) as u8 as f64,
        ];
        let mut out = self
            .forward(&self.fused_ce, &[hidden, weight, targets], &attrs)?
            .into_iter();
        Ok((next(&mut out)?, next(&mut out)?, next(&mut out)?))
    }

    /// RMSNorm forward: `y` and what the backward needs.
    pub fn rms_norm_forward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, RmsNormSaved)> {
        let mut out = self
            .forward(&self.rms_norm, &[x, weight], &[eps])?
            .into_iter();
        let y = next(&mut out)?;
        Ok((
            y,
            RmsNormSaved {
                rstd: next(&mut out)?,
            },
        ))
    }

    /// RMSNorm backward: `(dx, dweight)` for the output gradient `dy`.
    pub fn rms_norm_backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        weight: &Tensor,
        saved: &RmsNormSaved,
    ) -> Result<(Tensor, Tensor)> {
        let mut g = self
            .backward(&self.rms_norm, &[dy], &[x, weight], &[&saved.rstd])?
            .into_iter();
        Ok((some(g.next())?, some(g.next())?))
    }

    /// SwiGLU forward without autograd: `silu(gate) * up`.
    pub fn swiglu_forward(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        next(&mut self.forward(&self.swiglu, &[gate, up], &[])?.into_iter())
    }

    /// `silu(gate) * up`, differentiable with respect to both.
    pub fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let y = self.swiglu_forward(gate, up)?;
        if !gate.requires_grad() && !up.requires_grad() {
            return Ok(y);
        }
        // Element-wise op: the local derivatives are the backward of a gradient of ones.
        let (dgate, dup) = self.swiglu_backward(&y.ones_like(), gate, up)?;
        Ok(&y + (gate - gate.detach()) * dgate + (up - up.detach()) * dup)
    }

    /// SwiGLU backward: `(dgate, dup)` for the output gradient `dy`.
    pub fn swiglu_backward(
        &self,
        dy: &Tensor,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let mut g = self
            .backward(&self.swiglu, &[dy], &[gate, up], &[])?
            .into_iter();
        Ok((some(g.next())?, some(g.next())?))
    }
}

fn next(it: &mut impl Iterator<Item = Tensor>) -> Result<Tensor> {
    it.next()
        .ok_or_else(|| anyhow!("kernel op returned fewer tensors than it declares"))
}

fn some(t: Option<Option<Tensor>>) -> Result<Tensor> {
    t.flatten()
        .ok_or_else(|| anyhow!("kernel op returned no gradient where one is required"))
}
