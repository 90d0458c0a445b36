//! `W·xᵀ` for a decode step's few rows (`csrc/skinny_gemm.cpp`): every projection of a rollout's decode step and
//! its output matrix multiply a weight matrix `W` `[out, in]` by 1 to 64 rows `x` `[n, in]`. Against matrices larger
//! than the caches MKL's sgemm reads `W` at well under the memory's streaming rate (Qwen2.5-0.5B's output matrix,
//! 545 MB, at 7 GB/s where a sum over the same bytes reads 20 GB/s, on 2 threads). The kernel streams `W` once, a
//! few rows at a time, with the batch in the vector lanes, on torch's intra-op threads. Its tiles are compiled for
//! AVX-512F and for AVX2 with FMA ([`KernelIsa`]); the CPU's widest runs, or the one `FERL_DECODE_KERNEL` names
//! (`avx512`, `avx2`, `sgemm` for none). Without either, for more than [`MAX_ROWS`] rows, or for other dtypes,
//! devices or layouts, MKL runs as before.

use std::ffi::{c_char, c_int};
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

extern "C" {
    fn ferl_w_xt_isa() -> c_int;
    fn ferl_w_xt(
        w: *const C_tensor,
        x: *const C_tensor,
        out: *const C_tensor,
        isa: c_int,
    ) -> *mut c_char;
}

/// Rows of `x` up to which the kernel runs (it keeps 16 to 64 columns of sums in registers per pass over `W`).
pub const MAX_ROWS: i64 = 64;

/// The environment variable that picks the decode kernel: `avx512`, `avx2` or `sgemm` (MKL, no kernel).
pub const KERNEL_ENV: &str = "FERL_DECODE_KERNEL";

/// An instruction set the kernel's tiles are compiled for (ordered: a CPU that runs one runs those before it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum KernelIsa {
    /// AVX2 with FMA: 8 lanes, 16 registers (x86-64 CPUs since 2013).
    Avx2 = 1,
    /// AVX-512F: 16 lanes, 32 registers.
    Avx512 = 2,
}

impl KernelIsa {
    /// The name `FERL_DECODE_KERNEL` and the benchmarks use.
    pub fn name(self) -> &'static str {
        match self {
            KernelIsa::Avx2 => "avx2",
            KernelIsa::Avx512 => "avx512",
        }
    }
}

/// The widest kernel this CPU runs, if any.
pub fn cpu_kernel_isa() -> Option<KernelIsa> {
    // SAFETY: a pure query of the CPU's features.
    match unsafe { ferl_w_xt_isa() } {
        2 => Some(KernelIsa::Avx512),
        1 => Some(KernelIsa::Avx2),
        _ => None,
    }
}

/// The kernel decode steps use: `FERL_DECODE_KERNEL`'s choice, else the CPU's widest. A choice the CPU cannot run
/// or cannot be read is named on stderr once, and the CPU's widest runs instead.
pub fn kernel_isa() -> Option<KernelIsa> {
    static CHOSEN: OnceLock<Option<KernelIsa>> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let cpu = cpu_kernel_isa();
        let Ok(asked) = std::env::var(KERNEL_ENV) else {
            return cpu;
        };
        let choice = match asked.as_str() {
            "sgemm" => return None,
            "avx512" => KernelIsa::Avx512,
            "avx2" => KernelIsa::Avx2,
            other => {
                eprintln!("{KERNEL_ENV}={other}: expected avx512, avx2 or sgemm; using {cpu:?}");
                return cpu;
            }
        };
        if cpu.is_some_and(|c| c >= choice) {
            return Some(choice);
        }
        eprintln!("{KERNEL_ENV}={asked}: this CPU runs at most {cpu:?}; using that");
        cpu
    })
}

/// Whether decode steps run the kernel on this CPU (see [`kernel_isa`]).
pub fn kernel_available() -> bool {
    kernel_isa().is_some()
}

/// Whether [`w_xt_out`] takes the kernel for these operands: 2-D fp32 CPU tensors, `w` contiguous, `x` of at most
/// [`MAX_ROWS`] rows and any strides (a decode step's activations are often transposed views), on a CPU that has it.
pub fn takes_kernel(w: &Tensor, x: &Tensor) -> bool {
    fits_kernel(w, x) && kernel_available()
}

/// The operand checks of [`takes_kernel`], without the CPU's.
fn fits_kernel(w: &Tensor, x: &Tensor) -> bool {
    let fits = |t: &Tensor| t.dim() == 2 && t.kind() == Kind::Float && t.device() == Device::Cpu;
    fits(w) && w.is_contiguous() && fits(x) && w.size()[1] == x.size()[1] && x.size()[0] <= MAX_ROWS
}

