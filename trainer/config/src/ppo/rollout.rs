//! `actor_rollout_ref.rollout.*`, `algorithm.*`, `reward_model.*`, `custom_reward_function.*`, `critic.*` and
//! `trainer.*` of a PPO config, with verl's `ppo_trainer.yaml` key names and defaults. Where ferl's default differs
//! from verl's, the field's doc says so.

use serde::{Deserialize, Serialize};

use super::algos::{AdvEstimator, KlPenalty, LossAggMode};
use super::sections::{FsdpConfig, OptimConfig};
use crate::sections::{Dtype, OpenMap, ResumeMode, Strategy};
use crate::string_list::StringList;

/// `actor_rollout_ref.rollout.*`: generating the responses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// The generation engine. ferl's default is `ferl`, its own engine (verl: `vllm`, `sglang` or `hf`, no
    /// default); the config accepts any name and the engine refuses what it cannot run.
    pub name: String,
    /// `sync` (batch generation) or `async` (server mode). verl's newer default is `async`.
    pub mode: RolloutMode,
    /// Sampling temperature; above 0 when `do_sample`.
    pub temperature: f64,
    /// Top-k sampling; -1 (vLLM) or 0 (HF) disables it.
    pub top_k: i64,
    /// Nucleus sampling, in (0, 1]; 1 disables it.
    pub top_p: f64,
    /// Prompt length the engine is sized for; follows `data.max_prompt_length`.
    pub prompt_length: usize,
    /// Longest response generated; follows `data.max_response_length`.
    pub response_length: usize,
    /// dtype of the generation weights.
    pub dtype: Dtype,
    /// Fraction of device memory the engine may take (weights and KV cache).
    pub gpu_memory_utilization: f64,
    /// Keep generating after EOS up to `response_length`.
    pub ignore_eos: bool,
    /// verl (vLLM): no CUDA graphs.
    pub enforce_eager: bool,
    /// verl: free the KV cache after generation.
    pub free_cache_engine: bool,
    /// Tensor-parallel degree of the engine (verl: 2; not used by `hf`).
    pub tensor_model_parallel_size: usize,
    /// verl (vLLM): tokens in one engine batch.
    pub max_num_batched_tokens: usize,
    /// verl (vLLM): longest sequence; null is prompt + response.
    pub max_model_len: Option<usize>,
    /// verl (vLLM): sequences in one engine batch.
    pub max_num_seqs: usize,
    /// Deprecated by verl in favour of `log_prob_micro_batch_size_per_gpu` (a global size); exclusive with it.
    pub log_prob_micro_batch_size: Option<usize>,
    /// Sequences per old-log-prob forward on one rank; null leaves the choice to the engine.
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Form log-prob micro-batches to a token budget; follows `actor_rollout_ref.actor.use_dynamic_bsz`.
    pub log_prob_use_dynamic_bsz: bool,
    /// Token budget of a log-prob micro-batch; follows `actor_rollout_ref.actor.ppo_max_token_len_per_gpu`.
    pub log_prob_max_token_len_per_gpu: usize,
    /// verl (vLLM): no engine statistics in the log.
    pub disable_log_stats: bool,
    /// Sample; false decodes greedily.
    pub do_sample: bool,
    /// Responses per prompt (GRPO's group size); above 1 for group-baseline estimators.
    pub n: usize,
    /// Seed of the engine's sampling (verl's vLLM rollout reads `seed`, default 0).
    pub seed: u64,
    /// Extra engine arguments (`vllm: {...}`, `sglang: {...}`), passed on as-is.
    pub engine_kwargs: OpenMap,
    /// Sampling during validation.
    pub val_kwargs: SamplingConfig,
    /// verl: also return the rollout's log-probs (for debugging).
    pub calculate_log_probs: bool,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            name: "ferl".into(),
            mode: RolloutMode::Sync,
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            prompt_length: 512,
            response_length: 512,
            dtype: Dtype::Bf16,
            gpu_memory_utilization: 0.5,
            ignore_eos: false,
            enforce_eager: false,
            free_cache_engine: true,
            tensor_model_parallel_size: 2,
            max_num_batched_tokens: 8192,
            max_model_len: None,
            max_num_seqs: 1024,
            log_prob_micro_batch_size: None,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_use_dynamic_bsz: false,
            log_prob_max_token_len_per_gpu: 16384,
            disable_log_stats: true,
            do_sample: true,
            n: 1,
            seed: 0,
            engine_kwargs: OpenMap::new(),
            val_kwargs: SamplingConfig::default(),
            calculate_log_probs: false,
        }
    }
}

