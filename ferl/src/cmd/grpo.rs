//! `ferl grpo`: GRPO (or RLOO) with verl's `ppo_trainer.yaml` keys, on the one run loop and the trainer ranks SFT
//! uses ([`ferl_actors::rl::GrpoAlgorithm`] over [`ferl_actors::rank::RankState`]). Each step takes
//! `data.train_batch_size` prompts of `data.train_files` (the loop's data order, reshuffled every epoch with
//! `data.seed`, else `trainer.seed`), generates `actor_rollout_ref.rollout.n` responses to each, scores them with
//! the reward, and updates the sharded policy. Metrics carry verl's names; `trainer.save_freq` writes `global_step_N/`
//! folders (SFT's sharded checkpoint format) under `trainer.default_local_dir`, and `trainer.resume_mode=auto`
//! resumes from the newest, at any world size.
//!
//! Launch paths, as for `ferl sft`: one process; one rank of an external launcher (torchrun's or SLURM's
//! environment); trainer-rank actors driven from here ([`ferl_actors::rl::train_grpo_on_cluster`]) on an embedded
//! cluster of this machine (`--nproc-per-node N`) or on a running cluster of `ferl start` (`--address HOST:PORT
//! [--nproc-per-node N] [--nnodes M]`).

mod setup;

use anyhow::{Context, Result};
use clap::Args;
use ferl_actors::rank::RankState;
use ferl_actors::rl::setup as rl_setup;
use ferl_actors::rl::{train_grpo_on_cluster, GrpoAlgorithm, GrpoClusterJob};
use ferl_actors::spmd::{world_of_one, SpmdExecutor};
use ferl_collective::{init_groups_from_env, LaunchEnv, Subgroups};
use ferl_data::SftTokenizer;
use ferl_trainer::config::{PpoConfig, SftConfig};
use ferl_trainer::metrics::{config_params, LoggerContext, LoggerRegistry, MetricsLogger};
use ferl_trainer::run::threads::{local_ranks_from_env, set_rank_threads};
use ferl_trainer::run::{self, RunOptions};
use std::path::Path;
use std::sync::Arc;
use tch::Device;

/// Arguments of `ferl grpo`.
#[derive(Args, Debug)]
pub(crate) struct GrpoArgs {
    /// The config file, overrides and `--cfg job`.
    #[command(flatten)]
    pub config: super::ConfigArgs,
    /// Ranks (data-parallel, the policy sharded over them): trainer-rank actors of an embedded cluster of this
    /// machine, as `ferl sft --nproc-per-node` starts them; with --address, per node of that cluster. Without either:
    /// one process, or one rank of torchrun/SLURM when their environment is set.
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc_per_node",
        value_name = "N"
    )]
    pub nproc_per_node: Option<usize>,
    /// Machines of the running cluster at --address: --nproc-per-node ranks on each of --nnodes distinct nodes.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// A running cluster's head, `HOST:PORT` (token from FERL_TOKEN or the local head): the ranks are its
    /// trainer-rank actors. Default: FERL_ADDRESS.
    #[arg(long, env = "FERL_ADDRESS")]
    pub address: Option<String>,
}

/// Loads the config, checks it, and trains on the launch path the arguments and environment give.
pub(crate) fn run(args: GrpoArgs) -> Result<()> {
    let c = &args.config;
    let cfg = PpoConfig::load(c.config.as_deref(), &c.overrides)?;
    if c.print_job(|| cfg.to_yaml())? {
        return Ok(());
    }
    check_flags(&args)?;
    // A launcher rank exactly when `ferl sft` would be one (torchrun's RANK/WORLD_SIZE, or a SLURM step of tasks).
    let on_cluster_ranks = args.address.is_some() || args.nproc_per_node.is_some();
    let env = match (on_cluster_ranks, super::sft_dist::launched_externally()) {
        (false, true) => Some(LaunchEnv::from_env().context("the launcher's environment")?),
        _ => None,
    };
    let run_dir = ferl_data::expand_path(&cfg.trainer.default_local_dir);
    let fresh = !run_dir.exists();
    let coordinator = env.as_ref().is_none_or(|e| e.rank == 0);
    let trained = match on_cluster_ranks {
        true => {
            let nproc = args.nproc_per_node.unwrap_or(1);
            on_cluster(&cfg, args.address.as_deref(), nproc, args.nnodes)
        }
        false => {
            let world = env.as_ref().map_or(1, |e| e.world_size);
            Setup::new(&cfg, world).and_then(|setup| train(&cfg, setup, env))
        }
    };
    if let Err(e) = &trained {
        // A run that made the folder and failed before its first checkpoint (a reward scoring NaN, say) leaves
        // nothing.
        let saved = ferl_trainer::checkpoint::latest_step(&run_dir)
            .ok()
            .flatten();
        if coordinator && fresh && saved.is_none() {
            let _ = std::fs::remove_dir_all(&run_dir);
        }
        tracing::debug!("ferl grpo failed: {e:#}");
    }
    if coordinator && run_dir.exists() {
        super::print_curves(&run_dir);
    }
    trained.map(|_| ())
}

