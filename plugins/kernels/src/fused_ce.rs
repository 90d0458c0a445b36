//! `fused_linear_cross_entropy`: the output projection and the cross-entropy loss in one op that never holds the
//! `[tokens, vocab]` logits: rows are processed in chunks; each chunk's logits are turned in place into the gradient
//! of the loss with respect to them, which is immediately projected back to the gradients of `hidden` and `weight`.
//! Backward only scales those saved gradients by the incoming loss gradient.
//!
//! Inputs: `hidden [N, H]`, `weight [V, H]`, `targets [N]` (int64). Attributes:
//! `[ignore_index = -100, reduction = 1 (0: sum, 1: mean over non-ignored targets), chunk_rows = 0 (0: automatic),
//! mixed = 0]`. Output: the loss (0-d). Saved: `d loss / d hidden`, `d loss / d weight`. With `reduction = mean` and
//! no target left, the loss and its gradients are 0 (torch would return NaN).
//!
//! Mixed precision (`mixed = 1`, e.g. fp32 `hidden` and a bf16 `weight`): the matrix products run in `weight`'s
//! dtype, while the logits' softmax, the loss and both gradients are computed and accumulated in `hidden`'s dtype
//! (the gradient of `weight` is returned in `hidden`'s dtype). With one dtype everywhere (`mixed = 0`) nothing is cast.
//!
//! Memory: one `[chunk_rows, V]` buffer plus the gradients (`[N, H]` and `[V, H]`), instead of several `[N, V]`.

use crate::attr;
use ferl_plugin_abi::kernel::{KernelOpImpl, REDUCE_ALL};
use ferl_plugin_abi::tensor::{Host, Tensor};

/// The op (see the module docs).
pub struct FusedLinearCrossEntropy;

/// Elements of one logits chunk when `chunk_rows` is automatic (2^25 floats: 128 MiB in fp32).
pub const AUTO_CHUNK_ELEMENTS: i64 = 1 << 25;

/// Rows per chunk for `n` rows over a vocabulary of `v`, given the requested `chunk_rows` (0: automatic).
pub fn chunk_rows(requested: f64, n: i64, v: i64) -> i64 {
    let rows = if requested >= 1.0 {
        requested as i64
    } else {
        (AUTO_CHUNK_ELEMENTS / v.max(1)).max(1)
    };
    rows.min(n.max(1))
}

fn dims2(t: &Tensor<'_>, what: &str) -> Result<(i64, i64), String> {
    match t.shape()?.as_slice() {
        [a, b] => Ok((*a, *b)),
        s => Err(format!(
            "fused_linear_cross_entropy: {what} must be 2-d, got shape {s:?}"
        )),
    }
}

impl KernelOpImpl for FusedLinearCrossEntropy {
    const NAME: &'static str = "fused_linear_cross_entropy";
    const N_INPUTS: u32 = 3;
    const N_OUTPUTS: u32 = 1;
    const N_SAVED: u32 = 2;

    fn forward<'h>(
        _host: &'h Host,
        inputs: &[Tensor<'h>],
        attrs: &[f64],
    ) -> Result<Vec<Tensor<'h>>, String> {
        let (hidden, weight, targets) = (&inputs[0], &inputs[1], &inputs[2]);
        let (n, h) = dims2(hidden, "hidden")?;
        let (v, hw) = dims2(weight, "weight")?;
        if h != hw {
            return Err(format!(
                "fused_linear_cross_entropy: hidden is [{n}, {h}] but weight is [{v}, {hw}]"
            ));
        }
        if targets.shape()? != [n] {
            return Err(format!(
                "fused_linear_cross_entropy: targets must be [{n}], got {:?}",
                targets.shape()?
            ));
        }
        let ignore_index = attr(attrs, 0, -100.0);
        let mean = attr(attrs, 1, 1.0) != 0.0;
        let rows = chunk_rows(attr(attrs, 2, 0.0), n, v);
        let mixed = attr(attrs, 3, 0.0) != 0.0;

