//! Attention over sequences packed in one row (`use_remove_padding=true`), without a `T × T` mask: each sequence
//! attends causally to itself only, so cost and memory follow `Σ Lᵢ²`, not `T²`.
//!
//! The sequences are described by their cumulative lengths (`cu_seqlens`), built once per micro-batch.
//!
//! - On CUDA, torch's variable-length kernels take the whole row and `cu_seqlens` (int32 on the device): flash
//!   attention for bf16/fp16, memory-efficient attention for fp32 (kv heads expanded for GQA). tch 0.24 does not expose
//!   these aten ops, so `csrc/varlen_attention.cpp` calls them (through the dispatcher: autograd records them with
//!   their backward formulas). Dtypes and head sizes the kernels do not take use the per-sequence path below, as does a
//!   kernel that fails (e.g. flash on a GPU older than Ampere: warned once, not tried again).
//! - On the CPU, one autograd op (`csrc/packed_attention.cpp`) runs torch's CPU flash-attention kernel on each run of
//!   consecutive sequences of equal length (batched, `[n, heads, L, head_dim]`) and writes its output, and in backward
//!   the gradients of q, k and v, into row-sized tensors in place: autograd keeps the output once, and nothing but the
//!   results and one run's buffers is allocated — no index copies, no `T × T` anything.
//! - Elsewhere (a CUDA dtype or head size no kernel takes), the row is split at the same runs (one
//!   `split_with_sizes`, whose backward is one `cat`), each runs causal SDPA, and the outputs are concatenated.
//!
//! Both are autograd ops only, so gradients and checkpointed recomputation flow as through any other op.

use anyhow::{bail, Context, Result};
use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicBool, Ordering};
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

/// Packed sequences of one micro-batch row: their boundaries and the runs of consecutive equal lengths.
pub struct Varlen {
    cu_seqlens: Vec<i64>,
    /// `(length, count)` of each run of consecutive sequences of equal length, in row order.
    runs: Vec<(i64, i64)>,
    /// `cu_seqlens` as the CUDA kernels take them (int32 on the device); `None` off CUDA.
    cu_device: Option<Tensor>,
}

/// Which of torch's variable-length CUDA kernels runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Flash attention (bf16, fp16; GQA native).
    Flash,
    /// Memory-efficient attention (also fp32; kv heads expanded).
    Efficient,
}

/// The kernel that takes `kind` at `head_dim`, if any (flash: head dim a multiple of 8 up to 256; memory-efficient:
/// fp32 rows aligned to 16 bytes).
pub fn kernel_for(kind: Kind, head_dim: i64) -> Option<Kernel> {
    match kind {
        Kind::BFloat16 | Kind::Half if head_dim % 8 == 0 && head_dim <= 256 => Some(Kernel::Flash),
        Kind::Float if head_dim % 4 == 0 => Some(Kernel::Efficient),
        _ => None,
    }
}

/// `cu_seqlens` as torch's CUDA kernels take them: int32 on `device`.
pub fn kernel_cu_seqlens(cu: &[i64], device: Device) -> Result<Tensor> {
    let cu: Vec<i32> = cu
        .iter()
        .map(|&c| i32::try_from(c).context("a packed row of more than 2^31 tokens"))
        .collect::<Result<_>>()?;
    Ok(Tensor::from_slice(&cu).to_device(device))
}

