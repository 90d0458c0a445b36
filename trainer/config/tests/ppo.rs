//! [`PpoConfig`] loading: verl's defaults and command lines, interpolation, unknown keys with hints, bad values and
//! ranges naming the key, the YAML round trip, and refusing unsupported changes.

use ferl_config::ppo::{AdvEstimator, KlPenalty, LossAggMode, PromptTruncation, RolloutMode};
use ferl_config::{LrScheduler, PpoConfig, ResumeMode, StringList, Supported};

fn ov(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn load(args: &[&str]) -> anyhow::Result<PpoConfig> {
    PpoConfig::load(None, &ov(args))
}

fn err(args: &[&str]) -> String {
    format!("{:#}", load(args).unwrap_err())
}

/// The key the error for `key=value` suggests.
fn hint(key: &str, value: &str) -> String {
    let e = err(&[&format!("{key}={value}")]);
    let (_, rest) = e
        .split_once("did you mean `")
        .unwrap_or_else(|| panic!("{e}"));
    rest.split('`').next().unwrap().to_string()
}

const GRPO: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "data.train_files=/d/gsm8k/train.parquet",
    "data.train_batch_size=16",
    "data.max_prompt_length=256",
    "data.max_response_length=128",
    "actor_rollout_ref.model.path=/m/qwen",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.temperature=0.7",
    "actor_rollout_ref.rollout.name=ferl",
    "algorithm.use_kl_in_reward=False",
    "trainer.total_epochs=1",
    "trainer.logger=['console']",
    "custom_reward_function.path=plugins/x.so",
    "reward_model.reward_manager=naive",
];

#[test]
fn defaults_are_verls() {
    let c = load(&[]).unwrap();
    let (d, a, r) = (
        &c.data,
        &c.actor_rollout_ref.actor,
        &c.actor_rollout_ref.rollout,
    );
    assert_eq!(d.prompt_key, "prompt");
    assert_eq!(d.reward_fn_key, "data_source");
    assert_eq!((d.max_prompt_length, d.max_response_length), (512, 512));
    assert_eq!(d.train_batch_size, 1024);
    assert!(d.shuffle && !d.filter_overlong_prompts && !d.return_raw_chat);
    assert_eq!(d.truncation, PromptTruncation::Error);
    assert_eq!((d.tokenizer.as_deref(), d.seed), (None, None));
    let m = &c.actor_rollout_ref.model;
    assert!(m.enable_gradient_checkpointing && !m.use_remove_padding);
    assert_eq!((m.lora_rank, m.lora_alpha), (0, 16.0));
    assert_eq!(m.target_modules, StringList::one("all-linear"));
    assert_eq!(a.ppo_mini_batch_size, 256);
    assert_eq!(a.ppo_micro_batch_size_per_gpu, None);
    assert_eq!(a.ppo_max_token_len_per_gpu, 16384);
    assert_eq!((a.clip_ratio, a.clip_low(), a.clip_high()), (0.2, 0.2, 0.2));
    assert_eq!(a.clip_ratio_c, 3.0);
    assert_eq!(a.loss_agg_mode, LossAggMode::TokenMean);
    assert_eq!(a.entropy_coeff, 0.0);
    assert!(!a.use_kl_loss);
    assert_eq!(
        (a.kl_loss_coef, a.kl_loss_type),
        (0.001, KlPenalty::LowVarKl)
    );
    assert_eq!((a.ppo_epochs, a.shuffle, a.grad_clip), (1, false, 1.0));
    assert_eq!((a.optim.lr, a.optim.weight_decay), (1e-6, 0.01));
    assert_eq!(
        (a.optim.lr_warmup_steps_ratio, a.optim.lr_warmup_steps),
        (0.0, -1)
    );
    assert_eq!(a.optim.lr_scheduler_type, LrScheduler::Constant);
    assert_eq!(a.fsdp_config.fsdp_size, -1);
    assert!(!a.fsdp_config.param_offload && !a.fsdp_config.optimizer_offload);
    assert_eq!(a.checkpoint.load_contents, a.checkpoint.save_contents);
    assert_eq!(r.name, "ferl");
    assert_eq!(r.mode, RolloutMode::Sync);
    assert_eq!((r.temperature, r.top_k, r.top_p), (1.0, -1, 1.0));
    assert!(r.do_sample);
    assert_eq!((r.n, r.prompt_length, r.response_length), (1, 512, 512));
    assert_eq!(
        (r.tensor_model_parallel_size, r.gpu_memory_utilization),
        (2, 0.5)
    );
    assert!(!r.val_kwargs.do_sample);
    assert_eq!((r.val_kwargs.temperature, r.val_kwargs.n), (0.0, 1));
    let al = &c.algorithm;
    assert_eq!(al.adv_estimator, AdvEstimator::Gae);
    assert!(al.norm_adv_by_std_in_grpo && !al.use_kl_in_reward);
    assert_eq!((al.gamma, al.lam, al.kl_ctrl.kl_coef), (1.0, 1.0, 0.001));
    assert_eq!(al.kl_penalty, KlPenalty::Kl);
    assert!(!c.reward_model.enable);
    assert_eq!(c.reward_model.reward_manager, "naive");
    assert_eq!(c.custom_reward_function.path, None);
    assert_eq!(c.custom_reward_function.name, "compute_score");
    assert_eq!(c.critic.enable, None);
    assert!(c.uses_critic());
    let t = &c.trainer;
    assert_eq!((t.total_epochs, t.total_training_steps), (30, None));
    assert_eq!((t.nnodes, t.n_gpus_per_node), (1, 8));
    assert_eq!((t.save_freq, t.test_freq), (-1, -1));
    assert!(t.val_before_train);
    assert_eq!(t.resume_mode, ResumeMode::Auto);
    assert_eq!(t.default_local_dir, "checkpoints/verl_examples/gsm8k");
    assert_eq!(t.logger, StringList::one("console"));
    assert_eq!(t.device, "cuda");
    assert_eq!(c, PpoConfig::default());
}

