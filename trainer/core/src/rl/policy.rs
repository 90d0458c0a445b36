//! The actor's loss terms as verl computes them: the PPO clipped policy loss with dual clip
//! ([`compute_policy_loss`], verl's `vanilla` policy loss), KL to the reference policy ([`kl_penalty`],
//! `actor.kl_loss_type`), entropy from logits ([`entropy_from_logits`]) and their sum ([`actor_loss`]).

use super::{agg_loss, masked_mean, matrix, same_shape, GlobalBatch, LossAggMode};
use anyhow::{bail, Result};
use tch::Tensor;

/// verl's clip keys of `actor_rollout_ref.actor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyLossConfig {
    /// `clip_ratio`: ε of PPO's clip (0.2).
    pub clip_ratio: f64,
    /// `clip_ratio_low`: the ratio is clipped below at `1 - clip_ratio_low` (default `clip_ratio`).
    pub clip_ratio_low: Option<f64>,
    /// `clip_ratio_high`: the ratio is clipped above at `1 + clip_ratio_high` (default `clip_ratio`).
    pub clip_ratio_high: Option<f64>,
    /// `clip_ratio_c`: dual-clip bound for negative advantages, the loss never exceeds `-A · c` (3.0; must be > 1).
    pub clip_ratio_c: f64,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: 3.0,
        }
    }
}

/// The policy loss and verl's metrics of it (scalars; only `pg_loss` carries a gradient).
#[derive(Debug)]
pub struct PolicyLoss {
    /// The aggregated clipped loss (`actor/pg_loss`).
    pub pg_loss: Tensor,
    /// Fraction of response tokens where the clipped term won (`actor/pg_clipfrac`).
    pub pg_clipfrac: Tensor,
    /// Mean of `old_log_prob - log_prob` over response tokens (`actor/ppo_kl`).
    pub ppo_kl: Tensor,
    /// Fraction of response tokens with a negative advantage where the dual clip bound
    /// (`actor/pg_clipfrac_lower`).
    pub pg_clipfrac_lower: Tensor,
}

/// verl's `vanilla` policy loss: ratio `exp(clamp(log_prob - old_log_prob, -20, 20))`, the PPO objective
/// `max(-A·r, -A·clip(r, 1-low, 1+high))`, for `A < 0` bounded by `-A·clip_ratio_c` (dual clip), aggregated by
/// `mode` over `global`.
pub fn compute_policy_loss(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    response_mask: &Tensor,
    mode: LossAggMode,
    cfg: &PolicyLossConfig,
    global: GlobalBatch,
) -> Result<PolicyLoss> {
    matrix("log_prob", log_prob)?;
    for (name, t) in [
        ("old_log_prob", old_log_prob),
        ("advantages", advantages),
        ("response_mask", response_mask),
    ] {
        same_shape(("log_prob", log_prob), (name, t))?;
    }
    if cfg.clip_ratio_c.is_nan() || cfg.clip_ratio_c <= 1.0 {
        bail!(
            "clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {}",
            cfg.clip_ratio_c
        );
    }
    let low = cfg.clip_ratio_low.unwrap_or(cfg.clip_ratio);
    let high = cfg.clip_ratio_high.unwrap_or(cfg.clip_ratio);
    let negative_approx_kl = (log_prob - old_log_prob).clamp(-20.0, 20.0);
    let ratio = negative_approx_kl.exp();
    let ppo_kl = masked_mean(&negative_approx_kl.neg(), response_mask, None).detach();
    let losses1 = -advantages * &ratio;
    let losses2 = -advantages * ratio.clamp(1.0 - low, 1.0 + high);
    let clipped1 = losses1.maximum(&losses2);
    let kind = log_prob.kind();
    let pg_clipfrac = masked_mean(
        &losses2.gt_tensor(&losses1).to_kind(kind),
        response_mask,
        None,
    );
    let losses3 = -advantages * cfg.clip_ratio_c;
    let clipped2 = losses3.minimum(&clipped1);
    let negative = advantages.lt(0.0);
    let lower = clipped1.gt_tensor(&losses3).to_kind(kind) * negative.to_kind(kind);
    let pg_clipfrac_lower = masked_mean(&lower, response_mask, None);
    let pg_losses = clipped2.where_self(&negative, &clipped1);
    Ok(PolicyLoss {
        pg_loss: agg_loss(&pg_losses, response_mask, mode, global)?,
        pg_clipfrac: pg_clipfrac.detach(),
        ppo_kl,
        pg_clipfrac_lower: pg_clipfrac_lower.detach(),
    })
}

