//! GRPO and RLOO as an algorithm of the one run loop ([`ferl_trainer::run::run`]) on trainer ranks: every rank holds
//! its shard of the policy in the [`RankState`] SFT trains (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HSDP from the
//! actor's `fsdp_config`; gradient checkpointing; the learning-rate schedule), and runs the one GRPO step
//! ([`GrpoStep`]) over the loop's prompts with its share of every row. The loop owns the rest: data order, saving
//! (the sharded checkpoint format of SFT, resumable at any world size), resume, restarts, loggers and progress.
//!
//! Metrics carry verl's names; `train/*` is not logged for RL (its `actor/pg_loss`, `actor/grad_norm` and
//! `actor/lr` say it).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use ferl_rl::{Colocated, DataShare, GrpoPrompt, GrpoStep, StepperPolicy};
use ferl_trainer::run::{Phase, StepOutcome};

use crate::rank::RankState;
use crate::spmd::RankAlgorithm;

/// GRPO over the run's prompts (the loop's training set): one [`GrpoStep`] per global batch.
pub struct GrpoAlgorithm {
    prompts: Arc<Vec<GrpoPrompt>>,
    step: GrpoStep,
    rollout_dir: Option<PathBuf>,
}

impl GrpoAlgorithm {
    /// Trains on `prompts` (indexed by the loop's data order) with `step`.
    pub fn new(prompts: Arc<Vec<GrpoPrompt>>, step: GrpoStep) -> Self {
        Self {
            prompts,
            step,
            rollout_dir: None,
        }
    }

    /// Dumps each step's generations into `trainer.rollout_data_dir` of `cfg` when it is set (rank 0 writes;
    /// [`super::dump`]).
    pub fn dumping_rollouts_of(mut self, cfg: &ferl_config::PpoConfig) -> Self {
        let dir = cfg.trainer.rollout_data_dir.as_deref();
        self.rollout_dir = dir.map(ferl_data::expand_path);
        self
    }
}

impl GrpoAlgorithm {
    /// One step over `prompts` (the whole global batch; this rank takes its share of the rows), after `completed`
    /// steps of the run: its sampling and shuffles derive from that step, on every launch path.
    pub fn train_prompts(
        &mut self,
        state: &mut RankState,
        prompts: &[GrpoPrompt],
        completed: u64,
    ) -> Result<StepOutcome> {
        self.step.completed = completed;
        let (rank, world) = state.rank_and_world();
        let (dp_rank, dp_world) = state.data_rank_and_world();
        let share = DataShare {
            rank: dp_rank,
            world: dp_world,
        };
        let device = state.stepper.device;
        let mut policy = StepperPolicy {
            stepper: &mut state.stepper,
            share,
        };
        let out = self
            .step
            .run(&mut policy, &mut Colocated::default(), prompts)
            .with_context(|| format!("rank {rank}"))?;
        if let (0, Some(dir)) = (rank, &self.rollout_dir) {
            super::dump::dump_generations(dir, out.step, &out.batch, &self.step)?;
        }
        let mut memory = vec![0.0; world];
        memory[rank] = crate::device_memory::peak_memory_bytes(device) as f64;
        let memory = state.sum_over_ranks(&memory)?;
        let metric = |k: &str| out.metrics.get(k).copied().unwrap_or(f64::NAN);
        let tokens = out
            .batch
            .rows
            .iter()
            .map(|r| (r.prompt.len() + r.response.len()) as i64)
            .sum();
        Ok(StepOutcome {
            loss: metric("actor/pg_loss"),
            grad_norm: metric("actor/grad_norm"),
            lr: metric("actor/lr"),
            skipped: !metric("actor/grad_norm").is_finite(),
            tokens,
            peak_memory_bytes: memory.iter().map(|&b| b as u64).collect(),
            metrics: out.metrics.into_iter().collect(),
        })
    }
}

impl RankAlgorithm for GrpoAlgorithm {
    fn train_step(&mut self, state: &mut RankState, batch: &[usize]) -> Result<StepOutcome> {
        let chosen: Vec<GrpoPrompt> = batch.iter().map(|&i| self.prompts[i].clone()).collect();
        let completed = self.step.completed;
        self.train_prompts(state, &chosen, completed)
    }

    /// GRPO has no validation pass yet (the config gate refuses the keys that ask for one).
    fn validate(&mut self, _state: &mut RankState, _progress: &Phase) -> Result<Option<f64>> {
        Ok(None)
    }

    /// A restart without a checkpoint begins at the first step again.
    fn restarted(&mut self) {
        self.step.completed = 0;
    }

