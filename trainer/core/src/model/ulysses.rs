//! Ulysses sequence parallelism (DeepSpeed-Ulysses; verl's `ulysses_sequence_parallel_size`): the `K` ranks of a
//! sequence-parallel group each hold `1/K` of every sequence's tokens. Everything but attention is per token, so it
//! runs on the local slice as is; attention needs every token, so around it an all-to-all trades the sequence split
//! for a head split — each rank attends over the *whole* sequence with `1/K` of the heads — and a second all-to-all
//! trades it back.
//!
//! Layout: attention tensors are `[B, heads, T, head_dim]` as in `model::layers`. A rank's local slice holds the
//! tokens `rank·S .. (rank+1)·S` of the group's `T = K·S` (the caller pads `T` to a multiple of `K`), and after
//! [`SpGroup::seq_to_heads`] the heads `rank·H/K .. (rank+1)·H/K` of all `T` tokens.
//!
//! Backward: the two exchanges are each other's inverse and linear, so the gradient of one is the other applied to
//! the output gradient ([`SpAttention::backward`]); the attention core in between is differentiated by autograd
//! from leaves, as the engine does for every piece of a split layer.
//!
//! KV heads: with fewer KV heads than `K` the keys and values are repeated to `K` heads first (as verl does), so
//! every rank gets one; the gradient sums the repeats back.

use super::layers::{self, Attention};
use crate::storage::vjp_with_grads;
use anyhow::{bail, Context, Result};
use ferl_collective::Communicator;
use std::sync::Arc;
use tch::Tensor;

/// A sequence-parallel group: the ranks that share each sequence.
#[derive(Clone)]
pub struct SpGroup {
    comm: Arc<dyn Communicator>,
}

impl SpGroup {
    /// The group over `comm` (its ranks are the group's ranks, in order).
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self { comm }
    }

    /// `K`, the ranks of the group.
    pub fn size(&self) -> i64 {
        self.comm.world_size() as i64
    }

    /// This rank's place in the group (which slice of the sequence it holds).
    pub fn rank(&self) -> i64 {
        self.comm.rank() as i64
    }

    /// The group's communicator (the head's exchanges, `crate::head_share`).
    pub fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// The group's communicator, shared.
    pub fn shared_comm(&self) -> Arc<dyn Communicator> {
        self.comm.clone()
    }

    /// Refuses a model whose heads do not split over the group ([`check_heads`]).
    pub fn check_heads(&self, num_heads: i64, num_kv_heads: i64) -> Result<()> {
        check_heads(self.size(), num_heads, num_kv_heads)
    }

    /// This rank's slice `[.., rank·S .. (rank+1)·S]` of `x` along `dim`, whose size must be a multiple of `K`.
    pub fn local_slice(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        let (t, k) = (x.size()[dim as usize], self.size());
        if t % k != 0 {
            bail!("sequence length {t} is not a multiple of ulysses_sequence_parallel_size={k}");
        }
        Ok(x.narrow(dim, self.rank() * (t / k), t / k))
    }

    /// `[B, H, S, D]` (local tokens, all heads) → `[B, H/K, K·S, D]` (all tokens, local heads).
    pub fn seq_to_heads(&self, x: &Tensor) -> Result<Tensor> {
        let [b, h, s, d] = dims(x, "seq_to_heads")?;
        let k = self.size();
        let hk = h / k;
        // Chunk j goes to rank j: heads j·H/K ...; chunk i received is rank i's tokens.
        let send = x
            .view([b, k, hk, s, d])
            .permute([1, 0, 2, 3, 4])
            .contiguous();
        let recv = self.exchange(&send)?;
        Ok(recv.permute([1, 2, 0, 3, 4]).reshape([b, hk, k * s, d]))
    }

    /// `[B, H/K, K·S, D]` (all tokens, local heads) → `[B, H, S, D]` (local tokens, all heads); the inverse of
    /// [`SpGroup::seq_to_heads`].
    pub fn heads_to_seq(&self, y: &Tensor) -> Result<Tensor> {
        let [b, hk, t, d] = dims(y, "heads_to_seq")?;
        let k = self.size();
        let s = t / k;
        let send = y
            .view([b, hk, k, s, d])
            .permute([2, 0, 1, 3, 4])
            .contiguous();
        let recv = self.exchange(&send)?;
        Ok(recv.permute([1, 0, 2, 3, 4]).reshape([b, k * hk, s, d]))
    }

    fn exchange(&self, send: &Tensor) -> Result<Tensor> {
        let mut recv = send.empty_like();
        self.comm
            .all_to_all(&mut recv, send)
            .context("ulysses all-to-all")?;
        Ok(recv)
    }
}

