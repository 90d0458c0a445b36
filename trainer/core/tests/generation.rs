//! Generation and scoring (issue 14, items 1 and 2) against transformers 5.24 and against themselves.
//!
//! With the venv (`py/generation_reference.py session`): tiny random Qwen2, Llama (with `llama3` RoPE scaling) and
//! Qwen3 (q/k norms) models, 16 prompts of 3 to 24 tokens, 64 new tokens. ferl's batched greedy generation (left-padded, KV cache) must equal transformers'
//! `generate(do_sample=False)` of each prompt alone token for token, with an EOS token chosen so that about half of
//! the prompts stop early (both stop at it and keep it); a rollout's log-probabilities must equal ferl's one-pass
//! scoring of the same tokens within 1e-5, and the scoring's log-probabilities and entropies transformers' within
//! 1e-5 (greedy at T = 1 and a top-k/top-p sample at T = 0.8).
//!
//! Without Python (a model made by `model::init_model`): seeded sampling is reproducible, a batch gives each
//! sequence what it gets alone, EOS stops one sequence only, a store snapshot generates like the folder, and on a
//! machine with CUDA the GPU generates what the CPU does.

mod common;

use common::*;
use ferl_trainer::model::{init_model, load_model};
use ferl_trainer::params::LocalParams;
use ferl_trainer::rollout::{
    Generated, GenerationConfig, RolloutModel, SamplingParams, ScoreRequest, TokenScores,
};
use serde_json::Value;
use std::path::Path;
use std::time::Instant;
use tch::{Device, Kind};

const NEW_TOKENS: usize = 64;
const TOLERANCE: f64 = 1e-5;

fn read_json(file: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn requests<'a>(prompts: &'a [Vec<i64>], out: &'a [Generated]) -> Vec<ScoreRequest<'a>> {
    prompts
        .iter()
        .zip(out)
        .map(|(prompt, g)| ScoreRequest {
            prompt,
            response: &g.response,
        })
        .collect()
}

/// Largest |a - b| over all tokens of all sequences (lengths must match).
fn max_diff<'a>(
    a: impl IntoIterator<Item = &'a [f32]>,
    b: impl IntoIterator<Item = &'a [f32]>,
) -> f64 {
    let mut worst = 0.0f64;
    for (x, y) in a.into_iter().zip(b) {
        assert_eq!(x.len(), y.len(), "token counts differ");
        for (p, q) in x.iter().zip(y) {
            assert!(p.is_finite() && q.is_finite(), "non-finite value");
            worst = worst.max((*p as f64 - *q as f64).abs());
        }
    }
    worst
}

/// The rollout's log-probabilities against ferl's one-pass scoring of the same tokens; returns the scores.
fn check_rollout_against_scoring(
    name: &str,
    model: &RolloutModel,
    prompts: &[Vec<i64>],
    out: &[Generated],
    temperature: f64,
) -> Vec<TokenScores> {
    let scores = model
        .score(&requests(prompts, out), temperature, true)
        .unwrap();
    let diff = max_diff(
        out.iter().map(|g| g.log_probs.as_slice()),
        scores.iter().map(|s| s.log_probs.as_slice()),
    );
    println!("{name}: rollout vs scoring log-probs max diff {diff:e} (T {temperature})");
    assert!(
        diff <= TOLERANCE,
        "{name}: rollout log-probs differ from scoring by {diff}"
    );
    scores
}

/// ferl's scores against transformers' (`score` request of the session) for the same tokens.
fn check_scores_against_transformers(
    name: &str,
    session: &mut ReferenceSession,
    dir: &Path,
    prompts: &[Vec<i64>],
    out: &[Generated],
    ours: &[TokenScores],
    temperature: f64,
) {
    let seqs: Vec<Value> = prompts
        .iter()
        .zip(out)
        .map(|(p, g)| serde_json::json!({"prompt": p, "response": g.response}))
        .collect();
    let (src, dst) = (dir.join("score_in.json"), dir.join("score_out.json"));
    std::fs::write(&src, Value::Array(seqs).to_string()).unwrap();
    session.request(&format!(
        "score {} {} {temperature}",
        src.display(),
        dst.display()
    ));
    let theirs: Vec<(Vec<f32>, Vec<f32>)> = read_json(&dst)
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let f = |k: &str| floats(&s[k]).into_iter().map(|x| x as f32).collect();
            (f("log_probs"), f("entropy"))
        })
        .collect();
    let lp = max_diff(
        ours.iter().map(|s| s.log_probs.as_slice()),
        theirs.iter().map(|t| t.0.as_slice()),
    );
    let ent = max_diff(
        ours.iter().map(|s| s.entropy.as_slice()),
        theirs.iter().map(|t| t.1.as_slice()),
    );
    println!("{name}: scoring vs transformers max diff: log-probs {lp:e}, entropy {ent:e} (T {temperature})");
    assert!(
        lp <= TOLERANCE,
        "{name}: log-probs differ from transformers by {lp}"
    );
    assert!(
        ent <= TOLERANCE,
        "{name}: entropies differ from transformers by {ent}"
    );
}

