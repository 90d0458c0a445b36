//! Every run leaves a picture: `ferl sft` (one process and 2 ranks) writes `curves.png` beside its metrics when it
//! ends and says where it is (`ferl grpo`'s: `grpo_cli.rs`); `ferl plot` draws any run folder's
//! `metrics.jsonl` to a PNG or an SVG, and refuses a metric the run never logged by name.

use std::path::Path;

use ferl_tests::*;

use ferl_tests::output_text as text;

/// A PNG with something drawn on it: its signature, and more bytes than a blank canvas of its size compresses to.
fn assert_drawn_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        path.display()
    );
    assert!(
        bytes.len() > 15_000,
        "{}: {} bytes, a blank picture?",
        path.display(),
        bytes.len()
    );
}

#[test]
fn sft_runs_in_one_process_and_on_two_ranks_leave_their_curves() {
    let fx = Fixture::new().unwrap();
    for (name, extra) in [("one", vec![]), ("two", vec!["--nproc-per-node", "2"])] {
        let mut args = vec!["sft".to_string()];
        args.extend(fx.overrides(4, name, &["trainer.logger=[console,jsonl]"]));
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = run_ferl(&args);
        assert!(out.status.success(), "{name}: {}", text(&out));
        let curves = fx.dir.path().join(name).join("curves.png");
        assert_drawn_png(&curves);
        let said = format!("curves: {}", curves.display());
        assert!(
            text(&out).contains(&said),
            "{name} did not say `{said}`: {}",
            text(&out)
        );
    }
    let run = fx.dir.path().join("one");
    let svg = fx.dir.path().join("loss.svg");
    let plot = |metrics: &str, out: &Path| {
        let at = |p: &Path| p.display().to_string();
        run_ferl(&[
            "plot".into(),
            at(&run),
            "--metrics".into(),
            metrics.into(),
            "--out".into(),
            at(out),
        ])
    };
    let out = plot("train/loss,train/lr", &svg);
    assert!(out.status.success(), "{}", text(&out));
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(
        drawn.contains("train/loss") && drawn.contains("train/lr"),
        "{drawn}"
    );
    let out = plot("val/acc", &fx.dir.path().join("x.png"));
    assert!(!out.status.success());
    assert!(
        text(&out).contains("the run logged no `val/acc`"),
        "{}",
        text(&out)
    );
}
