//! The output projection of the target rows and a loss over their log-probabilities, chunk by chunk, with the
//! backward written out by hand into one reusable fp32 buffer (`[rows, vocab]`, allocated once per engine): per chunk
//! the logits are computed into the buffer, turned in place into the log-softmax, then into the logits' gradient for
//! the loss's per-token gradients (cross-entropy: `softmax - onehot`, scaled; see [`ChunkedHead::backward`]) and used
//! for both gradient matmuls. Nothing of size `[tokens, vocab]` is ever allocated, and no autograd graph holds
//! vocabulary-sized tensors.
//!
//! A sampling temperature `T` ([`ChunkedHead::set_temperature`], verl's `logits.div_(temperature)` when it recomputes
//! log-probabilities) divides the logits before the log-softmax, and the logits' gradient by `T` on the way back
//! (`d z / d logits = 1 / T` for `z = logits / T`). At `T = 1` neither division runs: results are bit-identical to a
//! head without a temperature.

use tch::{Device, Kind, Tensor};

/// Chunked projection + cross-entropy with its reusable buffer.
pub struct ChunkedHead {
    buf: Option<Tensor>,
    max_elements: i64,
    temperature: f64,
}

impl ChunkedHead {
    /// A head whose chunks hold at most `max_elements` logits.
    pub fn new(max_elements: i64) -> Self {
        Self {
            buf: None,
            max_elements,
            temperature: 1.0,
        }
    }

    /// The temperature `T` of `log_softmax(logits / T)` (1 by default); positive and finite.
    pub fn set_temperature(&mut self, temperature: f64) -> anyhow::Result<()> {
        anyhow::ensure!(
            temperature > 0.0 && temperature.is_finite(),
            "the head's temperature {temperature} must be positive and finite"
        );
        self.temperature = temperature;
        Ok(())
    }

    /// The temperature the logits are divided by.
    pub fn temperature(&self) -> f64 {
        self.temperature
    }

    /// Rows of a chunk of logits over `vocab` columns.
    pub(crate) fn rows_per_chunk(&self, vocab: i64) -> i64 {
        (self.max_elements / vocab).max(1)
    }

    /// The first `rows` rows of the buffer, `[rows, vocab]` (made for chunks of `chunk_rows` rows when too small, of
    /// another width or on another device).
    fn buffer(&mut self, rows: i64, vocab: i64, chunk_rows: i64, device: Device) -> Tensor {
        let fits = self
            .buf
            .as_ref()
            .is_some_and(|b| b.size()[0] >= rows && b.size()[1] == vocab && b.device() == device);
        if !fits {
            let cap = rows.max(chunk_rows);
            self.buf = Some(Tensor::empty([cap, vocab], (Kind::Float, device)));
        }
        self.buf
            .as_ref()
            .expect("buffer just made")
            .narrow(0, 0, rows)
    }

    /// The logits `x · wᵀ` (divided by the temperature) in the reused fp32 buffer, made for chunks of `chunk_rows`
    /// rows.
    pub(crate) fn logits_into(&mut self, x: &Tensor, w: &Tensor, chunk_rows: i64) -> Tensor {
        let (n, vocab) = (x.size()[0], w.size()[0]);
        let mut logits = self.buffer(n, vocab, chunk_rows, x.device());
        if x.kind() == Kind::Float && w.kind() == Kind::Float {
            let _ = x.mm_out(&logits, &w.tr());
        } else {
            logits.copy_(&x.mm(&w.tr()));
        }
        if self.temperature != 1.0 {
            let _ = logits.g_div_scalar_(self.temperature);
        }
        logits
    }

    /// Log-probabilities of `targets` (`[n]`) under the logits of `x` (`[n, H]`, normalised rows) against `w`
    /// (`[V, H]`), and with `entropy` each row's entropy; fp32, without gradients.
    pub fn token_stats(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        entropy: bool,
    ) -> TokenStats {
        let _g = tch::no_grad_guard();
        let (mut log_probs, mut entropies) = (Vec::new(), Vec::new());
        for (start, n) in self.chunks(x.size()[0], w.size()[0]) {
            let mut g =
                self.logits_into(&x.narrow(0, start, n), w, self.rows_per_chunk(w.size()[0]));
            let t = targets.narrow(0, start, n).unsqueeze(1);
            if !entropy {
                log_probs.push(softmax_in_place(&mut g, &t));
                continue;
            }
            log_probs.push(log_softmax_in_place(&mut g, &t));
            entropies.push(-(g.exp() * &g).sum_dim_intlist(1, false, Kind::Float));
        }
        TokenStats::from_chunks(log_probs, entropy.then_some(entropies), x.device())
    }

