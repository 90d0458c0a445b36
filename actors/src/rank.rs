//! One training rank's state, independent of how the rank was started: its shard of the model in a
//! [`ShardedParams`] (FULL_SHARD, SHARD_GRAD_OP or NO_SHARD from `model.fsdp_config`; HSDP's shard and replica groups
//! when `fsdp_size` asks for them), and the [`Stepper`]. The [`crate::TrainerRank`] actor wraps it for the cluster path; [`crate::spmd::SpmdExecutor`] uses
//! it directly for one process and for ranks started by torchrun or SLURM.
//!
//! Invariants:
//! 1. A distributed step computes exactly what [`Stepper::step`] computes on the whole global batch in one process:
//!    each rank scales by the *global* target count and the store sums the gradients across ranks before the norm.
//! 2. A rank never decides data order: it trains on the samples it is given.
//! 3. Every rank runs the same number of micro-batches per step and per validation (the store's gathers are
//!    collectives): the driver splits batches evenly and validation pads with discarded micro-batches.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use ferl_collective::Communicator;
use ferl_config::{Dtype, SftConfig};
use ferl_fsdp::{
    load_sharded, save_sharded, FsdpOptions, ShardGroups, ShardSnapshot, ShardedParams, WithTensors,
};
use ferl_trainer::batch::{Layout, SampleRef};
use ferl_trainer::checkpoint::HF_DIR;
use ferl_trainer::engine::{Engine, EngineOptions};
use ferl_trainer::kernels::KernelRegistry;
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::lora::{self, LoraSpec};
use ferl_trainer::model::ulysses::{self, SpGroup};
use ferl_trainer::model::{load_model, weights};
use ferl_trainer::optim::{AdamW, AdamWConfig};
use ferl_trainer::params::ParamStore;
use ferl_trainer::run::gate::lora_of;
use ferl_trainer::run::{adamw_config, compute_kind, lr_schedule, RankLayout};
use ferl_trainer::step::Stepper;
use tch::{Device, Kind, Tensor};

use crate::messages::{RankStep, Sample};

/// The model folder `model.partial_pretrain` names: a local folder as given, else a Hugging Face Hub id
/// (`ORG/NAME[@REVISION]`) resolved through this machine's Hugging Face cache and downloaded there when absent
/// ([`ferl_trainer::model::hub::resolve_model`]). Every process that reads the model folder resolves it this way, so
/// each node uses its own cache.
pub fn resolve_model_dir(cfg: &SftConfig) -> Result<PathBuf> {
    ferl_trainer::model::hub::resolve_model(&cfg.model.partial_pretrain)
        .with_context(|| format!("model.partial_pretrain={}", cfg.model.partial_pretrain))
}

/// The model a run trains, read from `model.partial_pretrain`: its config, layout and fp32 parameters, with LoRA
/// adapters (fresh, seeded by `trainer.seed`, or from `model.lora_adapter_path`) when the config asks for them.
pub fn load_model_for(cfg: &SftConfig) -> Result<(ModelConfig, ModelLayout, Vec<Tensor>)> {
    let dir = resolve_model_dir(cfg)?;
    let loaded =
        load_model(&dir).with_context(|| format!("model.partial_pretrain={}", dir.display()))?;
    let (layout, params) = match lora_of(cfg)? {
        Some((spec, adapter)) => lora::with_adapters(
            &loaded.config,
            loaded.layout,
            loaded.params,
            &spec,
            adapter.as_deref(),
            cfg.trainer.seed as i64,
        )?,
        None => (loaded.layout, loaded.params),
    };
    Ok((loaded.config, layout, params))
}

/// Forms a collective group of some of the world group's ranks over its rendezvous: `connect(name, rank, size)` joins
/// group `name` of `size` ranks as its rank `rank` ([`ferl_collective::Subgroups::connect`]).
pub type ConnectGroup<'a> = &'a dyn Fn(&str, usize, usize) -> Result<Arc<dyn Communicator>>;

