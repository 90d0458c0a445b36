//! The train step: the layer-wise schedule that runs forward and backward one stage at a time.
//!
//! # Schedule (design note 8)
//! For each micro-batch:
//! 1. **Forward**, stage by stage: `gather` the stage's parameters from the [`ParamStore`], run the stage function of
//!    `model::layers`, `release`. With gradient checkpointing only each decoder layer's *input* is kept; without it the
//!    layer's autograd graph is kept instead.
//! 2. **Head**: the final hidden rows whose next token is a target are gathered first, normalised, then projected to
//!    the vocabulary in chunks of rows; the loss is a function of each target's log-probability (and entropy), a
//!    [`TokenLoss`] (design note 13: SFT's cross-entropy divided by the target count of the *global* batch, or an RL
//!    actor loss), and its gradient is back-propagated chunk by chunk, so neither `[tokens, vocab]` logits nor their
//!    gradient ever exist whole. Where the store splits the output matrix by vocabulary rows
//!    ([`ParamStore::gather_split_head`]), every rank of the shard group computes the group's rows against its rows of
//!    the matrix ([`crate::vocab_parallel`]); otherwise, under sequence parallelism, the group's target rows are dealt
//!    out evenly over its ranks ([`crate::head_share`]).
//! 3. **Backward**, stage by stage in reverse: `gather` again and recompute the layer from its saved input with grad
//!    enabled (checkpointing), or `regather` and reuse the kept graph (without checkpointing: a FULL_SHARD store freed
//!    the graph's parameter bytes at `release` after forward and fills them again here), take the vector-Jacobian
//!    product with the upstream gradient via `Tensor::run_backward`, `accumulate_grads` for the parameters, pass the
//!    input gradient down, `release`.
//! 4. **Embedding**: its gradient needs no weights: the output's gradient rows are summed into the rows of the ids,
//!    through the split matrix where the store splits it ([`ParamStore::gather_split_embedding`], as in forward), else
//!    into a `[vocab, hidden]` gradient reduced like any other.
//!
//! # Hook point for kernels
//! Every RMSNorm, the MLP activation and the head's projection + cross-entropy go through the engine's
//! [`KernelRegistry`] ([`Engine::set_kernels`], `model.use_liger=true`): a replaced op runs its kernel's forward and
//! backward, and a layer with replaced ops is run split at them (`model::graph`), with or without checkpointing.
//!
//! # Hook point for sharding
//! Everything about where parameters live is behind [`ParamStore`]: `gather` (all-gather), `regather` (all-gather into
//! a freed buffer a kept graph refers to), `accumulate_grads` (reduce-scatter), `release` (free), `grad_sq_norm`
//! (all-reduce); `gather_split_embedding` and `gather_split_head` hand out this rank's rows of a vocabulary matrix
//! split over its group instead of the whole. The engine is generic over it and needs no change.
//!
//! # Invariants
//! 1. The loss of a global batch is `sum of per-target CE / number of targets in the whole global batch`; the count is
//!    passed in before the micro-batch loop, so gradients do not depend on how the batch is split.
//! 2. Gradients of a tied output matrix from the head are accumulated into the embedding's gradient.

use crate::batch::{Layout, MicroBatch};
use crate::head::{ChunkedHead, TokenStats};
use crate::head_share::{self, HeadShare};
use crate::kernels::KernelRegistry;
use crate::loss::{CrossEntropy, TokenLoss};
use crate::model::config::ModelConfig;
use crate::model::graph::{self, LayerGraph, NormGraph};
use crate::model::layers::{self, Rope};
use crate::model::layout::{DecoderParam, Stage};
use crate::params::{ParamStore, SplitHead};
use crate::vocab_parallel;
use anyhow::{Context, Result};
use tch::{Kind, Tensor};

pub use crate::kernels::HeadLoss;

/// Options of the step schedule.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Keep only layer inputs in forward and recompute each layer in backward.
    pub gradient_checkpointing: bool,
    /// Upper bound on the elements of one logits chunk (`rows * vocab`).
    pub logits_chunk_elements: i64,
    /// How the micro-batches the engine's users build from rows lay their samples out (`use_remove_padding`:
    /// packed in one row, no padding).
    pub layout: Layout,
    /// Run the base model only: LoRA's adapters are left out of every forward, as PEFT's `disable_adapter()`
    /// (verl's reference policy of a LoRA actor, with no second copy of the model).
    pub adapters_off: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            gradient_checkpointing: false,
            logits_chunk_elements: 1 << 24,
            layout: Layout::Padded,
            adapters_off: false,
        }
    }
}

/// What one decoder layer keeps between its forward and its backward.
enum Saved {
    /// Checkpointing: the layer's input only.
    Input(Tensor),
    /// No checkpointing: the layer's forward with what its backward needs.
    Graph(LayerGraph),
}

