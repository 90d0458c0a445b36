//! [`HostOps`] over tch: a handle is a `Box<tch::Tensor>` turned into a raw pointer. Every function catches panics
//! and libtorch errors (they become a status and a message), so nothing unwinds into the plugin.

use ferl_plugin_abi::kernel::*;
use ferl_plugin_abi::{ErrorBuf, STATUS_ERROR, STATUS_OK};
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tch::{Kind, Tensor};

/// Gives `t` to the other side as a handle (whoever receives it must release it).
pub fn into_handle(t: Tensor) -> TensorHandle {
    TensorHandle(Box::into_raw(Box::new(t)).cast())
}

/// Takes back ownership of a handle made by [`into_handle`].
///
/// # Safety
/// `h` came from [`into_handle`] and is not used afterwards.
pub unsafe fn from_handle(h: TensorHandle) -> Tensor {
    unsafe { *Box::from_raw(h.0.cast::<Tensor>()) }
}

/// Borrows the tensor behind a handle.
///
/// # Safety
/// `h` is a live handle from [`into_handle`].
unsafe fn t<'a>(h: TensorHandle) -> &'a mut Tensor {
    unsafe { &mut *h.0.cast::<Tensor>() }
}

/// Runs `f` writing its tensor to `out`; failures and panics become [`STATUS_ERROR`] with a message.
unsafe fn produce(
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
    f: impl FnOnce() -> Result<Tensor, tch::TchError>,
) -> i32 {
    unsafe {
        status(err, || {
            let r = f()?;
            *out = into_handle(r);
            Ok(())
        })
    }
}

unsafe fn status(err: *mut ErrorBuf, f: impl FnOnce() -> Result<(), tch::TchError>) -> i32 {
    unsafe {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(())) => STATUS_OK,
            Ok(Err(e)) => {
                ErrorBuf::write(err, &e.to_string());
                STATUS_ERROR
            }
            Err(_) => {
                ErrorBuf::write(err, "host tensor op panicked");
                STATUS_ERROR
            }
        }
    }
}

fn unknown(what: &str, op: u32) -> tch::TchError {
    tch::TchError::Kind(format!("unknown {what} op code {op}"))
}

fn transposed(x: &Tensor, yes: u32) -> Result<Tensor, tch::TchError> {
    if yes != 0 {
        x.f_transpose(0, 1)
    } else {
        Ok(x.shallow_clone())
    }
}

unsafe extern "C" fn release(_: *mut c_void, h: TensorHandle) {
    unsafe {
        if !h.is_null() {
            drop(from_handle(h));
        }
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
    unsafe {
        status(err, || {
            let s = t(h).size();
            *ndim = s.len();
            for (i, d) in s.iter().take(cap).enumerate() {
                *dims.add(i) = *d;
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn matmul(
    _: *mut c_void,
    a: TensorHandle,
    b: TensorHandle,
    ta: u32,
    tb: u32,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        produce(out, err, || {
            transposed(t(a), ta)?.f_matmul(&transposed(t(b), tb)?)
        })
    }
}

unsafe extern "C" fn unary(
    _: *mut c_void,
    op: u32,
    a: TensorHandle,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        produce(out, err, || {
            let a = t(a);
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
        })
    }
}

unsafe extern "C" fn binary(
    _: *mut c_void,
    op: u32,
    a: TensorHandle,
    b: TensorHandle,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        produce(out, err, || {
            let (a, b) = (t(a), t(b));
            match op {
                BINARY_ADD => a.f_add(b),
                BINARY_SUB => a.f_sub(b),
                BINARY_MUL => a.f_mul(b),
                BINARY_DIV => a.f_div(b),
                _ => Err(unknown("binary", op)),
            }
        })
    }
}

unsafe extern "C" fn scalar(
    _: *mut c_void,
    op: u32,
    a: TensorHandle,
    v: f64,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        produce(out, err, || {
            let a = t(a);
            match op {
                SCALAR_ADD => a.f_add_scalar(v),
                SCALAR_MUL => a.f_mul_scalar(v),
                SCALAR_EQ => a.f_eq(v)?.f_to_kind(a.kind()),
                SCALAR_NE => a.f_ne(v)?.f_to_kind(a.kind()),
                _ => Err(unknown("scalar", op)),
            }
        })
    }
}

unsafe extern "C" fn reduce(
    _: *mut c_void,
    op: u32,
    a: TensorHandle,
    dim: i64,
    keepdim: u32,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        produce(out, err, || {
            let a = t(a);
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
        })
    }
}

unsafe extern "C" fn softmax(
    _: *mut c_void,
    a: TensorHandle,
    dim: i64,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe { produce(out, err, || t(a).f_softmax(dim, None::<Kind>)) }
}

unsafe extern "C" fn narrow(
    _: *mut c_void,
    a: TensorHandle,
    dim: i64,
    start: i64,
    len: i64,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe { produce(out, err, || t(a).f_narrow(dim, start, len)) }
}

unsafe extern "C" fn reshape(
    _: *mut c_void,
    a: TensorHandle,
    dims: *const i64,
    n: usize,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        let dims = if n == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(dims, n)
        };
        produce(out, err, || t(a).f_reshape(dims))
    }
}