extern "C" {
    fn ferl_varlen_attention(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        cu: *const C_tensor,
        max_len: i64,
        flash: c_int,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    fn ferl_packed_attention_cpu(
        q: *const C_tensor,
        k: *const C_tensor,
        v: *const C_tensor,
        runs: *const i64,
        n_runs: i64,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
}

/// Runs `kernel` on `q` `[T, heads, D]`, `k`/`v` `[T, kv_heads, D]` (kv heads equal to heads for
/// [`Kernel::Efficient`]) with int32 `cu_seqlens` `cu`; the result is `[T, heads, D]`. Fails with torch's message
/// (e.g. on tensors not on a CUDA device).
pub fn kernel_attend(
    kernel: Kernel,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu: &Tensor,
    max_len: i64,
) -> Result<Tensor> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let flash = c_int::from(kernel == Kernel::Flash);
    // SAFETY: the pointers are live tch tensors (`at::Tensor*`) for the duration of the call; on success `out` is
    // a new `at::Tensor*` whose ownership passes to the returned `Tensor`; a returned message is freed here.
    unsafe {
        let err = ferl_varlen_attention(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            cu.as_ptr(),
            max_len,
            flash,
            &mut out,
        );
        if let Some(message) = crate::storage::take_shim_message(err) {
            bail!("{kernel:?} variable-length attention: {message}");
        }
        Ok(Tensor::from_ptr(out))
    }
}

/// `[0, L₀, L₀+L₁, …]`: the cumulative sequence lengths of `lens`.
pub fn cu_seqlens(lens: &[i64]) -> Vec<i64> {
    std::iter::once(0)
        .chain(lens.iter().scan(0, |acc, &l| {
            *acc += l;
            Some(*acc)
        }))
        .collect()
}

impl Varlen {
    /// The layout of sequences of lengths `lens` packed in this order in one row on `device`.
    pub fn new(lens: &[i64], device: Device) -> Result<Self> {
        if lens.is_empty() {
            bail!("packed attention needs at least one sequence");
        }
        if let Some((i, l)) = lens.iter().enumerate().find(|(_, &l)| l < 1) {
            bail!("packed sequence {i} has length {l}; every sequence needs at least one token");
        }
        let cu = cu_seqlens(lens);
        let mut runs: Vec<(i64, i64)> = Vec::new();
        for &l in lens {
            match runs.last_mut() {
                Some((len, n)) if *len == l => *n += 1,
                _ => runs.push((l, 1)),
            }
        }
        let cu_device = match device {
            Device::Cuda(_) => Some(kernel_cu_seqlens(&cu, device)?),
            _ => None,
        };
        Ok(Self {
            cu_seqlens: cu,
            runs,
            cu_device,
        })
    }

    /// Cumulative sequence lengths, `[0, L₀, L₀+L₁, …, T]`.
    pub fn cu_seqlens(&self) -> &[i64] {
        &self.cu_seqlens
    }

    /// The longest sequence.
    pub fn max_len(&self) -> i64 {
        self.runs.iter().map(|r| r.0).max().unwrap_or(0)
    }

    /// SDPA calls per layer off the CUDA kernels: runs of consecutive sequences of equal length.
    pub fn num_calls(&self) -> usize {
        self.runs.len()
    }

    /// Causal attention of each sequence to itself: `q` `[1, heads, T, D]`, `k`/`v` `[1, kv_heads, T, D]` (GQA when
    /// `gqa`), result `[1, heads, T, D]`.
    pub fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, gqa: bool) -> Tensor {
        let total = *self.cu_seqlens.last().expect("at least one sequence");
        assert_eq!(
            q.size()[2],
            total,
            "packed attention: the row has {} tokens, the layout {total}",
            q.size()[2]
        );
        if let Some(o) = self.on_kernel(q, k, v) {
            return o;
        }
        match q.device() {
            Device::Cpu => self.on_cpu(q, k, v),
            _ => self.per_run(q, k, v, gqa),
        }
    }

    /// [`Varlen::attend`] by tch ops (any device): the row split at the runs, causal SDPA on each, the outputs
    /// concatenated.
    fn per_run(&self, q: &Tensor, k: &Tensor, v: &Tensor, gqa: bool) -> Tensor {
        let sizes: Vec<i64> = self.runs.iter().map(|(l, n)| l * n).collect();
        let (qs, ks, vs) = (
            q.split_with_sizes(&sizes, 2),
            k.split_with_sizes(&sizes, 2),
            v.split_with_sizes(&sizes, 2),
        );
        let mut outs: Vec<Tensor> = qs
            .iter()
            .zip(ks.iter().zip(&vs))
            .zip(&self.runs)
            .map(|((q, (k, v)), &(len, n))| {
                let causal = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    Tensor::scaled_dot_product_attention(
                        q,
                        k,
                        v,
                        None::<&Tensor>,
                        0.0,
                        true,
                        None,
                        gqa,
                    )
                };
                match n {
                    1 => causal(q, k, v),
                    _ => join_rows(&causal(
                        &split_rows(q, n, len),
                        &split_rows(k, n, len),
                        &split_rows(v, n, len),
                    )),
                }
            })
            .collect();
        match outs.len() {
            1 => outs.pop().expect("one run"),
            _ => Tensor::cat(&outs, 2),
        }
    }

    /// [`Varlen::attend`] on the CPU: one autograd op (`csrc/packed_attention.cpp`) that runs torch's CPU flash kernel
    /// per run and writes the output, and in backward the input gradients, into row-sized tensors in place.
    fn on_cpu(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let runs: Vec<i64> = self.runs.iter().flat_map(|&(l, n)| [l, n]).collect();
        let mut out: *mut C_tensor = std::ptr::null_mut();
        // SAFETY: the tensors are live tch tensors (`at::Tensor*`) and `runs` holds `2 · runs.len()` integers for the
        // duration of the call; on success `out` is a new `at::Tensor*` whose ownership passes to the returned
        // `Tensor`; a returned message is freed here.
        unsafe {
            let err = ferl_packed_attention_cpu(
                q.as_ptr(),
                k.as_ptr(),
                v.as_ptr(),
                runs.as_ptr(),
                self.runs.len() as i64,
                &mut out,
            );
            if let Some(message) = crate::storage::take_shim_message(err) {
                panic!("packed attention on the CPU: {message}");
            }
            Tensor::from_ptr(out)
        }
    }

    /// [`Varlen::attend`] by a CUDA kernel, when the row is on CUDA and a kernel takes its dtype and head size.
    fn on_kernel(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Option<Tensor> {
        static FAILED: AtomicBool = AtomicBool::new(false);
        let cu = self
            .cu_device
            .as_ref()
            .filter(|_| !FAILED.load(Ordering::Relaxed))?;
        let kernel = kernel_for(q.kind(), q.size()[3])?;
        let rows = |x: &Tensor| x.squeeze_dim(0).transpose(0, 1).contiguous(); // [T, heads, D]
        let (heads, kv_heads) = (q.size()[1], k.size()[1]);
        let kv = |x: &Tensor| match kernel {
            Kernel::Efficient if kv_heads != heads => {
                rows(&x.repeat_interleave_self_int(heads / kv_heads, 1, None::<i64>))
            }
            _ => rows(x),
        };
        match kernel_attend(kernel, &rows(q), &kv(k), &kv(v), cu, self.max_len()) {
            Ok(o) => Some(o.transpose(0, 1).unsqueeze(0)),
            Err(e) => {
                if !FAILED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "{e:#}; packed attention runs per group of equal lengths from now on"
                    );
                }
                None
            }
        }
    }
}

