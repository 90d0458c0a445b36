//! The table of bad inputs run by `bad_inputs.rs`: each row is one command run as a user (or a launcher) would, the
//! peer it meets, and the text its error must contain.
//!
//! Placeholders in arguments, environment values, expected texts and `gone` paths: `{d}` the fixture folder (see
//! `setup.rs` for its bad files), `{run}` the row's own `trainer.default_local_dir`, `{state}` the row's own session
//! root (`FERL_TMPDIR`), `{head}` the shared head's address, `{port}` a free port for the row, `{secret}` and
//! `{secret2}` two fresh job secrets.
//!
//! A forged shared-memory offer is not driven from here: offers travel only inside the authenticated mesh connection
//! of a group, so a forger must first hold the job secret (the wrong-secret rows below show it cannot join without
//! it). The offer checks themselves (another descriptor, a wrong nonce or geometry, a torn header, another user) are
//! covered by `ferl-collective`'s crate test `tcp::shm::tests::offers_of_another_descriptor_or_with_the_wrong_nonce_are_refused`
//! and `ferl-shm`'s `offers_with_a_wrong_nonce_geometry_or_descriptor_are_refused`, `a_torn_or_foreign_header_is_refused`
//! and `another_user_cannot_open_the_segment`.

/// What a row runs.
#[derive(Clone, Copy)]
pub(crate) enum Cmd {
    /// `ferl sft` with the fixture's short-run overrides (run folder `{run}`), then the row's arguments.
    Sft,
    /// `ferl` with the row's arguments only.
    Ferl,
    /// The sft driver as launcher ranks, one process per environment list (over [`LAUNCH_ENV`]), each with the
    /// fixture's overrides and the row's arguments.
    Ranks(&'static [Env]),
}

/// Environment variables, `(name, value)`.
pub(crate) type Env = &'static [(&'static str, &'static str)];

/// What a row's peer does while (or before) the command runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Peer {
    /// Nothing.
    None,
    /// Sends junk UDP datagrams (random, QUIC-looking long headers, runts) to the head's port first.
    UdpGarbageToHead,
    /// Connects to `127.0.0.1:{port}` (rank 0's rendezvous store) again and again, sending junk bytes.
    GarbageClient,
    /// Listens at `127.0.0.1:{port}` as a fake rendezvous store and answers every connection with junk.
    GarbageStore,
}

/// The environment every launcher rank gets (a row's own values win).
pub(crate) const LAUNCH_ENV: Env = &[
    ("WORLD_SIZE", "2"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "{port}"),
    ("FERL_COLLECTIVE_JOIN_TIMEOUT_S", "5"),
];

/// One bad input.
pub(crate) struct Row {
    /// config, data, model, checkpoint, plugin, cli or network.
    pub cat: &'static str,
    /// What is wrong.
    pub name: &'static str,
    /// The command.
    pub cmd: Cmd,
    /// Its arguments.
    pub args: &'static [&'static str],
    /// Extra environment of every process of the row.
    pub env: Env,
    /// Texts stderr must contain.
    pub expect: &'static [&'static str],
    /// Paths that must not exist afterwards (besides `{run}` for sft rows); a trailing `*` matches a name prefix.
    pub gone: &'static [&'static str],
    /// The row's peer.
    pub peer: Peer,
    /// Whether the head must still answer `ferl status` afterwards.
    pub head_answers: bool,
}

impl Row {
    const fn new(cat: &'static str, name: &'static str, cmd: Cmd) -> Self {
        Row {
            cat,
            name,
            cmd,
            args: &[],
            env: &[],
            expect: &[],
            gone: &[],
            peer: Peer::None,
            head_answers: false,
        }
    }
    const fn args(mut self, args: &'static [&'static str]) -> Self {
        self.args = args;
        self
    }
    const fn env(mut self, env: Env) -> Self {
        self.env = env;
        self
    }
    const fn expect(mut self, expect: &'static [&'static str]) -> Self {
        self.expect = expect;
        self
    }
    const fn gone(mut self, gone: &'static [&'static str]) -> Self {
        self.gone = gone;
        self
    }
    const fn peer(mut self, peer: Peer) -> Self {
        self.peer = peer;
        self.head_answers = matches!(peer, Peer::UdpGarbageToHead);
        self
    }
    const fn head_answers(mut self) -> Self {
        self.head_answers = true;
        self
    }
}

