//! The distributed SFT driver (single controller, as verl's): where a distributed run's loop lives.
//!
//! - [`train_on_cluster`]: on a cluster handle, reserves a resource group of `world` bundles (GPU bundles when the
//!   machine has GPUs and `trainer.device` is not `cpu`), spawns one [`TrainerRank`] per bundle, a [`DataLoader`] and
//!   a [`Checkpointer`], hosts a [`Metrics`] actor in the driver, resumes if asked, and trains.
//! - [`run`]: `ferl sft --nproc-per-node N [--nnodes M --address HOST:PORT]`: an embedded cluster (or the running
//!   one at `--address`), then [`train_on_cluster`].
//! - [`run_from_env`]: a rank started by an external launcher (torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/
//!   `MASTER_PORT` or SLURM's variables) trains in-process; every rank runs the same loop (SPMD) over the same data
//!   plan, and rank 0 logs and finishes checkpoints.
//!
//! Both paths compute the same losses as one process training on each whole global batch (see `rank.rs`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use ferl_collective::{init_from_env, LaunchEnv};
use ferl_config::{ResumeMode, SftConfig};
use ferl_plugin_bridge::StepBoundary;
use ferl_runtime::{
    bundle, Cluster, HeadOptions, NodeOptions, SpawnOptions, Strategy, WorkerGroup,
};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{
    self, latest, read_meta, step_dir, CheckpointMeta, Checkpointer, CheckpointerArgs,
};
use crate::data_loader::{load_datasets_with, split_samples, DataLoader, DataLoaderArgs, DataPlan};
use crate::messages::*;
use crate::metrics::{mfu, peak_flops, Metrics, MetricsArgs};
use crate::plugins::{actor_plugin_host, liger_kernels, resolve_custom_cls, DriverPlugins};
use crate::rank::{micro_batches, rank_device, total_steps, RankState};
use crate::trainer_rank::{TrainerRank, TrainerRankArgs};

/// How `ferl sft` distributes a run.
#[derive(Clone, Debug, Default)]
pub struct LaunchOptions {
    /// Ranks per machine (`--nproc-per-node`); 0 means "launched by an external launcher" (read the environment).
    pub nproc_per_node: usize,
    /// Machines (`--nnodes`).
    pub nnodes: usize,
    /// A running cluster's head (`--address HOST:PORT`); none starts an embedded cluster.
    pub address: Option<String>,
}

/// One optimizer step as the driver saw it.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct StepRecord {
    /// Global step (from 1).
    pub step: u64,
    /// Token-mean loss over the global batch.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
}

/// What a run did.
#[derive(Serialize, Deserialize, Debug, Clone, Default)]
pub struct RunSummary {
    /// Ranks that trained.
    pub world_size: usize,
    /// The step the run resumed from (0 when it started fresh).
    pub resumed_from: u64,
    /// Steps trained by this run.
    pub steps: Vec<StepRecord>,
    /// `(step, token-mean validation loss)`.
    pub val_losses: Vec<(u64, f64)>,
    /// Newest complete checkpoint (0 when none).
    pub last_checkpoint: u64,
}

/// The checkpoint a run starts from, per `trainer.resume_mode`.
pub fn resume_dir(cfg: &SftConfig) -> Result<Option<PathBuf>> {
    let root = ferl_config::expand_path(&cfg.trainer.default_local_dir);
    match cfg.trainer.resume_mode {
        ResumeMode::Disable => Ok(None),
        ResumeMode::Auto => latest(&root),
        ResumeMode::ResumePath => match &cfg.trainer.resume_from_path {
            Some(p) => Ok(Some(ferl_config::expand_path(p))),
            None => bail!("trainer.resume_mode=resume_path needs trainer.resume_from_path"),
        },
    }
}

