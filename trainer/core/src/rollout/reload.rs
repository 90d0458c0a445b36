//! Reloading a [`RolloutModel`]'s weights in place: a weight sync writes the new values into the tensors the model
//! already holds (cast to its dtype), so no new memory is allocated and every page written is already resident.

use super::RolloutModel;
use crate::model::layout::{ModelLayout, Stage};
use anyhow::{bail, Result};
use tch::Tensor;

impl RolloutModel {
    /// Overwrites every parameter with `params` (in `layout.tensors` order, as [`RolloutModel::from_params`]
    /// takes them; any dtype and device), casting to the model's dtype. `layout` must be the model's: every
    /// tensor's shape is checked before anything is written.
    pub fn copy_params_from(&mut self, layout: &ModelLayout, params: &[Tensor]) -> Result<()> {
        if params.len() != layout.tensors.len() {
            bail!(
                "{} parameters for a layout of {} tensors",
                params.len(),
                layout.tensors.len()
            );
        }
        let pairs = self.stage_pairs(layout)?;
        for &(stage, slot, index) in &pairs {
            let (have, want) = (self.slot(stage, slot).size(), params[index].size());
            if have != want {
                bail!(
                    "parameter {} is {want:?}; the rollout model's is {have:?}",
                    layout.tensors[index].0
                );
            }
        }
        let _g = tch::no_grad_guard();
        for (stage, slot, index) in pairs {
            let mut dst = self.slot(stage, slot);
            dst.copy_(&params[index]);
        }
        Ok(())
    }

    /// Every (stage, position in the stage, index into `layout.tensors`) of the model.
    fn stage_pairs(&self, layout: &ModelLayout) -> Result<Vec<(Stage, usize, usize)>> {
        let mut stages = vec![Stage::Embedding];
        stages.extend((0..self.layers.len()).map(Stage::Decoder));
        stages.push(Stage::Head);
        let mut pairs = Vec::new();
        for stage in stages {
            let ids = layout.stage_ids(stage)?;
            let held = self.stage_len(stage);
            if ids.len() != held {
                bail!(
                    "the layout's stage {stage:?} has {} tensors; the rollout model's {held}",
                    ids.len()
                );
            }
            pairs.extend(ids.iter().enumerate().map(|(slot, &i)| (stage, slot, i)));
        }
        Ok(pairs)
    }

    /// Tensors the model holds for `stage`.
    fn stage_len(&self, stage: Stage) -> usize {
        match stage {
            Stage::Embedding => 1,
            Stage::Decoder(l) => self.layers[l].len(),
            Stage::Head => 2,
        }
    }

    /// The tensor at position `slot` of `stage` (a shallow handle on the model's own storage).
    fn slot(&self, stage: Stage, slot: usize) -> Tensor {
        match (stage, slot) {
            (Stage::Embedding, _) => self.embed.shallow_clone(),
            (Stage::Decoder(l), j) => self.layers[l][j].shallow_clone(),
            (Stage::Head, 0) => self.norm.shallow_clone(),
            (Stage::Head, _) => self.lm_head.shallow_clone(),
        }
    }
}
