//! Rows of a head moved between the ranks of a group: every rank holds its own target rows (a count per rank), and
//! a head computed elsewhere needs some of every rank's. A [`RowExchange`] says which: `positions` into the group's
//! rows laid out rank after rank, each rank's padded to the largest count. [`RowExchange::gather`] is one all-gather
//! (rows padded) and a selection; [`RowExchange::scatter_sum`], its adjoint, places results at their positions (zeros
//! elsewhere) and reduce-scatters the sum, so each rank gets back exactly the results of its own rows.
//!
//! Two heads use it: a sequence-parallel group's share of the rows ([`crate::head_share`]) and a head whose output
//! matrix is split by vocabulary rows ([`crate::vocab_parallel`], which takes every rank's rows).

use crate::head::TokenGrad;
use crate::loss::TokenLoss;
use anyhow::{bail, Context, Result};
use ferl_collective::{Communicator, ReduceOp};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// Which of a group's rows this rank takes (see the module docs).
pub(crate) struct RowExchange {
    group: Arc<dyn Communicator>,
    /// Every rank's row count, in rank order.
    counts: Vec<i64>,
    /// The largest count (at least 1): the exchanges' rows per rank.
    padded: i64,
    /// The padded positions (`rank · padded + i`) of the rows this rank takes.
    positions: Tensor,
}

impl RowExchange {
    /// This rank takes the rows of `positions(counts, padded)` of the group whose ranks hold `counts` rows.
    pub(crate) fn new(
        group: Arc<dyn Communicator>,
        counts: &[i64],
        positions: impl FnOnce(&[i64], i64) -> Vec<i64>,
        device: Device,
    ) -> Result<Self> {
        if counts.len() != group.world_size() {
            bail!(
                "{} row counts for a group of {}",
                counts.len(),
                group.world_size()
            );
        }
        let padded = counts.iter().copied().max().unwrap_or(0).max(1);
        let positions = Tensor::from_slice(&positions(counts, padded)).to_device(device);
        Ok(Self {
            group,
            counts: counts.to_vec(),
            padded,
            positions,
        })
    }

    /// Every rank's count of its `local` rows, exchanged over `group`.
    pub(crate) fn exchange_counts(
        group: &dyn Communicator,
        local: i64,
        device: Device,
    ) -> Result<Vec<i64>> {
        let all = group
            .all_gather_flat(&Tensor::from_slice(&[local]).to_device(device))
            .context("exchanging the head's row counts")?;
        Ok(Vec::<i64>::try_from(&all.to_device(Device::Cpu))?)
    }

    /// This rank's own row count.
    pub(crate) fn local(&self) -> i64 {
        self.counts[self.group.rank()]
    }

    /// The rows of every rank.
    pub(crate) fn total(&self) -> i64 {
        self.counts.iter().sum()
    }

    /// The rows this rank takes.
    pub(crate) fn taken(&self) -> i64 {
        self.positions.size()[0]
    }

    /// Where this rank's own rows start among the group's (rank order, unpadded).
    pub(crate) fn own_offset(&self) -> i64 {
        self.counts[..self.group.rank()].iter().sum()
    }

    /// The rows this rank takes of every rank's `local` (`[own count, ...]`): `[taken, ...]`.
    pub(crate) fn gather(&self, local: &Tensor) -> Result<Tensor> {
        let mut shape = local.size();
        shape[0] = self.padded;
        let padded = Tensor::zeros(shape.as_slice(), (local.kind(), local.device()));
        padded.narrow(0, 0, self.local()).copy_(local);
        let all = self
            .group
            .all_gather_flat(&padded)
            .context("gathering the head's rows")?;
        shape[0] = self.padded * self.counts.len() as i64;
        Ok(all.view(shape.as_slice()).index_select(0, &self.positions))
    }

    /// The adjoint of [`Self::gather`]: the sums over the group of results `taken` (`[taken, ...]`) for this rank's
    /// own rows, `[own count, ...]`.
    pub(crate) fn scatter_sum(&self, taken: &Tensor) -> Result<Tensor> {
        let mut shape = taken.size();
        shape[0] = self.padded * self.counts.len() as i64;
        let mut placed = Tensor::zeros(shape.as_slice(), (taken.kind(), taken.device()));
        let _ = placed.index_copy_(0, &self.positions, taken);
        let mine = self
            .group
            .reduce_scatter_flat(&placed.view([-1]), ReduceOp::Sum)
            .context("handing the head's results back")?;
        shape[0] = self.padded;
        Ok(mine.view(shape.as_slice()).narrow(0, 0, self.local()))
    }

    /// `r` of every rank, in rank order.
    pub(crate) fn gather_each(&self, r: f64, device: Device, what: &str) -> Result<Vec<f64>> {
        let all = self
            .group
            .all_gather_flat(&Tensor::from_slice(&[r]).to_device(device))
            .with_context(|| format!("the head's exchange: {what}"))?;
        Ok(Vec::<f64>::try_from(&all.to_device(Device::Cpu))?)
    }

    /// `Some(c)` when every rank's loss has the uniform gradient `c` ([`TokenLoss::uniform_grad`]): the head then
    /// takes one pass.
    pub(crate) fn common_uniform_grad(
        &self,
        loss: &dyn TokenLoss,
        device: Device,
    ) -> Result<Option<f64>> {
        // A rank without a uniform gradient still takes part in the exchange.
        let mine = loss.uniform_grad();
        let all = self.gather_each(mine.unwrap_or(f64::NAN), device, "comparing the losses")?;
        Ok(mine.filter(|&c| all.iter().all(|&o| o == c)))
    }

    /// Every rank's per-row loss gradients `g` (of its own rows) for the rows this rank takes. Every rank takes part
    /// in the same exchanges: a uniform gradient goes as per-row values, and when any rank's has an entropy term, a
    /// rank without one sends zeros for it.
    pub(crate) fn gather_grad(&self, g: TokenGrad, device: Device) -> Result<TokenGrad> {
        let local = self.local();
        let (log_prob, entropy) = match g {
            TokenGrad::Uniform(c) => (Tensor::full([local], c, (Kind::Float, device)), None),
            TokenGrad::PerRow { log_prob, entropy } => (log_prob, entropy),
        };
        let vote = match (local, &entropy) {
            (0, _) => -1.0,
            (_, Some(_)) => 1.0,
            (_, None) => 0.0,
        };
        let any_entropy = self
            .gather_each(vote, device, "comparing the loss gradients")?
            .contains(&1.0);
        let entropy = any_entropy
            .then(|| entropy.unwrap_or_else(|| Tensor::zeros([local], (Kind::Float, device))));
        Ok(TokenGrad::PerRow {
            log_prob: self.gather(&log_prob)?,
            entropy: entropy.map(|e| self.gather(&e)).transpose()?,
        })
    }
}