/// The metrics actor's arguments for `cfg` (no loggers unless `logs`: only rank 0 of a launcher run logs).
fn metrics_args(cfg: &SftConfig, logs: bool) -> MetricsArgs {
    let root = ferl_config::expand_path(&cfg.trainer.default_local_dir);
    MetricsArgs {
        loggers: if logs {
            cfg.trainer.logger.as_slice().to_vec()
        } else {
            Vec::new()
        },
        dir: root.display().to_string(),
        project: cfg.trainer.project_name.clone(),
        experiment: cfg.trainer.experiment_name.clone(),
    }
}

fn should(freq: i64, step: u64, total: u64) -> bool {
    freq > 0 && (step.is_multiple_of(freq as u64) || step == total)
}

fn use_gpus(cfg: &SftConfig) -> bool {
    cfg.trainer.device != "cpu" && ferl_trainer::sft::cuda_is_available()
}

/// Trains `cfg` with `world` ranks on `cluster`. Plugins come from the job's plugin host ([`DriverPlugins`]): the
/// data loader gets the dataset plugin's file and the ranks the `liger` kernel plugin's, shipped with their spawns.
pub async fn train_on_cluster(
    cluster: &Cluster,
    cfg: &SftConfig,
    world: usize,
) -> Result<RunSummary> {
    let mut cfg = cfg.clone();
    let plugins = DriverPlugins::open(&mut cfg).context("plugins")?;
    let cfg = &cfg;
    let yaml = cfg.to_yaml();
    let root = ferl_config::expand_path(&cfg.trainer.default_local_dir);
    let loader = cluster
        .spawn::<DataLoader>(
            DataLoaderArgs {
                config_yaml: yaml.clone(),
                world_size: world as u64,
            },
            plugins.ship(SpawnOptions::new(), &DriverPlugins::for_data_loader(cfg))?,
        )
        .await
        .context("spawning the data loader")?;
    let info = loader
        .call(GetDatasetInfo)
        .await
        .context("data loader: reading the dataset")?;
    let total = total_steps(cfg, info.train_len as usize) as u64;
    check_batch_split(cfg, world)?;
    let gpus = use_gpus(cfg);
    let one = if gpus {
        bundle(&[("GPU", 1.0), ("CPU", 1.0)])
    } else {
        bundle(&[("CPU", 1.0)])
    };
    let group = cluster
        .create_group(vec![one; world], Strategy::Pack, Duration::from_secs(120))
        .await
        .with_context(|| {
            format!(
                "reserving {world} {} bundles",
                if gpus { "GPU" } else { "CPU" }
            )
        })?;
    let prefix = format!("ferl/sft/{}/{}", std::process::id(), group.id);
    let rank_opts = plugins.ship(SpawnOptions::new(), &DriverPlugins::for_trainer_rank(cfg))?;
    let ranks = WorkerGroup::<TrainerRank>::spawn(
        cluster,
        &group,
        |rank| TrainerRankArgs {
            config_yaml: yaml.clone(),
            rank: rank as u64,
            world_size: world as u64,
            total_steps: total,
            group_prefix: prefix.clone(),
        },
        rank_opts,
    )
    .await
    .context("spawning the trainer ranks")?;
    let checkpointer = cluster
        .spawn::<Checkpointer>(
            CheckpointerArgs {
                root: root.display().to_string(),
                max_keep: cfg.trainer.max_ckpt_to_keep.unwrap_or(0) as u64,
            },
            SpawnOptions::new(),
        )
        .await
        .context("spawning the checkpointer")?;
    let metrics = cluster.spawn_local(
        Metrics::open_with_plugins(&metrics_args(cfg, true), Some(plugins.host()))?,
        SpawnOptions::new(),
    );
    let mut summary = RunSummary {
        world_size: world,
        ..Default::default()
    };
    if let Some(dir) = resume_dir(cfg)? {
        let meta = read_meta(&dir)?;
        ranks
            .call_all(LoadShard {
                dir: dir.display().to_string(),
            })
            .await
            .context("trainer ranks: loading the checkpoint")?;
        loader.call(SetPosition(meta.position())).await?;
        summary.resumed_from = meta.global_step;
        tracing::info!(checkpoint = %dir.display(), step = meta.global_step, "resumed");
    }
    let peak = peak_flops(gpus);
    let num_params = num_params_of(cfg)?;
    // Reload requests (`ferl plugin reload`) are served and new versions switched in after every step.
    let mut boundary = StepBoundary::new(plugins.host().clone());
    let mut step = summary.resumed_from;
    while step < total {
        let started = Instant::now();
        let batch = loader
            .call(NextBatch)
            .await
            .context("data loader: next batch")?;
        let calls = ranks
            .members()
            .iter()
            .zip(batch.shards)
            .map(|(r, samples)| {
                r.call(TrainStep {
                    samples,
                    global_targets: batch.global_targets,
                })
            });
        let replies = futures_join(calls)
            .await
            .with_context(|| format!("step {}: training", step + 1))?;
        step += 1;
        let loss = replies.iter().map(|r| r.loss_share).sum::<f64>();
        let record = StepRecord {
            step,
            loss,
            grad_norm: replies[0].grad_norm,
            lr: replies[0].lr,
        };
        summary.steps.push(record);
        boundary.run(step as i64);
        let seconds = started.elapsed().as_secs_f64();
        let mut values = step_values(&record, batch.tokens, seconds, &replies);
        if let Some(peak) = peak {
            values.push((
                "perf/mfu".into(),
                mfu(num_params, batch.tokens, seconds, world, peak),
            ));
        }
        if should(cfg.trainer.test_freq, step, total) && info.val_len > 0 {
            let shards = loader.call(ValShards).await?;
            let rounds = validation_rounds(&shards, cfg.data.micro_batch_size_per_gpu);
            let calls = ranks
                .members()
                .iter()
                .zip(shards)
                .map(|(r, samples)| r.call(Validate { samples, rounds }));
            let parts = futures_join(calls).await.context("validation")?;
            let (sum, count) = parts
                .iter()
                .fold((0.0, 0), |(s, c), (ps, pc)| (s + ps, c + pc));
            let val = sum / count.max(1) as f64;
            summary.val_losses.push((step, val));
            values.push(("val/loss".into(), val));
        }
        metrics.tell(Log { step, values }).await?;
        if should(cfg.trainer.save_freq, step, total) {
            let dir = step_dir(&root, step);
            let saving = ranks
                .call_all(SaveShard {
                    dir: dir.display().to_string(),
                })
                .await
                .with_context(|| format!("saving {}", dir.display()))?;
            let position = loader.call(GetPosition).await?;
            let files = saving
                .iter()
                .flat_map(|s| s.files.iter().cloned())
                .collect();
            let fsdp_meta_json = saving[0].meta_json.clone();
            checkpointer
                .tell(Commit {
                    fsdp_meta_json,
                    files,
                    global_step: step,
                    position,
                    world_size: world as u64,
                })
                .await?;
        }
    }
    ranks
        .call_all(FinishSave)
        .await
        .context("trainer ranks: finishing checkpoint writes")?;
    summary.last_checkpoint = checkpointer.call(Flush).await?;
    metrics.call(FlushLogs).await?;
    cluster.remove_group(&group).await.ok();
    cluster.kill(&loader).await.ok();
    cluster.kill(&checkpointer).await.ok();
    Ok(summary)
}

