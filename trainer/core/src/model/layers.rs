//! The forward functions of the model, each a pure function of (its parameter tensors, its input): embedding, one
//! decoder layer (RMSNorm, GQA self-attention with RoPE through SDPA, RMSNorm, SwiGLU MLP) and the head (final norm and
//! the output projection of the selected rows). The engine calls them stage by stage; nothing here owns parameters.
//! The layer's pieces ([`attention`], [`mlp_in`], [`swiglu`], [`mlp_out`]) are public so that `model::graph` can run a
//! layer split at ops replaced by kernels, and the attention's own ([`qkv`], [`attention_out`], with
//! [`decoder_layer_with`]) so that generation (`crate::rollout`) runs the same layer over a KV cache.

use super::config::ModelConfig;
use super::layout::DecoderParam;
use super::lora::Proj;
use super::ulysses::SpGroup;
use super::varlen::Varlen;
use tch::{Kind, Tensor};

/// How tokens of one micro-batch may attend to each other.
pub enum Attention {
    /// Right-padded rows: plain causal attention (real tokens never see the padding after them).
    Causal,
    /// Several sequences packed in one row (`[1, T]`), each attending causally to itself only.
    Varlen(Varlen),
    /// This rank's slice of the tokens of a Ulysses sequence-parallel group: attention over the group's whole
    /// sequence (as `whole` says) through two all-to-alls; run by `model::graph` (see `model::ulysses`).
    SequenceParallel(Box<SequenceParallel>),
}

/// Attention of a rank's slice of a sequence-parallel group's tokens.
pub struct SequenceParallel {
    /// The group that shares the sequences.
    pub group: SpGroup,
    /// How the group's whole sequence attends (causal rows, or packed sequences over all its tokens).
    pub whole: Attention,
    /// Each rank's count of target rows, in rank order (the head deals them out evenly: `crate::head_share`).
    pub targets_per_rank: Vec<i64>,
}

impl Attention {
    /// The sequence-parallel group, when attention spans one.
    pub fn sequence_parallel(&self) -> Option<&SequenceParallel> {
        match self {
            Self::SequenceParallel(sp) => Some(sp),
            _ => None,
        }
    }
}

/// Attention of `q` (`[B, heads, T, D]`), `k`, `v` (`[B, kv_heads, T, D]`) over the tokens present (causal rows or
/// packed sequences); `gqa` when there are fewer KV heads than query heads.
///
/// # Panics
/// On [`Attention::SequenceParallel`], whose exchanges can fail and are run by `model::graph` instead.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, attn: &Attention, gqa: bool) -> Tensor {
    match attn {
        Attention::Causal => {
            Tensor::scaled_dot_product_attention(q, k, v, None::<&Tensor>, 0.0, true, None, gqa)
        }
        Attention::Varlen(packed) => packed.attend(q, k, v, gqa),
        Attention::SequenceParallel(_) => {
            panic!("sequence-parallel attention runs through model::graph, not layers::attend")
        }
    }
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
    decoder_layer_with(cfg, d, p, h, |x| attention(cfg, d, p, x, rope, attn))
}

/// One decoder layer on `h` with the built-in ops around `attend`, the attention block of the normalised input
/// (what [`attention`] computes; generation passes one that also reads and extends a KV cache).
pub fn decoder_layer_with(
    cfg: &ModelConfig,
    d: &DecoderParam,
    p: &[Tensor],
    h: &Tensor,
    attend: impl FnOnce(&Tensor) -> Tensor,
) -> Tensor {
    let x = rms_norm(h, &p[d.input_norm], cfg.rms_norm_eps);
    let h = h + attend(&x);
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
    let (q, k, v) = qkv(cfg, d, p, x, rope);
    let o = attend(&q, &k, &v, attn, cfg.num_kv_heads != cfg.num_heads);
    attention_out(cfg, d, p, &o)
}

