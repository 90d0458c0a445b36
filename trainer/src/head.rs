//! The output projection and cross-entropy of the target rows, chunk by chunk, with the backward written out by hand
//! into one reusable fp32 buffer (`[rows, vocab]`, allocated once per engine): per chunk the logits are computed into
//! the buffer, the loss is `logsumexp - target logit`, then the buffer is turned in place into the logits' gradient
//! (`softmax - onehot`, scaled) and used for both gradient matmuls. Nothing of size `[tokens, vocab]` is ever
//! allocated, and no autograd graph holds vocabulary-sized tensors.

use tch::{Device, Kind, Tensor};

/// Chunked projection + cross-entropy with its reusable buffer.
pub struct ChunkedHead {
    buf: Option<Tensor>,
    max_elements: i64,
}

impl ChunkedHead {
    /// A head whose chunks hold at most `max_elements` logits.
    pub fn new(max_elements: i64) -> Self {
        Self {
            buf: None,
            max_elements,
        }
    }

    fn rows_per_chunk(&self, vocab: i64) -> i64 {
        (self.max_elements / vocab).max(1)
    }

    /// The first `rows` rows of the buffer (grown when too small or on another device).
    fn buffer(&mut self, rows: i64, vocab: i64, device: Device) -> Tensor {
        let fits = self
            .buf
            .as_ref()
            .is_some_and(|b| b.size()[0] >= rows && b.size()[1] == vocab && b.device() == device);
        if !fits {
            let cap = rows.max(self.rows_per_chunk(vocab));
            self.buf = Some(Tensor::empty([cap, vocab], (Kind::Float, device)));
        }
        self.buf
            .as_ref()
            .expect("buffer just made")
            .narrow(0, 0, rows)
    }

    fn logits_into(&mut self, x: &Tensor, w: &Tensor) -> Tensor {
        let (n, vocab) = (x.size()[0], w.size()[0]);
        let mut logits = self.buffer(n, vocab, x.device());
        if x.kind() == Kind::Float && w.kind() == Kind::Float {
            let _ = x.mm_out(&logits, &w.tr());
        } else {
            logits.copy_(&x.mm(&w.tr()));
        }
        logits
    }

    /// Summed cross-entropy of `x` (`[n, H]`, normalised rows) against `w` (`[V, H]`) for `targets` (`[n]`), and the
    /// gradients of `scale * loss` with respect to `x` (in `x`'s dtype) and, when `want_grad_w`, `w` (fp32; `None`
    /// otherwise: a frozen output matrix, as under LoRA, skips its `[V, H]` buffer and one of the three matmuls over
    /// the vocabulary). Runs without autograd.
    /// The logits and their softmax are fp32 whatever the inputs; when `x` is in a low-precision dtype (bf16
    /// compute) the two gradient matmuls run in that dtype too (the logits' gradient is cast per chunk), as autocast
    /// would run them — an fp32 matmul over the vocabulary would dominate a GPU step.
    pub fn loss_and_grads(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        scale: f64,
        want_grad_w: bool,
    ) -> (Tensor, Tensor, Option<Tensor>) {
        let _g = tch::no_grad_guard();
        let n_all = x.size()[0];
        let chunk = self.rows_per_chunk(w.size()[0]);
        let mut loss = Tensor::zeros([], (Kind::Double, x.device()));
        let mut grad_w = want_grad_w.then(|| Tensor::zeros(w.size(), (Kind::Float, x.device())));
        let low_precision = x.kind() != Kind::Float;
        let w_f = if low_precision {
            w.shallow_clone()
        } else {
            w.to_kind(Kind::Float)
        };
        let mut grad_x = Vec::new();
        let mut start = 0;
        while start < n_all {
            let n = chunk.min(n_all - start);
            let xc = x.narrow(0, start, n);
            let t = targets.narrow(0, start, n).unsqueeze(1);
            let mut g = self.logits_into(&xc, w);
            let lse = g.logsumexp([1], true);
            loss += (&lse - g.gather(1, &t, false)).sum(Kind::Double);
            // In place: logits -> softmax -> softmax - onehot -> times scale.
            let _ = g.g_sub_(&lse).exp_();
            let _ = g.scatter_add_(
                1,
                &t,
                &Tensor::full([n, 1], -1.0, (Kind::Float, x.device())),
            );
            let _ = g.g_mul_scalar_(scale);
            if low_precision {
                let gl = g.to_kind(x.kind());
                grad_x.push(gl.mm(&w_f.to_kind(x.kind())));
                if let Some(gw) = &mut grad_w {
                    let _ = gw.g_add_(&gl.tr().mm(&xc));
                }
            } else {
                grad_x.push(g.mm(&w_f).to_kind(x.kind()));
                if let Some(gw) = &mut grad_w {
                    let _ = gw.addmm_(&g.tr(), &xc.to_kind(Kind::Float));
                }
            }
            start += n;
        }
        (loss, Tensor::cat(&grad_x, 0), grad_w)
    }

