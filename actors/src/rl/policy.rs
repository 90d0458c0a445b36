//! The policy actor: the policy being trained (an [`Engine`] over a [`LocalParams`] store with AdamW, a
//! [`PolicyWorker`]) built from a Hugging Face model folder, and with a KL loss a frozen reference copy of the
//! initial weights (verl's actor and ref workers in one process). It serves the old and reference
//! log-probabilities ([`ComputeLogProb`]), the update ([`UpdatePolicy`]), its weights ([`ExportWeights`]) and its
//! state ([`SaveState`], [`LoadState`], the files of `GrpoTrainer::save`).

use super::messages::{
    token_matrix, token_values, ComputeLogProb, ExportWeights, LoadState, PublishWeights,
    PublishedWeights, ReleaseWeights, RowIds, SaveState, TokenValues, UpdatePolicy, WeightsHeader,
    WeightsPayload, WireDtype,
};
use super::{on_state, set_threads};
use anyhow::{bail, Context as _, Result};
use ferl_rl::grpo::frozen_copy;
use ferl_rl::{compute_log_prob, MicroBatching, PolicyWorker};
use ferl_runtime::{Actor, Cluster, Context, Handler, ObjectBuffer, ObjectRef};
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::optim::{AdamWConfig, LrSchedule, ScheduleKind};
use ferl_trainer::params::LocalParams;
use ferl_trainer::rollout::{ensure_device, parse_device, parse_dtype};
use std::path::Path;
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// Constructor arguments of [`PolicyActor`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct PolicyArgs {
    /// The Hugging Face model folder (config.json and safetensors): the initial policy and the reference.
    pub model_dir: String,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// The compute dtype: `fp32` or `bf16` (the masters are fp32).
    pub dtype: String,
    /// torch's intra-op threads in the actor's process (0: torch's default).
    pub threads: u64,
    /// `actor.optim.lr` (constant).
    pub lr: f64,
    /// AdamW's β1.
    pub beta1: f64,
    /// AdamW's β2.
    pub beta2: f64,
    /// AdamW's epsilon.
    pub eps: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Keep a frozen reference copy of the initial weights (`use_kl_loss`).
    pub reference: bool,
}

/// The policy worker and the reference.
pub(crate) struct PolicyState {
    worker: PolicyWorker<LocalParams>,
    reference: Option<Engine<LocalParams>>,
}

impl PolicyState {
    /// Builds the policy from `args.model_dir` on the actor's device, as `GrpoTrainer::new` does.
    pub(crate) fn load(args: &PolicyArgs) -> Result<Self> {
        set_threads(args.threads);
        let (device, kind) = (parse_device(&args.device)?, parse_dtype(&args.dtype)?);
        ensure_device(device)?;
        let loaded = ferl_trainer::model::load_model(Path::new(&args.model_dir))?;
        let params = loaded.params.iter().map(|t| t.to_device(device)).collect();
        let store = LocalParams::new(loaded.layout, params, kind);
        let mut engine = Engine::new(loaded.config, store, kind, EngineOptions::default());
        let reference = match args.reference {
            true => Some(frozen_copy(&mut engine)?),
            false => None,
        };
        let schedule = LrSchedule {
            lr: args.lr,
            warmup_steps: 0,
            total_steps: 1,
            kind: ScheduleKind::Constant,
            num_cycles: 0.5,
        };
        let optim = AdamWConfig {
            betas: (args.beta1, args.beta2),
            eps: args.eps,
            weight_decay: args.weight_decay,
        };
        Ok(Self {
            worker: PolicyWorker::new(engine, optim, schedule, device),
            reference,
        })
    }

    /// Log-probabilities (and entropies) of the rows under the policy or the reference.
    pub(crate) fn log_probs(&mut self, m: ComputeLogProb) -> Result<TokenValues> {
        let batch = RowIds::batch(m.rows);
        let device = self.worker.device();
        let mbs = MicroBatching::from(m.micro_batching);
        let (lp, h) = match (m.reference, self.reference.as_mut()) {
            (false, _) => self
                .worker
                .compute_log_prob(&batch, mbs, m.temperature, m.entropy)?,
            (true, Some(r)) => compute_log_prob(r, &batch, mbs, m.temperature, m.entropy, device)?,
            (true, None) => bail!("policy actor: no reference policy (spawn it with `reference`)"),
        };
        Ok(TokenValues {
            log_probs: token_values(&batch, &lp)?,
            entropies: match h {
                Some(h) => Some(token_values(&batch, &h)?),
                None => None,
            },
        })
    }

    /// verl's `update_policy` over the message's rows.
    pub(crate) fn update(&mut self, m: UpdatePolicy) -> Result<Vec<(String, f64)>> {
        let cfg = m.keys.to_config()?;
        let device = self.worker.device();
        let mut batch = RowIds::batch(m.rows);
        batch.old_log_probs = Some(token_matrix(&batch, &m.old_log_probs, device)?);
        batch.advantages = Some(token_matrix(&batch, &m.advantages, device)?);
        if let Some(r) = &m.ref_log_probs {
            batch.ref_log_probs = Some(token_matrix(&batch, r, device)?);
        }
        Ok(self
            .worker
            .update_policy(&batch, &cfg)?
            .into_iter()
            .collect())
    }