/// `ferl sft` + fixture overrides + `args`, refused with `expect`.
const fn sft(
    cat: &'static str,
    name: &'static str,
    args: &'static [&'static str],
    expect: &'static [&'static str],
) -> Row {
    Row::new(cat, name, Cmd::Sft).args(args).expect(expect)
}

/// `ferl args`, refused with `expect`.
const fn ferl(
    cat: &'static str,
    name: &'static str,
    args: &'static [&'static str],
    expect: &'static [&'static str],
) -> Row {
    Row::new(cat, name, Cmd::Ferl).args(args).expect(expect)
}

/// Launcher ranks (one per environment list), refused with `expect`.
const fn ranks(name: &'static str, ranks: &'static [Env], expect: &'static [&'static str]) -> Row {
    Row::new("network", name, Cmd::Ranks(ranks)).expect(expect)
}

/// `ferl grpo` of one step (2 prompts x 2 responses of `{d}/grpo/train.jsonl` on the fixture's tiny model) into
/// `{run}`, then the given arguments (a repeated key takes the later value).
macro_rules! grpo {
    ($($extra:expr),* $(,)?) => {
        &[
            "grpo", "data.train_files={d}/grpo/train.jsonl", "actor_rollout_ref.model.path={d}/model",
            "trainer.default_local_dir={run}", "data.train_batch_size=2", "data.max_prompt_length=64",
            "data.max_response_length=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "algorithm.adv_estimator=grpo", "trainer.device=cpu", "trainer.total_training_steps=1", "trainer.logger=[console]",
            $($extra),*
        ]
    };
}

/// A refused `ferl grpo` leaves no run folder.
const GRPO_RUN: &[&str] = &["{run}"];
const EXPORT_OUT: &[&str] = &["{d}/exported"];
const START_LOG: &[&str] = &["{state}/ferl-start-*"];

