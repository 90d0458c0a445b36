//! `ferl sft`'s launch paths, each a thin setup around the one run loop ([`ferl_trainer::run::run`]) and the one
//! config gate ([`ferl_trainer::run::check`]), which runs before anything is loaded or spawned:
//!
//! - [`Launch::OneProcess`]: world 1 in this process ([`SpmdExecutor`] over a group of one).
//! - [`Launch::Launcher`]: one rank of an external launcher (torchrun/SLURM environment), [`SpmdExecutor`].
//! - [`Launch::Cluster`]: actor ranks on an embedded cluster or the running one at `--address`, driven from here
//!   ([`ClusterExecutor`], [`train_on_cluster`]).
//!
//! Every path computes the same losses as one process training on each whole global batch (see `rank.rs`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use ferl_collective::{init_groups_from_env, Communicator, LaunchEnv, Subgroups};
use ferl_config::SftConfig;
use ferl_data::SftDataset;
use ferl_plugin_bridge::StepBoundary;
use ferl_plugin_host::PluginHost;
use ferl_runtime::{Cluster, HeadOptions, NodeOptions, SpawnOptions};
use ferl_trainer::metrics::LoggerRegistry;
use ferl_trainer::run::threads::{local_ranks_from_env, set_rank_threads};
use ferl_trainer::run::{
    self, check, device_of, peak_flops, LaunchShape, MfuInputs, RunOptions, StepExecutor,
};
use tch::Device;

pub use ferl_trainer::run::{RunSummary, StepRecord};

use crate::cluster_run::ClusterRun;
use crate::data_loader::load_datasets_with;
use crate::driver::ClusterExecutor;
use crate::metrics::{build_loggers, logger_registry};
use crate::plugins::{actor_plugin_host, liger_kernels, resolve_custom_cls, DriverPlugins};
use crate::rank::RankState;
pub use crate::spmd::InProcessOptions;
use crate::spmd::{world_of_one, SpmdExecutor};

/// How `ferl sft` launches a run.
#[derive(Clone, Debug)]
pub enum Launch {
    /// World 1 in this process.
    OneProcess,
    /// One rank of an external launch (torchrun's or SLURM's environment).
    Launcher,
    /// Actor ranks on a cluster.
    Cluster {
        /// Ranks per machine (`--nproc-per-node`).
        nproc_per_node: usize,
        /// Machines (`--nnodes`).
        nnodes: usize,
        /// A running cluster's head (`--address HOST:PORT`); none starts an embedded cluster.
        address: Option<String>,
    },
}

/// Trains `cfg` as `launch` says. A run that fails before producing anything (a refused launch, config, data
/// file, model folder or checkpoint) leaves no run folder behind: one it created holding only the plugin host's
/// control folder is removed again (by the coordinator; the other launcher ranks leave it to rank 0).
pub fn run(cfg: SftConfig, launch: &Launch) -> Result<RunSummary> {
    crate::ensure_linked();
    check_launch(launch)?;
    let run_dir = ferl_config::expand_path(&cfg.trainer.default_local_dir);
    let existed = run_dir.exists();
    let coordinator = coordinates(launch);
    let result = match launch {
        Launch::OneProcess => {
            println!("{}", set_rank_threads(1)?.describe());
            let opts = InProcessOptions {
                progress: true,
                ..InProcessOptions::default()
            };
            run_in_process(cfg, opts)
        }
        Launch::Launcher => run_from_env(cfg),
        Launch::Cluster {
            nproc_per_node,
            nnodes,
            address,
        } => run_cluster(cfg, *nproc_per_node, *nnodes, address.as_deref()),
    };
    if result.is_err() && coordinator && !existed {
        remove_if_untouched(&run_dir);
    }
    result
}

/// Whether this process coordinates the run `launch` makes: logs, commits checkpoints and reports the summary (rank
/// 0 of an external launch; the one process otherwise).
pub fn coordinates(launch: &Launch) -> bool {
    match launch {
        Launch::Launcher => LaunchEnv::from_env().map_or(true, |l| l.rank == 0),
        _ => true,
    }
}

