//! The whole one-process run (world 1 of the one run loop, `sft::run_in_process_with_data`): resume gives the same losses as an uninterrupted run (mid-epoch
//! and exactly at an epoch boundary, verl #7401), checkpoints and the tracker file, pruning, metrics.jsonl, the
//! Hugging Face export, and refusal of keys the engine cannot honour.

use ferl_actors::sft::{run_in_process_with_data, InProcessOptions, RunSummary};
use ferl_config::SftConfig;
use ferl_data::{SftDataset, TokenizedSample};
use ferl_trainer::checkpoint;

#[path = "../../plugins/bridge/tests/common/mod.rs"]
mod common;

use common::tiny_model;
use std::path::Path;

fn dataset(n: usize, seed: u64) -> SftDataset {
    let mut x = seed;
    let mut next = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) as i64
    };
    let samples = (0..n)
        .map(|_| {
            let len = 6 + (next() % 10) as usize;
            let prompt = 2 + (next() % 3) as usize;
            TokenizedSample {
                input_ids: (0..len).map(|_| next() % 97).collect(),
                loss_mask: (0..len).map(|t| t >= prompt).collect(),
            }
        })
        .collect();
    SftDataset::from_samples(samples, 0, 1)
}

fn config(dir: &Path, extra: &[&str]) -> SftConfig {
    let mut o: Vec<String> = vec![
        format!("model.partial_pretrain={}", dir.join("model").display()),
        format!("trainer.default_local_dir={}", dir.join("ckpt").display()),
        "trainer.device=cpu".into(),
        "data.train_batch_size=4".into(),
        "data.micro_batch_size_per_gpu=2".into(),
        "trainer.total_epochs=2".into(),
        "optim.lr=1e-2".into(),
        "trainer.logger=[console,jsonl]".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    SftConfig::load(None, &o).unwrap()
}

fn quiet() -> InProcessOptions {
    InProcessOptions::default()
}

fn losses(s: &RunSummary) -> Vec<f64> {
    s.losses()
}

fn run_with_data(
    cfg: &SftConfig,
    train: &(usize, u64),
    val: Option<&(usize, u64)>,
    opts: InProcessOptions,
) -> anyhow::Result<RunSummary> {
    let val = val.map(|&(n, seed)| dataset(n, seed));
    run_in_process_with_data(cfg.clone(), dataset(train.0, train.1), val, opts)
}

fn resume_matches_uninterrupted(stop_after: u64) {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path());
    let (train, val) = ((16, 1), (6, 2)); // 4 steps per epoch, 8 in all
    let full_dir = dir.path().join("full");
    std::fs::create_dir_all(&full_dir).unwrap();
    std::fs::rename(dir.path().join("model"), full_dir.join("model")).unwrap();
    let full = run_with_data(&config(&full_dir, &[]), &train, Some(&val), quiet()).unwrap();
    assert_eq!(full.global_step, 8);
    let first = run_with_data(
        &config(
            &full_dir,
            &[
                "trainer.save_freq=1",
                &format!(
                    "trainer.default_local_dir={}",
                    full_dir.join("split").display()
                ),
            ],
        ),
        &train,
        Some(&val),
        InProcessOptions {
            stop_after_steps: Some(stop_after),
            ..quiet()
        },
    )
    .unwrap();
    assert_eq!(first.global_step, stop_after);
    let second = run_with_data(
        &config(
            &full_dir,
            &[
                "trainer.save_freq=1",
                &format!(
                    "trainer.default_local_dir={}",
                    full_dir.join("split").display()
                ),
            ],
        ),
        &train,
        Some(&val),
        quiet(),
    )
    .unwrap();
    assert_eq!(
        second.steps.first().unwrap().step,
        stop_after + 1,
        "the resumed run starts after the checkpoint"
    );
    let mut joined = losses(&first);
    joined.extend(losses(&second));
    let expected = losses(&full);
    assert_eq!(
        joined.len(),
        expected.len(),
        "resumed run trained {} steps, uninterrupted {}",
        joined.len(),
        expected.len()
    );
    for (i, (a, b)) in joined.iter().zip(&expected).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "step {}: resumed loss {a} vs uninterrupted {b}",
            i + 1
        );
    }
    let (va, vb) = (
        second.val_losses.last().unwrap().1,
        full.val_losses.last().unwrap().1,
    );
    assert!(
        (va - vb).abs() <= 1e-6 * vb,
        "final validation loss {va} vs {vb}"
    );
}

