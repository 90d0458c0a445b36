//! Tests of [`SftConfig`] loading; names refer to the invariants in the crate docs.

use super::*;

fn ov(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn load(args: &[&str]) -> Result<SftConfig> {
    SftConfig::load(None, &ov(args))
}

#[test]
fn defaults_are_verls() {
    let c = load(&[]).unwrap();
    assert_eq!(c.data.train_batch_size, 256);
    assert_eq!(c.data.micro_batch_size_per_gpu, 4);
    assert_eq!(c.data.max_length, 1024);
    assert_eq!(c.data.truncation, Truncation::Error);
    assert_eq!(c.data.prompt_key, "question");
    assert_eq!(c.data.response_key, "answer");
    assert_eq!(c.optim.lr, 1e-5);
    assert_eq!(c.optim.betas, [0.9, 0.95]);
    assert_eq!(c.optim.lr_warmup_steps_ratio, 0.1);
    assert_eq!(c.optim.lr_scheduler, LrScheduler::Cosine);
    assert_eq!(c.model.strategy, Strategy::Fsdp2);
    assert!(c.model.enable_gradient_checkpointing);
    assert_eq!(c.trainer.total_epochs, 4);
    assert_eq!(c.trainer.seed, 1);
    assert_eq!(c.trainer.resume_mode, ResumeMode::Auto);
    assert_eq!(c.trainer.default_local_dir, "checkpoints/gsm8k-sft/test");
    assert_eq!(
        c.trainer.checkpoint.load_contents,
        c.trainer.checkpoint.save_contents
    );
    assert_eq!(c, SftConfig::resolved_default());
}

#[test]
fn verl_command_line_is_accepted() {
    let c = load(&[
        "data.train_files=/d/train.parquet",
        "data.prompt_key=extra_info",
        "data.response_key=extra_info",
        "optim.lr=1e-4",
        "data.prompt_dict_keys=['question']",
        "+data.response_dict_keys=['answer']",
        "data.micro_batch_size_per_gpu=4",
        "trainer.project_name=gsm8k-sft",
        "trainer.experiment_name=qwen",
        "trainer.logger=console",
        "trainer.total_epochs=1",
        "model.target_modules=[q_proj,v_proj]",
    ])
    .unwrap();
    assert_eq!(c.data.train_files, StringList::one("/d/train.parquet"));
    assert_eq!(c.data.prompt_dict_keys, Some(StringList::one("question")));
    assert_eq!(c.data.response_dict_keys, Some(StringList::one("answer")));
    assert_eq!(c.optim.lr, 1e-4);
    assert_eq!(c.trainer.logger, StringList::one("console"));
    assert_eq!(c.model.target_modules.as_slice(), ["q_proj", "v_proj"]);
    assert_eq!(c.trainer.default_local_dir, "checkpoints/gsm8k-sft/qwen");
}

#[test]
fn seed_spellings_are_aliases() {
    let c = load(&[
        "optim.warmup_steps_ratio=0.05",
        "trainer.save_interval=20",
        "optim.lr_scheduler_type=constant",
    ])
    .unwrap();
    assert_eq!(c.optim.lr_warmup_steps_ratio, 0.05);
    assert_eq!(c.trainer.save_freq, 20);
    assert_eq!(c.optim.lr_scheduler, LrScheduler::Constant);
    let c = SftConfig::from_yaml(
        "optim: {warmup_steps_ratio: 0.2}\ntrainer: {save_interval: 7}",
        &[],
    )
    .unwrap();
    assert_eq!(
        (c.optim.lr_warmup_steps_ratio, c.trainer.save_freq),
        (0.2, 7)
    );
}

#[test]
fn file_then_overrides_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("c.yaml");
    std::fs::write(
        &f,
        "defaults:\n  - optim: fsdp\n  - _self_\ndata:\n  max_length: 512\n  multiturn:\n    enable: true\n\
         model:\noptim:\n  lr: 1e-4\n  betas: [0.8, 0.9]\ntrainer:\n  logger: [console, jsonl]\n",
    )
    .unwrap();
    let c = SftConfig::load(
        Some(&f),
        &ov(&["data.max_length=256", "data.max_length=300"]),
    )
    .unwrap();
    assert_eq!(c.data.max_length, 300);
    assert!(c.data.multiturn.enable);
    assert_eq!(c.data.multiturn.messages_key, "messages");
    assert_eq!(c.model, ModelConfig::default());
    assert_eq!(c.optim.lr, 1e-4);
    assert_eq!(c.optim.betas, [0.8, 0.9]);
    assert_eq!(c.trainer.logger.as_slice(), ["console", "jsonl"]);
}