/// The groups this rank's store shards over: the world group, or under HSDP (`model.fsdp_config.fsdp_size=S` below
/// the world size, see [`RankLayout`]) shard group `fsdp{g}` (ranks `g·S .. (g+1)·S`) and replica group
/// `replica{i}` (the ranks at index `i` of their shard group), formed with `connect` in that order on every rank.
fn shard_groups(
    cfg: &SftConfig,
    comm: Arc<dyn Communicator>,
    connect: Option<ConnectGroup<'_>>,
) -> Result<ShardGroups> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let layout = RankLayout::new(cfg, world)?;
    if !layout.hybrid() {
        return Ok(comm.into());
    }
    let size = layout.shard_size;
    let connect = connect.with_context(|| {
        format!("model.fsdp_config.fsdp_size={size}: this launch path forms no HSDP groups")
    })?;
    let (group, index) = (layout.shard_group(rank), layout.shard_rank(rank));
    let shard = connect(&format!("fsdp{group}"), index, size)
        .with_context(|| format!("rank {rank}: joining HSDP shard group fsdp{group}"))?;
    let replicate = connect(&format!("replica{index}"), group, layout.replicas())
        .with_context(|| format!("rank {rank}: joining HSDP replica group replica{index}"))?;
    Ok(ShardGroups::hybrid(shard, replicate))
}

/// The model of `model.partial_pretrain` sharded over `comm`'s group, each rank reading only its shard's bytes of
/// the safetensors files (design note 14: no rank holds the whole model at start); with LoRA, the adapters (fresh,
/// seeded by `trainer.seed`, or from `model.lora_adapter_path`, both small) are made whole in memory and sharded.
fn shard_model(
    cfg: &SftConfig,
    comm: ShardGroups,
    fsdp: FsdpOptions,
) -> Result<(ModelConfig, ShardedParams, Option<LoraSpec>)> {
    shard_model_with(cfg, comm, fsdp, false)
}

/// [`shard_model`], every tensor frozen with `frozen` (no gradient buffers, no optimizer state: a reference
/// policy).
fn shard_model_with(
    cfg: &SftConfig,
    comm: ShardGroups,
    fsdp: FsdpOptions,
    frozen: bool,
) -> Result<(ModelConfig, ShardedParams, Option<LoraSpec>)> {
    let dir = resolve_model_dir(cfg)?;
    let at = || format!("model.partial_pretrain={}", dir.display());
    let config = ModelConfig::from_file(&dir.join("config.json")).with_context(at)?;
    let base = ModelLayout::new(&config);
    let files = weights::WeightReader::open(&dir, &base).with_context(at)?;
    let (layout, given, spec) = match lora_of(cfg)? {
        Some((spec, adapter)) => {
            // The adapters only append to the base tensors: undefined placeholders stand in for them.
            let placeholders = (0..base.tensors.len()).map(|_| Tensor::new()).collect();
            let seed = cfg.trainer.seed as i64;
            let (layout, params) =
                lora::with_adapters(&config, base, placeholders, &spec, adapter.as_deref(), seed)?;
            let base_len = layout.base_len();
            let given = params.into_iter().enumerate().skip(base_len).collect();
            (layout, given, Some(spec))
        }
        None => (base, HashMap::new(), None),
    };
    let mut layout = layout;
    if frozen {
        layout.trainable = vec![false; layout.tensors.len()];
    }
    let mut source = WithTensors { files, given };
    let store = ShardedParams::from_source(layout, &mut source, comm, fsdp)?;
    Ok((config, store, spec))
}

/// A [`Stepper`] over `store` with the config's optimizer, schedule, clipping and micro-batching.
pub fn build_stepper<P: ParamStore>(
    cfg: &SftConfig,
    model: ModelConfig,
    mut store: P,
    device: Device,
    total_steps: u64,
) -> Result<Stepper<P>> {
    let optimizer = AdamW::new(adamw_config(cfg), store.master_and_grads().0);
    Ok(Stepper {
        engine: Engine::new(model, store, compute_kind(cfg)?, engine_options(cfg)),
        optimizer,
        schedule: lr_schedule(cfg, total_steps)?,
        clip_grad: cfg.optim.clip_grad,
        micro_batch_size: cfg.data.micro_batch_size_per_gpu,
        layout: layout_of(cfg),
        device,
        completed_steps: 0,
        sequence_parallel: None,
    })
}

