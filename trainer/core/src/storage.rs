//! Freeing a tensor's storage while tensors (and autograd graphs) keep referring to it, and filling it again: what
//! FULL_SHARD needs without gradient checkpointing (design note 14).
//!
//! A decoder layer's forward saves, in its autograd graph, views of the gathered flat parameter buffer. Dropping the
//! store's handle would not free anything: the graph keeps the buffer alive until backward. Instead, as FSDP2 does
//! with `untyped_storage().resize_(0)`, [`free_storage`] releases the *bytes* of the buffer's storage (the allocator
//! gets them back at once) and keeps the storage object, so every view — the graph's included — now holds 0 bytes.
//! Before backward, [`refill_storage`] gives the storage the freshly all-gathered values: the gathered tensor's
//! allocation moves over without a copy when nothing else uses it, and the saved graph sees its parameters again.
//! [`vjp_with_grads`] back-propagates from outputs whose own bytes were freed (it reads none of their values).
//!
//! # Invariants
//! 1. Between [`free_storage`] and [`refill_storage`] nothing may read the storage (a read fails or crashes); the
//!    store that owns the buffer guarantees it by refilling before it hands the stage's parameters out again.
//! 2. Refilling never bumps the autograd version counter of the tensors over the storage, so a graph saved before
//!    the free back-propagates after the refill as if the bytes had never left (the tests check the gradients are
//!    bit-identical).

use anyhow::{bail, Result};
use std::ffi::{c_char, c_int, CStr};
use tch::Tensor;
use torch_sys::C_tensor;

