//! verl's single-controller GRPO loop over the role actors: the driver holds the reward and computes the
//! advantages; [`Rollout`] actors generate; the [`PolicyActor`] computes log-probabilities and updates; after each
//! update the driver moves the policy's weights to every rollout actor ([`sync_weights`]).
//!
//! One [`GrpoDriver::step`] is the one GRPO step ([`GrpoStep`], the code `GrpoTrainer::step` and every trainer
//! rank run) over actor-backed roles ([`super::remote`]): the same seeds, the same functions on the same values, so
//! given the same weights it generates the same responses and computes the same metrics (timings aside), whatever
//! the placement and number of rollout actors (each row samples from its own stream).
//!
//! # Placements ([`Placement`])
//! - `Colocated`: one resource group of one bundle; the policy actor and the rollout actors are separate processes
//!   in that bundle (the same node and device). The weight sync goes through the node's object store and
//!   same-host path.
//! - `Separate`: a group of one bundle for the policy and a group of one bundle per rollout actor (verl's
//!   separate resource pools); the weight sync crosses nodes when the groups do, fetched once per node.

use super::messages::{
    LoadState, LoadWeights, PublishWeights, ReleaseWeights, SaveState, WeightsSource, WireDtype,
};
use super::policy::{PolicyActor, PolicyArgs};
use super::remote::{ActorPolicy, ActorReference, ActorRollouts};
use super::rollout::{Rollout, RolloutArgs};
use anyhow::{bail, Context as _, Result};
use ferl_rl::grpo::Decoder;
use ferl_rl::{GrpoPrompt, GrpoSettings, GrpoStep, GrpoStepOutput, ReferencePolicy, Reward};
use ferl_runtime::{bundle, ActorRef, Cluster, ResourceGroup, SpawnOptions, Strategy, WorkerGroup};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

/// Where the roles run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// One resource group of one bundle holding the policy actor and the rollout actors (separate processes).
    Colocated,
    /// A resource group for the policy and another for the rollout actors, one bundle per actor.
    Separate,
}

/// How the role actors are spawned.
#[derive(Clone, Debug)]
pub struct RoleOptions {
    /// The actors' device: `cpu` (bundles of one CPU) or `cuda` (bundles of one GPU).
    pub device: String,
    /// The compute dtype of both roles: `fp32` or `bf16`.
    pub dtype: String,
    /// torch's intra-op threads per actor process (0: torch's default).
    pub threads: u64,
    /// Rollout actors (each generates an even share of the prompts).
    pub rollouts: usize,
}

impl Default for RoleOptions {
    /// CPU, fp32, one thread, one rollout actor.
    fn default() -> Self {
        Self {
            device: "cpu".into(),
            dtype: "fp32".into(),
            threads: 1,
            rollouts: 1,
        }
    }
}

/// The spawned roles and the resource groups they hold.
pub struct GrpoRoles {
    /// The policy (and reference).
    pub policy: ActorRef<PolicyActor>,
    /// The rollout actors, in rank order.
    pub rollouts: WorkerGroup<Rollout>,
    /// The resource groups (one when colocated, two when separate).
    pub groups: Vec<ResourceGroup>,
}

impl GrpoRoles {
    /// Frees the groups, which stops their actors.
    pub async fn remove(self, cluster: &Cluster) -> Result<()> {
        for g in &self.groups {
            cluster.remove_group(g).await?;
        }
        Ok(())
    }
}

