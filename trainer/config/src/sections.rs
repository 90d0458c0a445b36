//! The four sections of an SFT config (`data`, `model`, `optim`, `trainer`) with verl's legacy `sft_trainer.yaml`
//! key names and defaults (the `optim` section is verl's `optim/fsdp.yaml` merged under `sft_trainer.yaml`, as Hydra
//! composes it). Where ferl's default differs from verl's, the field's doc says so and why.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::string_list::StringList;

/// A free-form mapping passed through to a consumer (template kwargs, plugin options); any keys are accepted.
pub type OpenMap = BTreeMap<String, serde_json::Value>;

/// `data.*`: where the samples come from and how they are turned into token sequences.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Global batch size in samples (all ranks, all micro-batches of one optimizer step). verl: 256.
    pub train_batch_size: usize,
    /// Deprecated by verl in favour of `micro_batch_size_per_gpu`; accepted and ignored when null.
    pub micro_batch_size: Option<usize>,
    /// Samples per forward/backward on one rank; also the validation batch size. verl: 4.
    pub micro_batch_size_per_gpu: usize,
    /// verl's engine trainer: form each rank's training micro-batches to the token budget `max_token_len_per_gpu`
    /// (balanced over the ranks) instead of `micro_batch_size_per_gpu` samples each. The legacy trainer has no such
    /// key, so ferl's default is false (verl's engine trainer: true).
    pub use_dynamic_bsz: bool,
    /// With `use_dynamic_bsz`: tokens per micro-batch on one rank (padded positions when `use_remove_padding` is
    /// off); at least `max_length`. verl: 8192.
    pub max_token_len_per_gpu: usize,
    /// Training files (parquet or jsonl): one path or a list. `~/` is expanded by the reader.
    pub train_files: StringList,
    /// Validation files (parquet or jsonl): one path or a list.
    pub val_files: StringList,
    /// Use only the first N training rows (a seeded random N when `shuffle`); -1 uses all.
    pub train_max_samples: i64,
    /// Use only the first N validation rows; -1 uses all.
    pub val_max_samples: i64,
    /// Column holding the prompt (a string, or a list of chat messages).
    pub prompt_key: String,
    /// Column holding the response string.
    pub response_key: String,
    /// Keys to descend into, in order, inside the prompt column (verl: `prompt_key=extra_info`,
    /// `prompt_dict_keys=['question']`).
    pub prompt_dict_keys: Option<StringList>,
    /// Keys to descend into, in order, inside the response column.
    pub response_dict_keys: Option<StringList>,
    /// Multi-turn chat data (`messages` column) instead of prompt/response columns.
    pub multiturn: MultiturnConfig,
    /// Longest sample in tokens (prompt + response + EOS). verl: 1024.
    pub max_length: usize,
    /// What to do with a sample longer than `max_length`.
    pub truncation: Truncation,
    /// verl: balance tokens across data-parallel ranks. Not used by ferl's token-mean loss (always exact).
    pub balance_dp_token: bool,
    /// A Jinja chat template that replaces the tokenizer's own (`tokenizer_config.json`'s `chat_template`).
    pub chat_template: Option<String>,
    /// verl's custom dataset class (`path` to a Python file, `name` of the class).
    pub custom_cls: CustomClsConfig,
    /// verl: copy files through shared memory. No effect in ferl.
    pub use_shm: bool,
    /// verl: worker processes of the training `DataLoader`. No effect in ferl: the data is tokenized before training
    /// starts, so there is nothing left for loader workers to do. verl: 8.
    pub num_workers: usize,
    /// Extra variables given to the chat template (e.g. `enable_thinking: false`).
    pub apply_chat_template_kwargs: OpenMap,
    /// Shuffle the training set each epoch (seeded by `trainer.seed`); false keeps file order.
    /// verl always shuffles its training sampler, so the default is true.
    pub shuffle: bool,
    /// Name of a ferl dataset plugin that supplies the samples instead of the built-in readers.
    pub plugin: Option<String>,
    /// Options handed to the dataset plugin as-is.
    pub plugin_options: OpenMap,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            train_batch_size: 256,
            micro_batch_size: None,
            micro_batch_size_per_gpu: 4,
            use_dynamic_bsz: false,
            max_token_len_per_gpu: 8192,
            train_files: StringList::one("~/data/gsm8k/train.parquet"),
            val_files: StringList::one("~/data/gsm8k/test.parquet"),
            train_max_samples: -1,
            val_max_samples: -1,
            prompt_key: "question".into(),
            response_key: "answer".into(),
            prompt_dict_keys: None,
            response_dict_keys: None,
            multiturn: MultiturnConfig::default(),
            max_length: 1024,
            truncation: Truncation::Error,
            balance_dp_token: false,
            chat_template: None,
            custom_cls: CustomClsConfig::default(),
            use_shm: false,
            num_workers: 8,
            apply_chat_template_kwargs: OpenMap::new(),
            shuffle: true,
            plugin: None,
            plugin_options: OpenMap::new(),
        }
    }
}

