//! Ulysses sequence parallelism end to end on the CPU (issue #13): `ulysses_sequence_parallel_size=K` with
//! remove-padding trains the same loss and gradient-norm curves as the one-process reference within 1e-5 (fp32,
//! 6 steps): SP 2 at world 2, SP 2 at world 4 (data parallelism 2), SP 4 at world 4 (the tiny model's 2 KV heads
//! repeated to 4) on the actor path, and SP 2 at world 2 on the launcher path; with gradient checkpointing too, and
//! with LoRA and the liger kernels.
//! A size that does not divide the ranks is refused naming the key; one that does not divide the model's heads is
//! refused naming both numbers. The model has 4 query heads and 2 KV heads.

use ferl_tests::*;

const REL: f64 = 1e-5;
const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");

/// The fixture's runs over a model with 4 query heads and 2 KV heads (so groups of 2 and 4 ranks split them).
fn overrides(fx: &Fixture, tag: &str, extra: &[&str]) -> Vec<String> {
    let model = fx.dir.path().join("model4");
    if !model.exists() {
        write_tiny_model_with_heads(&model, 4, 2).unwrap();
    }
    let model = format!("model.partial_pretrain={}", model.display());
    let mut all = vec![
        "trainer.resume_mode=disable",
        "use_remove_padding=true",
        &model,
    ];
    all.extend(extra);
    fx.overrides(6, tag, &all)
}

#[test]
fn sequence_parallel_runs_match_the_one_process_curves() {
    let fx = Fixture::new().unwrap();
    let reference = reference_run(&overrides(&fx, "ref", &[])).unwrap();
    assert!(reference[5].loss < reference[0].loss, "{reference:?}");
    let cases: [(LaunchPath, &str, &[&str]); 4] = [
        (LaunchPath::Actors(2), "2", &[]),
        (LaunchPath::Actors(4), "2", &[]),
        (
            LaunchPath::Actors(4),
            "4",
            &["model.enable_gradient_checkpointing=true"],
        ),
        (LaunchPath::Launcher(2), "2", &[]),
    ];
    for (path, k, extra) in cases {
        let sp = format!("ulysses_sequence_parallel_size={k}");
        let mut keys = vec![sp.as_str()];
        keys.extend(extra);
        let tag = format!("sp{k}-{path:?}").replace(['(', ')'], "");
        let got = run_path(
            DRIVER,
            fx.dir.path(),
            path,
            &overrides(&fx, &tag, &keys),
            &tag,
        )
        .unwrap_or_else(|e| panic!("{tag} failed: {e}"));
        assert_curves_match(
            &format!("{path:?}, {sp} {extra:?}"),
            &got.steps,
            &reference,
            REL,
        );
    }
}

/// LoRA adapters (base frozen) and the liger kernels (the layer split at replaced ops) under SP 2 at world 2.
#[test]
fn sequence_parallel_with_lora_and_liger_matches_the_one_process_curves() {
    let fx = Fixture::new().unwrap();
    let keys = [
        "model.lora_rank=8",
        "model.lora_alpha=16",
        "model.target_modules=all-linear",
        "model.use_liger=true",
    ];
    let reference = reference_run(&overrides(&fx, "ref", &keys)).unwrap();
    let mut sp = keys.to_vec();
    sp.push("ulysses_sequence_parallel_size=2");
    let o = overrides(&fx, "lora", &sp);
    let got = run_path(DRIVER, fx.dir.path(), LaunchPath::Actors(2), &o, "lora")
        .unwrap_or_else(|e| panic!("SP 2 with LoRA and liger failed: {e}"));
    assert_curves_match("SP 2, LoRA, liger", &got.steps, &reference, REL);
}

#[test]
fn sizes_that_do_not_split_are_refused_naming_both_numbers() {
    let fx = Fixture::new().unwrap();
    let o = overrides(&fx, "bad", &["ulysses_sequence_parallel_size=2"]);
    let err = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::Actors(3),
        &o,
        "bad-ranks",
    )
    .unwrap_err();
    assert!(
        err.contains("ulysses_sequence_parallel_size=2") && err.contains("number of ranks"),
        "{err}"
    );
    let o = overrides(&fx, "bad", &["ulysses_sequence_parallel_size=3"]);
    let err = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::Actors(3),
        &o,
        "bad-heads",
    )
    .unwrap_err();
    let heads = "num_attention_heads=4";
    assert!(
        err.contains("ulysses_sequence_parallel_size=3") && err.contains(heads),
        "{err}"
    );
}
