//! The store's side of the vocabulary matrices split by rows (`crate::row_split`, `ferl_trainer::vocab_parallel`):
//! the head and the embedding take this rank's rows of the matrix from its master shard instead of a gathered copy,
//! and add their gradient into its gradient shard directly.

use super::ShardedParams;
use crate::row_split::SplitLayout;
use anyhow::{Context, Result};
use ferl_trainer::model::layout::Stage;
use ferl_trainer::params::SplitHead;
use ferl_trainer::vocab_parallel::VocabSlice;
use tch::{Kind, Tensor};

impl ShardedParams {
    /// The units a gather of `stage` is predicted to need: all of them, but the head's output matrix where the head
    /// splits it, and the embedding matrix where the embedding splits it.
    pub(super) fn gathered_units(&self, stage: Stage) -> Vec<usize> {
        let mut units = self.plan.stage_units[&stage].clone();
        let split = match stage {
            Stage::Head => self.split_head,
            Stage::Embedding => self.split_embedding,
            Stage::Decoder(_) => None,
        };
        if let Some(split) = split {
            units.retain(|&u| u != split.unit);
        }
        units
    }

    pub(super) fn split_head_params(&mut self) -> Result<Option<SplitHead>> {
        let Some(split) = self.split_head else {
            return Ok(None);
        };
        let units = self.gathered_units(Stage::Head);
        self.gather_stage_units(Stage::Head, units)?;
        let (u, e) = self.plan.stage_refs[&Stage::Head][0];
        let unit = &self.plan.units[u];
        let flat = self.full[u].as_ref().expect("materialised above");
        let norm = unit.view(flat, e).detach().set_requires_grad(!unit.frozen);
        Ok(Some(SplitHead {
            norm,
            out: self.vocab_slice(&split),
        }))
    }

    pub(super) fn add_split_head_grads(&mut self, norm: Tensor, rows: Tensor) -> Result<()> {
        let split = self
            .split_head
            .context("this store does not split the head's output matrix")?;
        self.reduce_stage_grads(Stage::Head, &[norm, Tensor::new()], Some(split.unit))?;
        self.add_split_rows_grad(&split, rows)
    }

    pub(super) fn split_embedding_params(&mut self) -> Result<Option<VocabSlice>> {
        let Some(split) = self.split_embedding else {
            return Ok(None);
        };
        let units = self.gathered_units(Stage::Embedding);
        self.gather_stage_units(Stage::Embedding, units)?;
        Ok(Some(self.vocab_slice(&split)))
    }

    /// Adds the sparse gradient `grads` of the rows `rows` of this rank's slice of the embedding matrix in place into
    /// its gradient shard (under HSDP the replicas' sum follows in `finish_grads`, as for every unit).
    pub(super) fn add_split_embedding_grad(&mut self, rows: Tensor, grads: Tensor) -> Result<()> {
        let split = self
            .split_embedding
            .context("this store does not split the embedding matrix")?;
        self.dirty = true;
        if self.plan.units[split.unit].frozen {
            return Ok(());
        }
        let shape = [split.rows, split.hidden];
        let _g = tch::no_grad_guard();
        let mut dst = self.grads[split.unit]
            .narrow(0, split.local_offset, split.rows * split.hidden)
            .view(shape);
        let (rows, grads) = (
            rows.to_device(self.master_device),
            grads.to_device(self.master_device),
        );
        let _ = dst.index_add_(0, &rows, &grads.to_kind(Kind::Float));
        Ok(())
    }

    /// This rank's rows of the split matrix `split`, in the compute dtype on the compute device.
    fn vocab_slice(&self, split: &SplitLayout) -> VocabSlice {
        let weight = self.master[split.unit]
            .narrow(0, split.local_offset, split.rows * split.hidden)
            .view([split.rows, split.hidden])
            .to_device(self.opts.device)
            .to_kind(self.opts.compute_kind)
            .detach();
        let trains = !self.plan.units[split.unit].frozen;
        // The rows' gradient is the shard group's whole: it goes into the shard as it is (HSDP's replicas sum theirs
        // in `finish_grads`), unless the shard lives on another device (offload).
        let direct = trains && self.master_device == self.opts.device;
        let grad = direct.then(|| {
            self.grads[split.unit]
                .narrow(0, split.local_offset, split.rows * split.hidden)
                .view([split.rows, split.hidden])
        });
        VocabSlice {
            start: split.first_row,
            weight,
            vocab: split.vocab,
            trains,
            grad,
            group: self.shard_group.clone(),
        }
    }

    /// Adds the gradient `rows` of this rank's rows of the split matrix `split` (the shard group's whole gradient of
    /// them) into its gradient shard.
    fn add_split_rows_grad(&mut self, split: &SplitLayout, rows: Tensor) -> Result<()> {
        if !rows.defined() || self.plan.units[split.unit].frozen {
            return Ok(());
        }
        let _g = tch::no_grad_guard();
        let numel = split.rows * split.hidden;
        let mut dst = self.grads[split.unit].narrow(0, split.local_offset, numel);
        let rows = rows.reshape([-1]).to_device(self.master_device);
        let _ = dst.g_add_(&rows.to_kind(Kind::Float));
        Ok(())
    }
}