/// `data.multiturn.*`: column names of multi-turn chat data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiturnConfig {
    /// Read `messages_key` (a list of `{role, content}`) instead of prompt/response columns.
    pub enable: bool,
    /// Column holding the list of messages.
    pub messages_key: String,
    /// Column holding a list of tool definitions given to the chat template (optional per file).
    pub tools_key: String,
    /// Column holding a per-row `enable_thinking` flag given to the chat template (optional per file).
    pub enable_thinking_key: String,
}

impl Default for MultiturnConfig {
    fn default() -> Self {
        Self {
            enable: false,
            messages_key: "messages".into(),
            tools_key: "tools".into(),
            enable_thinking_key: "enable_thinking".into(),
        }
    }
}

/// `data.custom_cls.*`: verl's Python dataset class. ferl cannot load Python classes; use `data.plugin`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomClsConfig {
    /// Path of the Python file holding the class.
    pub path: Option<String>,
    /// Name of the class.
    pub name: Option<String>,
}

/// `data.truncation`: how a sample longer than `max_length` is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Truncation {
    /// Fail, naming the file and row of the sample.
    Error,
    /// Keep the last `max_length` tokens.
    Left,
    /// Keep the first `max_length` tokens.
    Right,
}

/// `model.*`: which model to train and how it is laid out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Hugging Face model folder (config.json, safetensors, tokenizer.json) to start from.
    pub partial_pretrain: String,
    /// verl: load the model through shared memory. No effect in ferl.
    pub use_shm: bool,
    /// Sharding and precision settings.
    pub fsdp_config: FsdpConfig,
    /// verl: a Python module imported before the model is built.
    pub external_lib: Option<String>,
    /// Recompute each layer's activations in backward instead of keeping them.
    pub enable_gradient_checkpointing: bool,
    /// verl: allow custom modelling code from the model folder.
    pub trust_remote_code: bool,
    /// LoRA rank; 0 trains all weights.
    pub lora_rank: usize,
    /// LoRA scaling factor.
    pub lora_alpha: f64,
    /// Modules LoRA adapts: `all-linear` or a list of module names.
    pub target_modules: StringList,
    /// Modules LoRA never adapts (names matched like `target_modules`).
    pub exclude_modules: StringList,
    /// A PEFT adapter folder to start from (its `adapter_config.json` sets rank, alpha and modules).
    pub lora_adapter_path: Option<String>,
    /// Use fused kernels (ferl: a kernel plugin) instead of the plain ops.
    pub use_liger: bool,
    /// Parallel strategy: `fsdp2` (verl's default) or `fsdp`.
    pub strategy: Strategy,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            partial_pretrain: "~/models/gemma-1.1-7b-it".into(),
            use_shm: false,
            fsdp_config: FsdpConfig::default(),
            external_lib: None,
            enable_gradient_checkpointing: true,
            trust_remote_code: false,
            lora_rank: 0,
            lora_alpha: 16.0,
            target_modules: StringList::one("all-linear"),
            exclude_modules: StringList::default(),
            lora_adapter_path: None,
            use_liger: false,
            strategy: Strategy::Fsdp2,
        }
    }
}

/// `model.strategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// FSDP1-style full sharding.
    Fsdp,
    /// Per-parameter sharding (verl's default).
    Fsdp2,
}

/// `model.fsdp_config.*`. The input-only key `model.fsdp_config.sharding_strategy` (torch FSDP1's names) is turned
/// into `reshard_after_forward`/`fsdp_size` while loading; see [`crate::spellings`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// dtype the weights are held and computed in.
    pub model_dtype: Dtype,
    /// Which modules become separate sharding units.
    pub wrap_policy: WrapPolicy,
    /// Keep sharded state in host memory.
    pub cpu_offload: bool,
    /// With `cpu_offload`, also offload parameters (not only gradients/optimizer state).
    pub offload_params: bool,
    /// Compute in a lower precision than the held weights; null computes in `model_dtype`. The boolean form is
    /// accepted: `true` is [`MixedPrecision::bf16`], `false` is null (see [`crate::spellings`]).
    pub mixed_precision: Option<MixedPrecision>,
    /// Re-shard parameters after forward (FSDP2's `reshard_after_forward`). `sharding_strategy: SHARD_GRAD_OP` sets
    /// it to false (see [`crate::spellings`]).
    pub reshard_after_forward: bool,
    /// Size of one sharding group; -1 shards over all ranks (verl's `fsdp_size`); a size dividing the ranks shards
    /// within groups of it and replicates across them (HSDP). `sharding_strategy: NO_SHARD` sets it to 1;
    /// `HYBRID_SHARD` needs it set above 1 (see [`crate::spellings`]).
    pub fsdp_size: i64,
    /// Prefetch the next layer's all-gather during forward.
    pub forward_prefetch: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            model_dtype: Dtype::Fp32,
            wrap_policy: WrapPolicy::default(),
            cpu_offload: false,
            offload_params: false,
            mixed_precision: None,
            reshard_after_forward: true,
            fsdp_size: -1,
            forward_prefetch: false,
        }
    }
}