    /// Back-propagates `grad` (a loss's gradient with respect to each target row's log-probability and entropy)
    /// through the log-softmax and the projection: returns the rows' [`TokenStats`] (computed on the way; entropy
    /// only when `grad` has an entropy term) and the gradients with respect to `x` (in `x`'s dtype) and, when
    /// `want_grad_w`, `w` (fp32; `None` otherwise: a frozen output matrix, as under LoRA, skips its `[V, H]` buffer
    /// and one of the three matmuls over the vocabulary). Runs without autograd.
    /// The logits and their softmax are fp32 whatever the inputs; when `x` is in a low-precision dtype (bf16
    /// compute) the two gradient matmuls run in that dtype too (the logits' gradient is cast per chunk), as autocast
    /// would run them — an fp32 matmul over the vocabulary would dominate a GPU step.
    pub fn backward(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        grad: &TokenGrad,
        want_grad_w: bool,
    ) -> (TokenStats, Tensor, Option<Tensor>) {
        let _g = tch::no_grad_guard();
        let mut grad_w = want_grad_w.then(|| Tensor::zeros(w.size(), (Kind::Float, x.device())));
        let w_c = match x.kind() {
            Kind::Float => w.to_kind(Kind::Float),
            kind => w.to_kind(kind),
        };
        let (mut grad_x, mut log_probs, mut entropies) = (Vec::new(), Vec::new(), Vec::new());
        for (start, n) in self.chunks(x.size()[0], w.size()[0]) {
            let xc = x.narrow(0, start, n);
            let t = targets.narrow(0, start, n).unsqueeze(1);
            let mut g = self.logits_into(&xc, w, self.rows_per_chunk(w.size()[0]));
            let grad = grad.narrow(start, n);
            if grad.has_entropy() {
                log_probs.push(log_softmax_in_place(&mut g, &t));
                entropies.push(entropy_logits_grad_in_place(&mut g, &t, &grad));
            } else {
                log_probs.push(softmax_in_place(&mut g, &t));
                logits_grad_from_softmax(&mut g, &t, &grad);
            }
            if self.temperature != 1.0 {
                let _ = g.g_div_scalar_(self.temperature); // through z = logits / T
            }
            grad_x.push(project_back(&g, &xc, &w_c, grad_w.as_mut()));
        }
        let entropy = grad.has_entropy().then_some(entropies);
        let stats = TokenStats::from_chunks(log_probs, entropy, x.device());
        let grad_x = match grad_x.is_empty() {
            true => x.zeros_like(), // no rows
            false => Tensor::cat(&grad_x, 0),
        };
        (stats, grad_x, grad_w)
    }

    /// Summed cross-entropy of `x` against `w` for `targets`, and the gradients of `scale * loss` (see
    /// [`ChunkedHead::backward`]; cross-entropy is the uniform gradient `-scale` on every log-probability).
    pub fn loss_and_grads(
        &mut self,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        scale: f64,
        want_grad_w: bool,
    ) -> (Tensor, Tensor, Option<Tensor>) {
        let (stats, gx, gw) =
            self.backward(x, w, targets, &TokenGrad::Uniform(-scale), want_grad_w);
        (stats.cross_entropy_sum(), gx, gw)
    }

    /// Summed cross-entropy only (validation).
    pub fn loss(&mut self, x: &Tensor, w: &Tensor, targets: &Tensor) -> Tensor {
        self.token_stats(x, w, targets, false).cross_entropy_sum()
    }

    /// `(start, rows)` of each chunk of `n_all` rows.
    pub(crate) fn chunks(&self, n_all: i64, vocab: i64) -> impl Iterator<Item = (i64, i64)> {
        let chunk = self.rows_per_chunk(vocab);
        (0..n_all)
            .step_by(chunk as usize)
            .map(move |s| (s, chunk.min(n_all - s)))
    }
}