/// `actor_rollout_ref.rollout.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RolloutMode {
    /// Generate each batch in one call.
    Sync,
    /// Serve requests (agent loops, multi-turn).
    Async,
}

/// `actor_rollout_ref.rollout.val_kwargs.*`: sampling during validation (verl: greedy, one response).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingConfig {
    /// Top-k sampling; -1 or 0 disables it.
    pub top_k: i64,
    /// Nucleus sampling, in (0, 1].
    pub top_p: f64,
    /// Sampling temperature; above 0 when `do_sample`.
    pub temperature: f64,
    /// Responses per validation prompt.
    pub n: usize,
    /// Sample; false decodes greedily.
    pub do_sample: bool,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            top_k: -1,
            top_p: 1.0,
            temperature: 0.0,
            n: 1,
            do_sample: false,
        }
    }
}

/// `algorithm.*`: advantages and the KL-in-reward penalty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    /// Discount factor.
    pub gamma: f64,
    /// GAE's λ.
    pub lam: f64,
    /// How advantages are estimated (verl: `gae`; GRPO is `grpo`).
    pub adv_estimator: AdvEstimator,
    /// GRPO: divide by the group's standard deviation (false is Dr. GRPO).
    pub norm_adv_by_std_in_grpo: bool,
    /// Subtract a KL(policy ‖ reference) penalty from the reward.
    pub use_kl_in_reward: bool,
    /// Estimator of the in-reward KL penalty.
    pub kl_penalty: KlPenalty,
    /// Coefficient of the in-reward KL penalty.
    pub kl_ctrl: KlCtrlConfig,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            adv_estimator: AdvEstimator::Gae,
            norm_adv_by_std_in_grpo: true,
            use_kl_in_reward: false,
            kl_penalty: KlPenalty::Kl,
            kl_ctrl: KlCtrlConfig::default(),
        }
    }
}

/// `algorithm.kl_ctrl.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlCtrlConfig {
    /// `fixed` or `adaptive` coefficient.
    #[serde(rename = "type")]
    pub kind: KlCtrlType,
    /// The (initial) coefficient.
    pub kl_coef: f64,
    /// Adaptive: horizon of the controller in samples.
    pub horizon: u64,
    /// Adaptive: the KL the controller aims at.
    pub target_kl: f64,
}

impl Default for KlCtrlConfig {
    fn default() -> Self {
        Self {
            kind: KlCtrlType::Fixed,
            kl_coef: 0.001,
            horizon: 10000,
            target_kl: 0.1,
        }
    }
}

/// `algorithm.kl_ctrl.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlCtrlType {
    /// A constant coefficient.
    Fixed,
    /// A coefficient adapted towards `target_kl`.
    Adaptive,
}

/// `reward_model.*`: a learned reward model, and the reward manager that combines rewards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    /// Score responses with a reward model (false: rule-based rewards only).
    pub enable: bool,
    /// Parallel strategy of the reward model.
    pub strategy: Strategy,
    /// The reward model.
    pub model: RewardModelModel,
    /// Sequences per reward-model forward on one rank.
    pub micro_batch_size_per_gpu: Option<usize>,
    /// Longest sequence the reward model scores.
    pub max_length: Option<usize>,
    /// verl's reward manager: `naive`, `batch`, `prime`, `dapo`, or a registered one.
    pub reward_manager: String,
    /// verl: compute rule-based rewards in the background.
    pub launch_reward_fn_async: bool,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        Self {
            enable: false,
            strategy: Strategy::Fsdp,
            model: RewardModelModel::default(),
            micro_batch_size_per_gpu: None,
            max_length: None,
            reward_manager: "naive".into(),
            launch_reward_fn_async: false,
        }
    }
}