/// Flags that cannot make a launch, refused before anything is created.
fn check_launch(launch: &Launch) -> Result<()> {
    if let Launch::Cluster {
        nproc_per_node,
        nnodes,
        address,
    } = launch
    {
        if *nproc_per_node == 0 {
            bail!("--nproc-per-node 0: give at least 1 rank per node");
        }
        if *nnodes == 0 {
            bail!("--nnodes 0: give at least 1 node");
        }
        if address.is_none() && *nnodes > 1 {
            bail!("--nnodes {nnodes} needs --address of a running cluster (start one with `ferl start --head`)");
        }
    }
    Ok(())
}

/// Removes `run_dir` when it holds nothing but the plugin host's control folder (`plugins/`).
fn remove_if_untouched(run_dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return;
    };
    let untouched = entries
        .flatten()
        .all(|e| e.file_name() == "plugins" && e.path().is_dir());
    if untouched {
        std::fs::remove_dir_all(run_dir).ok();
    }
}

/// The coordinator's plugins (the job's plugin host, which resolves `data.custom_cls`, watching `folders` too) and
/// logger kinds (built in, its logger plugins, and any `extra`), then the config gate for `world` ranks. A refused
/// config leaves nothing behind: a run folder the plugin host created for it is removed again.
fn checked_coordinator(
    cfg: &mut SftConfig,
    extra: Option<LoggerRegistry>,
    folders: &[std::path::PathBuf],
    world: usize,
    local_device: bool,
    restarts_ranks: bool,
) -> Result<(DriverPlugins, LoggerRegistry)> {
    let run_dir = ferl_config::expand_path(&cfg.trainer.default_local_dir);
    let existed = run_dir.exists();
    let checked = DriverPlugins::open_with(cfg, folders)
        .context("plugins")
        .and_then(|plugins| {
            let mut registry = logger_registry(Some(plugins.host()));
            if let Some(extra) = extra {
                registry.merge(extra);
            }
            gate(cfg, world, local_device, registry.names(), restarts_ranks)?;
            Ok((plugins, registry))
        });
    if checked.is_err() && !existed {
        std::fs::remove_dir_all(&run_dir).ok();
    }
    checked
}

/// The loop's components on the process that logs: loggers, the plugins' step boundary, progress, MFU inputs.
fn coordinator_options(
    cfg: &SftConfig,
    host: &Arc<PluginHost>,
    registry: &LoggerRegistry,
    progress: bool,
    mfu: Option<MfuInputs>,
) -> Result<RunOptions> {
    let bar = progress.then(|| run::progress(0));
    let loggers = build_loggers(cfg, registry, bar.clone())?;
    let mut boundary = StepBoundary::new(host.clone());
    Ok(RunOptions {
        loggers,
        on_step_end: Some(Box::new(move |step| boundary.run(step))),
        progress: bar,
        mfu,
        stop_after_steps: None,
    })
}

fn mfu_inputs(num_params: i64, device: Device) -> Option<MfuInputs> {
    peak_flops(device.is_cuda()).map(|peak_flops| MfuInputs {
        num_params,
        peak_flops,
    })
}

/// World 1 in this process, loading `data.*` itself.
pub fn run_in_process(mut cfg: SftConfig, mut opts: InProcessOptions) -> Result<RunSummary> {
    let extra = opts.loggers.take();
    let (plugins, registry) =
        checked_coordinator(&mut cfg, extra, &opts.plugin_folders, 1, true, true)?;
    let (train, val) = load_datasets_with(&cfg, Some(plugins.host()))?;
    in_process(cfg, train, val, opts, &plugins, &registry)
}

/// World 1 in this process on already-tokenized datasets (tests and callers with their own data).
pub fn run_in_process_with_data(
    mut cfg: SftConfig,
    train: SftDataset,
    val: Option<SftDataset>,
    mut opts: InProcessOptions,
) -> Result<RunSummary> {
    let extra = opts.loggers.take();
    let (plugins, registry) =
        checked_coordinator(&mut cfg, extra, &opts.plugin_folders, 1, true, true)?;
    in_process(cfg, train, val, opts, &plugins, &registry)
}

