//! One trainer for every launch path (issue "One trainer"): the same config gate, the same effect of every honoured
//! key, the same checkpoints and the same metric names, whether `ferl sft` runs in one process, with
//! `--nproc-per-node` actor ranks, or as ranks of an external launcher.

use std::collections::BTreeSet;
use std::path::Path;

use ferl_actors::sft::RunSummary;
use ferl_config::SftConfig;
use ferl_tests::*;
use ferl_trainer::run::{check, cuda_is_available, LaunchShape};

const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");
const REL: f64 = 1e-5;
const PATHS: [LaunchPath; 3] = [
    LaunchPath::OneProcess,
    LaunchPath::Actors(2),
    LaunchPath::Launcher(2),
];

fn run(fx: &Fixture, path: LaunchPath, overrides: &[String], tag: &str) -> RunSummary {
    run_path(DRIVER, fx.dir.path(), path, overrides, tag)
        .unwrap_or_else(|e| panic!("{tag} ({path:?}) failed: {e}"))
}

/// A non-default value for every key of verl's legacy `sft_trainer.yaml` (and ferl's own), and whether ferl
/// honours it. A key the gate accepts must be listed as honoured here, so no key is accepted and ignored.
const KEYS: &[(&str, &str, bool)] = &[
    ("data.train_batch_size", "8", true),
    ("data.micro_batch_size_per_gpu", "1", true),
    ("data.use_dynamic_bsz", "true", true),
    ("data.max_token_len_per_gpu", "4096", true),
    ("data.train_files", "x.parquet", true),
    ("data.val_files", "y.parquet", true),
    ("data.train_max_samples", "10", true),
    ("data.val_max_samples", "10", true),
    ("data.prompt_key", "p", true),
    ("data.response_key", "r", true),
    ("data.prompt_dict_keys", "[a]", true),
    ("data.response_dict_keys", "[b]", true),
    ("data.multiturn.enable", "true", true),
    ("data.multiturn.messages_key", "m", true),
    ("data.max_length", "64", true),
    ("data.truncation", "right", true),
    ("data.balance_dp_token", "true", true),
    ("data.chat_template", "x", true),
    ("data.use_shm", "true", true),
    ("data.shuffle", "false", true),
    ("data.plugin", "alpaca", true),
    ("data.custom_cls.path", "x.so", true),
    ("model.partial_pretrain", "m", true),
    ("model.use_shm", "true", true),
    ("model.enable_gradient_checkpointing", "false", true),
    ("model.strategy", "fsdp", true),
    ("model.fsdp_config.model_dtype", "bf16", true),
    ("model.fsdp_config.model_dtype", "fp16", false),
    ("model.fsdp_config.cpu_offload", "true", true),
    ("model.fsdp_config.offload_params", "true", true),
    ("model.fsdp_config.reshard_after_forward", "false", true),
    // HSDP is honoured at any size that divides the ranks (tests/tests/hsdp.rs); 3 divides none of the table's
    // world sizes, so every path refuses it alike.
    ("model.fsdp_config.fsdp_size", "1", true),
    ("model.fsdp_config.fsdp_size", "3", false),
    ("model.fsdp_config.forward_prefetch", "true", true),
    (
        "model.fsdp_config.wrap_policy.min_num_params",
        "1000",
        false,
    ),
    ("model.external_lib", "foo", false),
    ("model.trust_remote_code", "true", false),
    ("model.lora_rank", "8", true),
    ("model.lora_alpha", "32", true),
    ("model.target_modules", "[q_proj]", true),
    ("model.exclude_modules", "[q_proj]", true),
    ("model.lora_adapter_path", "adapter", true),
    ("model.use_liger", "true", true),
    ("optim.lr", "0.001", true),
    ("optim.lr_warmup_steps_ratio", "0.2", true),
    ("optim.lr_warmup_steps", "3", true),
    ("optim.weight_decay", "0.1", true),
    ("optim.betas", "[0.8,0.9]", true),
    ("optim.clip_grad", "0.5", true),
    ("optim.min_lr_ratio", "0.1", true),
    ("optim.num_cycles", "1.5", true),
    ("optim.lr_scheduler", "constant", true),
    ("optim.optimizer_impl", "bitsandbytes.optim", false),
    ("optim.override_optimizer_config", "{foreach: true}", false),
    ("trainer.default_local_dir", "d", true),
    ("trainer.default_hdfs_dir", "hdfs://x", false),
    ("trainer.project_name", "p", true),
    ("trainer.experiment_name", "e", true),
    ("trainer.total_epochs", "2", true),
    ("trainer.total_training_steps", "5", true),
    ("trainer.logger", "[console,jsonl]", true),
    ("trainer.logger", "[console,wandb]", false),
    ("trainer.seed", "7", true),
    ("trainer.save_freq", "3", true),
    ("trainer.test_freq", "3", true),
    ("trainer.max_ckpt_to_keep", "2", true),
    ("trainer.resume_mode", "disable", true),
    ("trainer.resume_from_path", "x", true),
    (
        "trainer.checkpoint.save_contents",
        "[model,optimizer,extra,hf_model]",
        true,
    ),
    ("trainer.checkpoint.save_contents", "[model]", false),
    ("trainer.device", "cpu", true),
    ("trainer.nnodes", "3", false),
    ("trainer.n_gpus_per_node", "3", false),
    ("trainer.max_restarts", "1", true),
    ("trainer.elastic", "true", false),
    ("trainer.restart_wait_s", "30", true),
    // Honoured at any size that divides the ranks and the model's heads (tests/tests/sequence_parallel.rs); 3
    // divides none of the table's world sizes, so every path refuses it alike.
    ("ulysses_sequence_parallel_size", "1", true),
    ("ulysses_sequence_parallel_size", "3", false),
    ("use_remove_padding", "true", true),
];