/// Runs every rank's call at once (they meet in collectives) and gathers the replies in rank order.
async fn futures_join<T, E>(
    calls: impl Iterator<Item = impl std::future::Future<Output = Result<T, E>>>,
) -> Result<Vec<T>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let mut out = Vec::new();
    for (rank, r) in futures::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
        out.push(r.with_context(|| format!("trainer rank {rank}"))?);
    }
    Ok(out)
}

/// Every rank must run the same number of micro-batches per step (the sharded store's gathers are collectives), so
/// the global batch must split evenly (verl requires the same).
fn check_batch_split(cfg: &SftConfig, world: usize) -> Result<()> {
    let batch = cfg.data.train_batch_size;
    if !batch.is_multiple_of(world) {
        bail!("data.train_batch_size={batch} does not split evenly over {world} ranks (make it a multiple of {world})");
    }
    Ok(())
}

/// The most micro-batches any rank needs for its validation share.
fn validation_rounds(shards: &[Vec<Sample>], micro: usize) -> u64 {
    shards
        .iter()
        .map(|s| micro_batches(s.len(), micro))
        .max()
        .unwrap_or(0) as u64
}

fn step_values(
    record: &StepRecord,
    tokens: i64,
    seconds: f64,
    replies: &[RankStep],
) -> Vec<(String, f64)> {
    let mut values = vec![
        ("train/loss".to_string(), record.loss),
        ("train/grad_norm".to_string(), record.grad_norm),
        ("train/lr".to_string(), record.lr),
        (
            "perf/tokens_per_second".to_string(),
            tokens as f64 / seconds.max(1e-9),
        ),
        ("perf/step_seconds".to_string(), seconds),
    ];
    for (rank, r) in replies.iter().enumerate() {
        values.push((
            format!("perf/max_memory_gb/rank_{rank}"),
            r.peak_memory_bytes as f64 / (1u64 << 30) as f64,
        ));
    }
    values
}