/// Per-token quantities of the target rows: what a loss is a function of ([`crate::loss::TokenLoss`]).
#[derive(Debug)]
pub struct TokenStats {
    /// `log p(target)` of each row, `[n]` fp32.
    pub log_prob: Tensor,
    /// The entropy of each row's distribution, `[n]` fp32, when asked for.
    pub entropy: Option<Tensor>,
}

impl TokenStats {
    fn from_chunks(log_probs: Vec<Tensor>, entropies: Option<Vec<Tensor>>, device: Device) -> Self {
        let cat = |v: Vec<Tensor>| match v.is_empty() {
            true => Tensor::zeros([0], (Kind::Float, device)),
            false => Tensor::cat(&v, 0),
        };
        Self {
            log_prob: cat(log_probs),
            entropy: entropies.map(cat),
        }
    }

    /// `-Σ log p(target)` in fp64 (0-d).
    pub fn cross_entropy_sum(&self) -> Tensor {
        -self.log_prob.sum(Kind::Double)
    }
}

/// A loss's gradient with respect to each target row's log-probability and entropy.
pub enum TokenGrad {
    /// The same gradient on every row's log-probability and none on the entropy (cross-entropy: `-scale`).
    Uniform(f64),
    /// Per-row gradients, `[n]` fp32, of the log-probabilities and optionally of the entropies.
    PerRow {
        /// `d loss / d log p(target)`.
        log_prob: Tensor,
        /// `d loss / d entropy`.
        entropy: Option<Tensor>,
    },
}

impl TokenGrad {
    /// Whether the gradient has an entropy term.
    pub(crate) fn has_entropy(&self) -> bool {
        matches!(
            self,
            Self::PerRow {
                entropy: Some(_),
                ..
            }
        )
    }

    /// The rows `start..start + n`.
    pub(crate) fn narrow(&self, start: i64, n: i64) -> TokenGrad {
        match self {
            Self::Uniform(c) => TokenGrad::Uniform(*c),
            Self::PerRow { log_prob, entropy } => TokenGrad::PerRow {
                log_prob: log_prob.narrow(0, start, n),
                entropy: entropy.as_ref().map(|e| e.narrow(0, start, n)),
            },
        }
    }
}

/// Turns the logits `z` (`[n, V]`) into their softmax in place and returns each row's log-probability of its
/// target `t` (`[n, 1]`): `z[t] - max - ln Σ exp(z - max)`. Unlike `logsumexp`, which builds an `[n, V]` temporary
/// (67 MB for a chunk of 110 rows of Qwen2's vocabulary, mapped afresh and zeroed by the kernel on every call), it
/// allocates only per-row values.
fn softmax_in_place(z: &mut Tensor, t: &Tensor) -> Tensor {
    let target = shift_by_max(z, t);
    let _ = z.exp_();
    let sum = z.sum_dim_intlist(1, true, Kind::Float);
    let _ = z.g_div_(&sum);
    (target - sum.log()).squeeze_dim(1)
}

/// Turns the logits `z` (`[n, V]`) into their log-softmax in place and returns each row's log-probability of its
/// target `t`, the same values as [`softmax_in_place`] returns (one `[n, V]` temporary: the exponentials).
fn log_softmax_in_place(z: &mut Tensor, t: &Tensor) -> Tensor {
    let target = shift_by_max(z, t);
    let log_sum = z.exp().sum_dim_intlist(1, true, Kind::Float).log();
    let _ = z.g_sub_(&log_sum);
    (target - log_sum).squeeze_dim(1)
}

/// Subtracts each row's largest logit from `z` (`[n, V]`) in place, so that no exponential overflows, and returns
/// the shifted logits of the targets `t` (`[n, 1]`).
fn shift_by_max(z: &mut Tensor, t: &Tensor) -> Tensor {
    let max = z.amax([1], true);
    let _ = z.g_sub_(&max);
    z.gather(1, t, false)
}

