//! The plugin-side safe layer over [`HostOps`]: [`Tensor`] releases what it owns on drop and turns every host status
//! into a `Result` carrying the host's message.

use crate::kernel::*;
use crate::{ErrorMessage, STATUS_OK};

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
        self.call_status("shape", |e| unsafe {
            (ops.shape)(ops.ctx, h, dims.as_mut_ptr(), dims.len(), &mut n, e)
        })?;
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
        self.call("matmul", |o, e| unsafe {
            (ops.matmul)(ops.ctx, a, b, trans_a as u32, trans_b as u32, o, e)
        })
    }

    fn unary(&self, op: u32, what: &str) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call(what, |o, e| unsafe { (ops.unary)(ops.ctx, op, a, o, e) })
    }

    fn binary(&self, op: u32, other: &Tensor<'h>, what: &str) -> Result<Tensor<'h>, String> {
        let (ops, a, b) = (self.ops, self.handle, other.handle);
        self.call(what, |o, e| unsafe {
            (ops.binary)(ops.ctx, op, a, b, o, e)
        })
    }

    fn scalar(&self, op: u32, v: f64, what: &str) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call(what, |o, e| unsafe {
            (ops.scalar)(ops.ctx, op, a, v, o, e)
        })
    }

    fn reduce(&self, op: u32, dim: i64, keepdim: bool, what: &str) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call(what, |o, e| unsafe {
            (ops.reduce)(ops.ctx, op, a, dim, keepdim as u32, o, e)
        })
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
        self.call("softmax", |o, e| unsafe {
            (ops.softmax)(ops.ctx, a, dim, o, e)
        })
    }
    /// Rows/columns `start..start+len` of `dim`.
    pub fn narrow(&self, dim: i64, start: i64, len: i64) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call("narrow", |o, e| unsafe {
            (ops.narrow)(ops.ctx, a, dim, start, len, o, e)
        })
    }
    /// The same data with shape `dims`.
    pub fn reshape(&self, dims: &[i64]) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call("reshape", |o, e| unsafe {
            (ops.reshape)(ops.ctx, a, dims.as_ptr(), dims.len(), o, e)
        })
    }
    /// torch's `gather(dim, index)`.
    pub fn gather(&self, dim: i64, index: &Tensor<'h>) -> Result<Tensor<'h>, String> {
        let (ops, a, i) = (self.ops, self.handle, index.handle);
        self.call("gather", |o, e| unsafe {
            (ops.gather)(ops.ctx, a, dim, i, o, e)
        })
    }
    /// In place: `self[index] += src` along `dim` (torch's `scatter_add_`).
    pub fn scatter_add_into(
        &self,
        dim: i64,
        index: &Tensor<'h>,
        src: &Tensor<'h>,
    ) -> Result<(), String> {
        let (ops, d, i, s) = (self.ops, self.handle, index.handle, src.handle);
        self.call_status("scatter_add_into", |e| unsafe {
            (ops.scatter_add_into)(ops.ctx, d, dim, i, s, e)
        })
    }
    /// This tensor converted to `like`'s dtype.
    pub fn cast_like(&self, like: &Tensor<'h>) -> Result<Tensor<'h>, String> {
        let (ops, a, l) = (self.ops, self.handle, like.handle);
        self.call("cast_like", |o, e| unsafe {
            (ops.cast_like)(ops.ctx, a, l, o, e)
        })
    }
    /// Zeros shaped like this tensor.
    pub fn zeros_like(&self) -> Result<Tensor<'h>, String> {
        let (ops, a) = (self.ops, self.handle);
        self.call("zeros_like", |o, e| unsafe {
            (ops.zeros_like)(ops.ctx, a, o, e)
        })
    }
    /// In place: `self.narrow(dim, start, src.size(dim)) = src`.
    pub fn copy_into(&self, dim: i64, start: i64, src: &Tensor<'h>) -> Result<(), String> {
        let (ops, d, s) = (self.ops, self.handle, src.handle);
        self.call_status("copy_into", |e| unsafe {
            (ops.copy_into)(ops.ctx, d, dim, start, s, e)
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
        self.call_status(what, |e| unsafe { (ops.binary_into)(ops.ctx, op, d, s, e) })
    }
    /// In place: `self = exp(self)`.
    pub fn exp_into(&self) -> Result<(), String> {
        let (ops, d) = (self.ops, self.handle);
        self.call_status("exp_into", |e| unsafe {
            (ops.unary_into)(ops.ctx, UNARY_EXP, d, e)
        })
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
        self.call_status("addmm_into", |e| unsafe {
            (ops.addmm_into)(ops.ctx, d, a, b, trans_a as u32, trans_b as u32, e)
        })
    }
    /// The value of a one-element tensor.
    pub fn to_f64(&self) -> Result<f64, String> {
        let mut v = 0f64;
        let (ops, a) = (self.ops, self.handle);
        self.call_status("to_f64", |e| unsafe { (ops.to_f64)(ops.ctx, a, &mut v, e) })?;
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
