//! `ferl sft` itself (the `ferl` binary of the `ferl` package) launched both ways a verl user would: with
//! `--nproc-per-node 2`, and as two ranks under a torchrun-style environment. The per-step losses it logs to
//! `metrics.jsonl` must match the single-process trainer.

use std::path::{Path, PathBuf};
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
    let out = Command::new(&ferl)
        .env("OMP_NUM_THREADS", "1")
        .args(["sft", "--nproc-per-node", "2"])
        .args(&actors)
        .output()
        .unwrap();
    check(out, "ferl sft --nproc-per-node 2");
    assert_logged_matches(
        "ferl sft --nproc-per-node 2",
        &fx.dir.path().join("actors"),
        &reference,
    );

    // The sharded checkpoint it left exports to a Hugging Face folder, tokenizer files copied from the model.
    let hf = fx.dir.path().join("actors-hf");
    let out = Command::new(&ferl)
        .arg("export")
        .arg("--checkpoint")
        .arg(fx.dir.path().join("actors/global_step_2"))
        .arg("--out")
        .arg(&hf)
        .arg("--copy-from")
        .arg(fx.dir.path().join("model"))
        .output()
        .unwrap();
    check(out, "ferl export of a sharded checkpoint");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        let len = std::fs::metadata(hf.join(file))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(len > 0, "the export lacks {file}");
    }

    let env_run = fx.overrides(2, "torchrun", &extra);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let secret = job_secret_hex();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&ferl)
                .env("OMP_NUM_THREADS", "1")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("FERL_JOB_SECRET", &secret)
                .env("MASTER_PORT", port.to_string())
                .arg("sft")
                .args(&env_run)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        check(
            child.wait_with_output().unwrap(),
            &format!("ferl sft as torchrun rank {rank}"),
        );
    }
    assert_logged_matches(
        "ferl sft under torchrun variables",
        &fx.dir.path().join("torchrun"),
        &reference,
    );
}

/// The venv's `torchrun`, or `None` (with the reason printed).
fn torchrun() -> Option<PathBuf> {
    let venv = std::env::var_os("FERL_VENV")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/ferl/venv")))?;
    let bin = venv.join("bin/torchrun");
    if bin.exists() {
        Some(bin)
    } else {
        // Under CI a missing reference environment fails the run: parity tests never pass vacuously there.
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but no torchrun at {}: .ci/run must install it (scripts/setup.sh)",
            bin.display()
        );
        println!(
            "SKIP: no torchrun at {} (run scripts/setup.sh)",
            bin.display()
        );
        None
    }
}

#[test]
fn ferl_sft_under_torchrun_matches_single_process() {
    let Some(torchrun) = torchrun() else { return };
    let ferl = ferl_binary();
    let fx = Fixture::new().unwrap();
    let extra = [
        "trainer.resume_mode=disable",
        "trainer.logger=[console,jsonl]",
    ];
    let reference = reference_run(&fx.overrides(2, "ref", &extra)).unwrap();
    let keys = fx.overrides(2, "torchrun", &extra);
    // torchrun opens its own sockets: run it in a private network namespace with only loopback.
    let script = format!(
        "ip link set lo up && exec {} --no-python --standalone --nnodes=1 --nproc_per_node=2 {} sft {}",
        torchrun.display(),
        ferl.display(),
        keys.iter().map(|k| format!("'{k}'")).collect::<Vec<_>>().join(" ")
    );
    let out = Command::new("unshare")
        .args(["-n", "bash", "-c", &script])
        .env("OMP_NUM_THREADS", "1")
        .env("FERL_JOB_SECRET", job_secret_hex())
        .output()
        .unwrap();
    check(out, "torchrun --no-python ... ferl sft");
    assert_logged_matches(
        "ferl sft under torchrun",
        &fx.dir.path().join("torchrun"),
        &reference,
    );
}