/// Greedy tokens against transformers' per prompt, naming the first difference and the reference's logit margin.
fn check_greedy(name: &str, ours: &[Generated], reference: &Value) {
    let responses = reference["responses"].as_array().unwrap();
    let margins = floats(&reference["margins"]);
    assert_eq!(ours.len(), responses.len());
    for (i, (g, r)) in ours.iter().zip(responses).enumerate() {
        let r = ids(r);
        let first = g.response.iter().zip(&r).position(|(a, b)| a != b);
        assert!(
            g.response == r,
            "{name}: prompt {i}: greedy tokens differ from transformers' at {first:?} (lengths {} vs {}; smallest \
             top-2 logit gap of the reference {:e})\nours   {:?}\ntheirs {r:?}",
            g.len(),
            r.len(),
            margins[i],
            g.response
        );
    }
    let min_margin = margins.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "{name}: greedy equals transformers for {} prompts (smallest top-2 gap {min_margin:e})",
        ours.len()
    );
}

/// The case `name` of the reference session (`args`: `make` options): greedy, sampled and scored.
fn run_case(name: &str, args: &str) {
    let Some(py) = venv_python() else {
        return;
    };
    tch::set_num_threads(1);
    let start = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut all = vec!["session", "--out", d.to_str().unwrap()];
    all.extend(args.split_whitespace());
    let new_tokens = NEW_TOKENS.to_string();
    all.extend(["--prompts", "16", "--new-tokens", &new_tokens]);
    let mut session =
        ReferenceSession::start(&py, "generation_reference.py", &all, &d.join("stderr.txt"));
    let reference = read_json(&d.join("greedy.json"));
    let prompts: Vec<Vec<i64>> = read_json(&d.join("prompts.json"))
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let model_dir = d.join("model");
    let model = RolloutModel::load(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let greedy =
        GenerationConfig::from_model_dir(&model_dir, NEW_TOKENS, SamplingParams::default())
            .unwrap();
    assert_eq!(
        greedy.eos_token_ids,
        ids(&reference["eos"]),
        "EOS from generation_config.json"
    );
    let t = Instant::now();
    let out = model.generate(&prompts, &greedy).unwrap();
    println!(
        "{name}: greedy generation of 16 x {NEW_TOKENS} in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    check_greedy(name, &out, &reference);
    let stopped = out.iter().filter(|g| g.stopped_at_eos).count();
    assert!(
        stopped > 0 && stopped < out.len(),
        "{name}: {stopped} of {} prompts stopped at EOS: the case must test both endings",
        out.len()
    );
    assert!(out
        .iter()
        .all(|g| g.stopped_at_eos || g.len() == NEW_TOKENS));
    let scores = check_rollout_against_scoring(name, &model, &prompts, &out, 1.0);
    check_scores_against_transformers(name, &mut session, d, &prompts, &out, &scores, 1.0);
    let sampling = SamplingParams {
        do_sample: true,
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: 11,
    };
    let sampled = model
        .generate(
            &prompts,
            &GenerationConfig {
                sampling,
                ..greedy.clone()
            },
        )
        .unwrap();
    assert_ne!(sampled, out, "{name}: sampling gave the greedy tokens");
    let scores = check_rollout_against_scoring(name, &model, &prompts, &sampled, 0.8);
    check_scores_against_transformers(name, &mut session, d, &prompts, &sampled, &scores, 0.8);
    println!("{name}: case took {:.1}s", start.elapsed().as_secs_f64());
}

#[test]
fn qwen2_generation_and_scores_match_transformers() {
    run_case(
        "qwen2",
        "--arch qwen2 --hidden 32 --heads 4 --kv-heads 2 --tie 1",
    );
}

/// Llama 3.1's RoPE scaling with a pre-training context of 32 tokens: prompts plus responses reach 88 positions.
const LLAMA3: &str = r#"{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":32}"#;

#[test]
fn llama_generation_and_scores_match_transformers() {
    let args = format!("--arch llama --hidden 32 --heads 4 --kv-heads 1 --tie 0 --rope {LLAMA3}");
    run_case("llama", &args);
}

#[test]
fn qwen3_generation_and_scores_match_transformers() {
    run_case(
        "qwen3",
        "--arch qwen3 --hidden 32 --heads 4 --kv-heads 2 --head-dim 16 --tie 0",
    );
}

/// A tiny random Qwen2 made by ferl itself (no Python), with `init_range` wide enough for clear argmaxes.
fn ferl_model(dir: &Path) -> std::path::PathBuf {
    let config = serde_json::json!({
        "model_type": "qwen2", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "initializer_range": 0.3, "eos_token_id": 95, "dtype": "float32"
    });
    let file = dir.join("config.json");
    std::fs::write(&file, config.to_string()).unwrap();
    let out = dir.join("model");
    init_model(&file, None, &out, 3).unwrap();
    out
}

fn prompts() -> Vec<Vec<i64>> {
    (0..6)
        .map(|i| (0..(2 + 3 * i)).map(|t| (7 * i + 5 * t + 1) % 90).collect())
        .collect()
}

#[test]
fn seeded_sampling_is_reproducible_and_batching_changes_no_sequence() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model_dir = ferl_model(dir.path());
    let model = RolloutModel::load(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let prompts = prompts();
    let sampled = |seed| {
        let sampling = SamplingParams {
            top_k: 50,
            top_p: 0.9,
            ..SamplingParams::sample(1.0, seed)
        };
        model
            .generate(&prompts, &GenerationConfig::new(24, sampling))
            .unwrap()
    };
    let (a, b, c) = (sampled(5), sampled(5), sampled(6));
    assert_eq!(a, b, "the same seed gives the same tokens and log-probs");
    assert_ne!(
        a.iter().map(|g| &g.response).collect::<Vec<_>>(),
        c.iter().map(|g| &g.response).collect::<Vec<_>>(),
        "another seed gives other tokens"
    );
    assert!(a.iter().all(|g| g.len() == 24 && !g.stopped_at_eos));
    // Each prompt alone gives what it gets in the batch (greedy: no draws involved).
    let greedy = GenerationConfig::new(24, SamplingParams::default());
    let batched = model.generate(&prompts, &greedy).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let alone = model.generate(std::slice::from_ref(p), &greedy).unwrap();
        assert_eq!(alone[0].response, batched[i].response, "prompt {i}");
        let d = max_diff(
            [alone[0].log_probs.as_slice()],
            [batched[i].log_probs.as_slice()],
        );
        assert!(
            d <= TOLERANCE,
            "prompt {i}: log-probs alone vs batched differ by {d}"
        );
    }
    check_rollout_against_scoring("ferl-init", &model, &prompts, &a, 1.0);
}

#[test]
fn eos_stops_its_sequence_only_and_a_store_snapshot_generates_alike() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model_dir = ferl_model(dir.path());
    let model = RolloutModel::load(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let prompts = prompts();
    let from_dir =
        GenerationConfig::from_model_dir(&model_dir, 20, SamplingParams::default()).unwrap();
    assert_eq!(
        (from_dir.eos_token_ids.clone(), from_dir.pad_token_id),
        (vec![95], 95)
    );
    let free = model
        .generate(
            &prompts,
            &GenerationConfig::new(20, SamplingParams::default()),
        )
        .unwrap();
    // Stop at the token sequence 0 generates 5th, which it has not generated before.
    let eos = free[0].response[4];
    let first = free[0].response.iter().position(|&t| t == eos).unwrap();
    let config = GenerationConfig {
        eos_token_ids: vec![eos],
        ..GenerationConfig::new(20, SamplingParams::default())
    };
    let out = model.generate(&prompts, &config).unwrap();
    for (f, o) in free.iter().zip(&out) {
        let stop = f.response.iter().position(|&t| t == eos);
        let n = stop.map_or(20, |i| i + 1);
        assert_eq!(o.response, f.response[..n], "cut after the first EOS");
        assert_eq!(o.log_probs, f.log_probs[..n]);
        assert_eq!(o.stopped_at_eos, stop.is_some());
    }
    assert_eq!(out[0].len(), first + 1);
    assert!(
        out.iter().any(|g| !g.stopped_at_eos),
        "some sequence runs to the length limit"
    );
    // The weights of a trainer's store, snapshotted, generate the same tokens.
    let loaded = load_model(&model_dir).unwrap();
    let mut store = LocalParams::new(loaded.layout.clone(), loaded.params, Kind::Float);
    let snapshot = RolloutModel::from_store(loaded.config, &mut store, Kind::Float).unwrap();
    assert_eq!(snapshot.generate(&prompts, &config).unwrap(), out);
    // Refusals name what is wrong.
    let err = model
        .generate(&[vec![1, 500]], &config)
        .unwrap_err()
        .to_string();
    assert!(err.contains("500") && err.contains("vocabulary"), "{err}");
    let err = model.generate(&[vec![]], &config).unwrap_err().to_string();
    assert!(err.contains("empty"), "{err}");
}

#[test]
fn cuda_generation_matches_cpu() {
    if let Err(e) = ferl_trainer::rollout::ensure_device(Device::Cuda(0)) {
        println!("SKIP: no CUDA device ({e:#})");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model_dir = ferl_model(dir.path());
    let cpu = RolloutModel::load(&model_dir, Device::Cpu, Kind::Float).unwrap();
    let gpu = RolloutModel::load(&model_dir, Device::Cuda(0), Kind::Float).unwrap();
    let prompts = prompts();
    for sampling in [SamplingParams::default(), SamplingParams::sample(0.9, 4)] {
        let config = GenerationConfig::new(32, sampling);
        let (a, b) = (
            cpu.generate(&prompts, &config).unwrap(),
            gpu.generate(&prompts, &config).unwrap(),
        );
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.response, y.response, "{sampling:?}");
        }
        let d = max_diff(
            a.iter().map(|g| g.log_probs.as_slice()),
            b.iter().map(|g| g.log_probs.as_slice()),
        );
        println!("cuda vs cpu ({sampling:?}): log-probs max diff {d:e}");
        assert!(d <= 1e-4, "CUDA log-probs differ from CPU by {d}");
        check_rollout_against_scoring("cuda", &gpu, &prompts, &b, sampling.log_prob_temperature());
    }
    let bf16 = RolloutModel::load(&model_dir, Device::Cuda(0), Kind::BFloat16).unwrap();
    let out = bf16
        .generate(
            &prompts,
            &GenerationConfig::new(32, SamplingParams::default()),
        )
        .unwrap();
    assert!(out
        .iter()
        .all(|g| g.len() == 32 && g.log_probs.iter().all(|x| x.is_finite() && *x <= 0.0)));
}

