//! GRPO on trainer-rank actors of a cluster (`ferl grpo --address HOST:PORT`, a cluster started with `ferl start`):
//! the driver runs the one loop ([`ferl_trainer::run::run`]) over a [`ClusterExecutor`] whose ranks each hold their
//! shard of the policy and run the one GRPO step ([`super::GrpoAlgorithm`]) on the prompts the driver sends. Saving,
//! resume at any world size, restarts (`trainer.max_restarts`) and `ferl status` are those of an SFT cluster run.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use ferl_config::{PpoConfig, SftConfig};
use ferl_plugin_host::PluginHost;
use ferl_rl::GrpoPrompt;
use ferl_runtime::{Cluster, SpawnOptions};
use ferl_trainer::run::{self, RunOptions, RunSummary};

use super::setup::{data_sources, naive_reward_plugins, SHIPPED_REWARD_FILE};
use super::RlRankArgs;
use crate::cluster_run::ClusterRun;
use crate::driver::ClusterExecutor;
use crate::plugins::DriverPlugins;
use crate::sft::drive_on_cluster;

/// A checked GRPO run, as its driver built it.
pub struct GrpoClusterJob {
    /// The PPO config.
    pub ppo: PpoConfig,
    /// The actor's view of it: what the ranks' [`crate::rank::RankState`] trains (model, sharding, optimizer,
    /// schedule, run folder).
    pub view: SftConfig,
    /// The prompts of `data.train_files` (the loop's training set).
    pub prompts: Arc<Vec<GrpoPrompt>>,
    /// The driver's plugin host: the first-party reward plugins of the prompts' data sources are shipped from it.
    pub host: Arc<PluginHost>,
    /// Ranks on each of several distinct nodes (`--nnodes M --nproc-per-node N`), else packed.
    pub per_node: Option<usize>,
}

/// Trains `job` with `world` trainer-rank actors on `cluster`, logging with `opts`.
pub async fn train_grpo_on_cluster(
    cluster: &Cluster,
    job: GrpoClusterJob,
    world: usize,
    opts: RunOptions,
) -> Result<RunSummary> {
    let sources = data_sources(&job.prompts);
    let run = ClusterRun {
        cluster: cluster.clone(),
        loader_opts: SpawnOptions::new(),
        rank_opts: rank_spawn_options(&job, &sources)?,
        cfg: job.view.clone(),
        total_steps: run::RunPlan::new(&job.view, job.prompts.len())?.total_steps,
        job: format!("grpo-{}", std::process::id()),
        per_node: job.per_node,
        rl: Some(RlRankArgs {
            ppo_yaml: job.ppo.to_yaml(),
            data_sources: sources.into_iter().collect(),
        }),
    };
    let waiting = run::Progress::waiting(&format!("starting {world} trainer rank(s)"));
    let actors = run.start(world, None).await?;
    waiting.finish();
    let exec = ClusterExecutor {
        handle: tokio::runtime::Handle::current(),
        run,
        actors,
        micro_batch_size: job.view.data.micro_batch_size_per_gpu,
        val_len: 0,
        prompts: Some(Arc::clone(&job.prompts)),
        completed: 0,
    };
    drive_on_cluster(exec, job.view, job.prompts.len(), opts).await
}

/// What each rank's spawn ships: the reward plugin of `custom_reward_function.path`, else the first-party reward
/// plugins of the data sources `sources` (a rank lacking one on its node would fall back to its own).
fn rank_spawn_options(job: &GrpoClusterJob, sources: &BTreeSet<String>) -> Result<SpawnOptions> {
    let run_dir = ferl_config::expand_path(&job.view.trainer.default_local_dir);
    let plugins = DriverPlugins::from_host(Arc::clone(&job.host), &run_dir);
    match &job.ppo.custom_reward_function.path {
        Some(path) => {
            let file = ferl_config::expand_path(path);
            plugins.ship_file(SpawnOptions::new(), SHIPPED_REWARD_FILE, Path::new(&file))
        }
        None => plugins.ship(SpawnOptions::new(), &naive_reward_plugins(sources)),
    }
}
