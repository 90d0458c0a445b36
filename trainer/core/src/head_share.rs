//! Where the head's target rows are computed: on the rank that holds them, or dealt out evenly over a
//! sequence-parallel group. Every head of the engine (training's loss and gradients, [`head_loss`]; the statistics
//! of validation and scoring, [`HeadShare::token_stats`]) goes through a [`HeadShare`]; without a group
//! ([`HeadShare::own`]) each exchange is the identity.
//!
//! Under Ulysses sequence parallelism each rank of a group holds a contiguous slice of every sequence, and SFT's
//! targets (the response) come at the end of each sequence, so the last ranks of a group hold most of them: in
//! `ferl-bench train --sequence-parallel 2` (loss on each sequence's second half) one rank held every target and the
//! other waited for it through the head, the largest single cost of a step for a vocabulary of 151,936.
//! [`HeadShare`] deals the group's target rows out evenly before the head and hands the results back after it: of the
//! group's `N` rows, in rank order, rank `j` of `K` takes rows `⌊jN/K⌋ .. ⌊(j+1)N/K⌋`. Each rank's loss is still
//! evaluated on its own rows (per-row inputs of a loss, such as RL advantages, stay where they are); only the head's
//! projections and softmaxes move.
//!
//! Exchanges, on the group's communicator: an all-gather of every rank's rows (padded to the largest count) before,
//! and a reduce-scatter (sum) of the results placed at their owners' positions, every other entry zero, after — so
//! the sum is exact. Rows are `[n, hidden]`, small beside the head's `[vocab, hidden]`. The counts need no exchange:
//! every rank of the group holds the whole micro-batch before taking its slice.

use crate::head::{ChunkedHead, TokenGrad, TokenStats};
use crate::kernels::HeadLoss;
use crate::loss::TokenLoss;
use crate::model::ulysses::SpGroup;
use crate::row_exchange::RowExchange;
use anyhow::Result;
use tch::{Device, Kind, Tensor};

/// Where a rank's target rows go for the head: its own head, or (under sequence parallelism) its share of the
/// group's (see the module docs).
pub struct HeadShare {
    /// This rank's own rows.
    local: i64,
    /// The group's exchanges; none when the rows stay here.
    spread: Option<RowExchange>,
}

impl HeadShare {
    /// A rank's `rows` target rows through its own head (no sequence-parallel group): every exchange is the identity.
    pub fn own(rows: i64) -> Self {
        Self {
            local: rows,
            spread: None,
        }
    }

    /// The share of this rank of `group`, whose ranks hold `counts` rows each (in rank order; every rank of a
    /// sequence-parallel group knows them from the whole micro-batch, `SequenceParallel::targets_per_rank`).
    pub fn new(group: &SpGroup, counts: &[i64], device: Device) -> Result<Self> {
        let me = group.rank();
        let spread = RowExchange::new(
            group.shared_comm(),
            counts,
            |counts, padded| share_positions(counts, me, padded),
            device,
        )?;
        Ok(Self {
            local: spread.local(),
            spread: Some(spread),
        })
    }

    /// The rows of every rank that deals with this one (this rank's own without a group).
    pub fn total(&self) -> i64 {
        self.spread.as_ref().map_or(self.local, RowExchange::total)
    }

    /// The rows of this rank's share.
    pub fn share_rows(&self) -> i64 {
        self.spread.as_ref().map_or(self.local, RowExchange::taken)
    }

    /// This rank's share of the group's `local` rows (`[n, ...]`, `n` this rank's own count): `[share, ...]`.
    pub fn deal(&self, local: &Tensor) -> Result<Tensor> {
        match &self.spread {
            Some(s) => s.gather(local),
            None => Ok(local.shallow_clone()),
        }
    }

    /// The inverse of [`Self::deal`]: this rank's own rows of the results `share` (`[share, ...]`): `[n, ...]`.
    pub fn give_back(&self, share: &Tensor) -> Result<Tensor> {
        match &self.spread {
            Some(s) => s.scatter_sum(share),
            None => Ok(share.shallow_clone()),
        }
    }

    /// [`ChunkedHead::token_stats`] of this rank's rows `x` (`[n, hidden]`), computed on its share of the group's.
    pub fn token_stats(
        &self,
        head: &mut ChunkedHead,
        x: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        entropy: bool,
    ) -> Result<TokenStats> {
        let stats = head.token_stats(&self.deal(x)?, w, &self.deal(targets)?, entropy);
        self.give_back_stats(&stats)
    }

    /// `Some(c)` when every rank's loss has the uniform gradient `c` ([`TokenLoss::uniform_grad`]): the share then
    /// takes one pass.
    fn common_uniform_grad(&self, loss: &dyn TokenLoss, device: Device) -> Result<Option<f64>> {
        match &self.spread {
            Some(s) => s.common_uniform_grad(loss, device),
            None => Ok(loss.uniform_grad()),
        }
    }

    fn give_back_stats(&self, s: &TokenStats) -> Result<TokenStats> {
        Ok(TokenStats {
            log_prob: self.give_back(&s.log_prob)?,
            entropy: s.entropy.as_ref().map(|e| self.give_back(e)).transpose()?,
        })
    }