/// The model's forward/backward over a [`ParamStore`].
pub struct Engine<P: ParamStore> {
    cfg: ModelConfig,
    store: P,
    opts: EngineOptions,
    kind: Kind,
    kernels: KernelRegistry,
    head: ChunkedHead,
}

impl<P: ParamStore> Engine<P> {
    /// An engine for a model with `cfg`, parameters in `store`, computing in `kind`.
    pub fn new(cfg: ModelConfig, store: P, kind: Kind, opts: EngineOptions) -> Self {
        Self {
            cfg,
            store,
            opts,
            kind,
            kernels: KernelRegistry::builtin(),
            head: ChunkedHead::new(opts.logits_chunk_elements),
        }
    }

    /// Replaces ops by kernels (`model.use_liger=true`); [`KernelRegistry::builtin`] restores the built-in ops.
    pub fn set_kernels(&mut self, kernels: KernelRegistry) {
        self.kernels = kernels;
    }

    /// The op overrides in use.
    pub fn kernels(&self) -> &KernelRegistry {
        &self.kernels
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The dtype the layers compute in.
    pub fn compute_kind(&self) -> Kind {
        self.kind
    }

    /// The parameter store.
    pub fn store(&self) -> &P {
        &self.store
    }

    /// The parameter store, mutably (optimizer, checkpoints).
    pub fn store_mut(&mut self) -> &mut P {
        &mut self.store
    }

    /// Sets the temperature `T` of every log-probability the head computes, `log_softmax(logits / T)`, in
    /// [`Engine::token_stats`] and in the losses of [`Engine::forward_backward_with`] (verl divides the logits by the
    /// rollout temperature when it recomputes `old_log_prob` and in the actor's update). 1 by default; exactly 1 gives
    /// the results of an engine without a temperature, bit for bit. A head kernel (`use_liger`) is bypassed at
    /// `T != 1`.
    pub fn set_temperature(&mut self, temperature: f64) -> Result<()> {
        self.head.set_temperature(temperature)
    }

    /// The temperature of the head's log-probabilities.
    pub fn temperature(&self) -> f64 {
        self.head.temperature()
    }

    /// The schedule options.
    pub fn options_mut(&mut self) -> &mut EngineOptions {
        &mut self.opts
    }

    /// How micro-batches built for this engine lay their samples out ([`EngineOptions::layout`]).
    pub fn layout(&self) -> Layout {
        self.opts.layout
    }

    /// The decoder stages' slots the forwards use: the layout's, without LoRA's adapters under
    /// [`EngineOptions::adapters_off`].
    fn decoder(&self) -> DecoderParam {
        let d = self.store.layout().decoder;
        match self.opts.adapters_off {
            true => d.without_adapters(),
            false => d,
        }
    }

    /// Final hidden states `[B, T, H]` without grad.
    fn forward_hidden_no_grad(&mut self, mb: &MicroBatch) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let rope = Rope::new(&self.cfg, &mb.positions, self.kind);
        let mut h = self.embed(&mb.input_ids)?;
        let d = self.decoder();
        for l in 0..self.cfg.num_layers {
            let p = self.store.gather(Stage::Decoder(l))?;
            h = graph::decoder_layer_forward(
                &self.cfg,
                &d,
                &p.tensors,
                &h,
                &rope,
                &mb.attention,
                &self.kernels,
            )?;
            self.store.release(Stage::Decoder(l));
        }
        Ok(h)
    }

    /// Runs forward and backward of one micro-batch, adding its gradients (scaled by `1 / global_targets`) to the
    /// store. Returns the micro-batch's summed (unscaled) cross-entropy.
    pub fn forward_backward(&mut self, mb: &MicroBatch, global_targets: i64) -> Result<f64> {
        self.forward_backward_with(mb, &CrossEntropy::token_mean(global_targets))
    }

