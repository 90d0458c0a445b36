//! The order of global batches over a run: which samples step `n` trains on, and where a resumed run continues.
//!
//! Invariants (tests name them):
//! 1. The sequence of global batches depends only on (dataset length, `data.train_batch_size`, `trainer.seed`,
//!    `data.shuffle`), never on the number of ranks: ranks only change how each batch is split.
//! 2. After the last whole batch of an epoch the position moves to step 0 of the next epoch, so a checkpoint taken
//!    at an epoch boundary resumes at the next epoch (verl #7401 resumed into nothing).

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::batch::{epoch_order, global_batch, steps_per_epoch};

/// Where a run is in its data: the next global batch is step `step_in_epoch` of `epoch`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DataPosition {
    /// Epoch, from 0.
    pub epoch: u64,
    /// Global batch within the epoch, from 0.
    pub step_in_epoch: u64,
}

/// The seeded order of global batches, epoch after epoch, with a movable position.
#[derive(Clone, Debug)]
pub struct DataPlan {
    len: usize,
    batch: usize,
    seed: u64,
    shuffle: bool,
    position: DataPosition,
    order: Option<(u64, Vec<usize>)>,
}

impl DataPlan {
    /// A plan over `len` samples in global batches of `batch`, shuffled per epoch with `seed` when `shuffle`.
    pub fn new(len: usize, batch: usize, seed: u64, shuffle: bool) -> Result<Self> {
        if steps_per_epoch(len, batch) == 0 {
            bail!(
                "data.train_batch_size={batch} is larger than the training set ({len} samples): no whole batch"
            );
        }
        Ok(Self {
            len,
            batch,
            seed,
            shuffle,
            position: DataPosition::default(),
            order: None,
        })
    }

    /// Steps per epoch.
    pub fn steps_per_epoch(&self) -> u64 {
        steps_per_epoch(self.len, self.batch) as u64
    }

    /// The position of the next batch.
    pub fn position(&self) -> DataPosition {
        self.position
    }

    /// Moves to `position` (resume); a step past the epoch's end moves to the next epoch.
    pub fn set_position(&mut self, position: DataPosition) {
        self.position = position;
        if self.position.step_in_epoch >= self.steps_per_epoch() {
            self.position = DataPosition {
                epoch: position.epoch + 1,
                step_in_epoch: 0,
            };
        }
    }

    /// The sample indices of the next global batch; advances.
    pub fn next_batch(&mut self) -> Vec<usize> {
        let at = self.position;
        if self.order.as_ref().map(|(e, _)| *e) != Some(at.epoch) {
            let order = epoch_order(self.len, self.seed, at.epoch, self.shuffle);
            self.order = Some((at.epoch, order));
        }
        let order = &self.order.as_ref().expect("order of the current epoch").1;
        let indices = global_batch(order, self.batch, at.step_in_epoch as usize).to_vec();
        self.set_position(DataPosition {
            epoch: at.epoch,
            step_in_epoch: at.step_in_epoch + 1,
        });
        indices
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invariant_2_epoch_boundary_moves_to_next_epoch() {
        let mut plan = DataPlan::new(10, 4, 1, true).unwrap();
        assert_eq!(plan.steps_per_epoch(), 2);
        let a = plan.next_batch();
        let b = plan.next_batch();
        assert_eq!(
            plan.position(),
            DataPosition {
                epoch: 1,
                step_in_epoch: 0
            }
        );
        let mut all: Vec<usize> = a.iter().chain(&b).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(
            all.len(),
            8,
            "two batches of one epoch never repeat a sample"
        );
        plan.set_position(DataPosition {
            epoch: 3,
            step_in_epoch: 2,
        });
        assert_eq!(
            plan.position(),
            DataPosition {
                epoch: 4,
                step_in_epoch: 0
            }
        );
    }

    #[test]
    fn invariant_1_resumed_plan_continues_the_same_sequence() {
        let mut full = DataPlan::new(12, 4, 7, true).unwrap();
        let seq: Vec<Vec<usize>> = (0..5).map(|_| full.next_batch()).collect();
        let mut resumed = DataPlan::new(12, 4, 7, true).unwrap();
        resumed.set_position(DataPosition {
            epoch: 1,
            step_in_epoch: 0,
        });
        assert_eq!(resumed.next_batch(), seq[3]);
        assert_eq!(resumed.next_batch(), seq[4]);
    }

    #[test]
    fn too_few_samples_for_one_batch_is_refused() {
        let err = DataPlan::new(3, 4, 0, false).unwrap_err().to_string();
        assert!(err.contains("data.train_batch_size=4"), "{err}");
    }
}
