//! Sample order and batches: the seeded epoch order, global batches (the last partial one dropped, as verl's
//! sampler does), rank shards, and the two micro-batch forms the engine consumes — padded (`[batch, seq_len]`,
//! right padding) and packed (all tokens concatenated, with `cu_seqlens`).
//!
//! Invariants (tests name them):
//! 1. `epoch_order` is a permutation that depends only on (len, seed, epoch, shuffle); file order without shuffle.
//! 2. Padding never carries loss or attention: `attention_mask`/`loss_mask` are 0/false on every pad position.
//! 3. Position ids restart at 0 for every sequence in both forms.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::sample::TokenizedSample;

/// The order samples are visited in during `epoch`: a permutation seeded by (`seed`, `epoch`), or `0..len` when
/// `shuffle` is false.
pub fn epoch_order(len: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    if shuffle {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(epoch);
        order.shuffle(&mut rng);
    }
    order
}

/// Optimizer steps in one epoch: whole global batches only (the last partial batch is dropped).
pub fn steps_per_epoch(len: usize, global_batch: usize) -> usize {
    len.checked_div(global_batch).unwrap_or(0)
}

/// The sample indices of global batch `step` (0-based within the epoch) of `order`.
pub fn global_batch(order: &[usize], global_batch: usize, step: usize) -> &[usize] {
    &order[step * global_batch..(step + 1) * global_batch]
}

/// Rank `rank`'s contiguous share of a global batch split over `world` data-parallel ranks (the first
/// `len % world` ranks get one more).
pub fn rank_shard(batch: &[usize], rank: usize, world: usize) -> &[usize] {
    let (base, extra) = (batch.len() / world, batch.len() % world);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    &batch[start..start + len]
}

/// A right-padded micro-batch; every `Vec` is row-major `[batch, seq_len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaddedBatch {
    /// Number of sequences.
    pub batch: usize,
    /// Padded length (the longest sequence, or the requested length).
    pub seq_len: usize,
    /// Token ids; pad id on padding.
    pub input_ids: Vec<i64>,
    /// 1 on real tokens, 0 on padding.
    pub attention_mask: Vec<i64>,
    /// `loss_mask[t]`: token t is a target (predicted from position t-1); false on padding.
    pub loss_mask: Vec<bool>,
    /// 0, 1, 2... on real tokens; 0 on padding.
    pub position_ids: Vec<i64>,
}

impl PaddedBatch {
    /// Real (non-pad) tokens.
    pub fn num_tokens(&self) -> usize {
        self.attention_mask.iter().filter(|&&m| m == 1).count()
    }

    /// Target tokens.
    pub fn num_targets(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m).count()
    }
}

/// Pads `samples` on the right to the longest of them, or to `pad_to` when that is longer.
pub fn collate_padded(
    samples: &[&TokenizedSample],
    pad_id: i64,
    pad_to: Option<usize>,
) -> PaddedBatch {
    let longest = samples.iter().map(|s| s.len()).max().unwrap_or(0);
    let seq_len = longest.max(pad_to.unwrap_or(0));
    let n = samples.len() * seq_len;
    let mut b = PaddedBatch {
        batch: samples.len(),
        seq_len,
        input_ids: vec![pad_id; n],
        attention_mask: vec![0; n],
        loss_mask: vec![false; n],
        position_ids: vec![0; n],
    };
    for (row, s) in samples.iter().enumerate() {
        let at = row * seq_len;
        b.input_ids[at..at + s.len()].copy_from_slice(&s.input_ids);
        b.loss_mask[at..at + s.len()].copy_from_slice(&s.loss_mask);
        for t in 0..s.len() {
            b.attention_mask[at + t] = 1;
            b.position_ids[at + t] = t as i64;
        }
    }
    b
}