/// Turns the softmax `p` (`[n, V]`, in place) into the logits' gradient for `grad`, which has no entropy term:
/// `dlp · (onehot - p)`.
fn logits_grad_from_softmax(p: &mut Tensor, t: &Tensor, grad: &TokenGrad) {
    let n = p.size()[0];
    let dlp = match grad {
        TokenGrad::Uniform(c) => {
            let _ = p.g_mul_scalar_(-c);
            Tensor::full([n, 1], *c, (Kind::Float, p.device()))
        }
        TokenGrad::PerRow { log_prob, .. } => {
            let dlp = log_prob.to_kind(Kind::Float).unsqueeze(1);
            let _ = p.g_mul_(&-&dlp);
            dlp
        }
    };
    let _ = p.scatter_add_(1, t, &dlp);
}

/// Turns the log-softmax `ls` (`[n, V]`, in place) into the logits' gradient for `grad`, which has an entropy term
/// `dH`: `dlp · (onehot - p) - dH · p · (log p + H)`, with `p = exp(ls)` and `H = -Σ p log p`, and returns `H`
/// (`[n]`).
fn entropy_logits_grad_in_place(ls: &mut Tensor, t: &Tensor, grad: &TokenGrad) -> Tensor {
    let TokenGrad::PerRow {
        log_prob,
        entropy: Some(dh),
    } = grad
    else {
        unreachable!("called only for a gradient with an entropy term");
    };
    let dlp = log_prob.to_kind(Kind::Float).unsqueeze(1);
    let p = ls.exp();
    let h = -(&p * &*ls).sum_dim_intlist(1, true, Kind::Float);
    let dh = dh.to_kind(Kind::Float).unsqueeze(1);
    entropy_grad_but_onehot(ls, &p, &h, &dlp, &dh);
    let _ = ls.scatter_add_(1, t, &dlp);
    h.squeeze_dim(1)
}

/// Turns the log-probabilities `ls` (`[n, V]`, in place; `p = exp(ls)`) into `−dH·p·(log p + H) − dlp·p`, the logits'
/// gradient for per-row gradients `dlp`, `dH` (`[n, 1]`) and entropies `h` (`[n, 1]`) but the target's one-hot term
/// `dlp` (which the caller adds at the target's column).
pub(crate) fn entropy_grad_but_onehot(
    ls: &mut Tensor,
    p: &Tensor,
    h: &Tensor,
    dlp: &Tensor,
    dh: &Tensor,
) {
    let _ = ls.g_add_(h).g_mul_(p).g_mul_(&-dh);
    let _ = ls.g_sub_(&(p * dlp));
}

