//! The actors of a cluster run and their lifecycle: spawning the data loader, the resource group of trainer ranks
//! and the checkpointer; tearing them down; and bringing them back after a failure (`trainer.max_restarts`), at the
//! same world size when the resources return within `trainer.restart_wait_s`, else (`trainer.elastic`) at the
//! largest smaller one that fits the free resources and splits the global batch.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use ferl_collective::JobSecret;
use ferl_config::SftConfig;
use ferl_runtime::{
    bundle, ActorRef, Cluster, ResourceGroup, Resources, SpawnOptions, Strategy, WorkerGroup,
    JOBS_PREFIX,
};
use ferl_trainer::run::{RestartPolicy, RestartRecord};

use crate::checkpoint::{Checkpointer, CheckpointerArgs};
use crate::data_loader::{DataLoader, DataLoaderArgs};
use crate::messages::{DatasetInfo, GetDatasetInfo, IntraOpThreads};
use crate::rl::RlRankArgs;
use crate::trainer_rank::{SecretHex, TrainerRank, TrainerRankArgs};

/// How long a run waits for its first resource group.
const FIRST_GROUP_WAIT: Duration = Duration::from_secs(120);

/// What a cluster run spawns its actors from (kept for restarts).
#[derive(Clone)]
pub struct ClusterRun {
    /// The cluster.
    pub cluster: Cluster,
    /// The checked config.
    pub cfg: SftConfig,
    /// Spawn options of the data loader (its plugin files).
    pub loader_opts: SpawnOptions,
    /// Spawn options of each trainer rank (its plugin files).
    pub rank_opts: SpawnOptions,
    /// Optimizer steps of the run, once the dataset is known.
    pub total_steps: u64,
    /// The run's name in `ferl status` (KV key `jobs/<job>`).
    pub job: String,
    /// `--nproc-per-node` when the ranks must be spread over `--nnodes` distinct nodes, that many on each.
    pub per_node: Option<usize>,
    /// GRPO's settings when the ranks train RL (`cfg` is then the actor's view of the PPO config; the driver sends
    /// each step's prompts, and no data loader is spawned); none for SFT.
    pub rl: Option<RlRankArgs>,
}

/// The actors one attempt of a cluster run trains with.
pub struct RunActors {
    /// The resource group of the ranks.
    pub group: ResourceGroup,
    /// One trainer rank per bundle, in rank order.
    pub ranks: WorkerGroup<TrainerRank>,
    /// The data loader (SFT; an RL run's driver holds its prompts itself).
    pub loader: Option<ActorRef<DataLoader>>,
    /// The checkpointer.
    pub checkpointer: ActorRef<Checkpointer>,
}

impl ClusterRun {
    fn gpus(&self) -> bool {
        self.cfg.trainer.device == "cuda"
    }

    /// One rank's bundle: a GPU and a CPU on CUDA runs, a CPU otherwise.
    fn bundle(&self) -> Resources {
        match self.gpus() {
            true => bundle(&[("GPU", 1.0), ("CPU", 1.0)]),
            false => bundle(&[("CPU", 1.0)]),
        }
    }

    /// Spawns the data loader for `world` ranks and reads the dataset's sizes.
    pub async fn spawn_loader(&self, world: usize) -> Result<(ActorRef<DataLoader>, DatasetInfo)> {
        let args = DataLoaderArgs {
            config_yaml: self.cfg.to_yaml(),
            world_size: world as u64,
        };
        let loader = self
            .cluster
            .spawn::<DataLoader>(args, self.loader_opts.clone())
            .await
            .context("spawning the data loader")?;
        let info = loader
            .call(GetDatasetInfo)
            .await
            .context("data loader: reading the dataset")?;
        Ok((loader, info))
    }