fn engine_options(cfg: &SftConfig) -> EngineOptions {
    EngineOptions {
        gradient_checkpointing: cfg.model.enable_gradient_checkpointing,
        layout: layout_of(cfg),
        ..Default::default()
    }
}

/// `use_remove_padding`'s layout of micro-batches.
fn layout_of(cfg: &SftConfig) -> Layout {
    match cfg.use_remove_padding {
        true => Layout::Packed,
        false => Layout::Padded,
    }
}

/// Whether a checkpoint's copy of `bytes` may be written in the background with `available` bytes of host memory
/// free: room for it, as much again (the other ranks of the host copy theirs at the same moment) and 1 GiB to spare.
/// Unknown memory lets it.
fn background_copy_fits(bytes: u64, available: Option<u64>) -> bool {
    available.is_none_or(|a| 2 * bytes + (1 << 30) <= a)
}

/// Borrowed views of wire samples, in order.
pub fn sample_refs(samples: &[Sample]) -> Vec<SampleRef<'_>> {
    samples
        .iter()
        .map(|s| SampleRef {
            input_ids: &s.input_ids,
            loss_mask: &s.loss_mask,
        })
        .collect()
}

/// Micro-batches of `n` samples at micro-batch size `micro`.
pub fn micro_batches(n: usize, micro: usize) -> usize {
    n.div_ceil(micro.max(1))
}

/// A training rank: its shard of the model, the optimizer state of that shard, and the stepper.
pub struct RankState {
    /// The resolved config.
    pub cfg: SftConfig,
    /// The optimizer step machinery over the sharded store.
    pub stepper: Stepper<ShardedParams>,
    /// Parameters of the whole model (for FLOP counts).
    pub num_params: i64,
    comm: Arc<dyn Communicator>,
    groups: ShardGroups,
    fsdp: FsdpOptions,
    pending_save: Option<std::thread::JoinHandle<Result<()>>>,
    kernels: KernelRegistry,
    lora: Option<LoraSpec>,
}

impl RankState {
    /// Loads the model on `device`, keeps this rank's shard, and joins the store to `comm`'s group. A launch path
    /// that forms subgroups calls [`Self::build_in_groups`] instead (HSDP is refused here).
    pub fn build(
        cfg: SftConfig,
        comm: Arc<dyn Communicator>,
        device: Device,
        total_steps: u64,
    ) -> Result<Self> {
        Self::build_in_groups(cfg, comm, None, device, total_steps)
    }

    /// [`Self::build`], forming HSDP's shard and replica groups with `connect` when `model.fsdp_config.fsdp_size`
    /// asks for them (every rank of `comm`'s group calls it alike).
    pub fn build_in_groups(
        cfg: SftConfig,
        comm: Arc<dyn Communicator>,
        connect: Option<ConnectGroup<'_>>,
        device: Device,
        total_steps: u64,
    ) -> Result<Self> {
        let fsdp = FsdpOptions::from_fsdp_config(&cfg.model.fsdp_config, device);
        let groups = shard_groups(&cfg, comm.clone(), connect)?;
        let (config, store, lora) = shard_model(&cfg, groups.clone(), fsdp)?;
        let num_params = ModelLayout::new(&config).num_params();
        let stepper = build_stepper(&cfg, config, store, device, total_steps)?;
        Ok(Self {
            cfg,
            stepper,
            num_params,
            comm,
            groups,
            fsdp,
            pending_save: None,
            kernels: KernelRegistry::builtin(),
            lora,
        })
    }

    /// Whether the policy trains LoRA adapters over a frozen base.
    pub fn has_lora(&self) -> bool {
        self.lora.is_some()
    }

