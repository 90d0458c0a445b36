//! # ferl-actors: the standard actors that run distributed SFT on ferl's runtime
//!
//! ## Data model
//! - A run is driven by one controller ([`sft::train_on_cluster`], verl's single-controller idea): it owns the loop
//!   and talks to actors; tensors never travel through messages, only token ids, paths and numbers ([`messages`]).
//! - [`TrainerRank`] (one per bundle of a resource group) holds a [`rank::RankState`]: its shard of the model in a
//!   `ferl_fsdp::ShardedParams` (FULL_SHARD / SHARD_GRAD_OP / NO_SHARD), over a communicator formed through the
//!   head's key-value store ([`ClusterRendezvous`]), and the trainer's `Stepper`.
//! - [`DataLoader`] tokenizes once and hands out global batches in the seeded epoch order, split by rank
//!   ([`data_loader::DataPlan`] is the pure part). [`Checkpointer`] finishes checkpoints ([`checkpoint`]) while
//!   training goes on. [`Metrics`] writes the loggers.
//! - Ranks started by torchrun or SLURM skip the actors and run the same loop in-process ([`sft::run_from_env`]).
//! - Plugins ([`plugins`]): the driver's plugin host resolves which plugins each actor uses and ships their files
//!   with its spawn (content-addressed, cached per node); actors load them into a host of their own.
//!
//! ## Where things happen
//! - a distributed train step: [`rank::RankState::train_step`] (the trainer's `Stepper::step_with_global_targets`
//!   over the sharded store)
//! - the driver loop: [`sft`]; checkpoint layout and pruning: [`checkpoint`]

pub mod checkpoint;
pub mod data_loader;
pub mod messages;
pub mod metrics;
pub mod plugins;
pub mod rank;
mod registry;
pub mod rendezvous;
pub mod sft;
pub mod trainer_rank;

pub use checkpoint::Checkpointer;
pub use data_loader::DataLoader;
pub use metrics::Metrics;
pub use registry::ensure_linked;
pub use rendezvous::ClusterRendezvous;
pub use trainer_rank::TrainerRank;
