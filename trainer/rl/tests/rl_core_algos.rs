//! `ferl_rl` against a PyTorch implementation of verl's core_algos formulas (`py/rl_reference.py`) on
//! fixed inputs: GRPO (with and without std normalisation, two epsilons) and RLOO advantages, `agg_loss` in every
//! mode (local and global normalisers), the clipped policy loss with its metrics and gradient for several clip
//! settings, every KL estimator with its gradient, entropy from logits, and the actor's whole loss with gradients.
//! Every value must agree within 1e-6 (absolute, relative above magnitude 1).

#[path = "../../core/tests/common/mod.rs"]
mod common;

use common::{run_script, venv_python};
use ferl_rl::{
    actor_loss, agg_loss, compute_policy_loss, entropy_from_logits, grpo_outcome_advantage,
    kl_penalty, outcome_advantage, rloo_outcome_advantage, ActorLossConfig, ActorLossInputs,
    AdvEstimator, ClipConfig, GlobalBatch, KlPenalty, LossAggMode, AGG_MODES,
};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

const TOL: f64 = 1e-6;
const B: i64 = 6;
const T: i64 = 5;
const V: i64 = 7;
const INDEX: [&str; 6] = ["a", "a", "a", "b", "b", "c"];

/// The fixed inputs (seeded), with the edge cases placed by hand.
struct Inputs {
    mask: Tensor,
    rewards: Tensor,
    old: Tensor,
    new: Tensor,
    reference: Tensor,
    adv: Tensor,
    logits: Tensor,
}

fn set(t: &Tensor, i: i64, j: i64, v: f64) {
    let _ = t.get(i).get(j).fill_(v);
}

fn inputs() -> Inputs {
    tch::manual_seed(7);
    let lengths = [5i64, 3, 1, 4, 0, 2];
    let mask = Tensor::zeros([B, T], (Kind::Float, tch::Device::Cpu));
    let rewards = mask.zeros_like();
    for (i, (&len, r)) in lengths
        .iter()
        .zip([1.0, 0.0, 1.0, 0.5, 0.5, -1.0])
        .enumerate()
    {
        let _ = mask.get(i as i64).narrow(0, 0, len).fill_(1.0);
        set(&rewards, i as i64, (len - 1).max(0), r);
    }
    let old = -(Tensor::rand([B, T], (Kind::Float, tch::Device::Cpu)) * 2.9 + 0.1);
    let new = &old + Tensor::randn([B, T], (Kind::Float, tch::Device::Cpu)) * 0.5;
    let reference = &old + Tensor::randn([B, T], (Kind::Float, tch::Device::Cpu)) * 0.3;
    let adv = Tensor::randn([B, T], (Kind::Float, tch::Device::Cpu));
    let logits = Tensor::randn([B, T, V], (Kind::Float, tch::Device::Cpu)) * 3.0;
    // Ratio clamp (log-ratio 25 > 20), a small ratio, dual clip (ratio e^1.5 > 3 with A < 0), the k3 clamp (ref -
    // log_prob = 30), a peaked distribution.
    set(&new, 0, 0, old.double_value(&[0, 0]) + 25.0);
    set(&adv, 0, 0, 1.0);
    set(&new, 1, 1, old.double_value(&[1, 1]) - 1.5);
    set(&new, 2, 0, old.double_value(&[2, 0]) + 1.5);
    set(&adv, 2, 0, -1.0);
    set(&reference, 3, 2, new.double_value(&[3, 2]) + 30.0);
    let _ = logits.get(1).get(0).get(3).fill_(60.0);
    Inputs {
        mask,
        rewards,
        old,
        new,
        reference,
        adv,
        logits,
    }
}

fn to_json(t: &Tensor) -> Value {
    let data: Vec<f32> = Vec::try_from(t.reshape([-1])).unwrap();
    json!({"shape": t.size(), "data": data})
}

