//! Turning tokenized samples into the tensors of one micro-batch: token ids, positions, the attention kind, and the
//! flat row indices whose next token is a training target (only those rows ever reach the output projection).

use crate::model::layers::{Attention, SequenceParallel};
use crate::model::ulysses::SpGroup;
use crate::model::varlen::Varlen;
use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

/// One tokenized sample: `loss_mask[t]` means token `t` is a target, predicted from position `t - 1`.
#[derive(Clone, Copy, Debug)]
pub struct SampleRef<'a> {
    /// Token ids.
    pub input_ids: &'a [i64],
    /// Per token: is it a training target.
    pub loss_mask: &'a [bool],
}

impl SampleRef<'_> {
    /// Number of targets (token 0 is never one: nothing predicts it).
    pub fn num_targets(&self) -> i64 {
        self.loss_mask.iter().skip(1).filter(|&&m| m).count() as i64
    }
}

/// How samples are laid out in a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One row per sample, right-padded to the longest sample of the micro-batch (no wider).
    Padded,
    /// All samples in one row, each attending only to itself (no padding at all).
    Packed,
}

/// The tensors of one micro-batch.
pub struct MicroBatch {
    /// `[B, T]` token ids (padding is token 0, never attended to by real tokens, never a target).
    pub input_ids: Tensor,
    /// `[B, T]` position ids (restart at 0 per sample).
    pub positions: Tensor,
    /// Causal for padded rows; the packed sequences' boundaries for a packed row.
    pub attention: Attention,
    /// `[N]` indices into the flattened `[B * T]` positions whose next token is a target.
    pub target_rows: Tensor,
    /// `[N]` the target token of each of those rows.
    pub target_ids: Tensor,
    /// N.
    pub num_targets: i64,
    /// Real (non-pad) tokens in the micro-batch.
    pub real_tokens: i64,
}

