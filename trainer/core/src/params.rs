//! Where the engine gets each stage's parameters and sends their gradients: the [`ParamStore`] trait.
//!
//! The engine never touches parameter storage directly. For every stage it asks [`ParamStore::gather`] for the full
//! tensors to compute with, hands the gradients of those tensors back through [`ParamStore::accumulate_grads`], and
//! calls [`ParamStore::release`] when the stage is done. [`LocalParams`] keeps everything in one process (gather is a
//! free view of the fp32 master, or a cast copy in bf16); a sharded store implements the same three calls with an
//! all-gather, a reduce-scatter and a free — that is the whole FSDP hook.

use crate::model::layout::{ModelLayout, Stage};
use crate::vocab_parallel::VocabSlice;
use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// The parameters of one stage, ready to compute with: `tensors` require grad so a backward can reach them.
pub struct StageParams {
    /// Full tensors in the stage's order (see `model::layout`).
    pub tensors: Vec<Tensor>,
}

/// The head's parameters when a store splits its output matrix by vocabulary rows
/// ([`ParamStore::gather_split_head`]).
pub struct SplitHead {
    /// The final norm's weight, a leaf that requires grad unless the layout freezes it.
    pub norm: Tensor,
    /// This rank's rows of the output matrix.
    pub out: VocabSlice,
}

/// Parameter storage behind the layer-wise schedule. Implemented by [`LocalParams`] and by sharded stores.
pub trait ParamStore {
    /// The model's tensor names and the stages using them.
    fn layout(&self) -> &ModelLayout;
    /// Full parameters of `stage` in the compute dtype, as leaves that require grad unless the layout freezes them
    /// (FSDP: all-gather the shards).
    fn gather(&mut self, stage: Stage) -> Result<StageParams>;
    /// Adds `grads` (same order as `gather`; undefined tensors mean zero) into the stored gradients
    /// (FSDP: reduce-scatter into the local shard's gradient). The caller hands the gradients over: a store may
    /// reduce one in place instead of copying it, so they must not be read afterwards.
    fn accumulate_grads(&mut self, stage: Stage, grads: &[Tensor]) -> Result<()>;
    /// Adds the embedding matrix's gradient for the looked-up token `ids` (`[n]`) whose outputs got the gradient
    /// `rows` (`[n, hidden]`, fp32): row `ids[i]` of the gradient gains `rows[i]`. The default builds the dense
    /// `[vocab, hidden]` matrix and hands it to [`ParamStore::accumulate_grads`] (what a sharded store reduce-scatters);
    /// a store holding the whole gradient adds the rows in place instead. A frozen embedding's gradient is undefined.
    fn accumulate_embedding_rows(&mut self, ids: &Tensor, rows: &Tensor) -> Result<()> {
        let layout = self.layout();
        let index = layout.stage_ids(Stage::Embedding)?[0];
        let grad = match layout.trainable[index] {
            true => {
                let shape = layout.tensors[index].1.clone();
                let _g = tch::no_grad_guard();
                Tensor::zeros(shape.as_slice(), (Kind::Float, rows.device()))
                    .index_add_(0, ids, rows)
            }
            false => Tensor::new(),
        };
        self.accumulate_grads(Stage::Embedding, &[grad])
    }
    /// The stage's full parameters are no longer needed (FSDP FULL_SHARD: free the gathered copy's bytes, even where
    /// an autograd graph still refers to them). The tensors `gather` handed out for the stage must not be read again
    /// until the stage is gathered or [`ParamStore::regather`]ed. Default: nothing to do.
    fn release(&mut self, _stage: Stage) {}
    /// Makes the parameters handed out by the last `gather` of `stage` valid again, for the backward of an autograd
    /// graph the forward kept (no gradient checkpointing) after `release` (FSDP FULL_SHARD: all-gather into the buffer
    /// `release` freed, so the kept graph sees its parameters again). Default: nothing to do.
    fn regather(&mut self, _stage: Stage) -> Result<()> {
        Ok(())
    }
    /// The head with its output matrix split by vocabulary rows over the ranks that shard it
    /// ([`crate::vocab_parallel`]), in place of [`ParamStore::gather`] of [`Stage::Head`]: `None` (the default) when
    /// this store does not split it (then `gather` it whole). Every rank of the group must ask at the same point.
    /// `release(Stage::Head)` ends its use.
    fn gather_split_head(&mut self) -> Result<Option<SplitHead>> {
        Ok(None)
    }
    /// Adds the gradients of a split head: the final norm's (as [`ParamStore::accumulate_grads`] does) and that of
    /// this rank's rows of the output matrix (`[rows, hidden]`, already the sum over the group's rows; undefined when
    /// frozen).
    fn accumulate_split_head_grads(&mut self, _norm: Tensor, _rows: Tensor) -> Result<()> {
        bail!("this parameter store does not split the head's output matrix")
    }
    /// The embedding matrix split by vocabulary rows over the ranks that shard it ([`crate::vocab_parallel::embed`]),
    /// in place of [`ParamStore::gather`] of [`Stage::Embedding`]: `None` (the default) when this store does not
    /// split it. Every rank of the group must ask at the same point; `release(Stage::Embedding)` ends its use.
    fn gather_split_embedding(&mut self) -> Result<Option<VocabSlice>> {
        Ok(None)
    }
    /// Adds the gradient of this rank's rows of a split embedding matrix, sparse
    /// ([`crate::vocab_parallel::embedding_grad`]: rows counted from the slice's first, `[m]`, and their gradients,
    /// `[m, hidden]`, the group's tokens' all included).
    fn accumulate_split_embedding_grad(&mut self, _rows: Tensor, _grads: Tensor) -> Result<()> {
        bail!("this parameter store does not split the embedding matrix")
    }
    /// The locally held master tensors and their gradients, for the optimizer (FSDP: the shards).
    fn master_and_grads(&mut self) -> (&mut [Tensor], &mut [Tensor]);
    /// Squared L2 norm of all gradients of the model (FSDP: sum of local squares all-reduced across ranks).
    fn grad_sq_norm(&mut self) -> Result<f64>;
    /// Sets every stored gradient to zero.
    fn zero_grads(&mut self);
    /// Sums `values` over every rank the store spans, in order with its other collectives (one rank: the values).
    fn all_reduce_sum(&mut self, values: &[f64]) -> Result<Vec<f64>> {
        Ok(values.to_vec())
    }
}

