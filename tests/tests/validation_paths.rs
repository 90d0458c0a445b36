//! Validation on every launch path runs in calls of a few micro-batch rounds (so that its rows are reported as it
//! goes) and gives the one-process loss: shards of unequal length, calls of more than one round, and a last call in
//! which one rank has no row left.

use ferl_actors::sft::RunSummary;
use ferl_tests::*;

const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");

/// 261 rows on 2 ranks of 2-row micro-batches: shards of 131 and 130 rows, 66 rounds, 33 calls of 2 rounds.
const VAL_ROWS: usize = 261;

fn run(fx: &Fixture, path: LaunchPath, overrides: &[String], tag: &str) -> RunSummary {
    run_path(DRIVER, fx.dir.path(), path, overrides, tag)
        .unwrap_or_else(|e| panic!("{tag} ({path:?}) failed: {e}"))
}

#[test]
fn every_path_validates_every_row_to_the_same_loss() {
    let fx = Fixture::new().unwrap();
    let val = fx.dir.path().join("val.jsonl");
    write_gsm8k_slice(&val, VAL_ROWS).unwrap();
    let val_files = format!("data.val_files={}", val.display());
    let mut losses = Vec::new();
    for (i, path) in [
        LaunchPath::OneProcess,
        LaunchPath::Actors(2),
        LaunchPath::Launcher(2),
    ]
    .into_iter()
    .enumerate()
    {
        let keys = fx.overrides(
            1,
            &format!("val{i}"),
            &[&val_files, "trainer.resume_mode=disable"],
        );
        let summary = run(&fx, path, &keys, &format!("val{i}"));
        assert_eq!(summary.val_losses.len(), 1, "{path:?}: one validation");
        let (step, loss) = summary.val_losses[0];
        assert_eq!(step, 1, "{path:?}");
        assert!(loss.is_finite() && loss > 1.0, "{path:?}: {loss}");
        losses.push((path, loss));
    }
    let (_, want) = losses[0];
    for (path, loss) in &losses[1..] {
        let err = (loss - want).abs() / want;
        assert!(
            err <= 1e-5,
            "{path:?}: val/loss {loss} vs one process {want} (relative error {err:e})"
        );
    }
}
