//! The KV cache of a generation batch and the cached forward pass.
//!
//! Columns of the cache are shared by the batch: a prompt shorter than the longest is left-padded, so column `c`
//! of row `b` holds the key of that sequence's token `c - pad_b`. Which columns hold real tokens is kept in `valid`;
//! a query attends to the valid columns up to its own (causal), and always to its own column, so that padding queries
//! (whose outputs nobody reads) never see an all-masked row and SDPA never makes NaN. RoPE positions come from the
//! caller, per sequence, so padding shifts nothing.
//!
//! Keys and values are written into buffers sized for the whole generation (`capacity` columns), so a decode step
//! copies one column per layer instead of re-concatenating the cache.

use super::RolloutModel;
use crate::model::config::ModelConfig;
use crate::model::layers::{self, Rope};
use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

/// Keys and values of every layer for a batch, with the columns filled so far.
pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    /// `[B, capacity]` bool: the column holds a real token of the row's sequence.
    valid: Tensor,
    len: i64,
    capacity: i64,
    gqa: bool,
    /// The dtype of the keys, values and attention masks.
    kind: Kind,
}

impl KvCache {
    /// An empty cache for `batch` sequences of at most `capacity` tokens (padding included) of a model with `cfg`.
    pub fn new(cfg: &ModelConfig, batch: i64, capacity: i64, kind: Kind, device: Device) -> Self {
        let shape = [batch, cfg.num_kv_heads, capacity, cfg.head_dim];
        let buffers = || -> Vec<Tensor> {
            (0..cfg.num_layers)
                .map(|_| Tensor::zeros(shape, (kind, device)))
                .collect()
        };
        Self {
            keys: buffers(),
            values: buffers(),
            valid: Tensor::zeros([batch, capacity], (Kind::Bool, device)),
            len: 0,
            capacity,
            gqa: cfg.num_kv_heads != cfg.num_heads,
            kind,
        }
    }

    /// Columns filled so far.
    pub fn len(&self) -> i64 {
        self.len
    }

    /// Whether nothing has been written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Claims the next `t` columns for a step whose tokens are real where `valid` (`[B, t]` bool) is true, and
    /// returns the step's attention mask, `[B, 1, t, len + t]` in the cache's dtype: 0 where a token attends, −∞
    /// elsewhere (additive, as SDPA applies it; a boolean mask would be converted in every layer's call).
    pub(super) fn begin(&mut self, valid: &Tensor) -> Result<Tensor> {
        let t = valid.size()[1];
        self.claim(valid)?;
        let (start, end) = (self.len - t, self.len);
        let dev = valid.device();
        let keys = Tensor::arange(end, (Kind::Int64, dev)).unsqueeze(0); // [1, L]
        let queries = Tensor::arange_start(start, end, (Kind::Int64, dev)).unsqueeze(1); // [t, 1]
        let causal = keys.le_tensor(&queries); // [t, L]
        let own = keys.eq_tensor(&queries);
        let real = self.valid.narrow(1, 0, end).unsqueeze(1).unsqueeze(1); // [B, 1, 1, L]
        let attends = real.logical_and(&causal).logical_or(&own);
        Ok(Tensor::zeros(attends.size(), (self.kind, dev))
            .masked_fill(&attends.logical_not(), f64::NEG_INFINITY))
    }

    /// Claims the next `t` columns for tokens that are real where `valid` (`[B, t]` bool) is true (what
    /// [`KvCache::begin`] does, without the mask: the prefill attends packed).
    pub(super) fn claim(&mut self, valid: &Tensor) -> Result<()> {
        let t = valid.size()[1];
        if self.len + t > self.capacity {
            bail!(
                "KV cache full: {} + {t} columns exceed its capacity {}",
                self.len,
                self.capacity
            );
        }
        self.valid.narrow(1, self.len, t).copy_(valid);
        self.len += t;
        Ok(())
    }

    /// Writes layer `l`'s keys and values (`[B, kv_heads, t, head_dim]`) into the last `t` columns claimed.
    pub(super) fn write(&mut self, l: usize, k: &Tensor, v: &Tensor) {
        let t = k.size()[2];
        let start = self.len - t;
        self.keys[l].narrow(2, start, t).copy_(k);
        self.values[l].narrow(2, start, t).copy_(v);
    }

    /// Writes layer `l`'s keys and values of the current step (`[B, kv_heads, t, head_dim]`, the last `t` columns
    /// claimed by `begin`) and attends `q` to every column so far under `mask`.
    ///
    /// `q` is made contiguous first: a decode step's projections may be transposed views ([`layers::matmul_t`]), and
    /// CPU SDPA runs its fused kernel only on a unit-stride last dimension (else the math path, which copies the cache
    /// to every query head). A one-token step with fewer KV heads than query heads attends each KV head's group of
    /// query heads as its rows (`[B, kv_heads, group, head_dim]`, the mask the same for every row): the same
    /// products as SDPA's GQA, a third of its time on the CPU.
    pub(super) fn attend(
        &mut self,
        l: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
    ) -> Tensor {
        let q = q.contiguous();
        let t = k.size()[2];
        self.write(l, k, v);
        let keys = self.keys[l].narrow(2, 0, self.len);
        let values = self.values[l].narrow(2, 0, self.len);
        let sdpa = |q: &Tensor, gqa| {
            Tensor::scaled_dot_product_attention(
                q,
                &keys,
                &values,
                Some(mask),
                0.0,
                false,
                None,
                gqa,
            )
        };
        if !(self.gqa && t == 1) {
            return sdpa(&q, self.gqa);
        }
        let shape = q.size();
        let (b, kv, d) = (shape[0], k.size()[1], shape[3]);
        sdpa(&q.view([b, kv, -1, d]), false).view(shape.as_slice())
    }
}

impl RolloutModel {
    /// Runs the tokens `ids` (`[B, t]`) at RoPE `positions` (`[B, t]`, per sequence) through the model, appending
    /// their keys and values to `cache` (`valid` marks the real tokens); returns the final hidden states `[B, t, H]`.
    pub(crate) fn forward_cached(
        &self,
        cache: &mut KvCache,
        ids: &Tensor,
        positions: &Tensor,
        valid: &Tensor,
    ) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let mask = cache.begin(valid)?;
        let rope = Rope::new(&self.cfg, positions, self.kind);
        let mut h = self.embed(ids);
        for l in 0..self.cfg.num_layers {
            h = self.layer(l, &h, |p, d, x| {
                let (q, k, v) = layers::qkv(&self.cfg, d, p, x, &rope);
                let o = cache.attend(l, &q, &k, &v, &mask);
                layers::attention_out(&self.cfg, d, p, &o)
            });
        }
        Ok(h)
    }
}
