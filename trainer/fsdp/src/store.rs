//! [`ShardedParams`]: the [`ParamStore`] that shards the model over a
//! [`Communicator`](ferl_collective::Communicator) group, or over HSDP's [`ShardGroups`].
//!
//! # Invariants
//! 1. `master[u]` is fp32 on the master device: this rank's shard of unit `u` (FULL_SHARD, SHARD_GRAD_OP) or the whole
//!    padded flat buffer (NO_SHARD). `grads[u]` has the same shape and device.
//! 2. After [`ShardedParams::finish_grads`] (which `grad_sq_norm` and `master_and_grads` run), `grads[u]` holds the
//!    *sum over ranks* of every gradient accumulated since `zero_grads`, restricted to this rank's range. Under HSDP
//!    ([`ShardGroups`]) "ranks" are all of them: units are padded and sliced over the shard group (`world` is its
//!    size) and reduce-scattered within it per stage and micro-batch; the replica group's all-reduce of each
//!    gradient shard runs once per step, in `finish_grads` (FSDP2's HSDP all-reduces on the last micro-batch of an
//!    accumulation only), so the slow, usually inter-node, replica links carry one shard per unit per step. Before
//!    `finish_grads` a rank's `grads[u]` holds its own shard group's sum.
//! 3. Gathered copies never outlive a change of the masters: every cache and prefetch is dropped before the optimizer
//!    sees the masters, and gathers read copies of the shards, never the masters themselves.
//!    Within a step, `full[u]` keeps the handle of every buffer gathered for unit `u` until `drop_gathered`: FULL_SHARD's
//!    `release` frees its bytes ([`ferl_trainer::storage::free_storage`]) instead of dropping it, since an autograd
//!    graph kept without checkpointing may still refer to it, and the next gather (or `regather`) of the unit fills
//!    that same storage again. So a rank holds gathered bytes only for the units marked `resident`, and
//!    [`ShardedParams::memory_stats`] counts them by their storages, the graphs' references included.
//! 4. Which stage is prefetched depends only on the sequence of `gather` calls, which is the same on every rank, so
//!    every rank submits the same collectives in the same order.
//! 5. A unit several stages use — the embedding unit holding a tied output matrix — is sharded, gathered, freed and
//!    reduced like any other (design note 14): gathered for the embedding's forward, for the head and for the
//!    embedding's backward, freed after each, and each stage's gradient of it reduce-scattered at once, so no
//!    full-size gradient buffer of it lives through the step. Where the vocabulary matrices are split by rows
//!    (`row_split`: sharded, over 2 or more ranks), neither the embedding nor the head gathers them at all: they take
//!    this rank's rows from the master shard and add their rows' gradient, already the group's, into the gradient
//!    shard (`store/split.rs`).
//! 6. A frozen unit (LoRA's base) is gathered like any other but hands out leaves that do not require grad; it has
//!    no gradient buffer (an empty tensor), no reduction and no optimizer state: [`ParamStore::master_and_grads`]
//!    returns only the trainable units, which come first in the plan.

use crate::groups::ShardGroups;
use crate::row_split::{embedding_split, head_split, SplitLayout};
use crate::units::UnitPlan;
use crate::worker::{CommWorker, Pending};
use crate::{FsdpOptions, ShardingStrategy};
use anyhow::{bail, Context, Result};
use ferl_collective::Communicator;
use ferl_trainer::model::layout::{ModelLayout, Stage};
use ferl_trainer::optim::sum_of_squares;
use ferl_trainer::params::{ParamStore, SplitHead, StageParams};
use ferl_trainer::storage::{free_storage, refill_storage, storage_nbytes};
use ferl_trainer::vocab_parallel::VocabSlice;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

mod split;

/// Reduce-scatters allowed in flight before `accumulate_grads` waits for the oldest.
const MAX_PENDING_REDUCTIONS: usize = 4;

/// Counters of the store's communication, for benchmarks and logs.
#[derive(Clone, Copy, Debug, Default)]
pub struct CommStats {
    /// Unit all-gathers submitted (prefetches included).
    pub all_gathers: u64,
    /// Unit all-gathers that were already in flight (prefetched) when `gather` asked for them.
    pub prefetch_hits: u64,
    /// Unit reduce-scatters (or, for NO_SHARD, all-reduces) submitted.
    pub reductions: u64,
    /// HSDP: all-reduces of a unit's gradient shard across the replica group, one per trainable unit per step.
    pub replica_all_reduces: u64,
    /// Time `gather` spent blocked on an all-gather.
    pub gather_wait: Duration,
}

