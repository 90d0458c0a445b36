//! Issue 12's "LoRA parity with PEFT": `py/peft_reference.py` makes a tiny fp32 Qwen2, wraps it with
//! `peft.get_peft_model(LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))`, gives every `lora_B` a nonzero
//! value, saves that starting adapter and trains it 6 steps with torch's AdamW. ferl loads the same base model and
//! starting adapter and trains the same batches in one process ([`LocalParams`]) and sharded over two in-process ranks
//! ([`ShardedParams`]). Per-step loss and grad norm agree within 1e-4 relative, the trained adapters (written by
//! [`lora::write_adapter`]) within 1e-4 per tensor, [`lora::merge`] with `merge_and_unload()` within 1e-5, and peft
//! loads ferl's adapter folder with `PeftModel.from_pretrained` to logits equal to ferl's within 1e-5. A fresh
//! adapter follows peft's init (zero `B`, `A` uniform in `±1/√in`) and starts at exactly the base model's loss.

mod common;
/// The sharding tests' helpers: two ranks on threads over loopback TCP, the AdamW settings and the schedule.
#[path = "../../fsdp/tests/common/mod.rs"]
mod sharding;

use common::{
    floats, max_abs_diff, read_f32s, read_samples, run_script, venv_python, ReferenceSession,
    Samples,
};
use ferl_fsdp::{global_step, FsdpOptions, ShardedParams, ShardingStrategy};
use ferl_trainer::batch::{Layout, MicroBatch, SampleRef};
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::lora::{self, LoraSpec, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use ferl_trainer::model::{load_model, weights};
use ferl_trainer::optim::{AdamW, ScheduleKind};
use ferl_trainer::params::{LocalParams, ParamStore};
use ferl_trainer::step::Stepper;
use sharding::{adam, copies, rank_slice, run_ranks, schedule, stepper, GLOBAL_BATCH, TOTAL_STEPS};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, Tensor};

/// Samples per micro-batch in the one-process run (and in peft's loop); the ranks run micro-batches of one.
const MICRO: usize = 2;
/// Samples whose logits are compared.
const LOGIT_SAMPLES: usize = 2;
/// The prefix of peft's adapter tensor names.
const PEFT_PREFIX: &str = "base_model.model.";

/// Writes the settings of peft's loop: those of `sharding::stepper` (its `adam()`, `schedule()`, clipping at 1.0),
/// global batch [`GLOBAL_BATCH`], micro-batch [`MICRO`]. [`reference_curve`] checks the learning rates agree step by
/// step (the warmup ratio is given here, ferl's schedule keeps only the warmup steps).
fn write_settings(d: &Path) -> PathBuf {
    let (adam, schedule) = (adam(), schedule());
    let ScheduleKind::Cosine { min_lr_ratio } = schedule.kind else {
        panic!("the sharding tests' schedule is cosine")
    };
    let settings = serde_json::json!({
        "lr": schedule.lr, "betas": [adam.betas.0, adam.betas.1], "weight_decay": adam.weight_decay,
        "warmup_ratio": 0.2, "min_lr_ratio": min_lr_ratio, "scheduler": "cosine",
        "total_steps": schedule.total_steps, "clip_grad": 1.0,
        "train_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO,
    });
    let file = d.join("settings.json");
    std::fs::write(&file, settings.to_string()).unwrap();
    file
}

/// Reads `reference.json`: per-step (loss, grad norm), after checking peft's learning rates are ferl's.
fn reference_curve(file: &Path) -> Vec<(f64, f64)> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let (loss, norm, lr) = (
        floats(&v["loss"]),
        floats(&v["grad_norm"]),
        floats(&v["lr"]),
    );
    for (step, lr) in lr.iter().enumerate() {
        let ours = schedule().lr_at(step as i64);
        assert!(
            (ours - lr).abs() < 1e-12,
            "step {step}: lr {ours} vs peft's loop {lr}"
        );
    }
    loss.into_iter().zip(norm).collect()
}

/// Global batch `step` (what peft's loop takes at that step).
fn global_batch(samples: &Samples, step: usize) -> Vec<SampleRef<'_>> {
    (step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH)
        .map(|i| samples.get(i))
        .collect()
}

