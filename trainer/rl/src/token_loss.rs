//! The actor's loss ([`actor_loss`]) as a [`TokenLoss`] of the engine: the micro-batch's target rows are the
//! response tokens, in the micro-batch's order (sample by sample, position by position); their per-token inputs
//! (old and reference log-probabilities, advantages) come in the same order. The rows are laid out as verl's
//! `[batch, response_length]` matrices (each sample's tokens left-aligned, a response mask over them), so every
//! `loss_agg_mode` sees its sequences.

use super::{actor_loss, ActorLossConfig, ActorLossInputs, GlobalBatch};
use anyhow::{bail, Result};
use ferl_trainer::head::TokenStats;
use ferl_trainer::loss::{AutogradTokenLoss, TokenLoss, TokenLossValue};
use std::cell::RefCell;
use tch::{Kind, Tensor};

/// The figures of the last [`ActorTokenLoss::evaluate`] (verl's `actor/*` metrics of one micro-batch).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ActorLossMetrics {
    /// The whole loss.
    pub loss: f64,
    /// `actor/pg_loss`.
    pub pg_loss: f64,
    /// `actor/pg_clipfrac`.
    pub pg_clipfrac: f64,
    /// `actor/ppo_kl`.
    pub ppo_kl: f64,
    /// `actor/pg_clipfrac_lower`.
    pub pg_clipfrac_lower: f64,
    /// `actor/entropy`, when computed.
    pub entropy: Option<f64>,
    /// `actor/kl_loss`, with `use_kl_loss`.
    pub kl_loss: Option<f64>,
}

/// The per-token inputs of one micro-batch's response tokens, `[n]` each, in target-row order.
pub struct ActorRows {
    /// Response tokens of each sample of the micro-batch (sums to `n`).
    pub tokens_per_sample: Vec<i64>,
    /// Log-probabilities under the policy that generated the responses.
    pub old_log_prob: Tensor,
    /// Advantages.
    pub advantages: Tensor,
    /// Log-probabilities under the reference policy (with `use_kl_loss`).
    pub ref_log_prob: Option<Tensor>,
    /// Under Ulysses sequence parallelism, the positions (`[k]`, int64, in target-row order) of the tokens this
    /// rank's slice of the micro-batch holds ([`ferl_trainer::batch::MicroBatch::sequence_parallel_kept`]): the
    /// engine's statistics are theirs only. The other tokens enter the loss with the old policy's log-probability,
    /// no advantage and no entropy, so they add 0 to every term while each sequence keeps its whole length in the
    /// loss's means: summed over the group, the ranks' losses are the whole micro-batch's. `None`: every token.
    pub kept: Option<Tensor>,
}

/// [`actor_loss`] over a micro-batch's target rows.
pub struct ActorTokenLoss {
    cfg: ActorLossConfig,
    global: GlobalBatch,
    rows: ActorRows,
    /// Flat index of each row in the `[batch, width]` matrices.
    index: Tensor,
    width: i64,
    metrics: RefCell<ActorLossMetrics>,
}

impl ActorTokenLoss {
    /// The loss of `rows` with the actor's keys `cfg`, normalised by the global batch `global`.
    pub fn new(cfg: ActorLossConfig, global: GlobalBatch, rows: ActorRows) -> Result<Self> {
        let n: i64 = rows.tokens_per_sample.iter().sum();
        for (name, t) in [
            ("old_log_prob", Some(&rows.old_log_prob)),
            ("advantages", Some(&rows.advantages)),
        ]
        .into_iter()
        .chain([("ref_log_prob", rows.ref_log_prob.as_ref())])
        {
            if let Some(t) = t {
                if t.size() != [n] {
                    bail!(
                        "{name}: shape {:?}, expected [{n}] (one per response token)",
                        t.size()
                    );
                }
            }
        }
        if cfg.use_kl_loss && rows.ref_log_prob.is_none() {
            bail!("use_kl_loss is set but no ref_log_prob was given");
        }
        let width = rows
            .tokens_per_sample
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(1);
        let flat: Vec<i64> = (0i64..)
            .zip(&rows.tokens_per_sample)
            .flat_map(|(i, &len)| (0..len).map(move |j| i * width + j))
            .collect();
        Ok(Self {
            cfg,
            global,
            index: Tensor::from_slice(&flat).to_device(rows.old_log_prob.device()),
            width,
            rows,
            metrics: RefCell::new(ActorLossMetrics::default()),
        })
    }