/// A weight sync reloads a rollout model in place: after `copy_params_from` with another model's parameters it
/// generates exactly what that model does (fp32, and cast into a bf16 model), and parameters of another shape are
/// refused, naming the tensor, before anything is written.
#[test]
fn copy_params_from_reloads_in_place_and_refuses_another_shape() {
    tch::set_num_threads(1);
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = ferl_model(one.path());
    let file = two.path().join("config.json");
    std::fs::copy(one.path().join("config.json"), &file).unwrap();
    init_model(&file, None, &two.path().join("model"), 11).unwrap();
    let other = load_model(&two.path().join("model")).unwrap();
    let greedy = GenerationConfig::new(16, SamplingParams::default());
    let want = RolloutModel::load(&two.path().join("model"), Device::Cpu, Kind::Float)
        .unwrap()
        .generate(&prompts(), &greedy)
        .unwrap();
    let mut model = RolloutModel::load(&first, Device::Cpu, Kind::Float).unwrap();
    let before = model.generate(&prompts(), &greedy).unwrap();
    assert_ne!(before, want, "two seeds, two models");
    model
        .copy_params_from(&other.layout, &other.params)
        .unwrap();
    assert_eq!(model.generate(&prompts(), &greedy).unwrap(), want);

    let mut bf16 = RolloutModel::load(&first, Device::Cpu, Kind::BFloat16).unwrap();
    bf16.copy_params_from(&other.layout, &other.params).unwrap();
    let cast = RolloutModel::from_params(
        other.config.clone(),
        &other.layout,
        &other.params,
        Device::Cpu,
        Kind::BFloat16,
    )
    .unwrap();
    assert_eq!(
        bf16.generate(&prompts(), &greedy).unwrap(),
        cast.generate(&prompts(), &greedy).unwrap()
    );

    let mut wrong: Vec<tch::Tensor> = other.params.iter().map(|t| t.shallow_clone()).collect();
    wrong[1] = tch::Tensor::zeros([3, 3], (Kind::Float, Device::Cpu));
    let err = model
        .copy_params_from(&other.layout, &wrong)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&other.layout.tensors[1].0), "{err}");
    assert_eq!(
        model.generate(&prompts(), &greedy).unwrap(),
        want,
        "nothing written"
    );
}
