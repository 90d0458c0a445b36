//! # ferl-actors: the standard actors that run distributed SFT on ferl's runtime
//!
//! ## Data model
//! - Every launch path runs the one run loop of `ferl_trainer::run` over a step executor: [`driver::ClusterExecutor`]
//!   (one controller over actors, verl's single-controller idea; [`sft::train_on_cluster`]) or
//!   [`spmd::SpmdExecutor`] (world 1 in one process, or each rank of torchrun/SLURM). Tensors never travel through
//!   messages, only token ids, paths and numbers ([`messages`]).
//! - [`TrainerRank`] (one per bundle of a resource group) holds a [`rank::RankState`]: its shard of the model in a
//!   `ferl_fsdp::ShardedParams` (FULL_SHARD / SHARD_GRAD_OP / NO_SHARD), over a communicator formed through the
//!   head's key-value store ([`ClusterRendezvous`]), and the trainer's `Stepper`.
//! - [`DataLoader`] tokenizes once and hands out the global batches the loop names, split by rank.
//!   [`Checkpointer`] finishes checkpoints ([`checkpoint`]) while training goes on. [`Metrics`] offers the run's
//!   loggers ([`metrics::build_loggers`]) as an actor.
//! - Plugins ([`plugins`]): the driver's plugin host resolves which plugins each actor uses and ships their files
//!   with its spawn (content-addressed, cached per node); actors load them into a host of their own.
//!
//! ## Where things happen
//! - a distributed train step: [`rank::RankState::train_step`] (the trainer's `Stepper::step_with_global_targets`
//!   over the sharded store)
//! - the launch paths: [`sft`]; the loop itself: `ferl_trainer::run::run`
//! - GRPO's roles as actors ([`rl`]: [`rl::Rollout`], [`rl::PolicyActor`]) and verl's single-controller loop over
//!   them ([`rl::GrpoDriver`], [`rl::run_grpo_on_groups`]); weights cross processes as one byte blob

pub mod checkpoint;
pub mod cluster_run;
pub mod data_loader;
pub mod device_memory;
pub mod driver;
pub mod messages;
pub mod metrics;
pub mod plugins;
pub mod rank;
mod registry;
pub mod rendezvous;
pub mod rl;
pub mod sft;
pub mod spmd;
pub mod trainer_rank;

pub use checkpoint::Checkpointer;
pub use data_loader::DataLoader;
pub use metrics::Metrics;
pub use registry::ensure_linked;
pub use rendezvous::ClusterRendezvous;
pub use trainer_rank::TrainerRank;
