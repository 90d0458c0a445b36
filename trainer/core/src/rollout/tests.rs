//! Generation on a model wide enough (hidden size 512) for the decode step's left-multiplied projections
//! ([`crate::model::layers::multiplies_on_the_left`]), with prompts of different lengths (the packed prefill of
//! [`super::prefill`]): greedy (the fused [`super::greedy`] choice) and sampled (the transposed logits of
//! [`super::head`]), the rollout's log-probabilities equal one-pass scoring's, and under greedy decoding each prompt
//! alone gets what it gets in the batch.

use super::{GenerationConfig, RolloutModel, SamplingParams, ScoreRequest};
use crate::model::init_model;
use tch::{Device, Kind};

const TOLERANCE: f64 = 1e-5;

/// A random Qwen2 (biased q/k/v projections) of hidden size 512 written to `dir`.
fn wide_model(dir: &std::path::Path) -> RolloutModel {
    let config = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 640, "hidden_size": 512, "intermediate_size": 1024,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true,
        "initializer_range": 0.02, "dtype": "float32"
    });
    let file = dir.join("config.json");
    std::fs::write(&file, config.to_string()).unwrap();
    init_model(&file, None, &dir.join("model"), 7).unwrap();
    RolloutModel::load(&dir.join("model"), Device::Cpu, Kind::Float).unwrap()
}

/// Largest absolute difference between two lists of values.
fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
}

/// Each generated response's log-probabilities equal one-pass scoring's at `temperature`, within [`TOLERANCE`].
fn assert_rollout_equals_scoring(
    model: &RolloutModel,
    prompts: &[Vec<i64>],
    generated: &[super::Generated],
    temperature: f64,
) {
    let requests: Vec<ScoreRequest<'_>> = prompts
        .iter()
        .zip(generated)
        .map(|(p, g)| ScoreRequest {
            prompt: p,
            response: &g.response,
        })
        .collect();
    let scores = model.score(&requests, temperature, false).unwrap();
    for (i, (g, s)) in generated.iter().zip(&scores).enumerate() {
        assert_eq!(g.len(), 16);
        let d = max_diff(&g.log_probs, &s.log_probs);
        assert!(
            d <= TOLERANCE,
            "prompt {i} at T {temperature}: rollout vs scoring log-probs differ by {d}"
        );
    }
}

#[test]
fn a_wide_model_generates_what_scoring_and_single_prompts_give() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model = wide_model(dir.path());
    let prompts: Vec<Vec<i64>> = (0..6)
        .map(|i| {
            (0..(2 + 3 * i))
                .map(|t| (7 * i + 5 * t + 1) % 600)
                .collect()
        })
        .collect();
    let sampled = GenerationConfig::new(16, SamplingParams::sample(0.7, 3));
    let sampled_rows = model.generate(&prompts, &sampled).unwrap();
    assert_rollout_equals_scoring(&model, &prompts, &sampled_rows, 0.7);
    let config = GenerationConfig::new(16, SamplingParams::default());
    let batched = model.generate(&prompts, &config).unwrap();
    assert_ne!(batched, sampled_rows, "greedy and sampled decoding differ");
    assert_rollout_equals_scoring(&model, &prompts, &batched, 1.0);
    for (i, g) in batched.iter().enumerate() {
        let alone = model
            .generate(std::slice::from_ref(&prompts[i]), &config)
            .unwrap();
        assert_eq!(
            alone[0].response, g.response,
            "prompt {i}: alone vs batched"
        );
        let d = max_diff(&alone[0].log_probs, &g.log_probs);
        assert!(
            d <= TOLERANCE,
            "prompt {i}: alone vs batched log-probs differ by {d}"
        );
    }
}