#[test]
fn verl_grpo_command_line_is_accepted() {
    let c = load(GRPO).unwrap();
    let (a, r) = (&c.actor_rollout_ref.actor, &c.actor_rollout_ref.rollout);
    assert_eq!(c.algorithm.adv_estimator, AdvEstimator::Grpo);
    assert!(!c.uses_critic());
    assert_eq!(c.data.train_batch_size, 16);
    assert_eq!(r.n, 4);
    assert_eq!(a.ppo_mini_batch_size, 8);
    assert_eq!(a.ppo_micro_batch_size_per_gpu, Some(2));
    assert!(a.use_kl_loss);
    assert_eq!(
        (a.kl_loss_coef, a.kl_loss_type),
        (0.001, KlPenalty::LowVarKl)
    );
    assert_eq!(r.temperature, 0.7);
    assert_eq!(c.trainer.total_epochs, 1);
    assert_eq!(
        c.custom_reward_function.path.as_deref(),
        Some("plugins/x.so")
    );
    assert_eq!(c.reward_model.reward_manager, "naive");
    assert_eq!(c.actor_rollout_ref.model.path, "/m/qwen");
    // Followed keys follow; the critic's batch keys follow the actor's.
    assert_eq!((r.prompt_length, r.response_length), (256, 128));
    assert_eq!(c.critic.ppo_mini_batch_size, 8);
    assert_eq!(c.critic.model.tokenizer_path, "/m/qwen");
    let changed: Vec<String> = c.changed_keys().into_iter().map(|(k, _)| k).collect();
    assert!(
        !changed.iter().any(|k| k.starts_with("critic.")),
        "{changed:?}"
    );
    assert!(!changed.contains(&"actor_rollout_ref.rollout.response_length".to_string()));
    assert!(changed.contains(&"data.max_response_length".to_string()));
}

#[test]
fn response_length_follows_data_through_interpolation() {
    let c = load(&["data.max_response_length=32"]).unwrap();
    assert_eq!(c.actor_rollout_ref.rollout.response_length, 32);
    let c = load(&[
        "data.max_response_length=32",
        "actor_rollout_ref.rollout.response_length=16",
    ])
    .unwrap();
    assert_eq!(c.actor_rollout_ref.rollout.response_length, 16);
    let changed: Vec<String> = c.changed_keys().into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        changed,
        [
            "data.max_response_length",
            "actor_rollout_ref.rollout.response_length"
        ]
    );
    // A reset key follows again; a file may write the reference itself.
    let c = load(&[
        "actor_rollout_ref.rollout.response_length=16",
        "~actor_rollout_ref.rollout.response_length",
        "data.max_response_length=64",
    ])
    .unwrap();
    assert_eq!(c.actor_rollout_ref.rollout.response_length, 64);
    let yaml = "data:\n  max_prompt_length: 100\nactor_rollout_ref:\n  rollout:\n    prompt_length: ${data.max_prompt_length}\n";
    let c = PpoConfig::from_yaml(yaml, &[]).unwrap();
    assert_eq!(c.actor_rollout_ref.rollout.prompt_length, 100);
    let c = load(&["trainer.project_name=p", "trainer.experiment_name=e"]).unwrap();
    assert_eq!(c.trainer.default_local_dir, "checkpoints/p/e");
}

