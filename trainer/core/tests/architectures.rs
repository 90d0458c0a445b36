//! The seeds' architectures against transformers 5.24 (issue 12, item 3): tiny random Qwen2, Qwen3 (q/k norms,
//! explicit head_dim), Llama with `llama3` and `linear` RoPE scaling and a sharded-safetensors folder are made by
//! `py/parity_reference.py case`; ferl's fp32 logits must match transformers' within 1e-5 and one training step's
//! loss and grad norm within 1e-4 relative. Unsupported config fields are refused with errors naming them.

mod common;

use common::*;
use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::kernels::{KernelRegistry, RmsNormKernel};
use ferl_trainer::model::config::{Architecture, ModelConfig};
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::rope::RopeScaling;
use ferl_trainer::model::{load_model, weights, LoadedModel};
use ferl_trainer::optim::{AdamW, AdamWConfig, LrSchedule};
use ferl_trainer::params::LocalParams;
use ferl_trainer::step::Stepper;
use std::path::Path;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// Samples whose logits are compared.
const LOGIT_SAMPLES: usize = 2;
/// Samples of the one training step (two micro-batches of two).
const BATCH: usize = 4;
const LR: f64 = 2e-3;

/// What one case measured.
struct Measured {
    /// The loaded model (before the step).
    model: LoadedModel,
    samples: Samples,
    /// ferl's logits per compared sample.
    logits: Vec<Tensor>,
}

/// Makes the case's model with transformers (`args`: options of `make`, split at whitespace; `case` also writes its
/// logits and one reference training step), then checks ferl against it with `layout` micro-batches. Returns `None`
/// when the venv is absent (outside CI).
fn run_case(name: &str, args: &str, layout: Layout) -> Option<(Measured, tempfile::TempDir)> {
    let py = venv_python()?;
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let settings = serde_json::json!({
        "lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.01, "warmup_ratio": 0.0, "min_lr_ratio": 0.1,
        "scheduler": "constant", "total_steps": 1, "clip_grad": 1.0,
        "train_batch_size": BATCH, "micro_batch_size": 2,
    });
    std::fs::write(d.join("settings.json"), settings.to_string()).unwrap();
    let (out, set) = (d.to_str().unwrap(), d.join("settings.json"));
    let common = "--samples 8 --count 2 --vocab 256 --init-range 0.2";
    let mut all = vec!["case", "--out", out, "--settings", set.to_str().unwrap()];
    all.extend(common.split_whitespace().chain(args.split_whitespace()));
    run_reference(&py, &all);
    let model = load_model(&d.join("model")).unwrap();
    let samples = read_samples(&d.join("data.json"));
    let logits = ferl_logits(&model.config, &model, &samples);
    check_logits(name, &logits, &read_f32s(&d.join("logits.bin")));
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap()).unwrap();
    let (loss, norm) = (
        floats(&reference["loss"])[0],
        floats(&reference["grad_norm"])[0],
    );
    let measured = Measured {
        model,
        samples,
        logits,
    };
    check_step(
        name,
        &measured,
        layout,
        KernelRegistry::builtin(),
        (loss, norm),
    );
    Some((measured, dir))
}

/// An engine over copies of `model`'s parameters, computing with `cfg`.
fn engine(cfg: &ModelConfig, model: &LoadedModel, checkpointing: bool) -> Engine<LocalParams> {
    let params = model.params.iter().map(Tensor::copy).collect();
    let store = LocalParams::new(model.layout.clone(), params, Kind::Float);
    let opts = EngineOptions {
        gradient_checkpointing: checkpointing,
        logits_chunk_elements: 5_000,
        ..Default::default()
    };
    Engine::new(cfg.clone(), store, Kind::Float, opts)
}

