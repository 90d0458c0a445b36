//! The head with its output matrix split by vocabulary rows over a group of ranks (Megatron-LM's vocab-parallel
//! cross-entropy), for a store that shards the matrix by whole rows ([`crate::params::ParamStore::gather_split_head`]:
//! FSDP's flat shards of a tied embedding), and the embedding lookup through such a split matrix ([`embed`],
//! [`embedding_grad`]). No rank holds the whole `[vocab, hidden]` matrix or a gradient of its size: each rank computes
//! the logits of the group's target rows against its own vocabulary rows, and the softmax's normaliser is assembled
//! from per-rank statistics.
//!
//! Per micro-batch, over a group of `K` ranks, rank `r` holding the matrix's rows `W_r`:
//! 1. An all-gather of every rank's normalised target rows and target ids: the group's `N` rows ([`RowExchange`]).
//! 2. Per chunk of rows, the logits `z = x · W_rᵀ` (divided by the temperature) and, per row, this rank's largest
//!    logit `m_r`, `s_r = Σ exp(z − m_r)`, `e_r = Σ exp(z − m_r)·(z − m_r)` (for entropies) and the target's shifted
//!    logit where the target is one of its rows. One all-gather of these gives every rank the same
//!    `lse = M + ln Σ_r s_r·exp(m_r − M)` (`M = max_r m_r`), `log p(target) = z_target − lse` and the entropy
//!    `H = −Σ_r exp(m_r − lse)·(e_r + (m_r − lse)·s_r)`.
//! 3. Given the loss's per-row gradients, the logits' gradient on this rank's columns,
//!    `g = dlp·(onehot − p) − dH·p·(log p + H)`, and from it `gᵀ·x`, this rank's rows' gradient, already summed over
//!    the group's rows (no reduction of the matrix's gradient), and `g·W_r`, a partial sum of the rows' gradient.
//! 4. A reduce-scatter of the rows' gradients hands each rank those of its own rows.
//!
//! A loss with the same uniform gradient on every rank (SFT's cross-entropy) takes one pass (steps 2 and 3 chunk by
//! chunk); any other takes two: the statistics, each rank's loss on its own rows, their per-row gradients gathered,
//! then steps 2–3 again. Each rank's value is its own rows' loss, as with the whole matrix. Every rank chunks the rows
//! alike, by as many rows as a head over the whole matrix takes, so the ranks' collectives match and the logits buffer
//! of a rank is `1/K` of the whole matrix's.

use crate::head::{entropy_grad_but_onehot, project_back, ChunkedHead, TokenGrad, TokenStats};
use crate::head_share::own_loss;
use crate::loss::TokenLoss;
use crate::row_exchange::RowExchange;
use anyhow::{Context, Result};
use ferl_collective::Communicator;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// The largest logit a rank without vocabulary rows reports: no exponential of it survives.
const NO_ROWS_MAX: f64 = -1e30;

/// This rank's rows of an output matrix split by vocabulary rows over a group of ranks.
pub struct VocabSlice {
    /// The first vocabulary row this rank holds.
    pub start: i64,
    /// This rank's rows `[rows, hidden]` in the compute dtype, without grad.
    pub weight: Tensor,
    /// Rows of the whole matrix.
    pub vocab: i64,
    /// Whether the matrix trains (false: a frozen base under LoRA; no gradient is computed).
    pub trains: bool,
    /// This rank's rows of the matrix's gradient (fp32 `[rows, hidden]`, on the compute device) when the store lets
    /// the head add into them directly; without it the head returns the rows' gradient.
    pub grad: Option<Tensor>,
    /// The ranks holding the other rows, ordered by the rows they hold; its collectives run in order with the
    /// store's own.
    pub group: Arc<dyn Communicator>,
}

impl VocabSlice {
    fn rows(&self) -> i64 {
        self.weight.size()[0]
    }

    /// Every rank's rows, all taken by this one.
    fn exchange(&self, local: i64, device: tch::Device) -> Result<RowExchange> {
        let counts = RowExchange::exchange_counts(self.group.as_ref(), local, device)?;
        RowExchange::new(self.group.clone(), &counts, all_positions, device)
    }
}

/// The padded positions of every rank's rows, in rank order.
fn all_positions(counts: &[i64], padded: i64) -> Vec<i64> {
    let per_rank = counts.iter().enumerate();
    per_rank
        .flat_map(|(r, &n)| (0..n).map(move |i| r as i64 * padded + i))
        .collect()
}

