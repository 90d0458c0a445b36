//! [`HostOps`] over tch: a handle is a `Box<tch::Tensor>` turned into a raw pointer. Every function catches panics
//! and libtorch errors (they become a status and a message), so nothing unwinds into the plugin.
//!
//! # Safety contract
//! Every function of the table relies on what `ferl_plugin_abi::kernel` asks of a plugin: each handle argument is a
//! live handle of this table (made by [`into_handle`]: an input the host lent or a result the plugin has not
//! released), `out` and pointer arguments are writable or readable for the sizes documented on [`HostOps`], and
//! `err` is null or a valid [`ErrorBuf`]. Handles are only ever borrowed shared (`&Tensor`), so one tensor passed
//! twice (`x * x`) aliases nothing mutably; in-place ops update a [`Tensor::shallow_clone`] of the destination,
//! which shares its storage.

use ferl_plugin_abi::kernel::*;
use ferl_plugin_abi::{ErrorBuf, STATUS_ERROR, STATUS_OK};
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tch::{Kind, TchError, Tensor};

/// Gives `t` to the other side as a handle (whoever receives it must release it).
pub fn into_handle(t: Tensor) -> TensorHandle {
    TensorHandle(Box::into_raw(Box::new(t)).cast())
}

/// Takes back ownership of a handle made by [`into_handle`].
///
/// # Safety
/// `h` came from [`into_handle`] and is not used afterwards.
pub unsafe fn from_handle(h: TensorHandle) -> Tensor {
    // SAFETY: `h` is a pointer from `Box::into_raw` that the caller gives up, so the box is rebuilt exactly once.
    unsafe { *Box::from_raw(h.0.cast::<Tensor>()) }
}

/// Borrows the tensor behind a handle.
///
/// # Safety
/// `h` is a live handle from [`into_handle`] that is not released during `'a`.
unsafe fn tensor<'a>(h: TensorHandle) -> &'a Tensor {
    // SAFETY: the caller guarantees `h` points to a live boxed `Tensor`; only shared borrows are ever made of it.
    unsafe { &*h.0.cast::<Tensor>() }
}

/// Runs `f`, turning a libtorch error or a panic into [`STATUS_ERROR`] with a message written to `err`.
///
/// # Safety
/// `err` is null or a valid [`ErrorBuf`].
unsafe fn status(err: *mut ErrorBuf, f: impl FnOnce() -> Result<(), TchError>) -> i32 {
    let message = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return STATUS_OK,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "host tensor op panicked".to_string(),
    };
    // SAFETY: `err` is null or valid, as this function requires.
    unsafe { ErrorBuf::write(err, &message) };
    STATUS_ERROR
}

/// [`status`] for an op that makes a tensor: on success the tensor is written to `out` as a new handle.
///
/// # Safety
/// `out` is writable and `err` is null or a valid [`ErrorBuf`].
unsafe fn produce(
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
    f: impl FnOnce() -> Result<Tensor, TchError>,
) -> i32 {
    let mut made = None;
    // SAFETY: `err` is null or valid, as this function requires.
    let code = unsafe { status(err, || f().map(|t| made = Some(t))) };
    if let Some(t) = made {
        // SAFETY: `out` is writable, as this function requires.
        unsafe { *out = into_handle(t) };
    }
    code
}