    /// Runs forward and backward of one micro-batch for `loss`, a function of its target rows' log-probabilities
    /// (and entropies), adding the gradients to the store. Returns the loss's reported value.
    pub fn forward_backward_with(&mut self, mb: &MicroBatch, loss: &dyn TokenLoss) -> Result<f64> {
        let rope = Rope::new(&self.cfg, &mb.positions, self.kind);
        let d = self.decoder();
        // 1. Forward.
        let mut h = self.embed(&mb.input_ids)?;
        let mut saved = Vec::with_capacity(self.cfg.num_layers);
        for l in 0..self.cfg.num_layers {
            let p = self.store.gather(Stage::Decoder(l))?;
            if self.opts.gradient_checkpointing {
                let _g = tch::no_grad_guard();
                let out = graph::decoder_layer_forward(
                    &self.cfg,
                    &d,
                    &p.tensors,
                    &h,
                    &rope,
                    &mb.attention,
                    &self.kernels,
                )?;
                saved.push(Saved::Input(std::mem::replace(&mut h, out)));
            } else {
                let g = LayerGraph::build(
                    &self.cfg,
                    &d,
                    p.tensors,
                    &h,
                    &rope,
                    &mb.attention,
                    &self.kernels,
                )?;
                h = g.output();
                saved.push(Saved::Graph(g));
            }
            self.store.release(Stage::Decoder(l));
        }
        // 2. Head: loss and its gradient, chunk by chunk.
        let (loss_sum, mut grad_h) = self.head_forward_backward(&h, mb, loss)?;
        drop(h);
        // 3. Backward through the decoder layers.
        for l in (0..self.cfg.num_layers).rev() {
            let layer = match saved.pop().context("saved layer state")? {
                Saved::Input(x) => {
                    let p = self.store.gather(Stage::Decoder(l))?;
                    LayerGraph::build(
                        &self.cfg,
                        &d,
                        p.tensors,
                        &x,
                        &rope,
                        &mb.attention,
                        &self.kernels,
                    )?
                }
                Saved::Graph(g) => {
                    self.store.regather(Stage::Decoder(l))?;
                    g
                }
            };
            let (grad_input, grads) = layer.backward(&grad_h)?;
            grad_h = grad_input;
            self.store.accumulate_grads(Stage::Decoder(l), &grads)?;
            self.store.release(Stage::Decoder(l));
        }
        // 4. Embedding.
        self.embedding_backward(&mb.input_ids, &grad_h)?;
        Ok(loss_sum)
    }