/// Spawns the policy actor (with a reference when `settings.loss.use_kl_loss`) and `opts.rollouts` rollout actors,
/// all built from the model folder `model_dir`, on resource groups laid out as `placement` says.
pub async fn spawn_roles(
    cluster: &Cluster,
    settings: &GrpoSettings,
    model_dir: &Path,
    placement: Placement,
    opts: &RoleOptions,
) -> Result<GrpoRoles> {
    if opts.rollouts == 0 {
        bail!("spawn_roles: at least one rollout actor is needed");
    }
    let unit = match opts.device.starts_with("cuda") {
        true => bundle(&[("GPU", 1.0)]),
        false => bundle(&[("CPU", 1.0)]),
    };
    let device = if opts.device.starts_with("cuda") {
        "cuda"
    } else {
        "cpu"
    };
    let wait = Duration::from_secs(60);
    let dir = model_dir.display().to_string();
    let rollout_args = RolloutArgs {
        model_dir: dir.clone(),
        device: device.into(),
        dtype: opts.dtype.clone(),
        threads: opts.threads,
    };
    let policy_args = PolicyArgs {
        model_dir: dir,
        device: device.into(),
        dtype: opts.dtype.clone(),
        threads: opts.threads,
        lr: settings.lr,
        beta1: settings.optim.betas.0,
        beta2: settings.optim.betas.1,
        eps: settings.optim.eps,
        weight_decay: settings.optim.weight_decay,
        reference: settings.loss.use_kl_loss,
    };
    let policy_group = cluster
        .create_group(vec![unit.clone()], Strategy::Pack, wait)
        .await?;
    let in_policy = SpawnOptions::new().in_bundle(&policy_group, 0);
    let policy = cluster.spawn::<PolicyActor>(policy_args, in_policy.clone());
    let (policy, rollouts, groups) = match placement {
        Placement::Colocated => {
            let mut members = Vec::with_capacity(opts.rollouts);
            for _ in 0..opts.rollouts {
                let r = cluster.spawn::<Rollout>(rollout_args.clone(), in_policy.clone());
                members.push(r.await?);
            }
            let rollouts = WorkerGroup::from_members(members);
            (policy.await?, rollouts, vec![policy_group])
        }
        Placement::Separate => {
            let group = cluster
                .create_group(vec![unit; opts.rollouts], Strategy::Spread, wait)
                .await?;
            let args = |_| rollout_args.clone();
            let rollouts = WorkerGroup::spawn(cluster, &group, args, SpawnOptions::new());
            let (policy, rollouts) = futures::join!(policy, rollouts);
            (policy?, rollouts?, vec![policy_group, group])
        }
    };
    Ok(GrpoRoles {
        policy,
        rollouts,
        groups,
    })
}

/// One weight sync: what moved and how long it took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightSync {
    /// Bytes of the weights blob (fetched once per node).
    pub bytes: u64,
    /// Seconds of the whole sync: publish, every rollout actor's read and rebuild, and the release.
    pub seconds: f64,
    /// Seconds the policy took to write the blob into the object store (and the reply to arrive).
    pub export_seconds: f64,
    /// Seconds from the publish's reply until every rollout actor had rebuilt its model.
    pub load_seconds: f64,
}

impl WeightSync {
    /// `timing_s/update_weights` and the sync's `perf/weight_sync_bytes` and `perf/weight_sync_mb_per_s` (bytes
    /// over the whole sync's seconds, 10⁶ bytes per MB).
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([
            ("timing_s/update_weights".to_string(), self.seconds),
            ("perf/weight_sync_bytes".to_string(), self.bytes as f64),
            (
                "perf/weight_sync_mb_per_s".to_string(),
                self.bytes as f64 / self.seconds.max(1e-9) / 1e6,
            ),
        ])
    }
}

/// Moves the policy's current weights to every rollout actor: the policy writes them as one blob of `dtype` into
/// the object store itself ([`PublishWeights`]: shared memory where its host allows), every rollout actor reads it
/// (mapping it on the policy's host, else fetched once per node) and rebuilds its model, then the policy frees it
/// ([`ReleaseWeights`]). The weights cross no process but the readers'.
pub async fn sync_weights(
    policy: &ActorRef<PolicyActor>,
    rollouts: &WorkerGroup<Rollout>,
    dtype: WireDtype,
) -> Result<WeightSync> {
    let started = Instant::now();
    let published = policy.call(PublishWeights { dtype }).await?;
    let export_seconds = started.elapsed().as_secs_f64();
    let bytes = published.object.size();
    let loading = Instant::now();
    let msg = LoadWeights {
        header: published.header,
        source: WeightsSource::Object(published.object),
    };
    let loaded = rollouts.call_all(msg).await;
    let released = policy.call(ReleaseWeights).await;
    let loaded = loaded?;
    released?;
    if let Some(bad) = loaded.iter().find(|l| l.bytes != bytes) {
        bail!("a rollout actor loaded {} of {bytes} bytes", bad.bytes);
    }
    Ok(WeightSync {
        bytes,
        seconds: started.elapsed().as_secs_f64(),
        export_seconds,
        load_seconds: loading.elapsed().as_secs_f64(),
    })
}

/// GRPO driven from this process over the role actors (see the module docs): the one step
/// ([`GrpoStep`]) over the actor-backed roles of [`super::remote`].
pub struct GrpoDriver {
    cluster: Cluster,
    roles: GrpoRoles,
    step: GrpoStep,
    sync_dtype: WireDtype,
}