/// Defines table functions whose arguments are handles and plain numbers: `$h: handle` arguments reach the safe
/// `$body` as `&Tensor`s. `-> Tensor` functions end with `out: *mut TensorHandle, err` and write the body's tensor to
/// `out`; `-> ()` functions end with `err` only (in-place ops).
macro_rules! host_fns {
    ($(fn $name:ident($($arg:ident: $kind:tt),* $(,)?) -> $ret:tt $body:block)*) => {
        $(host_fns!(@one $name ($($arg: $kind),*) $ret $body);)*
    };
    (@one $name:ident ($($arg:ident: $kind:tt),*) Tensor $body:block) => {
        unsafe extern "C" fn $name(
            _: *mut c_void,
            $($arg: host_fns!(@abi $kind),)*
            out: *mut TensorHandle,
            err: *mut ErrorBuf,
        ) -> i32 {
            $(let $arg = host_fns!(@safe $arg: $kind);)*
            let body = move || -> Result<Tensor, TchError> { $body };
            // SAFETY: `out` and `err` are valid by the table's contract (module docs).
            unsafe { produce(out, err, body) }
        }
    };
    (@one $name:ident ($($arg:ident: $kind:tt),*) () $body:block) => {
        unsafe extern "C" fn $name(
            _: *mut c_void,
            $($arg: host_fns!(@abi $kind),)*
            err: *mut ErrorBuf,
        ) -> i32 {
            $(let $arg = host_fns!(@safe $arg: $kind);)*
            let body = move || -> Result<(), TchError> { $body };
            // SAFETY: `err` is null or valid by the table's contract (module docs).
            unsafe { status(err, body) }
        }
    };
    (@abi handle) => { TensorHandle };
    (@abi $ty:ty) => { $ty };
    // SAFETY: every handle argument is a live handle of this table, not released during the call (module docs).
    (@safe $arg:ident: handle) => { unsafe { tensor($arg) } };
    (@safe $arg:ident: $ty:ty) => { $arg };
}

fn unknown(what: &str, op: u32) -> TchError {
    TchError::Kind(format!("unknown {what} op code {op}"))
}

fn transposed(x: &Tensor, yes: u32) -> Result<Tensor, TchError> {
    if yes != 0 {
        x.f_transpose(0, 1)
    } else {
        Ok(x.shallow_clone())
    }
}

host_fns! {
    fn matmul(a: handle, b: handle, ta: u32, tb: u32) -> Tensor {
        transposed(a, ta)?.f_matmul(&transposed(b, tb)?)
    }

    fn unary(op: u32, a: handle) -> Tensor {
        match op {
            UNARY_EXP => a.f_exp(),
            UNARY_NEG => a.f_neg(),
            UNARY_SIGMOID => a.f_sigmoid(),
            UNARY_RSQRT => a.f_rsqrt(),
            UNARY_SQUARE => a.f_square(),
            UNARY_SILU => a.f_silu(),
            UNARY_LOG => a.f_log(),
            _ => Err(unknown("unary", op)),
        }
    }

    fn binary(op: u32, a: handle, b: handle) -> Tensor {
        match op {
            BINARY_ADD => a.f_add(b),
            BINARY_SUB => a.f_sub(b),
            BINARY_MUL => a.f_mul(b),
            BINARY_DIV => a.f_div(b),
            _ => Err(unknown("binary", op)),
        }
    }

    fn scalar(op: u32, a: handle, v: f64) -> Tensor {
        match op {
            SCALAR_ADD => a.f_add_scalar(v),
            SCALAR_MUL => a.f_mul_scalar(v),
            SCALAR_EQ => a.f_eq(v)?.f_to_kind(a.kind()),
            SCALAR_NE => a.f_ne(v)?.f_to_kind(a.kind()),
            _ => Err(unknown("scalar", op)),
        }
    }

    fn reduce(op: u32, a: handle, dim: i64, keepdim: u32) -> Tensor {
        let keep = keepdim != 0;
        if dim == REDUCE_ALL {
            let flat = a.f_reshape([-1])?;
            return match op {
                REDUCE_SUM => a.f_sum(None::<Kind>),
                REDUCE_MEAN => a.f_mean(None::<Kind>),
                REDUCE_LOGSUMEXP => flat.f_logsumexp([0], false),
                REDUCE_MAX => a.f_max(),
                _ => Err(unknown("reduce", op)),
            };
        }
        match op {
            REDUCE_SUM => a.f_sum_dim_intlist([dim].as_slice(), keep, None::<Kind>),
            REDUCE_MEAN => a.f_mean_dim([dim].as_slice(), keep, None::<Kind>),
            REDUCE_LOGSUMEXP => a.f_logsumexp([dim], keep),
            REDUCE_MAX => a.f_amax([dim], keep),
            _ => Err(unknown("reduce", op)),
        }
    }

    fn softmax(a: handle, dim: i64) -> Tensor {
        a.f_softmax(dim, None::<Kind>)
    }

    fn narrow(a: handle, dim: i64, start: i64, len: i64) -> Tensor {
        a.f_narrow(dim, start, len)
    }

    fn gather(a: handle, dim: i64, index: handle) -> Tensor {
        a.f_gather(dim, index, false)
    }

    fn cast_like(a: handle, like: handle) -> Tensor {
        a.f_to_kind(like.kind())
    }

    fn zeros_like(a: handle) -> Tensor {
        a.f_zeros_like()
    }

    fn scatter_add_into(dst: handle, dim: i64, index: handle, src: handle) -> () {
        dst.shallow_clone().f_scatter_add_(dim, index, src).map(drop)
    }

    fn copy_into(dst: handle, dim: i64, start: i64, src: handle) -> () {
        let len = *src.size().get(dim as usize).ok_or_else(|| {
            TchError::Shape(format!("copy_into: source has no dimension {dim}"))
        })?;
        dst.f_narrow(dim, start, len)?.f_copy_(src)
    }

    fn binary_into(op: u32, dst: handle, src: handle) -> () {
        let mut d = dst.shallow_clone();
        match op {
            BINARY_ADD => d.f_add_(src),
            BINARY_SUB => d.f_sub_(src),
            BINARY_MUL => d.f_mul_(src),
            BINARY_DIV => d.f_div_(src),
            _ => Err(unknown("binary", op)),
        }
        .map(drop)
    }

    fn unary_into(op: u32, dst: handle) -> () {
        let mut d = dst.shallow_clone();
        match op {
            UNARY_EXP => d.f_exp_(),
            UNARY_NEG => d.f_neg_(),
            UNARY_SIGMOID => d.f_sigmoid_(),
            UNARY_RSQRT => d.f_rsqrt_(),
            UNARY_SQUARE => d.f_square_(),
            UNARY_SILU => d.f_silu_(),
            UNARY_LOG => d.f_log_(),
            _ => Err(unknown("unary", op)),
        }
        .map(drop)
    }

    fn addmm_into(dst: handle, a: handle, b: handle, ta: u32, tb: u32) -> () {
        dst.shallow_clone()
            .f_addmm_(&transposed(a, ta)?, &transposed(b, tb)?)
            .map(drop)
    }
}