fn in_process(
    cfg: SftConfig,
    train: SftDataset,
    val: Option<SftDataset>,
    opts: InProcessOptions,
    plugins: &DriverPlugins,
    registry: &LoggerRegistry,
) -> Result<RunSummary> {
    let device = device_of(&cfg, 0)?;
    let comm = world_of_one(device)?;
    let train_len = train.len();
    let state = rank_state(
        &cfg,
        comm,
        None,
        device,
        train_len,
        Some(plugins.host().clone()),
    )?;
    let mfu = mfu_inputs(state.num_params, device);
    let mut run_opts = coordinator_options(&cfg, plugins.host(), registry, opts.progress, mfu)?;
    run_opts.stop_after_steps = opts.stop_after_steps;
    let (rebuild_cfg, host) = (cfg.clone(), plugins.host().clone());
    let rebuild = move || {
        let comm = world_of_one(device)?;
        rank_state(
            &rebuild_cfg,
            comm,
            None,
            device,
            train_len,
            Some(host.clone()),
        )
    };
    let mut exec = SpmdExecutor::new(state, train, val).restartable(Box::new(rebuild));
    run::run(&mut exec, &cfg, train_len, run_opts)
}

/// Builds a rank's state for a run over `train_len` samples, with the `liger` kernels when asked for, in its HSDP
/// and sequence-parallel groups (formed by `subgroups`) when the config asks for them.
fn rank_state(
    cfg: &SftConfig,
    comm: Arc<dyn Communicator>,
    subgroups: Option<&Subgroups>,
    device: Device,
    train_len: usize,
    host: Option<Arc<PluginHost>>,
) -> Result<RankState> {
    let total = run::RunPlan::new(cfg, train_len)?.total_steps;
    let connect = |name: &str, rank, size| match subgroups {
        Some(s) => s.connect(name, rank, size),
        None => bail!("this launch path forms no subgroups"),
    };
    let connect: Option<crate::rank::ConnectGroup<'_>> = match subgroups {
        Some(_) => Some(&connect),
        None => None,
    };
    let mut state = RankState::build_in_groups(cfg.clone(), comm, connect, device, total)?;
    state.join_sequence_parallel(|name, rank, size| {
        subgroups
            .context("this launch path forms no sequence-parallel groups")?
            .connect(name, rank, size)
    })?;
    if cfg.model.use_liger {
        state.set_kernels(liger_kernels(host));
    }
    Ok(state)
}

/// The config gate of every path: `world` ranks; `local_device` when this process decides the device; `loggers`
/// the logger kinds `trainer.logger` may name. Then the model folder is resolved (a Hub id found in this machine's
/// cache or downloaded), so a missing model is refused with the places looked at before anything is spawned.
fn gate(
    cfg: &SftConfig,
    world: usize,
    local_device: bool,
    loggers: Vec<String>,
    restarts_ranks: bool,
) -> Result<()> {
    let shape = LaunchShape {
        world_size: world,
        local_device,
        loggers,
        restarts_ranks,
    };
    check(cfg, &shape)?;
    // A model named by Hub id is found or downloaded now, so a missing one fails before anything is spawned.
    let dir = crate::rank::resolve_model_dir(cfg)?;
    // So do heads that a sequence-parallel group cannot split.
    let sp = cfg.ulysses_sequence_parallel_size as i64;
    if sp > 1 {
        let model = ferl_trainer::model::config::ModelConfig::from_file(&dir.join("config.json"))?;
        ferl_trainer::model::ulysses::check_heads(sp, model.num_heads, model.num_kv_heads)?;
    }
    // So is a LoRA adapter to start from (its config decides rank, alpha and modules).
    ferl_trainer::run::gate::lora_of(cfg)?;
    Ok(())
}

