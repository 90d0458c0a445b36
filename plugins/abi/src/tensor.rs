//! The plugin-side safe layer over [`HostOps`]: [`Tensor`] releases what it owns on drop and turns every host status
//! into a `Result` carrying the host's message.

use crate::kernel::*;
use crate::{ErrorMessage, STATUS_OK};

/// Calls the host function `$ops.$f` with the host's context as its first argument and then `$arg`s (local names,
/// so no caller expression is evaluated inside the `unsafe` block).
///
/// Every call into [`HostOps`] in this file goes through here, so one safety argument covers them all.
macro_rules! host_call {
    ($ops:expr, $f:ident($($arg:ident),* $(,)?)) => {{
        let ops: &HostOps = $ops;
        // SAFETY: a `HostOps` is only ever built by the host and lent to a kernel call (`Host::new` is called by
        // `forward_shim`/`backward_shim` with the table the host passed), so `ops.ctx` is the state its functions
        // expect and the table outlives every `Tensor<'h>` made from it. Each handle argument is the handle of a
        // live `Tensor<'h>` of that table (borrowed from the host or owned and not yet released), pointer arguments
        // point to locals or to slices borrowed for the call with their lengths passed alongside, and the `out` and
        // `err` arguments come from `Tensor::call`/`Tensor::call_status`, which point them at their own locals.
        unsafe { (ops.$f)(ops.ctx, $($arg),*) }
    }};
}

/// The host's tensor operations for one kernel call.
pub struct Host<'a> {
    ops: &'a HostOps,
}

/// A tensor handle: borrowed from the host (an input) or owned by the plugin (released on drop).
pub struct Tensor<'h> {
    ops: &'h HostOps,
    handle: TensorHandle,
    owned: bool,
}

impl<'a> Host<'a> {
    /// Wraps the table the host passed in.
    pub fn new(ops: &'a HostOps) -> Self {
        Self { ops }
    }

    /// Borrows `n` handles starting at `handles` (null `handles` with `n == 0` is fine).
    ///
    /// # Safety
    /// `handles` points to `n` valid handles that outlive the returned tensors.
    pub unsafe fn borrow_all(&self, handles: *const TensorHandle, n: usize) -> Vec<Tensor<'a>> {
        // SAFETY: the caller guarantees `n` readable handles at `handles`, and only indices `< n` are read (none when
        // `n == 0`, so a null pointer is never offset).
        unsafe {
            (0..n)
                .map(|i| Tensor {
                    ops: self.ops,
                    handle: *handles.add(i),
                    owned: false,
                })
                .collect()
        }
    }

    /// Borrows one handle.
    pub fn borrow(&self, handle: TensorHandle) -> Tensor<'a> {
        Tensor {
            ops: self.ops,
            handle,
            owned: false,
        }
    }
}