impl GrpoDriver {
    /// A driver of `roles` (spawned from the initial weights) with `settings`, scoring with `reward`. Weights are
    /// synced as fp32. Call it inside the runtime the actors run on (a multi-threaded one: the step blocks in
    /// place).
    pub fn new(
        cluster: &Cluster,
        roles: GrpoRoles,
        settings: GrpoSettings,
        reward: Box<dyn Reward>,
    ) -> Result<Self> {
        let reference = settings.loss.use_kl_loss.then(|| {
            Box::new(ActorReference {
                handle: Handle::current(),
                actor: roles.policy.clone(),
            }) as Box<dyn ReferencePolicy>
        });
        Ok(Self {
            cluster: cluster.clone(),
            step: GrpoStep::new(settings, reference, reward)?,
            roles,
            sync_dtype: WireDtype::F32,
        })
    }

    /// Decodes responses for the reward with `decoder` (without one the reward sees empty response texts).
    pub fn set_decoder(&mut self, decoder: Decoder) {
        self.step.set_decoder(decoder);
    }

    /// Sends weights to the rollout actors as `dtype` (bf16 halves the bytes; use it with bf16 rollouts).
    pub fn set_sync_dtype(&mut self, dtype: WireDtype) {
        self.sync_dtype = dtype;
    }

    /// The role actors.
    pub fn roles(&self) -> &GrpoRoles {
        &self.roles
    }

    /// The settings.
    pub fn settings(&self) -> &GrpoSettings {
        &self.step.settings
    }

    /// Steps completed.
    pub fn global_step(&self) -> u64 {
        self.step.completed
    }

    /// One GRPO step over `prompts` ([`GrpoStep::run`] on the actors: generate on the rollout actors, reward here,
    /// old and reference log-probabilities and the update on the policy actor, then the weight sync). Returns verl's
    /// metrics (`critic/*`, `response_length/*`, `actor/*`, `timing_s/*`, and the sync's `perf/weight_sync_*`) and
    /// the batch.
    pub async fn step(&mut self, prompts: &[GrpoPrompt]) -> Result<GrpoStepOutput> {
        let handle = Handle::current();
        let roles = &self.roles;
        let mut policy = ActorPolicy {
            handle: handle.clone(),
            actor: roles.policy.clone(),
        };
        let mut rollouts =
            ActorRollouts::new(handle, &roles.rollouts, &roles.policy, self.sync_dtype);
        let step = &mut self.step;
        tokio::task::block_in_place(|| step.run(&mut policy, &mut rollouts, prompts))
    }

    /// Writes the policy's state and this driver's step count to `dir` (the files of `GrpoTrainer::save`).
    pub async fn save(&self, dir: &Path) -> Result<()> {
        let msg = SaveState {
            dir: dir.display().to_string(),
            global_step: self.step.completed,
        };
        Ok(self.roles.policy.call(msg).await?)
    }

    /// Restores what [`GrpoDriver::save`] (or `GrpoTrainer::save`) wrote and syncs the restored weights to the
    /// rollout actors: the next step is the saved run's next step.
    pub async fn load(&mut self, dir: &Path) -> Result<()> {
        let msg = LoadState {
            dir: dir.display().to_string(),
        };
        self.step.completed = self.roles.policy.call(msg).await?;
        let roles = &self.roles;
        sync_weights(&roles.policy, &roles.rollouts, self.sync_dtype)
            .await
            .context("syncing the restored weights")?;
        Ok(())
    }

    /// Frees the roles' resource groups (their actors stop).
    pub async fn shutdown(self) -> Result<()> {
        self.roles.remove(&self.cluster).await
    }
}

/// GRPO on the role actors for `steps` steps over the same `prompts` each step (see [`GrpoDriver::step`]): spawns
/// the roles from `model_dir` with `placement` (CPU, fp32, one rollout actor), runs, frees the groups, and returns
/// each step's metrics.
pub async fn run_grpo_on_groups(
    cluster: &Cluster,
    settings: &GrpoSettings,
    model_dir: &Path,
    prompts: &[GrpoPrompt],
    reward: Box<dyn Reward>,
    steps: usize,
    placement: Placement,
) -> Result<Vec<BTreeMap<String, f64>>> {
    let opts = RoleOptions::default();
    let roles = spawn_roles(cluster, settings, model_dir, placement, &opts).await?;
    let mut driver = GrpoDriver::new(cluster, roles, settings.clone(), reward)?;
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        match driver.step(prompts).await {
            Ok(step) => out.push(step.metrics),
            Err(e) => {
                let _ = driver.shutdown().await;
                return Err(e);
            }
        }
    }
    driver.shutdown().await?;
    Ok(out)
}
