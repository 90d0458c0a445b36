//! Which named tensors make up each stage of the model (embedding, decoder layers, head), in the order the layer
//! functions of `model::layers` take them. The stage list is what the engine walks and what sharding hooks into.

use super::config::ModelConfig;
use super::lora::LoraSlots;

/// One unit of the layer-wise schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Token embedding: `[embed]`.
    Embedding,
    /// Decoder layer `i`: see [`DecoderParam`] for the order.
    Decoder(usize),
    /// Final RMSNorm and output projection: `[norm, lm_head]` (`lm_head` is the embedding when tied).
    Head,
}

/// Index of each tensor inside a decoder stage's parameter list (biases only when the config has them).
#[derive(Clone, Copy, Debug)]
pub struct DecoderParam {
    /// input_layernorm.weight
    pub input_norm: usize,
    /// q_proj.weight, q_proj.bias
    pub q: (usize, Option<usize>),
    /// k_proj.weight, k_proj.bias
    pub k: (usize, Option<usize>),
    /// v_proj.weight, v_proj.bias
    pub v: (usize, Option<usize>),
    /// o_proj.weight, o_proj.bias
    pub o: (usize, Option<usize>),
    /// self_attn.q_norm.weight (Qwen3's per-head RMSNorm of q)
    pub q_norm: Option<usize>,
    /// self_attn.k_norm.weight (Qwen3's per-head RMSNorm of k)
    pub k_norm: Option<usize>,
    /// post_attention_layernorm.weight
    pub post_norm: usize,
    /// mlp.gate_proj.weight
    pub gate: usize,
    /// mlp.up_proj.weight
    pub up: usize,
    /// mlp.down_proj.weight
    pub down: usize,
    /// LoRA adapters of the projections (none unless [`ModelLayout::add_lora`] ran).
    pub lora: LoraSlots,
}

/// The named tensors of the whole model and the stages that use them.
#[derive(Clone, Debug)]
pub struct ModelLayout {
    /// Hugging Face names and shapes of every stored tensor, each once (the tied head is not listed).
    pub tensors: Vec<(String, Vec<i64>)>,
    /// Per stage: indices into `tensors`, in the order the stage's function takes them.
    pub stages: Vec<(Stage, Vec<usize>)>,
    /// Positions inside a decoder stage's list.
    pub decoder: DecoderParam,
    /// Per tensor: whether training updates it (all true, except the frozen base of a LoRA model).
    pub trainable: Vec<bool>,
}

impl ModelLayout {
    /// The layout of a model with `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let mut tensors: Vec<(String, Vec<i64>)> = Vec::new();
        let push = |tensors: &mut Vec<(String, Vec<i64>)>, name: String, shape: Vec<i64>| {
            tensors.push((name, shape));
            tensors.len() - 1
        };
        let mut stages = Vec::new();
        let embed = push(&mut tensors, "model.embed_tokens.weight".into(), vec![v, h]);
        stages.push((Stage::Embedding, vec![embed]));
        let mut decoder = None;
        for l in 0..cfg.num_layers {
            let (params, ids) = decoder_layer(cfg, l, &mut tensors);
            decoder = Some(params);
            stages.push((Stage::Decoder(l), ids));
        }
        let norm = push(&mut tensors, "model.norm.weight".into(), vec![h]);
        let head = if cfg.tie_word_embeddings {
            embed
        } else {
            push(&mut tensors, "lm_head.weight".into(), vec![v, h])
        };
        stages.push((Stage::Head, vec![norm, head]));
        let decoder = decoder.unwrap_or(DecoderParam {
            input_norm: 0,
            q: (0, None),
            k: (0, None),
            v: (0, None),
            o: (0, None),
            q_norm: None,
            k_norm: None,
            post_norm: 0,
            gate: 0,
            up: 0,
            down: 0,
            lora: LoraSlots::default(),
        });
        let trainable = vec![true; tensors.len()];
        Self {
            tensors,
            stages,
            decoder,
            trainable,
        }
    }

    /// The indices into [`ModelLayout::tensors`] of `stage`'s tensors, in the stage's order (an error names a stage
    /// the layout lacks).
    pub fn stage_ids(&self, stage: Stage) -> anyhow::Result<&[usize]> {
        self.stages
            .iter()
            .find(|(s, _)| *s == stage)
            .map(|(_, ids)| ids.as_slice())
            .ok_or_else(|| anyhow::anyhow!("the layout has no stage {stage:?}"))
    }

    /// Total number of stored parameters.
    pub fn num_params(&self) -> i64 {
        self.tensors
            .iter()
            .map(|(_, s)| s.iter().product::<i64>())
            .sum()
    }
}

/// Appends the tensors of decoder layer `l` of a model with `cfg` to `tensors`; returns the positions inside the
/// layer's list and the layer's list of indices into `tensors`.
fn decoder_layer(
    cfg: &ModelConfig,
    l: usize,
    tensors: &mut Vec<(String, Vec<i64>)>,
) -> (DecoderParam, Vec<usize>) {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let q_out = cfg.num_heads * cfg.head_dim;
    let kv_out = cfg.num_kv_heads * cfg.head_dim;
    let p = format!("model.layers.{l}.");
    let mut ids = Vec::new();
    let mut add = |ids: &mut Vec<usize>, name: String, shape: Vec<i64>| {
        tensors.push((name, shape));
        ids.push(tensors.len() - 1);
        ids.len() - 1
    };
    let input_norm = add(&mut ids, format!("{p}input_layernorm.weight"), vec![h]);
    let mut proj = |ids: &mut Vec<usize>, n: &str, out: i64, inp: i64, bias: bool| {
        let w = add(ids, format!("{p}self_attn.{n}.weight"), vec![out, inp]);
        let b = bias.then(|| add(ids, format!("{p}self_attn.{n}.bias"), vec![out]));
        (w, b)
    };
    let q = proj(&mut ids, "q_proj", q_out, h, cfg.qkv_bias);
    let k = proj(&mut ids, "k_proj", kv_out, h, cfg.qkv_bias);
    let vv = proj(&mut ids, "v_proj", kv_out, h, cfg.qkv_bias);
    let o = proj(&mut ids, "o_proj", h, q_out, cfg.o_bias);
    let mut head_norm = |ids: &mut Vec<usize>, n: &str| {
        let shape = vec![cfg.head_dim];
        cfg.qk_norm
            .then(|| add(ids, format!("{p}self_attn.{n}.weight"), shape))
    };
    let (q_norm, k_norm) = (head_norm(&mut ids, "q_norm"), head_norm(&mut ids, "k_norm"));
    let post_norm = add(
        &mut ids,
        format!("{p}post_attention_layernorm.weight"),
        vec![h],
    );
    let gate = add(&mut ids, format!("{p}mlp.gate_proj.weight"), vec![i, h]);
    let up = add(&mut ids, format!("{p}mlp.up_proj.weight"), vec![i, h]);
    let down = add(&mut ids, format!("{p}mlp.down_proj.weight"), vec![h, i]);
    let params = DecoderParam {
        input_norm,
        q,
        k,
        v: vv,
        o,
        q_norm,
        k_norm,
        post_norm,
        gate,
        up,
        down,
        lora: LoraSlots::default(),
    };
    (params, ids)
}