/// ferl's fp32 logits `[T, vocab]` of the first samples, each alone in a padded micro-batch.
fn ferl_logits(cfg: &ModelConfig, model: &LoadedModel, samples: &Samples) -> Vec<Tensor> {
    let mut e = engine(cfg, model, false);
    (0..LOGIT_SAMPLES)
        .map(|i| {
            let mb = MicroBatch::new(&[samples.get(i)], Layout::Padded, Device::Cpu).unwrap();
            e.logits(&mb).unwrap().squeeze_dim(0)
        })
        .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// ferl's logits against transformers' (back to back in `theirs`): max |diff| <= 1e-5 * max(1, max |logit|).
fn check_logits(name: &str, ours: &[Tensor], theirs: &[f32]) {
    let mut offset = 0;
    for (i, o) in ours.iter().enumerate() {
        let n = o.numel();
        let t = Tensor::from_slice(&theirs[offset..offset + n]).view(o.size().as_slice());
        offset += n;
        let scale = t.abs().max().double_value(&[]).max(1.0);
        let diff = max_abs_diff(o, &t);
        println!(
            "{name}: sample {i} ({} tokens) logits max diff {diff:e} (scale {scale:.3})",
            o.size()[0]
        );
        assert!(
            diff <= 1e-5 * scale,
            "{name}: logits of sample {i} differ by {diff}"
        );
    }
    assert_eq!(
        offset,
        theirs.len(),
        "{name}: transformers wrote more logits"
    );
}

/// One training step of ferl (`kernels`, checkpointing when any kernel is set) against transformers' `(loss, norm)`.
fn check_step(
    name: &str,
    m: &Measured,
    layout: Layout,
    kernels: KernelRegistry,
    reference: (f64, f64),
) {
    let mut engine = engine(&m.model.config, &m.model, !kernels.is_builtin());
    engine.set_kernels(kernels);
    let adam = AdamWConfig {
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let optimizer = AdamW::new(adam, engine.store().master());
    let mut stepper = Stepper {
        engine,
        optimizer,
        schedule: LrSchedule::from_verl("constant", LR, 0.0, 1, 0.1).unwrap(),
        clip_grad: 1.0,
        micro_batch_size: 2,
        layout,
        device: Device::Cpu,
        completed_steps: 0,
        sequence_parallel: None,
    };
    let batch: Vec<SampleRef> = (0..BATCH).map(|i| m.samples.get(i)).collect();
    let stats = stepper.step(&batch).unwrap();
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
    let (loss, norm) = (
        rel(stats.loss, reference.0),
        rel(stats.grad_norm, reference.1),
    );
    println!(
        "{name}: step loss {} vs {} (rel {loss:e}), grad norm {} vs {} (rel {norm:e})",
        stats.loss, reference.0, stats.grad_norm, reference.1
    );
    assert!(
        loss < 1e-4,
        "{name}: loss {} vs torch {}",
        stats.loss,
        reference.0
    );
    assert!(
        norm < 1e-4,
        "{name}: grad norm {} vs torch {}",
        stats.grad_norm,
        reference.1
    );
}

/// Asserts that computing without the model's RoPE scaling changes its logits far beyond the tolerance.
fn assert_scaling_matters(name: &str, m: &Measured) {
    let mut plain = m.model.config.clone();
    assert_ne!(plain.rope_scaling, RopeScaling::Default, "{name}: scaled");
    plain.rope_scaling = RopeScaling::Default;
    let unscaled = ferl_logits(&plain, &m.model, &m.samples);
    let diff = m
        .logits
        .iter()
        .zip(&unscaled)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0.0, f64::max);
    println!("{name}: logits without the RoPE scaling differ by {diff:e}");
    assert!(diff > 1e-2, "{name}: the scaling barely matters ({diff})");
}

#[test]
fn qwen2_tied_gqa_matches_transformers() {
    let args = "--arch qwen2 --hidden 32 --heads 4 --kv-heads 2 --tie 1";
    let Some((m, _dir)) = run_case("qwen2", args, Layout::Padded) else {
        return;
    };
    assert_eq!(m.model.config.arch, Architecture::Qwen2);
    assert!(m.model.config.qkv_bias && !m.model.config.qk_norm);
}

/// RMSNorm with a hand-written backward (as a kernel plugin has), so that the layer runs split at its norms.
struct PlainRmsNorm;

impl RmsNormKernel for PlainRmsNorm {
    fn forward(&self, x: &Tensor, w: &Tensor, eps: f64) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
        let rstd = (x.square().mean_dim(-1, true, Kind::Float) + eps).rsqrt();
        Ok((x * &rstd * w, vec![rstd]))
    }

    fn backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        saved: &[Tensor],
    ) -> anyhow::Result<(Tensor, Tensor)> {
        let xn = x * &saved[0];
        let gn = dy * w;
        let dx = (&gn - &xn * (&gn * &xn).mean_dim(-1, true, Kind::Float)) * &saved[0];
        let dw = (dy * &xn)
            .reshape([-1, w.size()[0]])
            .sum_dim_intlist(0, false, Kind::Float);
        Ok((dx, dw))
    }
}