/// The one key honoured only where ferl starts the ranks: under torchrun/SLURM the launcher restarts them, and the
/// launcher path refuses it naming `torchrun --max-restarts` (tests/tests/restarts.rs runs both).
const LAUNCHER_REFUSES: &str = "trainer.max_restarts";

/// The shapes of the three paths at world size 2 (one process is world 1).
fn shapes() -> [LaunchShape; 3] {
    let loggers: Vec<String> = ["console", "jsonl"].map(String::from).to_vec();
    let shape = |world_size, restarts_ranks| LaunchShape {
        world_size,
        local_device: true,
        loggers: loggers.clone(),
        restarts_ranks,
    };
    [shape(1, true), shape(2, true), shape(2, false)]
}

#[test]
fn every_key_is_honoured_or_refused_the_same_way_on_every_path() {
    let base = ["trainer.device=cpu", "data.train_batch_size=8"];
    for &(key, value, honoured) in KEYS {
        let mut o: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        o.push(format!("{key}={value}"));
        let cfg = SftConfig::load(None, &o).unwrap_or_else(|e| panic!("{key}={value}: {e:#}"));
        let mut outcomes: Vec<Result<(), String>> = shapes()
            .iter()
            .map(|s| check(&cfg, s).map_err(|e| format!("{e:#}")))
            .collect();
        if key == LAUNCHER_REFUSES {
            let launcher = outcomes.pop().unwrap();
            assert!(
                launcher
                    .as_ref()
                    .is_err_and(|e| e.contains(key) && e.contains("torchrun")),
                "{key}={value} on the launcher path: {launcher:?}"
            );
        }
        assert!(
            outcomes.windows(2).all(|w| w[0] == w[1]),
            "{key}={value}: the paths disagree: {outcomes:?}"
        );
        match (&outcomes[0], honoured) {
            (Ok(()), true) => {}
            (Err(e), false) => assert!(e.contains(key), "{key}={value}: refusal names no key: {e}"),
            (Ok(()), false) => {
                panic!("{key}={value} is accepted but the table says ferl cannot honour it")
            }
            (Err(e), true) => panic!("{key}={value} is refused: {e}"),
        }
    }
    // Every leaf key of the config is in the table: a new key must be classified.
    let listed: BTreeSet<&str> = KEYS.iter().map(|(k, _, _)| *k).collect();
    let mut all = Vec::new();
    leaf_keys(
        "",
        &serde_yaml::to_value(SftConfig::default()).unwrap(),
        &mut all,
    );
    let unlisted: Vec<&String> = all
        .iter()
        .filter(|k| !listed.contains(k.as_str()) && !covered_by_section(k, &listed))
        .collect();
    assert!(
        unlisted.is_empty(),
        "keys missing from the table: {unlisted:?}"
    );
}

