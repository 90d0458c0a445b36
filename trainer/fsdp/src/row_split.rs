//! Where a rank's rows of the vocabulary matrices lie in its shard, for the head and the embedding split by
//! vocabulary rows ([`ferl_trainer::vocab_parallel`], design note 14: no rank holds a whole `[vocab, hidden]`
//! matrix or its gradient).
//!
//! The store splits a matrix when its flat shards are whole rows of it on every rank, which FSDP's even flat split
//! gives whenever the shard boundaries fall on row boundaries (`vocab · hidden / world` a multiple of `hidden` for a
//! matrix alone in its unit: 151,936 rows over 2, 4 or 8 ranks). The head's output matrix must also live in another
//! unit than the final norm (a tied matrix lives in the embedding unit), so the head gathers only the norm. Otherwise
//! the stage gathers the matrix whole, as any stage.

use crate::units::UnitPlan;
use crate::ShardingStrategy;
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
    strategy: ShardingStrategy,
    rank: usize,
    world: usize,
) -> Option<SplitLayout> {
    let refs = plan.stage_refs.get(&Stage::Head)?;
    let (&(norm_unit, _), &matrix) = (refs.first()?, refs.get(1)?);
    (matrix.0 != norm_unit)
        .then(|| row_split(plan, matrix, strategy, rank, world))
        .flatten()
}

/// The split of the embedding matrix for `rank` of `world`, or `None` when the embedding gathers it.
pub(crate) fn embedding_split(
    plan: &UnitPlan,
    strategy: ShardingStrategy,
    rank: usize,
    world: usize,
) -> Option<SplitLayout> {
    let &matrix = plan.stage_refs.get(&Stage::Embedding)?.first()?;
    row_split(plan, matrix, strategy, rank, world)
}

/// The split of the `[vocab, hidden]` matrix at `(unit, entry)` when every rank's shard holds whole rows of it.
fn row_split(
    plan: &UnitPlan,
    (unit, entry): (usize, usize),
    strategy: ShardingStrategy,
    rank: usize,
    world: usize,
) -> Option<SplitLayout> {
    if strategy == ShardingStrategy::NoShard || world < 2 {
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

    #[test]
    fn a_tied_matrix_splits_where_shards_fall_on_rows() {
        let p = plan(12, 8, true);
        let at = |rank, world| head_split(&p, ShardingStrategy::FullShard, rank, world);
        let halves: Vec<_> = (0..2).map(|r| at(r, 2).unwrap()).collect();
        assert_eq!((halves[0].first_row, halves[0].rows), (0, 6));
        assert_eq!((halves[1].first_row, halves[1].rows), (6, 6));
        assert_eq!(halves[1].local_offset, 0);
        assert_eq!(
            halves[1].unit, 0,
            "the tied matrix lives in the embedding unit"
        );
        // 96 elements over 5 ranks: shards of 20 elements cut rows of 8.
        assert!(at(0, 5).is_none());
        // One rank, or NO_SHARD: nothing to split.
        assert!(at(0, 1).is_none());
        assert!(head_split(&p, ShardingStrategy::NoShard, 0, 2).is_none());
        // The embedding splits alike: the same matrix.
        assert_eq!(
            embedding_split(&p, ShardingStrategy::FullShard, 1, 2),
            Some(halves[1])
        );
    }

    #[test]
    fn an_untied_output_matrix_sharing_the_norms_unit_is_gathered_and_its_embedding_split() {
        let p = plan(12, 8, false);
        assert!(head_split(&p, ShardingStrategy::FullShard, 0, 2).is_none());
        let e = embedding_split(&p, ShardingStrategy::FullShard, 1, 2).unwrap();
        assert_eq!((e.first_row, e.rows, e.local_offset), (6, 6, 0));
    }
}