/// [`TokenLoss`] of this rank's normalised target rows `normed` (`[n, hidden]`) through the split matrix: the loss's
/// value on this rank's rows, the gradient of `normed`, and the gradient of this rank's rows of the matrix (fp32,
/// `[rows, hidden]`, the group's whole gradient of them; undefined when the matrix is frozen, or when it was added
/// into the slice's [`VocabSlice::grad`]). See the module docs.
pub fn head_loss(
    slice: &VocabSlice,
    head: &mut ChunkedHead,
    normed: &Tensor,
    targets: &Tensor,
    loss: &dyn TokenLoss,
) -> Result<(f64, Tensor, Tensor)> {
    let device = normed.device();
    let rows = slice.exchange(normed.size()[0], device)?;
    let (x, t) = (rows.gather(&normed.detach())?, rows.gather(targets)?);
    let entropy = loss.needs_entropy();
    let (value, done) = match rows.common_uniform_grad(loss, device)? {
        Some(c) => {
            let done = pass(slice, head, &x, &t, entropy, Some(&TokenGrad::Uniform(c)))?;
            (own_loss(rows.local(), loss, &done.own(&rows))?.0, done)
        }
        None => {
            let stats = pass(slice, head, &x, &t, entropy, None)?;
            let (value, grad) = own_loss(rows.local(), loss, &stats.own(&rows))?;
            let grad = rows.gather_grad(grad, device)?;
            (value, pass(slice, head, &x, &t, false, Some(&grad))?)
        }
    };
    let grad_w = done.grad_w.filter(|_| slice.grad.is_none());
    Ok((
        value,
        rows.scatter_sum(&done.grad_x)?,
        grad_w.unwrap_or_default(),
    ))
}

/// The log-probabilities of this rank's `targets` (`[n]`) under its normalised rows `normed` (`[n, hidden]`) and,
/// with `entropy`, their entropies, through the split matrix; no gradients.
pub fn token_stats(
    slice: &VocabSlice,
    head: &mut ChunkedHead,
    normed: &Tensor,
    targets: &Tensor,
    entropy: bool,
) -> Result<TokenStats> {
    let rows = slice.exchange(normed.size()[0], normed.device())?;
    let (x, t) = (rows.gather(&normed.detach())?, rows.gather(targets)?);
    Ok(pass(slice, head, &x, &t, entropy, None)?.own(&rows))
}

/// The embedding of this rank's token `ids` (any shape `[...]`) through the split matrix: `[..., hidden]` in the
/// matrix's dtype. Every rank looks up the group's ids that fall in its rows (zeros elsewhere) and a reduce-scatter
/// sums each rank's own back to it: `[N, hidden]` travels instead of the `[vocab, hidden]` matrix.
pub fn embed(slice: &VocabSlice, ids: &Tensor) -> Result<Tensor> {
    let flat = ids.reshape([-1]);
    let rows = slice.exchange(flat.size()[0], ids.device())?;
    let all_ids = rows.gather(&flat)?;
    let looked_up = match slice.rows() {
        0 => Tensor::zeros(
            [all_ids.size()[0], slice.weight.size()[1]],
            (slice.weight.kind(), ids.device()),
        ),
        _ => {
            let (index, inside) = local_targets(slice, &all_ids);
            let inside = inside.unsqueeze(1).to_kind(slice.weight.kind());
            slice.weight.index_select(0, &index.squeeze_dim(1)) * inside
        }
    };
    let mut shape = ids.size();
    shape.push(slice.weight.size()[1]);
    Ok(rows.scatter_sum(&looked_up)?.view(shape.as_slice()))
}

/// The gradient of this rank's rows of the split matrix from the gradient `grad` (`[..., hidden]`) of [`embed`]'s
/// output for `ids`, sparse: the group's ids and output gradients are gathered, and those whose ids fall in this
/// rank's rows are returned, `(rows [m], gradients [m, hidden] fp32)` with rows counted from the slice's first, to be
/// summed into the rows' gradient (`index_add`, repeated rows adding up). `None`, without exchanges, when the matrix
/// is frozen (on every rank alike).
pub fn embedding_grad(
    slice: &VocabSlice,
    ids: &Tensor,
    grad: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    if !slice.trains {
        return Ok(None);
    }
    let flat = ids.reshape([-1]);
    let hidden = slice.weight.size()[1];
    let rows = slice.exchange(flat.size()[0], ids.device())?;
    let all_ids = rows.gather(&flat)?;
    let all_grads = rows.gather(&grad.reshape([-1, hidden]).to_kind(Kind::Float))?;
    let (index, inside) = local_targets(slice, &all_ids);
    let kept = inside.nonzero().squeeze_dim(1);
    let index = index.squeeze_dim(1).index_select(0, &kept);
    Ok(Some((index, all_grads.index_select(0, &kept))))
}

