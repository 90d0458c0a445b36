//! `ferl sft` itself (the `ferl` binary of the `ferl` package) launched both ways a verl user would: with
//! `--nproc-per-node 2`, and as two ranks under a torchrun-style environment. The per-step losses it logs to
//! `metrics.jsonl` must match the single-process trainer.

use std::path::Path;
use std::process::{Command, Output};

use ferl_tests::*;

fn check(out: Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `(step, train/loss, train/grad_norm)` rows of `dir/metrics.jsonl`.
fn logged_curve(dir: &Path) -> Vec<(u64, f64, f64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["train/loss"].as_f64().unwrap(),
                v["train/grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn assert_logged_matches(what: &str, dir: &Path, fx_reference: &[ferl_actors::sft::StepRecord]) {
    let got = logged_curve(dir);
    assert_eq!(got.len(), fx_reference.len(), "{what}: logged steps");
    for ((step, loss, gn), r) in got.iter().zip(fx_reference) {
        assert_eq!(*step, r.step, "{what}");
        for (name, a, b) in [("loss", *loss, r.loss), ("grad_norm", *gn, r.grad_norm)] {
            let err = (a - b).abs() / b.abs();
            assert!(
                err <= 1e-5,
                "{what}: step {step} {name} {a} vs {b} (relative error {err:e})"
            );
        }
    }
}

#[test]
fn ferl_sft_nproc_per_node_and_torchrun_env_match_single_process() {
    let ferl = ferl_binary();
    let fx = Fixture::new().unwrap();
    let extra = [
        "trainer.resume_mode=disable",
        "trainer.logger=[console,jsonl]",
    ];
    let reference = reference_run(&fx.overrides(2, "ref", &extra)).unwrap();

    let mut actors = fx.overrides(2, "actors", &extra);
    actors.push("trainer.save_freq=2".into());
    // No OMP_NUM_THREADS: the ranks split the host's cores between them, as torchrun users expect, and say so.
    let sessions = fx.dir.path().join("sessions");
    let out = Command::new(&ferl)
        .env_remove("OMP_NUM_THREADS")
        .env("FERL_TMPDIR", &sessions)
        .env_remove("FERL_KEEP_SESSION")
        .args(["sft", "--nproc-per-node", "2"])
        .args(&actors)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    check(out, "ferl sft --nproc-per-node 2");
    assert_no_session_left(&sessions);
    assert_threads_split_the_cores(&stdout);
    assert_logged_matches(
        "ferl sft --nproc-per-node 2",
        &fx.dir.path().join("actors"),
        &reference,
    );

    assert_exports_with_its_tokenizer(&ferl, fx.dir.path());

    sft_as_two_env_ranks(&ferl, &fx.overrides(2, "torchrun", &extra));
    assert_logged_matches(
        "ferl sft under torchrun variables",
        &fx.dir.path().join("torchrun"),
        &reference,
    );
}

/// The 2 ranks on this host split its cores, with no OMP_NUM_THREADS set, and the run said so.
fn assert_threads_split_the_cores(stdout: &str) {
    let cores = std::thread::available_parallelism().unwrap().get();
    let threads = (cores / 2).max(1);
    let line = format!(
        "trainer ranks [0, 1] on node-1: {threads} intra-op thread{} per rank ({cores} cores / 2 ranks on its host",
        if threads == 1 { "" } else { "s" }
    );
    assert!(stdout.contains(&line), "no `{line}` in:\n{stdout}");
}

/// The sharded checkpoint under `root/actors` exports to a Hugging Face folder whose tokenizer round-trips a
/// sentence.
fn assert_exports_with_its_tokenizer(ferl: &Path, root: &Path) {
    // The sharded checkpoint it left exports to a Hugging Face folder: alone (the tokenizer kept in the checkpoint's
    // huggingface/ folder) and with the tokenizer files copied from the model.
    let model = root.join("model");
    for copy_from in [None, Some(model.as_path())] {
        let hf = root.join(format!("actors-hf-{}", copy_from.is_some()));
        let mut export = Command::new(ferl);
        export
            .arg("export")
            .arg("--checkpoint")
            .arg(root.join("actors/global_step_2"))
            .arg("--out")
            .arg(&hf);
        if let Some(dir) = copy_from {
            export.arg("--copy-from").arg(dir);
        }
        check(
            export.output().unwrap(),
            "ferl export of a sharded checkpoint",
        );
        for file in ["config.json", "model.safetensors", "tokenizer.json"] {
            let len = std::fs::metadata(hf.join(file))
                .map(|m| m.len())
                .unwrap_or(0);
            assert!(
                len > 0,
                "the export (--copy-from {copy_from:?}) lacks {file}"
            );
        }
        let sentence = "Natalia sold 48 clips in April.";
        let tokenizer = ferl_data::tokenizer::SftTokenizer::from_dir(&hf, None).unwrap();
        let ids = tokenizer.encode(sentence).unwrap();
        assert!(
            ids.len() > 3,
            "the export's tokenizer encodes the sentence: {ids:?}"
        );
        assert_eq!(
            tokenizer.decode(&ids).unwrap(),
            sentence,
            "the export's tokenizer round-trips"
        );
    }
}

/// An embedded cluster that shut down cleanly took its session folder (token, worker logs) under `root` with it.
fn assert_no_session_left(root: &Path) {
    let left: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with("session_"))
        .collect();
    assert!(left.is_empty(), "session folders left behind: {left:?}");
}

/// `ferl sft keys` (2 steps) as ranks 0 and 1 of a torchrun-style environment; only rank 0 prints the summary.
fn sft_as_two_env_ranks(ferl: &Path, keys: &[String]) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let secret = job_secret_hex();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(ferl)
                .env("OMP_NUM_THREADS", "1")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("FERL_JOB_SECRET", &secret)
                .env("MASTER_PORT", port.to_string())
                .arg("sft")
                .args(keys)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        check(out, &format!("ferl sft as torchrun rank {rank}"));
        // Every rank's summary is the same: only rank 0 reports it.
        assert_eq!(
            stdout.contains("trained steps 1..2 on 2 rank(s)"),
            rank == 0,
            "rank {rank}'s output:\n{stdout}"
        );
    }
}

#[test]
fn ferl_sft_under_torchrun_matches_single_process() {
    let Some(torchrun) = torchrun() else { return };
    let fx = Fixture::new().unwrap();
    let extra = [
        "trainer.resume_mode=disable",
        "trainer.logger=[console,jsonl]",
    ];
    let reference = reference_run(&fx.overrides(2, "ref", &extra)).unwrap();
    let keys = fx.overrides(2, "torchrun", &extra);
    let args = [vec!["sft".to_string()], keys].concat();
    let out = run_under_torchrun(&torchrun, 2, &args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    check(out, "torchrun --no-python ... ferl sft");
    let line = "1 intra-op thread per rank (OMP_NUM_THREADS=1; ";
    assert!(stdout.contains(line), "no `{line}` in:\n{stdout}");
    assert_eq!(
        stdout.matches("trained steps 1..2 on 2 rank(s)").count(),
        1,
        "one summary, rank 0's:\n{stdout}"
    );
    assert_logged_matches(
        "ferl sft under torchrun",
        &fx.dir.path().join("torchrun"),
        &reference,
    );
}
