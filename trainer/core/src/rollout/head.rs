//! The output head: the final norm and the output projection of final hidden rows into fp32 logits, written into
//! buffers that a decode loop keeps from one step to the next.
//!
//! A decode step's logits are `[B, vocab]` (10 MB for 16 rows of Qwen2's 151,936 tokens): allocating them afresh each
//! step makes the kernel fault in and zero new pages every step, which a kept buffer does not. Where
//! [`layers::multiplies_on_the_left`] holds (few rows, a wide hidden size, on the CPU), the product is computed as
//! `W·xᵀ` into a `[vocab, B]` buffer and copied into rows block by block of [`VOCAB_BLOCK`] columns, each block's
//! transposition staying in the cache (0.8 ms for 16 × 151,936 logits, where one strided copy takes 2.4 ms).
//! Greedy decoding of an fp32 model on the CPU needs no logits at all: [`RolloutModel::next_tokens`] reduces the
//! `[vocab, n]` product directly ([`greedy`]).

use super::greedy;
use super::sampling::Sampler;
use super::RolloutModel;
use crate::model::{layers, skinny};
use tch::{Device, Kind, Tensor};

/// Columns of the logits transposed at once (see the module docs).
const VOCAB_BLOCK: i64 = 8192;

/// Buffers the logits are written into, reused while the number of rows stays the same.
#[derive(Default)]
pub(crate) struct LogitBuffers {
    /// `[n, vocab]` in the model's dtype: the logits.
    rows: Option<Tensor>,
    /// `[vocab, n]`: the product before its transposition, when it is computed as `W·xᵀ`.
    columns: Option<Tensor>,
}

/// `slot`'s tensor when it has `shape`, else a new one of `like`'s dtype and device, kept in `slot`.
fn reuse(slot: &mut Option<Tensor>, shape: [i64; 2], like: &Tensor) -> Tensor {
    match slot {
        Some(t) if t.size() == shape => t.shallow_clone(),
        _ => {
            let t = Tensor::empty(shape, (like.kind(), like.device()));
            *slot = Some(t.shallow_clone());
            t
        }
    }
}

impl RolloutModel {
    /// The next token of each sequence and its log-probability (`[n]` each) from final hidden rows `h` (`[n, H]`):
    /// greedy decoding of an fp32 model on the CPU takes them straight from the output product ([`greedy`]); any
    /// other case writes the logits into `buffers` and lets `sampler` pick.
    pub(crate) fn next_tokens(
        &self,
        h: &Tensor,
        buffers: &mut LogitBuffers,
        sampler: &mut Sampler,
    ) -> (Tensor, Tensor) {
        let params = sampler.params();
        let fused = params.is_greedy()
            && h.device() == Device::Cpu
            && h.kind() == Kind::Float
            && self.lm_head.kind() == Kind::Float
            && !h.requires_grad();
        if !fused {
            return sampler.pick(&self.logits_into(h, buffers));
        }
        let x = layers::rms_norm(h, &self.norm, self.cfg.rms_norm_eps);
        let (n, vocab) = (x.size()[0], self.lm_head.size()[0]);
        let columns = reuse(&mut buffers.columns, [vocab, n], &x);
        let columns = skinny::w_xt_out(&columns, &self.lm_head, &x);
        let picks = greedy::pick(&columns, params.log_prob_temperature());
        (picks.tokens, picks.log_probs)
    }

    /// fp32 logits (`[n, vocab]`) of final hidden rows `h` (`[n, H]`) in new memory.
    pub(crate) fn logits(&self, h: &Tensor) -> Tensor {
        self.logits_into(h, &mut LogitBuffers::default())
    }

    /// fp32 logits (`[n, vocab]`, contiguous) of final hidden rows `h` (`[n, H]`): the final norm, then the output
    /// projection, written into `buffers` (for an fp32 model the result is `buffers`' own tensor, overwritten by the
    /// next call).
    pub(crate) fn logits_into(&self, h: &Tensor, buffers: &mut LogitBuffers) -> Tensor {
        let x = layers::rms_norm(h, &self.norm, self.cfg.rms_norm_eps);
        let (n, vocab) = (x.size()[0], self.lm_head.size()[0]);
        let rows = reuse(&mut buffers.rows, [n, vocab], &x);
        if layers::multiplies_on_the_left(&x, &self.lm_head) {
            let columns = reuse(&mut buffers.columns, [vocab, n], &x);
            let _ = skinny::w_xt_out(&columns, &self.lm_head, &x);
            for start in (0..vocab).step_by(VOCAB_BLOCK as usize) {
                let len = VOCAB_BLOCK.min(vocab - start);
                rows.narrow(1, start, len)
                    .copy_(&columns.narrow(0, start, len).tr());
            }
        } else {
            let _ = x.linear_out(&rows, &self.lm_head, None::<&Tensor>);
        }
        rows.to_kind(Kind::Float)
    }
}