    /// The next step is the checkpoint's next: its sampling and shuffles derive from the step.
    fn loaded(&mut self, _dir: &std::path::Path, global_step: u64) -> Result<()> {
        self.step.completed = global_step;
        Ok(())
    }
}

/// One prompt on the wire (a cluster run's driver sends each step's prompts to its ranks): token ids and what the
/// reward reads.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct WirePrompt {
    /// Token ids.
    pub ids: Vec<i64>,
    /// Its text.
    pub text: String,
    /// The reward's ground truth.
    pub ground_truth: String,
    /// Anything else the reward reads, as JSON.
    pub extra_json: String,
}

impl From<&GrpoPrompt> for WirePrompt {
    fn from(p: &GrpoPrompt) -> Self {
        Self {
            ids: p.ids.clone(),
            text: p.text.clone(),
            ground_truth: p.ground_truth.clone(),
            extra_json: p.extra.to_string(),
        }
    }
}

impl WirePrompt {
    /// The prompt it carries.
    pub fn prompt(&self) -> Result<GrpoPrompt> {
        Ok(GrpoPrompt {
            ids: self.ids.clone(),
            text: self.text.clone(),
            ground_truth: self.ground_truth.clone(),
            extra: serde_json::from_str(&self.extra_json).context("a prompt's extra_info")?,
        })
    }
}

/// Trainer rank: one RL step over these prompts (the whole global batch; each rank takes its share of the rows).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct RlTrainStep {
    /// The step's prompts, in the loop's order.
    pub prompts: Vec<WirePrompt>,
    /// Steps the run completed before this one.
    pub completed: u64,
}

/// What an RL step did, as every rank knows it (its sums are over all ranks).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct RlStepDone {
    /// `actor/pg_loss`.
    pub loss: f64,
    /// `actor/grad_norm`.
    pub grad_norm: f64,
    /// `actor/lr`.
    pub lr: f64,
    /// The update was skipped (non-finite norm).
    pub skipped: bool,
    /// Tokens of the step's rows.
    pub tokens: i64,
    /// Each rank's peak memory in bytes.
    pub peak_memory_bytes: Vec<u64>,
    /// The step's metrics, verl's names.
    pub metrics: Vec<(String, f64)>,
}

impl From<StepOutcome> for RlStepDone {
    fn from(o: StepOutcome) -> Self {
        Self {
            loss: o.loss,
            grad_norm: o.grad_norm,
            lr: o.lr,
            skipped: o.skipped,
            tokens: o.tokens,
            peak_memory_bytes: o.peak_memory_bytes,
            metrics: o.metrics,
        }
    }
}

impl From<RlStepDone> for StepOutcome {
    fn from(d: RlStepDone) -> Self {
        Self {
            loss: d.loss,
            grad_norm: d.grad_norm,
            lr: d.lr,
            skipped: d.skipped,
            tokens: d.tokens,
            peak_memory_bytes: d.peak_memory_bytes,
            metrics: d.metrics,
        }
    }
}

/// What a trainer rank needs to train GRPO (in [`crate::trainer_rank::TrainerRankArgs`]).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct RlRankArgs {
    /// The resolved PPO config as YAML.
    pub ppo_yaml: String,
    /// The data sources of the run's prompts (the `naive` reward manager scores by them).
    pub data_sources: Vec<String>,
}

impl GrpoAlgorithm {
    /// The algorithm of a trainer-rank actor over `state`: the step as every path builds it
    /// ([`super::setup::grpo_step`]), prompts from the driver's messages.
    pub fn for_rank(args: &RlRankArgs, state: &RankState) -> Result<Self> {
        let cfg = ferl_config::PpoConfig::from_yaml(&args.ppo_yaml, &[])
            .context("trainer rank: reading the PPO config")?;
        let model_dir = std::path::PathBuf::from(&state.cfg.model.partial_pretrain);
        let tok = Arc::new(super::setup::tokenizer(&cfg, &model_dir)?);
        let sources = args.data_sources.iter().cloned().collect();
        let host = crate::plugins::actor_plugin_host()?;
        let reward = super::setup::rank_reward(&cfg, host, &sources)?;
        let settings = super::setup::grpo_settings(&cfg, &tok)?;
        let step = super::setup::grpo_step(settings, state, tok, reward)?;
        Ok(Self::new(Arc::new(Vec::new()), step).dumping_rollouts_of(&cfg))
    }
}

ferl_runtime::message! {
    RlTrainStep => RlStepDone;
}