#[test]
fn unknown_keys_name_the_key_and_a_hint() {
    let e = err(&["actor_rollout_ref.actor.lr=1e-6"]);
    assert!(
        e.contains("unknown config key `actor_rollout_ref.actor.lr`; did you mean `actor_rollout_ref.actor.optim.lr`?"),
        "{e}"
    );
    assert_eq!(hint("data.batch_size", "8"), "data.train_batch_size");
    assert_eq!(
        hint("actor_rollout_ref.rollout.num_samples", "4"),
        "actor_rollout_ref.rollout.n"
    );
    assert_eq!(hint("critic.lr", "1"), "critic.optim.lr");
    assert_eq!(hint("data.max_length", "1"), "data.max_prompt_length");
    assert_eq!(hint("model.path", "x"), "actor_rollout_ref.model.path");
    assert_eq!(hint("trainer.epochs", "1"), "trainer.total_epochs");
    assert_eq!(
        hint("actor_rollout_ref.actor.num_generations", "4"),
        "actor_rollout_ref.rollout.n"
    );
    assert_eq!(
        hint("actor_rollout_ref.actor.max_grad_norm", "1"),
        "actor_rollout_ref.actor.grad_clip"
    );
    // Spelling, preferring the same section.
    assert_eq!(hint("data.promt_key", "q"), "data.prompt_key");
    assert_eq!(
        hint("actor_rollout_ref.rollout.temprature", "1"),
        "actor_rollout_ref.rollout.temperature"
    );
    assert_eq!(hint("critic.enabel", "true"), "critic.enable");
    // SFT-only keys are unknown here, and the file name is given.
    let e = format!(
        "{:#}",
        PpoConfig::from_yaml(
            "critic:\n  model:\n    fsdp_config:\n      cpu_ofload: true\n",
            &[]
        )
        .unwrap_err()
    );
    assert!(e.contains("in config <yaml>"), "{e}");
    assert!(e.contains("`critic.model.fsdp_config.cpu_ofload`"), "{e}");
    let e = err(&["data.max_prompt_length.x=1"]);
    assert!(e.contains("`data.max_prompt_length` takes a value"), "{e}");
}

#[test]
fn aliases_and_open_keys() {
    let c = load(&[
        "actor_rollout_ref.actor.optim.warmup_style=cosine",
        "actor_rollout_ref.actor.use_remove_padding=true",
        "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
        "+data.apply_chat_template_kwargs.enable_thinking=false",
        "actor_rollout_ref.actor.kl_loss_type=k3",
        "algorithm.kl_penalty=k1",
    ])
    .unwrap();
    let a = &c.actor_rollout_ref;
    assert_eq!(a.actor.optim.lr_scheduler_type, LrScheduler::Cosine);
    assert!(a.model.use_remove_padding);
    assert!(a.model.override_config.contains_key("attention_dropout"));
    assert_eq!(a.actor.kl_loss_type, KlPenalty::LowVarKl);
    assert_eq!(c.algorithm.kl_penalty, KlPenalty::Kl);
    let changed: Vec<String> = c.changed_keys().into_iter().map(|(k, _)| k).collect();
    assert!(!changed.iter().any(|k| k.contains("kl")), "{changed:?}");
}