    /// The model folder's weights sharded as this rank's policy is, frozen (no gradient buffers, no optimizer
    /// state): the reference policy of RL, whose gathers are collectives of this rank's groups. Refused with LoRA
    /// (verl's reference is then the base model without adapters).
    pub fn frozen_reference(&self) -> Result<Engine<ShardedParams>> {
        if self.lora.is_some() {
            bail!("a frozen reference of a LoRA policy is its base model: not built yet");
        }
        let (config, store, _) = shard_model_with(&self.cfg, self.groups.clone(), self.fsdp, true)?;
        let kind = compute_kind(&self.cfg)?;
        let mut engine = Engine::new(config, store, kind, engine_options(&self.cfg));
        engine.set_kernels(self.kernels.clone());
        Ok(engine)
    }

    /// Runs the model's ops that `kernels` replaces through it (`model.use_liger=true`: the `liger` kernels); kept
    /// across checkpoint loads.
    pub fn set_kernels(&mut self, kernels: KernelRegistry) {
        self.stepper.engine.set_kernels(kernels.clone());
        self.kernels = kernels;
    }

    /// Joins this rank's Ulysses group when `ulysses_sequence_parallel_size` is above 1 (`RankLayout`): `connect(name,
    /// rank, size)` forms the collective group of the group's ranks (`name` tells the groups apart). Every
    /// micro-batch is then split over the group. The model's heads must split over it (checked before joining, so
    /// every rank refuses alike).
    pub fn join_sequence_parallel(
        &mut self,
        connect: impl FnOnce(&str, usize, usize) -> Result<Arc<dyn Communicator>>,
    ) -> Result<()> {
        let (rank, world) = self.rank_and_world();
        let layout = RankLayout::new(&self.cfg, world)?;
        if layout.sp_size == 1 {
            return Ok(());
        }
        let model = self.stepper.engine.config();
        ulysses::check_heads(layout.sp_size as i64, model.num_heads, model.num_kv_heads)?;
        let name = format!("sp{}", layout.dp_rank(rank));
        let comm = connect(&name, layout.sp_rank(rank), layout.sp_size)
            .with_context(|| format!("rank {rank}: joining sequence-parallel group {name}"))?;
        self.stepper.sequence_parallel = Some(SpGroup::new(comm));
        Ok(())
    }