/// Every row (one per line or two: a table, left unformatted).
#[rustfmt::skip]
pub(crate) const ROWS: &[Row] = &[
    // ---- config
    sft("config", "unknown key", &["optim.lrr=1"], &["unknown config key `optim.lrr`; did you mean `optim.lr`?"]),
    sft("config", "verl-style alias", &["max_steps=3"], &["`max_steps`; did you mean `trainer.total_training_steps`?"]),
    sft("config", "wrong type", &["data.train_batch_size=abc"], &["bad value for `data.train_batch_size`", "\"abc\""]),
    sft("config", "negative count", &["trainer.total_epochs=-1"], &["bad value for `trainer.total_epochs`"]),
    sft("config", "negative lr", &["optim.lr=-1"], &["optim.lr: must be a finite number >= 0"]),
    sft("config", "max_length 0", &["data.max_length=0"], &["data.max_length: must be at least 2"]),
    sft("config", "micro-batch 0", &["data.micro_batch_size_per_gpu=0"], &["data.micro_batch_size_per_gpu: must be at least 1"]),
    sft("config", "unknown enum value", &["data.truncation=middle"], &["bad value for `data.truncation`", "`middle`"]),
    sft("config", "fp16", &["model.fsdp_config.model_dtype=fp16"], &["fp16 is not supported"]),
    sft("config", "batch not splitting over ranks", &["--nproc-per-node", "3"], &["data.train_batch_size=8 does not split evenly over 3 ranks"]),
    sft("config", "bad device", &["trainer.device=tpu"], &["trainer.device=tpu", "supported: cpu, cuda"]),
    sft("config", "resume_path without a path", &["trainer.resume_mode=resume_path"], &["trainer.resume_from_path: must be set when trainer.resume_mode=resume_path"]),
    sft("config", "unknown logger", &["trainer.logger=[console,wandb2]"], &["`wandb2` not supported", "trainer.logger"]),
    sft("config", "elastic without max_restarts", &["trainer.elastic=true"], &["trainer.elastic=true", "trainer.max_restarts"]),
    sft("config", "unsupported verl key", &["trainer.default_hdfs_dir=hdfs://x"], &["trainer.default_hdfs_dir=hdfs://x: not supported by ferl yet"]),
    sft("config", "sequence parallel", &["ulysses_sequence_parallel_size=2"], &["ulysses_sequence_parallel_size=2"]),
    sft("config", "bad YAML file", &["--config", "{d}/bad.yaml"], &["parsing config {d}/bad.yaml", "line 3"]),
    sft("config", "unknown key in a YAML file", &["--config", "{d}/unknown_key.yaml"], &["in config {d}/unknown_key.yaml", "`data.train_bach_size`; did you mean `data.train_batch_size`?"]),
    sft("config", "missing --config file", &["--config", "{d}/nope.yaml"], &["reading config {d}/nope.yaml"]),
    sft("config", "override without =", &["foo"], &["override `foo` has no `=`"]),
    sft("config", "override without key", &["=3"], &["override `=3`", "is not a dotted config key"]),
    sft("config", "bad --cfg", &["--cfg", "foo"], &["--cfg foo: only `--cfg job` is supported"]),
    Row::new("config", "max_restarts under a torchrun env", Cmd::Ranks(&[&[("RANK", "0"), ("FERL_JOB_SECRET", "{secret}")]]))
        .args(&["trainer.max_restarts=1"])
        .expect(&["trainer.max_restarts=1: under torchrun/SLURM the launcher restarts ranks"]),
    ferl("config", "grpo: rollout.n=1 with adv_estimator=grpo", grpo!["actor_rollout_ref.rollout.n=1"], &["actor_rollout_ref.rollout.n: must be above 1 with algorithm.adv_estimator=grpo: grpo compares each response with the others of its prompt", "(rloo and grpo_passk need groups too)"])
        .gone(GRPO_RUN),
    ferl("config", "grpo: rollout.n=1 with adv_estimator=rloo", grpo!["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"], &["actor_rollout_ref.rollout.n: must be above 1 with algorithm.adv_estimator=rloo"])
        .gone(GRPO_RUN),
    ferl("config", "grpo: ppo_mini_batch_size not dividing the batch", grpo!["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=3"], &["actor_rollout_ref.actor.ppo_mini_batch_size: 3 does not divide data.train_batch_size (4)", "= 6 of the step's 8 responses"])
        .gone(GRPO_RUN),
    ferl("config", "grpo: ppo_mini_batch_size above the batch", grpo!["actor_rollout_ref.actor.ppo_mini_batch_size=4"], &["actor_rollout_ref.actor.ppo_mini_batch_size: must be at most data.train_batch_size (2)"])
        .gone(GRPO_RUN),
    ferl("config", "grpo: a KL estimator ferl does not compute", grpo!["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=full"], &["actor_rollout_ref.actor.kl_loss_type=full: `full` not supported by ferl yet (supported: kl, abs, mse, low_var_kl)"])
        .gone(GRPO_RUN),
    ferl("config", "grpo: an estimator ferl does not run", grpo!["algorithm.adv_estimator=remax"], &["algorithm.adv_estimator=remax: `remax` not supported by ferl yet (supported: grpo, rloo)"])
        .gone(GRPO_RUN),
    // ---- data
    sft("data", "missing file", &["data.train_files={d}/missing.jsonl"], &["loading data.train_files", "opening {d}/missing.jsonl"]),
    sft("data", "bad JSON line", &["data.train_files={d}/bad_line.jsonl"], &["{d}/bad_line.jsonl row 1: not a JSON object (line 2)"]),
    sft("data", "missing prompt column", &["data.train_files={d}/no_prompt.jsonl"], &["{d}/no_prompt.jsonl row 0: no column `question`"]),
    sft("data", "missing response column", &["data.train_files={d}/no_response.jsonl"], &["{d}/no_response.jsonl row 0: no column `answer` (nearest: `ans`"]),
    sft("data", "missing dict column", &["data.prompt_key=extra_info", "data.prompt_dict_keys=[question]"], &["row 0: no column `extra_info`"]),
    sft("data", "garbage parquet", &["data.train_files={d}/garbage.parquet"], &["reading parquet {d}/garbage.parquet"]),
    sft("data", "empty file", &["data.train_files={d}/empty.jsonl"], &["data.train_files={d}/empty.jsonl: 0 samples is fewer than one batch"]),
    sft("data", "bad validation file", &["data.val_files={d}/bad_line.jsonl"], &["loading data.val_files", "{d}/bad_line.jsonl row 1"]),
    sft("data", "sample over max_length with truncation=error", &["data.truncation=error", "data.max_length=8"], &["{d}/train.jsonl row 0", "more than data.max_length=8"]),
    ferl("data", "grpo: prompt over max_prompt_length without filter_overlong_prompts", grpo!["data.train_files={d}/grpo/long.jsonl", "data.filter_overlong_prompts=false"], &["{d}/grpo/long.jsonl row 1: the prompt has", "over data.max_prompt_length=64"])
        .gone(GRPO_RUN),
    // ---- model folders
    sft("model", "missing folder", &["model.partial_pretrain={d}/no_model"], &["model `{d}/no_model` not found"]),
    sft("model", "bad config.json", &["model.partial_pretrain={d}/m_bad_json"], &["parsing {d}/m_bad_json/config.json"]),
    sft("model", "unsupported model_type", &["model.partial_pretrain={d}/m_type"], &["{d}/m_type/config.json: `model_type` `mistral` is not supported"]),
    sft("model", "unsupported activation", &["model.partial_pretrain={d}/m_act"], &["{d}/m_act/config.json: `hidden_act` \"gelu\" is not supported"]),
    sft("model", "unsupported rope scaling", &["model.partial_pretrain={d}/m_rope"], &["{d}/m_rope/config.json: `rope_scaling.rope_type` `yarn` is not supported"]),
    sft("model", "missing safetensors", &["model.partial_pretrain={d}/m_no_weights"], &["{d}/m_no_weights: neither model.safetensors nor model.safetensors.index.json found"]),
    sft("model", "truncated safetensors", &["model.partial_pretrain={d}/m_truncated"], &["parsing {d}/m_truncated/model.safetensors"]),
    sft("model", "wrong tensor shape", &["model.partial_pretrain={d}/m_shape"], &["tensor `model.layers.0.mlp.gate_proj.weight` has shape [64, 32], config.json implies [48, 32]"]),
    sft("model", "index naming a missing shard", &["model.partial_pretrain={d}/m_index"], &["reading {d}/m_index/model-00002-of-00002.safetensors"]),
    // ---- checkpoints
    sft("checkpoint", "resume from a missing folder", &["trainer.resume_mode=resume_path", "trainer.resume_from_path={d}/no_ckpt/global_step_3"], &["resuming from {d}/no_ckpt/global_step_3", "meta.json (is it a complete checkpoint?)"]),
    sft("checkpoint", "resume from a corrupted shard", &["trainer.resume_mode=resume_path", "trainer.resume_from_path={d}/c_corrupt/global_step_1"], &["checkpoint file {d}/c_corrupt/global_step_1/model_world_size_1_rank_0.safetensors is corrupted"]),
    sft("checkpoint", "resume from a truncated meta.json", &["trainer.resume_mode=resume_path", "trainer.resume_from_path={d}/c_meta/global_step_1"], &["parsing {d}/c_meta/global_step_1/meta.json"]),
    sft("checkpoint", "auto-resume with no checkpoint that verifies", &["trainer.default_local_dir={d}/c_auto", "trainer.resume_mode=auto"], &["skipping checkpoint {d}/c_auto/global_step_1", "no checkpoint under {d}/c_auto verifies"])
        .gone(&["{d}/c_auto/global_step_2"]),
    sft("checkpoint", "garbage latest pointer", &["trainer.default_local_dir={d}/c_latest", "trainer.resume_mode=auto"], &["{d}/c_latest/latest_checkpointed_iteration.txt: `abc` is not a step number"])
        .gone(&["{d}/c_latest/global_step_2"]),
    ferl("checkpoint", "grpo: garbage latest pointer (read as SFT reads it)", grpo!["trainer.default_local_dir={d}/c_latest", "trainer.resume_mode=auto", "custom_reward_function.path={d}/grpo/testkit_reward.so"], &["{d}/c_latest/latest_checkpointed_iteration.txt: `abc` is not a step number"])
        .gone(&["{d}/c_latest/global_step_2", "{d}/c_latest/metrics.jsonl"]),
    ferl("checkpoint", "export of a non-checkpoint", &["export", "--checkpoint", "{d}/bad_run", "--out", "{d}/exported"], &["--checkpoint {d}/bad_run: not a ferl checkpoint (no fsdp_meta.json) nor a Hugging Face folder"])
        .gone(EXPORT_OUT),
    ferl("checkpoint", "export of a corrupted shard", &["export", "--checkpoint", "{d}/c_corrupt/global_step_1", "--out", "{d}/exported"], &["checkpoint file {d}/c_corrupt/global_step_1/model_world_size_1_rank_0.safetensors is corrupted"])
        .gone(EXPORT_OUT),
    ferl("checkpoint", "export with a truncated meta.json", &["export", "--checkpoint", "{d}/c_meta/global_step_1", "--out", "{d}/exported"], &["parsing {d}/c_meta/global_step_1/meta.json"])
        .gone(EXPORT_OUT),
    ferl("checkpoint", "export in an unknown dtype", &["export", "--checkpoint", "{d}/ckpt/global_step_1", "--out", "{d}/exported", "--dtype", "fp8"], &["export dtype `fp8`: expected fp32 or bf16"])
        .gone(EXPORT_OUT),
    ferl("checkpoint", "--merge-lora of a full checkpoint", &["export", "--checkpoint", "{d}/ckpt/global_step_1", "--out", "{d}/exported", "--merge-lora"], &["is not a LoRA checkpoint"])
        .gone(EXPORT_OUT),
    ferl("checkpoint", "export --copy-from a missing folder", &["export", "--checkpoint", "{d}/ckpt/global_step_1", "--out", "{d}/exported", "--copy-from", "{d}/nothing"], &["--copy-from {d}/nothing: no such folder"])
        .gone(EXPORT_OUT),
    // ---- plugins
    sft("plugin", "unknown data.plugin", &["data.plugin=nosuch"], &["data.plugin=nosuch", "no dataset plugin named `nosuch`"]),
    sft("plugin", "non-library file as data.custom_cls", &["data.custom_cls.path={d}/plugins/libferl_plugin_fake.so", "data.custom_cls.name=Fake"], &["plugin {d}/plugins/libferl_plugin_fake.so: cannot load the library", "file too short"]),
    sft("plugin", "non-library file in FERL_PLUGIN_PATH", &["data.plugin=fake"], &["plugin skipped: plugin {d}/plugins/libferl_plugin_fake.so", "no dataset plugin named `fake`"])
        .env(&[("FERL_PLUGIN_PATH", "{d}/plugins")]),
    ferl("plugin", "grpo: reward plugin file missing", grpo!["custom_reward_function.path={d}/grpo/nope.so"], &["custom_reward_function.path={d}/grpo/nope.so", "cannot read plugin file {d}/grpo/nope.so"])
        .gone(GRPO_RUN),
    ferl("plugin", "grpo: reward library exporting a logger, no reward", grpo!["custom_reward_function.path={d}/grpo/logger.so"], &["custom_reward_function.path={d}/grpo/logger.so", "says kind logger, but a reward plugin was expected"])
        .gone(GRPO_RUN),
    ferl("plugin", "grpo: reward file that is no library", grpo!["custom_reward_function.path={d}/plugins/libferl_plugin_fake.so"], &["custom_reward_function.path={d}/plugins/libferl_plugin_fake.so", "cannot load the library"])
        .gone(GRPO_RUN),
    ferl("plugin", "grpo: reward scoring a row NaN", grpo!["custom_reward_function.path={d}/grpo/testkit_reward.so"], &["plugin testkit@1.0.0", "row 1: score is NaN"])
        .env(&[("FERL_TESTKIT_REWARD", "nan_at=1")])
        .gone(GRPO_RUN),
    ferl("plugin", "bad plugin control file", &["plugin", "list", "--run-dir", "{d}/bad_run"], &["{d}/bad_run/plugins/state.json is not a plugin state file"]),
    ferl("plugin", "reload in a folder with no job", &["plugin", "reload", "alpaca", "--run-dir", "{d}/no_run", "--timeout-s", "1"], &["no job with plugins runs in this run directory"])
        .gone(&["{d}/no_run"]),
    // ---- CLI flags
    sft("cli", "--nnodes 2 without --address", &["--nnodes", "2"], &["--nnodes 2 needs --address of a running cluster"]),
    sft("cli", "--nproc-per-node 0", &["--nproc-per-node", "0"], &["--nproc-per-node 0: give at least 1 rank per node"]),
    sft("cli", "bad --address", &["--nproc-per-node", "1", "--address", "nohost"], &["cluster address `nohost`: expected HOST:PORT"]),
    sft("cli", "unknown flag", &["--bogus"], &["unexpected argument '--bogus'"]),
    ferl("cli", "unknown subcommand", &["frobnicate"], &["unrecognized subcommand 'frobnicate'"]),
    ferl("cli", "start with neither --head nor --address", &["start"], &["`ferl start` needs --head or --address HOST:PORT"]),
    ferl("cli", "start --address without a port", &["start", "--address", "nohost"], &["cluster address `nohost`: expected HOST:PORT"])
        .gone(START_LOG),
    ferl("cli", "start --head with a bad resource", &["start", "--head", "--port", "0", "--resources", "gpu=abc"], &["resource `gpu=abc`: amount is not a number"])
        .gone(START_LOG),
    ferl("cli", "model init from a missing config", &["model", "init", "--config", "{d}/nothing.json", "--out", "{d}/initialized"], &["reading {d}/nothing.json"])
        .gone(&["{d}/initialized"]),
    ferl("cli", "data gsm8k from a missing folder", &["data", "gsm8k", "--input-dir", "{d}/nothing", "--local-dir", "{d}/gsm8k_out"], &["{d}/nothing: no GSM8K train split"])
        .gone(&["{d}/gsm8k_out"]),
    // ---- network peers
    ferl("network", "join with a wrong token", &["start", "--address", "{head}", "--token", "wrong"], &["joining the cluster at {head} was refused: wrong cluster token"])
        .gone(START_LOG)
        .head_answers(),
    ferl("network", "status with a wrong token", &["status", "--address", "{head}", "--token", "wrong"], &["wrong cluster token"]),
    ferl("network", "status without a token", &["status", "--address", "{head}"], &["no cluster token: pass --token or set FERL_TOKEN"]),
    ferl("network", "stop with a wrong token", &["stop", "--address", "{head}", "--token", "wrong"], &["the head at {head} was not stopped", "wrong cluster token"])
        .head_answers(),
    ferl("network", "garbage datagrams, then a wrong token", &["start", "--address", "{head}", "--token", "wrong"], &["wrong cluster token"])
        .gone(START_LOG)
        .peer(Peer::UdpGarbageToHead),
    ranks("two ranks with different job secrets", &[&[("RANK", "0"), ("FERL_JOB_SECRET", "{secret}")], &[("RANK", "1"), ("FERL_JOB_SECRET", "{secret2}")]], &["wrong job secret", "FERL_JOB_SECRET"]),
    ranks("a rank without a job secret", &[&[("RANK", "1")]], &["FERL_JOB_SECRET is not set"]),
    ranks("a malformed job secret", &[&[("RANK", "1"), ("FERL_JOB_SECRET", "not-hex")]], &["FERL_JOB_SECRET is malformed", "not hex"]),
    ranks("a short job secret", &[&[("RANK", "1"), ("FERL_JOB_SECRET", "00112233")]], &["the job secret has 4 bytes; it needs 16 to 64"]),
    ranks("rank out of range", &[&[("RANK", "2"), ("FERL_JOB_SECRET", "{secret}")]], &["rank 2 is out of range for world size 2"]),
    ranks("MASTER_PORT not a number", &[&[("RANK", "0"), ("MASTER_PORT", "abc"), ("FERL_JOB_SECRET", "{secret}")]], &["MASTER_PORT=\"abc\" is not a number"]),
    ranks("garbage frames to the rendezvous store", &[&[("RANK", "0"), ("FERL_JOB_SECRET", "{secret}")]], &["not a ferl-collective handshake (bad magic)", "ranks [1] did not connect within 5s"])
        .peer(Peer::GarbageClient),
    ranks("a fake rendezvous store answering garbage", &[&[("RANK", "1"), ("FERL_JOB_SECRET", "{secret}")]], &["rendezvous store at 127.0.0.1:{port}", "the peer answered garbage"])
        .peer(Peer::GarbageStore),
];