fn global(case: &Value) -> GlobalBatch {
    let g = &case["global"];
    GlobalBatch {
        dp_size: g["dp_size"].as_i64().unwrap_or(1),
        batch_num_tokens: g["batch_num_tokens"].as_f64(),
        global_batch_size: g["global_batch_size"].as_f64(),
    }
}

/// The cases both sides compute.
fn cases() -> Value {
    let modes = AGG_MODES.map(LossAggMode::as_str);
    let mut agg = Vec::new();
    let mut policy = Vec::new();
    let mut actor = Vec::new();
    for mode in modes {
        agg.push(json!({"name": format!("agg/{mode}"), "mode": mode, "global": {}}));
        let g = if mode == "token-mean" {
            json!({"dp_size": 2, "batch_num_tokens": 40.0})
        } else {
            json!({"dp_size": 2, "global_batch_size": 10.0})
        };
        agg.push(json!({"name": format!("agg/{mode}/global"), "mode": mode, "global": g}));
        for (k, (clip, low, high, c)) in [
            (0.2, None, None, 3.0),
            (0.2, Some(0.1), Some(0.28), 3.0),
            (0.3, None, Some(0.5), 10.0),
        ]
        .into_iter()
        .enumerate()
        {
            policy.push(
                json!({"name": format!("policy/{mode}/{k}"), "mode": mode, "clip_ratio": clip,
                "clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": c, "global": {}}),
            );
        }
        actor.push(
            json!({"name": format!("actor/{mode}"), "mode": mode, "entropy_coeff": 0.01,
            "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl"}),
        );
    }
    json!({
        "grpo": [[1e-6, true], [1e-6, false], [1e-2, true], [1e-2, false]],
        "agg": agg, "policy": policy, "actor": actor,
        "kl": ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "abs+", "k2+", "k3+", "low_var_kl+"],
    })
}

/// `log_prob` as a fresh leaf that records gradients.
fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

/// ferl's values for every case, named as the reference names them.
fn ours(x: &Inputs, cases: &Value) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for (k, g) in cases["grpo"].as_array().unwrap().iter().enumerate() {
        let (eps, norm) = (g[0].as_f64().unwrap(), g[1].as_bool().unwrap());
        // verl's epsilon through the estimator's dispatch, the others directly.
        let adv = if eps == 1e-6 {
            outcome_advantage(AdvEstimator::Grpo, &x.rewards, &x.mask, &INDEX, norm)
        } else {
            grpo_outcome_advantage(&x.rewards, &x.mask, &INDEX, eps, norm)
        };
        let adv = adv.unwrap();
        out.insert(format!("grpo/{k}"), adv);
    }
    out.insert(
        "rloo".into(),
        outcome_advantage(AdvEstimator::Rloo, &x.rewards, &x.mask, &INDEX, true).unwrap(),
    );
    out.insert("entropy".into(), entropy_from_logits(&x.logits));
    for c in cases["agg"].as_array().unwrap() {
        let mode = LossAggMode::parse(c["mode"].as_str().unwrap()).unwrap();
        let v = agg_loss(&x.adv, &x.mask, mode, global(c)).unwrap();
        out.insert(c["name"].as_str().unwrap().into(), v);
    }
    for c in cases["policy"].as_array().unwrap() {
        let cfg = ClipConfig {
            clip_ratio: c["clip_ratio"].as_f64().unwrap(),
            clip_ratio_low: c["clip_ratio_low"].as_f64(),
            clip_ratio_high: c["clip_ratio_high"].as_f64(),
            clip_ratio_c: c["clip_ratio_c"].as_f64().unwrap(),
        };
        let mode = LossAggMode::parse(c["mode"].as_str().unwrap()).unwrap();
        let new = leaf(&x.new);
        let p = compute_policy_loss(&x.old, &new, &x.adv, &x.mask, mode, &cfg, global(c)).unwrap();
        p.pg_loss.backward();
        let name = c["name"].as_str().unwrap();
        out.insert(format!("{name}/grad"), new.grad());
        out.insert(format!("{name}/pg_loss"), p.pg_loss);
        out.insert(format!("{name}/pg_clipfrac"), p.pg_clipfrac);
        out.insert(format!("{name}/ppo_kl"), p.ppo_kl);
        out.insert(format!("{name}/pg_clipfrac_lower"), p.pg_clipfrac_lower);
    }
    for kind in cases["kl"].as_array().unwrap() {
        let kind = kind.as_str().unwrap();
        let (k, st) = KlPenalty::parse(kind).unwrap();
        let new = leaf(&x.new);
        let kl = kl_penalty(&new, &x.reference, k, st).unwrap();
        kl.sum(Kind::Float).backward();
        out.insert(format!("kl/{kind}/grad"), new.grad());
        out.insert(format!("kl/{kind}"), kl);
    }
    for c in cases["actor"].as_array().unwrap() {
        out.extend(actor(x, c));
    }
    out
}