    /// The embedding of `ids`, without grad: through the split matrix where the store splits it
    /// ([`vocab_parallel::embed`]), else the gathered one.
    fn embed(&mut self, ids: &Tensor) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let h = match self.store.gather_split_embedding()? {
            Some(slice) => vocab_parallel::embed(&slice, ids)?,
            None => {
                let p = self.store.gather(Stage::Embedding)?;
                layers::embed(&p.tensors[0], ids)
            }
        };
        self.store.release(Stage::Embedding);
        Ok(h)
    }

    /// Adds the embedding matrix's gradient from the gradient `grad_h` of its output for `ids`: through the split
    /// matrix where the store splits it ([`vocab_parallel::embedding_grad`]), else whole.
    fn embedding_backward(&mut self, ids: &Tensor, grad_h: &Tensor) -> Result<()> {
        match self.store.gather_split_embedding()? {
            Some(slice) => {
                if let Some((rows, grads)) = vocab_parallel::embedding_grad(&slice, ids, grad_h)? {
                    self.store.accumulate_split_embedding_grad(rows, grads)?;
                }
                self.store.release(Stage::Embedding);
            }
            None => {
                let rows = grad_h
                    .reshape([-1, self.cfg.hidden_size])
                    .to_kind(Kind::Float);
                self.store
                    .accumulate_embedding_rows(&ids.reshape([-1]), &rows)?;
            }
        }
        Ok(())
    }

    /// The head for training: returns (the loss's value, gradient of the final hidden states).
    fn head_forward_backward(
        &mut self,
        h: &Tensor,
        mb: &MicroBatch,
        loss: &dyn TokenLoss,
    ) -> Result<(f64, Tensor)> {
        let hidden = self.cfg.hidden_size;
        // The head kernel knows no temperature: it serves `T = 1` only, and needs the whole output matrix.
        let kernel = self
            .kernels
            .head
            .clone()
            .filter(|_| self.head.temperature() == 1.0);
        if kernel.is_none() {
            if let Some(split) = self.store.gather_split_head()? {
                return self.split_head_forward_backward(h, mb, loss, split);
            }
        }
        let share = Self::head_share(mb, h.device())?;
        let p = self.store.gather(Stage::Head)?;
        let (norm_w, out_w) = (&p.tensors[0], &p.tensors[1]);
        if share.total() == 0 {
            // No targets (e.g. the prompt filled `max_length`; in the whole sequence-parallel group when it shares
            // them): the gradient is zero, but it is still accumulated so that a sharded store runs the same
            // collectives on every rank.
            let zeros = [norm_w.zeros_like(), out_w.zeros_like()];
            self.store.accumulate_grads(Stage::Head, &zeros)?;
            self.store.release(Stage::Head);
            return Ok((0.0, h.zeros_like()));
        }
        let rows = h
            .detach()
            .reshape([-1, hidden])
            .index_select(0, &mb.target_rows);
        let norm = NormGraph::build(&self.kernels, &rows, norm_w, self.cfg.rms_norm_eps)?;
        let normed_d = norm.output();
        let (value, grad_normed, grad_w) = head_share::head_loss(
            &share,
            &mut self.head,
            kernel.as_deref(),
            &normed_d,
            out_w,
            &mb.target_ids,
            loss,
        )?;
        let (grad_rows, grad_norm_w) = norm.backward(&grad_normed)?;
        self.store
            .accumulate_grads(Stage::Head, &[grad_norm_w, grad_w])?;
        self.store.release(Stage::Head);
        Ok((value, Self::scatter_target_rows(h, mb, &grad_rows)))
    }

    /// The gradient of the target-row selection: `grad_rows` at the target rows of `h`'s shape, zeros elsewhere.
    fn scatter_target_rows(h: &Tensor, mb: &MicroBatch, grad_rows: &Tensor) -> Tensor {
        let (rows, hidden) = (h.size()[0] * h.size()[1], h.size()[2]);
        Tensor::zeros([rows, hidden], (h.kind(), h.device()))
            .index_add(0, &mb.target_rows, grad_rows)
            .reshape(h.size())
    }

    /// [`Self::head_forward_backward`] with the output matrix split by vocabulary rows ([`vocab_parallel`]).
    fn split_head_forward_backward(
        &mut self,
        h: &Tensor,
        mb: &MicroBatch,
        loss: &dyn TokenLoss,
        split: SplitHead,
    ) -> Result<(f64, Tensor)> {
        let rows = h
            .detach()
            .reshape([-1, self.cfg.hidden_size])
            .index_select(0, &mb.target_rows);
        let norm = NormGraph::build(&self.kernels, &rows, &split.norm, self.cfg.rms_norm_eps)?;
        let (value, grad_normed, grad_w) = vocab_parallel::head_loss(
            &split.out,
            &mut self.head,
            &norm.output(),
            &mb.target_ids,
            loss,
        )?;
        let (grad_rows, grad_norm_w) = norm.backward(&grad_normed)?;
        self.store
            .accumulate_split_head_grads(grad_norm_w, grad_w)?;
        self.store.release(Stage::Head);
        Ok((value, Self::scatter_target_rows(h, mb, &grad_rows)))
    }

    /// Where `mb`'s target rows go for the head: dealt out over its sequence-parallel group when it has one
    /// (`head_share`), else this rank's own head.
    fn head_share(mb: &MicroBatch, device: tch::Device) -> Result<HeadShare> {
        match mb.attention.sequence_parallel() {
            Some(sp) => HeadShare::new(&sp.group, &sp.targets_per_rank, device),
            None => Ok(HeadShare::own(mb.num_targets)),
        }
    }

    /// Per-token statistics of `mb`'s target rows without gradients: the log-probability of each target and, with
    /// `entropy`, each row's entropy (scoring rollouts under the current, old or reference policy).
    pub fn token_stats(&mut self, mb: &MicroBatch, entropy: bool) -> Result<TokenStats> {
        let h = self.forward_hidden_no_grad(mb)?;
        let _g = tch::no_grad_guard();
        let rows = h
            .reshape([-1, self.cfg.hidden_size])
            .index_select(0, &mb.target_rows);
        let eps = self.cfg.rms_norm_eps;
        let stats = match self.store.gather_split_head()? {
            Some(split) => {
                let normed = graph::norm_forward(&self.kernels, &rows, &split.norm, eps)?;
                let (head, targets) = (&mut self.head, &mb.target_ids);
                vocab_parallel::token_stats(&split.out, head, &normed, targets, entropy)?
            }
            None => {
                let p = self.store.gather(Stage::Head)?;
                let normed = graph::norm_forward(&self.kernels, &rows, &p.tensors[0], eps)?;
                let share = Self::head_share(mb, h.device())?;
                let (w, targets) = (&p.tensors[1], &mb.target_ids);
                share.token_stats(&mut self.head, &normed, w, targets, entropy)?
            }
        };
        self.store.release(Stage::Head);
        Ok(stats)
    }

    /// Summed cross-entropy and target count of `mb`, without gradients (validation).
    pub fn eval_loss(&mut self, mb: &MicroBatch) -> Result<(f64, i64)> {
        let stats = self.token_stats(mb, false)?;
        Ok((stats.cross_entropy_sum().double_value(&[]), mb.num_targets))
    }

    /// Full fp32 logits `[B, T, vocab]` of `mb`, not divided by the temperature (for checks against other
    /// implementations; small inputs only).
    pub fn logits(&mut self, mb: &MicroBatch) -> Result<Tensor> {
        let h = self.forward_hidden_no_grad(mb)?;
        let _g = tch::no_grad_guard();
        let p = self.store.gather(Stage::Head)?;
        let normed = graph::norm_forward(&self.kernels, &h, &p.tensors[0], self.cfg.rms_norm_eps)?;
        let logits = layers::project(&normed, &p.tensors[1]);
        self.store.release(Stage::Head);
        Ok(logits)
    }
}