/// Asserts a curve matches peft's within 1e-4 relative; returns the largest relative (loss, grad norm) differences.
fn compare_curves(what: &str, got: &[(f64, f64)], want: &[(f64, f64)]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "{what}: number of steps");
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
    let mut worst = (0.0f64, 0.0f64);
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        println!(
            "{what} step {}: loss {} vs peft {}, grad norm {} vs peft {}",
            step + 1,
            g.0,
            w.0,
            g.1,
            w.1
        );
        let (l, n) = (rel(g.0, w.0), rel(g.1, w.1));
        assert!(
            l < 1e-4,
            "{what} step {}: loss {} vs peft {}",
            step + 1,
            g.0,
            w.0
        );
        assert!(
            n < 1e-4,
            "{what} step {}: grad norm {} vs peft {}",
            step + 1,
            g.1,
            w.1
        );
        worst = (worst.0.max(l), worst.1.max(n));
    }
    println!(
        "{what}: max relative difference to peft: loss {:.2e}, grad norm {:.2e}",
        worst.0, worst.1
    );
    worst
}

/// The tensors of an adapter folder by name.
fn adapter_tensors(dir: &Path) -> HashMap<String, Tensor> {
    weights::read_tensors(&[dir.join(ADAPTER_WEIGHTS)]).unwrap()
}

/// Asserts the adapter folders `ours` (ferl's) and `theirs` (peft's) hold the same tensors within 1e-4; returns the
/// largest difference.
fn compare_adapters(what: &str, ours: &Path, theirs: &Path) -> f64 {
    let (ours, theirs) = (adapter_tensors(ours), adapter_tensors(theirs));
    let mut names: Vec<&String> = ours.keys().collect();
    names.sort();
    let mut theirs_names: Vec<&String> = theirs.keys().collect();
    theirs_names.sort();
    assert_eq!(names, theirs_names, "{what}: adapter tensor names");
    let mut worst = 0.0f64;
    for name in names {
        let diff = max_abs_diff(&ours[name], &theirs[name]);
        assert!(
            diff <= 1e-4,
            "{what}: `{name}` differs from peft's by {diff:e}"
        );
        worst = worst.max(diff);
    }
    println!("{what}: trained adapter max difference to peft {worst:.2e}");
    worst
}

/// The adapters of a LoRA model's full tensors (they follow the base model's in layout order).
fn adapters_of(layout: &ModelLayout, full: &[Tensor]) -> Vec<Tensor> {
    full[layout.base_len()..].iter().map(Tensor::copy).collect()
}

/// Asserts ferl's logits of the first [`LOGIT_SAMPLES`] samples equal `theirs` (peft's, back to back) within 1e-5 of
/// their scale; returns the largest difference.
fn compare_logits(stepper: &mut Stepper<LocalParams>, samples: &Samples, theirs: &[f32]) -> f64 {
    let mut offset = 0;
    let mut worst = 0.0f64;
    for i in 0..LOGIT_SAMPLES {
        let mb = MicroBatch::new(&[samples.get(i)], Layout::Padded, Device::Cpu).unwrap();
        let ours = stepper.engine.logits(&mb).unwrap().flatten(0, -1);
        let n = ours.numel();
        assert!(
            offset + n <= theirs.len(),
            "peft wrote fewer logits than ferl computed"
        );
        let theirs = Tensor::from_slice(&theirs[offset..offset + n]);
        offset += n;
        let scale = theirs.abs().max().double_value(&[]).max(1.0);
        let diff = max_abs_diff(&ours, &theirs);
        println!(
            "sample {i}: logits of ferl's adapter in peft, max difference {diff:e} (scale {scale})"
        );
        assert!(
            diff <= 1e-5 * scale,
            "sample {i}: logits differ by {diff} (scale {scale})"
        );
        worst = worst.max(diff);
    }
    assert_eq!(
        offset,
        theirs.len(),
        "peft wrote more logits than ferl computed"
    );
    worst
}

