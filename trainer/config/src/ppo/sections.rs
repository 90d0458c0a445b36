//! `data.*` and `actor_rollout_ref.*` (less `rollout`) of a PPO config, with verl's `ppo_trainer.yaml` key names
//! and defaults (`data/legacy_data.yaml`, `actor/dp_actor.yaml`, `ref/dp_ref.yaml`, `model/hf_model.yaml` as Hydra
//! composes them). Where ferl's default differs from verl's, the field's doc says so.

use serde::{Deserialize, Serialize};

use super::algos::{KlPenalty, LossAggMode, PolicyLossConfig};
use super::rollout::RolloutConfig;
use crate::sections::{CustomClsConfig, LrScheduler, OpenMap, Strategy, WrapPolicy};
use crate::string_list::StringList;

/// `data.*`: the prompts and how they are tokenized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Tokenizer folder; null uses `actor_rollout_ref.model.path`'s.
    pub tokenizer: Option<String>,
    /// verl: copy files through shared memory.
    pub use_shm: bool,
    /// Training files (parquet or jsonl): one path or a list.
    pub train_files: StringList,
    /// Validation files: one path or a list.
    pub val_files: StringList,
    /// Use only N training rows; -1 uses all.
    pub train_max_samples: i64,
    /// Use only N validation rows; -1 uses all.
    pub val_max_samples: i64,
    /// Column holding the prompt (a list of chat messages, or a string).
    pub prompt_key: String,
    /// Column selecting the reward function of a row (verl: `data_source`).
    pub reward_fn_key: String,
    /// Longest prompt in tokens (prompts are left-padded to it).
    pub max_prompt_length: usize,
    /// Longest generated response in tokens.
    pub max_response_length: usize,
    /// Prompts per training step (each sampled `actor_rollout_ref.rollout.n` times).
    pub train_batch_size: usize,
    /// Prompts per validation batch; null takes the whole validation set at once.
    pub val_batch_size: Option<usize>,
    /// verl: also return the prompt's token ids without the chat template.
    pub return_raw_input_ids: bool,
    /// verl: also return the prompt's messages without the chat template.
    pub return_raw_chat: bool,
    /// verl: also return the prompt with the chat template applied, as text.
    pub return_full_prompt: bool,
    /// Shuffle the training prompts each epoch.
    pub shuffle: bool,
    /// Seed of the shuffle; null uses `trainer.seed`.
    pub seed: Option<u64>,
    /// verl: `DataLoader` worker processes.
    pub dataloader_num_workers: usize,
    /// Shuffle the validation prompts.
    pub validation_shuffle: bool,
    /// Drop prompts longer than `max_prompt_length` instead of applying `truncation`.
    pub filter_overlong_prompts: bool,
    /// verl: processes filtering overlong prompts.
    pub filter_overlong_prompts_workers: usize,
    /// What to do with a prompt longer than `max_prompt_length`.
    pub truncation: PromptTruncation,
    /// Column holding images (multi-modal data).
    pub image_key: String,
    /// Column holding videos (multi-modal data).
    pub video_key: String,
    /// verl: allow custom tokenizer code.
    pub trust_remote_code: bool,
    /// verl's custom dataset class.
    pub custom_cls: CustomClsConfig,
    /// Extra variables given to the chat template.
    pub apply_chat_template_kwargs: OpenMap,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            tokenizer: None,
            use_shm: false,
            train_files: StringList::one("~/data/rlhf/gsm8k/train.parquet"),
            val_files: StringList::one("~/data/rlhf/gsm8k/test.parquet"),
            train_max_samples: -1,
            val_max_samples: -1,
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_prompt_length: 512,
            max_response_length: 512,
            train_batch_size: 1024,
            val_batch_size: None,
            return_raw_input_ids: false,
            return_raw_chat: false,
            return_full_prompt: false,
            shuffle: true,
            seed: None,
            dataloader_num_workers: 8,
            validation_shuffle: false,
            filter_overlong_prompts: false,
            filter_overlong_prompts_workers: 1,
            truncation: PromptTruncation::Error,
            image_key: "images".into(),
            video_key: "videos".into(),
            trust_remote_code: false,
            custom_cls: CustomClsConfig::default(),
            apply_chat_template_kwargs: OpenMap::new(),
        }
    }
}