    /// How `world` ranks are placed: `per_node` on each of `world / per_node` distinct nodes (torchrun's
    /// `--nnodes M --nproc-per-node N`), else packed onto as few nodes as hold them.
    fn strategy(&self, world: usize) -> Strategy {
        match self.per_node {
            Some(n) if n > 0 && world > n && world.is_multiple_of(n) => {
                Strategy::NodeBlocks(n as u32)
            }
            _ => Strategy::Pack,
        }
    }

    /// What placing `world` ranks means, for messages.
    fn placing(&self, world: usize, kind: &str) -> String {
        match self.strategy(world) {
            Strategy::NodeBlocks(n) => format!(
                "placing {n} {kind} rank(s) on each of {} distinct nodes (--nnodes {} --nproc-per-node {n})",
                world / n as usize,
                world / n as usize
            ),
            _ => format!("reserving {world} {kind} bundles"),
        }
    }

    /// Reserves `world` bundles, waiting up to `wait` while they are busy or their nodes are away. With
    /// `infeasible_is_final` (a first attempt), a placement the cluster can never hold fails at once, naming the
    /// shortfall; a restart waits for nodes to come back instead.
    pub async fn reserve(
        &self,
        world: usize,
        wait: Duration,
        infeasible_is_final: bool,
    ) -> Result<ResourceGroup> {
        let kind = if self.gpus() { "GPU" } else { "CPU" };
        let what = self.placing(world, kind);
        let deadline = Instant::now() + wait;
        let mut told = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let bundles = vec![self.bundle(); world];
            match self
                .cluster
                .create_group(bundles, self.strategy(world), left)
                .await
            {
                Ok(group) => return Ok(group),
                Err(e @ ferl_runtime::Error::Infeasible { .. }) if infeasible_is_final => {
                    return Err(e).context(what);
                }
                Err(e) if Instant::now() + Duration::from_millis(500) < deadline => {
                    if !told {
                        eprintln!("{what}: {e}; waiting up to {wait:?}");
                        told = true;
                    }
                    tracing::debug!("{what}: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e).with_context(|| format!("{what} (waited {wait:?})")),
            }
        }
    }

    /// What the run trains, for names and `ferl status`: `sft` or `grpo`.
    pub fn kind(&self) -> &'static str {
        match self.rl {
            Some(_) => "grpo",
            None => "sft",
        }
    }

    /// Spawns the ranks into `group` and a checkpointer; `loader` serves their batches (SFT).
    pub async fn spawn_ranks(
        &self,
        group: ResourceGroup,
        loader: Option<ActorRef<DataLoader>>,
    ) -> Result<RunActors> {
        let world = group.bundles.len();
        let yaml = self.cfg.to_yaml();
        let prefix = format!("ferl/{}/{}/{}", self.kind(), std::process::id(), group.id);
        // A fresh secret per group, handed to the ranks only in their (authenticated) spawn messages.
        let secret = SecretHex(JobSecret::generate()?.to_hex());
        let rank_args = |rank: usize| TrainerRankArgs {
            config_yaml: yaml.clone(),
            rank: rank as u64,
            world_size: world as u64,
            total_steps: self.total_steps,
            group_prefix: prefix.clone(),
            job_secret: secret.clone(),
            rl: self.rl.clone(),
        };
        let ranks = WorkerGroup::<TrainerRank>::spawn(
            &self.cluster,
            &group,
            rank_args,
            self.rank_opts.clone(),
        )
        .await
        .context("spawning the trainer ranks")?;
        let threads = ranks
            .call_all(IntraOpThreads)
            .await
            .context("asking the trainer ranks for their threads")?;
        print_rank_threads(&group, &threads);
        let checkpointer_args = CheckpointerArgs {
            root: ferl_config::expand_path(&self.cfg.trainer.default_local_dir)
                .display()
                .to_string(),
            max_keep: self.cfg.trainer.max_ckpt_to_keep.unwrap_or(0) as u64,
        };
        let checkpointer = self
            .cluster
            .spawn::<Checkpointer>(checkpointer_args, SpawnOptions::new())
            .await
            .context("spawning the checkpointer")?;
        Ok(RunActors {
            group,
            ranks,
            loader,
            checkpointer,
        })
    }