unsafe extern "C" fn gather(
    _: *mut c_void,
    a: TensorHandle,
    dim: i64,
    index: TensorHandle,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe { produce(out, err, || t(a).f_gather(dim, t(index), false)) }
}

unsafe extern "C" fn scatter_add_into(
    _: *mut c_void,
    dst: TensorHandle,
    dim: i64,
    index: TensorHandle,
    src: TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        status(err, || {
            t(dst).f_scatter_add_(dim, t(index), t(src)).map(drop)
        })
    }
}

unsafe extern "C" fn cast_like(
    _: *mut c_void,
    a: TensorHandle,
    like: TensorHandle,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe { produce(out, err, || t(a).f_to_kind(t(like).kind())) }
}

unsafe extern "C" fn zeros_like(
    _: *mut c_void,
    a: TensorHandle,
    out: *mut TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe { produce(out, err, || t(a).f_zeros_like()) }
}

unsafe extern "C" fn copy_into(
    _: *mut c_void,
    dst: TensorHandle,
    dim: i64,
    start: i64,
    src: TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        status(err, || {
            let src = t(src);
            let len = *src.size().get(dim as usize).ok_or_else(|| {
                tch::TchError::Shape(format!("copy_into: source has no dimension {dim}"))
            })?;
            t(dst).f_narrow(dim, start, len)?.f_copy_(src)
        })
    }
}

unsafe extern "C" fn binary_into(
    _: *mut c_void,
    op: u32,
    dst: TensorHandle,
    src: TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        status(err, || {
            let (d, s) = (t(dst), t(src));
            match op {
                BINARY_ADD => d.f_add_(s),
                BINARY_SUB => d.f_sub_(s),
                BINARY_MUL => d.f_mul_(s),
                BINARY_DIV => d.f_div_(s),
                _ => Err(unknown("binary", op)),
            }
            .map(drop)
        })
    }
}

unsafe extern "C" fn unary_into(
    _: *mut c_void,
    op: u32,
    dst: TensorHandle,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        status(err, || {
            let d = t(dst);
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
        })
    }
}

unsafe extern "C" fn addmm_into(
    _: *mut c_void,
    dst: TensorHandle,
    a: TensorHandle,
    b: TensorHandle,
    ta: u32,
    tb: u32,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        status(err, || {
            t(dst)
                .f_addmm_(&transposed(t(a), ta)?, &transposed(t(b), tb)?)
                .map(drop)
        })
    }
}

unsafe extern "C" fn to_f64(
    _: *mut c_void,
    a: TensorHandle,
    out: *mut f64,
    err: *mut ErrorBuf,
) -> i32 {
    unsafe {
        status(err, || {
            *out = t(a).f_double_value(&[])?;
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