/// Flags that cannot make a launch, refused before anything is created (as `ferl sft` refuses them).
fn check_flags(args: &GrpoArgs) -> Result<()> {
    if args.nproc_per_node == Some(0) {
        anyhow::bail!("--nproc-per-node 0: give at least 1 rank per node");
    }
    if args.nnodes == 0 {
        anyhow::bail!("--nnodes 0: give at least 1 node");
    }
    if args.address.is_none() && args.nnodes > 1 {
        anyhow::bail!(
            "--nnodes {} needs --address of a running cluster (start one with `ferl start --head`)",
            args.nnodes
        );
    }
    Ok(())
}

/// Trains on `nproc` × `nnodes` trainer-rank actors of the running cluster at `address`, or of an embedded cluster
/// of this machine without one (as `ferl sft --nproc-per-node` does), driven from here.
fn on_cluster(
    cfg: &PpoConfig,
    address: Option<&str>,
    nproc: usize,
    nnodes: usize,
) -> Result<run::RunSummary> {
    let world = nproc * nnodes;
    let setup = Setup::new(cfg, world)?;
    let opts = coordinator_options(cfg, &setup.view, &setup.registry)?;
    let job = GrpoClusterJob {
        ppo: cfg.clone(),
        view: setup.view.clone(),
        prompts: Arc::clone(&setup.prompts),
        host: Arc::clone(&setup.host),
        per_node: (nnodes > 1).then_some(nproc),
    };
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async {
        let cluster = match address {
            Some(a) => ferl_runtime::connect(a, None)
                .await
                .with_context(|| format!("joining the cluster at {a}"))?,
            None => ferl_actors::sft::embedded_cluster(world).await?,
        };
        let summary = train_grpo_on_cluster(&cluster, job, world, opts).await;
        // An embedded cluster's session folder goes with it, unless the run failed: its worker logs tell why.
        if summary.is_err() && address.is_none() {
            if let Some(dir) = cluster.keep_session() {
                eprintln!("worker logs of this run: {}", dir.join("logs").display());
            }
        }
        cluster.shutdown().await;
        summary
    })
}

/// What every rank builds before the model: the checked config, the actor's view of it, the tokenizer, prompts,
/// reward and logger kinds.
struct Setup {
    view: SftConfig,
    tok: Arc<SftTokenizer>,
    prompts: Arc<Vec<ferl_rl::GrpoPrompt>>,
    reward: Box<dyn ferl_rl::Reward>,
    registry: LoggerRegistry,
    host: Arc<ferl_plugin_host::PluginHost>,
    settings: ferl_rl::GrpoSettings,
    _exported: Option<tempfile::TempDir>,
}

impl Setup {
    /// The config gate for `world` ranks, then the model folder, tokenizer, prompts and reward.
    fn new(cfg: &PpoConfig, world: usize) -> Result<Self> {
        // One plugin host for the run: its logger plugins are `trainer.logger` kinds (as for `ferl sft`), its
        // reward plugins score when no `custom_reward_function.path` is given.
        let host = plugin_host()?;
        let registry = ferl_actors::metrics::logger_registry(Some(&host));
        cfg.validate_supported(&setup::supported(&registry.names()))?;
        setup::check_values(cfg)?;
        setup::check_world(cfg, world)?;
        let (model_dir, exported) = setup::model_dir(cfg)?;
        let tok = Arc::new(rl_setup::tokenizer(cfg, &model_dir)?);
        let prompts = setup::prompts(cfg, &tok)?;
        let view = setup::actor_view(cfg, &model_dir);
        setup::check_model_keys(&view, &model_dir)?;
        let sources = rl_setup::data_sources(&prompts);
        let reward = rl_setup::reward(cfg, || Ok(Arc::clone(&host)), &sources)?;
        Ok(Self {
            view,
            settings: rl_setup::grpo_settings(cfg, &tok)?,
            tok,
            prompts: Arc::new(prompts),
            reward,
            registry,
            host,
            _exported: exported,
        })
    }
}