/// One rank of a run started by an external launcher: checks the config, forms the group from the environment,
/// runs the loop over its share of every global batch; rank 0 logs and commits checkpoints.
pub fn run_from_env(mut cfg: SftConfig) -> Result<RunSummary> {
    let launch = LaunchEnv::from_env().context(
        "no --nproc-per-node given and no launcher environment (RANK/WORLD_SIZE/MASTER_ADDR or SLURM variables)",
    )?;
    let coordinator = launch.rank == 0;
    let threads = set_rank_threads(local_ranks_from_env())
        .with_context(|| format!("rank {}", launch.rank))?;
    if coordinator {
        println!("{}", threads.describe());
    }
    // Only rank 0 logs: the other ranks take the logger names as given (rank 0 checks them).
    let world = launch.world_size;
    let (plugins, registry) = if coordinator {
        let (p, r) = checked_coordinator(&mut cfg, None, &[], world, true, false)?;
        (Some(p), r)
    } else {
        gate(
            &cfg,
            world,
            true,
            cfg.trainer.logger.as_slice().to_vec(),
            false,
        )?;
        (None, LoggerRegistry::default())
    };
    crate::spmd::meet_beside_torchrun_store(&launch);
    // SLURM's --gpus-per-task leaves one visible device per task; torchrun leaves all of them.
    let visible = match cfg.trainer.device.as_str() {
        "cuda" if run::cuda_is_available() => tch::Cuda::device_count().max(1) as usize,
        _ => 1,
    };
    let device = device_of(&cfg, launch.local_rank % visible)?;
    let (comm, subgroups) =
        init_groups_from_env(device).context("joining the group from the launcher environment")?;
    let host = match &plugins {
        Some(p) => Some(p.host().clone()),
        None => {
            let h = actor_plugin_host()?;
            if let Some(h) = &h {
                resolve_custom_cls(h, &mut cfg)?;
            }
            h
        }
    };
    let (train, val) = load_datasets_with(&cfg, host.as_deref())?;
    let train_len = train.len();
    let state = rank_state(
        &cfg,
        comm,
        Some(&subgroups),
        device,
        train_len,
        host.clone(),
    )?;
    let run_opts = match &plugins {
        Some(p) => coordinator_options(
            &cfg,
            p.host(),
            &registry,
            true,
            mfu_inputs(state.num_params, device),
        )?,
        None => RunOptions::default(),
    };
    let mut exec = SpmdExecutor::new(state, train, val);
    run::run(&mut exec, &cfg, train_len, run_opts)
}

/// `--nproc-per-node N [--nnodes M] [--address HOST:PORT]`: checks the config, then starts an embedded cluster (or
/// joins the running one) and trains with actor ranks.
fn run_cluster(
    cfg: SftConfig,
    nproc: usize,
    nnodes: usize,
    address: Option<&str>,
) -> Result<RunSummary> {
    let world = nproc * nnodes.max(1);
    let mut cfg = cfg;
    let (plugins, registry) =
        checked_coordinator(&mut cfg, None, &[], world, address.is_none(), true)?;
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async {
        let cluster = match address {
            Some(a) => ferl_runtime::connect(a, None)
                .await
                .with_context(|| format!("joining the cluster at {a}"))?,
            None => embedded_cluster(world).await?,
        };
        let per_node = (nnodes > 1).then_some(nproc);
        let result = train_checked(&cluster, cfg, world, per_node, plugins, registry).await;
        // An embedded cluster's session folder goes with it, unless the run failed: its worker logs tell why.
        if result.is_err() {
            if let Some(dir) = cluster.keep_session() {
                eprintln!("worker logs of this run: {}", dir.join("logs").display());
            }
        }
        cluster.shutdown().await;
        result
    })
}

/// The cluster `--nproc-per-node` starts in this process when no `--address` is given: a head with one node of
/// this machine's CPUs (at least `world` ranks and the data loader and checkpointer beside them).
pub async fn embedded_cluster(world: usize) -> Result<Cluster> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let node = NodeOptions::new().num_cpus(cpus.max(world + 2) as f64);
    Ok(ferl_runtime::init(HeadOptions::new().node(node)).await?)
}

/// Trains `cfg` with `world` actor ranks on `cluster` (a driver script's entry point). The config is checked first
/// (the ranks check their own device). Plugins come from the job's plugin host ([`DriverPlugins`]): the data loader
/// gets the dataset plugin's file and the ranks the `liger` kernel plugin's, shipped with their spawns.
pub async fn train_on_cluster(
    cluster: &Cluster,
    cfg: &SftConfig,
    world: usize,
) -> Result<RunSummary> {
    let mut cfg = cfg.clone();
    let (plugins, registry) = checked_coordinator(&mut cfg, None, &[], world, false, true)?;
    train_checked(cluster, cfg, world, None, plugins, registry).await
}