fn actor(x: &Inputs, c: &Value) -> Vec<(String, Tensor)> {
    let cfg = ActorLossConfig {
        loss_agg_mode: LossAggMode::parse(c["mode"].as_str().unwrap()).unwrap(),
        entropy_coeff: c["entropy_coeff"].as_f64().unwrap(),
        use_kl_loss: true,
        kl_loss_coef: c["kl_loss_coef"].as_f64().unwrap(),
        kl_loss_type: KlPenalty::parse(c["kl_loss_type"].as_str().unwrap()).unwrap(),
        ..Default::default()
    };
    let (new, logits) = (leaf(&x.new), leaf(&x.logits));
    let entropy = entropy_from_logits(&logits);
    let inputs = ActorLossInputs {
        old_log_prob: &x.old,
        log_prob: &new,
        advantages: &x.adv,
        response_mask: &x.mask,
        entropy: Some(&entropy),
        ref_log_prob: Some(&x.reference),
    };
    let l = actor_loss(&inputs, &cfg, GlobalBatch::default()).unwrap();
    l.loss.backward();
    let name = c["name"].as_str().unwrap();
    vec![
        (format!("{name}/loss"), l.loss),
        (format!("{name}/entropy"), l.entropy.unwrap()),
        (format!("{name}/kl_loss"), l.kl_loss.unwrap()),
        (format!("{name}/grad"), new.grad()),
        (format!("{name}/logits_grad"), logits.grad()),
    ]
}

/// The largest error of `got` against `want`: absolute where `|want| <= 1`, relative above.
fn worst_error(got: &Tensor, want: &[f64]) -> f64 {
    let got: Vec<f32> = Vec::try_from(got.detach().reshape([-1])).unwrap();
    assert_eq!(got.len(), want.len(), "lengths differ");
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs() / w.abs().max(1.0))
        .fold(0.0, f64::max)
}

#[test]
fn core_algos_match_verls_formulas_in_pytorch() {
    let Some(py) = venv_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let x = inputs();
    let mut cases = cases();
    let named = [
        ("response_mask", &x.mask),
        ("token_level_rewards", &x.rewards),
        ("old_log_prob", &x.old),
        ("log_prob", &x.new),
        ("ref_log_prob", &x.reference),
        ("advantages", &x.adv),
        ("logits", &x.logits),
    ];
    for (name, t) in named {
        cases[name] = to_json(t);
    }
    cases["index"] = json!(INDEX);
    let (input, output) = (dir.path().join("in.json"), dir.path().join("out.json"));
    std::fs::write(&input, cases.to_string()).unwrap();
    run_script(
        &py,
        "rl_reference.py",
        &[input.to_str().unwrap(), output.to_str().unwrap()],
    );
    let reference: BTreeMap<String, Vec<f64>> =
        serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).unwrap();
    let ours = ours(&x, &cases);
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        reference.keys().collect::<Vec<_>>(),
        "both sides compute the same cases"
    );
    let mut failures = Vec::new();
    let mut worst: f64 = 0.0;
    for (name, got) in &ours {
        let err = worst_error(got, &reference[name]);
        worst = worst.max(err);
        println!("{name}: max error {err:.3e}");
        if err.is_nan() || err > TOL {
            failures.push(format!("{name}: error {err:.3e} > {TOL:e}"));
        }
    }
    println!(
        "{} cases, worst error {worst:.3e} (tolerance {TOL:e})",
        ours.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The edge cases were reached: a dual clip, a ratio clip and a clamped k3.
    let lower = ours["policy/token-mean/0/pg_clipfrac_lower"].double_value(&[]);
    let clipfrac = ours["policy/token-mean/0/pg_clipfrac"].double_value(&[]);
    assert!(
        lower > 0.0 && clipfrac > 0.0,
        "lower {lower} clipfrac {clipfrac}"
    );
    assert_eq!(ours["kl/k3"].double_value(&[3, 2]), 10.0);
}

