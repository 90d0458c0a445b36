//! GRPO's roles as actors, driven by one controller (verl's `RayPPOTrainer` over its worker groups).
//!
//! - [`Rollout`] ([`rollout`]): a `RolloutModel` on its process's device; generates ([`Generate`]) and takes new
//!   weights ([`LoadWeights`]).
//! - [`PolicyActor`] ([`policy`]): the policy's engine and AdamW (a `PolicyWorker`) and, with a KL loss, a frozen
//!   reference copy; old and reference log-probabilities ([`ComputeLogProb`]), the update ([`UpdatePolicy`]), its
//!   weights ([`ExportWeights`]) and its state ([`SaveState`], [`LoadState`]).
//! - [`messages`]: the wire types. Rows travel as token ids, per-token values as flat `f32` lists of the response
//!   tokens, weights as one raw byte blob ([`WeightsPayload`], [`weights`]), never as text.
//! - [`driver`]: the single-controller loop — generate, reward (in the driver), old and reference log-probabilities,
//!   advantages (in the driver), update, weight sync ([`sync_weights`]) — on a [`Placement`] of resource groups.
//!
//! With the same seed and weights, a step of [`GrpoDriver`] generates and trains exactly what a step of the
//! one-process `ferl_rl::GrpoTrainer` does: the same seeds ([`ferl_rl::derive_seed`]), the same
//! functions, the same values in the same order.

pub mod cluster;
pub mod driver;
pub mod dump;
pub mod messages;
pub mod policy;
pub mod rank;
pub mod remote;
pub mod rollout;
pub mod setup;
pub mod weights;

pub use cluster::{train_grpo_on_cluster, GrpoClusterJob};
pub use driver::{
    run_grpo_on_groups, spawn_roles, sync_weights, GrpoDriver, GrpoRoles, Placement, RoleOptions,
    WeightSync,
};
pub use messages::*;
pub use policy::{PolicyActor, PolicyArgs};
pub use rank::{GrpoAlgorithm, RlRankArgs, RlStepDone, RlTrainStep, WirePrompt};
pub use rollout::{Rollout, RolloutArgs};

use anyhow::{Context as _, Result};
use std::sync::{Arc, Mutex};

/// Runs `f` on the state behind `state` on a blocking thread (compute must not stall the worker's connections).
pub(crate) async fn on_state<S: Send + 'static, T: Send + 'static>(
    state: &Arc<Mutex<S>>,
    what: &'static str,
    f: impl FnOnce(&mut S) -> Result<T> + Send + 'static,
) -> Result<T> {
    let state = state.clone();
    tokio::task::spawn_blocking(move || {
        let mut guard = state
            .lock()
            .map_err(|_| anyhow::anyhow!("{what}: state poisoned by an earlier panic"))?;
        f(&mut guard)
    })
    .await
    .with_context(|| format!("{what} task"))?
}

/// Sets torch's intra-op threads of this process (0: leave torch's default).
pub(crate) fn set_threads(threads: u64) {
    if threads > 0 {
        tch::set_num_threads(threads as i32);
    }
}