/// Queries, keys and values of the normalised input `x` (`[B, T, H]`): projected, split into heads
/// (`[B, heads, T, head_dim]`, keys and values with the KV heads), Qwen3's q/k norms applied, then rotated by `rope`.
pub fn qkv(
    cfg: &ModelConfig,
    d: &DecoderParam,
    p: &[Tensor],
    x: &Tensor,
    rope: &Rope,
) -> (Tensor, Tensor, Tensor) {
    let (b, t) = (x.size()[0], x.size()[1]);
    let heads = |(w, bias): (usize, Option<usize>), proj: Proj, n: i64| {
        linear(x, p, w, bias, d, proj)
            .view([b, t, n, cfg.head_dim])
            .transpose(1, 2)
    };
    let q = heads(d.q, Proj::Q, cfg.num_heads);
    let k = heads(d.k, Proj::K, cfg.num_kv_heads);
    let v = heads(d.v, Proj::V, cfg.num_kv_heads);
    let q = head_norm(cfg, p, d.q_norm, q);
    let k = head_norm(cfg, p, d.k_norm, k);
    (rope.apply(&q), rope.apply(&k), v)
}

/// The output projection of the attention's result `o` (`[B, heads, T, head_dim]`), back to `[B, T, H]`.
pub fn attention_out(cfg: &ModelConfig, d: &DecoderParam, p: &[Tensor], o: &Tensor) -> Tensor {
    let (b, t) = (o.size()[0], o.size()[2]);
    let o = o
        .transpose(1, 2)
        .reshape([b, t, cfg.num_heads * cfg.head_dim]);
    linear(&o, p, d.o.0, d.o.1, d, Proj::O)
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
    let y = matmul_t(x, &p[w], bias.map(|i| &p[i]));
    match d.lora.get(proj) {
        Some((a, b)) => {
            let update = matmul_t(&matmul_t(x, &p[a], None), &p[b], None);
            y + update * d.lora.scale
        }
        None => y,
    }
}

/// Rows of `x` up to which [`multiplies_on_the_left`] holds.
const FEW_ROWS: i64 = 64;
/// Inner dimension from which [`multiplies_on_the_left`] holds.
const LEFT_MIN_IN: i64 = 512;

/// Whether [`matmul_t`] computes `x·Wᵀ` as `(W·xᵀ)ᵀ`: for at most [`FEW_ROWS`] rows of at least [`LEFT_MIN_IN`]
/// features on the CPU, when neither tensor needs gradients (a rollout's decode step). MKL's sgemm copies (packs) a
/// right-hand `Wᵀ` on every call, which against a few rows costs about as much as the product, while a left-hand `W`
/// is read in place: 16 rows against one of Qwen2.5-0.5B's MLP matrices take 2.1 → 1.4 ms, against its output
/// matrix 66 → 40 ms (2 threads); with AVX-512 the product runs [`super::skinny`]'s kernel instead of sgemm. With fewer
/// features the products gain little and the transposed result slows the ops after them.
pub fn multiplies_on_the_left(x: &Tensor, w: &Tensor) -> bool {
    let size = x.size();
    let (Some(&features), 2) = (size.last(), w.dim()) else {
        return false;
    };
    let rows: i64 = size[..size.len() - 1].iter().product();
    rows <= FEW_ROWS
        && features >= LEFT_MIN_IN
        && x.device() == tch::Device::Cpu
        && !x.requires_grad()
        && !w.requires_grad()
}

/// `x·Wᵀ + b` for `x` `[.., in]` and `w` `[out, in]`, as `x.linear(w, bias)` computes it, or, where
/// [`multiplies_on_the_left`], as `(W·xᵀ)ᵀ + b` (a transposed view: the same sums, so the same values up to
/// rounding).
pub fn matmul_t(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Tensor {
    if !multiplies_on_the_left(x, w) {
        return x.linear(w, bias);
    }
    let mut size = x.size();
    let features = size.pop().expect("x has a dimension");
    let rows: i64 = size.iter().product();
    size.push(w.size()[0]);
    let y = super::skinny::w_xt(w, &x.reshape([rows, features]))
        .tr()
        .view(size.as_slice());
    match bias {
        Some(b) => y + b,
        None => y,
    }
}

/// Logits of normalised rows `x` (`[n, H]`) against the output matrix `w` (`[vocab, H]`), in fp32.
pub fn project(x: &Tensor, w: &Tensor) -> Tensor {
    x.linear(w, None::<&Tensor>).to_kind(Kind::Float)
}
