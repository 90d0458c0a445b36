//! ferl's SFT data: GSM8K preparation, parquet/jsonl reading, chat templates, tokenization, loss masks, sample
//! order and micro-batches. No tensors here: everything is plain `Vec`s the engine turns into tensors.
//!
//! # Data model
//! - A [`DataSource`] yields [`SourcedExample`]s: a [`RawExample`] (prompt/response, a conversation, or ready
//!   tokens) with its [`Origin`] (file and row). [`read::FileSource`] reads parquet and jsonl by the `data.*` keys;
//!   a dataset plugin implements the same trait.
//! - A [`TokenizedSample`] is `input_ids: Vec<i64>` and `loss_mask: Vec<bool>`, where `loss_mask[t]` means token
//!   `t` is a target: the engine predicts token `t` from position `t - 1`, so `loss_mask[0]` is always false.
//! - An [`SftDataset`] holds every sample of some files, tokenized up front (in parallel, with a [`Progress`]:
//!   a bar in a terminal, plain lines in a log).
//!
//! # Contract for the engine
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use ferl_data::{collate_packed, collate_padded, epoch_order, global_batch, steps_per_epoch, SftDataset};
//! let cfg = ferl_config::SftConfig::load(None, &["data.train_files=train.parquet".into()])?;
//! let tokenizer_dir = std::path::Path::new(&cfg.model.partial_pretrain);
//! let train = SftDataset::train(&cfg.data, tokenizer_dir)?; // or SftDataset::load(&cfg.data, dir, &files)
//! let order = epoch_order(train.len(), cfg.trainer.seed, 0, cfg.data.shuffle);
//! for step in 0..steps_per_epoch(train.len(), cfg.data.train_batch_size) {
//!     let batch = global_batch(&order, cfg.data.train_batch_size, step);
//!     for micro in batch.chunks(cfg.data.micro_batch_size_per_gpu) {
//!         let samples: Vec<_> = micro.iter().map(|&i| train.get(i)).collect();
//!         let padded = collate_padded(&samples, train.pad_token_id(), None); // [batch, seq_len], right padding
//!         let packed = collate_packed(&samples); // use_remove_padding: tokens back to back + cu_seqlens
//! #       let _ = (padded, packed);
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! # Masking rules (verl's legacy mask trains on the last prompt token and never on EOS; ferl does not)
//! - Single-turn: prompt = the chat template applied to `[{role: user, content: prompt}]` (or to the prompt's own
//!   message list) with the generation prompt; then the response tokens, then EOS (the tokenizer's `eos_token`,
//!   `<|im_end|>` for Qwen). Loss on every response token and on EOS; none on the prompt.
//! - Multi-turn: loss on every assistant message's tokens and the EOS closing it; none elsewhere.
//! - `data.truncation`: `error` (names file and row), `left` (keep the end), `right` (keep the start).

pub mod balance;
pub mod batch;
pub mod dataset;
pub mod gsm8k;
pub mod plan;
pub mod progress;
pub mod read;
pub mod sample;
pub mod source;
pub mod template;
pub mod tokenizer;
pub mod write;

pub use balance::{budget_micro_batches, Batching, RankMicroBatches};
pub use batch::{
    collate_packed, collate_padded, epoch_order, global_batch, rank_shard, steps_per_epoch,
    PackedBatch, PaddedBatch,
};
pub use dataset::SftDataset;
pub use ferl_config::expand_path;
pub use plan::{DataPlan, DataPosition};
pub use progress::{Phase, Progress};
pub use sample::{SampleBuilder, TokenizedSample};
pub use source::{DataSource, Origin, Prompt, RawExample, SourcedExample};
pub use tokenizer::SftTokenizer;
