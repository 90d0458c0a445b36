//! Packed attention (`Attention::Varlen`) against the dense block-diagonal causal mask it replaced (a test-only
//! reference here), and a packed decoder layer against each sequence run alone: forward, input and parameter
//! gradients, fp32, on random packed layouts that include length-1 sequences and one sequence filling the row.

use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layers::{decoder_layer, Attention, Rope};
use ferl_trainer::model::layout::{ModelLayout, Stage};
use ferl_trainer::model::varlen::Varlen;
use ferl_trainer::model::weights::init_params;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};

const TOL: f64 = 1e-5;
const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

/// The old path: a `[1, 1, T, T]` mask, true where a token may attend (same sequence, not after it).
fn dense_mask(lens: &[i64]) -> Tensor {
    let seg: Vec<i64> = lens
        .iter()
        .enumerate()
        .flat_map(|(i, &l)| std::iter::repeat_n(i as i64, l as usize))
        .collect();
    let t = seg.len() as i64;
    let seg = Tensor::from_slice(&seg);
    let same = seg.unsqueeze(1).eq_tensor(&seg.unsqueeze(0));
    let causal = Tensor::ones([t, t], (Kind::Bool, Device::Cpu)).tril(0);
    same.logical_and(&causal).view([1, 1, t, t])
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Random packed layouts: lengths 1..=12 with length-1 sequences mixed in, plus one sequence filling the row.
fn layouts() -> Vec<Vec<i64>> {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let mut out: Vec<Vec<i64>> = (0..12)
        .map(|_| {
            let n = rng.random_range(1..8);
            (0..n)
                .map(|_| match rng.random_bool(0.3) {
                    true => 1,
                    false => rng.random_range(1..=12),
                })
                .collect()
        })
        .collect();
    out.extend([
        vec![29],
        vec![1],
        vec![1, 1, 1],
        vec![4, 4, 4],
        vec![7, 1, 7, 1],
    ]);
    out
}

/// `(output, dq, dk, dv)` of `attend` on leaves `q`, `k`, `v` for the output gradient `dy`.
fn run(
    attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
    qkv: [&Tensor; 3],
    dy: &Tensor,
) -> [Tensor; 4] {
    let [q, k, v] = qkv.map(|t| t.detach().set_requires_grad(true));
    let o = attend(&q, &k, &v);
    let g = Tensor::run_backward(&[(&o * dy).sum(Kind::Float)], &[&q, &k, &v], false, false);
    [
        o.detach(),
        g[0].shallow_clone(),
        g[1].shallow_clone(),
        g[2].shallow_clone(),
    ]
}

#[test]
fn varlen_attention_equals_the_dense_block_diagonal_mask() {
    tch::manual_seed(0);
    let mut worst = 0f64;
    for lens in layouts() {
        let t: i64 = lens.iter().sum();
        for (heads, kv_heads) in [(4, 2), (2, 2)] {
            let gqa = heads != kv_heads;
            let q = Tensor::randn([1, heads, t, 8], CPU);
            let k = Tensor::randn([1, kv_heads, t, 8], CPU);
            let v = Tensor::randn([1, kv_heads, t, 8], CPU);
            let dy = Tensor::randn([1, heads, t, 8], CPU);
            let varlen = Varlen::new(&lens, Device::Cpu).unwrap();
            let mask = dense_mask(&lens);
            let ours = run(|q, k, v| varlen.attend(q, k, v, gqa), [&q, &k, &v], &dy);
            let reference = run(
                |q, k, v| {
                    Tensor::scaled_dot_product_attention(
                        q,
                        k,
                        v,
                        Some(&mask),
                        0.0,
                        false,
                        None,
                        gqa,
                    )
                },
                [&q, &k, &v],
                &dy,
            );
            for (name, a, b) in ["output", "dq", "dk", "dv"]
                .iter()
                .zip(&ours)
                .zip(&reference)
                .map(|((n, a), b)| (n, a, b))
            {
                assert_eq!(a.size(), b.size(), "{lens:?} {name}");
                let d = max_diff(a, b);
                assert!(
                    d < TOL,
                    "lengths {lens:?}, heads {heads}/{kv_heads}: {name} differs by {d}"
                );
                worst = worst.max(d);
            }
        }
    }
    println!("largest difference to the dense mask: {worst:e} (tolerance {TOL:e})");
}

/// A one-layer Qwen2 with GQA (4 heads, 2 kv heads).
fn tiny() -> (ModelConfig, ModelLayout, Vec<Tensor>) {
    let raw = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 40,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true
    });
    let cfg = ModelConfig::from_value(raw, std::path::Path::new("tiny.json")).unwrap();
    let layout = ModelLayout::new(&cfg);
    let all = init_params(&cfg, &layout, 3);
    let params = layout
        .stage_ids(Stage::Decoder(0))
        .unwrap()
        .iter()
        .map(|&i| &all[i] + 0.05)
        .collect();
    (cfg, layout, params)
}