/// What one rank's store holds, in bytes (see [`ShardedParams::memory_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// The local fp32 masters (shards, or whole buffers for NO_SHARD).
    pub master_bytes: i64,
    /// The local fp32 gradients (empty for frozen units).
    pub grad_bytes: i64,
    /// Gathered full parameters held now, by the bytes of their storages (what autograd graphs keep included).
    pub gathered_bytes: i64,
    /// Output buffers of all-gathers in flight (prefetches).
    pub inflight_gather_bytes: i64,
    /// Full-size gradient buffers submitted for reduction and not yet applied (an upper bound: the communication
    /// thread frees each input once its collective ran).
    pub reducing_bytes: i64,
    /// The largest `gathered_bytes + inflight_gather_bytes` seen since the last [`ShardedParams::reset_peak`].
    pub peak_gathered_bytes: i64,
    /// The largest `gathered_bytes + inflight_gather_bytes + reducing_bytes` seen since the last reset.
    pub peak_transient_bytes: i64,
}

/// Parameters sharded over a group of ranks; see the crate docs for the constructor contract.
pub struct ShardedParams {
    layout: ModelLayout,
    plan: UnitPlan,
    opts: FsdpOptions,
    rank: usize,
    world: usize,
    replica: usize,
    replicas: usize,
    master_device: Device,
    worker: CommWorker,
    master: Vec<Tensor>,
    grads: Vec<Tensor>,
    full: Vec<Option<Tensor>>,
    resident: Vec<bool>,
    inflight: Vec<(usize, Pending)>,
    pending_reductions: VecDeque<(usize, Pending)>,
    dirty: bool,
    prev: Option<Stage>,
    last: Option<Stage>,
    next_of: HashMap<(Option<Stage>, Stage), Stage>,
    stats: CommStats,
    peak_gathered: i64,
    peak_transient: i64,
    /// This rank's rows of the head's output matrix and of the embedding matrix where they are split
    /// (`crate::row_split`).
    split_head: Option<SplitLayout>,
    split_embedding: Option<SplitLayout>,
    /// The shard group through the worker, for the split matrices' collectives.
    shard_group: Arc<dyn Communicator>,
}

impl ShardedParams {
    /// Shards the full fp32 parameters `full` (in `layout.tensors` order, identical on every rank — e.g. from
    /// `load_model` or `init_params` with one seed) over `comm`'s group (a communicator, or HSDP's
    /// [`ShardGroups`]); this rank keeps only its part.
    pub fn new(
        layout: ModelLayout,
        full: &[Tensor],
        comm: impl Into<ShardGroups>,
        opts: FsdpOptions,
    ) -> Result<Self> {
        if full.len() != layout.tensors.len() {
            bail!(
                "ShardedParams::new: {} tensors given, the layout has {}",
                full.len(),
                layout.tensors.len()
            );
        }
        for ((name, shape), t) in layout.tensors.iter().zip(full) {
            if t.size() != *shape {
                bail!(
                    "ShardedParams::new: tensor `{name}` has shape {:?}, the layout says {shape:?}",
                    t.size()
                );
            }
        }
        let mut source = full;
        Self::from_source(layout, &mut source, comm, opts)
    }