/// `model.fsdp_config.wrap_policy.*`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WrapPolicy {
    /// Smallest module (in parameters) wrapped on its own; 0 wraps each decoder layer.
    pub min_num_params: u64,
}

/// `model.fsdp_config.mixed_precision.*` (verl's worker names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MixedPrecision {
    /// dtype parameters are gathered and computed in.
    pub param_dtype: Dtype,
    /// dtype gradients are reduced in.
    pub reduce_dtype: Dtype,
    /// dtype of buffers (e.g. RoPE tables).
    pub buffer_dtype: Dtype,
}

impl MixedPrecision {
    /// bf16 compute with fp32 gradient reduction and fp32 buffers: what `mixed_precision: true` means.
    pub fn bf16() -> Self {
        Self {
            param_dtype: Dtype::Bf16,
            reduce_dtype: Dtype::Fp32,
            buffer_dtype: Dtype::Fp32,
        }
    }
}

impl Default for MixedPrecision {
    fn default() -> Self {
        Self::bf16()
    }
}

/// A floating-point dtype; verl's short names and PyTorch's long names are both accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Dtype {
    /// 32-bit float.
    #[serde(rename = "fp32", alias = "float32", alias = "float")]
    Fp32,
    /// bfloat16.
    #[serde(rename = "bf16", alias = "bfloat16")]
    Bf16,
    /// IEEE half.
    #[serde(rename = "fp16", alias = "float16", alias = "half")]
    Fp16,
}

/// `optim.*`: AdamW and the learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    /// Optimizer class name (verl: `AdamW`). A `torch.optim` name ([`TORCH_OPTIMIZERS`]) is matched in any case and
    /// stored in its canonical spelling (`adamw`, `ADAMW` -> `AdamW`); another name is kept as written.
    #[serde(deserialize_with = "optimizer_name")]
    pub optimizer: String,
    /// Module the optimizer comes from in verl (`torch.optim`).
    pub optimizer_impl: String,
    /// Peak learning rate. verl's sft default: 1e-5.
    pub lr: f64,
    /// Warmup length as a fraction of the total steps (seed spelling `warmup_steps_ratio` accepted).
    pub lr_warmup_steps_ratio: f64,
    /// Warmup length in steps; -1 uses `lr_warmup_steps_ratio`.
    pub lr_warmup_steps: i64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW (beta1, beta2). verl's sft default: [0.9, 0.95].
    pub betas: [f64; 2],
    /// Clip the global gradient norm to this value.
    pub clip_grad: f64,
    /// Floor of the schedule as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Number of cosine half-waves over the decay (0.5 = one half cosine down to the floor).
    pub num_cycles: f64,
    /// `cosine` or `constant` after warmup (verl's `lr_scheduler_type`/`warmup_style` are accepted as aliases).
    pub lr_scheduler: LrScheduler,
    /// Extra optimizer keyword arguments (verl passes them to the optimizer constructor).
    pub override_optimizer_config: Option<OpenMap>,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            optimizer: "AdamW".into(),
            optimizer_impl: "torch.optim".into(),
            lr: 1e-5,
            lr_warmup_steps_ratio: 0.1,
            lr_warmup_steps: -1,
            weight_decay: 0.01,
            betas: [0.9, 0.95],
            clip_grad: 1.0,
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            lr_scheduler: LrScheduler::Cosine,
            override_optimizer_config: None,
        }
    }
}

/// The optimizer classes of `torch.optim`, in their canonical spelling (what `optim.optimizer` holds after loading).
pub const TORCH_OPTIMIZERS: &[&str] = &[
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "ASGD",
    "LBFGS",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SGD",
    "SparseAdam",
];