/// `(output, d input, d params)` of the decoder layer on `h` (`[B, T, 16]`) at `positions`.
fn layer(
    (cfg, layout, params): &(ModelConfig, ModelLayout, Vec<Tensor>),
    h: &Tensor,
    positions: &Tensor,
    attn: &Attention,
    dy: &Tensor,
) -> (Tensor, Tensor, Vec<Tensor>) {
    let p: Vec<Tensor> = params
        .iter()
        .map(|t| t.detach().set_requires_grad(true))
        .collect();
    let h = h.detach().set_requires_grad(true);
    let rope = Rope::new(cfg, positions, Kind::Float);
    let out = decoder_layer(cfg, &layout.decoder, &p, &h, &rope, attn);
    let mut inputs = vec![&h];
    inputs.extend(p.iter());
    let mut g = Tensor::run_backward(&[(&out * dy).sum(Kind::Float)], &inputs, false, false);
    let dp = g.split_off(1);
    (out.detach(), g.remove(0), dp)
}

#[test]
fn a_packed_decoder_layer_equals_each_sequence_alone() {
    tch::manual_seed(1);
    let model = tiny();
    let mut worst = 0f64;
    for lens in layouts() {
        let t: i64 = lens.iter().sum();
        let h = Tensor::randn([1, t, 16], CPU);
        let dy = Tensor::randn([1, t, 16], CPU);
        let ids: Vec<Vec<i64>> = lens.iter().map(|&l| vec![1; l as usize]).collect();
        let masks: Vec<Vec<bool>> = lens.iter().map(|&l| vec![true; l as usize]).collect();
        let samples: Vec<SampleRef> = ids
            .iter()
            .zip(&masks)
            .map(|(i, m)| SampleRef {
                input_ids: i,
                loss_mask: m,
            })
            .collect();
        let mb = MicroBatch::new(&samples, Layout::Packed, Device::Cpu).unwrap();
        let Attention::Varlen(v) = &mb.attention else {
            panic!("a packed micro-batch attends by sequence lengths")
        };
        assert_eq!(
            v.cu_seqlens(),
            ferl_trainer::model::varlen::cu_seqlens(&lens)
        );
        let (out, dh, dp) = layer(&model, &h, &mb.positions, &mb.attention, &dy);
        let mut dp_alone: Vec<Tensor> = dp.iter().map(Tensor::zeros_like).collect();
        let mut off = 0;
        for &l in &lens {
            let part = |x: &Tensor| x.narrow(1, off, l);
            let pos = Tensor::arange(l, (Kind::Int64, Device::Cpu)).unsqueeze(0);
            let (o, d, g) = layer(&model, &part(&h), &pos, &Attention::Causal, &part(&dy));
            let what = format!("lengths {lens:?}, sequence at {off}");
            for (name, a, b) in [("output", &o, &part(&out)), ("d input", &d, &part(&dh))] {
                let diff = max_diff(a, b);
                assert!(diff < TOL, "{what}: {name} differs by {diff}");
                worst = worst.max(diff);
            }
            for (acc, g) in dp_alone.iter_mut().zip(&g) {
                *acc += g;
            }
            off += l;
        }
        for (i, (a, b)) in dp.iter().zip(&dp_alone).enumerate() {
            let diff = max_diff(a, b);
            assert!(
                diff < TOL,
                "lengths {lens:?}: parameter {i} gradient differs by {diff}"
            );
            worst = worst.max(diff);
        }
    }
    println!("largest difference to each sequence alone: {worst:e} (tolerance {TOL:e})");
}
