//! How a rank cuts the rows of a forward into micro-batches: a number of rows (verl's `*_micro_batch_size_per_gpu`)
//! or, with verl's `use_dynamic_bsz`, a token budget (`*_max_token_len_per_gpu`). Forwards over a sharded store
//! meet in collectives (each stage is gathered), so under a token budget every rank cuts its share into as many
//! micro-batches: each rank holds the whole batch and computes every rank's cut (the same on all of them).

use anyhow::{Context as _, Result};
use ferl_trainer::batch::Layout;

use crate::batch::RlBatch;
use crate::policy_worker::DataShare;

/// How the rows of one forward are cut into micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MicroBatching {
    /// At most this many rows each.
    Rows(usize),
    /// At most this many tokens each (prompt and response; padded micro-batches count their padding).
    Tokens(usize),
}

impl MicroBatching {
    /// Rows per micro-batch, or (with `budget`, verl's `use_dynamic_bsz`) the token budget.
    pub fn new(rows: usize, budget: Option<usize>) -> Self {
        match budget {
            Some(tokens) => Self::Tokens(tokens),
            None => Self::Rows(rows),
        }
    }

    /// Whether it can cut anything (a positive size).
    pub fn is_positive(&self) -> bool {
        match *self {
            Self::Rows(n) | Self::Tokens(n) => n > 0,
        }
    }

    /// `share`'s micro-batches of the rows `rows` of `batch` (indices into it), in `layout`: its contiguous share
    /// cut in order into chunks of rows, or under the token budget into as many micro-batches as every other rank.
    pub fn cut(
        &self,
        batch: &RlBatch,
        rows: &[usize],
        share: DataShare,
        layout: Layout,
    ) -> Result<Vec<Vec<usize>>> {
        match *self {
            Self::Rows(n) => Ok(share
                .of(rows)
                .chunks(n.max(1))
                .map(<[usize]>::to_vec)
                .collect()),
            Self::Tokens(max_tokens) => {
                let lengths: Vec<usize> = rows.iter().map(|&i| batch.row_tokens(i)).collect();
                let positions: Vec<usize> = (0..rows.len()).collect();
                let shares: Vec<Vec<usize>> = (0..share.world)
                    .map(|rank| {
                        DataShare {
                            rank,
                            world: share.world,
                        }
                        .of(&positions)
                        .to_vec()
                    })
                    .collect();
                let padded = layout == Layout::Padded;
                let cut = ferl_data::budget_micro_batches(&shares, &lengths, max_tokens, padded)
                    .context("cutting rows under the token budget (use_dynamic_bsz)")?;
                let mine = cut.into_iter().nth(share.rank).unwrap_or_default();
                Ok(mine
                    .into_iter()
                    .map(|micro| micro.into_iter().map(|p| rows[p]).collect())
                    .collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::RlRow;

    fn batch(lengths: &[(usize, usize)]) -> RlBatch {
        let rows = lengths
            .iter()
            .map(|&(p, r)| RlRow {
                prompt: vec![1; p],
                response: vec![2; r],
                ..RlRow::default()
            })
            .collect();
        RlBatch::new(rows)
    }

    #[test]
    fn a_token_budget_cuts_every_ranks_share_into_as_many_micro_batches_within_it() {
        // Rank 0 holds short rows, rank 1 long ones: rank 1 needs more micro-batches, and rank 0 cuts as many.
        let b = batch(&[
            (2, 1),
            (2, 1),
            (2, 1),
            (2, 1),
            (6, 3),
            (6, 3),
            (6, 3),
            (6, 3),
        ]);
        let all: Vec<usize> = (0..b.len()).collect();
        let how = MicroBatching::Tokens(18);
        let cuts: Vec<Vec<Vec<usize>>> = (0..2)
            .map(|rank| {
                how.cut(&b, &all, DataShare { rank, world: 2 }, Layout::Packed)
                    .unwrap()
            })
            .collect();
        assert_eq!(cuts[0].len(), cuts[1].len(), "{cuts:?}");
        assert_eq!(cuts[1].len(), 2, "{cuts:?}");
        for (rank, cut) in cuts.iter().enumerate() {
            let mut rows: Vec<usize> = cut.iter().flatten().copied().collect();
            rows.sort_unstable();
            assert_eq!(rows, (4 * rank..4 * rank + 4).collect::<Vec<_>>());
            for micro in cut {
                let tokens: usize = micro.iter().map(|&i| b.row_tokens(i)).sum();
                assert!(tokens <= 18, "{micro:?}: {tokens} tokens");
            }
        }
        // Padded, a micro-batch costs its rows × its longest row: 2 rows of 9 fit 18, 3 do not.
        let padded = how
            .cut(&b, &all, DataShare { rank: 1, world: 2 }, Layout::Padded)
            .unwrap();
        assert!(padded.iter().all(|m| m.len() <= 2), "{padded:?}");
        let rows = MicroBatching::Rows(3)
            .cut(&b, &all, DataShare { rank: 1, world: 2 }, Layout::Padded)
            .unwrap();
        assert_eq!(rows, vec![vec![4, 5, 6], vec![7]]);
    }

    #[test]
    fn a_row_over_the_budget_is_refused() {
        let b = batch(&[(6, 3), (2, 1)]);
        let err = MicroBatching::Tokens(8)
            .cut(&b, &[0, 1], DataShare::WHOLE, Layout::Packed)
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("9 tokens, more than a micro-batch's budget of 8"),
            "{err:#}"
        );
    }
}