/// The gradient of a chunk's rows `xc` from the logits' gradient `g` (fp32), adding `gᵀ·xc` into `grad_w` when
/// given. `w_c` is the output matrix in the compute dtype (fp32, or `xc`'s low-precision dtype).
pub(crate) fn project_back(
    g: &Tensor,
    xc: &Tensor,
    w_c: &Tensor,
    grad_w: Option<&mut Tensor>,
) -> Tensor {
    if xc.kind() == Kind::Float {
        if let Some(gw) = grad_w {
            let _ = gw.addmm_(&g.tr(), xc);
        }
        g.mm(w_c)
    } else {
        let gl = g.to_kind(xc.kind());
        if let Some(gw) = grad_w {
            let _ = gw.g_add_(&gl.tr().mm(xc));
        }
        gl.mm(w_c)
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
    fn per_row_gradients_with_entropy_match_autograd_across_chunks() {
        tch::manual_seed(3);
        let x = Tensor::randn([7, 5], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([11, 5], (Kind::Float, Device::Cpu));
        let t = Tensor::from_slice(&[0i64, 3, 10, 4, 4, 1, 9]);
        let dlp = Tensor::randn([7], (Kind::Float, Device::Cpu));
        let dh = Tensor::randn([7], (Kind::Float, Device::Cpu));
        let mut head = ChunkedHead::new(3 * 11);
        let grad = TokenGrad::PerRow {
            log_prob: dlp.copy(),
            entropy: Some(dh.copy()),
        };
        let (stats, gx, gw) = head.backward(&x, &w, &t, &grad, true);
        let xa = x.detach().set_requires_grad(true);
        let wa = w.detach().set_requires_grad(true);
        let ls = xa.mm(&wa.tr()).log_softmax(1, Kind::Float);
        let lp = ls.gather(1, &t.unsqueeze(1), false).squeeze_dim(1);
        let h = -(ls.exp() * &ls).sum_dim_intlist(1, false, Kind::Float);
        let objective = (&lp * &dlp).sum(Kind::Float) + (&h * &dh).sum(Kind::Float);
        let g = Tensor::run_backward(&[objective], &[&xa, &wa], true, false);
        let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
        let entropy = stats.entropy.as_ref().expect("entropy asked for");
        assert!(close(&stats.log_prob, &lp) < 1e-5);
        assert!(close(entropy, &h) < 1e-5);
        assert!(
            close(&gx, &g[0]) < 1e-5,
            "grad x differs by {}",
            close(&gx, &g[0])
        );
        let gw = gw.expect("grad w asked for");
        assert!(
            close(&gw, &g[1]) < 1e-5,
            "grad w differs by {}",
            close(&gw, &g[1])
        );
        let again = head.token_stats(&x, &w, &t, true);
        assert!(again.log_prob.equal(&stats.log_prob));
        assert!(again.entropy.expect("entropy").equal(entropy));
        // Without an entropy term: the log-prob part alone.
        let lp_only = TokenGrad::PerRow {
            log_prob: dlp.copy(),
            entropy: None,
        };
        let (stats, gx, _) = head.backward(&x, &w, &t, &lp_only, false);
        let g = Tensor::run_backward(&[(&lp * &dlp).sum(Kind::Float)], &[&xa], false, false);
        assert!(stats.entropy.is_none());
        assert!(
            close(&gx, &g[0]) < 1e-5,
            "grad x differs by {}",
            close(&gx, &g[0])
        );
    }

    #[test]
    fn temperature_divides_the_logits_and_their_gradient_as_autograd_does() {
        tch::manual_seed(4);
        let x = Tensor::randn([7, 5], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([11, 5], (Kind::Float, Device::Cpu));
        let t = Tensor::from_slice(&[0i64, 3, 10, 4, 4, 1, 9]);
        let dlp = Tensor::randn([7], (Kind::Float, Device::Cpu));
        let dh = Tensor::randn([7], (Kind::Float, Device::Cpu));
        let grad = || TokenGrad::PerRow {
            log_prob: dlp.copy(),
            entropy: Some(dh.copy()),
        };
        let temperature = 0.7;
        let mut head = ChunkedHead::new(3 * 11);
        assert!(head.set_temperature(0.0).is_err() && head.set_temperature(f64::NAN).is_err());
        head.set_temperature(temperature).unwrap();
        let (stats, gx, gw) = head.backward(&x, &w, &t, &grad(), true);
        let xa = x.detach().set_requires_grad(true);
        let wa = w.detach().set_requires_grad(true);
        let ls = (xa.mm(&wa.tr()) / temperature).log_softmax(1, Kind::Float);
        let lp = ls.gather(1, &t.unsqueeze(1), false).squeeze_dim(1);
        let h = -(ls.exp() * &ls).sum_dim_intlist(1, false, Kind::Float);
        let objective = (&lp * &dlp).sum(Kind::Float) + (&h * &dh).sum(Kind::Float);
        let g = Tensor::run_backward(&[objective], &[&xa, &wa], false, false);
        let rel = |a: &Tensor, b: &Tensor| {
            (a - b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-12)
        };
        assert!(rel(&stats.log_prob, &lp) < 1e-6);
        assert!(rel(stats.entropy.as_ref().expect("entropy"), &h) < 1e-6);
        assert!(rel(&gx, &g[0]) < 1e-5, "grad x off by {}", rel(&gx, &g[0]));
        let gw = gw.expect("grad w asked for");
        assert!(rel(&gw, &g[1]) < 1e-5, "grad w off by {}", rel(&gw, &g[1]));
        let again = head.token_stats(&x, &w, &t, true);
        assert!(again.log_prob.equal(&stats.log_prob));
        // Back at T = 1: exactly the results of a head that never had a temperature.
        head.set_temperature(1.0).unwrap();
        let (one, gx1, _) = head.backward(&x, &w, &t, &grad(), false);
        let (plain, gx_plain, _) = ChunkedHead::new(3 * 11).backward(&x, &w, &t, &grad(), false);
        assert!(one.log_prob.equal(&plain.log_prob) && gx1.equal(&gx_plain));
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