/// The base model in `model_dir` with peft's starting adapter from `start` (r 8, alpha 16, all-linear, nonzero `B`):
/// the adapter's spec, the model's config, the LoRA layout and its tensors.
fn start_adapter(
    model_dir: &Path,
    start: &Path,
) -> (LoraSpec, ModelConfig, ModelLayout, Vec<Tensor>) {
    let spec = LoraSpec::from_adapter_config(&start.join(ADAPTER_CONFIG)).unwrap();
    assert_eq!(
        (spec.rank, spec.alpha),
        (8, 16.0),
        "peft's r and lora_alpha"
    );
    let model = load_model(model_dir).unwrap();
    let cfg = model.config.clone();
    let (layout, params) =
        lora::with_adapters(&cfg, model.layout, model.params, &spec, Some(start), 0).unwrap();
    assert_eq!(
        layout.lora_pairs().len(),
        7 * cfg.num_layers,
        "all-linear: 7 projections per layer"
    );
    let b_max = adapters_of(&layout, &params)
        .iter()
        .map(|t| t.abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    assert!(b_max > 0.01, "the starting adapter's B are nonzero");
    (spec, cfg, layout, params)
}

/// A rank's `(loss, grad norm)` curve and its trained adapters.
type RankRun = (Vec<(f64, f64)>, Vec<Tensor>);

/// Asserts `lora::merge` of `full` (a trained LoRA model's tensors) equals peft's `merge_and_unload()` saved in
/// `peft_merged`, tensor by tensor, within 1e-5; returns the largest difference.
fn compare_merge(layout: &ModelLayout, full: &[Tensor], peft_merged: &Path) -> f64 {
    let merged = lora::merge(layout, full);
    let theirs = weights::read_tensors(&[peft_merged.to_path_buf()]).unwrap();
    let mut merge_diff = 0.0f64;
    for ((name, _), t) in layout.tensors.iter().zip(&merged) {
        let peft_t = theirs
            .get(name)
            .unwrap_or_else(|| panic!("merge_and_unload() has no `{name}`"));
        let diff = max_abs_diff(t, peft_t);
        assert!(
            diff <= 1e-5,
            "merged `{name}` differs from merge_and_unload() by {diff:e}"
        );
        merge_diff = merge_diff.max(diff);
    }
    println!("merged weights: max difference to merge_and_unload() {merge_diff:.2e}");
    merge_diff
}

/// Trains `params` (the starting LoRA model of `layout`) on two ranks, each with half of every global batch in
/// micro-batches of one, FULL_SHARD, checkpointing on; returns each rank's `(loss, grad norm)` curve and trained
/// adapters.
fn train_two_ranks(
    layout: &ModelLayout,
    cfg: &ModelConfig,
    params: Vec<Tensor>,
    samples: Samples,
) -> Vec<RankRun> {
    let samples = Arc::new(samples);
    let shared = Arc::new(Mutex::new(params));
    let (rank_layout, rank_cfg, rank_samples) = (layout.clone(), cfg.clone(), samples.clone());
    run_ranks(2, move |rank, comm| {
        let mine = copies(&shared.lock().unwrap());
        let opts = FsdpOptions::new(ShardingStrategy::FullShard, Kind::Float, Device::Cpu);
        let store = ShardedParams::new(rank_layout.clone(), &mine, comm, opts).unwrap();
        let optimizer = AdamW::new(adam(), store.trainable_masters());
        let mut s = stepper(&rank_cfg, store, optimizer, 1, true, 0);
        let curve: Vec<(f64, f64)> = (0..TOTAL_STEPS as usize)
            .map(|step| {
                let batch: Vec<SampleRef> = rank_slice(step, rank, 2)
                    .map(|i| rank_samples.get(i))
                    .collect();
                let st = global_step(&mut s, &batch).unwrap();
                assert!(!st.skipped);
                (st.loss, st.grad_norm)
            })
            .collect();
        (curve, s.engine.store_mut().full_trainable_params().unwrap())
    })
}

#[test]
fn lora_training_matches_peft_in_one_process_and_sharded_over_two_ranks() {
    let Some(py) = venv_python() else { return };
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let settings = write_settings(d);
    let count = LOGIT_SAMPLES.to_string();
    let samples = (GLOBAL_BATCH * TOTAL_STEPS as usize).to_string();
    let args = [
        "train",
        "--out",
        d.to_str().unwrap(),
        "--settings",
        settings.to_str().unwrap(),
        "--count",
        &count,
        "--samples",
        &samples,
    ];
    let mut peft = ReferenceSession::start(&py, "peft_reference.py", &args, &d.join("python.log"));
    let want = reference_curve(&d.join("reference.json"));
    let samples = read_samples(&d.join("data.json"));

    let model_dir = d.join("model");
    let (spec, cfg, layout, params) = start_adapter(&model_dir, &d.join("adapter_start"));

    // (a) One process.
    let mut store = LocalParams::new(layout.clone(), copies(&params), Kind::Float);
    let optimizer = AdamW::new(adam(), store.master_and_grads().0);
    let mut s = stepper(&cfg, store, optimizer, MICRO, false, 0);
    let local: Vec<(f64, f64)> = (0..TOTAL_STEPS as usize)
        .map(|step| {
            let st = s.step(&global_batch(&samples, step)).unwrap();
            assert!(!st.skipped);
            (st.loss, st.grad_norm)
        })
        .collect();
    let (loss_diff, norm_diff) = compare_curves("one process", &local, &want);
    let ours = d.join("ferl_adapter");
    let full = s.engine.store().master();
    lora::write_adapter(
        &ours,
        &spec,
        &layout,
        &adapters_of(&layout, full),
        model_dir.to_str().unwrap(),
    )
    .unwrap();
    assert_eq!(
        LoraSpec::from_adapter_config(&ours.join(ADAPTER_CONFIG)).unwrap(),
        spec
    );
    let adapter_diff = compare_adapters("one process", &ours, &d.join("adapter_trained"));

    let merge_diff = compare_merge(&layout, full, &d.join("merged.safetensors"));

    peft.request(ours.to_str().unwrap());
    let logit_diff = compare_logits(&mut s, &samples, &read_f32s(&ours.join("logits.bin")));
    drop(peft);

    // (b) Two ranks, each with half of every global batch in micro-batches of one, FULL_SHARD, checkpointing on.
    let ranks = train_two_ranks(&layout, &cfg, params, samples);
    let mut fsdp = (0.0f64, 0.0f64, 0.0f64);
    for (rank, (curve, adapters)) in ranks.into_iter().enumerate() {
        let what = format!("rank {rank} of 2");
        let (l, n) = compare_curves(&what, &curve, &want);
        let ours = d.join(format!("ferl_adapter_rank{rank}"));
        lora::write_adapter(
            &ours,
            &spec,
            &layout,
            &adapters,
            model_dir.to_str().unwrap(),
        )
        .unwrap();
        let a = compare_adapters(&what, &ours, &d.join("adapter_trained"));
        fsdp = (fsdp.0.max(l), fsdp.1.max(n), fsdp.2.max(a));
    }
    println!(
        "SUMMARY max differences to peft: one process loss {loss_diff:.2e} rel, grad norm {norm_diff:.2e} rel, \
         adapter {adapter_diff:.2e}, merged {merge_diff:.2e}, logits {logit_diff:.2e}; two ranks loss {:.2e} rel, \
         grad norm {:.2e} rel, adapter {:.2e}",
        fsdp.0, fsdp.1, fsdp.2
    );
}

/// Checks `A / (1/√in)` of every `A` of `tensors` (named as `layout`'s adapters, with `prefix`) is uniform in ±1 and
/// every `B` is zero: what Kaiming-uniform with `a = √5` and peft's zero `B` give.
fn assert_peft_init(
    what: &str,
    layout: &ModelLayout,
    tensors: &HashMap<String, Tensor>,
    prefix: &str,
) {
    let mut normalised = Vec::new();
    for (name, shape) in &layout.tensors[layout.base_len()..] {
        let t = tensors
            .get(&format!("{prefix}{name}"))
            .unwrap_or_else(|| panic!("{what}: no `{prefix}{name}`"));
        assert_eq!(&t.size(), shape, "{what}: shape of `{name}`");
        if name.ends_with("lora_B.weight") {
            assert_eq!(
                t.abs().max().double_value(&[]),
                0.0,
                "{what}: `{name}` is zero"
            );
        } else {
            let bound = 1.0 / (shape[1] as f64).sqrt();
            normalised.push(t.to_kind(Kind::Double).flatten(0, -1) / bound);
        }
    }
    let all = Tensor::cat(&normalised, 0);
    let (max, mean) = (
        all.abs().max().double_value(&[]),
        all.mean(Kind::Double).double_value(&[]),
    );
    let var = all.square().mean(Kind::Double).double_value(&[]);
    println!("{what}: A·√in over {} values: max |x| {max:.4}, mean {mean:.4}, E[x²] {var:.4} (uniform ±1: 1/3)", all.numel());
    assert!(
        max <= 1.0 && max > 0.99,
        "{what}: A spans ±1/√in (max |A|·√in = {max})"
    );
    assert!(mean.abs() < 0.03, "{what}: A is centred (mean {mean})");
    assert!(
        (var * 3.0 - 1.0).abs() < 0.05,
        "{what}: E[(A·√in)²] = {var}, uniform ±1 gives 1/3"
    );
}

#[test]
fn a_fresh_adapter_follows_peft_init_and_starts_at_the_base_loss() {
    let Some(py) = venv_python() else { return };
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let settings = write_settings(d);
    let args = [
        "fresh",
        "--out",
        d.to_str().unwrap(),
        "--settings",
        settings.to_str().unwrap(),
        "--samples",
        &GLOBAL_BATCH.to_string(),
    ];
    run_script(&py, "peft_reference.py", &args);
    let peft_loss = reference_curve(&d.join("reference.json"))[0].0;
    let samples = read_samples(&d.join("data.json"));
    let fresh = d.join("adapter_fresh");
    let spec = LoraSpec::from_adapter_config(&fresh.join(ADAPTER_CONFIG)).unwrap();
    let base = load_model(&d.join("model")).unwrap();
    let cfg = base.config.clone();
    let (layout, params) = lora::with_adapters(
        &cfg,
        base.layout.clone(),
        copies(&base.params),
        &spec,
        None,
        5,
    )
    .unwrap();
    assert_eq!(
        layout.lora_pairs().len(),
        7 * cfg.num_layers,
        "all-linear: 7 projections per layer"
    );
    let ours: HashMap<String, Tensor> = layout.tensors[layout.base_len()..]
        .iter()
        .zip(adapters_of(&layout, &params))
        .map(|((name, _), t)| (name.clone(), t))
        .collect();
    assert_peft_init("ferl", &layout, &ours, "");
    let theirs = adapter_tensors(&fresh);
    assert_eq!(
        theirs.len(),
        ours.len(),
        "peft's fresh adapter has ferl's tensors"
    );
    assert_peft_init("peft", &layout, &theirs, PEFT_PREFIX);

    let first_loss = |layout: ModelLayout, params: Vec<Tensor>| {
        let mut store = LocalParams::new(layout, params, Kind::Float);
        let optimizer = AdamW::new(adam(), store.master_and_grads().0);
        let mut s = stepper(&cfg, store, optimizer, MICRO, false, 0);
        s.step(&global_batch(&samples, 0)).unwrap().loss
    };
    let lora_loss = first_loss(layout, params);
    let base_loss = first_loss(base.layout, base.params);
    println!("step 1: LoRA {lora_loss}, base {base_loss}, peft {peft_loss}");
    assert_eq!(
        lora_loss, base_loss,
        "B = 0: step 1's loss is exactly the base model's"
    );
    assert!(
        (lora_loss - peft_loss).abs() <= 1e-4 * peft_loss.abs(),
        "step 1: ferl {lora_loss} vs peft {peft_loss}"
    );
}

/// A fresh adapter written by ferl (never made by peft): `spec` on the tiny model, `A` from peft's init and every `B`
/// seeded nonzero so the adapter changes the logits; returns the stepper holding it.
fn fresh_ferl_adapter(model_dir: &Path, spec: &LoraSpec, out: &Path) -> Stepper<LocalParams> {
    let base = load_model(model_dir).unwrap();
    let cfg = base.config.clone();
    let (layout, mut params) =
        lora::with_adapters(&cfg, base.layout, base.params, spec, None, 11).unwrap();
    let _g = tch::no_grad_guard();
    for (i, (name, shape)) in layout.tensors.iter().enumerate() {
        if name.ends_with("lora_B.weight") {
            let b = weights::seeded(40 + i as i64, || {
                Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu))
            });
            params[i] = b * 0.05;
        }
    }
    lora::write_adapter(
        out,
        spec,
        &layout,
        &adapters_of(&layout, &params),
        model_dir.to_str().unwrap(),
    )
    .unwrap();
    let mut store = LocalParams::new(layout, params, Kind::Float);
    let optimizer = AdamW::new(adam(), store.master_and_grads().0);
    stepper(&cfg, store, optimizer, MICRO, false, 0)
}

