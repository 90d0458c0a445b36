//! The groups a [`ShardedParams`](crate::ShardedParams) communicates over: FSDP2's 2-D mesh `[replicate, shard]`.
//!
//! Plain FSDP (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD) has one group, every rank. HSDP (`model.fsdp_config.fsdp_size=S`
//! with `1 < S < world`) splits the `world` ranks into `world / S` shard groups of `S` consecutive ranks
//! (`g·S .. (g+1)·S`), each holding one whole copy of the model sharded over its ranks, and `S` replica groups: the
//! ranks with the same index inside their shard group (`r, r+S, r+2S, ...`), which hold equal shards.
//!
//! # Invariants
//! 1. Data parallelism stays over all `world` ranks: each rank trains its own samples, so a gradient is the sum over
//!    every rank — a reduce-scatter within the shard group, then an all-reduce (sum) of the shard across the
//!    replica group.
//! 2. Replicas hold bit-equal shards: they start from the same elements, receive the same reduced gradients and run
//!    the same local optimizer.
//! 3. A rank's global rank is `replica · S + shard rank` (shard groups are consecutive ranks).

use ferl_collective::Communicator;
use std::sync::Arc;

/// The shard group of a store and, under HSDP, its replica group.
#[derive(Clone)]
pub struct ShardGroups {
    /// The ranks that split one copy of the model between them (every rank, except under HSDP).
    pub shard: Arc<dyn Communicator>,
    /// HSDP: the ranks of the other shard groups holding the same shard as this rank; `None` for plain FSDP.
    pub replicate: Option<Arc<dyn Communicator>>,
}

impl From<Arc<dyn Communicator>> for ShardGroups {
    fn from(comm: Arc<dyn Communicator>) -> Self {
        Self {
            shard: comm,
            replicate: None,
        }
    }
}

impl ShardGroups {
    /// HSDP groups: this rank's shard group and its replica group (see the module docs).
    pub fn hybrid(shard: Arc<dyn Communicator>, replicate: Arc<dyn Communicator>) -> Self {
        Self {
            shard,
            replicate: Some(replicate),
        }
    }

    /// This rank's index in its shard group, and the shard group's size.
    pub fn shard_rank_and_size(&self) -> (usize, usize) {
        (self.shard.rank(), self.shard.world_size())
    }

    /// This rank's replica index (its shard group's index; 0 without HSDP) and the number of replicas.
    pub fn replica_rank_and_count(&self) -> (usize, usize) {
        self.replicate
            .as_ref()
            .map_or((0, 1), |r| (r.rank(), r.world_size()))
    }

    /// This rank's global rank and the number of ranks (invariant 3).
    pub fn global_rank_and_world(&self) -> (usize, usize) {
        let (rank, size) = self.shard_rank_and_size();
        let (replica, replicas) = self.replica_rank_and_count();
        (replica * size + rank, replicas * size)
    }
}