    /// A store from this rank's local master buffers (one per unit of `plan`, as invariant 1 describes).
    pub(crate) fn from_local_masters(
        layout: ModelLayout,
        plan: UnitPlan,
        locals: Vec<Tensor>,
        groups: ShardGroups,
        opts: FsdpOptions,
    ) -> Result<Self> {
        let (rank, world) = groups.shard_rank_and_size();
        let (replica, replicas) = groups.replica_rank_and_count();
        if replicas > 1 && opts.strategy == ShardingStrategy::NoShard {
            bail!("HSDP (a replica group) needs a sharding strategy, not NO_SHARD");
        }
        let master_device = if opts.cpu_offload {
            Device::Cpu
        } else {
            opts.device
        };
        if opts.cpu_offload {
            if opts.device == Device::Cpu {
                tracing::info!(
                    "cpu_offload: compute already runs on the CPU, so offloading changes nothing"
                );
            } else {
                tracing::info!(
                    "cpu_offload: fp32 master shards and AdamW state are kept in host memory"
                );
            }
        }
        let mut master = Vec::with_capacity(locals.len());
        for (u, t) in plan.units.iter().zip(locals) {
            let (_, len) = local_range(opts.strategy, u.shard_len(world), rank, world);
            if t.numel() as i64 != len {
                bail!(
                    "unit `{}`: local master has {} elements, expected {len}",
                    u.name,
                    t.numel()
                );
            }
            master.push(t.to_kind(Kind::Float).to_device(master_device));
        }
        // Frozen units never get gradients: an empty tensor stands in (invariant 6).
        let grads = master
            .iter()
            .zip(&plan.units)
            .map(|(m, u)| match u.frozen {
                true => Tensor::zeros([0], (Kind::Float, master_device)),
                false => m.zeros_like(),
            })
            .collect();
        let full = (0..master.len()).map(|_| None).collect();
        let resident = vec![false; master.len()];
        let worker = CommWorker::new(opts.device, groups.shard, groups.replicate);
        let split_head = head_split(&plan, &opts, rank, world);
        let split_embedding = embedding_split(&plan, &opts, rank, world);
        let shard_group = worker.shard_group();
        Ok(Self {
            layout,
            plan,
            opts,
            rank,
            world,
            replica,
            replicas,
            master_device,
            worker,
            master,
            grads,
            full,
            resident,
            inflight: Vec::new(),
            pending_reductions: VecDeque::new(),
            dirty: false,
            prev: None,
            last: None,
            next_of: HashMap::new(),
            stats: CommStats::default(),
            peak_gathered: 0,
            peak_transient: 0,
            split_head,
            split_embedding,
            shard_group,
        })
    }

    /// Whether the head splits its output matrix by vocabulary rows over the shard group instead of gathering it
    /// ([`ParamStore::gather_split_head`]; `crate::row_split` says when).
    pub fn splits_head(&self) -> bool {
        self.split_head.is_some()
    }

    /// Whether the embedding splits its matrix by vocabulary rows ([`ParamStore::gather_split_embedding`]).
    pub fn splits_embedding(&self) -> bool {
        self.split_embedding.is_some()
    }

    /// The flat units the model is sharded into.
    pub fn plan(&self) -> &UnitPlan {
        &self.plan
    }

    /// The options the store runs with.
    pub fn options(&self) -> &FsdpOptions {
        &self.opts
    }