/// What one pass over the group's rows gives.
struct Pass {
    log_prob: Tensor,
    entropy: Option<Tensor>,
    /// The group's rows' gradients from this rank's columns (zeros without a loss gradient).
    grad_x: Tensor,
    grad_w: Option<Tensor>,
}

impl Pass {
    /// This rank's own rows' statistics.
    fn own(&self, rows: &RowExchange) -> TokenStats {
        let own = |t: &Tensor| t.narrow(0, rows.own_offset(), rows.local());
        TokenStats {
            log_prob: own(&self.log_prob),
            entropy: self.entropy.as_ref().map(own),
        }
    }
}

/// This rank's targets among its vocabulary rows: `(index [N, 1], inside [N])`, the index clamped into the slice
/// (meaningful where `inside`).
fn local_targets(slice: &VocabSlice, t: &Tensor) -> (Tensor, Tensor) {
    let rel = t - slice.start;
    let inside = rel.ge(0).logical_and(&rel.lt(slice.rows()));
    (rel.clamp(0, (slice.rows() - 1).max(0)).unsqueeze(1), inside)
}

/// Steps 2 and (with `grad`, the loss's gradients of all the group's rows) 3 of the module docs, chunk by chunk,
/// over the group's rows `x` (`[N, hidden]`) and targets `t` (`[N]`).
fn pass(
    slice: &VocabSlice,
    head: &mut ChunkedHead,
    x: &Tensor,
    t: &Tensor,
    entropy: bool,
    grad: Option<&TokenGrad>,
) -> Result<Pass> {
    let _g = tch::no_grad_guard();
    let entropy = entropy || grad.is_some_and(TokenGrad::has_entropy);
    let (index, inside) = local_targets(slice, t);
    let want_w = grad.is_some() && slice.trains;
    let mut grad_w = want_w.then(|| match &slice.grad {
        Some(into) => into.shallow_clone(),
        None => Tensor::zeros(slice.weight.size(), (Kind::Float, x.device())),
    });
    let w_c = slice.weight.to_kind(x.kind());
    let (mut log_probs, mut entropies, mut grad_x) = (Vec::new(), Vec::new(), Vec::new());
    // Chunks of as many rows as the whole matrix's head takes, on every rank alike: the logits buffer is a slice's
    // width, 1/K of the whole matrix's.
    let chunk_rows = head.rows_per_chunk(slice.vocab);
    for (start, n) in head.chunks(x.size()[0], slice.vocab) {
        let xc = x.narrow(0, start, n);
        let (index, inside) = (index.narrow(0, start, n), inside.narrow(0, start, n));
        let mut z = match slice.rows() {
            0 => Tensor::zeros([n, 0], (Kind::Float, x.device())),
            _ => head.logits_into(&xc, &slice.weight, chunk_rows),
        };
        let (m, local) = local_stats(&mut z, &index, &inside, entropy);
        let all = slice
            .group
            .all_gather_flat(&local)
            .context("the split head's statistics")?;
        let rows = Combined::of(&all.view([-1, n, STATS]), entropy);
        if let Some(grad) = grad.filter(|_| slice.rows() > 0) {
            logits_grad(&mut z, &m, &rows, (&index, &inside), &grad.narrow(start, n));
            if head.temperature() != 1.0 {
                let _ = z.g_div_scalar_(head.temperature()); // through z = logits / T
            }
        }
        if grad.is_some() {
            grad_x.push(project_back(&z, &xc, &w_c, grad_w.as_mut()));
        }
        log_probs.push(rows.log_prob);
        entropies.extend(rows.entropy);
    }
    let cat = |v: Vec<Tensor>, empty: &dyn Fn() -> Tensor| match v.is_empty() {
        true => empty(),
        false => Tensor::cat(&v, 0),
    };
    let no_rows = || Tensor::zeros([0], (Kind::Float, x.device()));
    Ok(Pass {
        log_prob: cat(log_probs, &no_rows),
        entropy: entropy.then(|| cat(entropies, &no_rows)),
        grad_x: cat(grad_x, &|| x.zeros_like()),
        grad_w,
    })
}

/// Statistics per row a rank sends: `m`, `s`, `e`, the target's shifted logit (0 outside) and whether it is inside.
const STATS: i64 = 5;

