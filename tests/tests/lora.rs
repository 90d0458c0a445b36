//! LoRA on every launch path: a fresh adapter (PEFT's init: zero `B`) gives exactly the base model's first loss;
//! only adapters train; runs on one process, `--nproc-per-node 2` and a cluster follow the unsharded reference;
//! checkpoints hold the adapter in PEFT's format and the merged model, and resume at another world size.

use ferl_tests::*;
use ferl_trainer::model::lora::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, CHECKPOINT_ADAPTER_DIR};
use ferl_trainer::model::{load_model, weights};

const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");
const LORA: [&str; 3] = [
    "model.lora_rank=8",
    "model.lora_alpha=16",
    "model.target_modules=all-linear",
];

fn lora_overrides(fx: &Fixture, steps: usize, ckpt: &str, extra: &[&str]) -> Vec<String> {
    let all: Vec<&str> = LORA.iter().chain(extra).copied().collect();
    fx.overrides(steps, ckpt, &all)
}

#[test]
fn a_fresh_adapter_starts_at_the_base_loss_and_every_path_matches_the_reference() {
    let fx = Fixture::new().unwrap();
    let full = reference_run(&fx.overrides(4, "full", &[])).unwrap();
    let o = lora_overrides(&fx, 4, "ref", &[]);
    let reference = reference_run(&o).unwrap();
    assert_eq!(
        reference[0].loss, full[0].loss,
        "B = 0: the first LoRA loss is the base model's"
    );
    assert!(
        (reference[3].loss - full[3].loss).abs() > 1e-4,
        "LoRA trains something different from full fine-tuning"
    );
    for (path, name) in [
        (LaunchPath::OneProcess, "one"),
        (LaunchPath::Actors(2), "actors"),
        (LaunchPath::Launcher(2), "launcher"),
    ] {
        let o = lora_overrides(&fx, 4, name, &[]);
        let run = run_path(DRIVER, fx.dir.path(), path, &o, name).unwrap();
        assert_curves_match(name, &run.steps, &reference, 1e-5);
    }
}

/// The PEFT tensors of an adapter folder, by name.
fn adapter(dir: &std::path::Path) -> std::collections::HashMap<String, tch::Tensor> {
    weights::read_tensors(&[dir.join(ADAPTER_WEIGHTS)]).unwrap()
}

fn max_diff(a: &tch::Tensor, b: &tch::Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// The saved adapter folder is PEFT's: its config (rank 8, alpha 16, `LORA`) and A and B of 7 projections in 2
/// layers, trained away from zero. Returns its tensors.
fn assert_saved_adapter(saved: &std::path::Path) -> std::collections::HashMap<String, tch::Tensor> {
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(saved.join(ADAPTER_CONFIG)).unwrap()).unwrap();
    assert_eq!(
        (config["r"].as_i64(), config["lora_alpha"].as_f64()),
        (Some(8), Some(16.0))
    );
    assert_eq!(config["peft_type"], "LORA");
    let tensors = adapter(saved);
    assert_eq!(
        tensors.len(),
        2 * 7 * 2,
        "A and B of 7 projections in 2 layers"
    );
    let b = &tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"];
    assert!(
        b.abs().max().double_value(&[]) > 0.0,
        "B trained away from zero"
    );
    tensors
}

/// `ferl export` of checkpoint `step2`: the adapter alone equals the saved one (`tensors`); the merged model has the
/// base's tensors, equals `huggingface/`, and differs from the base where adapted.
fn assert_export_matches(
    fx: &Fixture,
    step2: &std::path::Path,
    tensors: &std::collections::HashMap<String, tch::Tensor>,
) {
    let out = fx.dir.path().join("exported");
    let export = |extra: &[&str], to: &str| {
        let status = std::process::Command::new(ferl_binary())
            .args(["export", "--checkpoint"])
            .arg(step2)
            .arg("--out")
            .arg(out.join(to))
            .args(extra)
            .status()
            .unwrap();
        assert!(status.success(), "ferl export {extra:?}");
    };
    export(&["--adapter-only"], "adapter");
    for (name, t) in adapter(&out.join("adapter")) {
        assert_eq!(max_diff(&t, &tensors[&name]), 0.0, "{name}");
    }
    export(&["--merge-lora"], "merged");
    let merged = load_model(&out.join("merged")).unwrap();
    let hf = load_model(&step2.join("huggingface")).unwrap();
    let base = load_model(&fx.dir.path().join("model")).unwrap();
    assert_eq!(
        merged.layout.tensors, base.layout.tensors,
        "the merged model has the base's tensors"
    );
    let mut changed = 0.0f64;
    for ((m, h), b) in merged.params.iter().zip(&hf.params).zip(&base.params) {
        assert!(
            max_diff(m, h) < 1e-6,
            "export --merge-lora equals huggingface/"
        );
        changed = changed.max(max_diff(m, b));
    }
    assert!(changed > 0.0, "merging changed the adapted weights");
}