/// verl's `kl_penalty` estimators of KL(π ‖ π_ref) per token (`actor.kl_loss_type`, `algorithm.kl_penalty`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KlPenalty {
    /// `k1` / `kl`: `log_prob - ref_log_prob`.
    K1,
    /// `abs`: `|log_prob - ref_log_prob|`.
    Abs,
    /// `k2` / `mse`: `0.5 · (log_prob - ref_log_prob)²`.
    K2,
    /// `k3` / `low_var_kl`: `exp(d) - d - 1` with `d = clamp(ref - log_prob, ±20)`, clamped to ±10.
    K3,
}

impl KlPenalty {
    /// verl's spellings; a trailing `+` (e.g. `k3+`) keeps the value and takes k2's gradient (straight-through).
    pub const NAMES: [(&'static str, KlPenalty); 6] = [
        ("k1", Self::K1),
        ("kl", Self::K1),
        ("abs", Self::Abs),
        ("k2", Self::K2),
        ("mse", Self::K2),
        ("k3", Self::K3),
    ];

    /// `(estimator, straight_through)` for `name` (`low_var_kl` is `k3`); the error lists the valid names.
    pub fn parse(name: &str) -> Result<(Self, bool)> {
        let (base, plus) = match name.strip_suffix('+') {
            Some(b) => (b, true),
            None => (name, false),
        };
        let base = if base == "low_var_kl" { "k3" } else { base };
        match Self::NAMES.iter().find(|(n, _)| *n == base) {
            Some((_, k)) => Ok((*k, plus)),
            None => bail!(
                "kl_loss_type `{name}` is not one of k1, kl, abs, k2, mse, k3, low_var_kl (each optionally with `+`)"
            ),
        }
    }

    fn forward(self, log_prob: &Tensor, ref_log_prob: &Tensor) -> Tensor {
        let diff = log_prob - ref_log_prob;
        match self {
            Self::K1 => diff,
            Self::Abs => diff.abs(),
            Self::K2 => diff.square() * 0.5,
            Self::K3 => {
                let kl = (ref_log_prob - log_prob).clamp(-20.0, 20.0);
                (kl.exp() - &kl - 1.0).clamp(-10.0, 10.0)
            }
        }
    }
}

/// The per-token KL estimate `kind` of `log_prob` against `ref_log_prob`. With `straight_through` (verl's `+`
/// suffix) the value is `kind`'s and the gradient is k2's (`mse`/`k2` are unchanged by it).
pub fn kl_penalty(
    log_prob: &Tensor,
    ref_log_prob: &Tensor,
    kind: KlPenalty,
    straight_through: bool,
) -> Result<Tensor> {
    same_shape(("log_prob", log_prob), ("ref_log_prob", ref_log_prob))?;
    let forward = kind.forward(log_prob, ref_log_prob);
    if !straight_through || kind == KlPenalty::K2 {
        return Ok(forward);
    }
    let backward = KlPenalty::K2.forward(log_prob, ref_log_prob);
    Ok(&backward - backward.detach() + forward.detach())
}

/// Entropy of the categorical distribution of each row of `logits` (`[..., vocab]` → `[...]`), as verl:
/// `logsumexp(logits) - Σ softmax(logits) · logits`.
pub fn entropy_from_logits(logits: &Tensor) -> Tensor {
    let kind = logits.kind();
    let p = logits.softmax(-1, kind);
    logits.logsumexp([-1i64].as_slice(), false)
        - (p * logits).sum_dim_intlist([-1i64].as_slice(), false, kind)
}

/// The actor's loss keys (`actor_rollout_ref.actor`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActorLossConfig {
    /// The clip keys.
    pub policy: PolicyLossConfig,
    /// `loss_agg_mode` (token-mean).
    pub loss_agg_mode: LossAggMode,
    /// `entropy_coeff`: the entropy bonus (0 = no entropy term).
    pub entropy_coeff: f64,
    /// `use_kl_loss`: KL to the reference policy as a loss term.
    pub use_kl_loss: bool,
    /// `kl_loss_coef` (0.001).
    pub kl_loss_coef: f64,
    /// `kl_loss_type` (`low_var_kl`) and whether it ends with `+`.
    pub kl_loss_type: (KlPenalty, bool),
}

