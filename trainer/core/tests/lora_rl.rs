//! What RL needs of a LoRA policy, on a tiny model with trained-looking (non-zero) adapters:
//! - a rollout model built from the store merges the adapters into their projections stage by stage and scores as
//!   the engine with adapters does;
//! - an engine with `adapters_off` scores as the base model alone (verl's reference of a LoRA actor), and the
//!   adapters are back on afterwards.

use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::{ModelLayout, Stage};
use ferl_trainer::model::lora::{self, LoraSpec};
use ferl_trainer::model::weights::init_params;
use ferl_trainer::params::LocalParams;
use ferl_trainer::rollout::{RolloutModel, ScoreRequest};
use std::path::Path;
use tch::{Device, Kind, Tensor};

const PROMPT: [i64; 4] = [3, 17, 5, 9];
const RESPONSE: [i64; 5] = [11, 2, 30, 7, 1];

fn config() -> ModelConfig {
    let raw = serde_json::json!({
        "model_type": "qwen2", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 24, "num_hidden_layers": 2, "vocab_size": 37, "tie_word_embeddings": false
    });
    ModelConfig::from_value(raw, Path::new("test")).unwrap()
}

/// The base model's parameters and a LoRA model over them whose `B` matrices are non-zero (as after training).
fn lora_model() -> (ModelLayout, Vec<Tensor>, ModelLayout, Vec<Tensor>) {
    let cfg = config();
    let base = ModelLayout::new(&cfg);
    let params = init_params(&cfg, &base, 7);
    let spec = LoraSpec {
        rank: 4,
        alpha: 8.0,
        targets: vec![lora::ALL_LINEAR.into()],
        exclude: vec![],
    };
    let (layout, mut with) =
        lora::with_adapters(&cfg, base.clone(), copies(&params), &spec, None, 3).unwrap();
    tch::manual_seed(11);
    for (_, _, b) in layout.lora_pairs() {
        with[b] = Tensor::randn(layout.tensors[b].1.as_slice(), (Kind::Float, Device::Cpu)) * 0.3;
    }
    (base, params, layout, with)
}

fn copies(params: &[Tensor]) -> Vec<Tensor> {
    params.iter().map(Tensor::copy).collect()
}

fn engine(layout: ModelLayout, params: Vec<Tensor>) -> Engine<LocalParams> {
    let store = LocalParams::new(layout, params, Kind::Float);
    Engine::new(config(), store, Kind::Float, EngineOptions::default())
}

/// The engine's log-probabilities of the response tokens.
fn engine_log_probs(engine: &mut Engine<LocalParams>) -> Vec<f32> {
    let ids = [&PROMPT[..], &RESPONSE[..]].concat();
    let mask: Vec<bool> = (0..ids.len()).map(|t| t >= PROMPT.len()).collect();
    let sample = SampleRef {
        input_ids: &ids,
        loss_mask: &mask,
    };
    let mb = MicroBatch::new(&[sample], Layout::Padded, Device::Cpu).unwrap();
    let stats = engine.token_stats(&mb, false).unwrap();
    Vec::<f32>::try_from(stats.log_prob.reshape([-1])).unwrap()
}

fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_rollout_of_a_lora_store_merges_the_adapters_and_scores_as_the_engine() {
    let (_, _, layout, params) = lora_model();
    let mut e = engine(layout, params);
    let want = engine_log_probs(&mut e);
    let rollout = RolloutModel::from_store(config(), e.store_mut(), Kind::Float).unwrap();
    let request = ScoreRequest {
        prompt: &PROMPT,
        response: &RESPONSE,
    };
    let got = rollout.score(&[request], 1.0, false).unwrap().remove(0);
    let diff = largest_difference(&want, &got.log_probs);
    assert!(
        diff < 1e-5,
        "merged rollout vs engine with adapters: {diff}"
    );
}

/// `merge_stage` leaves a decoder stage of base tensors only, equal to [`lora::merge`] of the whole model.
#[test]
fn a_merged_stage_holds_the_base_tensors_with_the_adapters_folded_in() {
    let (base, _, layout, params) = lora_model();
    let merged = lora::merge(&layout, &params);
    let ids = layout.stage_ids(Stage::Decoder(1)).unwrap();
    let mut stage: Vec<Tensor> = ids.iter().map(|&i| params[i].copy()).collect();
    let slots = lora::merge_stage(&layout.decoder, &mut stage);
    assert!(slots.lora.is_empty());
    let base_ids = base.stage_ids(Stage::Decoder(1)).unwrap();
    assert_eq!(stage.len(), base_ids.len());
    for (t, &i) in stage.iter().zip(base_ids) {
        let diff = (t - &merged[i]).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{}: {diff}", base.tensors[i].0);
    }
}

#[test]
fn adapters_off_scores_as_the_base_model_and_only_while_set() {
    let (base_layout, base_params, layout, params) = lora_model();
    let base = engine_log_probs(&mut engine(base_layout, base_params));
    let mut e = engine(layout, params);
    let with = engine_log_probs(&mut e);
    // The adapters matter: otherwise the checks below would prove nothing.
    assert!(largest_difference(&base, &with) > 1e-3);
    e.options_mut().adapters_off = true;
    let off = engine_log_probs(&mut e);
    assert!(
        largest_difference(&base, &off) < 1e-6,
        "adapters off vs base"
    );
    e.options_mut().adapters_off = false;
    assert_eq!(engine_log_probs(&mut e), with);
}