#[test]
fn checkpoints_hold_the_peft_adapter_and_the_merged_model_and_resume_at_another_world_size() {
    let fx = Fixture::new().unwrap();
    let reference = reference_run(&lora_overrides(&fx, 4, "ref", &[])).unwrap();
    let save = [
        "trainer.save_freq=2",
        "trainer.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ];
    let o = lora_overrides(&fx, 4, "saved", &save);
    let first = run_path(DRIVER, fx.dir.path(), LaunchPath::Actors(2), &o, "save").unwrap();
    assert_curves_match("saving at world 2", &first.steps, &reference, 1e-5);
    let step2 = fx.dir.path().join("saved/global_step_2");
    let saved = step2.join(CHECKPOINT_ADAPTER_DIR);
    let tensors = assert_saved_adapter(&saved);

    assert_export_matches(&fx, &step2, &tensors);

    // Resume the world-2 LoRA checkpoint in one process.
    let resume = lora_overrides(
        &fx,
        4,
        "resumed",
        &[
            "trainer.resume_mode=resume_path",
            &format!("trainer.resume_from_path={}", step2.display()),
        ],
    );
    let second = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::OneProcess,
        &resume,
        "resume",
    )
    .unwrap();
    assert_eq!(second.resumed_from, 2);
    assert_curves_match("world 2 -> 1", &second.steps, &reference[2..], 1e-5);
}

#[test]
fn lora_config_mistakes_are_refused_naming_the_key() {
    let fx = Fixture::new().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["model.lora_rank=8", "model.target_modules=[q_proj,lm_head]"],
            "`lm_head` is not supported",
        ),
        (
            &["model.lora_rank=8", "model.target_modules=[qproj]"],
            "`qproj` matches no module",
        ),
        (
            &[
                "model.lora_rank=8",
                "model.target_modules=[model.layers.0.self_attn.q_proj]",
            ],
            "adapt different projections in layer 0 and layer 1",
        ),
        (
            &["model.lora_adapter_path=/nonexistent/adapter"],
            "model.lora_adapter_path=/nonexistent/adapter",
        ),
    ];
    for (i, (extra, want)) in cases.into_iter().enumerate() {
        let o = fx.overrides(1, &format!("bad{i}"), extra);
        let err = run_path(
            DRIVER,
            fx.dir.path(),
            LaunchPath::OneProcess,
            &o,
            &format!("bad{i}"),
        )
        .err()
        .unwrap_or_default();
        assert!(err.contains(want), "{extra:?}: expected `{want}` in: {err}");
    }
}

#[test]
fn lora_works_with_every_strategy_checkpointing_packing_and_liger() {
    let fx = Fixture::new().unwrap();
    let variants: [(&[&str], f64); 3] = [
        (
            &[
                "model.fsdp_config.reshard_after_forward=false",
                "model.enable_gradient_checkpointing=true",
            ],
            1e-5,
        ),
        (
            &["model.fsdp_config.fsdp_size=1", "use_remove_padding=true"],
            1e-5,
        ),
        (
            &[
                "model.use_liger=true",
                "model.enable_gradient_checkpointing=true",
            ],
            1e-4,
        ),
    ];
    for (i, (extra, rel)) in variants.into_iter().enumerate() {
        let o = lora_overrides(&fx, 3, &format!("v{i}"), extra);
        let reference = reference_run(&o).unwrap();
        let run = run_path(
            DRIVER,
            fx.dir.path(),
            LaunchPath::Actors(2),
            &o,
            &format!("v{i}"),
        )
        .unwrap_or_else(|e| panic!("{extra:?}: {e}"));
        assert_curves_match(&format!("{extra:?}"), &run.steps, &reference, rel);
    }
}