/// `data.truncation`: how a prompt longer than `data.max_prompt_length` is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptTruncation {
    /// Fail, naming the prompt.
    Error,
    /// Keep the last tokens.
    Left,
    /// Keep the first tokens.
    Right,
    /// Keep the first and last halves.
    Middle,
}

/// `actor_rollout_ref.*`: the policy model and its three roles (training, reference log-probs, generation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorRolloutRefConfig {
    /// verl: actor, rollout and reference share one worker.
    pub hybrid_engine: bool,
    /// `actor_rollout_ref.model.*`.
    pub model: ModelConfig,
    /// `actor_rollout_ref.actor.*`.
    pub actor: ActorConfig,
    /// `actor_rollout_ref.ref.*`.
    #[serde(rename = "ref")]
    pub reference: RefConfig,
    /// `actor_rollout_ref.rollout.*`.
    pub rollout: RolloutConfig,
    /// verl: seconds before a collective times out.
    pub nccl_timeout: u64,
}

impl Default for ActorRolloutRefConfig {
    fn default() -> Self {
        Self {
            hybrid_engine: true,
            model: ModelConfig::default(),
            actor: ActorConfig::default(),
            reference: RefConfig::default(),
            rollout: RolloutConfig::default(),
            nccl_timeout: 600,
        }
    }
}

/// `actor_rollout_ref.model.*`: the policy (and reference) model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Hugging Face model folder to start from.
    pub path: String,
    /// A Jinja chat template replacing the tokenizer's own.
    pub custom_chat_template: Option<String>,
    /// verl: load the model through shared memory.
    pub use_shm: bool,
    /// verl: a Python module imported before the model is built.
    pub external_lib: Option<String>,
    /// Keys overriding the model's `config.json`.
    pub override_config: OpenMap,
    /// Recompute each layer's activations in backward instead of keeping them.
    pub enable_gradient_checkpointing: bool,
    /// verl: offload activations to host memory.
    pub enable_activation_offload: bool,
    /// Pack sequences without padding (verl's actor, reference and rollout log-probs follow this key).
    pub use_remove_padding: bool,
    /// LoRA rank; 0 trains all weights.
    pub lora_rank: usize,
    /// LoRA scaling factor.
    pub lora_alpha: f64,
    /// Modules LoRA adapts: `all-linear` or a list of module names.
    pub target_modules: StringList,
    /// Modules LoRA never adapts.
    pub exclude_modules: Option<StringList>,
    /// A PEFT adapter folder to start LoRA from (its `adapter_config.json` gives rank, alpha and modules).
    pub lora_adapter_path: Option<String>,
    /// Use fused kernels instead of the plain ops.
    pub use_liger: bool,
    /// verl: fused log-prob/entropy kernels.
    pub use_fused_kernels: bool,
    /// verl: allow custom modelling code from the model folder.
    pub trust_remote_code: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: "~/models/deepseek-llm-7b-chat".into(),
            custom_chat_template: None,
            use_shm: false,
            external_lib: None,
            override_config: OpenMap::new(),
            enable_gradient_checkpointing: true,
            enable_activation_offload: false,
            use_remove_padding: false,
            lora_rank: 0,
            lora_alpha: 16.0,
            target_modules: StringList::one("all-linear"),
            exclude_modules: None,
            lora_adapter_path: None,
            use_liger: false,
            use_fused_kernels: false,
            trust_remote_code: false,
        }
    }
}