    /// The full current weights by name: with a [`LocalParams`] store, its fp32 master tensors in layout order.
    fn named_weights(&self) -> Vec<(String, &Tensor)> {
        let store = self.worker.engine().store();
        store
            .layout_ref()
            .tensors
            .iter()
            .map(|(name, _)| name.clone())
            .zip(store.master())
            .collect()
    }

    /// The full current weights as one payload of `dtype`.
    pub(crate) fn export(&self, dtype: WireDtype) -> WeightsPayload {
        WeightsPayload::from_tensors(&self.named_weights(), dtype)
    }

    /// The full current weights of `dtype` written into an object-store buffer of `cluster`, and their header.
    fn export_into_buffer(
        &self,
        dtype: WireDtype,
        cluster: &Cluster,
    ) -> Result<(WeightsHeader, ObjectBuffer)> {
        let named = self.named_weights();
        let header = WeightsHeader::of(&named, dtype);
        let mut buffer = cluster.object_buffer(header.bytes() as usize);
        header.write(&named, &mut buffer)?;
        Ok((header, buffer))
    }

    /// Writes the policy's state to `dir` (the files `GrpoTrainer::save` writes).
    pub(crate) fn save(&mut self, dir: &Path, global_step: u64) -> Result<()> {
        self.worker.save_state(dir, global_step)
    }

    /// Restores what [`PolicyState::save`] wrote; returns the saved `global_step`.
    pub(crate) fn restore(&mut self, dir: &Path) -> Result<u64> {
        self.worker.restore_state(dir)
    }
}

/// The policy hosted by the runtime (verl's actor + ref worker, one process).
///
/// [`ExportWeights`] replies with the full weights: here the [`LocalParams`] store's fp32 masters. With a sharded
/// store (`ferl_fsdp::ShardedParams`) each rank would first gather its units (as `RolloutModel::from_store` does,
/// stage by stage) and rank 0 would reply with the whole model.
pub struct PolicyActor {
    state: Arc<Mutex<PolicyState>>,
    /// The owner's handle of the last [`PublishWeights`] blob, until [`ReleaseWeights`] or the next publish.
    published: Mutex<Option<ObjectRef>>,
}

impl Actor for PolicyActor {
    type Args = PolicyArgs;
    const NAME: &'static str = "ferl.actors.PolicyActor";
    async fn start(args: PolicyArgs, _: &Context) -> Result<Self> {
        let state = tokio::task::spawn_blocking(move || {
            PolicyState::load(&args)
                .with_context(|| format!("policy actor: loading the model {}", args.model_dir))
        })
        .await
        .context("policy actor: start task")??;
        Ok(Self {
            state: Arc::new(Mutex::new(state)),
            published: Mutex::new(None),
        })
    }
}

impl Handler<ComputeLogProb> for PolicyActor {
    async fn handle(&self, m: ComputeLogProb, _: &Context) -> Result<TokenValues> {
        on_state(&self.state, "policy: log-probs", move |s| s.log_probs(m)).await
    }
}

impl Handler<UpdatePolicy> for PolicyActor {
    async fn handle(&self, m: UpdatePolicy, _: &Context) -> Result<Vec<(String, f64)>> {
        on_state(&self.state, "policy: update", move |s| s.update(m)).await
    }
}

impl Handler<ExportWeights> for PolicyActor {
    async fn handle(&self, m: ExportWeights, _: &Context) -> Result<WeightsPayload> {
        on_state(
            &self.state,
            "policy: export",
            move |s| Ok(s.export(m.dtype)),
        )
        .await
    }
}

impl Handler<PublishWeights> for PolicyActor {
    async fn handle(&self, m: PublishWeights, ctx: &Context) -> Result<PublishedWeights> {
        self.release();
        let cluster = ctx.cluster();
        let (header, buffer) = on_state(&self.state, "policy: publish", move |s| {
            s.export_into_buffer(m.dtype, &cluster)
        })
        .await?;
        let object = ctx.cluster().put_buffer(buffer)?;
        *self.published.lock().expect("published weights lock") = Some(object.clone());
        Ok(PublishedWeights { header, object })
    }
}

impl Handler<ReleaseWeights> for PolicyActor {
    async fn handle(&self, _: ReleaseWeights, _: &Context) -> Result<()> {
        self.release();
        Ok(())
    }
}

impl PolicyActor {
    /// Frees the last published weights (if any).
    fn release(&self) {
        let last = self
            .published
            .lock()
            .expect("published weights lock")
            .take();
        drop(last);
    }
}

impl Handler<SaveState> for PolicyActor {
    async fn handle(&self, m: SaveState, _: &Context) -> Result<()> {
        on_state(&self.state, "policy: save", move |s| {
            s.save(Path::new(&m.dir), m.global_step)
        })
        .await
    }
}

impl Handler<LoadState> for PolicyActor {
    async fn handle(&self, m: LoadState, _: &Context) -> Result<u64> {
        on_state(&self.state, "policy: load", move |s| {
            s.restore(Path::new(&m.dir))
        })
        .await
    }
}
