//! `swiglu`: `y = silu(gate) * up` with `silu(a) = a * sigmoid(a)`.
//!
//! Inputs: `gate`, `up` (same shape). No attributes. Output: `y`. Nothing saved (backward recomputes the sigmoid).
//! Backward, with `s = sigmoid(gate)`: `dup = dy * gate * s`, `dgate = dy * up * s * (1 + gate * (1 - s))`.

use ferl_plugin_abi::kernel::KernelOpImpl;
use ferl_plugin_abi::tensor::{Host, Tensor};

/// The op (see the module docs).
pub struct SwiGlu;

impl KernelOpImpl for SwiGlu {
    const NAME: &'static str = "swiglu";
    const N_INPUTS: u32 = 2;
    const N_OUTPUTS: u32 = 1;
    const N_SAVED: u32 = 0;

    fn forward<'h>(
        _host: &'h Host,
        inputs: &[Tensor<'h>],
        _attrs: &[f64],
    ) -> Result<Vec<Tensor<'h>>, String> {
        Ok(vec![inputs[0].silu()?.mul(&inputs[1])?])
    }

    fn backward<'h>(
        _host: &'h Host,
        grad_outputs: &[Tensor<'h>],
        inputs: &[Tensor<'h>],
        _saved: &[Tensor<'h>],
        _attrs: &[f64],
    ) -> Result<Vec<Option<Tensor<'h>>>, String> {
        let (dy, gate, up) = (&grad_outputs[0], &inputs[0], &inputs[1]);
        let s = gate.sigmoid()?;
        let silu = gate.mul(&s)?;
        let dup = dy.mul(&silu)?;
        // d silu / d gate = s + gate * s * (1 - s) = s * (1 + gate * (1 - s))
        let one_minus_s = s.neg()?.add_scalar(1.0)?;
        let dsilu = s.mul(&gate.mul(&one_minus_s)?.add_scalar(1.0)?)?;
        let dgate = dy.mul(up)?.mul(&dsilu)?;
        Ok(vec![Some(dgate), Some(dup)])
    }
}