/// `actor_rollout_ref.actor.*`: the policy update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorConfig {
    /// Parallel strategy: `fsdp` (verl's default) or `fsdp2`.
    pub strategy: Strategy,
    /// Prompts per optimizer step (each with its `rollout.n` responses); `data.train_batch_size` is split into
    /// mini-batches of this size.
    pub ppo_mini_batch_size: usize,
    /// Deprecated by verl in favour of `ppo_micro_batch_size_per_gpu` (a global size); exclusive with it.
    pub ppo_micro_batch_size: Option<usize>,
    /// Sequences per forward/backward on one rank. verl requires it (or `ppo_micro_batch_size`) unless
    /// `use_dynamic_bsz`; null leaves the choice to the engine.
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Form micro-batches to the token budget `ppo_max_token_len_per_gpu` instead of a sequence count.
    pub use_dynamic_bsz: bool,
    /// With `use_dynamic_bsz`: tokens per micro-batch on one rank.
    pub ppo_max_token_len_per_gpu: usize,
    /// PPO's clip range ε: the ratio is clipped to [1 - ε, 1 + ε].
    pub clip_ratio: f64,
    /// Lower clip range; null uses `clip_ratio` (verl writes 0.2, `clip_ratio`'s default). See
    /// [`ActorConfig::clip_low`].
    pub clip_ratio_low: Option<f64>,
    /// Upper clip range (DAPO's clip-higher); null uses `clip_ratio`. See [`ActorConfig::clip_high`].
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip PPO's bound on negative advantages; above 1.
    pub clip_ratio_c: f64,
    /// The policy-loss variant.
    pub policy_loss: PolicyLossConfig,
    /// How token losses are reduced to one number.
    pub loss_agg_mode: LossAggMode,
    /// Weight of the entropy bonus; 0 disables it.
    pub entropy_coeff: f64,
    /// Add a KL(policy ‖ reference) term to the loss (GRPO's way) instead of to the reward.
    pub use_kl_loss: bool,
    /// verl: compile the log-prob computation with `torch.compile`.
    pub use_torch_compile: bool,
    /// Weight of the KL loss term.
    pub kl_loss_coef: f64,
    /// Estimator of the KL loss term.
    pub kl_loss_type: KlPenalty,
    /// Passes over each batch of rollouts.
    pub ppo_epochs: usize,
    /// Shuffle the rollouts between mini-batches.
    pub shuffle: bool,
    /// What actor checkpoints hold.
    pub checkpoint: CheckpointConfig,
    /// The actor's optimizer.
    pub optim: OptimConfig,
    /// Clip the global gradient norm to this value.
    pub grad_clip: f64,
    /// Ulysses sequence-parallel degree; 1 disables it.
    pub ulysses_sequence_parallel_size: usize,
    /// verl: compute the entropy from logits in chunks.
    pub entropy_from_logits_with_chunking: bool,
    /// verl: recompute the entropy in backward.
    pub entropy_checkpointing: bool,
    /// Sharding and offload.
    pub fsdp_config: FsdpConfig,
}

impl Default for ActorConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::Fsdp,
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 16384,
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: 3.0,
            policy_loss: PolicyLossConfig::default(),
            loss_agg_mode: LossAggMode::TokenMean,
            entropy_coeff: 0.0,
            use_kl_loss: false,
            use_torch_compile: true,
            kl_loss_coef: 0.001,
            kl_loss_type: KlPenalty::LowVarKl,
            ppo_epochs: 1,
            shuffle: false,
            checkpoint: CheckpointConfig::default(),
            optim: OptimConfig::default(),
            grad_clip: 1.0,
            ulysses_sequence_parallel_size: 1,
            entropy_from_logits_with_chunking: false,
            entropy_checkpointing: false,
            fsdp_config: FsdpConfig::default(),
        }
    }
}

impl ActorConfig {
    /// The lower clip range in use: `clip_ratio_low`, else `clip_ratio`.
    pub fn clip_low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }

    /// The upper clip range in use: `clip_ratio_high`, else `clip_ratio`.
    pub fn clip_high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }
}

/// `actor_rollout_ref.actor.checkpoint.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Parts written: `model`, `optimizer`, `extra`, `hf_model`.
    pub save_contents: StringList,
    /// Parts read on resume; follows `save_contents` by default.
    pub load_contents: StringList,
    /// verl: write checkpoints in the background.
    pub async_save: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        let parts = StringList(vec!["model".into(), "optimizer".into(), "extra".into()]);
        Self {
            save_contents: parts.clone(),
            load_contents: parts,
            async_save: false,
        }
    }
}