impl<'h> Tensor<'h> {
    /// Runs one host call that produces a new handle.
    fn call(
        &self,
        what: &str,
        f: impl FnOnce(*mut TensorHandle, *mut crate::ErrorBuf) -> i32,
    ) -> Result<Tensor<'h>, String> {
        let mut out = TensorHandle::NULL;
        let mut err = ErrorMessage::new();
        let status = f(&mut out, err.as_mut_ptr());
        if status != STATUS_OK {
            return Err(format!("host op {what} failed: {}", err.message()));
        }
        if out.is_null() {
            return Err(format!("host op {what} returned no tensor"));
        }
        Ok(Tensor {
            ops: self.ops,
            handle: out,
            owned: true,
        })
    }

    /// Runs one host call that only returns a status.
    fn call_status(
        &self,
        what: &str,
        f: impl FnOnce(*mut crate::ErrorBuf) -> i32,
    ) -> Result<(), String> {
        let mut err = ErrorMessage::new();
        if f(err.as_mut_ptr()) != STATUS_OK {
            return Err(format!("host op {what} failed: {}", err.message()));
        }
        Ok(())
    }

    /// The raw handle (still owned by `self`).
    pub fn handle(&self) -> TensorHandle {
        self.handle
    }

    /// Gives the handle to the host (returned as an output): `self` no longer releases it.
    pub fn into_raw(self) -> TensorHandle {
        let h = self.handle;
        std::mem::forget(self);
        h
    }

    /// The dimension sizes.
    pub fn shape(&self) -> Result<Vec<i64>, String> {
        let mut dims = [0i64; 8];
        let mut n = 0usize;
        let (ops, h) = (self.ops, self.handle);
        let (cap, ndim) = (dims.len(), &mut n);
        let out = dims.as_mut_ptr();
        self.call_status("shape", |e| host_call!(ops, shape(h, out, cap, ndim, e)))?;
        if n > dims.len() {
            return Err(format!(
                "tensor of rank {n} is not supported (at most {})",
                dims.len()
            ));
        }
        Ok(dims[..n].to_vec())
    }

    /// `op(self) @ op(other)`, transposing where asked.
    pub fn matmul(
        &self,
        other: &Tensor<'h>,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<Tensor<'h>, String> {
        let (ops, a, b) = (self.ops, self.handle, other.handle);
        let (ta, tb) = (u32::from(trans_a), u32::from(trans_b));
        self.call("matmul", |o, e| host_call!(ops, matmul(a, b, ta, tb, o, e)))
    }

    fn unary(&self, op: u32, what: &str) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call(what, |o, e| host_call!(ops, unary(op, a, o, e)))
    }

    fn binary(&self, op: u32, other: &Tensor<'h>, what: &str) -> Result<Tensor<'h>, String> {
        let (ops, a, b) = (self.ops, self.handle, other.handle);
        self.call(what, |o, e| host_call!(ops, binary(op, a, b, o, e)))
    }

    fn scalar(&self, op: u32, v: f64, what: &str) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call(what, |o, e| host_call!(ops, scalar(op, a, v, o, e)))
    }

    fn reduce(&self, op: u32, dim: i64, keepdim: bool, what: &str) -> Result<Tensor<'h>, String> {
        let (ops, a, keep) = (self.ops, self.handle, u32::from(keepdim));
        self.call(what, |o, e| host_call!(ops, reduce(op, a, dim, keep, o, e)))
    }

    /// `exp(self)`.
    pub fn exp(&self) -> Result<Tensor<'h>, String> {
        self.unary(UNARY_EXP, "exp")
    }
    /// `-self`.
    pub fn neg(&self) -> Result<Tensor<'h>, String> {
        self.unary(UNARY_NEG, "neg")
    }
    /// `sigmoid(self)`.
    pub fn sigmoid(&self) -> Result<Tensor<'h>, String> {
        self.unary(UNARY_SIGMOID, "sigmoid")
    }
    /// `1 / sqrt(self)`.
    pub fn rsqrt(&self) -> Result<Tensor<'h>, String> {
        self.unary(UNARY_RSQRT, "rsqrt")
    }
    /// `self * self`.
    pub fn square(&self) -> Result<Tensor<'h>, String> {
        self.unary(UNARY_SQUARE, "square")
    }
    /// `self * sigmoid(self)`.
    pub fn silu(&self) -> Result<Tensor<'h>, String> {
        self.unary(UNARY_SILU, "silu")
    }
    /// `ln(self)`.
    pub fn log(&self) -> Result<Tensor<'h>, String> {
        self.unary(UNARY_LOG, "log")
    }
    /// `self + other`.
    pub fn add(&self, other: &Tensor<'h>) -> Result<Tensor<'h>, String> {
        self.binary(BINARY_ADD, other, "add")
    }
    /// `self - other`.
    pub fn sub(&self, other: &Tensor<'h>) -> Result<Tensor<'h>, String> {
        self.binary(BINARY_SUB, other, "sub")
    }
    /// `self * other`.
    pub fn mul(&self, other: &Tensor<'h>) -> Result<Tensor<'h>, String> {
        self.binary(BINARY_MUL, other, "mul")
    }
    /// `self / other`.
    pub fn div(&self, other: &Tensor<'h>) -> Result<Tensor<'h>, String> {
        self.binary(BINARY_DIV, other, "div")
    }
    /// `self + v`.
    pub fn add_scalar(&self, v: f64) -> Result<Tensor<'h>, String> {
        self.scalar(SCALAR_ADD, v, "add_scalar")
    }
    /// `self * v`.
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor<'h>, String> {
        self.scalar(SCALAR_MUL, v, "mul_scalar")
    }
    /// `self == v` as 1/0 in this tensor's dtype.
    pub fn eq_scalar(&self, v: f64) -> Result<Tensor<'h>, String> {
        self.scalar(SCALAR_EQ, v, "eq_scalar")
    }
    /// `self != v` as 1/0 in this tensor's dtype.
    pub fn ne_scalar(&self, v: f64) -> Result<Tensor<'h>, String> {
        self.scalar(SCALAR_NE, v, "ne_scalar")
    }
    /// Sum over `dim` ([`REDUCE_ALL`]: everything).
    pub fn sum(&self, dim: i64, keepdim: bool) -> Result<Tensor<'h>, String> {
        self.reduce(REDUCE_SUM, dim, keepdim, "sum")
    }
    /// Mean over `dim`.
    pub fn mean(&self, dim: i64, keepdim: bool) -> Result<Tensor<'h>, String> {
        self.reduce(REDUCE_MEAN, dim, keepdim, "mean")
    }
    /// Log-sum-exp over `dim`.
    pub fn logsumexp(&self, dim: i64, keepdim: bool) -> Result<Tensor<'h>, String> {
        self.reduce(REDUCE_LOGSUMEXP, dim, keepdim, "logsumexp")
    }
    /// Maximum over `dim`.
    pub fn max(&self, dim: i64, keepdim: bool) -> Result<Tensor<'h>, String> {
        self.reduce(REDUCE_MAX, dim, keepdim, "max")
    }
    /// Softmax over `dim`.
    pub fn softmax(&self, dim: i64) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call("softmax", |o, e| host_call!(ops, softmax(a, dim, o, e)))
    }
    /// Rows/columns `start..start+len` of `dim`.
    pub fn narrow(&self, dim: i64, start: i64, len: i64) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call("narrow", |o, e| {
            host_call!(ops, narrow(a, dim, start, len, o, e))
        })
    }
    /// The same data with shape `dims`.
    pub fn reshape(&self, dims: &[i64]) -> Result<Tensor<'h>, String> {
        let (ops, a, ptr, n) = (self.ops, self.handle, dims.as_ptr(), dims.len());
        self.call("reshape", |o, e| host_call!(ops, reshape(a, ptr, n, o, e)))
    }
    /// torch's `gather(dim, index)`.
    pub fn gather(&self, dim: i64, index: &Tensor<'h>) -> Result<Tensor<'h>, String> {
        let (ops, a, i) = (self.ops, self.handle, index.handle);
        self.call("gather", |o, e| host_call!(ops, gather(a, dim, i, o, e)))
    }
    /// In place: `self[index] += src` along `dim` (torch's `scatter_add_`).
    pub fn scatter_add_into(
        &self,
        dim: i64,
        index: &Tensor<'h>,
        src: &Tensor<'h>,
    ) -> Result<(), String> {
        let (ops, d, i, s) = (self.ops, self.handle, index.handle, src.handle);
        self.call_status("scatter_add_into", |e| {
            host_call!(ops, scatter_add_into(d, dim, i, s, e))
        })
    }
    /// This tensor converted to `like`'s dtype.
    pub fn cast_like(&self, like: &Tensor<'h>) -> Result<Tensor<'h>, String> {
        let (ops, a, l) = (self.ops, self.handle, like.handle);
        self.call("cast_like", |o, e| host_call!(ops, cast_like(a, l, o, e)))
    }
    /// Zeros shaped like this tensor.
    pub fn zeros_like(&self) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call("zeros_like", |o, e| host_call!(ops, zeros_like(a, o, e)))
    }
    /// In place: `self.narrow(dim, start, src.size(dim)) = src`.
    pub fn copy_into(&self, dim: i64, start: i64, src: &Tensor<'h>) -> Result<(), String> {
        let (ops, d, s) = (self.ops, self.handle, src.handle);
        self.call_status("copy_into", |e| {
            host_call!(ops, copy_into(d, dim, start, s, e))
        })
    }
    /// In place: `self += src`.
    pub fn add_into(&self, src: &Tensor<'h>) -> Result<(), String> {
        self.binary_into(BINARY_ADD, src, "add_into")
    }
    /// In place: `self -= src`.
    pub fn sub_into(&self, src: &Tensor<'h>) -> Result<(), String> {
        self.binary_into(BINARY_SUB, src, "sub_into")
    }
    /// In place: `self *= src`.
    pub fn mul_into(&self, src: &Tensor<'h>) -> Result<(), String> {
        self.binary_into(BINARY_MUL, src, "mul_into")
    }
    fn binary_into(&self, op: u32, src: &Tensor<'h>, what: &str) -> Result<(), String> {
        let (ops, d, s) = (self.ops, self.handle, src.handle);
        self.call_status(what, |e| host_call!(ops, binary_into(op, d, s, e)))
    }
    /// In place: `self = exp(self)`.
    pub fn exp_into(&self) -> Result<(), String> {
        let (ops, d, op) = (self.ops, self.handle, UNARY_EXP);
        self.call_status("exp_into", |e| host_call!(ops, unary_into(op, d, e)))
    }
    /// In place: `self += op(a) @ op(b)`.
    pub fn addmm_into(
        &self,
        a: &Tensor<'h>,
        b: &Tensor<'h>,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<(), String> {
        let (ops, d, a, b) = (self.ops, self.handle, a.handle, b.handle);
        let (ta, tb) = (u32::from(trans_a), u32::from(trans_b));
        self.call_status("addmm_into", |e| {
            host_call!(ops, addmm_into(d, a, b, ta, tb, e))
        })
    }
    /// The value of a one-element tensor.
    pub fn to_f64(&self) -> Result<f64, String> {
        let mut v = 0f64;
        let (ops, a) = (self.ops, self.handle);
        let out = &mut v;
        self.call_status("to_f64", |e| host_call!(ops, to_f64(a, out, e)))?;
        Ok(v)
    }
}

impl Drop for Tensor<'_> {
    fn drop(&mut self) {
        if self.owned && !self.handle.is_null() {
            // SAFETY: an owned handle came from this host table and is released exactly once.
            unsafe { (self.ops.release)(self.ops.ctx, self.handle) }
        }
    }
}
