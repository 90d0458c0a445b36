//! Where a rank's rows of the vocabulary matrices lie in its shard, for the head and the embedding split by
//! vocabulary rows ([`ferl_trainer::vocab_parallel`], design note 14: no rank holds a whole `[vocab, hidden]`
//! matrix or its gradient).
//!
//! The units cut the vocabulary matrices on whole rows (`crate::units` invariant 5: each alone in its unit, padded to
//! whole rows per rank), so a rank's shard of one is rows `[a_r, b_r)` of it at any world size, the last ranks'
//! possibly fewer or none. The store splits them unless it runs NO_SHARD, on one rank, or with
//! [`FsdpOptions::vocab_parallel`] off; otherwise (and for the head kernel, which needs the whole matrix) the stage
//! gathers the matrix whole, as any stage.

use crate::units::UnitPlan;
use crate::{FsdpOptions, ShardingStrategy};
use ferl_trainer::model::layout::Stage;

/// This rank's rows of a split matrix inside its local shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SplitLayout {
    /// The unit holding the matrix.
    pub unit: usize,
    /// The matrix's rows (the vocabulary) and columns.
    pub vocab: i64,
    pub hidden: i64,
    /// The first row this rank holds, and how many.
    pub first_row: i64,
    pub rows: i64,
    /// Where they start inside this rank's local master of `unit`.
    pub local_offset: i64,
}

/// The split of the head's output matrix (the head stage's second tensor) for `rank` of `world`, or `None` when the
/// head gathers it (see the module docs).
pub(crate) fn head_split(
    plan: &UnitPlan,
    opts: &FsdpOptions,
    rank: usize,
    world: usize,
) -> Option<SplitLayout> {
    let refs = plan.stage_refs.get(&Stage::Head)?;
    let (&(norm_unit, _), &matrix) = (refs.first()?, refs.get(1)?);
    (matrix.0 != norm_unit)
        .then(|| row_split(plan, matrix, opts, rank, world))
        .flatten()
}

/// The split of the embedding matrix for `rank` of `world`, or `None` when the embedding gathers it.
pub(crate) fn embedding_split(
    plan: &UnitPlan,
    opts: &FsdpOptions,
    rank: usize,
    world: usize,
) -> Option<SplitLayout> {
    let &matrix = plan.stage_refs.get(&Stage::Embedding)?.first()?;
    row_split(plan, matrix, opts, rank, world)
}

/// The split of the `[vocab, hidden]` matrix at `(unit, entry)` when every rank's shard holds whole rows of it.
fn row_split(
    plan: &UnitPlan,
    (unit, entry): (usize, usize),
    opts: &FsdpOptions,
    rank: usize,
    world: usize,
) -> Option<SplitLayout> {
    if !opts.vocab_parallel || opts.strategy == ShardingStrategy::NoShard || world < 2 {
        return None;
    }
    let e = &plan.units[unit].entries[entry];
    let [vocab, hidden] = e.shape[..] else {
        return None;
    };
    let shard = plan.units[unit].shard_len(world);
    // A rank's part of the matrix, in elements from the matrix's first, clipped to it.
    let part = |r: i64| {
        let lo = (r * shard - e.offset).clamp(0, e.numel);
        let hi = ((r + 1) * shard - e.offset).clamp(0, e.numel);
        (lo, hi)
    };
    let aligned = hidden > 0
        && (0..world as i64).all(|r| {
            let (lo, hi) = part(r);
            lo % hidden == 0 && hi % hidden == 0
        });
    if !aligned {
        return None;
    }
    let (lo, hi) = part(rank as i64);
    Some(SplitLayout {
        unit,
        vocab,
        hidden,
        first_row: lo / hidden,
        rows: (hi - lo) / hidden,
        local_offset: e.offset + lo - rank as i64 * shard,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferl_trainer::model::config::ModelConfig;
    use ferl_trainer::model::layout::ModelLayout;

    fn plan(vocab: i64, hidden: i64, tied: bool) -> UnitPlan {
        let raw = serde_json::json!({
            "model_type": "qwen2", "hidden_size": hidden, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 12, "num_hidden_layers": 2, "vocab_size": vocab, "tie_word_embeddings": tied,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0
        });
        let cfg = ModelConfig::from_value(raw, std::path::Path::new("test")).unwrap();
        UnitPlan::new(&ModelLayout::new(&cfg))
    }

    fn opts(strategy: ShardingStrategy) -> FsdpOptions {
        FsdpOptions::new(strategy, tch::Kind::Float, tch::Device::Cpu)
    }

    #[test]
    fn a_tied_matrix_splits_on_whole_rows_at_any_world_size() {
        let p = plan(12, 8, true);
        let full = opts(ShardingStrategy::FullShard);
        let at = |rank, world| head_split(&p, &full, rank, world);
        let halves: Vec<_> = (0..2).map(|r| at(r, 2).unwrap()).collect();
        assert_eq!((halves[0].first_row, halves[0].rows), (0, 6));
        assert_eq!((halves[1].first_row, halves[1].rows), (6, 6));
        assert_eq!(halves[1].local_offset, 0);
        assert_eq!(
            halves[1].unit, 0,
            "the tied matrix lives in the embedding unit"
        );
        // 12 rows over 5 ranks: padded to 15, 3 rows each, the last rank none.
        let fifths: Vec<_> = (0..5).map(|r| at(r, 5).unwrap()).collect();
        let rows: Vec<(i64, i64)> = fifths.iter().map(|s| (s.first_row, s.rows)).collect();
        assert_eq!(rows, [(0, 3), (3, 3), (6, 3), (9, 3), (12, 0)]);
        // One rank, NO_SHARD, or the split turned off: nothing to split.
        assert!(at(0, 1).is_none());
        assert!(head_split(&p, &opts(ShardingStrategy::NoShard), 0, 2).is_none());
        let off = FsdpOptions {
            vocab_parallel: false,
            ..full
        };
        assert!(head_split(&p, &off, 0, 2).is_none());
        assert!(embedding_split(&p, &off, 0, 2).is_none());
        // The embedding splits alike: the same matrix.
        assert_eq!(embedding_split(&p, &full, 1, 2), Some(halves[1]));
    }

    #[test]
    fn an_untied_output_matrix_splits_in_its_own_unit_as_the_embedding_does() {
        let p = plan(12, 8, false);
        let full = opts(ShardingStrategy::FullShard);
        for world in 2..=4 {
            for rank in 0..world {
                let head = head_split(&p, &full, rank, world).unwrap();
                let emb = embedding_split(&p, &full, rank, world).unwrap();
                assert_eq!(p.units[head.unit].name, "head.output");
                assert_eq!(p.units[emb.unit].name, "embedding");
                assert_eq!(
                    (head.first_row, head.rows, head.local_offset),
                    (emb.first_row, emb.rows, emb.local_offset),
                    "rank {rank} of {world}"
                );
            }
        }
        let e = embedding_split(&p, &full, 1, 3).unwrap();
        assert_eq!((e.first_row, e.rows, e.local_offset), (4, 4, 0));
    }
}
