//! Kernel plugins: replacements for model ops (fused linear + cross-entropy, RMSNorm, SwiGLU...) chosen by config.
//!
//! A plugin cannot link the host's tensor library, so the host lends it a table of tensor operations, [`HostOps`],
//! that act on opaque [`TensorHandle`]s. The plugin's algorithm (chunking, recomputation, the order of operations)
//! runs in the plugin; the arithmetic runs in the host's library on whatever device the tensors live on, so a kernel
//! plugin is as fast as the host's BLAS and works on CPU and CUDA alike.
//!
//! # Handle ownership
//! 1. Handles the host passes in (`inputs`, `grad_outputs`, `saved`) are borrowed for the call; the plugin never
//!    releases them.
//! 2. Every handle a [`HostOps`] function returns belongs to the plugin, which either releases it with
//!    [`HostOps::release`] or hands it back as an output/gradient, after which it belongs to the host.
//! 3. On a non-zero status the plugin has written no output handle (the safe layer releases partial results).
//!
//! # Op protocol
//! `forward` writes `n_outputs` outputs followed by `n_saved` tensors the host keeps for `backward`. `backward`
//! receives `n_outputs` output gradients, the original inputs and the saved tensors, and writes `n_inputs` gradients
//! (a null handle: no gradient for that input). Both receive the op's numeric attributes (`attrs`), documented per op.

use crate::tensor::{Host, Tensor};
use crate::{guard, ErrorBuf, FerlStr};
use std::ffi::c_void;

/// An opaque tensor owned by the host's tensor library.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorHandle(pub *mut c_void);

impl TensorHandle {
    /// "No tensor" (e.g. no gradient for an input).
    pub const NULL: TensorHandle = TensorHandle(std::ptr::null_mut());

    /// Whether this is [`TensorHandle::NULL`].
    pub fn is_null(self) -> bool {
        self.0.is_null()
    }
}

/// [`HostOps::unary`]: `exp(a)`.
pub const UNARY_EXP: u32 = 1;
/// [`HostOps::unary`]: `-a`.
pub const UNARY_NEG: u32 = 2;
/// [`HostOps::unary`]: `1 / (1 + exp(-a))`.
pub const UNARY_SIGMOID: u32 = 3;
/// [`HostOps::unary`]: `1 / sqrt(a)`.
pub const UNARY_RSQRT: u32 = 4;
/// [`HostOps::unary`]: `a * a`.
pub const UNARY_SQUARE: u32 = 5;
/// [`HostOps::unary`]: `a * sigmoid(a)`.
pub const UNARY_SILU: u32 = 6;
/// [`HostOps::unary`]: `ln(a)`.
pub const UNARY_LOG: u32 = 7;

/// [`HostOps::binary`]: `a + b` (broadcasting, type promotion as the host library does it).
pub const BINARY_ADD: u32 = 1;
/// [`HostOps::binary`]: `a - b`.
pub const BINARY_SUB: u32 = 2;
/// [`HostOps::binary`]: `a * b`.
pub const BINARY_MUL: u32 = 3;
/// [`HostOps::binary`]: `a / b`.
pub const BINARY_DIV: u32 = 4;

/// [`HostOps::scalar`]: `a + v`.
pub const SCALAR_ADD: u32 = 1;
/// [`HostOps::scalar`]: `a * v`.
pub const SCALAR_MUL: u32 = 2;
/// [`HostOps::scalar`]: `a == v` as 1/0 in `a`'s dtype.
pub const SCALAR_EQ: u32 = 3;
/// [`HostOps::scalar`]: `a != v` as 1/0 in `a`'s dtype.
pub const SCALAR_NE: u32 = 4;

/// [`HostOps::reduce`]: sum.
pub const REDUCE_SUM: u32 = 1;
/// [`HostOps::reduce`]: mean.
pub const REDUCE_MEAN: u32 = 2;
/// [`HostOps::reduce`]: `ln(sum(exp(a)))`, computed stably.
pub const REDUCE_LOGSUMEXP: u32 = 3;
/// [`HostOps::reduce`]: maximum.
pub const REDUCE_MAX: u32 = 4;
/// [`HostOps::reduce`] `dim` meaning "over all dimensions, to a 0-d tensor".
pub const REDUCE_ALL: i64 = i64::MIN;

