//! One policy update step through the engine (issue #14, check 2): the actor's loss ([`ActorTokenLoss`]: the
//! clipped policy loss with asymmetric clipping and dual clip, an entropy bonus and a `low_var_kl` KL loss) over a
//! tiny Qwen2's response tokens, back-propagated by the layer-wise engine, against transformers + a PyTorch
//! implementation of verl's formulas (`py/actor_step_reference.py`) on the same model, samples and per-token inputs,
//! for every `loss_agg_mode`. Asserted: per-token log-probabilities within 1e-5; the loss, its terms and the
//! gradient's global L2 norm within 1e-4 (relative).

#[path = "../../core/tests/common/mod.rs"]
mod common;

use common::{floats, py_script, read_samples, run_reference, venv_python};
use ferl_rl::{
    ActorLossConfig, ActorRows, ActorTokenLoss, ClipConfig, GlobalBatch, KlPenalty, LossAggMode,
    AGG_MODES,
};
use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::model::load_model;
use ferl_trainer::params::{LocalParams, ParamStore};
use std::path::Path;
use std::process::Command;
use tch::{Device, Kind, Tensor};

const TOL: f64 = 1e-4;

fn cfg(mode: LossAggMode) -> ActorLossConfig {
    ActorLossConfig {
        policy: ClipConfig {
            clip_ratio: 0.2,
            clip_ratio_low: Some(0.2),
            clip_ratio_high: Some(0.28),
            clip_ratio_c: 3.0,
        },
        loss_agg_mode: mode,
        entropy_coeff: 0.01,
        use_kl_loss: true,
        kl_loss_coef: 0.05,
        kl_loss_type: (KlPenalty::LowVarKl, false),
    }
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-6)
}

/// Runs the reference for `mode` on the inputs and returns its JSON.
fn reference(py: &Path, dir: &Path, mode: LossAggMode, rows: &ActorRows) -> serde_json::Value {
    let list = |t: &Tensor| Vec::<f64>::try_from(t.to_kind(Kind::Double)).unwrap();
    let inputs = serde_json::json!({
        "old_log_prob": list(&rows.old_log_prob), "advantages": list(&rows.advantages),
        "ref_log_prob": list(rows.ref_log_prob.as_ref().unwrap()),
        "cfg": {"loss_agg_mode": mode.as_str(), "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                "clip_ratio_c": 3.0, "entropy_coeff": 0.01, "kl_loss_coef": 0.05, "kl_loss_type": "low_var_kl"},
    });
    let (input_file, out_file) = (dir.join("inputs.json"), dir.join("out.json"));
    std::fs::write(&input_file, inputs.to_string()).unwrap();
    let status = Command::new(py)
        .arg(py_script("actor_step_reference.py"))
        .arg("--model")
        .arg(dir.join("model"))
        .arg("--data")
        .arg(dir.join("data.json"))
        .arg("--inputs")
        .arg(&input_file)
        .arg("--out")
        .arg(&out_file)
        .status()
        .unwrap();
    assert!(status.success(), "actor_step_reference.py failed");
    serde_json::from_str(&std::fs::read_to_string(out_file).unwrap()).unwrap()
}

/// The global L2 norm of `grads` (in f64).
fn global_norm<'a>(grads: impl Iterator<Item = &'a Tensor>) -> f64 {
    grads
        .map(|g| {
            g.to_kind(Kind::Double)
                .square()
                .sum(Kind::Double)
                .double_value(&[])
        })
        .sum::<f64>()
        .sqrt()
}

/// The largest absolute difference between `want` and the values of `got`, element by element.
fn max_abs_diff(want: &[f64], got: &Tensor) -> f64 {
    want.iter()
        .zip(Vec::<f64>::try_from(got.to_kind(Kind::Double)).unwrap())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

#[test]
fn one_actor_update_matches_pytorch_for_every_loss_agg_mode() {
    let Some(py) = venv_python() else { return };
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.to_str().unwrap();
    run_reference(
        &py,
        &["make", "--out", out, "--samples", "6", "--vocab", "512"],
    );
    let samples = read_samples(&d.join("data.json"));
    let refs: Vec<SampleRef> = (0..samples.ids.len()).map(|i| samples.get(i)).collect();
    let mb = MicroBatch::new(&refs, Layout::Padded, Device::Cpu).unwrap();
    let model = load_model(&d.join("model")).unwrap();
    let store = LocalParams::new(model.layout.clone(), model.params, Kind::Float);
    let mut engine = Engine::new(model.config, store, Kind::Float, EngineOptions::default());
    // Old and reference log-probs near the current ones (so some ratios clip and some do not), random advantages.
    let current = engine.token_stats(&mb, false).unwrap().log_prob;
    tch::manual_seed(11);
    let n = mb.num_targets;
    let rows = || ActorRows {
        tokens_per_sample: refs.iter().map(|s| s.num_targets()).collect(),
        old_log_prob: &current + Tensor::randn([n], (Kind::Float, Device::Cpu)) * 0.3,
        advantages: Tensor::randn([n], (Kind::Float, Device::Cpu)),
        ref_log_prob: Some(&current + Tensor::randn([n], (Kind::Float, Device::Cpu)) * 0.2),
        kept: None,
    };
    for mode in AGG_MODES {
        let name = mode.as_str();
        let rows = rows();
        let want = reference(&py, d, mode, &rows);
        let loss = ActorTokenLoss::new(cfg(mode), GlobalBatch::default(), rows).unwrap();
        engine.store_mut().zero_grads();
        let value = engine.forward_backward_with(&mb, &loss).unwrap();
        let (_, grads) = engine.store_mut().master_and_grads();
        let norm = global_norm(grads.iter());
        let m = loss.metrics();
        let lp_diff = max_abs_diff(&floats(&want["log_prob"]), &current);
        let checks = [
            ("loss", value, want["loss"].as_f64().unwrap()),
            ("pg_loss", m.pg_loss, want["pg_loss"].as_f64().unwrap()),
            (
                "entropy",
                m.entropy.unwrap(),
                want["entropy"].as_f64().unwrap(),
            ),
            (
                "kl_loss",
                m.kl_loss.unwrap(),
                want["kl_loss"].as_f64().unwrap(),
            ),
            ("grad_norm", norm, want["grad_norm"].as_f64().unwrap()),
        ];
        println!("{name}: log-prob max diff {lp_diff:.2e}; {checks:?}");
        assert!(lp_diff < 1e-5, "{name}: log-probs differ by {lp_diff}");
        for (what, got, expected) in checks {
            assert!(
                rel(got, expected) < TOL,
                "{name}: {what} {got} vs PyTorch {expected}"
            );
        }
        let clipfrac = want["pg_clipfrac"].as_f64().unwrap();
        assert!(
            (m.pg_clipfrac - clipfrac).abs() < 1e-6,
            "{name}: pg_clipfrac {} vs {clipfrac}",
            m.pg_clipfrac
        );
        assert!(
            m.pg_clipfrac > 0.0 && m.pg_clipfrac < 1.0,
            "{name}: some ratios clip, not all"
        );
    }
}
