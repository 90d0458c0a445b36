//! Element types the collectives move, and the element-wise reduction kernels the TCP backend applies to them.

use anyhow::{bail, Result};
use half::{bf16, f16};
use tch::Kind;

/// The element types a collective can carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer (also carries `bool`).
    U8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
}

/// How values from different ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size (floating-point types only).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl DType {
    /// The element type of a tch tensor kind, or an error naming the unsupported kind.
    pub fn from_kind(kind: Kind) -> Result<Self> {
        Ok(match kind {
            Kind::Float => DType::F32,
            Kind::Double => DType::F64,
            Kind::BFloat16 => DType::BF16,
            Kind::Half => DType::F16,
            Kind::Int8 => DType::I8,
            Kind::Uint8 | Kind::Bool => DType::U8,
            Kind::Int16 => DType::I16,
            Kind::Int => DType::I32,
            Kind::Int64 => DType::I64,
            other => bail!("collectives do not support tensors of kind {other:?}"),
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 | DType::I16 => 2,
            DType::I8 | DType::U8 => 1,
        }
    }

    /// Whether the type is a floating-point type (the only ones `ReduceOp::Avg` accepts).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }
}

/// An element that can be reduced.
trait Reducible: Copy {
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
}

macro_rules! native_reducible {
    ($($t:ty => $add:ident),*) => {$(
        impl Reducible for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.$add(b),
                    ReduceOp::Max => if b > a { b } else { a },
                    ReduceOp::Min => if b < a { b } else { a },
                }
            }
        }
    )*};
}

/// Floats add with `+`; integers wrap like torch's integer sum.
trait PlainAdd {
    fn plain_add(self, other: Self) -> Self;
}
impl PlainAdd for f32 {
    #[inline(always)]
    fn plain_add(self, other: Self) -> Self {
        self + other
    }
}
impl PlainAdd for f64 {
    #[inline(always)]
    fn plain_add(self, other: Self) -> Self {
        self + other
    }
}

native_reducible!(f32 => plain_add, f64 => plain_add, i8 => wrapping_add, u8 => wrapping_add,
    i16 => wrapping_add, i32 => wrapping_add, i64 => wrapping_add);

macro_rules! half_reducible {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => <$t>::from_f32(a.to_f32() + b.to_f32()),
                    ReduceOp::Max => if b > a { b } else { a },
                    ReduceOp::Min => if b < a { b } else { a },
                }
            }
        }
    )*};
}
half_reducible!(bf16, f16);

/// `dst[i] = op(dst[i], src[i])`, specialised per op so the sum loop vectorises.
fn combine_in_place<T: Reducible>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = T::combine(ReduceOp::Sum, *d, *s);
            }
        }
        _ => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = T::combine(op, *d, *s);
            }
        }
    }
}

/// `dst[i] = op(a[i], b[i])`.
fn combine_into<T: Reducible>(op: ReduceOp, dst: &mut [T], a: &[T], b: &[T]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
                *d = T::combine(ReduceOp::Sum, *x, *y);
            }
        }
        _ => {
            for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
                *d = T::combine(op, *x, *y);
            }
        }
    }
}

/// Combines `count` elements: `dst = op(other, received)`, where `other` may be `dst` itself (in-place reduction).
///
/// # Safety
/// `dst`, `other` and `received` must each point to `count` valid, aligned elements of `dtype`; `received` must not
/// overlap `dst`; `other` either equals `dst` or does not overlap it.
pub(crate) unsafe fn reduce_raw(
    dtype: DType,
    op: ReduceOp,
    dst: *mut u8,
    other: *const u8,
    received: *const u8,
    count: usize,
) {
    /// [`reduce_raw`] for element type `T`.
    ///
    /// # Safety
    /// As [`reduce_raw`], with `T` the element type of its `dtype`.
    unsafe fn run<T: Reducible>(
        op: ReduceOp,
        dst: *mut u8,
        other: *const u8,
        received: *const u8,
        count: usize,
    ) {
        // SAFETY: the caller guarantees `count` valid, aligned `T`s at each pointer. The only mutable slice, over
        // `dst`, is borrowed next to `received` (which never overlaps `dst`) and, when `other` is not `dst`
        // itself, next to `other` (which then does not overlap `dst` either), so no slice aliases the mutable one.
        unsafe {
            let src = std::slice::from_raw_parts(received as *const T, count);
            if std::ptr::eq(dst as *const u8, other) {
                combine_in_place(
                    op,
                    std::slice::from_raw_parts_mut(dst as *mut T, count),
                    src,
                );
            } else {
                let a = std::slice::from_raw_parts(other as *const T, count);
                combine_into(
                    op,
                    std::slice::from_raw_parts_mut(dst as *mut T, count),
                    a,
                    src,
                );
            }
        }
    }
    // SAFETY: each arm calls `run` with the element type `dtype` names, so `run`'s contract is this function's.
    unsafe {
        match dtype {
            DType::F32 => run::<f32>(op, dst, other, received, count),
            DType::F64 => run::<f64>(op, dst, other, received, count),
            DType::BF16 => run::<bf16>(op, dst, other, received, count),
            DType::F16 => run::<f16>(op, dst, other, received, count),
            DType::I8 => run::<i8>(op, dst, other, received, count),
            DType::U8 => run::<u8>(op, dst, other, received, count),
            DType::I16 => run::<i16>(op, dst, other, received, count),
            DType::I32 => run::<i32>(op, dst, other, received, count),
            DType::I64 => run::<i64>(op, dst, other, received, count),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_raw_sums_in_place_and_out_of_place() {
        let mut dst = vec![1.0f32, 2.0, 3.0];
        let recv = [10.0f32, 20.0, 30.0];
        let p = dst.as_mut_ptr() as *mut u8;
        // SAFETY: in place: `p` is `dst`'s 3 f32s (also passed as `other`), `recv` is a separate array of 3 f32s.
        unsafe {
            reduce_raw(
                DType::F32,
                ReduceOp::Sum,
                p,
                p,
                recv.as_ptr() as *const u8,
                3,
            )
        };
        assert_eq!(dst, [11.0, 22.0, 33.0]);
        let other = [1i64, 5, -3];
        let recv = [4i64, 2, -7];
        let mut out = [0i64; 3];
        // SAFETY: `out`, `other` and `recv` are three separate arrays of 3 i64s.
        unsafe {
            reduce_raw(
                DType::I64,
                ReduceOp::Max,
                out.as_mut_ptr() as *mut u8,
                other.as_ptr() as *const u8,
                recv.as_ptr() as *const u8,
                3,
            )
        };
        assert_eq!(out, [4, 5, -3]);
    }

    #[test]
    fn bf16_sum_rounds_through_f32() {
        let mut dst = [bf16::from_f32(1.5), bf16::from_f32(-2.0)];
        let recv = [bf16::from_f32(0.25), bf16::from_f32(8.0)];
        let p = dst.as_mut_ptr() as *mut u8;
        // SAFETY: in place: `p` is `dst`'s 2 bf16s (also passed as `other`), `recv` is a separate array of 2 bf16s.
        unsafe {
            reduce_raw(
                DType::BF16,
                ReduceOp::Sum,
                p,
                p,
                recv.as_ptr() as *const u8,
                2,
            )
        };
        assert_eq!(dst.map(|x| x.to_f32()), [1.75, 6.0]);
        assert_eq!(DType::from_kind(Kind::BFloat16).unwrap().size(), 2);
        assert!(DType::from_kind(Kind::ComplexFloat).is_err());
    }
}