/// `[1, h, n·L, D]` → `[n, h, L, D]`.
fn split_rows(x: &Tensor, n: i64, len: i64) -> Tensor {
    let (h, d) = (x.size()[1], x.size()[3]);
    x.reshape([h, n, len, d]).transpose(0, 1)
}

/// `[n, h, L, D]` → `[1, h, n·L, D]`.
fn join_rows(x: &Tensor) -> Tensor {
    let s = x.size();
    x.transpose(0, 1).reshape([1, s[1], s[0] * s[2], s[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_seqlens_are_cumulative_from_zero() {
        assert_eq!(cu_seqlens(&[3, 1, 4]), vec![0, 3, 4, 8]);
        assert_eq!(cu_seqlens(&[5]), vec![0, 5]);
    }

    #[test]
    fn consecutive_equal_lengths_form_runs() {
        let v = Varlen::new(&[2, 2, 3, 1, 1, 2], Device::Cpu).unwrap();
        assert_eq!(v.cu_seqlens(), &[0, 2, 4, 7, 8, 9, 11]);
        assert_eq!(v.runs, vec![(2, 2), (3, 1), (1, 2), (2, 1)]);
        assert_eq!((v.max_len(), v.num_calls()), (3, 4));
        let one = Varlen::new(&[5], Device::Cpu).unwrap();
        assert_eq!((one.runs.clone(), one.max_len()), (vec![(5, 1)], 5));
    }

    #[test]
    fn kernels_are_chosen_by_dtype_and_head_size() {
        assert_eq!(kernel_for(Kind::BFloat16, 64), Some(Kernel::Flash));
        assert_eq!(kernel_for(Kind::Half, 128), Some(Kernel::Flash));
        assert_eq!(kernel_for(Kind::Float, 64), Some(Kernel::Efficient));
        assert_eq!(
            kernel_for(Kind::BFloat16, 12),
            None,
            "flash needs multiples of 8"
        );
        assert_eq!(kernel_for(Kind::BFloat16, 512), None, "flash stops at 256");
        assert_eq!(kernel_for(Kind::Float, 6), None);
        assert_eq!(kernel_for(Kind::Double, 64), None);
    }

    #[test]
    fn kernel_cu_seqlens_are_int32() {
        let cu = kernel_cu_seqlens(&cu_seqlens(&[3, 1, 4]), Device::Cpu).unwrap();
        assert_eq!(cu.kind(), Kind::Int);
        assert_eq!(Vec::<i32>::try_from(&cu).unwrap(), vec![0, 3, 4, 8]);
        assert!(kernel_cu_seqlens(&[0, 1 << 31], Device::Cpu).is_err());
        let cpu = Varlen::new(&[3, 1], Device::Cpu).unwrap();
        assert!(cpu.cu_device.is_none(), "no kernel inputs off CUDA");
    }

    /// The kernels are CUDA-only: on CPU tensors the call reaches torch's dispatcher and comes back as an error
    /// naming the op (the C++ shim links and its errors cross the boundary).
    #[test]
    fn kernel_calls_reach_torch_and_report_its_errors() {
        let x = Tensor::randn([4, 2, 8], (Kind::BFloat16, Device::Cpu));
        let cu = kernel_cu_seqlens(&[0, 4], Device::Cpu).unwrap();
        for (kernel, op) in [
            (Kernel::Flash, "_flash_attention_forward"),
            (Kernel::Efficient, "_efficient_attention_forward"),
        ] {
            let e = kernel_attend(kernel, &x, &x, &x, &cu, 4)
                .unwrap_err()
                .to_string();
            assert!(e.contains(op), "{kernel:?}: {e}");
        }
    }

    /// The CPU op and the per-run tch path (what CUDA falls back to) agree: outputs and input gradients, GQA.
    #[test]
    fn the_cpu_op_equals_the_per_run_path() {
        tch::manual_seed(1);
        let varlen = Varlen::new(&[3, 3, 5, 1, 1, 7], Device::Cpu).unwrap();
        let t = 20;
        let leaf =
            |h| Tensor::randn([1, h, t, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (q, k, v) = (leaf(4), leaf(2), leaf(2));
        let dy = Tensor::randn([1, 4, t, 8], (Kind::Float, Device::Cpu));
        let run = |o: Tensor| {
            let g =
                Tensor::run_backward(&[(&o * &dy).sum(Kind::Float)], &[&q, &k, &v], false, false);
            [
                o.detach(),
                g[0].shallow_clone(),
                g[1].shallow_clone(),
                g[2].shallow_clone(),
            ]
        };
        let ours = run(varlen.on_cpu(&q, &k, &v));
        let theirs = run(varlen.per_run(&q, &k, &v, true));
        for (name, (a, b)) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(ours.iter().zip(&theirs))
        {
            let d = (a - b).abs().max().double_value(&[]);
            assert!(d < 1e-5, "{name} differs by {d}");
        }
    }

    #[test]
    fn empty_layouts_and_empty_sequences_are_refused() {
        assert!(Varlen::new(&[], Device::Cpu).is_err());
        let e = Varlen::new(&[3, 0], Device::Cpu).err().unwrap().to_string();
        assert!(e.contains("sequence 1 has length 0"), "{e}");
    }
}
