//! Crash-safe checkpoints: a one-process run SIGKILLed at 20 moments in or around its checkpoint saves always leaves
//! the newest complete checkpoint loadable (its files verify against `meta.json`, the latest pointer names a
//! complete one), and the run resumed after the last kill trains the uninterrupted run's losses.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use ferl_config::SftConfig;
use ferl_tests::*;
use ferl_trainer::checkpoint::{complete_steps, latest_step, resume_dir, verify};

const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");
const KILLS: usize = 20;
const STEPS: usize = 24;

/// The newest `global_step_N` folder under `root` (complete or not).
fn newest_folder(root: &Path) -> u64 {
    std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    name.strip_prefix("global_step_")?.parse().ok()
                })
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}

/// How long after a save began the `kill`th kill lands: even kills within 2 ms (inside the save however fast the
/// machine writes), odd kills anywhere in 0-300 ms (inside a save, between saves or inside a training step).
fn kill_delay(kill: usize, seed: u64) -> Duration {
    let window_us = if kill.is_multiple_of(2) {
        2_000
    } else {
        300_000
    };
    Duration::from_micros((seed >> 33) % window_us)
}

/// Starts the run (resuming from whatever is there) and kills it `delay` after its next save began.
fn run_and_kill(overrides: &[String], root: &Path, delay: Duration) -> bool {
    let before = newest_folder(root);
    let mut child: Child = driver_command(DRIVER)
        .arg("--one-process")
        .args(overrides)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the driver");
    let deadline = Instant::now() + Duration::from_secs(60);
    while newest_folder(root) == before {
        if child.try_wait().unwrap().is_some() || Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    std::thread::sleep(delay);
    child.kill().ok();
    child.wait().unwrap();
    true
}

#[test]
fn kills_during_saves_always_leave_a_loadable_checkpoint_and_the_same_losses() {
    let fx = Fixture::new().unwrap();
    let full = fx.overrides(STEPS, "full", &["trainer.resume_mode=disable"]);
    let reference = reference_run(&full).unwrap();
    let o = fx.overrides(
        STEPS,
        "killed",
        &["trainer.save_freq=1", "trainer.max_ckpt_to_keep=3"],
    );
    let cfg = SftConfig::load(None, &o).unwrap();
    let root = fx.dir.path().join("killed");
    let mut seed = 12345u64;
    let (mut kills, mut mid_save) = (0, 0);
    while kills < KILLS {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let delay = kill_delay(kills, seed);
        if !run_and_kill(&o, &root, delay) {
            break;
        }
        kills += 1;
        let complete = complete_steps(&root).unwrap();
        if complete.last().copied().unwrap_or(0) < newest_folder(&root) {
            mid_save += 1;
        }
        let Some(pointed) = latest_step(&root).unwrap() else {
            continue;
        };
        assert!(
            complete_steps(&root).unwrap().contains(&pointed),
            "kill {kills}: the latest pointer names step {pointed}, which is not complete"
        );
        let dir = resume_dir(&cfg)
            .unwrap()
            .expect("a checkpoint to resume from");
        verify(&dir).unwrap_or_else(|e| panic!("kill {kills}: {e:#}"));
    }
    assert_eq!(kills, KILLS, "the run finished before {KILLS} kills");
    println!("{mid_save} of {KILLS} kills left a checkpoint folder without its meta.json");
    assert!(
        mid_save >= 3,
        "only {mid_save} kills landed inside a save: the test no longer tests saves"
    );
    let resumed_from = latest_step(&root).unwrap().unwrap_or(0);
    let last = run_path(
        DRIVER,
        fx.dir.path(),
        LaunchPath::OneProcess,
        &o,
        "after-kills",
    )
    .unwrap();
    assert_eq!(last.resumed_from, resumed_from);
    assert_curves_match(
        "after 20 kills",
        &last.steps,
        &reference[resumed_from as usize..],
        1e-5,
    );
}