/// `actor_rollout_ref.actor.optim.*` (and `critic.optim.*`): AdamW and the learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    /// Peak learning rate. verl: 1e-6 for the actor, 1e-5 for the critic.
    pub lr: f64,
    /// Warmup length as a fraction of the total steps.
    pub lr_warmup_steps_ratio: f64,
    /// Warmup length in steps; -1 uses `lr_warmup_steps_ratio`.
    pub lr_warmup_steps: i64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW (beta1, beta2).
    pub betas: [f64; 2],
    /// Floor of the cosine schedule as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Number of cosine half-waves over the decay.
    pub num_cycles: f64,
    /// `constant` (verl's default) or `cosine` after warmup; verl's older spelling `warmup_style` is accepted.
    pub lr_scheduler_type: LrScheduler,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            lr_warmup_steps_ratio: 0.0,
            lr_warmup_steps: -1,
            weight_decay: 0.01,
            betas: [0.9, 0.999],
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            lr_scheduler_type: LrScheduler::Constant,
        }
    }
}

/// `actor_rollout_ref.actor.fsdp_config.*` (and `critic.model.fsdp_config.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// Which modules become separate sharding units.
    pub wrap_policy: WrapPolicy,
    /// Keep parameters in host memory between uses.
    pub param_offload: bool,
    /// Keep optimizer state in host memory.
    pub optimizer_offload: bool,
    /// verl: FSDP2's CPU offload policy.
    pub offload_policy: bool,
    /// Re-shard parameters after forward.
    pub reshard_after_forward: bool,
    /// Size of one sharding group; -1 shards over all ranks.
    pub fsdp_size: i64,
    /// Prefetch the next layer's all-gather during forward.
    pub forward_prefetch: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            wrap_policy: WrapPolicy::default(),
            param_offload: false,
            optimizer_offload: false,
            offload_policy: false,
            reshard_after_forward: true,
            fsdp_size: -1,
            forward_prefetch: false,
        }
    }
}

/// `actor_rollout_ref.ref.*`: the frozen reference policy's log-probs (for the KL term).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RefConfig {
    /// Deprecated by verl in favour of `log_prob_micro_batch_size_per_gpu` (a global size); exclusive with it.
    pub log_prob_micro_batch_size: Option<usize>,
    /// Sequences per log-prob forward on one rank; null leaves the choice to the engine.
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Form log-prob micro-batches to a token budget; follows `actor_rollout_ref.actor.use_dynamic_bsz`.
    pub log_prob_use_dynamic_bsz: bool,
    /// Token budget of a log-prob micro-batch; follows `actor_rollout_ref.actor.ppo_max_token_len_per_gpu`.
    pub log_prob_max_token_len_per_gpu: usize,
    /// Ulysses degree; follows `actor_rollout_ref.actor.ulysses_sequence_parallel_size`.
    pub ulysses_sequence_parallel_size: usize,
    /// Sharding and offload of the reference weights.
    pub fsdp_config: RefFsdpConfig,
}

impl Default for RefConfig {
    fn default() -> Self {
        Self {
            log_prob_micro_batch_size: None,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_use_dynamic_bsz: false,
            log_prob_max_token_len_per_gpu: 16384,
            ulysses_sequence_parallel_size: 1,
            fsdp_config: RefFsdpConfig::default(),
        }
    }
}

/// `actor_rollout_ref.ref.fsdp_config.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RefFsdpConfig {
    /// Which modules become separate sharding units.
    pub wrap_policy: WrapPolicy,
    /// Keep the reference weights in host memory between uses.
    pub param_offload: bool,
    /// Re-shard parameters after forward.
    pub reshard_after_forward: bool,
    /// Prefetch the next layer's all-gather during forward.
    pub forward_prefetch: bool,
}

impl Default for RefFsdpConfig {
    fn default() -> Self {
        Self {
            wrap_policy: WrapPolicy::default(),
            param_offload: false,
            reshard_after_forward: true,
            forward_prefetch: false,
        }
    }
}
