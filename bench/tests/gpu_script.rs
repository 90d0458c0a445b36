//! The prepared GPU benchmark, checked on any machine: `bench/gpu/h200_sft.sh` runs end to end on its CPU dry path
//! (same binary, same code as on the H200, a small shape; its sequence-parallel rows included), and `ferl-bench train --device cuda` either trains on a GPU
//! or, where there is none, fails with a message saying why (printed as the test's skip reason).

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ferl-bench");

fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

#[test]
fn h200_script_dry_run_on_the_cpu_prints_the_rows_of_both_stores() {
    let out = Command::new("bash")
        .arg(repo_root().join("bench/gpu/h200_sft.sh"))
        .current_dir(repo_root())
        .env("FERL_BENCH_BIN", BIN)
        .envs([
            ("DEVICE", "cpu"),
            ("SHAPE", "test"),
            ("SEQ", "32"),
            ("STEPS", "2"),
            ("BATCH", "2"),
            ("MICRO", "1"),
            ("SP_SEQ", "64"),
        ])
        .output()
        .expect("running bench/gpu/h200_sft.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "script failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("torch: 2.11.0"), "{stdout}");
    assert!(stdout.contains("H200 SFT BENCH DONE"), "{stdout}");
    let rates: Vec<f64> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("sft_test_cpu_tokens_per_s "))
        .map(|v| v.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        rates.len(),
        2,
        "one rate per store (local, fsdp):\n{stdout}"
    );
    assert!(rates.iter().all(|r| *r > 0.0), "{rates:?}");
    let losses: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("sft_test_cpu_first_loss "))
        .collect();
    assert_eq!(losses.len(), 2, "{stdout}");
    assert_eq!(
        losses[0], losses[1],
        "both stores train the same model on the same tokens"
    );
    let row = |name: &str| -> f64 {
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name} row:\n{stdout}"));
        line.split_whitespace().next().unwrap().parse().unwrap()
    };
    for group in ["sp1_w1", "dp_w2", "sp_w2"] {
        assert!(row(&format!("sp_{group}_peak_rss_MiB")) > 0.0);
        assert!(row(&format!("sp_{group}_tokens_per_s")) > 0.0);
    }
    assert!(row("sp_peak_rss_vs_one_rank") > 0.0);
}

#[test]
fn cuda_training_runs_on_a_gpu_or_says_why_not() {
    let out = Command::new(BIN)
        .args([
            "train",
            "--device",
            "cuda",
            "--model-shape",
            "test",
            "--seq-len",
            "32",
            "--steps",
            "2",
            "--batch",
            "2",
            "--micro-batch",
            "1",
        ])
        .output()
        .expect("running ferl-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let gpu = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success() && !o.stdout.is_empty());
    if gpu {
        assert!(
            out.status.success(),
            "a GPU is present but the CUDA run failed:\n{stderr}"
        );
        assert!(stdout.contains("sft_test_cuda_mfu "), "{stdout}");
    } else {
        assert!(
            !out.status.success(),
            "no GPU, yet the CUDA run succeeded:\n{stdout}"
        );
        assert!(
            stderr.contains("--device cuda"),
            "the failure must say why: {stderr}"
        );
        println!(
            "SKIP cuda_training_runs_on_a_gpu_or_says_why_not: no GPU here ({})",
            stderr
                .lines()
                .find(|l| l.contains("--device cuda"))
                .unwrap_or_default()
                .trim()
        );
    }
}
