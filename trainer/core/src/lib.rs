//! ferl's SFT engine on tch (libtorch). Where a train step happens: [`engine::Engine::forward_backward`], driven by
//! [`step::Stepper`]; where a run happens: [`run::run`], the one loop of every launch path.
//!
//! - [`model`]: Qwen2/Qwen3/Llama from a Hugging Face folder or Hub id (config, RoPE, stage layout, layer functions,
//!   safetensors, init) and LoRA adapters in PEFT's format.
//! - [`params`]: the [`params::ParamStore`] trait — the hook where sharding (FSDP) plugs in — and the local store.
//! - [`batch`]: micro-batch tensors from tokenized samples (padded or packed; only target rows reach the head).
//! - [`engine`]: the layer-wise forward/backward schedule with optional gradient checkpointing.
//! - [`huge_pages`]: libtorch's large CPU tensors in transparent huge pages (fewer page faults per step).
//! - [`head`]: the chunked output projection + cross-entropy with a hand-written backward into one reused buffer.
//! - [`head_share`]: a sequence-parallel group's target rows dealt out evenly over its ranks for the head.
//! - [`vocab_parallel`]: the head with its output matrix split by vocabulary rows over the ranks that shard it.
//! - [`loss`]: pluggable losses over per-token log-probabilities and entropies ([`loss::TokenLoss`]): SFT's
//!   cross-entropy, losses written with autograd over the per-token vectors (the RL losses of the `ferl-rl` crate).
//! - [`kernels`]: the op-override hook ([`kernels::KernelRegistry`]): RMSNorm, SwiGLU and the head replaced by
//!   kernels (`model.use_liger=true`), the built-in ops otherwise.
//! - [`optim`]: AdamW, verl's learning-rate schedules, gradient clipping.
//! - [`checkpoint`]: the one `global_step_N/` layout (sharded state, `meta.json`, `huggingface/`), resume, pruning.
//! - [`metrics`]: the [`metrics::MetricsLogger`] trait and the registry of logger kinds (`console`, `jsonl`).
//! - [`run`]: the run loop over a step executor (one process, actor ranks, launcher ranks), its config gate, plan
//!   and metric names.
//! - [`rollout`]: generation with a KV cache (greedy, temperature, top-k, top-p, seeded) and one-pass scoring of
//!   prompt + response tokens (log-probabilities, entropies), with the model code and weights of [`model`].
//! - [`step`]: one optimizer step over a global batch (micro-batching, token-mean loss, clipping, skip on non-finite).
//! - [`storage`]: freeing a parameter buffer's bytes while autograd graphs refer to it, and refilling it (FULL_SHARD).

pub use ferl_config as config;
pub use ferl_data as data;

pub mod batch;
pub mod checkpoint;
pub mod engine;
pub mod head;
pub mod head_share;
pub mod huge_pages;
pub mod kernels;
pub mod loss;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod params;
pub mod rollout;
mod row_exchange;
pub mod run;
pub mod step;
pub mod storage;
pub mod vocab_parallel;