#[test]
fn qwen3_with_qk_norms_and_explicit_head_dim_matches_transformers() {
    let args = "--arch qwen3 --hidden 32 --heads 4 --kv-heads 2 --head-dim 16 --tie 0";
    let Some((m, dir)) = run_case("qwen3", args, Layout::Padded) else {
        return;
    };
    let cfg = &m.model.config;
    assert_eq!(cfg.arch, Architecture::Qwen3);
    assert!(cfg.qk_norm && !cfg.qkv_bias && !cfg.o_bias);
    assert_eq!(
        (cfg.head_dim, cfg.num_heads * cfg.head_dim),
        (16, 64),
        "q is wider than hidden"
    );
    let names: Vec<&str> = m
        .model
        .layout
        .tensors
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(names.contains(&"model.layers.1.self_attn.k_norm.weight"));
    // The layer split at replaced norms (with checkpointing) back-propagates into the q/k norms too.
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("reference.json")).unwrap())
            .unwrap();
    let mut kernels = KernelRegistry::builtin();
    kernels.rms_norm = Some(Arc::new(PlainRmsNorm));
    let expected = (
        floats(&reference["loss"])[0],
        floats(&reference["grad_norm"])[0],
    );
    check_step("qwen3-split-ckpt", &m, Layout::Packed, kernels, expected);
}

/// Llama 3.1's scaling with a pre-training context of 32 tokens (no whitespace: arguments are split at it).
const LLAMA3: &str = r#"{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":32}"#;

#[test]
fn llama_with_llama3_rope_scaling_matches_transformers() {
    // head_dim 16: wavelengths 6.3 (kept), 19.9 (interpolated) and > 32 (scaled); samples of 40 to 64 tokens.
    let args = format!(
        "--arch llama --hidden 64 --heads 4 --kv-heads 2 --tie 0 --min-len 40 --max-len 64 --rope {LLAMA3}"
    );
    let Some((m, _dir)) = run_case("llama3-rope", &args, Layout::Padded) else {
        return;
    };
    let expected = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 32.0,
    };
    assert_eq!(m.model.config.rope_scaling, expected);
    assert!(
        m.model.config.raw.get("rope_parameters").is_some(),
        "transformers 5's form"
    );
    assert_scaling_matters("llama3-rope", &m);
}

#[test]
fn llama_with_legacy_linear_rope_scaling_matches_transformers() {
    // deepseek-coder's form: `rope_scaling: {"type": "linear", "factor": 4}` next to a top-level rope_theta.
    let args = r#"--arch llama --hidden 32 --heads 4 --kv-heads 2 --tie 1 --min-len 24 --max-len 48
        --legacy-rope 1 --rope {"type":"linear","factor":4.0}"#;
    let Some((m, _dir)) = run_case("linear-rope", args, Layout::Packed) else {
        return;
    };
    let raw = &m.model.config.raw;
    assert_eq!(raw["rope_scaling"]["type"], "linear");
    assert!(raw.get("rope_parameters").is_none() && raw.get("rope_theta").is_some());
    assert_eq!(
        m.model.config.rope_scaling,
        RopeScaling::Linear { factor: 4.0 }
    );
    assert_scaling_matters("linear-rope", &m);
}