async fn train_checked(
    cluster: &Cluster,
    cfg: SftConfig,
    world: usize,
    per_node: Option<usize>,
    plugins: DriverPlugins,
    registry: LoggerRegistry,
) -> Result<RunSummary> {
    if cfg.trainer.device == "cuda" {
        ensure_cluster_has_gpus(cluster).await?;
    }
    let mut run = ClusterRun {
        cluster: cluster.clone(),
        loader_opts: plugins.ship(SpawnOptions::new(), &DriverPlugins::for_data_loader(&cfg))?,
        rank_opts: plugins.ship(SpawnOptions::new(), &DriverPlugins::for_trainer_rank(&cfg))?,
        cfg: cfg.clone(),
        total_steps: 0,
        job: format!("sft-{}", std::process::id()),
        per_node,
        rl: None,
    };
    let waiting = run::Progress::waiting("data loader: reading and tokenizing the data");
    let (loader, info) = run.spawn_loader(world).await?;
    waiting.finish();
    run.total_steps = run::RunPlan::new(&cfg, info.train_len as usize)?.total_steps;
    let waiting = run::Progress::waiting(&format!("starting {world} trainer rank(s)"));
    let actors = match run.start(world, Some(loader.clone())).await {
        Ok(actors) => actors,
        Err(e) => {
            cluster.kill(&loader).await.ok();
            return Err(e);
        }
    };
    waiting.finish();
    let num_params = num_params_of(&cfg)?;
    let device = match run.cfg.trainer.device == "cuda" {
        true => Device::Cuda(0),
        false => Device::Cpu,
    };
    let opts = coordinator_options(
        &cfg,
        plugins.host(),
        &registry,
        true,
        mfu_inputs(num_params, device),
    )?;
    let train_len = info.train_len as usize;
    let exec = ClusterExecutor {
        handle: tokio::runtime::Handle::current(),
        run: run.clone(),
        actors,
        micro_batch_size: cfg.data.micro_batch_size_per_gpu,
        val_len: info.val_len as usize,
        prompts: None,
        completed: 0,
    };
    drive_on_cluster(exec, cfg, train_len, opts).await
}

/// Runs the one loop over `exec`'s actors (on a blocking thread), shows the run in `ferl status` while it runs and
/// how it ended, and tears its actors down.
pub(crate) async fn drive_on_cluster(
    mut exec: ClusterExecutor,
    cfg: SftConfig,
    train_len: usize,
    opts: RunOptions,
) -> Result<RunSummary> {
    let run = exec.run.clone();
    run.publish("running", exec.world_size(), &[]).await;
    let (summary, exec) = tokio::task::spawn_blocking(move || {
        let summary = run::run(&mut exec, &cfg, train_len, opts);
        (summary, exec)
    })
    .await
    .context("the run loop's thread")?;
    let state = if summary.is_ok() {
        "finished"
    } else {
        "failed"
    };
    let restarts = summary
        .as_ref()
        .map(|s| s.restarts.clone())
        .unwrap_or_default();
    run.publish(state, exec.world_size(), &restarts).await;
    run.teardown(&exec.actors, Duration::from_secs(30)).await;
    summary
}

/// `trainer.device=cuda` on a cluster whose live nodes declare no GPU is refused as on every other path (instead of a
/// placement that can never be met).
async fn ensure_cluster_has_gpus(cluster: &Cluster) -> Result<()> {
    let status = cluster
        .status()
        .await
        .context("reading the cluster's nodes")?;
    let gpus: f64 = status["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["alive"].as_bool() != Some(false))
        .filter_map(|n| n["resources_total"]["GPU"].as_f64())
        .sum();
    if gpus < 1.0 {
        return Err(ferl_trainer::run::gate::no_cuda_device());
    }
    Ok(())
}

fn num_params_of(cfg: &SftConfig) -> Result<i64> {
    let dir = crate::rank::resolve_model_dir(cfg)?;
    let model = ferl_trainer::model::config::ModelConfig::from_file(&dir.join("config.json"))?;
    Ok(ferl_trainer::model::layout::ModelLayout::new(&model).num_params())
}

/// Reads a summary a driver wrote as JSON (tests and scripts).
pub fn read_summary(path: &std::path::Path) -> Result<RunSummary> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}