#[test]
fn resume_mid_epoch_gives_the_same_losses() {
    resume_matches_uninterrupted(3);
}

#[test]
fn resume_at_an_epoch_boundary_gives_the_same_losses() {
    resume_matches_uninterrupted(4);
}

#[test]
fn checkpoints_metrics_pruning_and_export() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path());
    let (train, val) = ((16, 5), (4, 6));
    let cfg = config(
        dir.path(),
        &[
            "trainer.save_freq=2",
            "trainer.max_ckpt_to_keep=2",
            "trainer.test_freq=3",
            "trainer.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        ],
    );
    let root = dir.path().join("ckpt");
    // A complete checkpoint of an "earlier run" (in another run directory's history) that pruning must also
    // remove; resume is off so the run starts fresh.
    std::fs::create_dir_all(root.join("global_step_1")).unwrap();
    let meta = r#"{"global_step":1,"epoch":0,"step_in_epoch":1,"world_size":1}"#;
    std::fs::write(root.join("global_step_1/meta.json"), meta).unwrap();
    let mut cfg = cfg;
    cfg.trainer.resume_mode = ferl_config::ResumeMode::Disable;
    let s = run_with_data(&cfg, &train, Some(&val), quiet()).unwrap();
    assert_eq!(checkpoint::complete_steps(&root).unwrap(), vec![6, 8]);
    assert_eq!(
        std::fs::read_to_string(root.join(checkpoint::LATEST_FILE))
            .unwrap()
            .trim(),
        "8"
    );
    assert_eq!(
        s.val_losses.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![3, 6, 8]
    );
    assert!(
        losses(&s).last().unwrap() < losses(&s).first().unwrap(),
        "loss falls: {:?}",
        losses(&s)
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(root.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 8);
    for key in [
        "step",
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens",
        "perf/tokens_per_s",
    ] {
        assert!(
            lines[0].get(key).is_some(),
            "metrics.jsonl lacks {key}: {}",
            lines[0]
        );
    }
    assert!(lines[2].get("val/loss").is_some() && lines[0].get("val/loss").is_none());
    let hf = root.join("global_step_8/huggingface");
    assert!(hf.join("config.json").exists() && hf.join("model.safetensors").exists());
    let out = dir.path().join("export");
    checkpoint::export(&root.join("global_step_8"), &out, "bf16").unwrap();
    let exported = ferl_trainer::model::load_model(&out).unwrap();
    let ours = ferl_trainer::model::load_model(&hf).unwrap();
    let diff = (&exported.params[0] - &ours.params[0])
        .abs()
        .max()
        .double_value(&[]);
    assert!(
        diff > 0.0 && diff < 1e-2,
        "bf16 export differs from fp32 by {diff}"
    );
}

#[test]
fn keys_the_engine_cannot_honour_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path());
    let cfg = config(
        dir.path(),
        &[
            "model.external_lib=foo",
            "trainer.default_hdfs_dir=hdfs://x",
        ],
    );
    let err = run_with_data(&cfg, &(8, 1), None, quiet()).err().unwrap();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("model.external_lib") && msg.contains("trainer.default_hdfs_dir"),
        "{msg}"
    );
    // Sequence parallelism needs ranks to share sequences: one process is refused naming the key and the ranks.
    let cfg = config(dir.path(), &["ulysses_sequence_parallel_size=2"]);
    let err = run_with_data(&cfg, &(8, 1), None, quiet()).err().unwrap();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("ulysses_sequence_parallel_size=2") && msg.contains("number of ranks"),
        "{msg}"
    );
}