/// `reward_model.model.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelModel {
    /// Hugging Face folder of the reward model.
    pub path: String,
    /// Tokenizer the prompts come in; follows `actor_rollout_ref.model.path`.
    pub input_tokenizer: String,
    /// verl: allow custom modelling code.
    pub trust_remote_code: bool,
}

impl Default for RewardModelModel {
    fn default() -> Self {
        Self {
            path: "~/models/FsfairX-LLaMA3-RM-v0.1".into(),
            input_tokenizer: "~/models/deepseek-llm-7b-chat".into(),
            trust_remote_code: false,
        }
    }
}

/// `custom_reward_function.*`: a rule-based reward (verl: a Python file; ferl: a reward plugin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomRewardFunctionConfig {
    /// Where the function lives; null uses the built-in scorers by `data.reward_fn_key`.
    pub path: Option<String>,
    /// The function's name.
    pub name: String,
}

impl Default for CustomRewardFunctionConfig {
    fn default() -> Self {
        Self {
            path: None,
            name: "compute_score".into(),
        }
    }
}

/// `critic.*`: the value model of GAE. GRPO needs none; only verl's common keys are modelled (any other is an
/// unknown key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticConfig {
    /// Train a critic; null: verl's rule, a critic exactly when `algorithm.adv_estimator` is `gae`.
    pub enable: Option<bool>,
    /// Parallel strategy.
    pub strategy: Strategy,
    /// The critic's optimizer (verl: `lr` 1e-5).
    pub optim: OptimConfig,
    /// The value model.
    pub model: CriticModelConfig,
    /// Prompts per critic optimizer step; follows `actor_rollout_ref.actor.ppo_mini_batch_size`.
    pub ppo_mini_batch_size: usize,
    /// Sequences per forward/backward on one rank.
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Form micro-batches to a token budget; follows `actor_rollout_ref.actor.use_dynamic_bsz`.
    pub use_dynamic_bsz: bool,
    /// With `use_dynamic_bsz`: tokens per micro-batch on one rank.
    pub ppo_max_token_len_per_gpu: usize,
    /// Passes over each batch; follows `actor_rollout_ref.actor.ppo_epochs`.
    pub ppo_epochs: usize,
    /// Shuffle between mini-batches; follows `actor_rollout_ref.actor.shuffle`.
    pub shuffle: bool,
    /// Clip range of the value loss.
    pub cliprange_value: f64,
    /// Reduction of token losses; follows `actor_rollout_ref.actor.loss_agg_mode`.
    pub loss_agg_mode: LossAggMode,
    /// Clip the global gradient norm to this value.
    pub grad_clip: f64,
    /// Ulysses sequence-parallel degree.
    pub ulysses_sequence_parallel_size: usize,
}

impl Default for CriticConfig {
    fn default() -> Self {
        Self {
            enable: None,
            strategy: Strategy::Fsdp,
            optim: OptimConfig {
                lr: 1e-5,
                ..OptimConfig::default()
            },
            model: CriticModelConfig::default(),
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 32768,
            ppo_epochs: 1,
            shuffle: false,
            cliprange_value: 0.5,
            loss_agg_mode: LossAggMode::TokenMean,
            grad_clip: 1.0,
            ulysses_sequence_parallel_size: 1,
        }
    }
}

/// `critic.model.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticModelConfig {
    /// Hugging Face folder the value model starts from.
    pub path: String,
    /// Tokenizer folder; follows `actor_rollout_ref.model.path`.
    pub tokenizer_path: String,
    /// Recompute activations in backward.
    pub enable_gradient_checkpointing: bool,
    /// Pack sequences without padding.
    pub use_remove_padding: bool,
    /// Sharding and offload.
    pub fsdp_config: FsdpConfig,
    /// LoRA rank; 0 trains all weights.
    pub lora_rank: usize,
    /// LoRA scaling factor.
    pub lora_alpha: f64,
}