    /// This rank and the size of the group the units are sliced over: the shard group under HSDP, else all ranks.
    pub fn rank_and_world(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    /// This rank's replica index (its shard group under HSDP, else 0) and the number of replicas (1 without HSDP).
    pub fn replica_rank_and_count(&self) -> (usize, usize) {
        (self.replica, self.replicas)
    }

    /// Communication counters since the store was built.
    pub fn comm_stats(&self) -> CommStats {
        self.stats
    }

    /// Bytes this rank's store holds now, with the peaks since [`Self::reset_peak`]. AdamW's moments live in the
    /// optimizer: `2 * master_bytes` of the trainable units (see [`Self::trainable_masters`]).
    pub fn memory_stats(&self) -> MemoryStats {
        let bytes = |ts: &[Tensor]| ts.iter().map(|t| t.numel() as i64 * 4).sum::<i64>();
        let (gathered, inflight, reducing) = self.transient_bytes();
        MemoryStats {
            master_bytes: bytes(&self.master),
            grad_bytes: bytes(&self.grads),
            gathered_bytes: gathered,
            inflight_gather_bytes: inflight,
            reducing_bytes: reducing,
            peak_gathered_bytes: self.peak_gathered.max(gathered + inflight),
            peak_transient_bytes: self.peak_transient.max(gathered + inflight + reducing),
        }
    }

    /// Starts the peaks of [`Self::memory_stats`] again from what is held now.
    pub fn reset_peak(&mut self) {
        self.peak_gathered = 0;
        self.peak_transient = 0;
        self.note_peak();
    }

    /// (gathered, all-gathers in flight, reductions not yet applied), in bytes.
    fn transient_bytes(&self) -> (i64, i64, i64) {
        let gathered = if self.sharded() {
            self.full.iter().flatten().map(storage_nbytes).sum()
        } else {
            0 // NO_SHARD's full buffers are the masters (or cast copies of them), counted as masters
        };
        let padded =
            |u: usize, kind: Kind| self.plan.units[u].padded(self.world) * elem_bytes(kind);
        let inflight = self
            .inflight
            .iter()
            .map(|(u, _)| padded(*u, self.opts.compute_kind))
            .sum();
        let reducing = self
            .pending_reductions
            .iter()
            .map(|(u, _)| padded(*u, self.opts.reduce_kind))
            .sum();
        (gathered, inflight, reducing)
    }

    fn note_peak(&mut self) {
        let (g, i, r) = self.transient_bytes();
        self.peak_gathered = self.peak_gathered.max(g + i);
        self.peak_transient = self.peak_transient.max(g + i + r);
    }

    /// Where unit `u`'s local master starts inside its padded flat buffer, and how long it is.
    pub fn local_range(&self, u: usize) -> (i64, i64) {
        local_range(
            self.opts.strategy,
            self.plan.units[u].shard_len(self.world),
            self.rank,
            self.world,
        )
    }

    /// The local fp32 masters, one per unit (invariant 1).
    pub fn local_masters(&self) -> &[Tensor] {
        &self.master
    }

    /// The local fp32 masters of the units that train (the optimizer's tensors; a prefix of [`Self::local_masters`]).
    pub fn trainable_masters(&self) -> &[Tensor] {
        &self.master[..self.plan.trainable_units()]
    }

    /// Sums `values` over all ranks, every replica included (through the store's communication thread, in order
    /// with its other collectives).
    pub fn all_reduce_sum(&mut self, values: &[f64]) -> Result<Vec<f64>> {
        if self.world * self.replicas == 1 {
            return Ok(values.to_vec());
        }
        let t = Tensor::from_slice(values).to_device(self.opts.device);
        let out = self
            .worker
            .all_reduce(t)
            .wait()
            .context("summing scalars over ranks")?;
        Ok(Vec::<f64>::try_from(&out.to_device(Device::Cpu))?)
    }

    /// Full parameters of all ranks, assembled (fp32, CPU, layout order): an all-gather of every unit.
    pub fn full_params(&mut self) -> Result<Vec<Tensor>> {
        let flats = self.gather_units(self.master.len())?;
        Ok(self.plan.unflatten(&flats, self.layout.tensors.len()))
    }

    /// The full trainable tensors (fp32, CPU, in layout order), e.g. LoRA's adapters: an all-gather of the
    /// trainable units only.
    pub fn full_trainable_params(&mut self) -> Result<Vec<Tensor>> {
        let flats = self.gather_units(self.plan.trainable_units())?;
        let mut named: Vec<(usize, Tensor)> = Vec::new();
        for (unit, flat) in self.plan.units.iter().zip(&flats) {
            for (i, e) in unit.entries.iter().enumerate() {
                named.push((e.layout_index, unit.view(flat, i).copy()));
            }
        }
        named.sort_by_key(|(i, _)| *i);
        Ok(named.into_iter().map(|(_, t)| t).collect())
    }

    /// The full flat buffers of units `0..count` (fp32, CPU), gathered from every rank.
    fn gather_units(&mut self, count: usize) -> Result<Vec<Tensor>> {
        self.finish_grads()?;
        let mut flats = Vec::with_capacity(count);
        for u in 0..count {
            let flat = match self.opts.strategy {
                ShardingStrategy::NoShard => self.master[u].copy(),
                _ => self
                    .worker
                    .all_gather(self.master[u].to_device(self.opts.device).copy())
                    .wait()
                    .with_context(|| format!("gathering unit `{}`", self.plan.units[u].name))?,
            };
            flats.push(flat.to_device(Device::Cpu).to_kind(Kind::Float));
        }
        Ok(flats)
    }

    fn sharded(&self) -> bool {
        self.opts.strategy != ShardingStrategy::NoShard
    }

    /// Records that `stage` follows the previous gathers and returns the stage predicted to come next.
    fn observe(&mut self, stage: Stage) -> Option<Stage> {
        if let Some(last) = self.last {
            self.next_of.insert((self.prev, last), stage);
        }
        self.prev = self.last;
        self.last = Some(stage);
        self.predicted()
    }

    fn predicted(&self) -> Option<Stage> {
        self.last
            .and_then(|l| self.next_of.get(&(self.prev, l)).copied())
    }

    /// Submits the all-gather of unit `u` unless it is cached or in flight.
    fn start_gather(&mut self, u: usize) {
        if self.resident[u] || self.inflight.iter().any(|(i, _)| *i == u) {
            return;
        }
        let shard = self.master[u]
            .to_device(self.opts.device)
            .to_kind(self.opts.compute_kind)
            .copy();
        self.stats.all_gathers += 1;
        let p = self.worker.all_gather(shard);
        self.inflight.push((u, p));
        self.note_peak();
    }

    /// Makes `full[u]` resident: the master itself or a cast copy (NO_SHARD), or the finished all-gather — moved
    /// into the storage of the unit's freed buffer when it has one (invariant 3), so kept graphs see it.
    fn materialise(&mut self, u: usize) -> Result<()> {
        if self.resident[u] {
            return Ok(());
        }
        let t = if self.sharded() {
            let pos = self
                .inflight
                .iter()
                .position(|(i, _)| *i == u)
                .context("an all-gather was started for every unit of the stage")?;
            let (_, p) = self.inflight.remove(pos);
            let started = Instant::now();
            let t = p
                .wait()
                .with_context(|| format!("all-gather of unit `{}`", self.plan.units[u].name))?;
            self.stats.gather_wait += started.elapsed();
            t
        } else if self.opts.compute_kind == Kind::Float && self.master_device == self.opts.device {
            self.master[u].shallow_clone()
        } else {
            self.master[u]
                .to_device(self.opts.device)
                .to_kind(self.opts.compute_kind)
        };
        match &self.full[u] {
            Some(freed) if self.sharded() => {
                refill_storage(freed, t)
                    .with_context(|| format!("unit `{}`", self.plan.units[u].name))?;
            }
            _ => self.full[u] = Some(t),
        }
        self.resident[u] = true;
        self.note_peak();
        Ok(())
    }

    /// Frees the bytes of unit `u`'s gathered buffer, keeping its handle for the next gather (invariant 3).
    fn free_gathered(&mut self, u: usize) {
        if !self.resident[u] {
            return;
        }
        self.resident[u] = false;
        if let Some(t) = &self.full[u] {
            if let Err(e) = free_storage(t) {
                tracing::warn!(unit = %self.plan.units[u].name, "dropping a gathered buffer: {e:#}");
                self.full[u] = None;
            }
        }
    }

    fn prefetch(&mut self, next: Stage, current: Stage) {
        if !self.sharded() || !self.opts.prefetch || next == current {
            return;
        }
        let wanted = self.gathered_units(next);
        let current = &self.plan.stage_units[&current];
        // An unclaimed prefetch for another stage would only hold memory: let it finish unobserved.
        self.inflight
            .retain(|(u, _)| wanted.contains(u) || current.contains(u));
        for u in wanted {
            self.start_gather(u);
        }
    }

    /// Adds a finished reduction of unit `u` into its gradient.
    fn apply_reduction(&mut self, u: usize, p: Pending) -> Result<()> {
        self.take_reduced(u, p, "reduce-scatter", true)
    }

    /// Waits for the reduction `p` (`what`) of unit `u`'s gradient and adds it into the gradient (`add`) or makes it
    /// the gradient.
    fn take_reduced(&mut self, u: usize, p: Pending, what: &str, add: bool) -> Result<()> {
        let name = &self.plan.units[u].name;
        let t = p
            .wait()
            .with_context(|| format!("{what} of unit `{name}`'s gradient"))?;
        let _g = tch::no_grad_guard();
        if add {
            let _ = self.grads[u].g_add_(&t.to_device(self.master_device).to_kind(Kind::Float));
        } else {
            self.grads[u].copy_(&t); // converts device and dtype itself
        }
        Ok(())
    }

    /// Waits for every gradient reduction in flight and all-reduces the accumulated gradients where the step's sum
    /// needs it: NO_SHARD's whole buffers over all ranks, HSDP's shards over the replica group (once per step, not
    /// per micro-batch: invariant 2). Drops gathered copies and prefetches. Idempotent; `grad_sq_norm` calls it.
    pub fn finish_grads(&mut self) -> Result<()> {
        while let Some((u, p)) = self.pending_reductions.pop_front() {
            self.apply_reduction(u, p)?;
        }
        if self.dirty {
            if !self.sharded() && self.world > 1 {
                self.all_reduce_grads(false)?;
            } else if self.sharded() && self.replicas > 1 {
                self.all_reduce_grads(true)?;
            }
        }
        self.dirty = false;
        self.drop_gathered();
        Ok(())
    }

    /// Sums every trainable unit's gradient over all ranks (NO_SHARD) or, with `replicas_only`, over the replica
    /// group (HSDP's shards), in the reduce dtype, a few units in flight at a time.
    fn all_reduce_grads(&mut self, replicas_only: bool) -> Result<()> {
        let mut pending: VecDeque<(usize, Pending)> = VecDeque::new();
        for u in 0..self.plan.trainable_units() {
            if pending.len() == MAX_PENDING_REDUCTIONS {
                let (v, p) = pending.pop_front().expect("a full window");
                self.take_reduced(v, p, "all-reduce", false)?;
            }
            let g = self.grads[u]
                .to_device(self.opts.device)
                .to_kind(self.opts.reduce_kind)
                .copy();
            let p = if replicas_only {
                self.stats.replica_all_reduces += 1;
                self.worker.all_reduce_replicas(g)
            } else {
                self.stats.reductions += 1;
                self.worker.all_reduce(g)
            };
            pending.push_back((u, p));
        }
        while let Some((v, p)) = pending.pop_front() {
            self.take_reduced(v, p, "all-reduce", false)?;
        }
        Ok(())
    }

    fn drop_gathered(&mut self) {
        self.inflight.clear();
        for f in &mut self.full {
            *f = None;
        }
        self.resident.fill(false);
    }

    /// Gathers every unit of `stage` into `full` (prefetching the predicted next stage) and returns its units.
    fn gather_stage(&mut self, stage: Stage) -> Result<Vec<usize>> {
        let units = self
            .plan
            .stage_units
            .get(&stage)
            .with_context(|| format!("stage {stage:?} is not part of the model layout"))?
            .clone();
        self.gather_stage_units(stage, units)
    }

    /// Gathers `units` of `stage` into `full`, prefetching the predicted next stage; returns them.
    fn gather_stage_units(&mut self, stage: Stage, units: Vec<usize>) -> Result<Vec<usize>> {
        let next = self.observe(stage);
        if self.sharded() {
            for &u in &units {
                if self.inflight.iter().any(|(i, _)| *i == u) {
                    self.stats.prefetch_hits += 1;
                }
                self.start_gather(u);
            }
        }
        if let Some(next) = next {
            self.prefetch(next, stage);
        }
        for &u in &units {
            self.materialise(u)?;
        }
        Ok(units)
    }

    /// Reduce-scatters (NO_SHARD: adds) the gradients of `stage`'s units but `skip`.
    fn reduce_stage_grads(
        &mut self,
        stage: Stage,
        grads: &[Tensor],
        skip: Option<usize>,
    ) -> Result<()> {
        let refs = self.plan.stage_refs[&stage].clone();
        if grads.len() != refs.len() {
            bail!(
                "stage {stage:?}: {} gradients for {} parameters",
                grads.len(),
                refs.len()
            );
        }
        self.dirty = true;
        for u in self.plan.stage_units[&stage].clone() {
            let unit = &self.plan.units[u];
            if unit.frozen || skip == Some(u) {
                continue;
            }
            let mut parts: Vec<Option<&Tensor>> = vec![None; unit.entries.len()];
            for (k, &(ru, e)) in refs.iter().enumerate() {
                if ru == u {
                    parts[e] = Some(&grads[k]);
                }
            }
            if self.sharded() {
                let flat =
                    unit.flatten_grads(&parts, self.world, self.opts.reduce_kind, self.opts.device);
                self.stats.reductions += 1;
                let p = self.worker.reduce_scatter(flat);
                self.pending_reductions.push_back((u, p));
                self.note_peak();
            } else {
                let flat = unit.flatten_grads(&parts, self.world, Kind::Float, self.master_device);
                let _g = tch::no_grad_guard();
                let _ = self.grads[u].g_add_(&flat);
            }
        }
        while self.pending_reductions.len() > MAX_PENDING_REDUCTIONS {
            let (u, p) = self.pending_reductions.pop_front().expect("non-empty");
            self.apply_reduction(u, p)?;
        }
        Ok(())
    }
}

/// Bytes per element of `kind` (the dtypes the store gathers and reduces in).
fn elem_bytes(kind: Kind) -> i64 {
    match kind {
        Kind::Double | Kind::Int64 => 8,
        Kind::Half | Kind::BFloat16 => 2,
        _ => 4,
    }
}

/// Where a rank's local master lies inside a unit's padded flat buffer: its shard, or everything for NO_SHARD.
pub fn local_range(
    strategy: ShardingStrategy,
    shard: i64,
    rank: usize,
    world: usize,
) -> (i64, i64) {
    match strategy {
        ShardingStrategy::NoShard => (0, shard * world as i64),
        _ => (shard * rank as i64, shard),
    }
}

impl ParamStore for ShardedParams {
    fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    fn all_reduce_sum(&mut self, values: &[f64]) -> Result<Vec<f64>> {
        ShardedParams::all_reduce_sum(self, values)
    }

