//! FSDP2-style sharding for ferl's SFT engine (design note 8): a [`ParamStore`](ferl_trainer::params::ParamStore)
//! that shards parameters, gradients and AdamW state over a [`Communicator`](ferl_collective::Communicator) group.
//!
//! # Data model
//! The model's tensors are grouped per stage (embedding, each decoder layer, final norm + head) into [`FlatUnit`]s:
//! one flat fp32 buffer per unit, padded to a multiple of the world size. Rank `r` keeps slice `r` of each buffer as its
//! fp32 master (FULL_SHARD, SHARD_GRAD_OP) or the whole buffer (NO_SHARD). The optimizer (`ferl_trainer::optim::AdamW`,
//! element-wise) runs on those local buffers only. HSDP ([`ShardGroups::hybrid`], `fsdp_size=S`) does the same within
//! each shard group of `S` ranks (the "world" of the units is `S`) and sums gradients across the groups.
//!
//! # Using it (one trainer rank)
//! ```no_run
//! # use std::sync::Arc;
//! # fn demo(comm: Arc<dyn ferl_collective::Communicator>) -> anyhow::Result<()> {
//! use ferl_fsdp::{FsdpOptions, ShardedParams, ShardingStrategy};
//! use ferl_trainer::model::{config::ModelConfig, layout::ModelLayout, weights::WeightReader};
//! let dir = std::path::Path::new("assets/models/tiny-qwen2");
//! let layout = ModelLayout::new(&ModelConfig::from_file(&dir.join("config.json"))?);
//! let opts = FsdpOptions::new(ShardingStrategy::FullShard, tch::Kind::Float, tch::Device::Cpu);
//! // Each rank reads only its shard's bytes from the safetensors files (`ShardedParams::new` takes full tensors).
//! let mut files = WeightReader::open(dir, &layout)?;
//! let store = ShardedParams::from_source(layout, &mut files, comm, opts)?;
//! // Build `Engine::new(cfg, store, kind, ..)`, `AdamW::new(cfg, store.trainable_masters())`, a `Stepper`, then call
//! // `ferl_fsdp::global_step(&mut stepper, &my_slice_of_the_global_batch)` every step on every rank.
//! # Ok(()) }
//! ```
//! Checkpoints: [`save_sharded`] / [`load_sharded`] (any world size and strategy on load), [`assemble_full`],
//! [`export_hf`] / [`export_sharded`] (the Hugging Face folder from shards). A checkpointer that writes while training
//! continues takes a [`ShardSnapshot`] on each rank (a copy), writes it from another thread, and has rank 0 call
//! [`ShardSnapshot::write_meta`] after every rank's write returned.
//!
//! # Modules
//! - [`units`]: the flat unit layout (who owns which elements).
//! - [`groups`]: [`ShardGroups`], the shard group and (HSDP) replica group a store communicates over.
//! - [`store`]: [`ShardedParams`] — gather (all-gather + prefetch), reduce-scatter, release (FULL_SHARD frees the
//!   gathered bytes even where a kept autograd graph refers to them, and `regather` fills them again), norms, and
//!   [`MemoryStats`], the bytes a rank holds.
//! - [`checkpoint`]: sharded checkpoints that load at any world size, and assembly of full tensors.
//! - [`load`]: building a rank's store from the model's files, reading only its shard ([`ParamSource`]).
//! - [`global`]: the exact token-mean over the global batch across ranks.
//! - `worker`: the thread that runs the collectives in order while the main thread computes.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod global;
pub mod groups;
pub mod load;
mod row_split;
pub mod store;
pub mod units;
mod worker;

pub use checkpoint::{
    assemble_full, export_hf, export_sharded, load_sharded, read_meta, save_sharded,
    CheckpointMeta, LoadedShards, ShardSnapshot,
};
pub use global::global_step;
pub use groups::ShardGroups;
pub use load::{ParamSource, WithTensors};
pub use store::{CommStats, MemoryStats, ShardedParams};
pub use units::{FlatUnit, UnitPlan};

use anyhow::{bail, Result};
use ferl_config::{Dtype, FsdpConfig};
use std::str::FromStr;
use tch::{Device, Kind};

/// How parameters, gradients and optimizer state are split across ranks (PyTorch FSDP's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardingStrategy {
    /// Everything sharded; parameters are gathered per stage and freed after use (ZeRO-3).
    FullShard,
    /// Gradients and optimizer state sharded; gathered parameters are kept until the step's backward ends (ZeRO-2).
    ShardGradOp,
    /// Full replicas on every rank; gradients are all-reduced (DDP).
    NoShard,
}

impl FromStr for ShardingStrategy {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_uppercase().as_str() {
            "FULL_SHARD" => Self::FullShard,
            "SHARD_GRAD_OP" => Self::ShardGradOp,
            "NO_SHARD" => Self::NoShard,
            other => bail!(
                "sharding strategy `{other}` is not supported (supported: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)"
            ),
        })
    }
}

