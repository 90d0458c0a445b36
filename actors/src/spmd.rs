//! The SPMD executor: every rank runs the one run loop itself over the same data plan — world 1 in one process
//! (`ferl sft` without `--nproc-per-node`), or each rank of an external launcher (torchrun's `RANK`/`WORLD_SIZE`/
//! `MASTER_ADDR`/`MASTER_PORT`, SLURM's variables). Rank 0 logs, serves plugin reloads and commits checkpoints.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use ferl_collective::{Communicator, GroupOptions, MemoryRendezvous};
use ferl_config::expand_path;
use ferl_data::{rank_shard, Batching, SftDataset};
use ferl_trainer::checkpoint::{commit, RunMeta, HF_DIR};
use ferl_trainer::metrics::LoggerRegistry;
use ferl_trainer::run::{Phase, RestartPolicy, StepExecutor, StepOutcome};
use tch::Device;

use crate::data_loader::{call_samples, plan_batch, rank_share, rows_done, validation_calls};
use crate::messages::Sample;
use crate::rank::{micro_batches, RankState};

/// What a rank trains: the algorithm's step and validation over the rank's [`RankState`] (its sharded model,
/// optimizer and schedule), for the indices of the training set the loop gives. Every rank of a run calls the same
/// methods in the same order.
pub trait RankAlgorithm {
    /// Trains one global batch of the training-set indices `batch` (the rank takes its share).
    fn train_step(&mut self, state: &mut RankState, batch: &[usize]) -> Result<StepOutcome>;
    /// The validation loss over the whole validation set; `None` when there is none.
    fn validate(&mut self, state: &mut RankState, progress: &Phase) -> Result<Option<f64>>;
    /// Told that the model was restored from the checkpoint `dir` (written after `global_step` steps).
    fn loaded(&mut self, dir: &Path, global_step: u64) -> Result<()> {
        let _ = (dir, global_step);
        Ok(())
    }
    /// Told that the run starts again from its first step (a restart; a checkpoint to resume from is then
    /// [`RankAlgorithm::loaded`]).
    fn restarted(&mut self) {}
}

/// SFT: the whole (tokenized) training and validation sets; each rank trains its share of every batch.
pub struct SftAlgorithm {
    train: SftDataset,
    val: Option<SftDataset>,
}

/// A rank that runs the loop itself: its [`RankState`] and the algorithm it trains.
pub struct SpmdExecutor {
    state: RankState,
    algorithm: Box<dyn RankAlgorithm>,
    root: PathBuf,
    keep: Option<usize>,
    /// Rank 0's commit of the newest checkpoint (digests, `meta.json`, latest pointer), running off the step path
    /// so that the other ranks never wait in a collective while it reads the files back.
    committing: Option<std::thread::JoinHandle<Result<()>>>,
    /// Builds a fresh rank state for a restart (world 1 in this process); none under an external launcher, whose
    /// launcher restarts ranks.
    rebuild: Option<Rebuild>,
}

/// Builds a fresh [`RankState`] (a restart of a run in this process).
pub type Rebuild = Box<dyn FnMut() -> Result<RankState> + Send>;

impl SpmdExecutor {
    /// An executor over `state` training SFT on `train` (and validating on `val`) as `state`'s config says.
    pub fn new(state: RankState, train: SftDataset, val: Option<SftDataset>) -> Self {
        Self::with_algorithm(state, Box::new(SftAlgorithm { train, val }))
    }

    /// An executor over `state` training `algorithm`.
    pub fn with_algorithm(state: RankState, algorithm: Box<dyn RankAlgorithm>) -> Self {
        let root = expand_path(&state.cfg.trainer.default_local_dir);
        let keep = state.cfg.trainer.max_ckpt_to_keep;
        Self {
            state,
            algorithm,
            root,
            keep,
            committing: None,
            rebuild: None,
        }
    }

    /// Lets `trainer.max_restarts` restart this executor with states `rebuild` makes.
    pub fn restartable(mut self, rebuild: Rebuild) -> Self {
        self.rebuild = Some(rebuild);
        self
    }

    fn finish_commit(&mut self) -> Result<()> {
        match self.committing.take() {
            Some(h) => h
                .join()
                .map_err(|_| anyhow::anyhow!("checkpoint commit thread panicked"))?,
            None => Ok(()),
        }
    }

    fn rank(&self) -> usize {
        self.state.rank_and_world().0
    }
}

/// This rank's contiguous share of `indices` of `dataset`, as wire samples.
fn my_samples(dataset: &SftDataset, indices: &[usize], rank: usize, world: usize) -> Vec<Sample> {
    rank_shard(indices, rank, world)
        .iter()
        .map(|&i| Sample::from(dataset.get(i)))
        .collect()
}