/// Trains this process's rank (world 1 without `env`) through the one run loop.
fn train(cfg: &PpoConfig, setup: Setup, env: Option<LaunchEnv>) -> Result<run::RunSummary> {
    let threads = set_rank_threads(match env {
        Some(_) => local_ranks_from_env(),
        None => 1,
    })?;
    let coordinator = env.as_ref().is_none_or(|e| e.rank == 0);
    if coordinator {
        println!("{}", threads.describe());
    }
    let device = Device::Cpu;
    let (comm, subgroups) = match &env {
        Some(launch) => {
            ferl_actors::spmd::meet_beside_torchrun_store(launch);
            let (comm, sub) = init_groups_from_env(device)
                .context("joining the group from the launcher environment")?;
            (comm, Some(sub))
        }
        None => (world_of_one(device)?, None),
    };
    let view = setup.view.clone();
    let total = run::RunPlan::new(&view, setup.prompts.len())?.total_steps;
    let mut state = rank_state(&view, comm, subgroups.as_ref(), device, total)?;
    if let Some(sub) = &subgroups {
        state.join_sequence_parallel(|name, rank, size| sub.connect(name, rank, size))?;
    }
    let step = rl_setup::grpo_step(setup.settings.clone(), &state, setup.tok, setup.reward)?;
    let algorithm = GrpoAlgorithm::new(Arc::clone(&setup.prompts), step).dumping_rollouts_of(cfg);
    let mut exec = SpmdExecutor::with_algorithm(state, Box::new(algorithm));
    if env.is_none() {
        // `trainer.max_restarts` in one process: a fresh rank state, resumed by the loop (the launcher restarts
        // its ranks itself).
        let rebuild_view = view.clone();
        exec = exec.restartable(Box::new(move || {
            rank_state(&rebuild_view, world_of_one(device)?, None, device, total)
        }));
    }
    let opts = match coordinator {
        true => coordinator_options(cfg, &view, &setup.registry)?,
        false => RunOptions::default(),
    };
    run::run(&mut exec, &view, setup.prompts.len(), opts)
}

/// The policy's rank state: its shard of the model in the actor view's sharding, in HSDP groups when
/// `fsdp_size` asks for them.
fn rank_state(
    view: &SftConfig,
    comm: Arc<dyn ferl_collective::Communicator>,
    subgroups: Option<&Subgroups>,
    device: Device,
    total_steps: u64,
) -> Result<RankState> {
    let connect = |name: &str, rank, size| match subgroups {
        Some(s) => s.connect(name, rank, size),
        None => anyhow::bail!("this launch path forms no subgroups"),
    };
    let connect: Option<ferl_actors::rank::ConnectGroup<'_>> = match subgroups {
        Some(_) => Some(&connect),
        None => None,
    };
    RankState::build_in_groups(view.clone(), comm, connect, device, total_steps)
}

/// The coordinator's loggers (under the run folder, with the PPO config as their parameters) and progress.
fn coordinator_options(
    cfg: &PpoConfig,
    view: &SftConfig,
    registry: &LoggerRegistry,
) -> Result<RunOptions> {
    let progress = run::progress(0);
    let run_dir = ferl_data::expand_path(&view.trainer.default_local_dir);
    Ok(RunOptions {
        loggers: loggers(cfg, &run_dir, &progress, registry)?,
        progress: Some(progress),
        ..RunOptions::default()
    })
}

/// The run's plugin host (logger plugins, and rewards when no `custom_reward_function.path` is given): the
/// first-party plugins beside this binary and `$FERL_PLUGIN_PATH`.
fn plugin_host() -> Result<Arc<ferl_plugin_host::PluginHost>> {
    match ferl_actors::plugins::actor_plugin_host()? {
        Some(host) => Ok(host),
        None => {
            let dir = std::env::temp_dir()
                .join("ferl-plugin-copies")
                .join(std::process::id().to_string());
            Ok(Arc::new(ferl_plugin_host::PluginHost::new(dir)))
        }
    }
}

/// `trainer.logger`'s loggers from `registry`, writing under `run_dir` (the console's lines printed through
/// `progress`).
fn loggers(
    cfg: &PpoConfig,
    run_dir: &Path,
    progress: &ferl_data::Progress,
    registry: &LoggerRegistry,
) -> Result<Vec<Box<dyn MetricsLogger>>> {
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let ctx = LoggerContext {
        run_dir: run_dir.to_path_buf(),
        project: cfg.trainer.project_name.clone(),
        experiment: cfg.trainer.experiment_name.clone(),
        progress: Some(progress.clone()),
        params: config_params(cfg),
    };
    let names: Vec<String> = cfg.trainer.logger.as_slice().to_vec();
    registry.build(&names, &ctx)
}
