//! The trainer-rank actor: one per bundle of the resource group. It builds its model replica from
//! `model.partial_pretrain`, joins the data-parallel group through the cluster's key-value store
//! ([`ClusterRendezvous`]), keeps its shard in a `ferl_fsdp::ShardedParams`, and trains on the micro-batches the
//! driver sends. Its collective connections prove the job secret the driver put in its spawn message. With
//! `model.use_liger=true` its head is the `liger` kernel plugin the driver shipped with the spawn (see
//! [`crate::plugins`]), else the built-in kernels. Compute runs on a blocking thread so the worker's connections stay
//! responsive.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, Result};
use ferl_collective::{GroupOptions, JobSecret, Subgroups};
use ferl_config::SftConfig;
use ferl_runtime::{Actor, Context, Handler};
use ferl_trainer::run::threads::{local_ranks_from_env, set_rank_threads, ThreadChoice};

use crate::messages::*;
use crate::rank::RankState;
use crate::rendezvous::ClusterRendezvous;
use crate::rl::{GrpoAlgorithm, RlRankArgs, RlStepDone, RlTrainStep, WirePrompt};

/// Constructor arguments of [`TrainerRank`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct TrainerRankArgs {
    /// The resolved config as YAML.
    pub config_yaml: String,
    /// This rank.
    pub rank: u64,
    /// Number of ranks.
    pub world_size: u64,
    /// Optimizer steps of the run (the schedule's length).
    pub total_steps: u64,
    /// Key prefix of this run's rendezvous in the head's store (unique per run).
    pub group_prefix: String,
    /// The group's job secret, fresh from the driver for each group: every collective connection proves it.
    pub job_secret: SecretHex,
    /// GRPO's settings when the rank trains RL (`config_yaml` is then the actor's view of the PPO config); none for
    /// SFT.
    pub rl: Option<RlRankArgs>,
}

/// A job secret in a spawn message, as hex (it travels only inside the cluster's authenticated messages); its `Debug`
/// form never shows it.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone)]
pub struct SecretHex(pub String);

impl std::fmt::Debug for SecretHex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretHex(<redacted>)")
    }
}

/// A training rank hosted by the runtime.
pub struct TrainerRank {
    state: Arc<Mutex<RankState>>,
    /// The RL algorithm it trains ([`RlTrainStep`]), when its spawn asked for one.
    rl: Option<Arc<Mutex<GrpoAlgorithm>>>,
    /// Its intra-op threads: its node's cores split over the group's ranks there (`LOCAL_WORLD_SIZE`).
    threads: ThreadChoice,
}

impl TrainerRank {
    async fn with_state<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut RankState) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = state
                .lock()
                .map_err(|_| anyhow::anyhow!("trainer rank state poisoned by an earlier panic"))?;
            f(&mut guard)
        })
        .await
        .with_context(|| format!("trainer rank: {what} task"))?
    }
}

