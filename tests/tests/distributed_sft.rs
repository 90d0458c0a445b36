//! Distributed SFT end to end on the CPU: the actor path (`--nproc-per-node`) and the external-launcher path
//! (torchrun-style environment) against the single-process trainer, and save/resume across world sizes.

use ferl_actors::sft::RunSummary;
use ferl_tests::*;

const REL: f64 = 1e-5;

const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");

fn run(fx: &Fixture, path: LaunchPath, overrides: &[String], tag: &str) -> RunSummary {
    run_path(DRIVER, fx.dir.path(), path, overrides, tag)
        .unwrap_or_else(|e| panic!("{tag} ({path:?}) failed: {e}"))
}

fn run_actor_path(fx: &Fixture, nproc: usize, overrides: &[String], tag: &str) -> RunSummary {
    run(fx, LaunchPath::Actors(nproc), overrides, tag)
}

/// verl's `model.fsdp_config` keys selecting each sharding strategy.
const STRATEGIES: &[(&str, &str, &[usize])] = &[
    (
        "FULL_SHARD",
        "model.fsdp_config.reshard_after_forward=true",
        &[1, 2, 4],
    ),
    (
        "SHARD_GRAD_OP",
        "model.fsdp_config.reshard_after_forward=false",
        &[2, 4],
    ),
    ("NO_SHARD", "model.fsdp_config.fsdp_size=1", &[2, 4]),
];

#[test]
fn actor_path_matches_single_process_for_each_strategy_and_world_size() {
    let fx = Fixture::new().unwrap();
    let reference =
        reference_run(&fx.overrides(3, "ref", &["trainer.resume_mode=disable"])).unwrap();
    assert!(
        reference.iter().all(|r| r.loss.is_finite() && r.loss > 1.0),
        "{reference:?}"
    );
    assert!(
        reference[2].loss < reference[0].loss,
        "the loss should fall: {reference:?}"
    );
    for &(name, key, worlds) in STRATEGIES {
        let o = fx.overrides(3, "ckpt", &["trainer.resume_mode=disable", key]);
        for &world in worlds {
            let got = run_actor_path(&fx, world, &o, &format!("{name}-w{world}"));
            assert_eq!(got.world_size, world);
            assert_curves_match(
                &format!("actor path, {name}, world size {world}"),
                &got.steps,
                &reference,
                REL,
            );
        }
    }
}

#[test]
fn launcher_env_path_matches_single_process() {
    let fx = Fixture::new().unwrap();
    let o = fx.overrides(3, "ckpt", &["trainer.resume_mode=disable"]);
    let reference = reference_run(&o).unwrap();
    let got = run(&fx, LaunchPath::Launcher(2), &o, "env");
    assert_eq!(got.world_size, 2);
    assert_curves_match("launcher path, rank 0", &got.steps, &reference, REL);
}

#[test]
fn save_at_world_size_4_resume_at_2_and_1_matches_uninterrupted() {
    let fx = Fixture::new().unwrap();
    let full = fx.overrides(4, "full", &["trainer.resume_mode=disable"]);
    let reference = reference_run(&full).unwrap();
    // An uninterrupted run at world size 4 that saves every 2 steps.
    let saving = fx.overrides(
        4,
        "ckpt",
        &["trainer.save_freq=2", "trainer.resume_mode=disable"],
    );
    let run4 = run_actor_path(&fx, 4, &saving, "save4");
    let ckpt = fx.dir.path().join("ckpt");
    assert_eq!(run4.last_checkpoint, Some(ckpt.join("global_step_4")));
    assert_curves_match("saving run at world size 4", &run4.steps, &reference, REL);
    let latest = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap();
    assert_eq!(latest.trim(), "4");
    let step2 = ckpt.join("global_step_2");
    for file in [
        "meta.json",
        "fsdp_meta.json",
        "model_world_size_4_rank_3.safetensors",
        "optim_world_size_4_rank_0.safetensors",
    ] {
        assert!(step2.join(file).exists(), "global_step_2 lacks {file}");
    }
    // Resume from step 2 with fewer ranks: steps 3 and 4 must match the uninterrupted run.
    for (world, tag) in [(2, "resume2"), (1, "resume1")] {
        let resume = fx.overrides(
            4,
            &format!("out-{tag}"),
            &[
                "trainer.resume_mode=resume_path",
                &format!("trainer.resume_from_path={}", step2.display()),
            ],
        );
        let got = run_actor_path(&fx, world, &resume, tag);
        assert_eq!(got.resumed_from, 2, "world size {world}");
        assert_curves_match(
            &format!("resumed at world size {world}"),
            &got.steps,
            &reference[2..],
            REL,
        );
    }
}