impl MicroBatch {
    /// Builds a micro-batch of `samples` on `device`.
    pub fn new(samples: &[SampleRef<'_>], layout: Layout, device: Device) -> Result<Self> {
        if samples.is_empty() {
            bail!("a micro-batch needs at least one sample");
        }
        for (i, s) in samples.iter().enumerate() {
            if s.input_ids.len() != s.loss_mask.len() || s.input_ids.is_empty() {
                bail!(
                    "sample {i} of the micro-batch: {} input ids but {} loss-mask entries",
                    s.input_ids.len(),
                    s.loss_mask.len()
                );
            }
        }
        let real_tokens: i64 = samples.iter().map(|s| s.input_ids.len() as i64).sum();
        let (rows, width) = match layout {
            Layout::Padded => (
                samples.len(),
                samples.iter().map(|s| s.input_ids.len()).max().unwrap_or(0),
            ),
            Layout::Packed => (1, real_tokens as usize),
        };
        let mut ids = vec![0i64; rows * width];
        let mut pos = vec![0i64; rows * width];
        let mut target_rows = Vec::new();
        let mut target_ids = Vec::new();
        let mut offset = 0usize;
        for (i, s) in samples.iter().enumerate() {
            let start = match layout {
                Layout::Padded => i * width,
                Layout::Packed => offset,
            };
            offset += s.input_ids.len();
            for (t, (&id, &m)) in s.input_ids.iter().zip(s.loss_mask).enumerate() {
                ids[start + t] = id;
                pos[start + t] = t as i64;
                if t > 0 && m {
                    target_rows.push((start + t - 1) as i64);
                    target_ids.push(id);
                }
            }
        }
        let shape = [rows as i64, width as i64];
        let attention = match layout {
            Layout::Padded => Attention::Causal,
            Layout::Packed => {
                let lens: Vec<i64> = samples.iter().map(|s| s.input_ids.len() as i64).collect();
                Attention::Varlen(Varlen::new(&lens, device)?)
            }
        };
        Ok(Self {
            input_ids: Tensor::from_slice(&ids).view(shape).to_device(device),
            positions: Tensor::from_slice(&pos).view(shape).to_device(device),
            attention,
            num_targets: target_rows.len() as i64,
            target_rows: Tensor::from_slice(&target_rows).to_device(device),
            target_ids: Tensor::from_slice(&target_ids).to_device(device),
            real_tokens,
        })
    }

    /// This rank's share of the micro-batch under a Ulysses group (`model::ulysses`): the token dimension padded
    /// to a multiple of the group's size `K` (pad tokens attend to nothing real and are never targets; packed rows
    /// get them as one more sequence), then sliced to this rank's `1/K`, with the target rows in the slice and
    /// attention over the group's whole sequence. Positions stay those of the whole sequence.
    pub fn sequence_parallel(self, group: &SpGroup) -> Result<Self> {
        Ok(self.sequence_parallel_kept(group)?.0)
    }

    /// [`Self::sequence_parallel`], with the positions (in the whole micro-batch's target order) of the targets
    /// this rank's slice keeps, in order: a loss with per-target inputs (RL's advantages) takes those entries.
    pub fn sequence_parallel_kept(self, group: &SpGroup) -> Result<(Self, Vec<i64>)> {
        let (rows, width) = (self.input_ids.size()[0], self.input_ids.size()[1]);
        let k = group.size();
        let padded = (width + k - 1) / k * k;
        let pad = |t: &Tensor| t.constant_pad_nd([0, padded - width]);
        let real = self.real_mask(rows, width);
        let whole = match self.attention {
            Attention::Causal => Attention::Causal,
            Attention::Varlen(v) if padded > width => {
                let mut lens: Vec<i64> = v.cu_seqlens().windows(2).map(|w| w[1] - w[0]).collect();
                lens.push(padded - width);
                Attention::Varlen(Varlen::new(&lens, self.input_ids.device())?)
            }
            Attention::Varlen(v) => Attention::Varlen(v),
            Attention::SequenceParallel(_) => {
                bail!("the micro-batch is already split for sequence parallelism")
            }
        };
        let (span, start) = (padded / k, group.rank() * (padded / k));
        let local = |flat: i64| {
            let (b, t) = (flat / width, flat % width);
            (start..start + span)
                .contains(&t)
                .then_some(b * span + t - start)
        };
        let rows_in: Vec<i64> = Vec::<i64>::try_from(&self.target_rows)?;
        let ids_in: Vec<i64> = Vec::<i64>::try_from(&self.target_ids)?;
        let mut kept = Vec::new();
        let (target_rows, target_ids): (Vec<i64>, Vec<i64>) = (0i64..)
            .zip(rows_in.iter().zip(&ids_in))
            .filter_map(|(i, (&r, &id))| {
                let l = local(r)?;
                kept.push(i);
                Some((l, id))
            })
            .unzip();
        let mut targets_per_rank = vec![0; k as usize];
        for &r in &rows_in {
            targets_per_rank[((r % width) / span) as usize] += 1;
        }
        let device = self.input_ids.device();
        let local = Self {
            input_ids: group.local_slice(&pad(&self.input_ids), 1)?,
            positions: group.local_slice(&pad(&self.positions), 1)?,
            real_tokens: group
                .local_slice(&pad(&real), 1)?
                .sum(Kind::Int64)
                .int64_value(&[]),
            attention: Attention::SequenceParallel(Box::new(SequenceParallel {
                group: group.clone(),
                whole,
                targets_per_rank,
            })),
            num_targets: target_rows.len() as i64,
            target_rows: Tensor::from_slice(&target_rows).to_device(device),
            target_ids: Tensor::from_slice(&target_ids).to_device(device),
        };
        Ok((local, kept))
    }

    /// `[B, T]` 1 where a real token is, 0 on padding.
    fn real_mask(&self, rows: i64, width: i64) -> Tensor {
        let device = self.input_ids.device();
        match &self.attention {
            Attention::Varlen(_) | Attention::SequenceParallel(_) => {
                Tensor::ones([rows, width], (Kind::Int64, device))
            }
            Attention::Causal => {
                // Padding follows each row's tokens: a position is real when it is 0 or follows a larger one.
                let starts = self.positions.eq(0).cumsum(1, Kind::Int64).eq(1);
                starts.to_kind(Kind::Int64)
            }
        }
    }
}