    fn gather(&mut self, stage: Stage) -> Result<StageParams> {
        self.gather_stage(stage)?;
        let refs = &self.plan.stage_refs[&stage];
        let tensors = refs
            .iter()
            .map(|&(u, e)| {
                let flat = self.full[u].as_ref().expect("materialised above");
                let unit = &self.plan.units[u];
                unit.view(flat, e).detach().set_requires_grad(!unit.frozen)
            })
            .collect();
        Ok(StageParams { tensors })
    }

    fn accumulate_grads(&mut self, stage: Stage, grads: &[Tensor]) -> Result<()> {
        self.reduce_stage_grads(stage, grads, None)
    }

    fn gather_split_head(&mut self) -> Result<Option<SplitHead>> {
        self.split_head_params()
    }

    fn accumulate_split_head_grads(&mut self, norm: Tensor, rows: Tensor) -> Result<()> {
        self.add_split_head_grads(norm, rows)
    }

    fn gather_split_embedding(&mut self) -> Result<Option<VocabSlice>> {
        self.split_embedding_params()
    }

    fn accumulate_split_embedding_grad(&mut self, rows: Tensor, grads: Tensor) -> Result<()> {
        self.add_split_embedding_grad(rows, grads)
    }

    fn release(&mut self, stage: Stage) {
        if self.opts.strategy != ShardingStrategy::FullShard {
            return; // SHARD_GRAD_OP keeps gathered parameters until the step's backward ends; NO_SHARD holds views.
        }
        let keep: Vec<usize> = self
            .predicted()
            .map(|n| self.plan.stage_units[&n].clone())
            .unwrap_or_default();
        for u in self.plan.stage_units[&stage].clone() {
            if !keep.contains(&u) {
                self.free_gathered(u);
            }
        }
    }