    /// The figures of the last evaluation.
    pub fn metrics(&self) -> ActorLossMetrics {
        *self.metrics.borrow()
    }

    /// `v` (`[n]`) as the `[batch, width]` matrix (zeros where a sample has no token); differentiable in `v`.
    fn matrix(&self, v: &Tensor) -> Tensor {
        let batch = self.rows.tokens_per_sample.len() as i64;
        Tensor::zeros([batch * self.width], (v.kind(), v.device()))
            .index_add(0, &self.index, v)
            .view([batch, self.width])
    }

    /// Every token's inputs from the engine's statistics of the kept tokens (see [`ActorRows::kept`]): the log-
    /// probabilities, entropies, advantages and reference log-probabilities, `[n]` each.
    fn whole(
        &self,
        log_prob: &Tensor,
        entropy: Option<&Tensor>,
    ) -> (Tensor, Option<Tensor>, Tensor, Option<Tensor>) {
        let f = |t: &Tensor| t.to_kind(Kind::Float);
        let rows = &self.rows;
        let Some(kept) = &rows.kept else {
            let lp = f(log_prob);
            return (
                lp,
                entropy.map(f),
                f(&rows.advantages),
                rows.ref_log_prob.as_ref().map(f),
            );
        };
        let old = f(&rows.old_log_prob);
        let put = |base: &Tensor, local: &Tensor| base.index_copy(0, kept, &f(local));
        let take = |t: &Tensor| f(t).index_select(0, kept);
        (
            put(&old, log_prob),
            entropy.map(|h| put(&old.zeros_like(), h)),
            put(&old.zeros_like(), &take(&rows.advantages)),
            rows.ref_log_prob.as_ref().map(|r| put(&old, &take(r))),
        )
    }

    fn loss(&self, log_prob: &Tensor, entropy: Option<&Tensor>) -> Result<Tensor> {
        let m = |t: &Tensor| self.matrix(&t.to_kind(Kind::Float));
        let mask = self.matrix(&self.rows.old_log_prob.ones_like().to_kind(Kind::Float));
        let (log_prob, entropy, adv, reference) = self.whole(log_prob, entropy);
        let (log_prob, old, adv) = (m(&log_prob), m(&self.rows.old_log_prob), m(&adv));
        let (entropy, reference) = (entropy.as_ref().map(m), reference.as_ref().map(m));
        let out = actor_loss(
            &ActorLossInputs {
                old_log_prob: &old,
                log_prob: &log_prob,
                advantages: &adv,
                response_mask: &mask,
                entropy: entropy.as_ref(),
                ref_log_prob: reference.as_ref(),
            },
            &self.cfg,
            self.global,
        )?;
        let f = |t: &Tensor| t.double_value(&[]);
        *self.metrics.borrow_mut() = ActorLossMetrics {
            loss: f(&out.loss),
            pg_loss: f(&out.policy.pg_loss),
            pg_clipfrac: f(&out.policy.pg_clipfrac),
            ppo_kl: f(&out.policy.ppo_kl),
            pg_clipfrac_lower: f(&out.policy.pg_clipfrac_lower),
            entropy: out.entropy.as_ref().map(f),
            kl_loss: out.kl_loss.as_ref().map(f),
        };
        Ok(out.loss)
    }
}

impl TokenLoss for ActorTokenLoss {
    fn needs_entropy(&self) -> bool {
        self.cfg.entropy_coeff != 0.0
    }

    fn evaluate(&self, stats: &TokenStats) -> Result<TokenLossValue> {
        let n: i64 = match &self.rows.kept {
            Some(kept) => kept.size()[0],
            None => self.rows.tokens_per_sample.iter().sum(),
        };
        if stats.log_prob.size() != [n] {
            bail!(
                "the micro-batch has {:?} target rows, the actor's inputs {n} response tokens",
                stats.log_prob.size()
            );
        }
        AutogradTokenLoss::new(
            |lp: &Tensor, h: Option<&Tensor>| self.loss(lp, h),
            self.needs_entropy(),
        )
        .evaluate(stats)
    }
}