        let mask = targets.ne_scalar(ignore_index)?; // int64 1/0
        let safe_targets = targets.mul(&mask)?; // ignored rows point at class 0, masked out below
        let mask_f = mask.cast_like(hidden)?;
        let n_valid = mask_f.sum(REDUCE_ALL, false)?.to_f64()?;
        let scale = if !mean {
            1.0
        } else if n_valid > 0.0 {
            1.0 / n_valid
        } else {
            0.0
        };

        let grad_hidden = hidden.zeros_like()?;
        let grad_weight = if mixed {
            weight.zeros_like()?.cast_like(hidden)?
        } else {
            weight.zeros_like()?
        };
        let row_loss = mask_f.zeros_like()?;
        let mut start = 0;
        while start < n {
            let len = rows.min(n - start);
            let hc = hidden.narrow(0, start, len)?;
            let tc = safe_targets.narrow(0, start, len)?.reshape(&[len, 1])?;
            let mc = mask_f.narrow(0, start, len)?.reshape(&[len, 1])?;
            // The rows in the matmul dtype (a no-op cast without `mixed`).
            let hm = if mixed { hc.cast_like(weight)? } else { hc };
            // logits, then the loss per row: logsumexp - logit of the target, zero where ignored.
            let logits = hm.matmul(weight, false, true)?;
            let logits = if mixed {
                logits.cast_like(hidden)?
            } else {
                logits
            };
            let lse = logits.logsumexp(1, true)?;
            let loss_c = lse
                .sub(&logits.gather(1, &tc)?)?
                .mul(&mc)?
                .reshape(&[len])?;
            row_loss.copy_into(0, start, &loss_c)?;
            // In place: logits -> softmax -> softmax - onehot(target) = d row_loss / d logits. The mask and the
            // scale are applied to the [len, H] factors instead of this [len, V] buffer (one pass fewer over it).
            logits.sub_into(&lse)?;
            logits.exp_into()?;
            logits.scatter_add_into(1, &tc, &mc.neg()?)?;
            let row_scale = mc.mul_scalar(scale)?;
            if mixed {
                // Products in the weight's dtype, added into the accumulation dtype.
                let gl = logits.cast_like(weight)?;
                drop(logits);
                let gh = gl.matmul(weight, false, false)?.cast_like(hidden)?;
                grad_hidden.copy_into(0, start, &gh.mul(&row_scale)?)?;
                let scaled = hm.mul(&row_scale.cast_like(weight)?)?;
                grad_weight.add_into(&gl.matmul(&scaled, true, false)?)?;
            } else {
                grad_hidden.copy_into(
                    0,
                    start,
                    &logits.matmul(weight, false, false)?.mul(&row_scale)?,
                )?;
                grad_weight.addmm_into(&logits, &hm.mul(&row_scale)?, true, false)?;
            }
            start += len;
        }
        let loss = row_loss.sum(REDUCE_ALL, false)?.mul_scalar(scale)?;
        Ok(vec![loss, grad_hidden, grad_weight])
    }

    fn backward<'h>(
        _host: &'h Host,
        grad_outputs: &[Tensor<'h>],
        _inputs: &[Tensor<'h>],
        saved: &[Tensor<'h>],
        _attrs: &[f64],
    ) -> Result<Vec<Option<Tensor<'h>>>, String> {
        let g = &grad_outputs[0];
        Ok(vec![Some(saved[0].mul(g)?), Some(saved[1].mul(g)?), None])
    }
}

#[cfg(test)]
mod tests {
    use super::chunk_rows;

    #[test]
    fn chunk_rows_respects_request_and_bounds() {
        assert_eq!(chunk_rows(64.0, 1000, 151_936), 64);
        assert_eq!(chunk_rows(64.0, 10, 151_936), 10);
        assert_eq!(chunk_rows(0.0, 4096, 151_936), (1 << 25) / 151_936);
        assert_eq!(chunk_rows(0.0, 4096, 1 << 30), 1);
    }
}
