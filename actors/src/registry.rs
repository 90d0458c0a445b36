//! Registers the standard actor types by name, in one place, so that [`ensure_linked`] keeps every registration in
//! any binary that hosts them (worker processes re-run the driver's binary and look types up by name).

use crate::checkpoint::Checkpointer;
use crate::data_loader::DataLoader;
use crate::messages::*;
use crate::metrics::Metrics;
use crate::rl::messages::*;
use crate::rl::{PolicyActor, RlTrainStep, Rollout};
use crate::trainer_rank::TrainerRank;

ferl_runtime::register_actor!(TrainerRank, calls: [TrainStep, RlTrainStep, Validate, SaveShard, FinishSave, LoadShard, Export, IntraOpThreads]);
ferl_runtime::register_actor!(DataLoader, calls: [GetDatasetInfo, BatchOf, ValShards]);
ferl_runtime::register_actor!(Checkpointer, calls: [Commit, Flush]);
ferl_runtime::register_actor!(Metrics, calls: [Log, FlushLogs]);
ferl_runtime::register_actor!(Rollout, calls: [Generate, LoadWeights]);
ferl_runtime::register_actor!(PolicyActor, calls: [ComputeLogProb, UpdatePolicy, ExportWeights, PublishWeights, ReleaseWeights, SaveState, LoadState]);

/// Keeps these registrations linked into the calling binary; call it before `ferl::enter_worker_mode_if_spawned`
/// (or, without the facade, `ferl_trainer::huge_pages::prefer_huge_pages` and then
/// `ferl_runtime::enter_worker_mode_if_spawned`, as the `ferl-actors-worker` binary does) in every binary that spawns
/// the standard actors.
#[inline(never)]
pub fn ensure_linked() -> [&'static str; 6] {
    use ferl_runtime::Actor;
    [
        TrainerRank::NAME,
        DataLoader::NAME,
        Checkpointer::NAME,
        Metrics::NAME,
        Rollout::NAME,
        PolicyActor::NAME,
    ]
}