#[test]
fn bad_values_name_the_key() {
    let e = err(&["data.max_prompt_length=abc"]);
    assert!(
        e.contains("bad value for `data.max_prompt_length`: invalid type: string \"abc\""),
        "{e}"
    );
    let e = err(&["actor_rollout_ref.actor.loss_agg_mode=token-sum"]);
    assert!(
        e.contains(
            "bad value for `actor_rollout_ref.actor.loss_agg_mode`: unknown variant `token-sum`"
        ),
        "{e}"
    );
    assert!(e.contains("`seq-mean-token-sum-norm`"), "{e}");
    let e = err(&["algorithm.adv_estimator=ppo"]);
    assert!(
        e.contains("bad value for `algorithm.adv_estimator`") && e.contains("`grpo`"),
        "{e}"
    );
    let e = err(&["actor_rollout_ref.actor.kl_loss_type=k4"]);
    assert!(e.contains("`actor_rollout_ref.actor.kl_loss_type`"), "{e}");
    let e = err(&["actor_rollout_ref.rollout.mode=batch"]);
    assert!(e.contains("`actor_rollout_ref.rollout.mode`"), "{e}");
}

#[test]
fn ranges_and_verls_batch_rules_name_the_key() {
    let e = err(&[
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    ]);
    assert!(
        e.contains("actor_rollout_ref.actor.ppo_mini_batch_size: must be at most data.train_batch_size (16)"),
        "{e}"
    );
    let e = err(&[
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
    ]);
    assert!(
        e.contains("actor_rollout_ref.actor.ppo_mini_batch_size: 6 does not divide data.train_batch_size (16)"),
        "{e}"
    );
    assert!(e.contains("= 6 of the step's 16 responses"), "{e}");
    let e = err(&["algorithm.adv_estimator=grpo"]);
    assert!(
        e.contains(
            "actor_rollout_ref.rollout.n: must be above 1 with algorithm.adv_estimator=grpo: grpo compares"
        ),
        "{e}"
    );
    assert!(e.contains("(rloo and grpo_passk need groups too)"), "{e}");
    let e = err(&[
        "actor_rollout_ref.rollout.temperature=0",
        "actor_rollout_ref.rollout.top_p=0",
        "actor_rollout_ref.rollout.n=0",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.actor.clip_ratio=-0.1",
        "actor_rollout_ref.actor.clip_ratio_high=-1",
        "actor_rollout_ref.actor.clip_ratio_c=1",
        "data.max_response_length=0",
    ]);
    for want in [
        "actor_rollout_ref.rollout.temperature: must be above 0 when actor_rollout_ref.rollout.do_sample is true",
        "actor_rollout_ref.rollout.top_p: must be in (0, 1]",
        "actor_rollout_ref.rollout.n: must be at least 1",
        "actor_rollout_ref.rollout.val_kwargs.temperature: must be above 0",
        "actor_rollout_ref.actor.clip_ratio: must be a finite number >= 0",
        "actor_rollout_ref.actor.clip_ratio_high: must be a finite number >= 0",
        "actor_rollout_ref.actor.clip_ratio_c: must be above 1",
        "data.max_response_length: must be at least 1",
        "actor_rollout_ref.rollout.response_length: must be at least 1",
    ] {
        assert!(e.contains(want), "{want}\n{e}");
    }
    let e = err(&[
        "actor_rollout_ref.actor.ppo_micro_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]);
    assert!(
        e.contains("actor_rollout_ref.actor.ppo_micro_batch_size: set only one of"),
        "{e}"
    );
    let e = err(&["trainer.resume_mode=resume_path"]);
    assert!(e.contains("trainer.resume_from_path: must be set"), "{e}");
    let c = load(&[
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
    ])
    .unwrap();
    let a = &c.actor_rollout_ref.actor;
    assert_eq!((a.clip_low(), a.clip_high()), (0.2, 0.28));
}

#[test]
fn group_estimators_need_n_above_1_and_mini_batches_count_prompts() {
    let with = |extra: &[&str]| {
        let mut args = GRPO.to_vec();
        args.extend_from_slice(extra);
        load(&args)
    };
    // GRPO's command line: 8 of 16 prompts per optimizer step, each with its 4 responses.
    let c = with(&[]).unwrap();
    assert_eq!(c.actor_rollout_ref.actor.ppo_mini_batch_size, 8);
    let e = format!(
        "{:#}",
        with(&["actor_rollout_ref.actor.ppo_mini_batch_size=6"]).unwrap_err()
    );
    assert!(
        e.contains("actor_rollout_ref.actor.ppo_mini_batch_size: 6 does not divide data.train_batch_size (16)"),
        "{e}"
    );
    assert!(e.contains("= 24 of the step's 64 responses"), "{e}");
    let e = format!(
        "{:#}",
        with(&["actor_rollout_ref.actor.ppo_mini_batch_size=32"]).unwrap_err()
    );
    assert!(
        e.contains("must be at most data.train_batch_size (16)"),
        "{e}"
    );
    assert!(!e.contains("does not divide"), "{e}");
    for (est, others) in [
        ("grpo", "rloo and grpo_passk"),
        ("rloo", "grpo and grpo_passk"),
        ("grpo_passk", "grpo and rloo"),
    ] {
        let e = format!(
            "{:#}",
            with(&[
                &format!("algorithm.adv_estimator={est}"),
                "actor_rollout_ref.rollout.n=1"
            ])
            .unwrap_err()
        );
        assert!(
            e.contains(&format!(
                "actor_rollout_ref.rollout.n: must be above 1 with algorithm.adv_estimator={est}"
            )),
            "{e}"
        );
        assert!(e.contains(&format!("({others} need groups too)")), "{e}");
    }
    // Estimators without groups take one response per prompt.
    for est in ["gae", "reinforce_plus_plus", "remax"] {
        with(&[
            &format!("algorithm.adv_estimator={est}"),
            "actor_rollout_ref.rollout.n=1",
        ])
        .unwrap();
    }
}

#[test]
fn to_yaml_round_trips() {
    let c = load(GRPO).unwrap();
    let yaml = c.to_yaml();
    assert!(yaml.contains("adv_estimator: grpo"), "{yaml}");
    assert!(yaml.contains("loss_agg_mode: token-mean"), "{yaml}");
    assert!(yaml.contains("ref:"), "{yaml}");
    assert_eq!(PpoConfig::from_yaml(&yaml, &[]).unwrap(), c);
    let d = PpoConfig::default();
    assert_eq!(PpoConfig::from_yaml(&d.to_yaml(), &[]).unwrap(), d);
}

#[test]
fn unsupported_changes_are_refused_and_defaults_pass() {
    let supported = Supported::new()
        .keys(&[
            "data.*",
            "actor_rollout_ref.model.path",
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            "actor_rollout_ref.actor.optim.lr",
            "actor_rollout_ref.actor.use_kl_loss",
            "actor_rollout_ref.actor.kl_loss_coef",
            "actor_rollout_ref.actor.entropy_coeff",
            "actor_rollout_ref.rollout.n",
            "actor_rollout_ref.rollout.temperature",
            "custom_reward_function.path",
            "trainer.total_epochs",
        ])
        .values("algorithm.adv_estimator", &["grpo"])
        .values("actor_rollout_ref.rollout.name", &["ferl"])
        .values("actor_rollout_ref.actor.kl_loss_type", &["low_var_kl"])
        .values("trainer.logger", &["console", "jsonl"]);
    load(&[]).unwrap().validate_supported(&supported).unwrap();
    load(GRPO).unwrap().validate_supported(&supported).unwrap();
    let mut args = GRPO.to_vec();
    args.extend([
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "trainer.logger=[console,wandb]",
    ]);
    let e = load(&args)
        .unwrap()
        .validate_supported(&supported)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("actor_rollout_ref.rollout.name=vllm: `vllm` not supported by ferl yet (supported: ferl)"),
        "{e}"
    );
    assert!(
        e.contains(
            "actor_rollout_ref.actor.fsdp_config.param_offload=true: not supported by ferl yet"
        ),
        "{e}"
    );
    assert!(
        e.contains("trainer.logger=[console,wandb]: `wandb` has no Rust client in ferl"),
        "{e}"
    );
    assert!(!e.contains("rollout.n="), "{e}");
    // A followed key set apart from its reference is a change of its own.
    let e = load(&["actor_rollout_ref.rollout.response_length=64"])
        .unwrap()
        .validate_supported(&supported)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("actor_rollout_ref.rollout.response_length=64: not supported by ferl yet"),
        "{e}"
    );
}

#[test]
fn critic_section_is_checked() {
    let c = load(&["critic.enable=false", "critic.optim.lr=2e-5"]).unwrap();
    assert!(!c.uses_critic());
    assert_eq!(c.critic.optim.lr, 2e-5);
    let e = err(&["critic.value_head=linear"]);
    assert!(e.contains("unknown config key `critic.value_head`"), "{e}");
    let refused = c
        .validate_supported(&Supported::new())
        .unwrap_err()
        .to_string();
    assert!(refused.contains("critic.enable=false"), "{refused}");
    assert!(refused.contains("critic.optim.lr=0.00002"), "{refused}");
}
