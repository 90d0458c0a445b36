//! `W·xᵀ` for a decode step's few rows (`csrc/skinny_gemm.cpp`): every projection of a rollout's decode step and
//! its output matrix multiply a weight matrix `W` `[out, in]` by 1 to 64 rows `x` `[n, in]`. Against matrices larger
//! than the caches MKL's sgemm reads `W` at well under the memory's streaming rate (Qwen2.5-0.5B's output matrix,
//! 545 MB, at 7 GB/s where a sum over the same bytes reads 20 GB/s, on 2 threads). The kernel streams `W` once, a
//! few rows at a time, with the batch in the AVX-512 lanes, on torch's intra-op threads. Without AVX-512F, for more
//! than [`MAX_ROWS`] rows, or for other dtypes, devices or layouts, MKL runs as before.

use std::ffi::{c_char, c_int};
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn ferl_w_xt_supported() -> c_int;
    fn ferl_w_xt(w: *const C_tensor, x: *const C_tensor, out: *const C_tensor) -> *mut c_char;
}

/// Rows of `x` up to which the kernel runs (it keeps 16 to 64 columns of sums in registers per pass over `W`).
pub const MAX_ROWS: i64 = 64;

/// Whether this CPU runs the kernel (AVX-512F).
pub fn kernel_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    // SAFETY: a pure query of the CPU's features.
    *AVAILABLE.get_or_init(|| unsafe { ferl_w_xt_supported() } == 1)
}

/// Whether [`w_xt_out`] takes the kernel for these operands: 2-D fp32 CPU tensors, `w` contiguous, `x` of at most
/// [`MAX_ROWS`] rows and any strides (a decode step's activations are often transposed views), on a CPU that has it.
pub fn takes_kernel(w: &Tensor, x: &Tensor) -> bool {
    let fits = |t: &Tensor| t.dim() == 2 && t.kind() == Kind::Float && t.device() == Device::Cpu;
    fits(w)
        && w.is_contiguous()
        && fits(x)
        && w.size()[1] == x.size()[1]
        && x.size()[0] <= MAX_ROWS
        && kernel_available()
}

/// `out = W·xᵀ` (`[out_features, n]`) for `w` `[out_features, in]` and `x` `[n, in]`, without autograd; returns
/// `out`. The kernel where [`takes_kernel`], else `w.mm_out(out, xᵀ)`.
pub fn w_xt_out(out: &Tensor, w: &Tensor, x: &Tensor) -> Tensor {
    if !(takes_kernel(w, x) && out.is_contiguous() && out.kind() == Kind::Float) {
        return w.mm_out(out, &x.tr());
    }
    // SAFETY: the three pointers are live tch tensors for the duration of the call (the kernel checks their shapes,
    // dtypes and layouts); a returned message is malloc'd by the callee and freed here.
    unsafe {
        let err = ferl_w_xt(w.as_ptr(), x.as_ptr(), out.as_ptr());
        if let Some(message) = crate::storage::take_shim_message(err) {
            panic!("w_xt_out: {message}");
        }
    }
    out.shallow_clone()
}

/// `W·xᵀ` in a new `[out_features, n]` tensor (see [`w_xt_out`]).
pub fn w_xt(w: &Tensor, x: &Tensor) -> Tensor {
    let out = Tensor::empty([w.size()[0], x.size()[0]], (w.kind(), w.device()));
    w_xt_out(&out, w, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_equals_sgemm_on_every_tail_of_rows_columns_and_features() {
        tch::manual_seed(0);
        let cpu = (Kind::Float, Device::Cpu);
        for (m, k, n) in [
            (1, 16, 1),
            (7, 5, 3),
            (8, 16, 2),
            (33, 100, 16),
            (1000, 896, 16),
            (517, 128, 64),
        ] {
            let w = Tensor::randn([m, k], cpu);
            // Rows of x contiguous, and the same values as a transposed view (a decode step's usual layout).
            let rows = Tensor::randn([n, k], cpu);
            let transposed = rows.tr().contiguous().tr();
            let want = w.to_kind(Kind::Double).mm(&rows.to_kind(Kind::Double).tr());
            for x in [&rows, &transposed] {
                let got = w_xt(&w, x);
                assert_eq!(got.size(), [m, n]);
                let err = (got.to_kind(Kind::Double) - &want)
                    .abs()
                    .max()
                    .double_value(&[]);
                let scale = want.abs().max().double_value(&[]).max(1.0);
                assert!(
                    err <= 1e-5 * scale,
                    "[{m}, {k}] x [{n}, {k}] (strides {:?}): max error {err} (scale {scale})",
                    x.stride()
                );
            }
        }
    }

    #[test]
    fn other_operands_fall_back_to_sgemm() {
        let w = Tensor::randn([24, 40], (Kind::Float, Device::Cpu)).tr(); // not contiguous
        let x = Tensor::randn([3, 24], (Kind::Float, Device::Cpu));
        assert!(!takes_kernel(&w, &x));
        let got = w_xt(&w, &x);
        assert!(got.allclose(&w.mm(&x.tr()), 1e-5, 1e-5, false));
        let w = w.contiguous();
        let (wd, xd) = (
            w.to_kind(Kind::Double),
            x.contiguous().to_kind(Kind::Double),
        );
        assert!(!takes_kernel(&wd, &xd));
        assert!(w_xt(&wd, &xd).allclose(&wd.mm(&xd.tr()), 1e-12, 1e-12, false));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn an_avx512_cpu_takes_the_kernel() {
        let w = Tensor::randn([64, 32], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([4, 32], (Kind::Float, Device::Cpu));
        let avx512 = std::arch::is_x86_feature_detected!("avx512f");
        assert_eq!(takes_kernel(&w, &x), avx512);
        assert_eq!(
            takes_kernel(&w, &x.tr().contiguous().tr()),
            avx512,
            "any strides of x"
        );
    }
}