    /// Spawns every actor of a first attempt at `world` ranks.
    pub async fn start(
        &self,
        world: usize,
        loader: Option<ActorRef<DataLoader>>,
    ) -> Result<RunActors> {
        let group = self.reserve(world, FIRST_GROUP_WAIT, true).await?;
        self.spawn_ranks(group, loader).await
    }

    /// Shows the run in `ferl status`: its state, world size and restarts (best effort: a status the head cannot
    /// take is logged, never fatal).
    pub async fn publish(&self, state: &str, world: usize, restarts: &[RestartRecord]) {
        let record = serde_json::json!({
            "name": self.job, "kind": self.kind(), "state": state, "world_size": world,
            "experiment": self.cfg.trainer.experiment_name, "restarts": restarts,
            // The head marks the job `failed: driver lost` when this driver stops beating.
            "driver": self.cluster.driver_id(),
        });
        let key = format!("{JOBS_PREFIX}{}", self.job);
        if let Err(e) = self
            .cluster
            .kv_put(&key, record.to_string().into_bytes())
            .await
        {
            tracing::warn!("publishing {key} for `ferl status`: {e}");
        }
    }

    /// Stops every actor of an attempt (those already gone are skipped), waiting up to `bound`; stops still under way
    /// then (a node that died before the head knew may hold them up) finish in the background.
    pub async fn teardown(&self, actors: &RunActors, bound: Duration) {
        let c = self.cluster.clone();
        let (group, loader, checkpointer) = (
            actors.group.clone(),
            actors.loader.clone(),
            actors.checkpointer.clone(),
        );
        let stops = tokio::spawn(async move {
            let kill_loader = async {
                match &loader {
                    Some(l) => c.kill(l).await,
                    None => Ok(()),
                }
            };
            let (g, l, k) =
                tokio::join!(c.remove_group(&group), kill_loader, c.kill(&checkpointer));
            for e in [g.err(), l.err(), k.err()].into_iter().flatten() {
                tracing::debug!("tearing down: {e}");
            }
        });
        if tokio::time::timeout(bound, stops).await.is_err() {
            tracing::debug!("tearing the attempt down takes longer than {bound:?}; going on");
        }
    }

    /// Tears `old` down and spawns a fresh attempt: at `old`'s world size when its resources come back within
    /// `policy.wait`, else (`policy.elastic`) at the largest smaller world size that fits.
    pub async fn restart(&self, old: &RunActors, policy: &RestartPolicy<'_>) -> Result<RunActors> {
        self.teardown(old, policy.wait).await;
        let world = old.group.bundles.len();
        match self.bring_up(world, policy.wait).await {
            Ok(actors) => Ok(actors),
            Err(e) if policy.elastic => {
                let smaller = self.fitting_world(world, policy).await.with_context(|| {
                    format!("{e:#}; trainer.elastic=true found no smaller world size")
                })?;
                tracing::warn!(
                    "{e:#}; continuing elastically at {smaller} ranks instead of {world}"
                );
                self.bring_up(smaller, policy.wait).await
            }
            Err(e) => Err(e.context(format!(
                "the lost ranks' resources did not come back within trainer.restart_wait_s={}s \
                 (trainer.elastic=false: not resuming at a smaller world size)",
                policy.wait.as_secs_f64()
            ))),
        }
    }

