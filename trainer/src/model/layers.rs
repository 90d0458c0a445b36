//! The forward functions of the model, each a pure function of (its parameter tensors, its input): embedding, one
//! decoder layer (RMSNorm, GQA self-attention with RoPE through SDPA, RMSNorm, SwiGLU MLP) and the head (final norm and
//! the output projection of the selected rows). The engine calls them stage by stage; nothing here owns parameters.
//! The layer's pieces ([`attention`], [`mlp_in`], [`swiglu`], [`mlp_out`]) are public so that `model::graph` can run a
//! layer split at ops replaced by kernels.

use super::config::ModelConfig;
use super::layout::DecoderParam;
use super::lora::Proj;
use super::varlen::Varlen;
use tch::{Kind, Tensor};

/// How tokens of one micro-batch may attend to each other.
pub enum Attention {
    /// Right-padded rows: plain causal attention (real tokens never see the padding after them).
    Causal,
    /// Several sequences packed in one row (`[1, T]`), each attending causally to itself only.
    Varlen(Varlen),
}

/// Cosine and sine tables of rotary embeddings for the given positions, `[B, T, head_dim]` in `kind`.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Tables for `positions` (`[B, T]` int64), computed in fp32 the way transformers' RoPE does (with the
    /// config's [`super::rope::RopeScaling`]).
    pub fn new(cfg: &ModelConfig, positions: &Tensor, kind: Kind) -> Self {
        let dev = positions.device();
        let inv_freq = super::rope::inv_freq(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim, dev); // [D/2]
        let pos = positions.to_kind(Kind::Float).unsqueeze(-1); // [B,T,1]
        let freqs = pos.matmul(&inv_freq.unsqueeze(0)); // [B,T,D/2]
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        Self {
            cos: emb.cos().to_kind(kind).unsqueeze(1),
            sin: emb.sin().to_kind(kind).unsqueeze(1),
        }
    }

    /// Rotates `x` (`[B, heads, T, D]`).
    fn apply(&self, x: &Tensor) -> Tensor {
        let d = x.size()[3];
        let x1 = x.narrow(3, 0, d / 2);
        let x2 = x.narrow(3, d / 2, d / 2);
        let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
        x * &self.cos + rotated * &self.sin
    }
}

/// RMSNorm over the last dimension, computed in fp32 and cast back like transformers' `Qwen2RMSNorm`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    let xf = x.to_kind(Kind::Float);
    let var = xf.square().mean_dim(-1, true, Kind::Float);
    let normed = xf * (var + eps).rsqrt();
    weight * normed.to_kind(kind)
}

/// Token embedding: rows of `embed` for `ids`.
pub fn embed(embed: &Tensor, ids: &Tensor) -> Tensor {
    Tensor::embedding(embed, ids, -1, false, false)
}

/// One decoder layer on `h` (`[B, T, H]`) with the built-in ops; `p` holds the layer's tensors in the order of `d`.
pub fn decoder_layer(
    cfg: &ModelConfig,
    d: &DecoderParam,
    p: &[Tensor],
    h: &Tensor,
    rope: &Rope,
    attn: &Attention,
) -> Tensor {
    let x = rms_norm(h, &p[d.input_norm], cfg.rms_norm_eps);
    let h = h + attention(cfg, d, p, &x, rope, attn);
    let x = rms_norm(&h, &p[d.post_norm], cfg.rms_norm_eps);
    let (gate, up) = mlp_in(d, p, &x);
    h + mlp_out(d, p, &swiglu(&gate, &up))
}

/// The attention block of a decoder layer on the normalised input `x` (`[B, T, H]`): q/k/v projections, RoPE,
/// SDPA and the output projection (the residual is added by the caller).
pub fn attention(
    cfg: &ModelConfig,
    d: &DecoderParam,
    p: &[Tensor],
    x: &Tensor,
    rope: &Rope,
    attn: &Attention,
) -> Tensor {
    let (b, t) = (x.size()[0], x.size()[1]);
    let lin =
        |x: &Tensor, (w, bias): (usize, Option<usize>), proj: Proj| linear(x, p, w, bias, d, proj);
    let q = lin(x, d.q, Proj::Q)
        .view([b, t, cfg.num_heads, cfg.head_dim])
        .transpose(1, 2);
    let k = lin(x, d.k, Proj::K)
        .view([b, t, cfg.num_kv_heads, cfg.head_dim])
        .transpose(1, 2);
    let v = lin(x, d.v, Proj::V)
        .view([b, t, cfg.num_kv_heads, cfg.head_dim])
        .transpose(1, 2);
    let q = head_norm(cfg, p, d.q_norm, q);
    let k = head_norm(cfg, p, d.k_norm, k);
    let (q, k) = (rope.apply(&q), rope.apply(&k));
    let gqa = cfg.num_kv_heads != cfg.num_heads;
    let o = match attn {
        Attention::Causal => {
            Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, gqa)
        }
        Attention::Varlen(packed) => packed.attend(&q, &k, &v, gqa),
    };
    let o = o
        .transpose(1, 2)
        .reshape([b, t, cfg.num_heads * cfg.head_dim]);
    lin(&o, d.o, Proj::O)
}

/// Qwen3's per-head RMSNorm of q or k (`[B, heads, T, head_dim]`, over `head_dim`) when the layer has one.
fn head_norm(cfg: &ModelConfig, p: &[Tensor], weight: Option<usize>, x: Tensor) -> Tensor {
    match weight {
        Some(w) => rms_norm(&x, &p[w], cfg.rms_norm_eps),
        None => x,
    }
}

/// The MLP's input projections of the normalised `x`: `(gate, up)`.
pub fn mlp_in(d: &DecoderParam, p: &[Tensor], x: &Tensor) -> (Tensor, Tensor) {
    (
        linear(x, p, d.gate, None, d, Proj::Gate),
        linear(x, p, d.up, None, d, Proj::Up),
    )
}

/// The built-in MLP activation, `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    gate.silu() * up
}

/// The MLP's output projection of the activation `m` (the residual is added by the caller).
pub fn mlp_out(d: &DecoderParam, p: &[Tensor], m: &Tensor) -> Tensor {
    linear(m, p, d.down, None, d, Proj::Down)
}

/// The projection `proj` of `x`: `x·Wᵀ + b`, plus `(α/r)·(x·Aᵀ)·Bᵀ` when LoRA adapts it (PEFT's order of ops).
pub fn linear(
    x: &Tensor,
    p: &[Tensor],
    w: usize,
    bias: Option<usize>,
    d: &DecoderParam,
    proj: Proj,
) -> Tensor {
    let y = x.linear(&p[w], bias.map(|i| &p[i]));
    match d.lora.get(proj) {
        Some((a, b)) => {
            let update = x
                .linear(&p[a], None::<&Tensor>)
                .linear(&p[b], None::<&Tensor>);
            y + update * d.lora.scale
        }
        None => y,
    }
}

/// Logits of normalised rows `x` (`[n, H]`) against the output matrix `w` (`[vocab, H]`), in fp32.
pub fn project(x: &Tensor, w: &Tensor) -> Tensor {
    x.linear(w, None::<&Tensor>).to_kind(Kind::Float)
}
