//! Building a rank's store from where the parameters live, reading only the elements the rank keeps (design note 14:
//! no rank ever holds the whole model, at start or on resume).
//!
//! A [`ParamSource`] hands out element ranges of the model's tensors: the model folder's safetensors files
//! ([`WeightReader`], which reads only those bytes), full tensors already in memory (`&[Tensor]`, in layout order), or files with a
//! few tensors given in memory besides ([`WithTensors`], LoRA's fresh adapters over a base read from files).
//! [`ShardedParams::from_source`] asks each source only for the ranges that overlap the rank's slice of each unit.

use crate::groups::ShardGroups;
use crate::store::{local_range, ShardedParams};
use crate::units::UnitPlan;
use crate::FsdpOptions;
use anyhow::{bail, Context, Result};
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::weights::WeightReader;
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

/// Element ranges of the model's tensors, for building a rank's shard.
pub trait ParamSource {
    /// Elements `[lo, hi)` of layout tensor `index` (named `name`), flattened in row-major order, fp32 on the CPU.
    fn read(&mut self, name: &str, index: usize, lo: i64, hi: i64) -> Result<Tensor>;
}

impl ParamSource for WeightReader {
    fn read(&mut self, name: &str, _index: usize, lo: i64, hi: i64) -> Result<Tensor> {
        self.read_range(name, lo, hi)
    }
}

impl ParamSource for &[Tensor] {
    fn read(&mut self, name: &str, index: usize, lo: i64, hi: i64) -> Result<Tensor> {
        let t = self
            .get(index)
            .with_context(|| format!("tensor `{name}`: no tensor {index} given"))?;
        Ok(t.reshape([-1]).narrow(0, lo, hi - lo).to_kind(Kind::Float))
    }
}

/// A source that takes some tensors from memory (by layout index) and the rest from `files`.
pub struct WithTensors<S> {
    /// Where every tensor not in `given` comes from.
    pub files: S,
    /// Layout index → full tensor.
    pub given: HashMap<usize, Tensor>,
}

impl<S: ParamSource> ParamSource for WithTensors<S> {
    fn read(&mut self, name: &str, index: usize, lo: i64, hi: i64) -> Result<Tensor> {
        match self.given.get(&index) {
            Some(t) => Ok(t.reshape([-1]).narrow(0, lo, hi - lo).to_kind(Kind::Float)),
            None => self.files.read(name, index, lo, hi),
        }
    }
}

/// This rank's local master of every unit of `plan` (its slice of the padded flat buffer; everything for NO_SHARD),
/// asking `source` only for the elements inside it. Padding stays zero.
pub fn local_masters(
    plan: &UnitPlan,
    source: &mut (impl ParamSource + ?Sized),
    opts: &FsdpOptions,
    rank: usize,
    world: usize,
) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(plan.units.len());
    for unit in &plan.units {
        let (start, len) = local_range(opts.strategy, unit.shard_len(world), rank, world);
        let local = Tensor::zeros([len], (Kind::Float, Device::Cpu));
        for e in &unit.entries {
            let lo = start.max(e.offset);
            let hi = (start + len).min(e.offset + e.numel);
            if hi <= lo {
                continue;
            }
            let part = source
                .read(&e.name, e.layout_index, lo - e.offset, hi - e.offset)
                .with_context(|| format!("reading this rank's part of `{}`", e.name))?;
            if part.numel() as i64 != hi - lo {
                bail!(
                    "tensor `{}`: {} elements read for the range [{}, {})",
                    e.name,
                    part.numel(),
                    lo - e.offset,
                    hi - e.offset
                );
            }
            local.narrow(0, lo - start, hi - lo).copy_(&part);
        }
        out.push(local);
    }
    Ok(out)
}

impl ShardedParams {
    /// Shards the model whose tensors `source` holds over `comm`'s group (a communicator, or HSDP's
    /// [`ShardGroups`]: then over the shard group), reading only this rank's part of each unit: with a
    /// [`WeightReader`], a rank never holds more of the model than its shard.
    pub fn from_source(
        layout: ModelLayout,
        source: &mut (impl ParamSource + ?Sized),
        comm: impl Into<ShardGroups>,
        opts: FsdpOptions,
    ) -> Result<Self> {
        let groups = comm.into();
        let plan = UnitPlan::new(&layout);
        let (rank, world) = groups.shard_rank_and_size();
        let locals = local_masters(&plan, source, &opts, rank, world)?;
        Self::from_local_masters(layout, plan, locals, groups, opts)
    }
}