/// Refuses a model whose heads do not split over groups of `k` ranks, naming both numbers: the query heads must
/// be a multiple of `k`, and the KV heads a multiple or a divisor of it (then they are repeated).
pub fn check_heads(k: i64, num_heads: i64, num_kv_heads: i64) -> Result<()> {
    if num_heads % k != 0 {
        bail!("ulysses_sequence_parallel_size={k} must divide the model's num_attention_heads={num_heads}");
    }
    if num_kv_heads % k != 0 && k % num_kv_heads != 0 {
        bail!(
            "ulysses_sequence_parallel_size={k} and the model's num_key_value_heads={num_kv_heads}: one must divide \
             the other"
        );
    }
    Ok(())
}

fn dims(x: &Tensor, what: &str) -> Result<[i64; 4]> {
    x.size().try_into().ok().with_context(|| {
        format!(
            "{what}: expected [B, heads, T, head_dim], got {:?}",
            x.size()
        )
    })
}

/// Attention of this rank's local `q`, `k`, `v` over the group's whole sequence (as [`SpAttention::forward`]),
/// without anything kept for a backward (no-grad passes).
pub fn attend_no_grad(
    group: &SpGroup,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    whole: &Attention,
) -> Result<Tensor> {
    let _g = tch::no_grad_guard();
    let (q, k, v, _) = to_heads(group, q, k, v)?;
    let o = layers::attend(&q, &k, &v, whole, q.size()[1] != k.size()[1]);
    group.heads_to_seq(&o)
}

/// The whole-sequence, local-head queries, keys and values of the local ones, the KV heads first repeated to `K`
/// when there are fewer; and that repeat (1: none).
fn to_heads(
    group: &SpGroup,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Tensor, Tensor, i64)> {
    let repeat = (group.size() / k.size()[1]).max(1);
    let spread = |t: &Tensor| match repeat {
        1 => group.seq_to_heads(t),
        r => group.seq_to_heads(&t.repeat_interleave_self_int(r, 1, None)),
    };
    Ok((group.seq_to_heads(q)?, spread(k)?, spread(v)?, repeat))
}

/// One attention over a sequence-parallel group, kept between forward and backward: the whole-sequence, local-head
/// queries, keys and values (leaves) and the attention output with its graph.
pub struct SpAttention {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    /// Times each KV head was repeated before the exchange (1: none).
    kv_repeat: i64,
}

impl SpAttention {
    /// Attention of this rank's local `q` (`[B, H, S, D]`, rotated), `k`, `v` (`[B, KV, S, D]`) over the group's
    /// whole sequence as `attn` describes it (causal rows, or packed sequences by their lengths over all `K·S`
    /// tokens). Returns the local output `[B, H, S, D]` and what the backward needs.
    pub fn forward(
        group: &SpGroup,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        attn: &Attention,
    ) -> Result<(Tensor, Self)> {
        let leaf = |t: Tensor| t.detach().set_requires_grad(true);
        let (q, k, v, kv_repeat) = to_heads(group, q, k, v)?;
        let (q, k, v) = (leaf(q), leaf(k), leaf(v));
        let gqa = q.size()[1] != k.size()[1];
        let out = tch::with_grad(|| layers::attend(&q, &k, &v, attn, gqa));
        let local = group.heads_to_seq(&out.detach())?;
        let saved = Self {
            q,
            k,
            v,
            out,
            kv_repeat,
        };
        Ok((local, saved))
    }

    /// The gradients of the local `q`, `k`, `v` for the local output gradient `grad` (`[B, H, S, D]`).
    pub fn backward(self, group: &SpGroup, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let grad_out = group.seq_to_heads(grad)?;
        let grad_out = grad_out.to_kind(self.out.kind());
        let g = vjp_with_grads(&[&self.out], &[&grad_out], &[&self.q, &self.k, &self.v])?;
        let unrepeat = |t: Tensor| match self.kv_repeat {
            1 => t,
            r => {
                let [b, h, s, d] = t.size()[..].try_into().expect("4-d");
                t.view([b, h / r, r, s, d])
                    .sum_dim_intlist(2, false, t.kind())
            }
        };
        let dq = group.heads_to_seq(&g[0])?;
        let dk = unrepeat(group.heads_to_seq(&g[1])?);
        let dv = unrepeat(group.heads_to_seq(&g[2])?);
        Ok((dq, dk, dv))
    }
}