/// The canonical spelling of optimizer `name`: the [`TORCH_OPTIMIZERS`] entry equal to it ignoring ASCII case, or
/// `name` as written when there is none.
pub fn canonical_optimizer(name: &str) -> String {
    TORCH_OPTIMIZERS
        .iter()
        .find(|known| known.eq_ignore_ascii_case(name.trim()))
        .map_or_else(|| name.to_string(), |known| known.to_string())
}

fn optimizer_name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    String::deserialize(d).map(|name| canonical_optimizer(&name))
}

/// `optim.lr_scheduler`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduler {
    /// Linear warmup, then cosine decay to `min_lr_ratio * lr`.
    Cosine,
    /// Linear warmup, then constant `lr`.
    Constant,
}

/// `trainer.*`: run length, logging, checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    /// Where checkpoints (`global_step_N/`) and `metrics.jsonl` go.
    pub default_local_dir: String,
    /// verl: mirror checkpoints to HDFS.
    pub default_hdfs_dir: Option<String>,
    /// Project name (used in the default checkpoint directory and by loggers).
    pub project_name: String,
    /// Experiment name (used in the default checkpoint directory and by loggers).
    pub experiment_name: String,
    /// Epochs to train when `total_training_steps` is null.
    pub total_epochs: usize,
    /// Optimizer steps to train; overrides `total_epochs` when set.
    pub total_training_steps: Option<usize>,
    /// Loggers: `console`, `jsonl`, `mlflow` (ferl), or a logger plugin's name. ferl's default is `[console]`, not verl's
    /// `[console, wandb]`, because ferl has no wandb client.
    pub logger: StringList,
    /// Seed of shuffling and of everything else random.
    pub seed: u64,
    /// Save a checkpoint every N steps (and at the end); -1 never (seed spelling `save_interval` accepted).
    pub save_freq: i64,
    /// Validate every N steps (and at the end); -1 never.
    pub test_freq: i64,
    /// Number of machines (verl launches with torchrun; ferl takes it from the cluster).
    pub nnodes: usize,
    /// GPUs per machine (verl launches with torchrun; ferl takes `ferl sft --nproc-per-node`).
    pub n_gpus_per_node: usize,
    /// Keep at most this many checkpoints (older ones, also from earlier runs, are deleted); null keeps all.
    pub max_ckpt_to_keep: Option<usize>,
    /// `auto` (resume from the latest checkpoint in `default_local_dir` if any), `disable`, or `resume_path`.
    pub resume_mode: ResumeMode,
    /// Checkpoint directory to resume from with `resume_mode=resume_path`.
    pub resume_from_path: Option<String>,
    /// What checkpoints hold.
    pub checkpoint: CheckpointConfig,
    /// `cuda` (verl's default) or `cpu`.
    pub device: String,
    /// ferl: times a distributed run restarts after losing a rank or a node (it tears the group down, waits for
    /// resources and resumes from its last complete checkpoint); 0 fails the run at the first loss.
    pub max_restarts: usize,
    /// ferl: when a restart's resources do not come back within `restart_wait_s`, resume at the largest smaller
    /// world size that fits and splits the global batch (checkpoints reshard; the loss is unchanged).
    pub elastic: bool,
    /// ferl: seconds a restart waits for the lost ranks' resources before it fails (or, with `elastic`, shrinks).
    pub restart_wait_s: f64,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            default_local_dir: "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
                .into(),
            default_hdfs_dir: None,
            project_name: "gsm8k-sft".into(),
            experiment_name: "test".into(),
            total_epochs: 4,
            total_training_steps: None,
            logger: StringList::one("console"),
            seed: 1,
            save_freq: -1,
            test_freq: -1,
            nnodes: 1,
            n_gpus_per_node: 8,
            max_ckpt_to_keep: None,
            resume_mode: ResumeMode::Auto,
            resume_from_path: None,
            checkpoint: CheckpointConfig::default(),
            device: "cuda".into(),
            max_restarts: 0,
            elastic: false,
            restart_wait_s: 60.0,
        }
    }
}

/// `trainer.resume_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// Resume from the latest checkpoint under `default_local_dir` when there is one.
    Auto,
    /// Always start from scratch.
    Disable,
    /// Resume from `resume_from_path`.
    ResumePath,
}

/// `trainer.checkpoint.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Parts written: `model`, `optimizer`, `extra` (scheduler, RNG, data position), `hf_model`.
    pub save_contents: StringList,
    /// Parts read on resume (verl's default interpolates `save_contents`).
    pub load_contents: StringList,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            save_contents: StringList(vec!["model".into(), "optimizer".into(), "extra".into()]),
            load_contents: StringList::one("${trainer.checkpoint.save_contents}"),
        }
    }
}
