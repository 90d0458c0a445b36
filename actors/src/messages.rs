//! The wire types of the standard actors: one type per message (rkyv), with its reply declared by
//! [`ferl_runtime::message!`]. Tensors never travel here — only token ids, paths and numbers.

use rkyv::{Archive, Deserialize, Serialize};

/// One tokenized sample: token ids and, per token, whether it is a training target.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Sample {
    /// Token ids.
    pub input_ids: Vec<i64>,
    /// `loss_mask[t]`: token `t` is a target (predicted from position `t - 1`).
    pub loss_mask: Vec<bool>,
}

impl Sample {
    /// Targets in this sample (token 0 never is one).
    pub fn num_targets(&self) -> i64 {
        self.loss_mask.iter().skip(1).filter(|&&m| m).count() as i64
    }
}

impl From<&ferl_data::TokenizedSample> for Sample {
    fn from(s: &ferl_data::TokenizedSample) -> Self {
        Self {
            input_ids: s.input_ids.clone(),
            loss_mask: s.loss_mask.clone(),
        }
    }
}

/// What one rank did in one optimizer step.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct RankStep {
    /// This rank's share of the loss: its summed cross-entropy over the global target count (the global loss is the
    /// sum of the shares).
    pub loss_share: f64,
    /// Global gradient norm before clipping (the same on every rank).
    pub grad_norm: f64,
    /// Learning rate the update used.
    pub lr: f64,
    /// The update was skipped (non-finite norm).
    pub skipped: bool,
    /// Real tokens this rank processed.
    pub tokens: i64,
    /// Targets this rank processed.
    pub targets: i64,
    /// Peak memory of this rank in bytes (0 when unknown): its process's resident set on CPU, its device's memory
    /// in use on CUDA ([`crate::device_memory::peak_memory_bytes`]).
    pub peak_memory_bytes: u64,
}

/// Trainer rank: train on these samples (this rank's share of one global batch).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct TrainStep {
    /// This rank's samples, micro-batch after micro-batch.
    pub samples: Vec<Sample>,
    /// Samples in each micro-batch, in order (every rank gets as many micro-batches).
    pub micro_sizes: Vec<u64>,
    /// Targets in the whole global batch (all ranks): the loss denominator.
    pub global_targets: i64,
}

/// Trainer rank: summed validation cross-entropy and target count over these samples.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Validate {
    /// This rank's share of the validation set.
    pub samples: Vec<Sample>,
    /// Micro-batches every rank runs (the most any rank needs; the store's gathers are collectives).
    pub rounds: u64,
}

/// Trainer rank: copy this rank's shards and write them into the folder `dir` in the background (training goes on).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct SaveShard {
    /// The `global_step_N` folder.
    pub dir: String,
}

/// What a rank's [`SaveShard`] started.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ShardSaving {
    /// The sharded checkpoint's metadata as JSON (identical on every rank).
    pub meta_json: String,
    /// Files this rank is writing; each appears complete (written, then renamed).
    pub files: Vec<String>,
}

/// Trainer rank: wait for the background checkpoint write; fails if it failed.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct FinishSave;

/// Trainer rank: restore model, optimizer and schedule from the checkpoint folder `dir`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct LoadShard {
    /// The `global_step_N` folder.
    pub dir: String,
}

/// Trainer rank: write a Hugging Face folder to `dir`; replies whether this rank wrote it (rank 0 does).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Export {
    /// Output folder.
    pub dir: String,
}

/// Sizes the data loader knows after tokenizing.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct DatasetInfo {
    /// Training samples.
    pub train_len: u64,
    /// Validation samples (0 when validation is off or no files are given).
    pub val_len: u64,
    /// Optimizer steps per epoch.
    pub steps_per_epoch: u64,
}

/// Data loader: report [`DatasetInfo`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct GetDatasetInfo;

/// Data loader: the global batch of these training-set indices (in order), split across ranks. The run loop
/// decides the order ([`ferl_data::DataPlan`]); the loader only holds the samples.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct BatchOf {
    /// Training-set indices of the batch.
    pub indices: Vec<u64>,
}

/// One global batch, split by data-parallel rank.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct GlobalBatch {
    /// Per rank: its share of the batch ([`crate::data_loader::plan_shares`]), micro-batch after micro-batch.
    pub shards: Vec<Vec<Sample>>,
    /// Per rank: samples in each of its micro-batches.
    pub micro_sizes: Vec<Vec<u64>>,
    /// Targets in the whole batch.
    pub global_targets: i64,
    /// Real tokens in the whole batch.
    pub tokens: i64,
}

/// Data loader: the validation set split across ranks.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct ValShards;

/// Checkpointer: the ranks are writing `global_step_N`; once their files exist, write its metadata, point
/// `latest_checkpointed_iteration.txt` at it and prune old checkpoints.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Commit {
    /// The sharded checkpoint's metadata as JSON (`fsdp_meta.json`, written once every file exists).
    pub fsdp_meta_json: String,
    /// Every rank's files; the checkpointer waits for all of them.
    pub files: Vec<String>,
    /// The checkpoint's `meta.json` as JSON ([`ferl_trainer::checkpoint::RunMeta`]), written last.
    pub run_meta_json: String,
}

/// Checkpointer: wait for earlier commits; reply with the latest committed step (0 when none).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Flush;

/// Metrics: record one step's values.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct Log {
    /// Global step.
    pub step: u64,
    /// Named values (`train/loss`, `perf/mfu`, ...).
    pub values: Vec<(String, f64)>,
}

/// Trainer rank: the intra-op threads it chose, as one line ([`ferl_trainer::run::threads::ThreadChoice::describe`]).
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct IntraOpThreads;

/// Metrics: flush the loggers.
#[derive(Archive, Serialize, Deserialize, Debug, Clone)]
pub struct FlushLogs;

ferl_runtime::message! {
    TrainStep => RankStep;
    Validate => (f64, i64);
    SaveShard => ShardSaving;
    FinishSave => ();
    LoadShard => ();
    Export => bool;
    IntraOpThreads => String;
    GetDatasetInfo => DatasetInfo;
    BatchOf => GlobalBatch;
    ValShards => Vec<Vec<Sample>>;
    Commit => ();
    Flush => u64;
    Log => ();
    FlushLogs => ();
}