#[test]
fn sharded_qwen3_with_rope_scaling_matches_transformers() {
    let args = r#"--arch qwen3 --hidden 32 --heads 4 --kv-heads 2 --head-dim 8 --tie 0 --max-shard-size 20KB
        --rope {"rope_type":"linear","factor":2.0}"#;
    let Some((m, dir)) = run_case("sharded-qwen3", args, Layout::Padded) else {
        return;
    };
    let model_dir = dir.path().join("model");
    assert!(model_dir.join("model.safetensors.index.json").exists());
    let files = weights::weight_files(&model_dir).unwrap();
    println!("sharded-qwen3: {} shards", files.len());
    assert!(files.len() >= 3, "sharded into {} files", files.len());
    assert_eq!(
        m.model.config.rope_scaling,
        RopeScaling::Linear { factor: 2.0 }
    );
}

/// A valid Qwen2 config.json, to be broken one field at a time.
fn base_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen2", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu",
        "rope_theta": 10000.0, "use_sliding_window": false, "attention_dropout": 0.0
    })
}

fn load_config(dir: &Path, v: &serde_json::Value) -> anyhow::Result<ModelConfig> {
    let file = dir.join("config.json");
    std::fs::write(&file, v.to_string()).unwrap();
    ModelConfig::from_file(&file)
}

#[test]
fn unsupported_config_fields_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    load_config(dir.path(), &base_config()).expect("the base config is supported");
    let llama3 =
        serde_json::json!({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0});
    let cases: Vec<(&str, serde_json::Value, &[&str])> = vec![
        ("model_type", "mistral".into(), &["model_type", "mistral"]),
        (
            "model_type",
            "qwen3_moe".into(),
            &["model_type", "qwen3_moe"],
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 4.0}),
            &["rope_scaling.type", "yarn"],
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "dynamic", "factor": 2.0}),
            &["rope_scaling.rope_type", "dynamic"],
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "longrope"}),
            &["rope_parameters.rope_type", "longrope"],
        ),
        ("rope_parameters", llama3, &["rope_parameters.factor"]),
        (
            "partial_rotary_factor",
            0.5.into(),
            &["partial_rotary_factor"],
        ),
        ("use_sliding_window", true.into(), &["use_sliding_window"]),
        (
            "layer_types",
            serde_json::json!(["sliding_attention"]),
            &["layer_types", "sliding_attention"],
        ),
        ("mlp_bias", true.into(), &["mlp_bias"]),
        ("hidden_act", "gelu".into(), &["hidden_act", "gelu"]),
        ("attention_dropout", 0.1.into(), &["attention_dropout"]),
    ];
    for (field, value, expected) in cases {
        let mut v = base_config();
        v[field] = value;
        let err = format!("{:#}", load_config(dir.path(), &v).expect_err(field));
        assert!(
            err.contains("config.json"),
            "{field}: the file is named: {err}"
        );
        for e in expected {
            assert!(err.contains(e), "{field}: `{e}` is named: {err}");
        }
    }
}

#[test]
fn qwen3_defaults_and_random_init_follow_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let mut v = base_config();
    v["model_type"] = "qwen3".into();
    let cfg = load_config(dir.path(), &v).unwrap();
    assert_eq!(cfg.head_dim, 128, "Qwen3Config's default head_dim");
    assert!(!cfg.qkv_bias && !cfg.o_bias && cfg.qk_norm);
    v["attention_bias"] = true.into();
    v["head_dim"] = 8.into();
    let cfg = load_config(dir.path(), &v).unwrap();
    assert!(cfg.qkv_bias && cfg.o_bias);
    let layout = ModelLayout::new(&cfg);
    let params = weights::init_params(&cfg, &layout, 3);
    for ((name, shape), t) in layout.tensors.iter().zip(&params) {
        if name.contains("q_norm") || name.contains("k_norm") {
            assert_eq!(shape, &vec![8]);
            assert_eq!(
                t.ne(1.0).sum(Kind::Int64).int64_value(&[]),
                0,
                "{name} is ones"
            );
        }
    }
    let norms = layout
        .tensors
        .iter()
        .filter(|(n, _)| n.ends_with("_norm.weight") && n.contains("self_attn"));
    assert_eq!(norms.count(), 2);
    // A saved Qwen3 folder loads back with its q/k norms.
    let out = dir.path().join("saved");
    weights::save_hf_folder(&out, &cfg, &layout, &params, Kind::Float, &[]).unwrap();
    let loaded = load_model(&out).unwrap();
    assert_eq!(loaded.layout.tensors, layout.tensors);
}