impl Default for CriticModelConfig {
    fn default() -> Self {
        Self {
            path: "~/models/deepseek-llm-7b-chat".into(),
            tokenizer_path: "~/models/deepseek-llm-7b-chat".into(),
            enable_gradient_checkpointing: true,
            use_remove_padding: false,
            fsdp_config: FsdpConfig::default(),
            lora_rank: 0,
            lora_alpha: 16.0,
        }
    }
}

/// `trainer.*`: run length, logging, checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    /// verl: balance sequence lengths over data-parallel ranks.
    pub balance_batch: bool,
    /// Epochs over the prompts when `total_training_steps` is null.
    pub total_epochs: usize,
    /// Training steps; overrides `total_epochs` when set.
    pub total_training_steps: Option<usize>,
    /// Project name (default checkpoint directory, loggers).
    pub project_name: String,
    /// Experiment name (default checkpoint directory, loggers).
    pub experiment_name: String,
    /// Loggers: `console`, `jsonl`, `mlflow` (ferl), or a logger plugin's name. ferl's default is `[console]`, not verl's
    /// `[console, wandb]`, because ferl has no wandb client.
    pub logger: StringList,
    /// Validation generations printed to the loggers.
    pub log_val_generations: usize,
    /// Directory rollouts are dumped to (jsonl); null dumps none.
    pub rollout_data_dir: Option<String>,
    /// Directory validation generations are dumped to; null dumps none.
    pub validation_data_dir: Option<String>,
    /// Number of machines.
    pub nnodes: usize,
    /// Devices per machine.
    pub n_gpus_per_node: usize,
    /// Save a checkpoint every N steps (and at the end); -1 never.
    pub save_freq: i64,
    /// `auto`, `disable`, or `resume_path`.
    pub resume_mode: ResumeMode,
    /// Checkpoint directory to resume from with `resume_mode=resume_path`.
    pub resume_from_path: Option<String>,
    /// Validate before the first step.
    pub val_before_train: bool,
    /// Only validate, then stop.
    pub val_only: bool,
    /// Validate every N steps (and at the end); -1 never.
    pub test_freq: i64,
    /// Steps the critic trains before the actor starts.
    pub critic_warmup: usize,
    /// verl: mirror checkpoints to HDFS.
    pub default_hdfs_dir: Option<String>,
    /// verl: delete the local checkpoint after loading it.
    pub del_local_ckpt_after_load: bool,
    /// Where checkpoints (`global_step_N/`) and metrics go; follows the project and experiment names.
    pub default_local_dir: String,
    /// Keep at most this many actor checkpoints; null keeps all.
    pub max_actor_ckpt_to_keep: Option<usize>,
    /// Keep at most this many critic checkpoints; null keeps all.
    pub max_critic_ckpt_to_keep: Option<usize>,
    /// `cuda` (verl's default) or `cpu`.
    pub device: String,
    /// ferl: seed of shuffling and of everything else random (verl has no such key; `data.seed` and
    /// `actor_rollout_ref.rollout.seed` are more specific).
    pub seed: u64,
    /// ferl: times the run restarts its ranks after one fails, resuming from its newest checkpoint (as `ferl sft`'s
    /// key); 0 fails the run at the first failure.
    pub max_restarts: usize,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            balance_batch: true,
            total_epochs: 30,
            total_training_steps: None,
            project_name: "verl_examples".into(),
            experiment_name: "gsm8k".into(),
            logger: StringList::one("console"),
            log_val_generations: 0,
            rollout_data_dir: None,
            validation_data_dir: None,
            nnodes: 1,
            n_gpus_per_node: 8,
            save_freq: -1,
            resume_mode: ResumeMode::Auto,
            resume_from_path: None,
            val_before_train: true,
            val_only: false,
            test_freq: -1,
            critic_warmup: 0,
            default_hdfs_dir: None,
            del_local_ckpt_after_load: false,
            default_local_dir: "checkpoints/verl_examples/gsm8k".into(),
            max_actor_ckpt_to_keep: None,
            max_critic_ckpt_to_keep: None,
            device: "cuda".into(),
            seed: 1,
            max_restarts: 0,
        }
    }
}