fn num_params_of(cfg: &SftConfig) -> Result<i64> {
    let dir = crate::rank::model_dir(cfg);
    let model = ferl_trainer::model::config::ModelConfig::from_file(&dir.join("config.json"))?;
    Ok(ferl_trainer::model::layout::ModelLayout::new(&model).num_params())
}

/// `ferl sft --nproc-per-node N [--nnodes M] [--address HOST:PORT]`, or, with `nproc_per_node == 0`, one rank of
/// an external launch ([`run_from_env`]).
pub fn run(cfg: SftConfig, opts: &LaunchOptions) -> Result<RunSummary> {
    crate::ensure_linked();
    if opts.nproc_per_node == 0 {
        return run_from_env(cfg);
    }
    let world = opts.nproc_per_node * opts.nnodes.max(1);
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async {
        let cluster = match &opts.address {
            Some(address) => ferl_runtime::connect(address, None).await.with_context(|| format!("joining the cluster at {address}"))?,
            None => {
                if opts.nnodes > 1 {
                    bail!("--nnodes {} needs --address of a running cluster (start one with `ferl start --head`)", opts.nnodes);
                }
                let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
                let node = NodeOptions { num_cpus: Some(cpus.max(world + 2) as f64), ..Default::default() };
                ferl_runtime::init(HeadOptions { node, ..Default::default() }).await?
            }
        };
        let result = train_on_cluster(&cluster, &cfg, world).await;
        cluster.shutdown().await;
        result
    })
}