/// This rank's statistics of the logits `z` (`[n, rows]`): `(m [n, 1], [n, STATS] f64)`. `z` is left shifted by each
/// row's largest logit, `z − m`, and, without `entropy`, exponentiated in place, `exp(z − m)`.
fn local_stats(z: &mut Tensor, index: &Tensor, inside: &Tensor, entropy: bool) -> (Tensor, Tensor) {
    let (n, device) = (z.size()[0], z.device());
    let inside = inside.unsqueeze(1).to_kind(Kind::Float);
    if z.size()[1] == 0 {
        let m = Tensor::full([n, 1], NO_ROWS_MAX, (Kind::Float, device));
        let zeros = Tensor::zeros([n, 1], (Kind::Float, device));
        let stats = Tensor::cat(&[&m, &zeros, &zeros, &zeros, &inside], 1);
        return (m, stats.to_kind(Kind::Double));
    }
    let m = z.amax([1], true);
    let _ = z.g_sub_(&m);
    let target = z.gather(1, index, false) * &inside;
    let (s, e) = if entropy {
        let exp = z.exp();
        let e = (&exp * &*z).sum_dim_intlist(1, true, Kind::Float);
        (exp.sum_dim_intlist(1, true, Kind::Float), e)
    } else {
        let _ = z.exp_();
        let s = z.sum_dim_intlist(1, true, Kind::Float);
        (s, Tensor::zeros([n, 1], (Kind::Float, device)))
    };
    let stats = Tensor::cat(&[&m, &s, &e, &target, &inside], 1);
    (m, stats.to_kind(Kind::Double))
}

/// The group's per-row results of one chunk, the same on every rank.
struct Combined {
    /// `ln Σ exp(z)` over the whole vocabulary, `[n]` f64.
    lse: Tensor,
    /// `[n]` fp32.
    log_prob: Tensor,
    /// `[n]` fp32, when asked for.
    entropy: Option<Tensor>,
}

impl Combined {
    /// Combines every rank's statistics `all` (`[K, n, STATS]`, see [`local_stats`]) as the module docs say.
    fn of(all: &Tensor, entropy: bool) -> Self {
        let col = |i: i64| all.select(2, i);
        let m = col(0);
        let top = m.amax([0], true);
        let scale = (&m - &top).exp();
        let sum = (col(1) * &scale).sum_dim_intlist(0, false, Kind::Double);
        let shifted_target =
            (col(4) * (col(3) + (&m - &top))).sum_dim_intlist(0, false, Kind::Double);
        let lse = top.squeeze_dim(0) + sum.log();
        let entropy = entropy.then(|| {
            let weight = (&m - lse.unsqueeze(0)).exp(); // exp(m_r − lse)
            let inner = col(2) + (&m - lse.unsqueeze(0)) * col(1);
            (-(weight * inner).sum_dim_intlist(0, false, Kind::Double)).to_kind(Kind::Float)
        });
        Self {
            log_prob: (shifted_target - sum.log()).to_kind(Kind::Float),
            lse,
            entropy,
        }
    }
}

/// Turns this rank's shifted logits `z` (see [`local_stats`]: `exp(z − m)` for a gradient without an entropy term
/// when no entropy was computed, else `z − m`) into the logits' gradient for `grad`, `dlp·(onehot − p) −
/// dH·p·(log p + H)`, the one-hot only where the target is inside the slice.
fn logits_grad(
    z: &mut Tensor,
    m: &Tensor,
    rows: &Combined,
    (index, inside): (&Tensor, &Tensor),
    grad: &TokenGrad,
) {
    let n = z.size()[0];
    let shift = (m.to_kind(Kind::Double) - rows.lse.unsqueeze(1)).to_kind(Kind::Float); // m − lse
    let (dlp, dh) = match grad {
        TokenGrad::Uniform(c) => (Tensor::full([n, 1], *c, (Kind::Float, z.device())), None),
        TokenGrad::PerRow { log_prob, entropy } => (
            log_prob.to_kind(Kind::Float).unsqueeze(1),
            entropy
                .as_ref()
                .map(|e| e.to_kind(Kind::Float).unsqueeze(1)),
        ),
    };
    match (&rows.entropy, dh) {
        (None, _) => {
            let _ = z.g_mul_(&shift.exp()).g_mul_(&-&dlp); // exp(z − m) → p → −dlp·p
        }
        (Some(h), dh) => {
            let _ = z.g_add_(&shift); // log p
            let p = z.exp();
            match dh {
                Some(dh) => entropy_grad_but_onehot(z, &p, &h.unsqueeze(1), &dlp, &dh),
                None => {
                    z.copy_(&(p * -&dlp));
                }
            }
        }
    }
    let onehot = dlp * inside.unsqueeze(1).to_kind(Kind::Float);
    let _ = z.scatter_add_(1, index, &onehot);
}

#[cfg(test)]
mod tests {
    use super::all_positions;

    #[test]
    fn every_rank_takes_every_row_in_rank_order() {
        assert_eq!(all_positions(&[2, 0, 3], 3), vec![0, 1, 6, 7, 8]);
        assert!(all_positions(&[0, 0], 1).is_empty());
    }
}