/// Every leaf key below `node`, dotted.
fn leaf_keys(prefix: &str, node: &serde_yaml::Value, out: &mut Vec<String>) {
    match node.as_mapping() {
        Some(map) if !map.is_empty() => {
            for (k, v) in map {
                let k = k.as_str().unwrap();
                let key = if prefix.is_empty() {
                    k.to_string()
                } else {
                    format!("{prefix}.{k}")
                };
                leaf_keys(&key, v, out);
            }
        }
        _ => out.push(prefix.to_string()),
    }
}

/// Keys under a section the table covers through one representative (`data.multiturn.*`, mixed precision, ...).
fn covered_by_section(key: &str, listed: &BTreeSet<&str>) -> bool {
    const SECTIONS: &[&str] = &[
        "data.multiturn.",
        "data.custom_cls.",
        "data.apply_chat_template_kwargs",
        "data.plugin_options",
        "model.fsdp_config.mixed_precision",
        "trainer.checkpoint.load_contents",
        "data.micro_batch_size",
        "data.num_workers",
        "optim.optimizer",
        "model.fsdp_config.sharding_strategy",
    ];
    SECTIONS.iter().any(|s| key.starts_with(s)) && !listed.is_empty()
}

/// Keys ferl cannot honour are refused by every path's real entry point with the same message, before anything
/// is loaded or spawned.
#[test]
fn refusals_are_the_same_from_every_entry_point() {
    let fx = Fixture::new().unwrap();
    let mut refused = vec![
        "ulysses_sequence_parallel_size=3",
        "model.fsdp_config.fsdp_size=3",
        "trainer.default_hdfs_dir=x",
        "model.external_lib=foo",
        "model.fsdp_config.model_dtype=fp16",
        "optim.optimizer_impl=foo",
        "trainer.logger=[console,wandb]",
    ];
    if !cuda_is_available() {
        refused.push("trainer.device=cuda");
    }
    for (i, bad) in refused.iter().enumerate() {
        let o = fx.overrides(2, "refused", &[bad]);
        let errors: Vec<String> = PATHS
            .iter()
            .map(
                |&p| match run_path(DRIVER, fx.dir.path(), p, &o, &format!("refused{i}")) {
                    Ok(_) => panic!("{bad} trained on {p:?}"),
                    Err(e) => e,
                },
            )
            .collect();
        let key = bad.split('=').next().unwrap();
        assert!(errors[0].contains(key), "{bad}: {}", errors[0]);
        assert!(
            errors.iter().all(|e| e == &errors[0]),
            "{bad}: different messages: {errors:#?}"
        );
    }
    assert!(
        !fx.dir.path().join("refused").exists(),
        "a refused run wrote its run folder"
    );
}

/// Many honoured non-default keys at once have the same effect on every path: the same losses, gradient norms and
/// learning rates as the golden reference (the trainer's stepper on whole global batches, no sharding, no loop),
/// and the same metric names.
#[test]
fn honoured_keys_have_the_same_effect_on_every_path() {
    let fx = Fixture::new().unwrap();
    let keys = [
        "optim.lr_warmup_steps=1",
        "optim.num_cycles=1.5",
        "optim.min_lr_ratio=0.1",
        "optim.weight_decay=0.05",
        "optim.betas=[0.8,0.9]",
        "optim.clip_grad=0.5",
        "use_remove_padding=true",
        "model.enable_gradient_checkpointing=true",
        "model.fsdp_config.reshard_after_forward=false",
        "trainer.seed=3",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
    ];
    let mut names = Vec::new();
    for (i, path) in PATHS.into_iter().enumerate() {
        let o = fx.overrides(4, &format!("honoured{i}"), &keys);
        let reference = reference_run(&o).unwrap();
        let got = run(&fx, path, &o, &format!("honoured{i}"));
        assert_curves_match(&format!("{path:?}"), &got.steps, &reference, REL);
        names.push(metric_names(
            &fx.dir.path().join(format!("honoured{i}/metrics.jsonl")),
        ));
    }
    assert!(
        names[0].contains("perf/tokens_per_s") && names[0].contains("train/tokens"),
        "{:?}",
        names[0]
    );
    assert_eq!(names[0], names[1], "one process vs actor ranks");
    assert_eq!(names[1], names[2], "actor ranks vs launcher ranks");
}