    /// Reserves `world` bundles and spawns a loader, the ranks and a checkpointer, retrying until `wait` passes
    /// (a node that died but is not yet declared dead may still be offered).
    async fn bring_up(&self, world: usize, wait: Duration) -> Result<RunActors> {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let group = self.reserve(world, left, false).await?;
            let spawned = async {
                let loader = match self.rl {
                    Some(_) => None,
                    None => Some(self.spawn_loader(world).await?.0),
                };
                match self.spawn_ranks(group.clone(), loader.clone()).await {
                    Ok(actors) => Ok(actors),
                    Err(e) => {
                        if let Some(loader) = &loader {
                            self.cluster.kill(loader).await.ok();
                        }
                        Err(e)
                    }
                }
            };
            match spawned.await {
                Ok(actors) => return Ok(actors),
                Err(e) => {
                    self.cluster.remove_group(&group).await.ok();
                    if Instant::now() >= deadline {
                        return Err(e);
                    }
                    tracing::debug!("starting {world} ranks: {e:#}; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// The largest world size below `world` that `policy.fits` and that the live nodes' free resources hold, asking
    /// again until `policy.wait` passes (the lost attempt's resources may still be on their way back).
    async fn fitting_world(&self, world: usize, policy: &RestartPolicy<'_>) -> Result<usize> {
        let deadline = Instant::now() + policy.wait;
        loop {
            let free = self.free_bundles().await?;
            let fit = (1..world.min(free + 1)).rev().find(|&w| (policy.fits)(w));
            match fit {
                Some(w) => return Ok(w),
                None if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(500)).await
                }
                None => bail!(
                    "{free} free bundle(s) on the live nodes; no smaller world size splits \
                     data.train_batch_size={}",
                    self.cfg.data.train_batch_size
                ),
            }
        }
    }

    /// How many of this run's bundles the live nodes' free resources hold.
    async fn free_bundles(&self) -> Result<usize> {
        let status = self
            .cluster
            .status()
            .await
            .context("reading the cluster's nodes")?;
        let want = self.bundle();
        let per_node = |n: &serde_json::Value| -> usize {
            want.iter()
                .map(|(k, need)| {
                    let total = n["resources_total"][k].as_f64().unwrap_or(0.0);
                    let used = n["resources_used"][k].as_f64().unwrap_or(0.0);
                    ((total - used) / need).floor().max(0.0) as usize
                })
                .min()
                .unwrap_or(0)
        };
        let nodes = status["nodes"].as_array().cloned().unwrap_or_default();
        Ok(nodes
            .iter()
            .filter(|n| n["alive"].as_bool() != Some(false))
            .map(per_node)
            .sum())
    }
}

/// The kind of failure an error chain shows: `node_lost` or `rank_lost` (an actor died), `collective` (a rank's
/// collective failed, e.g. a peer vanished), else `error`.
pub fn cause_kind(cause: &anyhow::Error) -> String {
    let died = cause
        .chain()
        .find_map(|c| match c.downcast_ref::<ferl_runtime::Error>() {
            Some(ferl_runtime::Error::ActorDied { reason, .. }) => Some(reason.clone()),
            Some(ferl_runtime::Error::Lost { reason, .. }) => Some(reason.clone()),
            _ => None,
        });
    let text = format!("{cause:#}");
    let kind = match died {
        Some(reason) if reason.contains("node") => "node_lost",
        Some(_) => "rank_lost",
        None if text.contains("collective") || text.contains("peer") => "collective",
        None => "error",
    };
    kind.to_string()
}

/// Prints where the ranks run and their intra-op threads: a line per node (and per choice, should ranks of one
/// node differ), e.g. `trainer ranks [0, 1] on node-0: 1 intra-op thread per rank (2 cores / 2 ranks on its host; …)`.
fn print_rank_threads(group: &ResourceGroup, threads: &[String]) {
    let mut lines: Vec<(&str, &str, Vec<usize>)> = Vec::new();
    for (rank, (line, node)) in threads.iter().zip(&group.nodes).enumerate() {
        match lines.iter_mut().find(|(n, l, _)| *n == node && *l == line) {
            Some((_, _, ranks)) => ranks.push(rank),
            None => lines.push((node, line, vec![rank])),
        }
    }
    for (node, line, ranks) in lines {
        println!("trainer ranks {ranks:?} on {node}: {line}");
    }
}