    /// This rank's index and the group size.
    pub fn rank_and_world(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world_size())
    }

    /// This rank's data-parallel rank and the number of data-parallel ranks: its sequence-parallel group and the
    /// number of groups (the rank and world size without sequence parallelism).
    pub fn data_rank_and_world(&self) -> (usize, usize) {
        let (rank, world) = self.rank_and_world();
        match RankLayout::new(&self.cfg, world) {
            Ok(l) => (l.dp_rank(rank), l.dp_world()),
            Err(_) => (rank, world),
        }
    }

    /// Sums `values` over the ranks (in order with the store's other collectives).
    pub fn sum_over_ranks(&mut self, values: &[f64]) -> Result<Vec<f64>> {
        self.stepper.engine.store_mut().all_reduce_sum(values)
    }

    /// Trains on this rank's share of one global batch whose target count is `global_targets`, in micro-batches of
    /// `data.micro_batch_size_per_gpu` samples.
    pub fn train_step(&mut self, samples: &[Sample], global_targets: i64) -> Result<RankStep> {
        let micro = self.stepper.micro_batch_size.max(1);
        let sizes: Vec<usize> = samples.chunks(micro).map(<[_]>::len).collect();
        self.train_micro_batches(samples, &sizes, global_targets)
    }

    /// [`Self::train_step`] in the micro-batches `sizes` (samples in each, in order: a
    /// [`ferl_data::Batching`] plan).
    pub fn train_micro_batches(
        &mut self,
        samples: &[Sample],
        sizes: &[usize],
        global_targets: i64,
    ) -> Result<RankStep> {
        let stats =
            self.stepper
                .step_in_micro_batches(&sample_refs(samples), sizes, global_targets)?;
        Ok(RankStep {
            loss_share: stats.loss,
            grad_norm: stats.grad_norm,
            lr: stats.lr,
            skipped: stats.skipped,
            tokens: stats.tokens,
            targets: samples.iter().map(Sample::num_targets).sum(),
            peak_memory_bytes: crate::device_memory::peak_memory_bytes(self.stepper.device),
        })
    }

    /// Summed validation cross-entropy and target count over `samples`, running exactly `rounds` micro-batches
    /// (extra ones repeat a sample and are discarded) so every rank joins the same gathers.
    pub fn validate(&mut self, samples: &[Sample], rounds: usize) -> Result<(f64, i64)> {
        let refs = sample_refs(samples);
        let micro = self.stepper.micro_batch_size.max(1);
        let filler = [SampleRef {
            input_ids: &[0, 0],
            loss_mask: &[false, false],
        }];
        let (mut sum, mut count) = (0.0, 0);
        let mut chunks = refs.chunks(micro);
        for _ in 0..rounds {
            let (chunk, real) = match chunks.next() {
                Some(c) => (c, true),
                None => (&filler[..], false),
            };
            let mb = self.stepper.micro_batch(chunk)?;
            let (s, c) = self.stepper.engine.eval_loss(&mb)?;
            if real {
                sum += s;
                count += c;
            }
        }
        if chunks.next().is_some() {
            bail!("validation: {} samples need more than the {rounds} micro-batches the driver planned", samples.len());
        }
        Ok((sum, count))
    }

    fn adam_config(&self) -> AdamWConfig {
        self.stepper.optimizer.config
    }

    /// Waits for the previous checkpoint's background write, returning its error if it failed.
    pub fn finish_save(&mut self) -> Result<()> {
        match self.pending_save.take() {
            Some(h) => h
                .join()
                .map_err(|_| anyhow::anyhow!("checkpoint writer thread panicked"))?,
            None => Ok(()),
        }
    }

    /// Copies this rank's shards of the masters and optimizer state (fast), then writes them into `dir` on a
    /// background thread while training continues. Returns the checkpoint metadata the checkpointer writes once
    /// every rank's files exist (as JSON), and the files this rank will write.
    pub fn save_in_background(&mut self, dir: &Path) -> Result<(String, Vec<String>)> {
        self.finish_save()?;
        let step = self.stepper.completed_steps;
        let snap = {
            let store = self.stepper.engine.store_mut();
            store.finish_grads()?;
            ShardSnapshot::view(store, &self.stepper.optimizer, step)?
        }
        .with_model_config(self.stepper.engine.config());
        let meta = serde_json::to_string(&snap.meta)?;
        // Under HSDP only the first shard group writes (its files are those of a run at its size).
        let files = snap
            .files(dir)
            .iter()
            .map(|f| f.display().to_string())
            .collect();
        self.save_side_files(dir)?;
        let (bytes, available) = (snap.bytes(), crate::device_memory::available_memory_bytes());
        if !background_copy_fits(bytes, available) {
            // A background copy (of this rank's, and as much again for the other ranks of the host) would not fit:
            // the shards are written now, before training goes on.
            tracing::info!(
                dir = %dir.display(),
                bytes,
                available = available.unwrap_or(0),
                "checkpoint: writing the shards now, a copy to write in the background would not fit in memory"
            );
            snap.write(dir)?;
            return Ok((meta, files));
        }
        let (dir, snap) = (dir.to_path_buf(), snap.into_owned());
        self.pending_save = Some(std::thread::spawn(move || snap.write(&dir)));
        Ok((meta, files))
    }

    /// Saves a complete sharded checkpoint into `dir` now (every rank calls it; rank 0 writes the metadata last).
    pub fn save_now(&mut self, dir: &Path) -> Result<()> {
        self.finish_save()?;
        let step = self.stepper.completed_steps;
        let model = self.stepper.engine.config().clone();
        let optimizer = &self.stepper.optimizer;
        save_sharded(
            self.stepper.engine.store_mut(),
            optimizer,
            &model,
            step,
            dir,
        )?;
        self.save_side_files(dir)
    }

    /// What a checkpoint holds beside the shards: the LoRA adapter (see [`Self::save_adapter`]) and, as verl
    /// keeps them, the model's tokenizer and generation files in `huggingface/` (rank 0), so `ferl export` needs
    /// no source folder.
    fn save_side_files(&mut self, dir: &Path) -> Result<()> {
        self.save_adapter(dir)?;
        if self.rank_and_world().0 == 0 {
            let src = resolve_model_dir(&self.cfg)?;
            weights::copy_side_files(&[src.as_path()], &dir.join(HF_DIR))?;
        }
        Ok(())
    }

    /// With LoRA, writes the adapter in PEFT's format into `dir/lora_adapter` (every rank calls it: the adapters
    /// are gathered; rank 0 writes).
    fn save_adapter(&mut self, dir: &Path) -> Result<()> {
        let Some(spec) = self.lora.clone() else {
            return Ok(());
        };
        let adapters = self.stepper.engine.store_mut().full_trainable_params()?;
        if self.rank_and_world().0 != 0 {
            return Ok(());
        }
        let layout = self.stepper.engine.store().layout();
        let base = &self.cfg.model.partial_pretrain;
        lora::write_adapter(
            &dir.join(lora::CHECKPOINT_ADAPTER_DIR),
            &spec,
            layout,
            &adapters,
            base,
        )
    }

    /// Restores model shard, optimizer state and schedule position from the sharded checkpoint `dir`, written at
    /// any world size.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        self.finish_save()?;
        let layout = self.stepper.engine.store().layout().clone();
        let loaded = load_sharded(
            dir,
            layout,
            self.groups.clone(),
            self.fsdp,
            self.adam_config(),
        )
        .with_context(|| format!("loading checkpoint {}", dir.display()))?;
        let model = self.stepper.engine.config().clone();
        let kind = compute_kind(&self.cfg)?;
        self.stepper.engine = Engine::new(model, loaded.store, kind, engine_options(&self.cfg));
        self.stepper.engine.set_kernels(self.kernels.clone());
        self.stepper.optimizer = loaded.optimizer;
        self.stepper.completed_steps = loaded.meta.global_step;
        Ok(())
    }

    /// Writes a Hugging Face folder to `out` (every rank calls it: the full tensors are gathered; rank 0 writes);
    /// with LoRA, the merged model (`W + (α/r)·B·A`).
    /// Returns whether this rank wrote it.
    pub fn export(&mut self, out: &Path) -> Result<bool> {
        let full = self.stepper.engine.store_mut().full_params()?;
        if self.rank_and_world().0 != 0 {
            return Ok(false);
        }
        let kind = if self.cfg.model.fsdp_config.model_dtype == Dtype::Bf16 {
            Kind::BFloat16
        } else {
            Kind::Float
        };
        let src = resolve_model_dir(&self.cfg)?;
        let (config, layout) = (
            self.stepper.engine.config(),
            self.stepper.engine.store().layout(),
        );
        let (layout, full) = match self.lora {
            Some(_) => (ModelLayout::new(config), lora::merge(layout, &full)),
            None => (layout.clone(), full),
        };
        weights::save_hf_folder(out, config, &layout, &full, kind, &[src.as_path()])?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 0.5B-shaped rank's shard (3 GiB of masters and moments) is copied for a background write with 16 GiB free,
    /// and written at once with 6 GiB free (two ranks copying would exhaust them).
    #[test]
    fn a_checkpoint_copy_goes_to_the_background_only_when_it_fits() {
        let gib = 1u64 << 30;
        assert!(background_copy_fits(3 * gib, Some(16 * gib)));
        assert!(!background_copy_fits(3 * gib, Some(6 * gib)));
        assert!(background_copy_fits(3 * gib, None));
    }

    /// `use_remove_padding` packs the micro-batches every engine of the rank builds from rows (RL's old and
    /// reference log-probabilities and its update read the layout from the engine).
    #[test]
    fn remove_padding_is_the_engines_layout() {
        let mut cfg = SftConfig::default();
        assert_eq!(engine_options(&cfg).layout, Layout::Padded);
        cfg.use_remove_padding = true;
        assert_eq!(engine_options(&cfg).layout, Layout::Packed);
    }
}