/// The metric names of a `metrics.jsonl`, with per-rank suffixes folded (`perf/max_memory_gb/rank_*`).
fn metric_names(file: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        for k in row.as_object().unwrap().keys() {
            names.insert(k.split("/rank_").next().unwrap().to_string());
        }
    }
    names
}

/// Micro-batches whose samples have no target left (the prompt filled `max_length`) do not make a rank skip a
/// collective: every path gives the reference's losses.
#[test]
fn micro_batches_without_targets_train_the_same_on_every_path() {
    let fx = Fixture::new().unwrap();
    let keys = [
        "data.max_length=40",
        "data.train_batch_size=4",
        "data.micro_batch_size_per_gpu=1",
        "trainer.resume_mode=disable",
    ];
    let o = fx.overrides(4, "empty", &keys);
    let reference = reference_run(&o).unwrap();
    for path in [LaunchPath::Actors(2), LaunchPath::Launcher(2)] {
        let got = run(&fx, path, &o, "empty");
        assert_curves_match(&format!("{path:?}"), &got.steps, &reference, REL);
    }
}

/// One checkpoint format: each path resumes another path's checkpoint (at another world size) with the
/// uninterrupted run's losses; `hf_model` adds a `huggingface/` folder that `ferl export` reads.
#[test]
fn any_path_resumes_any_other_paths_checkpoint() {
    let fx = Fixture::new().unwrap();
    let full = fx.overrides(4, "full", &["trainer.resume_mode=disable"]);
    let reference = reference_run(&full).unwrap();
    let pairs = [
        (LaunchPath::OneProcess, LaunchPath::Actors(2)),
        (LaunchPath::Actors(2), LaunchPath::OneProcess),
        (LaunchPath::Launcher(2), LaunchPath::Actors(2)),
    ];
    for (i, (saver, resumer)) in pairs.into_iter().enumerate() {
        let saved = format!("saved{i}");
        let o = fx.overrides(
            4,
            &saved,
            &[
                "trainer.resume_mode=disable",
                "trainer.save_freq=2",
                "trainer.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            ],
        );
        let first = run(&fx, saver, &o, &format!("save{i}"));
        assert_curves_match(&format!("{saver:?} saving"), &first.steps, &reference, REL);
        let step2 = fx.dir.path().join(&saved).join("global_step_2");
        assert!(
            step2.join("huggingface/config.json").exists(),
            "{saver:?}: no huggingface/"
        );
        let resume = fx.overrides(
            4,
            &format!("resumed{i}"),
            &[
                "trainer.resume_mode=resume_path",
                &format!("trainer.resume_from_path={}", step2.display()),
            ],
        );
        let second = run(&fx, resumer, &resume, &format!("resume{i}"));
        assert_eq!(second.resumed_from, 2, "{saver:?} -> {resumer:?}");
        assert_curves_match(
            &format!("{saver:?} -> {resumer:?}"),
            &second.steps,
            &reference[2..],
            REL,
        );
    }
}

/// `trainer.device=cuda` on a cluster none of whose nodes has a GPU (the `--address` path, where the driver's own
/// machine does not decide) is refused with the same words as on every other path, before anything is spawned.
#[test]
fn a_cluster_without_gpus_refuses_cuda_like_every_other_path() {
    if cuda_is_available() {
        println!("SKIP: this machine has a GPU, so its cluster does too");
        return;
    }
    let fx = Fixture::new().unwrap();
    let cfg = SftConfig::load(None, &fx.overrides(2, "cuda", &["trainer.device=cuda"])).unwrap();
    let one = ferl_trainer::run::device_of(&cfg, 0)
        .unwrap_err()
        .to_string();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let err = rt.block_on(async {
        let cluster = ferl::runtime::init(Default::default()).await.unwrap();
        let r = ferl_actors::sft::train_on_cluster(&cluster, &cfg, 2).await;
        cluster.shutdown().await;
        r.unwrap_err()
    });
    assert_eq!(format!("{err:#}"), one);
}
