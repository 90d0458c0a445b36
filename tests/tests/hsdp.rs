//! HSDP end to end on the CPU (issue #13): `model.fsdp_config.fsdp_size=2` at world 4 shards the model within two
//! groups of 2 ranks and replicates it across them, and trains the one-process curves within 1e-5 (fp32, 6 steps)
//! on the actor and launcher paths, with Ulysses sequence parallelism too; its checkpoints are those of a 2-rank run
//! and resume at world 2 (plain FULL_SHARD) with the uninterrupted curve. A size that does not divide the ranks is
//! refused naming `fsdp_size`, in the same words on every path.

use ferl_actors::sft::StepRecord;
use ferl_tests::*;

const REL: f64 = 1e-5;
const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");
const HSDP: &str = "model.fsdp_config.fsdp_size=2";

/// The largest relative difference of loss, gradient norm and learning rate between two curves.
fn worst(got: &[StepRecord], want: &[StepRecord]) -> f64 {
    got.iter()
        .zip(want)
        .flat_map(|(g, w)| {
            [(g.loss, w.loss), (g.grad_norm, w.grad_norm), (g.lr, w.lr)]
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
        })
        .fold(0.0, f64::max)
}

fn check(what: &str, got: &[StepRecord], want: &[StepRecord]) {
    assert_curves_match(what, got, want, REL);
    eprintln!(
        "{what}: largest relative difference {:.2e}",
        worst(got, want)
    );
}

#[test]
fn hsdp_at_world_4_matches_one_process_and_its_checkpoint_resumes_at_world_2() {
    let fx = Fixture::new().unwrap();
    let reference =
        reference_run(&fx.overrides(6, "ref", &["trainer.resume_mode=disable"])).unwrap();
    assert!(reference[5].loss < reference[0].loss, "{reference:?}");
    let saving = fx.overrides(
        6,
        "ckpt",
        &[HSDP, "trainer.save_freq=3", "trainer.resume_mode=disable"],
    );
    let run4 = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::Actors(4),
        &saving,
        "hsdp4",
    )
    .unwrap_or_else(|e| panic!("HSDP at world 4 failed: {e}"));
    assert_eq!(run4.world_size, 4);
    check(
        "actor path, fsdp_size=2 at world 4",
        &run4.steps,
        &reference,
    );
    let plain = fx.overrides(6, "launcher", &[HSDP, "trainer.resume_mode=disable"]);
    let launched = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::Launcher(4),
        &plain,
        "hsdp4-env",
    )
    .unwrap_or_else(|e| panic!("HSDP under the launcher failed: {e}"));
    check(
        "launcher path, fsdp_size=2 at world 4",
        &launched.steps,
        &reference,
    );
    // The first shard group wrote a 2-rank checkpoint; the other wrote nothing.
    let step3 = fx.dir.path().join("ckpt/global_step_3");
    let mut files: Vec<String> = std::fs::read_dir(&step3)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "model_world_size_2_rank_0.safetensors",
            "model_world_size_2_rank_1.safetensors",
            "optim_world_size_2_rank_0.safetensors",
            "optim_world_size_2_rank_1.safetensors",
        ]
    );
    let resume = fx.overrides(
        6,
        "out-resume2",
        &[
            "trainer.resume_mode=resume_path",
            &format!("trainer.resume_from_path={}", step3.display()),
        ],
    );
    let got = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::Actors(2),
        &resume,
        "resume2",
    )
    .unwrap_or_else(|e| panic!("resume at world 2 failed: {e}"));
    assert_eq!(got.resumed_from, 3);
    check(
        "HSDP checkpoint resumed at world 2 (FULL_SHARD)",
        &got.steps,
        &reference[3..],
    );
}

#[test]
fn hsdp_with_sequence_parallelism_matches_one_process() {
    let fx = Fixture::new().unwrap();
    let model = fx.dir.path().join("model4");
    write_tiny_model_with_heads(&model, 4, 2).unwrap();
    let model = format!("model.partial_pretrain={}", model.display());
    let base = [
        "trainer.resume_mode=disable",
        "use_remove_padding=true",
        model.as_str(),
    ];
    let reference = reference_run(&fx.overrides(6, "ref", &base)).unwrap();
    let mut keys = base.to_vec();
    keys.extend([HSDP, "ulysses_sequence_parallel_size=2"]);
    let o = fx.overrides(6, "sp-hsdp", &keys);
    let got = run_path(DRIVER, fx.dir.path(), LaunchPath::Actors(4), &o, "sp-hsdp")
        .unwrap_or_else(|e| panic!("HSDP with SP at world 4 failed: {e}"));
    check(
        "actor path, fsdp_size=2 and ulysses_sequence_parallel_size=2 at world 4",
        &got.steps,
        &reference,
    );
    // A size that does not divide the ranks is refused before anything starts.
    let bad = fx.overrides(6, "bad", &["model.fsdp_config.fsdp_size=3"]);
    let err = run_path(DRIVER, fx.dir.path(), LaunchPath::Actors(4), &bad, "bad").unwrap_err();
    assert!(
        err.contains("model.fsdp_config.fsdp_size=3") && err.contains("number of ranks"),
        "{err}"
    );
}