    /// Gathers `stage` again into the buffers its kept graph refers to (invariant 3); NO_SHARD and SHARD_GRAD_OP never
    /// freed them, so this only keeps the prefetch prediction in step.
    fn regather(&mut self, stage: Stage) -> Result<()> {
        self.gather_stage(stage).map(drop)
    }

    /// Finishes pending reductions first (see [`ShardedParams::finish_grads`]); panics if a collective fails there,
    /// which cannot happen when `grad_sq_norm` ran first, as `Stepper::step` does.
    fn master_and_grads(&mut self) -> (&mut [Tensor], &mut [Tensor]) {
        if let Err(e) = self.finish_grads() {
            panic!("ShardedParams: finishing gradient reductions before the optimizer step failed: {e:#}");
        }
        let trainable = self.plan.trainable_units();
        (&mut self.master[..trainable], &mut self.grads[..trainable])
    }

    fn grad_sq_norm(&mut self) -> Result<f64> {
        self.finish_grads()?;
        let _g = tch::no_grad_guard();
        let local: f64 = self.grads.iter().map(sum_of_squares).sum();
        if self.sharded() && self.world > 1 {
            // Replicas hold equal shards: the shard group's sum is the whole gradient's.
            let t = Tensor::from_slice(&[local]).to_device(self.opts.device);
            let out = self
                .worker
                .all_reduce_shard_group(t)
                .wait()
                .context("summing the gradient norm over the shard group")?;
            Ok(Vec::<f64>::try_from(&out.to_device(Device::Cpu))?[0])
        } else {
            Ok(local)
        }
    }

    fn zero_grads(&mut self) {
        while let Some((u, p)) = self.pending_reductions.pop_front() {
            if let Err(e) = p.wait() {
                tracing::warn!(unit = %self.plan.units[u].name, "discarding a failed gradient reduction: {e:#}");
            }
        }
        self.dirty = false;
        let _g = tch::no_grad_guard();
        for g in &mut self.grads {
            let _ = g.zero_();
        }
        // Masters may have changed since the last gather (optimizer step, restore): start from fresh gathers.
        self.drop_gathered();
    }
}
