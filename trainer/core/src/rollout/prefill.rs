//! The prefill of a generation batch: the prompts' tokens run through the model packed, without their padding, and
//! their keys and values land in the left-padded KV cache.
//!
//! The cache is left-padded (see [`super::cache`]), but only the decode steps' attention needs that layout: the
//! projections and the MLP work row by row, so they run on the prompts' real tokens only, packed in one row (`[1, S]`,
//! S the sum of the prompt lengths; 1,368 of the 2,128 padded tokens of `ferl-bench rl`'s 16 GSM8K prompts). Each
//! layer scatters its packed keys and values into the padded cache, and its queries attend packed, each prompt
//! causally to itself ([`Varlen`], as training's remove-padding does), without padding or a mask.

use super::cache::KvCache;
use super::RolloutModel;
use crate::model::layers::{self, Rope};
use crate::model::varlen::Varlen;
use anyhow::Result;
use tch::{Device, Tensor};

/// The left-padded prompt batch, `[B, W]`, and its real tokens packed in one row.
pub(crate) struct PromptBatch {
    /// Real-token flags of the padded layout (`[B, W]` bool).
    pub(crate) valid: Tensor,
    /// Prompt lengths (`[B]` int64).
    pub(crate) lens: Tensor,
    /// The real tokens in order (`[1, S]`).
    packed_ids: Tensor,
    /// Their RoPE positions, `0..len` per prompt (`[1, S]`).
    packed_positions: Tensor,
    /// Where each real token sits in the padded layout flattened to `B · W` rows (`[S]`).
    slots: Tensor,
    /// Each prompt's last token in the packed row (`[B]`).
    last: Tensor,
    /// The prompts' layout in the packed row, for the prefill's attention.
    packed: Varlen,
    width: i64,
}

impl PromptBatch {
    /// `prompts` left-padded to the longest (the padding is never attended to, so its token is irrelevant).
    pub(crate) fn new(prompts: &[Vec<i64>], device: Device) -> Result<Self> {
        let width = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let (mut ids, mut positions, mut slots, mut last, mut valid) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (row, p) in prompts.iter().enumerate() {
            let skip = width - p.len();
            ids.extend_from_slice(p);
            positions.extend(0..p.len() as i64);
            slots.extend((skip..width).map(|c| (row * width + c) as i64));
            last.push(ids.len() as i64 - 1);
            valid.extend((0..width).map(|c| c >= skip));
        }
        let lens: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
        let on = |t: Tensor| t.to_device(device);
        Ok(Self {
            valid: on(Tensor::from_slice(&valid).view([prompts.len() as i64, width as i64])),
            lens: on(Tensor::from_slice(&lens)),
            packed_ids: on(Tensor::from_slice(&ids).unsqueeze(0)),
            packed_positions: on(Tensor::from_slice(&positions).unsqueeze(0)),
            slots: on(Tensor::from_slice(&slots)),
            last: on(Tensor::from_slice(&last)),
            packed: Varlen::new(&lens, device)?,
            width: width as i64,
        })
    }

    /// Columns of the padded layout: the longest prompt's length.
    pub(crate) fn width(&self) -> i64 {
        self.width
    }

    /// `[1, heads, S, D]` packed rows in the padded layout, `[B, heads, W, D]` (zeros at the padding).
    fn unpack(&self, x: &Tensor) -> Tensor {
        let (b, w) = (self.lens.size()[0], self.width);
        let (heads, d) = (x.size()[1], x.size()[3]);
        let rows = x.squeeze_dim(0).transpose(0, 1); // [S, heads, D]
        Tensor::zeros([b * w, heads, d], (x.kind(), x.device()))
            .index_copy(0, &self.slots, &rows)
            .view([b, w, heads, d])
            .transpose(1, 2)
    }

    /// The real rows of `[B, heads, W, D]`, packed: `[1, heads, S, D]` (the inverse of `unpack`).
    #[cfg(test)]
    fn pack(&self, x: &Tensor) -> Tensor {
        let (heads, d) = (x.size()[1], x.size()[3]);
        x.transpose(1, 2)
            .reshape([-1, heads, d])
            .index_select(0, &self.slots)
            .transpose(0, 1)
            .unsqueeze(0)
    }
}

impl RolloutModel {
    /// Runs the prompts of `batch` through the model into the empty `cache`; returns each prompt's last hidden state
    /// (`[B, H]`).
    pub(crate) fn prefill(&self, cache: &mut KvCache, batch: &PromptBatch) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        cache.claim(&batch.valid)?;
        let rope = Rope::new(&self.cfg, &batch.packed_positions, self.kind);
        let gqa = self.cfg.num_kv_heads != self.cfg.num_heads;
        let mut h = self.embed(&batch.packed_ids);
        for l in 0..self.cfg.num_layers {
            h = self.layer(l, &h, |p, d, x| {
                let (q, k, v) = layers::qkv(&self.cfg, d, p, x, &rope);
                cache.write(l, &batch.unpack(&k), &batch.unpack(&v));
                let o = batch.packed.attend(&q, &k, &v, gqa);
                layers::attention_out(&self.cfg, d, p, &o)
            });
        }
        Ok(h.squeeze_dim(0).index_select(0, &batch.last))
    }
}

/// A check of the layout helpers without a model.
#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn packing_round_trips_through_the_padded_layout() {
        let batch = PromptBatch::new(&[vec![5, 6], vec![7, 8, 9], vec![4]], Device::Cpu).unwrap();
        assert_eq!(batch.width(), 3);
        assert_eq!(
            Vec::<i64>::try_from(&batch.slots).unwrap(),
            [1, 2, 3, 4, 5, 8]
        );
        assert_eq!(Vec::<i64>::try_from(&batch.last).unwrap(), [1, 4, 5]);
        let x = Tensor::arange(6 * 2 * 4, (Kind::Float, Device::Cpu)).view([1, 6, 2, 4]);
        let x = x.transpose(1, 2); // [1, heads 2, S 6, D 4]
        let padded = batch.unpack(&x);
        assert_eq!(padded.size(), [3, 2, 3, 4]);
        assert_eq!(
            padded
                .get(0)
                .select(1, 0)
                .abs()
                .sum(Kind::Float)
                .double_value(&[]),
            0.0
        );
        assert_eq!(batch.pack(&padded), x);
    }
}