impl ShardingStrategy {
    /// The strategy verl's `model.fsdp_config` implies: `fsdp_size: 1` replicates (NO_SHARD),
    /// `reshard_after_forward: false` keeps parameters through backward (SHARD_GRAD_OP), otherwise FULL_SHARD.
    pub fn from_fsdp_config(cfg: &FsdpConfig) -> Self {
        if cfg.fsdp_size == 1 {
            Self::NoShard
        } else if !cfg.reshard_after_forward {
            Self::ShardGradOp
        } else {
            Self::FullShard
        }
    }
}

/// How a [`ShardedParams`] runs.
#[derive(Clone, Copy, Debug)]
pub struct FsdpOptions {
    /// Sharding strategy.
    pub strategy: ShardingStrategy,
    /// dtype parameters are gathered and computed in (bf16 for mixed precision).
    pub compute_kind: Kind,
    /// dtype gradients are reduced in (fp32 unless asked otherwise).
    pub reduce_kind: Kind,
    /// Device the stages compute on (and the communicator's device).
    pub device: Device,
    /// Keep fp32 masters, gradients and optimizer state in host memory (a no-op when `device` is the CPU).
    pub cpu_offload: bool,
    /// Start the next stage's all-gather while the current stage computes.
    pub prefetch: bool,
    /// Split the vocabulary matrices by rows over the shard group (`vocab_parallel`): the embedding and the head work
    /// on this rank's rows instead of gathering the whole `[vocab, hidden]` matrix. On by default; it changes no
    /// result beyond rounding, so turning it off serves comparisons and tests of the gathered path.
    pub vocab_parallel: bool,
}

impl FsdpOptions {
    /// fp32 reduction, no offload, prefetch on.
    pub fn new(strategy: ShardingStrategy, compute_kind: Kind, device: Device) -> Self {
        Self {
            strategy,
            compute_kind,
            reduce_kind: Kind::Float,
            device,
            cpu_offload: false,
            prefetch: true,
            vocab_parallel: true,
        }
    }

    /// Options from verl's `model.fsdp_config`: compute dtype from `mixed_precision.param_dtype` (else
    /// `model_dtype`), reduce dtype from `mixed_precision.reduce_dtype`, offload from `cpu_offload`/`offload_params`,
    /// prefetch always on (it never changes results).
    pub fn from_fsdp_config(cfg: &FsdpConfig, device: Device) -> Self {
        let (compute, reduce) = match &cfg.mixed_precision {
            Some(mp) => (kind_of(mp.param_dtype), kind_of(mp.reduce_dtype)),
            None => (kind_of(cfg.model_dtype), Kind::Float),
        };
        Self {
            strategy: ShardingStrategy::from_fsdp_config(cfg),
            compute_kind: compute,
            reduce_kind: reduce,
            device,
            cpu_offload: cfg.cpu_offload || cfg.offload_params,
            prefetch: true,
            vocab_parallel: true,
        }
    }
}

/// The tch kind of a config dtype.
pub fn kind_of(d: Dtype) -> Kind {
    match d {
        Dtype::Fp32 => Kind::Float,
        Dtype::Bf16 => Kind::BFloat16,
        Dtype::Fp16 => Kind::Half,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferl_config::MixedPrecision;

    #[test]
    fn strategy_names_parse_and_unknown_ones_are_listed() {
        assert_eq!(
            "full_shard".parse::<ShardingStrategy>().unwrap(),
            ShardingStrategy::FullShard
        );
        assert_eq!(
            "SHARD_GRAD_OP".parse::<ShardingStrategy>().unwrap(),
            ShardingStrategy::ShardGradOp
        );
        assert_eq!(
            "NO_SHARD".parse::<ShardingStrategy>().unwrap(),
            ShardingStrategy::NoShard
        );
        let err = "HYBRID_SHARD"
            .parse::<ShardingStrategy>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("HYBRID_SHARD") && err.contains("FULL_SHARD"),
            "{err}"
        );
    }

    #[test]
    fn verl_fsdp_config_maps_to_strategy_precision_and_offload() {
        let mut cfg = FsdpConfig::default();
        let o = FsdpOptions::from_fsdp_config(&cfg, Device::Cpu);
        assert_eq!(o.strategy, ShardingStrategy::FullShard);
        assert_eq!(
            (o.compute_kind, o.reduce_kind, o.cpu_offload),
            (Kind::Float, Kind::Float, false)
        );
        cfg.reshard_after_forward = false;
        cfg.mixed_precision = Some(MixedPrecision::default());
        cfg.offload_params = true;
        let o = FsdpOptions::from_fsdp_config(&cfg, Device::Cpu);
        assert_eq!(o.strategy, ShardingStrategy::ShardGradOp);
        assert_eq!(
            (o.compute_kind, o.reduce_kind, o.cpu_offload),
            (Kind::BFloat16, Kind::Float, true)
        );
        cfg.fsdp_size = 1;
        assert_eq!(
            ShardingStrategy::from_fsdp_config(&cfg),
            ShardingStrategy::NoShard
        );
    }
}