/// A packed ("remove padding") micro-batch: the sequences back to back, no padding at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    /// All token ids, sequence after sequence.
    pub input_ids: Vec<i64>,
    /// Position within its own sequence (restarts at 0 for each).
    pub position_ids: Vec<i64>,
    /// `loss_mask[t]`: token t is a target (predicted from t-1 of the same sequence; never the first of one).
    pub loss_mask: Vec<bool>,
    /// Sequence boundaries: sequence i is `cu_seqlens[i]..cu_seqlens[i+1]`; `len() == sequences + 1`.
    pub cu_seqlens: Vec<i64>,
    /// The longest sequence.
    pub max_seqlen: usize,
}

impl PackedBatch {
    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.cu_seqlens.len() - 1
    }

    /// Target tokens.
    pub fn num_targets(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m).count()
    }
}

/// Packs `samples` back to back.
pub fn collate_packed(samples: &[&TokenizedSample]) -> PackedBatch {
    let total: usize = samples.iter().map(|s| s.len()).sum();
    let mut b = PackedBatch {
        input_ids: Vec::with_capacity(total),
        position_ids: Vec::with_capacity(total),
        loss_mask: Vec::with_capacity(total),
        cu_seqlens: vec![0],
        max_seqlen: 0,
    };
    for s in samples {
        b.input_ids.extend_from_slice(&s.input_ids);
        b.loss_mask.extend_from_slice(&s.loss_mask);
        b.position_ids.extend(0..s.len() as i64);
        b.cu_seqlens.push(b.input_ids.len() as i64);
        b.max_seqlen = b.max_seqlen.max(s.len());
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ids: &[i64], mask: &[bool]) -> TokenizedSample {
        TokenizedSample {
            input_ids: ids.to_vec(),
            loss_mask: mask.to_vec(),
        }
    }

    #[test]
    fn epoch_order_is_a_seeded_permutation() {
        let a = epoch_order(100, 7, 0, true);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(a, sorted);
        assert_eq!(a, epoch_order(100, 7, 0, true));
        assert_ne!(a, epoch_order(100, 7, 1, true));
        assert_ne!(a, epoch_order(100, 8, 0, true));
        assert_eq!(epoch_order(5, 7, 3, false), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn batches_drop_the_last_partial_one_and_shards_cover_a_batch() {
        assert_eq!(steps_per_epoch(7473, 32), 233);
        assert_eq!(steps_per_epoch(10, 0), 0);
        let order: Vec<usize> = (0..10).collect();
        assert_eq!(global_batch(&order, 4, 1), [4, 5, 6, 7]);
        let b = [10, 11, 12, 13, 14];
        let shards: Vec<&[usize]> = (0..2).map(|r| rank_shard(&b, r, 2)).collect();
        assert_eq!(shards, [&[10, 11, 12][..], &[13, 14][..]]);
    }

    #[test]
    fn padding_carries_no_loss_or_attention() {
        let a = sample(&[1, 2, 3], &[false, true, true]);
        let b = sample(&[4, 5], &[false, true]);
        let p = collate_padded(&[&a, &b], 0, None);
        assert_eq!((p.batch, p.seq_len), (2, 3));
        assert_eq!(p.input_ids, [1, 2, 3, 4, 5, 0]);
        assert_eq!(p.attention_mask, [1, 1, 1, 1, 1, 0]);
        assert_eq!(p.loss_mask, [false, true, true, false, true, false]);
        assert_eq!(p.position_ids, [0, 1, 2, 0, 1, 0]);
        assert_eq!((p.num_tokens(), p.num_targets()), (5, 3));
        let p = collate_padded(&[&b], 9, Some(4));
        assert_eq!(p.input_ids, [4, 5, 9, 9]);
    }

    #[test]
    fn packed_positions_restart_per_sequence() {
        let a = sample(&[1, 2, 3], &[false, true, true]);
        let b = sample(&[4, 5], &[false, true]);
        let p = collate_packed(&[&a, &b]);
        assert_eq!(p.input_ids, [1, 2, 3, 4, 5]);
        assert_eq!(p.position_ids, [0, 1, 2, 0, 1]);
        assert_eq!(p.cu_seqlens, [0, 3, 5]);
        assert_eq!(
            (p.max_seqlen, p.num_sequences(), p.num_targets()),
            (3, 2, 3)
        );
    }
}