/// Every parameter of the model in this process: fp32 masters, fp32 gradients, computed in `compute_kind`.
pub struct LocalParams {
    layout: ModelLayout,
    master: Vec<Tensor>,
    grads: Vec<Tensor>,
    compute_kind: Kind,
}

impl LocalParams {
    /// Wraps fp32 masters (in `layout.tensors` order); computation happens in `compute_kind`.
    pub fn new(layout: ModelLayout, master: Vec<Tensor>, compute_kind: Kind) -> Self {
        // A frozen tensor (LoRA's base) never gets a gradient: an empty tensor stands in.
        let grads = master
            .iter()
            .zip(&layout.trainable)
            .map(|(m, &trains)| match trains {
                true => m.zeros_like(),
                false => Tensor::zeros([0], (Kind::Float, m.device())),
            })
            .collect();
        Self {
            layout,
            master,
            grads,
            compute_kind,
        }
    }

    /// The fp32 master tensors in layout order.
    pub fn master(&self) -> &[Tensor] {
        &self.master
    }

    /// Replaces the master tensors (checkpoint restore); shapes must match.
    pub fn set_master(&mut self, values: &[Tensor]) {
        let _g = tch::no_grad_guard();
        for (m, v) in self.master.iter_mut().zip(values) {
            m.copy_(v);
        }
    }

    /// The model's tensor layout.
    pub fn layout_ref(&self) -> &ModelLayout {
        &self.layout
    }

    /// The dtype stages compute in.
    pub fn compute_kind(&self) -> Kind {
        self.compute_kind
    }
}

fn stage_ids(layout: &ModelLayout, stage: Stage) -> &[usize] {
    layout.stage_ids(stage).expect("stage of this layout")
}

impl ParamStore for LocalParams {
    fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    fn gather(&mut self, stage: Stage) -> Result<StageParams> {
        let ids = stage_ids(&self.layout, stage);
        let tensors = ids
            .iter()
            .map(|&i| {
                let t = if self.compute_kind == Kind::Float {
                    self.master[i].detach()
                } else {
                    self.master[i].to_kind(self.compute_kind).detach()
                };
                t.set_requires_grad(self.layout.trainable[i])
            })
            .collect();
        Ok(StageParams { tensors })
    }

    fn accumulate_grads(&mut self, stage: Stage, grads: &[Tensor]) -> Result<()> {
        let _g = tch::no_grad_guard();
        let ids = stage_ids(&self.layout, stage).to_vec();
        for (&i, g) in ids.iter().zip(grads) {
            if g.defined() && self.layout.trainable[i] {
                let _ = self.grads[i].g_add_(&g.to_kind(Kind::Float));
            }
        }
        Ok(())
    }

    /// In place: the rows are added to the stored gradient directly, with no dense `[vocab, hidden]` temporary (a
    /// fixed cost of every micro-batch otherwise: 78 MB written, read and added at Qwen's vocabulary and hidden 128).
    fn accumulate_embedding_rows(&mut self, ids: &Tensor, rows: &Tensor) -> Result<()> {
        let index = self.layout.stage_ids(Stage::Embedding)?[0];
        if self.layout.trainable[index] {
            let _g = tch::no_grad_guard();
            let _ = self.grads[index].index_add_(0, ids, rows);
        }
        Ok(())
    }

    /// The trainable tensors only: everything, or LoRA's adapters, which the layout appends after the frozen base.
    fn master_and_grads(&mut self) -> (&mut [Tensor], &mut [Tensor]) {
        let t = &self.layout.trainable;
        let first = t.iter().position(|&x| x).unwrap_or(t.len());
        assert!(
            t[first..].iter().all(|&x| x),
            "LocalParams: trainable tensors must follow the frozen ones"
        );
        (&mut self.master[first..], &mut self.grads[first..])
    }

    fn grad_sq_norm(&mut self) -> Result<f64> {
        let _g = tch::no_grad_guard();
        Ok(self.grads.iter().map(crate::optim::sum_of_squares).sum())
    }

    fn zero_grads(&mut self) {
        let _g = tch::no_grad_guard();
        for g in &mut self.grads {
            let _ = g.zero_();
        }
    }
}