    /// Summed cross-entropy only (validation).
    pub fn loss(&mut self, x: &Tensor, w: &Tensor, targets: &Tensor) -> Tensor {
        let _g = tch::no_grad_guard();
        let n_all = x.size()[0];
        let chunk = self.rows_per_chunk(w.size()[0]);
        let mut loss = Tensor::zeros([], (Kind::Double, x.device()));
        let mut start = 0;
        while start < n_all {
            let n = chunk.min(n_all - start);
            let g = self.logits_into(&x.narrow(0, start, n), w);
            let t = targets.narrow(0, start, n).unsqueeze(1);
            loss += (g.logsumexp([1], true) - g.gather(1, &t, false)).sum(Kind::Double);
            start += n;
        }
        loss
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_written_backward_matches_autograd_across_chunks() {
        tch::manual_seed(0);
        let x = Tensor::randn([7, 5], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([11, 5], (Kind::Float, Device::Cpu));
        let t = Tensor::from_slice(&[0i64, 3, 10, 4, 4, 1, 9]);
        let mut head = ChunkedHead::new(3 * 11); // 3 rows per chunk: 3 chunks
        let (loss, gx, gw) = head.loss_and_grads(&x, &w, &t, 0.5, true);
        let gw = gw.expect("grad w asked for");
        let xa = x.detach().set_requires_grad(true);
        let wa = w.detach().set_requires_grad(true);
        let ce =
            xa.mm(&wa.tr())
                .cross_entropy_loss::<Tensor>(&t, None, tch::Reduction::Sum, -100, 0.0);
        let g = Tensor::run_backward(&[&ce * 0.5], &[&xa, &wa], false, false);
        let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
        assert!((loss.double_value(&[]) - ce.double_value(&[])).abs() < 1e-4);
        assert!(
            close(&gx, &g[0]) < 1e-5,
            "grad x differs by {}",
            close(&gx, &g[0])
        );
        assert!(
            close(&gw, &g[1]) < 1e-5,
            "grad w differs by {}",
            close(&gw, &g[1])
        );
        assert!((head.loss(&x, &w, &t).double_value(&[]) - ce.double_value(&[])).abs() < 1e-4);
    }

    #[test]
    fn frozen_output_matrix_skips_its_gradient_and_changes_nothing_else() {
        tch::manual_seed(2);
        let x = Tensor::randn([7, 5], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([11, 5], (Kind::Float, Device::Cpu));
        let t = Tensor::from_slice(&[0i64, 3, 10, 4, 4, 1, 9]);
        for kind in [Kind::Float, Kind::BFloat16] {
            let (x, w) = (x.to_kind(kind), w.to_kind(kind));
            let mut head = ChunkedHead::new(3 * 11);
            let (loss, gx, gw) = head.loss_and_grads(&x, &w, &t, 0.5, true);
            let (frozen_loss, frozen_gx, none) = head.loss_and_grads(&x, &w, &t, 0.5, false);
            assert!(gw.is_some() && none.is_none(), "{kind:?}");
            assert!(loss.equal(&frozen_loss) && gx.equal(&frozen_gx), "{kind:?}");
        }
    }

    #[test]
    fn bf16_inputs_give_bf16_grad_x_and_fp32_grad_w_close_to_fp32() {
        tch::manual_seed(1);
        let x = Tensor::randn([9, 16], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([13, 16], (Kind::Float, Device::Cpu)) * 0.3;
        let t = Tensor::from_slice(&[0i64, 3, 12, 4, 4, 1, 9, 7, 2]);
        let (xb, wb) = (x.to_kind(Kind::BFloat16), w.to_kind(Kind::BFloat16));
        let (loss, gx, gw) = ChunkedHead::new(4 * 13).loss_and_grads(&xb, &wb, &t, 0.25, true);
        let (loss32, gx32, gw32) = ChunkedHead::new(4 * 13).loss_and_grads(
            &xb.to_kind(Kind::Float),
            &wb.to_kind(Kind::Float),
            &t,
            0.25,
            true,
        );
        let (gw, gw32) = (gw.expect("grad w"), gw32.expect("grad w"));
        assert_eq!((gx.kind(), gw.kind()), (Kind::BFloat16, Kind::Float));
        let rel = |a: &Tensor, b: &Tensor| {
            let a = a.to_kind(Kind::Float);
            ((&a - b).norm().double_value(&[]) / b.norm().double_value(&[])).abs()
        };
        assert!((loss.double_value(&[]) - loss32.double_value(&[])).abs() < 0.05);
        assert!(rel(&gx, &gx32) < 0.02, "grad x off by {}", rel(&gx, &gx32));
        assert!(rel(&gw, &gw32) < 0.02, "grad w off by {}", rel(&gw, &gw32));
    }
}