impl Default for ActorLossConfig {
    fn default() -> Self {
        Self {
            policy: PolicyLossConfig::default(),
            loss_agg_mode: LossAggMode::TokenMean,
            entropy_coeff: 0.0,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: (KlPenalty::K3, false),
        }
    }
}

/// The actor's loss and its terms.
#[derive(Debug)]
pub struct ActorLoss {
    /// `pg_loss - entropy_coeff · entropy + kl_loss_coef · kl_loss`, the value to back-propagate.
    pub loss: Tensor,
    /// The policy loss and its metrics.
    pub policy: PolicyLoss,
    /// The aggregated entropy (`actor/entropy`), when `entropy` was given.
    pub entropy: Option<Tensor>,
    /// The aggregated KL to the reference (`actor/kl_loss`), with `use_kl_loss`.
    pub kl_loss: Option<Tensor>,
}

/// Per-token inputs of [`actor_loss`], all `[batch, response_length]`.
pub struct ActorLossInputs<'a> {
    /// Log-probabilities of the rollout under the policy that generated it.
    pub old_log_prob: &'a Tensor,
    /// Log-probabilities under the current policy (with gradient).
    pub log_prob: &'a Tensor,
    /// Advantages per token.
    pub advantages: &'a Tensor,
    /// Response tokens.
    pub response_mask: &'a Tensor,
    /// Per-token entropy ([`entropy_from_logits`]); required when `entropy_coeff != 0`.
    pub entropy: Option<&'a Tensor>,
    /// Log-probabilities under the reference policy; required with `use_kl_loss`.
    pub ref_log_prob: Option<&'a Tensor>,
}

/// verl's actor loss of one micro-batch: the policy loss, minus the entropy bonus, plus the KL loss.
pub fn actor_loss(
    x: &ActorLossInputs<'_>,
    cfg: &ActorLossConfig,
    global: GlobalBatch,
) -> Result<ActorLoss> {
    let mode = cfg.loss_agg_mode;
    let policy = compute_policy_loss(
        x.old_log_prob,
        x.log_prob,
        x.advantages,
        x.response_mask,
        mode,
        &cfg.policy,
        global,
    )?;
    let entropy = match x.entropy {
        Some(e) => Some(agg_loss(e, x.response_mask, mode, global)?),
        None if cfg.entropy_coeff != 0.0 => {
            bail!(
                "entropy_coeff is {} but no entropy was given",
                cfg.entropy_coeff
            )
        }
        None => None,
    };
    // Fresh tensors, never in-place ops: `pg_loss` is returned too and must keep its value.
    let loss = match (&entropy, cfg.entropy_coeff != 0.0) {
        (Some(e), true) => &policy.pg_loss - e * cfg.entropy_coeff,
        _ => policy.pg_loss.shallow_clone(),
    };
    let kl_loss = if cfg.use_kl_loss {
        let Some(r) = x.ref_log_prob else {
            bail!("use_kl_loss is set but no ref_log_prob was given")
        };
        let (kind, st) = cfg.kl_loss_type;
        let kl = agg_loss(
            &kl_penalty(x.log_prob, r, kind, st)?,
            x.response_mask,
            mode,
            global,
        )?;
        Some(kl)
    } else {
        None
    };
    let loss = match &kl_loss {
        Some(kl) => loss + kl * cfg.kl_loss_coef,
        None => loss,
    };
    Ok(ActorLoss {
        loss,
        policy,
        entropy,
        kl_loss,
    })
}