extern "C" {
    fn ferl_storage_nbytes(t: *const C_tensor) -> i64;
    fn ferl_storage_free(t: *const C_tensor) -> i64;
    fn ferl_storage_refill(
        dst: *const C_tensor,
        src: *const C_tensor,
        stolen: *mut c_int,
    ) -> *mut c_char;
    fn ferl_storage_message_free(message: *mut c_char);
    fn ferl_vjp(
        outputs: *const *const C_tensor,
        grads: *const *const C_tensor,
        n: i64,
        inputs: *const *const C_tensor,
        m: i64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
}

/// The message a C++ shim of this crate returned on failure (copied, and the C string freed), or `None` on success
/// (null). Every shim (`csrc/*.cpp`) returns its failures as a `malloc`'d string.
///
/// # Safety
/// `err` is null or a string a shim returned that nothing else frees.
pub(crate) unsafe fn take_shim_message(err: *mut c_char) -> Option<String> {
    if err.is_null() {
        return None;
    }
    // SAFETY: as the caller promises, `err` is a live NUL-terminated string owned by nobody else.
    unsafe {
        let message = CStr::from_ptr(err).to_string_lossy().into_owned();
        ferl_storage_message_free(err);
        Some(message)
    }
}

/// Bytes `t`'s storage holds now (0 for a freed storage or an undefined tensor).
pub fn storage_nbytes(t: &Tensor) -> i64 {
    // SAFETY: `t` is a live tch tensor (`at::Tensor*`) for the duration of the call.
    unsafe { ferl_storage_nbytes(t.as_ptr()) }
}

/// Frees the bytes of `t`'s storage, keeping the storage object that `t`, its views and any autograd graph refer to
/// (invariant 1: nothing may read it until [`refill_storage`]). Returns the bytes freed.
pub fn free_storage(t: &Tensor) -> Result<i64> {
    // SAFETY: `t` is a live tch tensor for the duration of the call.
    let n = unsafe { ferl_storage_free(t.as_ptr()) };
    if n < 0 {
        bail!("free_storage: the tensor has no storage");
    }
    Ok(n)
}

/// Gives `dst`'s storage (freed or not) the values of `src`: same dtype, device and element count, `dst` contiguous
/// from its storage's start. `src`'s allocation moves over when `src` is its only user and of the right size (returns
/// `true`); otherwise the bytes are allocated and copied (`false`). Views of `dst` and graphs saved over them see the
/// new values; their autograd version counter is unchanged (invariant 2).
pub fn refill_storage(dst: &Tensor, src: Tensor) -> Result<bool> {
    let mut stolen: c_int = 0;
    // SAFETY: both pointers are live tch tensors for the duration of the call; a returned message is malloc'd by the
    // callee and freed here.
    unsafe {
        let err = ferl_storage_refill(dst.as_ptr(), src.as_ptr(), &mut stolen);
        if let Some(message) = take_shim_message(err) {
            bail!("refilling a freed parameter buffer: {message}");
        }
    }
    Ok(stolen != 0)
}

/// The gradients of `outputs` weighted by `grads` (one each, same shapes) with respect to `inputs`, freeing the
/// graph: `torch.autograd.grad` with `grad_outputs`. An input that does not require grad (a frozen parameter) or
/// that the outputs do not use gets an undefined tensor and costs nothing. It reads no output's values, so those may
/// have been freed ([`free_storage`]) since the forward.
pub fn vjp_with_grads(
    outputs: &[&Tensor],
    grads: &[&Tensor],
    inputs: &[&Tensor],
) -> Result<Vec<Tensor>> {
    if outputs.len() != grads.len() {
        bail!(
            "vjp: {} outputs but {} gradients",
            outputs.len(),
            grads.len()
        );
    }
    let wanted: Vec<&Tensor> = inputs
        .iter()
        .copied()
        .filter(|t| t.requires_grad())
        .collect();
    let mut found = vjp_of(outputs, grads, &wanted)?.into_iter();
    Ok(inputs
        .iter()
        .map(|t| match t.requires_grad() {
            true => found.next().expect("one gradient per differentiated input"),
            false => Tensor::new(),
        })
        .collect())
}

/// [`vjp_with_grads`] over inputs that all require grad (the shim's contract).
fn vjp_of(outputs: &[&Tensor], grads: &[&Tensor], inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let ptrs = |ts: &[&Tensor]| ts.iter().map(|t| t.as_ptr()).collect::<Vec<_>>();
    let (o, g, i) = (ptrs(outputs), ptrs(grads), ptrs(inputs));
    let mut out: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); inputs.len()];
    // SAFETY: every pointer is a live tch tensor for the duration of the call; on success each `out[k]` is a new
    // `at::Tensor` the returned `Tensor` owns (and frees).
    unsafe {
        let err = ferl_vjp(
            o.as_ptr(),
            g.as_ptr(),
            o.len() as i64,
            i.as_ptr(),
            i.len() as i64,
            out.as_mut_ptr(),
        );
        if let Some(message) = take_shim_message(err) {
            bail!("vector-Jacobian product: {message}");
        }
        Ok(out.into_iter().map(|p| Tensor::from_ptr(p)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Two "layers" whose weights are views of one flat buffer, with their graph kept; returns (loss, leaves).
    fn forward(flat: &Tensor, x: &Tensor) -> (Tensor, Vec<Tensor>) {
        let w1 = flat
            .narrow(0, 0, 12)
            .view([4, 3])
            .detach()
            .set_requires_grad(true);
        let w2 = flat
            .narrow(0, 12, 6)
            .view([3, 2])
            .detach()
            .set_requires_grad(true);
        let b = flat.narrow(0, 18, 2).detach().set_requires_grad(true);
        let y = (x.matmul(&w1).tanh().matmul(&w2) + &b).sigmoid();
        (y.square().sum(Kind::Float), vec![w1, w2, b])
    }

    fn grads(loss: &Tensor, leaves: &[Tensor]) -> Vec<Tensor> {
        let refs: Vec<&Tensor> = leaves.iter().collect();
        Tensor::run_backward(&[loss], &refs, false, false)
    }

    #[test]
    fn a_freed_and_refilled_buffer_gives_bit_identical_gradients_through_a_kept_graph() {
        tch::manual_seed(3);
        let values = Tensor::randn([20], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
        let (loss, leaves) = forward(&values.copy(), &x);
        let want = grads(&loss, &leaves);
        for steal in [true, false] {
            let flat = values.copy();
            let (loss, leaves) = forward(&flat, &x);
            assert_eq!(free_storage(&flat).unwrap(), 80);
            assert_eq!(storage_nbytes(&flat), 0);
            assert_eq!(
                storage_nbytes(&leaves[1]),
                0,
                "the graph's views share the freed storage"
            );
            // The "all-gather": a fresh buffer, the only user of its storage (moved) or a view of a larger one (copied).
            let src = match steal {
                true => values.copy(),
                false => Tensor::cat(&[values.copy(), values.copy()], 0).narrow(0, 20, 20),
            };
            assert_eq!(refill_storage(&flat, src).unwrap(), steal);
            assert_eq!(storage_nbytes(&flat), 80);
            assert!(leaves[0].equal(&values.narrow(0, 0, 12).view([4, 3])));
            let got = grads(&loss, &leaves);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    g.equal(w),
                    "steal={steal}: gradients differ after free + refill"
                );
            }
        }
    }

    #[test]
    fn refill_refuses_a_source_of_another_shape_or_dtype() {
        let flat = Tensor::zeros([8], (Kind::Float, Device::Cpu));
        free_storage(&flat).unwrap();
        let e = refill_storage(&flat, Tensor::zeros([7], (Kind::Float, Device::Cpu))).unwrap_err();
        assert!(e.to_string().contains("elements"), "{e}");
        let e = refill_storage(&flat, Tensor::zeros([8], (Kind::Double, Device::Cpu))).unwrap_err();
        assert!(e.to_string().contains("dtype"), "{e}");
        assert_eq!(storage_nbytes(&flat), 0);
        assert!(refill_storage(&flat, Tensor::ones([8], (Kind::Float, Device::Cpu))).unwrap());
        assert_eq!(flat.sum(Kind::Float).double_value(&[]), 8.0);
    }
}