#[test]
fn a_fresh_ferl_adapter_loads_in_peft_at_all_linear_and_at_a_module_list() {
    let Some(py) = venv_python() else { return };
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let settings = write_settings(d);
    let count = LOGIT_SAMPLES.to_string();
    let args = [
        "serve",
        "--out",
        d.to_str().unwrap(),
        "--settings",
        settings.to_str().unwrap(),
        "--count",
        &count,
    ];
    let mut peft = ReferenceSession::start(&py, "peft_reference.py", &args, &d.join("python.log"));
    let samples = read_samples(&d.join("data.json"));
    let model_dir = d.join("model");
    for (what, targets) in [
        ("all-linear", vec![lora::ALL_LINEAR]),
        ("list", vec!["q_proj", "v_proj"]),
    ] {
        let spec = LoraSpec {
            rank: 4,
            alpha: 8.0,
            targets: targets.iter().map(|t| t.to_string()).collect(),
            exclude: Vec::new(),
        };
        let out = d.join(format!("ferl_fresh_{what}"));
        let mut s = fresh_ferl_adapter(&model_dir, &spec, &out);
        peft.request(out.to_str().unwrap());
        let diff = compare_logits(&mut s, &samples, &read_f32s(&out.join("logits.bin")));
        println!("{what}: ferl's fresh adapter in peft, logits max difference {diff:.2e}");
    }
}