impl Actor for TrainerRank {
    type Args = TrainerRankArgs;
    const NAME: &'static str = "ferl.actors.TrainerRank";
    async fn start(args: TrainerRankArgs, ctx: &Context) -> Result<Self> {
        let cfg = SftConfig::from_yaml(&args.config_yaml, &[])
            .context("trainer rank: reading the config")?;
        let cluster = ctx.cluster();
        let bind_ip: IpAddr = match cluster.head_address() {
            Ok(head) => ferl_runtime::local_ip_for(head)?,
            Err(_) => IpAddr::from([127, 0, 0, 1]),
        };
        let handle = tokio::runtime::Handle::current();
        let (rank, world) = (args.rank as usize, args.world_size as usize);
        let threads = set_rank_threads(local_ranks_from_env())
            .with_context(|| format!("trainer rank {rank}/{world}"))?;
        tracing::info!("trainer rank {rank}/{world}: {}", threads.describe());
        let state = tokio::task::spawn_blocking(move || {
            let rendezvous = Arc::new(ClusterRendezvous::new(cluster, handle, &args.group_prefix));
            let secret = JobSecret::from_hex(&args.job_secret.0)
                .context("trainer rank: the job secret from the driver")?;
            let options = GroupOptions {
                prefix: args.group_prefix.clone(),
                bind_ip: Some(bind_ip),
                job_secret: Some(secret),
                ..Default::default()
            };
            let device = ferl_trainer::run::device_of(&cfg, 0)?;
            let comm = ferl_collective::connect(device, rank, world, rendezvous.clone(), &options)
                .with_context(|| {
                    format!("trainer rank {rank}/{world}: joining the collective group")
                })?;
            let liger = cfg.model.use_liger;
            let subgroups = Subgroups::new(device, rendezvous, options);
            let connect = |name: &str, r, size| subgroups.connect(name, r, size);
            let mut state =
                RankState::build_in_groups(cfg, comm, Some(&connect), device, args.total_steps)
                    .with_context(|| format!("trainer rank {rank}/{world}: building the model"))?;
            state.join_sequence_parallel(|name, r, size| subgroups.connect(name, r, size))?;
            if liger {
                // The `liger` plugin shipped from the driver, else the built-in kernels.
                let host = crate::plugins::actor_plugin_host()
                    .with_context(|| format!("trainer rank {rank}/{world}: loading plugins"))?;
                state.set_kernels(crate::plugins::liger_kernels(host));
            }
            let rl = match &args.rl {
                Some(rl) => Some(
                    GrpoAlgorithm::for_rank(rl, &state)
                        .with_context(|| format!("trainer rank {rank}/{world}: building GRPO"))?,
                ),
                None => None,
            };
            anyhow::Ok((state, rl))
        })
        .await
        .context("trainer rank: start task")??;
        let (state, rl) = state;
        Ok(Self {
            state: Arc::new(Mutex::new(state)),
            rl: rl.map(|a| Arc::new(Mutex::new(a))),
            threads,
        })
    }
}

impl Handler<TrainStep> for TrainerRank {
    async fn handle(&self, m: TrainStep, _: &Context) -> Result<RankStep> {
        self.with_state("train step", move |s| {
            let sizes: Vec<usize> = m.micro_sizes.iter().map(|&n| n as usize).collect();
            s.train_micro_batches(&m.samples, &sizes, m.global_targets)
        })
        .await
    }
}

impl Handler<RlTrainStep> for TrainerRank {
    async fn handle(&self, m: RlTrainStep, _: &Context) -> Result<RlStepDone> {
        let rl = self
            .rl
            .clone()
            .context("this trainer rank was spawned for SFT, not RL")?;
        self.with_state("RL step", move |s| {
            let prompts = m
                .prompts
                .iter()
                .map(WirePrompt::prompt)
                .collect::<Result<Vec<_>>>()?;
            let mut algorithm = rl.lock().map_err(|_| {
                anyhow::anyhow!("the RL algorithm was poisoned by an earlier panic")
            })?;
            let outcome = algorithm.train_prompts(s, &prompts, m.completed)?;
            Ok(RlStepDone::from(outcome))
        })
        .await
    }
}

impl Handler<Validate> for TrainerRank {
    async fn handle(&self, m: Validate, _: &Context) -> Result<(f64, i64)> {
        self.with_state("validation", move |s| {
            s.validate(&m.samples, m.rounds as usize)
        })
        .await
    }
}

impl Handler<SaveShard> for TrainerRank {
    async fn handle(&self, m: SaveShard, _: &Context) -> Result<ShardSaving> {
        self.with_state("checkpoint save", move |s| {
            let (meta_json, files) = s.save_in_background(&PathBuf::from(m.dir))?;
            Ok(ShardSaving { meta_json, files })
        })
        .await
    }
}

impl Handler<FinishSave> for TrainerRank {
    async fn handle(&self, _: FinishSave, _: &Context) -> Result<()> {
        self.with_state("checkpoint write", |s| s.finish_save())
            .await
    }
}

impl Handler<LoadShard> for TrainerRank {
    async fn handle(&self, m: LoadShard, _: &Context) -> Result<()> {
        self.with_state("checkpoint load", move |s| s.load(&PathBuf::from(m.dir)))
            .await
    }
}

impl Handler<Export> for TrainerRank {
    async fn handle(&self, m: Export, _: &Context) -> Result<bool> {
        self.with_state("export", move |s| s.export(&PathBuf::from(m.dir)))
            .await
    }
}

impl Handler<IntraOpThreads> for TrainerRank {
    async fn handle(&self, _: IntraOpThreads, _: &Context) -> Result<String> {
        Ok(self.threads.describe())
    }
}