/// `out = W·xᵀ` (`[out_features, n]`) for `w` `[out_features, in]` and `x` `[n, in]`, without autograd; returns
/// `out`. The kernel of [`kernel_isa`] where [`takes_kernel`], else `w.mm_out(out, xᵀ)`.
pub fn w_xt_out(out: &Tensor, w: &Tensor, x: &Tensor) -> Tensor {
    w_xt_out_with(kernel_isa(), out, w, x)
}

/// [`w_xt_out`] with the kernel of `isa` (`None`: sgemm); an `isa` this CPU cannot run panics naming it.
pub fn w_xt_out_with(isa: Option<KernelIsa>, out: &Tensor, w: &Tensor, x: &Tensor) -> Tensor {
    let Some(isa) =
        isa.filter(|_| fits_kernel(w, x) && out.is_contiguous() && out.kind() == Kind::Float)
    else {
        return w.mm_out(out, &x.tr());
    };
    // SAFETY: the three pointers are live tch tensors for the duration of the call (the kernel checks their shapes,
    // dtypes and layouts, and that the CPU runs `isa`); a returned message is malloc'd by the callee and freed here.
    unsafe {
        let err = ferl_w_xt(w.as_ptr(), x.as_ptr(), out.as_ptr(), isa as c_int);
        if let Some(message) = crate::storage::take_shim_message(err) {
            panic!("w_xt_out: {message}");
        }
    }
    out.shallow_clone()
}

/// `W·xᵀ` in a new `[out_features, n]` tensor (see [`w_xt_out`]).
pub fn w_xt(w: &Tensor, x: &Tensor) -> Tensor {
    w_xt_with(kernel_isa(), w, x)
}

/// [`w_xt`] with the kernel of `isa` (`None`: sgemm).
pub fn w_xt_with(isa: Option<KernelIsa>, w: &Tensor, x: &Tensor) -> Tensor {
    let out = Tensor::empty([w.size()[0], x.size()[0]], (w.kind(), w.device()));
    w_xt_out_with(isa, &out, w, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel this CPU runs (AVX-512 CPUs run both).
    fn kernels_here() -> Vec<KernelIsa> {
        [KernelIsa::Avx2, KernelIsa::Avx512]
            .into_iter()
            .filter(|isa| cpu_kernel_isa().is_some_and(|cpu| cpu >= *isa))
            .collect()
    }

    #[test]
    fn every_kernel_equals_sgemm_on_every_tail_of_rows_columns_and_features() {
        for isa in kernels_here() {
            kernel_equals_sgemm(isa);
        }
    }

    fn kernel_equals_sgemm(isa: KernelIsa) {
        tch::manual_seed(0);
        let cpu = (Kind::Float, Device::Cpu);
        for (m, k, n) in [
            (1, 16, 1),
            (7, 5, 3),
            (8, 16, 2),
            (33, 100, 16),
            (1000, 896, 16),
            (517, 128, 64),
            (13, 300, 9),
            (25, 40, 41),
        ] {
            let w = Tensor::randn([m, k], cpu);
            // Rows of x contiguous, and the same values as a transposed view (a decode step's usual layout).
            let rows = Tensor::randn([n, k], cpu);
            let transposed = rows.tr().contiguous().tr();
            let want = w.to_kind(Kind::Double).mm(&rows.to_kind(Kind::Double).tr());
            for x in [&rows, &transposed] {
                let got = w_xt_with(Some(isa), &w, x);
                assert_eq!(got.size(), [m, n]);
                let err = (got.to_kind(Kind::Double) - &want)
                    .abs()
                    .max()
                    .double_value(&[]);
                let scale = want.abs().max().double_value(&[]).max(1.0);
                assert!(
                    err <= 1e-5 * scale,
                    "{isa:?}: [{m}, {k}] x [{n}, {k}] (strides {:?}): max error {err} (scale {scale})",
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
    fn an_avx2_or_avx512_cpu_takes_its_widest_kernel() {
        let w = Tensor::randn([64, 32], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([4, 32], (Kind::Float, Device::Cpu));
        let want = if std::arch::is_x86_feature_detected!("avx512f") {
            Some(KernelIsa::Avx512)
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            Some(KernelIsa::Avx2)
        } else {
            None
        };
        assert_eq!(cpu_kernel_isa(), want);
        if std::env::var_os(KERNEL_ENV).is_none() {
            assert_eq!(kernel_isa(), want);
            assert_eq!(takes_kernel(&w, &x), want.is_some());
            assert_eq!(
                takes_kernel(&w, &x.tr().contiguous().tr()),
                want.is_some(),
                "any strides of x"
            );
        }
    }
}
