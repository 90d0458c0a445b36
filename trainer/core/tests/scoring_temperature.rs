//! The engine's temperature (`Engine::set_temperature`): every log-probability is `log_softmax(logits / T)`, as verl
//! recomputes `old_log_prob` with the rollout temperature.
//! - `Engine::token_stats` at T = 0.7 equals `RolloutModel::score` of the same weights at T = 0.7 (log-probabilities
//!   and entropies within 1e-5).
//! - The gradient at T = 0.7 through the whole engine (a loss of the log-probabilities and entropies, the two-pass
//!   path of RL losses): dividing the logits by T is the same as dividing the (untied) output matrix `W` by T, so the
//!   gradients at (T, W) equal those at (1, W / T) for every other parameter and `1 / T` times them for `W` (within
//!   1e-4 relative). The hand-written backward at T is checked against autograd in `head.rs`'s unit tests.
//! - T = 1 set explicitly gives bit-identical log-probabilities and gradients to an engine never given one.

use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::loss::AutogradTokenLoss;
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::weights::init_params;
use ferl_trainer::params::{LocalParams, ParamStore};
use ferl_trainer::rollout::{RolloutModel, ScoreRequest};
use tch::{Device, Kind, Tensor};

const T: f64 = 0.7;
const VOCAB: i64 = 97;

fn config() -> ModelConfig {
    let raw = serde_json::json!({
        "model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "initializer_range": 0.2
    });
    ModelConfig::from_value(raw, std::path::Path::new("tiny.json")).unwrap()
}

/// An engine over seeded weights, with the output matrix divided by `head_scale`.
fn engine(head_scale: f64) -> Engine<LocalParams> {
    let cfg = config();
    let layout = ModelLayout::new(&cfg);
    let mut params = init_params(&cfg, &layout, 5);
    let head = layout
        .tensors
        .iter()
        .position(|(name, _)| name == "lm_head.weight")
        .expect("an untied output matrix");
    params[head] = &params[head] / head_scale;
    let store = LocalParams::new(layout, params, Kind::Float);
    let opts = EngineOptions {
        gradient_checkpointing: false,
        logits_chunk_elements: 3 * VOCAB, // several chunks per micro-batch
        ..Default::default()
    };
    Engine::new(cfg, store, Kind::Float, opts)
}

/// (prompt, response) pairs of different lengths.
fn sequences() -> Vec<(Vec<i64>, Vec<i64>)> {
    [(4usize, 5usize), (2, 3), (5, 7)]
        .iter()
        .enumerate()
        .map(|(s, &(p, r))| {
            let tok = |i: usize| ((i * 7 + s * 13 + 3) % VOCAB as usize) as i64;
            ((0..p).map(tok).collect(), (p..p + r).map(tok).collect())
        })
        .collect()
}