/// Tensor operations the host lends a kernel plugin for one call. Every function returns a status
/// ([`crate::STATUS_OK`] or an error with a message in `err`) and writes new handles to `out`.
#[repr(C)]
pub struct HostOps {
    /// `size_of::<HostOps>()` as the host compiled it.
    pub struct_size: usize,
    /// The host's state, passed back as the first argument of every function.
    pub ctx: *mut c_void,
    /// Releases a handle the plugin owns.
    pub release: unsafe extern "C" fn(ctx: *mut c_void, h: TensorHandle),
    /// Writes up to `cap` dimension sizes to `dims` and the rank to `ndim`.
    pub shape: unsafe extern "C" fn(
        ctx: *mut c_void,
        h: TensorHandle,
        dims: *mut i64,
        cap: usize,
        ndim: *mut usize,
        err: *mut ErrorBuf,
    ) -> i32,
    /// Matrix product of 2-d tensors, `op(a) @ op(b)` where `op` transposes when `trans_* != 0`.
    pub matmul: unsafe extern "C" fn(
        ctx: *mut c_void,
        a: TensorHandle,
        b: TensorHandle,
        trans_a: u32,
        trans_b: u32,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// An element-wise `UNARY_*` op.
    pub unary: unsafe extern "C" fn(
        ctx: *mut c_void,
        op: u32,
        a: TensorHandle,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// An element-wise `BINARY_*` op with broadcasting.
    pub binary: unsafe extern "C" fn(
        ctx: *mut c_void,
        op: u32,
        a: TensorHandle,
        b: TensorHandle,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// An element-wise `SCALAR_*` op with the number `value`.
    pub scalar: unsafe extern "C" fn(
        ctx: *mut c_void,
        op: u32,
        a: TensorHandle,
        value: f64,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// A `REDUCE_*` over `dim` (negative counts from the end; [`REDUCE_ALL`] for all), keeping it when `keepdim != 0`.
    pub reduce: unsafe extern "C" fn(
        ctx: *mut c_void,
        op: u32,
        a: TensorHandle,
        dim: i64,
        keepdim: u32,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// Softmax over `dim`.
    pub softmax: unsafe extern "C" fn(
        ctx: *mut c_void,
        a: TensorHandle,
        dim: i64,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// The slice `start..start+len` of `dim` (a view when the library allows).
    pub narrow: unsafe extern "C" fn(
        ctx: *mut c_void,
        a: TensorHandle,
        dim: i64,
        start: i64,
        len: i64,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// `a` with the shape `dims[..n]` (one entry may be -1).
    pub reshape: unsafe extern "C" fn(
        ctx: *mut c_void,
        a: TensorHandle,
        dims: *const i64,
        n: usize,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// `out[i][j] = a[i][index[i][j]]` along `dim` (torch's `gather`; `index` holds int64).
    pub gather: unsafe extern "C" fn(
        ctx: *mut c_void,
        a: TensorHandle,
        dim: i64,
        index: TensorHandle,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// In place: `dst[index]` += `src` along `dim` (torch's `scatter_add_`; `index` holds int64).
    pub scatter_add_into: unsafe extern "C" fn(
        ctx: *mut c_void,
        dst: TensorHandle,
        dim: i64,
        index: TensorHandle,
        src: TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// `a` converted to the dtype of `like`.
    pub cast_like: unsafe extern "C" fn(
        ctx: *mut c_void,
        a: TensorHandle,
        like: TensorHandle,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// Zeros with the shape, dtype and device of `a`.
    pub zeros_like: unsafe extern "C" fn(
        ctx: *mut c_void,
        a: TensorHandle,
        out: *mut TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// In place: `dst.narrow(dim, start, src.size(dim)) = src`.
    pub copy_into: unsafe extern "C" fn(
        ctx: *mut c_void,
        dst: TensorHandle,
        dim: i64,
        start: i64,
        src: TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// In place: `dst = dst OP src` for a `BINARY_*` op (broadcasting `src`).
    pub binary_into: unsafe extern "C" fn(
        ctx: *mut c_void,
        op: u32,
        dst: TensorHandle,
        src: TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// In place: `dst = OP(dst)` for a `UNARY_*` op.
    pub unary_into: unsafe extern "C" fn(
        ctx: *mut c_void,
        op: u32,
        dst: TensorHandle,
        err: *mut ErrorBuf,
    ) -> i32,
    /// In place: `dst += op(a) @ op(b)` for 2-d tensors (`op` transposes when `trans_* != 0`).
    pub addmm_into: unsafe extern "C" fn(
        ctx: *mut c_void,
        dst: TensorHandle,
        a: TensorHandle,
        b: TensorHandle,
        trans_a: u32,
        trans_b: u32,
        err: *mut ErrorBuf,
    ) -> i32,
    /// The value of a one-element tensor.
    pub to_f64: unsafe extern "C" fn(
        ctx: *mut c_void,
        a: TensorHandle,
        out: *mut f64,
        err: *mut ErrorBuf,
    ) -> i32,
}

/// `forward` of a [`KernelOp`]: writes `n_outputs + n_saved` handles to `outputs`.
pub type KernelForwardFn = unsafe extern "C" fn(
    host: *const HostOps,
    inputs: *const TensorHandle,
    attrs: *const f64,
    n_attrs: usize,
    outputs: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32;

/// `backward` of a [`KernelOp`]: writes `n_inputs` gradient handles (null = none) to `grad_inputs`.
pub type KernelBackwardFn = unsafe extern "C" fn(
    host: *const HostOps,
    grad_outputs: *const TensorHandle,
    inputs: *const TensorHandle,
    saved: *const TensorHandle,
    attrs: *const f64,
    n_attrs: usize,
    grad_inputs: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32;

/// One op a kernel plugin provides.
#[repr(C)]
pub struct KernelOp {
    /// Name the host looks ops up by, e.g. `fused_linear_cross_entropy`.
    pub name: FerlStr,
    /// Number of input tensors.
    pub n_inputs: u32,
    /// Number of output tensors.
    pub n_outputs: u32,
    /// Number of tensors `forward` saves for `backward`.
    pub n_saved: u32,
    /// Computes the outputs and the saved tensors.
    pub forward: KernelForwardFn,
    /// Computes the input gradients.
    pub backward: KernelBackwardFn,
}

// SAFETY: a KernelOp points only to 'static name data and functions.
unsafe impl Sync for KernelOp {}

/// The table a kernel plugin exports through [`crate::KERNEL_SYMBOL`].
#[repr(C)]
pub struct KernelVTable {
    /// `size_of::<KernelVTable>()` as the plugin compiled it.
    pub struct_size: usize,
    /// `n_ops` ops.
    pub ops: *const KernelOp,
    /// Number of ops.
    pub n_ops: usize,
}

// SAFETY: the table points only to a 'static array of ops.
unsafe impl Sync for KernelVTable {}

impl KernelVTable {
    /// The ops as a slice.
    ///
    /// # Safety
    /// `ops` points to `n_ops` ops that outlive `'a` (true while the library is loaded).
    pub unsafe fn ops<'a>(&self) -> &'a [KernelOp] {
        // SAFETY: an empty table never reaches `from_raw_parts`; otherwise the caller guarantees `n_ops` ops at
        // `ops` that outlive `'a`.
        unsafe {
            if self.n_ops == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(self.ops, self.n_ops)
            }
        }
    }
}

/// The `extern "C"` signature of [`crate::KERNEL_SYMBOL`].
pub type KernelTableFn = unsafe extern "C" fn() -> *const KernelVTable;

/// What a kernel author implements per op.
pub trait KernelOpImpl {
    /// Name the host looks the op up by.
    const NAME: &'static str;
    /// Number of inputs.
    const N_INPUTS: u32;
    /// Number of outputs.
    const N_OUTPUTS: u32;
    /// Number of tensors saved for backward.
    const N_SAVED: u32;
    /// Returns `N_OUTPUTS` outputs followed by `N_SAVED` saved tensors.
    fn forward<'h>(
        host: &'h Host,
        inputs: &[Tensor<'h>],
        attrs: &[f64],
    ) -> Result<Vec<Tensor<'h>>, String>;
    /// Returns one gradient per input (`None`: no gradient).
    fn backward<'h>(
        host: &'h Host,
        grad_outputs: &[Tensor<'h>],
        inputs: &[Tensor<'h>],
        saved: &[Tensor<'h>],
        attrs: &[f64],
    ) -> Result<Vec<Option<Tensor<'h>>>, String>;
}

/// The `n` attributes at `attrs` (empty for a null pointer or `n == 0`).
///
/// # Safety
/// A non-null `attrs` with `n > 0` points to `n` readable `f64`s that outlive `'a`.
unsafe fn attrs_slice<'a>(attrs: *const f64, n: usize) -> &'a [f64] {
    // SAFETY: null and empty are handled without reading; otherwise this is the caller's guarantee.
    unsafe {
        if n == 0 || attrs.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(attrs, n)
        }
    }
}

unsafe extern "C" fn forward_shim<T: KernelOpImpl>(
    host: *const HostOps,
    inputs: *const TensorHandle,
    attrs: *const f64,
    n_attrs: usize,
    outputs: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: per `KernelForwardFn`'s contract the host passes its `HostOps` table (valid for the call), `N_INPUTS`
    // handles at `inputs` that it keeps alive for the call, `n_attrs` attributes at `attrs`, room for
    // `N_OUTPUTS + N_SAVED` handles at `outputs`, and a null-or-valid `err`. Outputs are written only after checking
    // that exactly that many tensors came back, and `into_raw` hands each one's ownership to the host.
    unsafe {
        let host = Host::new(&*host);
        let (status, out) = guard(err, || {
            let ins = host.borrow_all(inputs, T::N_INPUTS as usize);
            let outs = T::forward(&host, &ins, attrs_slice(attrs, n_attrs))?;
            let want = (T::N_OUTPUTS + T::N_SAVED) as usize;
            if outs.len() != want {
                return Err(format!(
                    "kernel op {} returned {} tensors, expected {want}",
                    T::NAME,
                    outs.len()
                ));
            }
            Ok(outs)
        });
        if let Some(outs) = out {
            for (i, t) in outs.into_iter().enumerate() {
                *outputs.add(i) = t.into_raw();
            }
        }
        status
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn backward_shim<T: KernelOpImpl>(
    host: *const HostOps,
    grad_outputs: *const TensorHandle,
    inputs: *const TensorHandle,
    saved: *const TensorHandle,
    attrs: *const f64,
    n_attrs: usize,
    grad_inputs: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: per `KernelBackwardFn`'s contract the host passes its `HostOps` table (valid for the call),
    // `N_OUTPUTS`/`N_INPUTS`/`N_SAVED` live handles at `grad_outputs`/`inputs`/`saved`, `n_attrs` attributes at
    // `attrs`, room for `N_INPUTS` handles at `grad_inputs`, and a null-or-valid `err`. Gradients are written only
    // after checking that exactly `N_INPUTS` came back, and `into_raw` hands each one's ownership to the host.
    unsafe {
        let host = Host::new(&*host);
        let (status, out) = guard(err, || {
            let gouts = host.borrow_all(grad_outputs, T::N_OUTPUTS as usize);
            let ins = host.borrow_all(inputs, T::N_INPUTS as usize);
            let sv = host.borrow_all(saved, T::N_SAVED as usize);
            let grads = T::backward(&host, &gouts, &ins, &sv, attrs_slice(attrs, n_attrs))?;
            if grads.len() != T::N_INPUTS as usize {
                return Err(format!(
                    "kernel op {} returned {} gradients, expected {}",
                    T::NAME,
                    grads.len(),
                    T::N_INPUTS
                ));
            }
            Ok(grads)
        });
        if let Some(grads) = out {
            for (i, g) in grads.into_iter().enumerate() {
                *grad_inputs.add(i) = g.map_or(TensorHandle::NULL, Tensor::into_raw);
            }
        }
        status
    }
}

/// The table entry for `T` (used in a `static` array by [`crate::export_kernel!`] or a built-in table).
pub const fn kernel_op<T: KernelOpImpl>() -> KernelOp {
    KernelOp {
        name: FerlStr::new(T::NAME),
        n_inputs: T::N_INPUTS,
        n_outputs: T::N_OUTPUTS,
        n_saved: T::N_SAVED,
        forward: forward_shim::<T>,
        backward: backward_shim::<T>,
    }
}

/// A kernel table over a `'static` array of ops (for a `static` in a crate that also serves the ops built-in).
pub const fn kernel_table(ops: &'static [KernelOp]) -> KernelVTable {
    KernelVTable {
        struct_size: std::mem::size_of::<KernelVTable>(),
        ops: ops.as_ptr(),
        n_ops: ops.len(),
    }
}

/// Exports a kernel plugin: `export_kernel!(MyPlugin, [OpA, OpB])` builds the table from `KernelOpImpl` types;
/// `export_kernel!(MyPlugin, table = some_crate::TABLE)` exports an existing `static KernelVTable`.
#[macro_export]
macro_rules! export_kernel {
    ($ty:ty, table = $table:path) => {
        $crate::__export_manifest!($ty, $crate::PluginKind::Kernel);
        /// This plugin's kernel table (`ferl_plugin_abi::kernel::KernelVTable`), looked up by this symbol's name.
        #[no_mangle]
        pub extern "C" fn ferl_plugin_kernel() -> *const $crate::kernel::KernelVTable {
            &$table
        }
    };
    ($ty:ty, [$($op:ty),+ $(,)?]) => {
        $crate::__export_manifest!($ty, $crate::PluginKind::Kernel);
        /// This plugin's kernel table (`ferl_plugin_abi::kernel::KernelVTable`), looked up by this symbol's name.
        #[no_mangle]
        pub extern "C" fn ferl_plugin_kernel() -> *const $crate::kernel::KernelVTable {
            static OPS: &[$crate::kernel::KernelOp] = &[$($crate::kernel::kernel_op::<$op>()),+];
            static TABLE: $crate::kernel::KernelVTable = $crate::kernel::kernel_table(OPS);
            &TABLE
        }
    };
}