    /// Deals out this rank's per-row loss gradients for its share's backward ([`RowExchange::gather_grad`]).
    fn deal_grad(&self, g: TokenGrad, device: Device) -> Result<TokenGrad> {
        match &self.spread {
            Some(s) => s.gather_grad(g, device),
            None => Ok(g),
        }
    }
}

/// The padded positions of rank `me`'s share of the rows `counts` (see the module docs).
fn share_positions(counts: &[i64], me: i64, padded: i64) -> Vec<i64> {
    let (k, total): (i64, i64) = (counts.len() as i64, counts.iter().sum());
    let (lo, hi) = (total * me / k, total * (me + 1) / k);
    let mut positions = Vec::with_capacity((hi - lo) as usize);
    let mut first = 0;
    for (rank, &count) in counts.iter().enumerate() {
        let rows = (lo.max(first)..hi.min(first + count)).map(|g| rank as i64 * padded + g - first);
        positions.extend(rows);
        first += count;
    }
    positions
}

/// [`TokenLoss`] of this rank's normalised target rows `normed` (`[n, hidden]`) against the output matrix `w`, the
/// head's work done on this rank's share of the rows: returns the loss's value on this rank's rows, the
/// gradient of `normed`, and the gradient of `w` from the share (undefined when `w` is frozen; summed over the group,
/// as the parameter store's reduction sums it, it is the group's). A loss with a uniform gradient on every rank takes
/// one pass over the share, through the head `kernel` when there is one ([`HeadLoss`]: then the value is the
/// share's); any other two: the statistics, handed back for each rank's loss, then its per-row gradients dealt out
/// for the backward. A rank with no rows of its own evaluates no loss (value 0).
pub fn head_loss(
    share: &HeadShare,
    head: &mut ChunkedHead,
    kernel: Option<&dyn HeadLoss>,
    normed: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    loss: &dyn TokenLoss,
) -> Result<(f64, Tensor, Tensor)> {
    let x = share.deal(&normed.detach())?;
    let t = share.deal(targets)?;
    let uniform = share.common_uniform_grad(loss, normed.device())?;
    if let (Some(c), Some(kernel)) = (uniform, kernel) {
        let (value, gx, gw) = kernel_loss(kernel, &x, w, &t, c)?;
        return Ok((value, share.give_back(&gx)?, gw));
    }
    let (value, grad) = match uniform {
        Some(c) => (None, TokenGrad::Uniform(c)),
        None => {
            let stats = head.token_stats(&x, w, &t, loss.needs_entropy());
            let (value, grad) = own_loss(share.local, loss, &share.give_back_stats(&stats)?)?;
            (Some(value), share.deal_grad(grad, normed.device())?)
        }
    };
    let (stats, gx, gw) = head.backward(&x, w, &t, &grad, w.requires_grad());
    let value = match value {
        Some(v) => v,
        None => own_loss(share.local, loss, &share.give_back_stats(&stats)?)?.0,
    };
    Ok((value, share.give_back(&gx)?, gw.unwrap_or_default()))
}

/// A head kernel's loss of the share `x` with the uniform gradient `c`: `(value, d/dx, d/dw)`, `d/dw` undefined when
/// `w` is frozen. A kernel gives no per-row statistics, so the value is the share's summed cross-entropy, not this
/// rank's own rows' (summed over the group, as every launch path sums the ranks' values, it is the group's). An empty
/// share skips the kernel.
fn kernel_loss(
    kernel: &dyn HeadLoss,
    x: &Tensor,
    w: &Tensor,
    t: &Tensor,
    c: f64,
) -> Result<(f64, Tensor, Tensor)> {
    let want_grad_w = w.requires_grad();
    if x.size()[0] == 0 {
        let gw = match want_grad_w {
            true => Tensor::zeros(w.size(), (Kind::Float, w.device())),
            false => Tensor::new(),
        };
        return Ok((0.0, x.zeros_like(), gw));
    }
    let (ce, gx, gw) = kernel.sum_loss_and_grads(x, w, t)?;
    let gw = if want_grad_w { gw * -c } else { Tensor::new() };
    Ok((ce.double_value(&[]), gx * -c, gw))
}

/// The loss of this rank's `local` own rows' statistics, or (no rows) 0 and an empty gradient.
pub(crate) fn own_loss(
    local: i64,
    loss: &dyn TokenLoss,
    stats: &TokenStats,
) -> Result<(f64, TokenGrad)> {
    if local > 0 {
        let evaluated = loss.evaluate(stats)?;
        return Ok((evaluated.value, evaluated.grad));
    }
    let grad = TokenGrad::PerRow {
        log_prob: stats.log_prob.zeros_like(),
        entropy: None,
    };
    Ok((0.0, grad))
}

#[cfg(test)]
mod tests {
    use super::share_positions;

    #[test]
    fn shares_split_the_group_rows_evenly_in_rank_order() {
        // Counts 0, 5, 2 (7 rows, padded 5): shares of 2, 2, 3 rows.
        let counts = [0, 5, 2];
        assert_eq!(share_positions(&counts, 0, 5), vec![5, 6]);
        assert_eq!(share_positions(&counts, 1, 5), vec![7, 8]);
        assert_eq!(share_positions(&counts, 2, 5), vec![9, 10, 11]);
        assert!(share_positions(&[0, 0], 1, 1).is_empty());
    }
}