impl RankAlgorithm for SftAlgorithm {
    fn train_step(&mut self, state: &mut RankState, batch: &[usize]) -> Result<StepOutcome> {
        let (rank, world) = state.rank_and_world();
        let (dp_rank, dp_world) = state.data_rank_and_world();
        let samples: Vec<&ferl_data::TokenizedSample> =
            batch.iter().map(|&i| self.train.get(i)).collect();
        let global_targets = samples.iter().map(|s| s.num_targets() as i64).sum();
        let tokens = samples.iter().map(|s| s.input_ids.len() as i64).sum();
        let plan = plan_batch(
            &self.train,
            batch,
            dp_world,
            Batching::from_config(&state.cfg),
        )?;
        let (mine, sizes) = rank_share(&self.train, batch, &plan[dp_rank]);
        let sizes: Vec<usize> = sizes.iter().map(|&n| n as usize).collect();
        let out = state
            .train_micro_batches(&mine, &sizes, global_targets)
            .with_context(|| format!("rank {rank}"))?;
        // One all-reduce carries the loss shares and every rank's peak memory.
        let mut shares = vec![0.0; 1 + world];
        shares[0] = out.loss_share;
        shares[1 + rank] = out.peak_memory_bytes as f64;
        let sums = state.sum_over_ranks(&shares)?;
        Ok(StepOutcome {
            loss: sums[0],
            grad_norm: out.grad_norm,
            lr: out.lr,
            skipped: out.skipped,
            tokens,
            peak_memory_bytes: sums[1..].iter().map(|&b| b as u64).collect(),
            metrics: Vec::new(),
        })
    }

    fn validate(&mut self, state: &mut RankState, progress: &Phase) -> Result<Option<f64>> {
        let Some(val) = &self.val else {
            return Ok(None);
        };
        let (dp_rank, dp_world) = state.data_rank_and_world();
        let all: Vec<usize> = (0..val.len()).collect();
        let mine = my_samples(val, &all, dp_rank, dp_world);
        let micro = state.cfg.data.micro_batch_size_per_gpu;
        let rounds = micro_batches(val.len().div_ceil(dp_world), micro);
        progress.set_length(val.len() as u64);
        progress.set_position(0);
        let (mut sum, mut count) = (0.0, 0);
        for call in validation_calls(rounds) {
            let samples = call_samples(&mine, &call, micro);
            let (s, c) = state.validate(samples, call.len())?;
            sum += s;
            count += c;
            progress.set_position(rows_done(val.len(), call.end, rounds));
        }
        let sums = state.sum_over_ranks(&[sum, count as f64])?;
        Ok(Some(sums[0] / sums[1].max(1.0)))
    }
}

impl StepExecutor for SpmdExecutor {
    fn world_size(&self) -> usize {
        self.state.rank_and_world().1
    }

    fn train_step(&mut self, batch: &[usize]) -> Result<StepOutcome> {
        self.algorithm.train_step(&mut self.state, batch)
    }

    fn validate(&mut self, progress: &Phase) -> Result<Option<f64>> {
        self.algorithm.validate(&mut self.state, progress)
    }

    fn save(&mut self, dir: &Path, meta: &RunMeta, hf_model: bool) -> Result<()> {
        self.state.save_now(dir)?;
        if hf_model {
            self.state.export(&dir.join(HF_DIR))?;
        }
        self.finish_commit()?;
        if self.rank() == 0 {
            let (root, meta, keep) = (self.root.clone(), meta.clone(), self.keep);
            let commit = move || commit(&root, &meta, keep);
            self.committing = Some(std::thread::spawn(commit));
        }
        Ok(())
    }

    fn load(&mut self, dir: &Path) -> Result<()> {
        self.state.load(dir)?;
        let meta = ferl_trainer::checkpoint::read_meta(dir)?;
        self.algorithm.loaded(dir, meta.global_step)
    }

    fn finish(&mut self) -> Result<()> {
        self.state.finish_save()?;
        self.finish_commit()?;
        self.state.sum_over_ranks(&[0.0]).context("final barrier")?;
        Ok(())
    }

    fn restart(&mut self, _cause: &anyhow::Error, _policy: &RestartPolicy<'_>) -> Result<String> {
        let Some(rebuild) = self.rebuild.as_mut() else {
            bail!("ranks started by torchrun/SLURM are restarted by their launcher");
        };
        if let Some(commit) = self.committing.take() {
            commit.join().ok();
        }
        self.state = rebuild().context("rebuilding the rank")?;
        self.algorithm.restarted();
        Ok("error".into())
    }
}

/// Under torchrun, whose agent already serves its own store at `MASTER_PORT`, points this rank's rendezvous at the
/// next port (every rank of the launch does the same).
pub fn meet_beside_torchrun_store(launch: &ferl_collective::LaunchEnv) {
    if std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
        std::env::set_var("MASTER_PORT", (launch.master_port + 1).to_string());
    }
}

/// A group of one rank (this process), on `device`.
pub fn world_of_one(device: Device) -> Result<Arc<dyn Communicator>> {
    let options = GroupOptions {
        prefix: "ferl/one-process".into(),
        ..Default::default()
    };
    ferl_collective::connect(device, 0, 1, Arc::new(MemoryRendezvous::new()), &options)
        .context("forming the one-process group")
}

/// Options of a run in this process (world 1) beyond the config.
#[derive(Default)]
pub struct InProcessOptions {
    /// Stop after this many steps of this run (an interruption, in tests).
    pub stop_after_steps: Option<u64>,
    /// Show the run's progress (a bar in a terminal, plain lines in a log: [`ferl_trainer::run::Progress`]).
    pub progress: bool,
    /// Extra logger kinds `trainer.logger` may name, besides the built-in ones and loaded plugins.
    pub loggers: Option<LoggerRegistry>,
    /// Plugin folders watched besides the default ones and `$FERL_PLUGIN_PATH`.
    pub plugin_folders: Vec<PathBuf>,
}
