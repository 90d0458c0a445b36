//! `rms_norm`: `y = x * rsqrt(mean(x^2, last dim) + eps) * weight`.
//!
//! Inputs: `x [..., H]`, `weight [H]`. Attributes: `[eps = 1e-6]`. Output: `y`. Saved: `rstd [..., 1]`.
//! Backward, with `xn = x * rstd` and `gn = dy * weight`:
//! `dx = rstd * (gn - xn * mean(gn * xn, last dim))`, `dweight = sum over rows of dy * xn`.

use crate::attr;
use ferl_plugin_abi::kernel::KernelOpImpl;
use ferl_plugin_abi::tensor::{Host, Tensor};

/// The op (see the module docs).
pub struct RmsNorm;

impl KernelOpImpl for RmsNorm {
    const NAME: &'static str = "rms_norm";
    const N_INPUTS: u32 = 2;
    const N_OUTPUTS: u32 = 1;
    const N_SAVED: u32 = 1;

    fn forward<'h>(
        _host: &'h Host,
        inputs: &[Tensor<'h>],
        attrs: &[f64],
    ) -> Result<Vec<Tensor<'h>>, String> {
        let (x, w) = (&inputs[0], &inputs[1]);
        let eps = attr(attrs, 0, 1e-6);
        let rstd = x.square()?.mean(-1, true)?.add_scalar(eps)?.rsqrt()?;
        let y = x.mul(&rstd)?.mul(w)?;
        Ok(vec![y, rstd])
    }

    fn backward<'h>(
        _host: &'h Host,
        grad_outputs: &[Tensor<'h>],
        inputs: &[Tensor<'h>],
        saved: &[Tensor<'h>],
        _attrs: &[f64],
    ) -> Result<Vec<Option<Tensor<'h>>>, String> {
        let (dy, x, w, rstd) = (&grad_outputs[0], &inputs[0], &inputs[1], &saved[0]);
        let h = *x
            .shape()?
            .last()
            .ok_or("rms_norm: x must have at least one dimension")?;
        let xn = x.mul(rstd)?;
        let gn = dy.mul(w)?;
        let dx = gn.sub(&xn.mul(&gn.mul(&xn)?.mean(-1, true)?)?)?.mul(rstd)?;
        let dw = dy.mul(&xn)?.reshape(&[-1, h])?.sum(0, false)?;
        Ok(vec![Some(dx), Some(dw)])
    }
}