/// One rank of a run started by an external launcher: forms the group from the environment, trains its share of
/// every global batch, and (rank 0) logs and commits checkpoints.
pub fn run_from_env(mut cfg: SftConfig) -> Result<RunSummary> {
    let launch = LaunchEnv::from_env().context(
        "no --nproc-per-node given and no launcher environment (RANK/WORLD_SIZE/MASTER_ADDR or SLURM variables)",
    )?;
    // torchrun's agent already serves its own store at MASTER_PORT; ranks then meet on the next port.
    if std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
        std::env::set_var("MASTER_PORT", (launch.master_port + 1).to_string());
    }
    // SLURM's --gpus-per-task leaves one visible device per task; torchrun leaves all of them.
    let visible = if cfg.trainer.device != "cpu" && ferl_trainer::sft::cuda_is_available() {
        tch::Cuda::device_count().max(1) as usize
    } else {
        1
    };
    let device = rank_device(&cfg, launch.local_rank % visible);
    let comm = init_from_env(device).context("joining the group from the launcher environment")?;
    let (rank, world) = (comm.rank(), comm.world_size());
    // Every rank has the plugin folders itself ($FERL_PLUGIN_PATH); rank 0's host is the run directory's (its
    // control channel serves `ferl plugin list|reload`), the others keep private copies.
    let plugins = if rank == 0 {
        Some(DriverPlugins::open(&mut cfg).context("plugins")?)
    } else {
        None
    };
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
    let mut plan = DataPlan::new(&cfg, train.len())?;
    let total = total_steps(&cfg, train.len()) as u64;
    let root = ferl_config::expand_path(&cfg.trainer.default_local_dir);
    let metrics = Metrics::open_with_plugins(&metrics_args(&cfg, rank == 0), host.as_ref())?;
    check_batch_split(&cfg, world)?;
    let mut state = RankState::build(cfg.clone(), comm, device, total as usize)?;
    if cfg.model.use_liger {
        state.set_kernels(liger_kernels(host.clone()));
    }
    let mut summary = RunSummary {
        world_size: world,
        ..Default::default()
    };
    if let Some(dir) = resume_dir(&cfg)? {
        let meta = read_meta(&dir)?;
        state.load(&dir)?;
        plan.set_position(meta.position());
        summary.resumed_from = meta.global_step;
    }
    let mut boundary = plugins
        .as_ref()
        .map(|p| StepBoundary::new(p.host().clone()));
    let mut step = summary.resumed_from;
    while step < total {
        let started = Instant::now();
        let (_, indices) = plan.next_batch();
        let shards = split_samples(&train, &indices, world);
        let global_targets: i64 = shards.iter().flatten().map(Sample::num_targets).sum();
        let tokens: i64 = shards
            .iter()
            .flatten()
            .map(|s| s.input_ids.len() as i64)
            .sum();
        let mine = state
            .train_step(&shards[rank], global_targets)
            .with_context(|| format!("rank {rank}: step {}", step + 1))?;
        step += 1;
        let loss = state.sum_over_ranks(&[mine.loss_share])?[0];
        let record = StepRecord {
            step,
            loss,
            grad_norm: mine.grad_norm,
            lr: mine.lr,
        };
        summary.steps.push(record);
        if let Some(b) = boundary.as_mut() {
            b.run(step as i64);
        }
        let mut values = step_values(
            &record,
            tokens,
            started.elapsed().as_secs_f64(),
            std::slice::from_ref(&mine),
        );
        if let (Some(val), true) = (&val, should(cfg.trainer.test_freq, step, total)) {
            let all: Vec<usize> = (0..val.len()).collect();
            let shards = split_samples(val, &all, world);
            let rounds = validation_rounds(&shards, cfg.data.micro_batch_size_per_gpu) as usize;
            let (s, c) = state.validate(&shards[rank], rounds)?;
            let sums = state.sum_over_ranks(&[s, c as f64])?;
            let v = sums[0] / sums[1].max(1.0);
            summary.val_losses.push((step, v));
            values.push(("val/loss".into(), v));
        }
        metrics.log(&Log { step, values })?;
        if should(cfg.trainer.save_freq, step, total) {
            let dir = step_dir(&root, step);
            state.save_now(&dir)?;
            if rank == 0 {
                let p = plan.position();
                let meta = CheckpointMeta {
                    global_step: step,
                    epoch: p.epoch,
                    step_in_epoch: p.step_in_epoch,
                    world_size: world as u64,
                };
                checkpoint::commit(&root, &meta, cfg.trainer.max_ckpt_to_keep)?;
            }
            summary.last_checkpoint = step;
        }
    }
    metrics.flush()?;
    state.sum_over_ranks(&[0.0]).context("final barrier")?;
    Ok(summary)
}

/// Reads a summary a driver wrote as JSON (tests and scripts).
pub fn read_summary(path: &Path) -> Result<RunSummary> {
    serde_json::from_slice(
        &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))
}