#[test]
fn errors_name_the_argument_and_masked_values_never_leak() {
    let x = inputs();
    let short = x.mask.narrow(1, 0, 3);
    let e = grpo_outcome_advantage(&x.rewards, &short, &INDEX, 1e-6, true).unwrap_err();
    assert!(
        e.to_string()
            .contains("token_level_rewards is [6, 5] but response_mask is [6, 3]"),
        "{e}"
    );
    let e = rloo_outcome_advantage(&x.rewards, &x.mask, &INDEX[..4]).unwrap_err();
    assert!(e.to_string().contains("index has 4 uids for 6 rows"), "{e}");
    let cfg = ClipConfig {
        clip_ratio_c: 1.0,
        ..Default::default()
    };
    let e = compute_policy_loss(
        &x.old,
        &x.new,
        &x.adv,
        &x.mask,
        LossAggMode::TokenMean,
        &cfg,
        GlobalBatch::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("clip_ratio_c must be greater than 1.0"),
        "{e}"
    );
    let e = LossAggMode::parse("token_mean").unwrap_err();
    assert!(
        e.to_string()
            .contains("token-mean, seq-mean-token-sum, seq-mean-token-mean"),
        "{e}"
    );
    let e = KlPenalty::parse("k4").unwrap_err();
    assert!(e.to_string().contains("kl_loss_type `k4`"), "{e}");
    assert_eq!(
        KlPenalty::parse("low_var_kl+").unwrap(),
        (KlPenalty::LowVarKl, true)
    );
    let global = GlobalBatch {
        dp_size: 2,
        ..Default::default()
    };
    let e = agg_loss(&x.adv, &x.mask, LossAggMode::TokenMean, global).unwrap_err();
    assert!(
        e.to_string()
            .contains("needs the global batch's batch_num_tokens"),
        "{e}"
    );
    // NaN and infinity where the mask is 0 change nothing.
    let poisoned = x.adv.where_self(&x.mask.ne(0.0), &Tensor::from(f32::NAN));
    for mode in AGG_MODES {
        let clean = agg_loss(&x.adv, &x.mask, mode, GlobalBatch::default()).unwrap();
        let dirty = agg_loss(&poisoned, &x.mask, mode, GlobalBatch::default()).unwrap();
        assert_eq!(
            clean.double_value(&[]),
            dirty.double_value(&[]),
            "{}",
            mode.as_str()
        );
    }
}

/// What the config can spell but ferl does not compute is refused by name.
#[test]
fn values_the_config_spells_but_ferl_does_not_compute_are_refused() {
    let x = inputs();
    let e = kl_penalty(&x.new, &x.reference, KlPenalty::Full, false).unwrap_err();
    assert!(
        e.to_string()
            .contains("kl_loss_type `full` is not supported"),
        "{e}"
    );
    let e = agg_loss(
        &x.adv,
        &x.mask,
        LossAggMode::SeqMeanTokenSumNorm,
        GlobalBatch::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("loss_agg_mode `seq-mean-token-sum-norm` is not supported"),
        "{e}"
    );
    let e = outcome_advantage(AdvEstimator::Gae, &x.rewards, &x.mask, &INDEX, true).unwrap_err();
    assert!(e.to_string().contains("algorithm.adv_estimator=gae"), "{e}");
}