#[test]
fn bf16_compute_with_fp32_masters_trains() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path());
    let cfg = config(
        dir.path(),
        &[
            "model.fsdp_config.model_dtype=bf16",
            "trainer.total_epochs=3",
            "use_remove_padding=true",
        ],
    );
    let s = run_with_data(&cfg, &(16, 9), None, quiet()).unwrap();
    let l = losses(&s);
    assert_eq!(l.len(), 12);
    assert!(l.iter().all(|x| x.is_finite()), "{l:?}");
    let (head, tail) = (
        l[..3].iter().sum::<f64>(),
        l[l.len() - 3..].iter().sum::<f64>(),
    );
    assert!(tail < head, "bf16 loss does not fall: {l:?}");
    // The checkpoint holds the fp32 masters.
    let shard = dir
        .path()
        .join("ckpt/global_step_12/model_world_size_1_rank_0.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(st
        .tensors()
        .iter()
        .all(|(_, t)| t.dtype() == safetensors::Dtype::F32));
}

/// `trainer.device=cuda` trains on the GPU when torch sees one (libtorch_cuda is loaded on demand even though the
/// linker dropped it), and otherwise is refused with a message that says what to set; never a silent CPU run.
#[test]
fn cuda_device_trains_on_a_gpu_or_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path());
    let cfg = config(
        dir.path(),
        &["trainer.device=cuda", "trainer.total_training_steps=2"],
    );
    if !ferl_trainer::run::cuda_is_available() {
        let err = ferl_trainer::run::device_of(&cfg, 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no CUDA device is visible") && err.contains("trainer.device=cpu"),
            "{err}"
        );
        eprintln!("SKIP the GPU run: torch sees no CUDA device here (checked the refusal instead)");
        return;
    }
    assert_eq!(
        ferl_trainer::run::device_of(&cfg, 0).unwrap(),
        tch::Device::Cuda(0)
    );
    let data = (8, 5);
    let gpu = run_with_data(&cfg, &data, None, quiet()).unwrap();
    let cpu_dir = tempfile::tempdir().unwrap();
    tiny_model(cpu_dir.path());
    let cpu_cfg = config(cpu_dir.path(), &["trainer.total_training_steps=2"]);
    let cpu = run_with_data(&cpu_cfg, &data, None, quiet()).unwrap();
    assert_eq!(losses(&gpu).len(), 2);
    for (g, c) in losses(&gpu).iter().zip(&losses(&cpu)) {
        assert!(
            (g - c).abs() <= 1e-3 * c.abs(),
            "GPU loss {g} vs CPU loss {c}"
        );
    }
}

/// A corrupted newest checkpoint is skipped by `resume_mode=auto` (with a warning): the run resumes from the one
/// before it and trains the same losses as an uninterrupted run.
#[test]
fn auto_resume_skips_a_corrupted_checkpoint_and_keeps_the_losses() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    tiny_model(dir.path());
    let full = run_with_data(&config(dir.path(), &[]), &(16, 1), None, quiet()).unwrap();
    let split = format!(
        "trainer.default_local_dir={}",
        dir.path().join("split").display()
    );
    let cfg = config(dir.path(), &["trainer.save_freq=1", &split]);
    let stop = InProcessOptions {
        stop_after_steps: Some(3),
        ..quiet()
    };
    run_with_data(&cfg, &(16, 1), None, stop).unwrap();
    let shard = dir
        .path()
        .join("split/global_step_3/optim_world_size_1_rank_0.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let resumed = run_with_data(&cfg, &(16, 1), None, quiet()).unwrap();
    assert_eq!(
        resumed.resumed_from, 2,
        "the corrupted step-3 checkpoint is skipped"
    );
    let want = &losses(&full)[2..];
    for (i, (a, b)) in losses(&resumed).iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "step {}: {a} vs {b}",
            i + 3
        );
    }
    assert_eq!(losses(&resumed).len(), want.len());
}
