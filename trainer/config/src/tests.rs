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
        err.contains("trainer.logger=[console,wandb]: `wandb` not supported"),
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