fn micro_batch() -> MicroBatch {
    let owned: Vec<(Vec<i64>, Vec<bool>)> = sequences()
        .into_iter()
        .map(|(p, r)| {
            let mask = (0..p.len() + r.len()).map(|t| t >= p.len()).collect();
            ([p, r].concat(), mask)
        })
        .collect();
    let refs: Vec<SampleRef> = owned
        .iter()
        .map(|(input_ids, loss_mask)| SampleRef {
            input_ids,
            loss_mask,
        })
        .collect();
    MicroBatch::new(&refs, Layout::Padded, Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn token_stats_at_a_temperature_equal_the_rollout_models_scores() {
    tch::set_num_threads(1);
    let mut e = engine(1.0);
    let mb = micro_batch();
    e.set_temperature(T).unwrap();
    assert_eq!(e.temperature(), T);
    let stats = e.token_stats(&mb, true).unwrap();
    let rollout = RolloutModel::from_store(config(), e.store_mut(), Kind::Float).unwrap();
    let seqs = sequences();
    let reqs: Vec<ScoreRequest> = seqs
        .iter()
        .map(|(prompt, response)| ScoreRequest { prompt, response })
        .collect();
    let scores = rollout.score(&reqs, T, true).unwrap();
    let flat = |f: fn(&ferl_trainer::rollout::TokenScores) -> &Vec<f32>| {
        Tensor::from_slice(
            &scores
                .iter()
                .flat_map(|s| f(s).clone())
                .collect::<Vec<f32>>(),
        )
    };
    let lp = max_diff(&stats.log_prob, &flat(|s| &s.log_probs));
    let ent = max_diff(stats.entropy.as_ref().unwrap(), &flat(|s| &s.entropy));
    println!("T {T}: token_stats vs RolloutModel::score: log-prob {lp:e}, entropy {ent:e}");
    assert!(lp < 1e-5 && ent < 1e-5, "log-prob {lp}, entropy {ent}");
    // And they are not T = 1's.
    e.set_temperature(1.0).unwrap();
    let at_one = e.token_stats(&mb, false).unwrap();
    assert!(max_diff(&at_one.log_prob, &stats.log_prob) > 1e-2);
}

/// The value and every gradient of a loss of log-probabilities and entropies with fixed random weights.
fn grads(e: &mut Engine<LocalParams>, mb: &MicroBatch) -> (f64, Vec<Tensor>) {
    let n = mb.num_targets;
    let (a, b) = ferl_trainer::model::weights::seeded(9, || {
        (
            Tensor::randn([n], (Kind::Float, Device::Cpu)),
            Tensor::randn([n], (Kind::Float, Device::Cpu)),
        )
    });
    let loss = AutogradTokenLoss::new(
        |lp: &Tensor, h: Option<&Tensor>| {
            Ok((lp * &a).sum(Kind::Float) + (h.unwrap() * &b).sum(Kind::Float) * 0.3)
        },
        true,
    );
    e.store_mut().zero_grads();
    let value = e.forward_backward_with(mb, &loss).unwrap();
    let (_, g) = e.store_mut().master_and_grads();
    (value, g.iter().map(Tensor::copy).collect())
}

#[test]
fn gradients_at_a_temperature_are_those_of_the_output_matrix_divided_by_it() {
    tch::set_num_threads(1);
    let mb = micro_batch();
    let mut hot = engine(1.0);
    hot.set_temperature(T).unwrap();
    let (value, g_hot) = grads(&mut hot, &mb);
    let mut scaled = engine(T);
    let (value_scaled, g_scaled) = grads(&mut scaled, &mb);
    let head = hot
        .store()
        .layout()
        .tensors
        .iter()
        .position(|(name, _)| name == "lm_head.weight")
        .unwrap();
    assert!((value - value_scaled).abs() <= 1e-5 * value.abs().max(1.0));
    let mut worst = 0.0f64;
    for (i, (g, s)) in g_hot.iter().zip(&g_scaled).enumerate() {
        let want = if i == head { s / T } else { s.shallow_clone() };
        let rel = (g - &want).norm().double_value(&[]) / want.norm().double_value(&[]).max(1e-12);
        worst = worst.max(rel);
        assert!(rel < 1e-4, "tensor {i}: gradient off by {rel} (relative)");
    }
    println!(
        "T {T}: worst relative gradient difference {worst:e} over {} tensors",
        g_hot.len()
    );
    // T = 1 set explicitly: bit-identical to an engine never given a temperature.
    let mut plain = engine(1.0);
    let (v0, g0) = grads(&mut plain, &mb);
    hot.set_temperature(1.0).unwrap();
    let (v1, g1) = grads(&mut hot, &mb);
    assert_eq!(v0, v1);
    assert!(g0.iter().zip(&g1).all(|(a, b)| a.equal(b)));
    let s0 = plain.token_stats(&mb, true).unwrap();
    let s1 = hot.token_stats(&mb, true).unwrap();
    assert!(s0.log_prob.equal(&s1.log_prob));
    assert!(s0.entropy.unwrap().equal(&s1.entropy.unwrap()));
}