unsafe extern "C" fn release(_: *mut c_void, h: TensorHandle) {
    if !h.is_null() {
        // SAFETY: the plugin releases only handles it owns, each exactly once (`ferl_plugin_abi::kernel`'s handle
        // ownership rules), and every such handle was made by `into_handle`.
        drop(unsafe { from_handle(h) });
    }
}

unsafe extern "C" fn shape(
    _: *mut c_void,
    h: TensorHandle,
    dims: *mut i64,
    cap: usize,
    ndim: *mut usize,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: `h` is live, `dims` has room for `cap` sizes (only the first `cap` are written), `ndim` is writable and
    // `err` is null or valid (module docs).
    unsafe {
        status(err, || {
            let s = tensor(h).size();
            *ndim = s.len();
            for (i, d) in s.iter().take(cap).enumerate() {
                *dims.add(i) = *d;
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn reshape(
    _: *mut c_void,
    a: TensorHandle,
    dims: *const i64,
    n: usize,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: `a` is live, `dims` holds `n` sizes (not read when `n == 0`), `out` is writable and `err` is null or
    // valid (module docs).
    unsafe {
        let dims = if n == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(dims, n)
        };
        let a = tensor(a);
        produce(out, err, || a.f_reshape(dims))
    }
}

unsafe extern "C" fn to_f64(
    _: *mut c_void,
    a: TensorHandle,
    out: *mut f64,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: `a` is live, `out` is a writable `f64` and `err` is null or valid (module docs).
    unsafe {
        status(err, || {
            *out = tensor(a).f_double_value(&[])?;
            Ok(())
        })
    }
}

/// The table handed to kernel plugins. Stateless (`ctx` is null): handles carry their tensors.
pub fn tch_host_ops() -> HostOps {
    HostOps {
        struct_size: std::mem::size_of::<HostOps>(),
        ctx: std::ptr::null_mut(),
        release,
        shape,
        matmul,
        unary,
        binary,
        scalar,
        reduce,
        softmax,
        narrow,
        reshape,
        gather,
        scatter_add_into,
        cast_like,
        zeros_like,
        copy_into,
        binary_into,
        unary_into,
        addmm_into,
        to_f64,
    }
}
