//! The digit task of the GRPO tests (`trainer/rl/tests/grpo_learns.rs`, `actors/tests/grpo_actors.rs`): a tiny
//! random Qwen2 (vocabulary 16: pad 0, BOS 1, EOS 2, digits 3..=12) prompted with `[BOS, d]`, twice per digit and
//! step, earning 1 when the first token of its response is `d` (else 0), with the settings that learn it.

use ferl_rl::{
    ActorLossConfig, ClipConfig, FnReward, GrpoPrompt, GrpoSettings, GrpoStepOutput, GrpoTrainer,
    KlPenalty, LossAggMode, MicroBatching, Reward, RewardRow,
};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::model::{init_model, load_model};
use ferl_trainer::params::LocalParams;
use std::path::{Path, PathBuf};
use tch::Kind;

/// The prompts' first token.
pub(crate) const BOS: i64 = 1;
/// The token that ends a response.
pub(crate) const EOS: i64 = 2;
/// The digit tokens.
pub(crate) const DIGITS: std::ops::RangeInclusive<i64> = 3..=12;
/// Steps within which the mean reward must reach 0.8.
pub(crate) const MAX_STEPS: usize = 30;

/// The tiny model as a Hugging Face folder under `dir`.
pub(crate) fn model_dir(dir: &Path) -> PathBuf {
    let config = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "initializer_range": 0.02, "bos_token_id": BOS, "eos_token_id": EOS, "dtype": "float32"
    });
    let file = dir.join("config.json");
    std::fs::write(&file, config.to_string()).unwrap();
    let out = dir.join("model");
    init_model(&file, None, &out, 7).unwrap();
    out
}

/// n = 8 at temperature 1, fp32, lr 3e-3, 2 PPO epochs of 4 mini-batches, a KL loss to the initial weights.
pub(crate) fn settings() -> GrpoSettings {
    GrpoSettings {
        n: 8,
        temperature: 1.0,
        seed: 42,
        max_response_length: 3,
        eos_token_ids: vec![EOS],
        pad_token_id: 0,
        ppo_mini_batch_size: 5, // four optimizer steps per epoch
        ppo_micro_batching: MicroBatching::Rows(16),
        log_prob_micro_batching: MicroBatching::Rows(40),
        ref_log_prob_micro_batching: MicroBatching::Rows(40),
        ppo_epochs: 2,
        shuffle: true,
        loss: ActorLossConfig {
            policy: ClipConfig {
                clip_ratio: 0.2,
                clip_ratio_low: Some(0.2),
                clip_ratio_high: Some(0.28),
                clip_ratio_c: 3.0,
            },
            loss_agg_mode: LossAggMode::TokenMean,
            entropy_coeff: 0.0,
            use_kl_loss: true,
            kl_loss_coef: 0.001,
            kl_loss_type: (KlPenalty::LowVarKl, false),
        },
        lr: 3e-3,
        optim: ferl_trainer::optim::AdamWConfig {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        },
        grad_clip: 1.0,
        ..GrpoSettings::default()
    }
}

/// 1 when the response's first token is the prompt's digit.
pub(crate) fn reward() -> Box<dyn Reward> {
    Box::new(FnReward::new("echo_digit", |r: &RewardRow<'_>| {
        f64::from(r.response_ids.first() == r.prompt_ids.get(1))
    }))
}

/// Each digit twice.
pub(crate) fn prompts() -> Vec<GrpoPrompt> {
    DIGITS
        .flat_map(|d| [d, d])
        .map(|d| GrpoPrompt {
            ids: vec![BOS, d],
            ground_truth: d.to_string(),
            ..GrpoPrompt::default()
        })
        .collect()
}

/// A fresh one-process trainer of the initial weights in `model` with `settings`.
pub(crate) fn one_process(model: &Path, settings: GrpoSettings) -> GrpoTrainer<LocalParams> {
    let loaded = load_model(model).unwrap();
    let store = LocalParams::new(loaded.layout.clone(), loaded.params, Kind::Float);
    let engine = Engine::new(loaded.config, store, Kind::Float, EngineOptions::default());
    GrpoTrainer::new(settings, engine, reward()).unwrap()
}

/// Two outputs of the same step agree: responses, rewards and every metric but timings and sync figures (within
/// 1e-6). Returns the largest metric difference.
pub(crate) fn assert_same_step(a: &GrpoStepOutput, b: &GrpoStepOutput, what: &str) -> f64 {
    let responses = |o: &GrpoStepOutput| -> Vec<Vec<i64>> {
        o.batch.rows.iter().map(|r| r.response.clone()).collect()
    };
    assert_eq!(a.step, b.step, "{what}");
    assert_eq!(responses(a), responses(b), "{what}: responses differ");
    assert_eq!(a.batch.rewards, b.batch.rewards, "{what}: rewards differ");
    let mut worst = 0.0f64;
    for (k, v) in &a.metrics {
        if k.starts_with("timing_s/") || k.starts_with("perf/") {
            continue;
        }
        let w = b
            .metrics
            .get(k)
            .unwrap_or_else(|| panic!("{what}: no metric {k}"));
        assert!((v - w).abs() <= 1e-6, "{what}: {k}: {v} vs {w}");
        worst = worst.max((v - w).abs());
    }
    worst
}