#[test]
fn typed_values_strings_and_resets() {
    let c = load(&[
        "trainer.experiment_name=123",
        "trainer.total_training_steps=60",
        "data.shuffle=False",
        "model.fsdp_config.model_dtype=bfloat16",
        "model.fsdp_config.mixed_precision.param_dtype=bf16",
        "+data.apply_chat_template_kwargs.enable_thinking=false",
        "data.max_length=99",
        "~data.max_length",
    ])
    .unwrap();
    assert_eq!(c.trainer.experiment_name, "123");
    assert_eq!(c.trainer.total_training_steps, Some(60));
    assert!(!c.data.shuffle);
    assert_eq!(c.model.fsdp_config.model_dtype, Dtype::Bf16);
    assert_eq!(
        c.model.fsdp_config.mixed_precision,
        Some(MixedPrecision::default())
    );
    assert_eq!(
        c.data.apply_chat_template_kwargs["enable_thinking"],
        serde_json::Value::Bool(false)
    );
    assert_eq!(c.data.max_length, 1024);
}

#[test]
fn interpolation_of_keys_and_environment() {
    std::env::set_var("FERL_CFG_LIB_TEST_DIR", "/tmp/runs");
    let c = load(&[
        "trainer.default_local_dir=${oc.env:FERL_CFG_LIB_TEST_DIR}/${trainer.project_name}",
        "trainer.project_name=p1",
        "trainer.experiment_name=${oc.env:FERL_CFG_LIB_TEST_UNSET,exp}",
        "data.val_files=${data.train_files}",
        "data.train_files=[a.parquet,b.parquet]",
        "data.max_length=${oc.env:FERL_CFG_LIB_TEST_UNSET,64}",
    ])
    .unwrap();
    assert_eq!(c.trainer.default_local_dir, "/tmp/runs/p1");
    assert_eq!(c.trainer.experiment_name, "exp");
    assert_eq!(c.data.val_files.as_slice(), ["a.parquet", "b.parquet"]);
    assert_eq!(c.data.max_length, 64);
    let yaml = "trainer:\n  default_local_dir: ${oc.env:FERL_CFG_LIB_TEST_DIR}/${trainer.experiment_name}\n";
    let c = SftConfig::from_yaml(yaml, &ov(&["trainer.experiment_name=e2"])).unwrap();
    assert_eq!(c.trainer.default_local_dir, "/tmp/runs/e2");
    let err = load(&["trainer.project_name=${oc.env:FERL_CFG_LIB_TEST_UNSET}"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`trainer.project_name`: environment variable `FERL_CFG_LIB_TEST_UNSET`"),
        "{err}"
    );
}

#[test]
fn unknown_keys_name_the_key_and_the_nearest() {
    let err = format!("{:#}", load(&["data.promt_key=q"]).unwrap_err());
    assert!(
        err.contains("unknown config key `data.promt_key`; did you mean `data.prompt_key`?"),
        "{err}"
    );
    let err = format!("{:#}", load(&["lr=1e-4"]).unwrap_err());
    assert!(
        err.contains("unknown config key `lr`; did you mean `optim.lr`?"),
        "{err}"
    );
    let err = format!("{:#}", load(&["trainer.save_intervall=5"]).unwrap_err());
    assert!(
        err.contains("did you mean `trainer.save_interval`?"),
        "{err}"
    );
    let err = format!(
        "{:#}",
        SftConfig::from_yaml("model:\n  fsdp_config:\n    cpu_ofload: true\n", &[]).unwrap_err()
    );
    assert!(err.contains("in config <yaml>"), "{err}");
    assert!(
        err.contains(
            "`model.fsdp_config.cpu_ofload`; did you mean `model.fsdp_config.cpu_offload`?"
        ),
        "{err}"
    );
    let err = format!("{:#}", load(&["data.max_length.x=1"]).unwrap_err());
    assert!(
        err.contains("`data.max_length` takes a value, not sub-keys"),
        "{err}"
    );
}

#[test]
fn bad_values_name_the_key() {
    let err = format!("{:#}", load(&["data.max_length=abc"]).unwrap_err());
    assert!(
        err.contains("bad value for `data.max_length`: invalid type: string \"abc\""),
        "{err}"
    );
    let err = format!("{:#}", load(&["data.truncation=middle"]).unwrap_err());
    assert!(
        err.contains("bad value for `data.truncation`: unknown variant `middle`"),
        "{err}"
    );
    assert!(err.contains("`left`"), "{err}");
    let err = format!("{:#}", load(&["optim.betas=[0.9]"]).unwrap_err());
    assert!(err.contains("bad value for `optim.betas`"), "{err}");
    let err = format!(
        "{:#}",
        load(&["trainer.resume_mode=sometimes"]).unwrap_err()
    );
    assert!(
        err.contains("`trainer.resume_mode`") && err.contains("resume_path"),
        "{err}"
    );
}

#[test]
fn ranges_are_checked_with_the_key() {
    let err = format!(
        "{:#}",
        load(&["optim.betas=[0.9,1.5]", "data.micro_batch_size_per_gpu=0"]).unwrap_err()
    );
    assert!(err.contains("optim.betas[1]: must be in [0, 1)"), "{err}");
    assert!(
        err.contains("data.micro_batch_size_per_gpu: must be at least 1"),
        "{err}"
    );
    let err = format!(
        "{:#}",
        load(&["trainer.resume_mode=resume_path"]).unwrap_err()
    );
    assert!(
        err.contains("trainer.resume_from_path: must be set"),
        "{err}"
    );
}

#[test]
fn to_yaml_round_trips() {
    let c = load(&[
        "data.train_files=[a,b]",
        "optim.lr=3e-4",
        "trainer.total_training_steps=5",
    ])
    .unwrap();
    let yaml = c.to_yaml();
    assert!(yaml.contains("lr: 0.0003"), "{yaml}");
    assert_eq!(SftConfig::from_yaml(&yaml, &[]).unwrap(), c);
}

#[test]
fn unsupported_changes_are_refused_and_defaults_pass() {
    let supported = Supported::new()
        .keys(&["data.*", "optim.lr", "trainer.total_training_steps"])
        .values("trainer.logger", &["console", "jsonl"]);
    load(&[]).unwrap().validate_supported(&supported).unwrap();
    load(&["data.max_length=5", "trainer.logger=[console,jsonl]"])
        .unwrap()
        .validate_supported(&supported)
        .unwrap();
    let c = load(&[
        "model.lora_rank=32",
        "trainer.logger=[console,wandb]",
        "optim.lr=1",
    ])
    .unwrap();
    let changed: Vec<String> = c.changed_keys().into_iter().map(|(k, _)| k).collect();
    assert_eq!(changed, ["model.lora_rank", "optim.lr", "trainer.logger"]);
    let err = c.validate_supported(&supported).unwrap_err().to_string();
    assert!(
        err.contains("model.lora_rank=32: not supported by ferl yet"),
        "{err}"
    );
    assert!(
        err.contains("trainer.logger=[console,wandb]: `wandb` has no Rust client in ferl"),
        "{err}"
    );
    assert!(!err.contains("optim.lr="), "{err}");
}

#[test]
fn expand_path_expands_home() {
    let home = std::env::var("HOME").unwrap();
    assert_eq!(expand_path("~/data/x"), PathBuf::from(home).join("data/x"));
    assert_eq!(expand_path("/abs/x"), PathBuf::from("/abs/x"));
}

fn err(args: &[&str]) -> String {
    format!("{:#}", load(args).unwrap_err())
}

fn fsdp(args: &[&str]) -> (bool, i64) {
    let c = load(args).unwrap();
    let f = &c.model.fsdp_config;
    (f.reshard_after_forward, f.fsdp_size)
}

#[test]
fn sharding_strategy_sets_verls_keys() {
    const KEY: &str = "model.fsdp_config.sharding_strategy";
    assert_eq!(fsdp(&[&format!("{KEY}=FULL_SHARD")]), (true, -1));
    assert_eq!(fsdp(&[&format!("{KEY}=shard_grad_op")]), (false, -1));
    assert_eq!(fsdp(&[&format!("{KEY}=No_Shard")]), (true, 1));
    let hybrid = [
        format!("{KEY}=HYBRID_SHARD"),
        "model.fsdp_config.fsdp_size=4".into(),
    ];
    assert_eq!(fsdp(&[&hybrid[0], &hybrid[1]]), (true, 4));
    assert_eq!(fsdp(&[&format!("{KEY}=null")]), (true, -1));
    // Agreeing values are fine, as is a reset of the strategy.
    let ok = [
        "model.fsdp_config.reshard_after_forward=false",
        "model.fsdp_config.sharding_strategy=SHARD_GRAD_OP",
    ];
    assert_eq!(fsdp(&ok), (false, -1));
    let reset = [
        "model.fsdp_config.sharding_strategy=NO_SHARD",
        "~model.fsdp_config.sharding_strategy",
    ];
    assert_eq!(fsdp(&reset), (true, -1));
    let c = SftConfig::from_yaml(
        "model:\n  fsdp_config:\n    sharding_strategy: no_shard\n",
        &[],
    )
    .unwrap();
    assert_eq!(c.model.fsdp_config.fsdp_size, 1);
    // The strategy is consumed: the typed config prints verl's keys and loads back to itself.
    let yaml = c.to_yaml();
    assert!(!yaml.contains("sharding_strategy"), "{yaml}");
    assert_eq!(SftConfig::from_yaml(&yaml, &[]).unwrap(), c);
    let changed: Vec<String> = c.changed_keys().into_iter().map(|(k, _)| k).collect();
    assert_eq!(changed, ["model.fsdp_config.fsdp_size"]);
}

#[test]
fn sharding_strategy_conflicts_name_both_keys() {
    let e = err(&[
        "model.fsdp_config.sharding_strategy=SHARD_GRAD_OP",
        "model.fsdp_config.reshard_after_forward=true",
    ]);
    assert!(
        e.contains("`model.fsdp_config.sharding_strategy=SHARD_GRAD_OP` conflicts with `model.fsdp_config.reshard_after_forward=true`"),
        "{e}"
    );
    let e = err(&[
        "model.fsdp_config.fsdp_size=2",
        "model.fsdp_config.sharding_strategy=NO_SHARD",
    ]);
    assert!(
        e.contains("`model.fsdp_config.sharding_strategy=NO_SHARD` conflicts with `model.fsdp_config.fsdp_size=2`"),
        "{e}"
    );
    let e = err(&[
        "model.fsdp_config.sharding_strategy=full_shard",
        "model.fsdp_config.fsdp_size=1",
    ]);
    assert!(
        e.contains("FULL_SHARD` conflicts with `model.fsdp_config.fsdp_size=1`"),
        "{e}"
    );
    let e = err(&["model.fsdp_config.sharding_strategy=HYBRID_SHARD"]);
    assert!(
        e.contains("`model.fsdp_config.sharding_strategy=HYBRID_SHARD` needs `model.fsdp_config.fsdp_size`"),
        "{e}"
    );
    let e = err(&[
        "model.fsdp_config.sharding_strategy=HYBRID_SHARD",
        "model.fsdp_config.fsdp_size=-1",
    ]);
    assert!(
        e.contains("`model.fsdp_config.sharding_strategy=HYBRID_SHARD` conflicts with `model.fsdp_config.fsdp_size=-1`"),
        "{e}"
    );
    // A reset key is no longer the user's, so the strategy's value applies.
    let args = [
        "model.fsdp_config.fsdp_size=2",
        "~model.fsdp_config.fsdp_size",
        "model.fsdp_config.sharding_strategy=NO_SHARD",
    ];
    assert_eq!(fsdp(&args), (true, 1));
}

#[test]
fn bad_values_sharding_strategy_names_the_key_and_the_choices() {
    let e = err(&["model.fsdp_config.sharding_strategy=ZERO3"]);
    assert!(
        e.contains("bad value for `model.fsdp_config.sharding_strategy`: `ZERO3`; expected one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD"),
        "{e}"
    );
}

#[test]
fn mixed_precision_true_is_bf16_with_fp32_reduce_and_buffers() {
    let bf16 = MixedPrecision {
        param_dtype: Dtype::Bf16,
        reduce_dtype: Dtype::Fp32,
        buffer_dtype: Dtype::Fp32,
    };
    let mp = |args: &[&str]| load(args).unwrap().model.fsdp_config.mixed_precision;
    assert_eq!(
        mp(&["model.fsdp_config.mixed_precision=true"]),
        Some(bf16.clone())
    );
    assert_eq!(
        mp(&["model.fsdp_config.mixed_precision=True"]),
        Some(bf16.clone())
    );
    assert_eq!(mp(&["model.fsdp_config.mixed_precision=false"]), None);
    assert_eq!(mp(&["model.fsdp_config.mixed_precision=null"]), None);
    let c =
        SftConfig::from_yaml("model:\n  fsdp_config:\n    mixed_precision: true\n", &[]).unwrap();
    assert_eq!(c.model.fsdp_config.mixed_precision, Some(bf16.clone()));
    assert_eq!(SftConfig::from_yaml(&c.to_yaml(), &[]).unwrap(), c);
    // Sub-keys after the boolean form refine its mapping; the mapping form keeps working.
    let refined = mp(&[
        "model.fsdp_config.mixed_precision=true",
        "model.fsdp_config.mixed_precision.reduce_dtype=bf16",
    ]);
    assert_eq!(refined.unwrap().reduce_dtype, Dtype::Bf16);
    let mapping = mp(&["model.fsdp_config.mixed_precision={param_dtype: fp16}"]).unwrap();
    assert_eq!(
        (mapping.param_dtype, mapping.reduce_dtype),
        (Dtype::Fp16, Dtype::Fp32)
    );
    std::env::set_var("FERL_CFG_LIB_TEST_MP", "true");
    let interpolated = mp(&["model.fsdp_config.mixed_precision=${oc.env:FERL_CFG_LIB_TEST_MP}"]);
    assert_eq!(interpolated, Some(bf16));
}

#[test]
fn optimizer_names_are_case_insensitive() {
    for name in ["adamw", "AdamW", "ADAMW", "adamW"] {
        let c = load(&[&format!("optim.optimizer={name}")]).unwrap();
        assert_eq!(c.optim.optimizer, "AdamW");
        assert!(c.changed_keys().is_empty(), "{name}");
    }
    let c = SftConfig::from_yaml("optim:\n  optimizer: sgd\n", &[]).unwrap();
    assert_eq!(c.optim.optimizer, "SGD");
    assert_eq!(
        load(&["optim.optimizer=AdamW8bit"])
            .unwrap()
            .optim
            .optimizer,
        "AdamW8bit"
    );
    assert_eq!(load(&[]).unwrap().optim.optimizer_impl, "torch.optim");
    let supported = Supported::new().values("optim.optimizer", &["AdamW"]);
    load(&["optim.optimizer=adamw"])
        .unwrap()
        .validate_supported(&supported)
        .unwrap();
}

#[test]
fn seed_spellings_model_level_sequence_keys_are_top_level() {
    let c = load(&[
        "model.use_remove_padding=true",
        "model.ulysses_sequence_parallel_size=2",
    ])
    .unwrap();
    assert!(c.use_remove_padding);
    assert_eq!(c.ulysses_sequence_parallel_size, 2);
    let yaml =
        "model:\n  use_remove_padding: true\n  ulysses_sequence_parallel_size: 4\n  lora_rank: 8\n";
    let c = SftConfig::from_yaml(yaml, &ov(&["~model.ulysses_sequence_parallel_size"])).unwrap();
    assert!(c.use_remove_padding);
    assert_eq!(c.ulysses_sequence_parallel_size, 1);
    assert_eq!(c.model.lora_rank, 8);
    let c = load(&[
        "model.use_remove_padding=true",
        "trainer.experiment_name=${model.use_remove_padding}",
    ])
    .unwrap();
    assert_eq!(c.trainer.experiment_name, "true");
    let e = err(&["model.use_remove_padding.x=1"]);
    assert!(e.contains("`use_remove_padding` takes a value"), "{e}");
}

#[test]
fn data_num_workers_is_a_known_key() {
    assert_eq!(load(&[]).unwrap().data.num_workers, 8);
    let c = load(&["data.num_workers=2"]).unwrap();
    assert_eq!(c.data.num_workers, 2);
    let changed: Vec<String> = c.changed_keys().into_iter().map(|(k, _)| k).collect();
    assert_eq!(changed, ["data.num_workers"]);
}

#[test]
fn unknown_keys_hint_by_meaning_then_spelling() {
    let hint = |key: &str| {
        let e = err(&[&format!("{key}=1")]);
        let (_, rest) = e
            .split_once("did you mean `")
            .unwrap_or_else(|| panic!("{e}"));
        rest.split('`').next().unwrap().to_string()
    };
    assert_eq!(hint("data.num_workerz"), "data.num_workers");
    assert_eq!(
        hint("model.fsdp_config.sharding_strategyy"),
        "model.fsdp_config.sharding_strategy"
    );
    assert_eq!(hint("optim.warmup_steps"), "optim.lr_warmup_steps");
    assert_eq!(hint("trainer.lr_warmup"), "optim.lr_warmup_steps");
    assert_eq!(hint("batch_size"), "data.train_batch_size");
    assert_eq!(
        hint("data.micro_batch_size_per_device"),
        "data.micro_batch_size_per_gpu"
    );
    assert_eq!(hint("trainer.epochs"), "trainer.total_epochs");
    assert_eq!(hint("num_epochs"), "trainer.total_epochs");
    assert_eq!(hint("trainer.max_steps"), "trainer.total_training_steps");
    assert_eq!(hint("optim.learning_rate"), "optim.lr");
    assert_eq!(
        hint("model.gradient_checkpointing"),
        "model.enable_gradient_checkpointing"
    );
    assert_eq!(hint("trainer.output_dir"), "trainer.default_local_dir");
    assert_eq!(hint("save_dir"), "trainer.default_local_dir");
    assert_eq!(hint("model.model_name_or_path"), "model.partial_pretrain");
    assert_eq!(hint("model_path"), "model.partial_pretrain");
    assert_eq!(hint("data.max_seq_length"), "data.max_length");
    assert_eq!(hint("seq_len"), "data.max_length");
    assert_eq!(hint("optim.max_grad_norm"), "optim.clip_grad");
    assert_eq!(hint("grad_clip"), "optim.clip_grad");
    assert_eq!(
        hint("model.fsdp_config.sharding"),
        "model.fsdp_config.sharding_strategy"
    );
    assert_eq!(hint("model.dtype"), "model.fsdp_config.model_dtype");
    assert_eq!(hint("precision"), "model.fsdp_config.model_dtype");
    // Spelling prefers the same section: `trainer.seeds` is one edit from `trainer.seed`.
    assert_eq!(hint("trainer.seeds"), "trainer.seed");
    assert_eq!(
        hint("model.fsdp.cpu_offload"),
        "model.fsdp_config.cpu_offload"
    );
}

#[test]
fn every_synonym_names_a_valid_key() {
    let s = schema(&defaults_tree());
    for (synonym, key) in hints::SYNONYMS {
        assert!(s.check_key(key).is_ok(), "{synonym} -> {key}");
        assert!(
            s.check_key(&tree::canonical_key(synonym)).is_err(),
            "{synonym} is itself a key"
        );
    }
}
