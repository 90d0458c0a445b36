//! The actor's loss terms as verl computes them: the PPO clipped policy loss with dual clip
//! ([`compute_policy_loss`], verl's `vanilla` policy loss), KL to the reference policy ([`kl_penalty`],
//! `actor.kl_loss_type`), entropy from logits ([`entropy_from_logits`]) and their sum ([`actor_loss`]).

use super::{agg_loss, masked_mean, matrix, same_shape, GlobalBatch, KlPenalty, LossAggMode};
use anyhow::{bail, Result};
use ferl_trainer::config::ppo::ActorConfig;
use tch::Tensor;

/// verl's clip keys of `actor_rollout_ref.actor` (`clip_ratio`, `_low`, `_high`, `_c`), as the policy loss takes
/// them. (verl's `actor_rollout_ref.actor.policy_loss.*` is the config's
/// [`PolicyLossConfig`](ferl_trainer::config::ppo::PolicyLossConfig).)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipConfig {
    /// `clip_ratio`: ε of PPO's clip (0.2).
    pub clip_ratio: f64,
    /// `clip_ratio_low`: the ratio is clipped below at `1 - clip_ratio_low` (default `clip_ratio`).
    pub clip_ratio_low: Option<f64>,
    /// `clip_ratio_high`: the ratio is clipped above at `1 + clip_ratio_high` (default `clip_ratio`).
    pub clip_ratio_high: Option<f64>,
    /// `clip_ratio_c`: dual-clip bound for negative advantages, the loss never exceeds `-A · c` (3.0; must be > 1).
    pub clip_ratio_c: f64,
}

impl Default for ClipConfig {
    fn default() -> Self {
        Self::from(&ActorConfig::default())
    }
}

impl From<&ActorConfig> for ClipConfig {
    fn from(a: &ActorConfig) -> Self {
        Self {
            clip_ratio: a.clip_ratio,
            clip_ratio_low: a.clip_ratio_low,
            clip_ratio_high: a.clip_ratio_high,
            clip_ratio_c: a.clip_ratio_c,
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
    cfg: &ClipConfig,
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

/// The KL estimators [`kl_penalty`] computes (verl's `full`, the exact KL over the vocabulary, is refused).
pub const KL_PENALTIES: [KlPenalty; 4] = [
    KlPenalty::Kl,
    KlPenalty::Abs,
    KlPenalty::Mse,
    KlPenalty::LowVarKl,
];

/// verl's `kl_penalty_forward`: `kind`'s per-token estimate of KL(π ‖ π_ref) (k1 `log_prob - ref_log_prob`, its
/// absolute value, k2 `0.5 · (log_prob - ref_log_prob)²`, k3 `exp(d) - d - 1` with `d = clamp(ref - log_prob, ±20)`,
/// clamped to ±10).
fn kl_forward(kind: KlPenalty, log_prob: &Tensor, ref_log_prob: &Tensor) -> Result<Tensor> {
    let diff = log_prob - ref_log_prob;
    Ok(match kind {
        KlPenalty::Kl => diff,
        KlPenalty::Abs => diff.abs(),
        KlPenalty::Mse => diff.square() * 0.5,
        KlPenalty::LowVarKl => {
            let kl = (ref_log_prob - log_prob).clamp(-20.0, 20.0);
            (kl.exp() - &kl - 1.0).clamp(-10.0, 10.0)
        }
        KlPenalty::Full => bail!(
            "kl_loss_type `full` is not supported by ferl; use one of {}",
            KL_PENALTIES.map(KlPenalty::as_str).join(", ")
        ),
    })
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
    let forward = kl_forward(kind, log_prob, ref_log_prob)?;
    if !straight_through || kind == KlPenalty::Mse {
        return Ok(forward);
    }
    let backward = kl_forward(KlPenalty::Mse, log_prob, ref_log_prob)?;
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
    pub policy: ClipConfig,
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
    /// verl's defaults (those of [`ActorConfig::default`]).
    fn default() -> Self {
        Self::from(&ActorConfig::default())
    }
}

impl From<&ActorConfig> for ActorLossConfig {
    /// The loss keys of `actor_rollout_ref.actor` (its `kl_loss_type` without straight-through, which the config
    /// cannot spell).
    fn from(a: &ActorConfig) -> Self {
        Self {
            policy: ClipConfig::from(a),
            loss_agg_mode: a.loss_agg_mode,
            entropy_coeff: a.entropy_coeff,
            use_kl_loss: a.use_kl_loss,
            kl_loss_coef: a.kl_loss_coef,
            kl_loss_type: (a.kl_loss_type, false),
        }
    }
}

impl ActorLossConfig {
    /// Refuses keys the loss cannot compute, naming the key: a `loss_agg_mode` outside [`super::AGG_MODES`] or a
    /// `kl_loss_type` outside [`KL_PENALTIES`] (with `use_kl_loss`), and a `clip_ratio_c` not above 1.
    pub fn validate(&self) -> Result<()> {
        if !super::AGG_MODES.contains(&self.loss_agg_mode) {
            bail!(
                "actor_rollout_ref.actor.loss_agg_mode={} is not supported by ferl; use one of {}",
                self.loss_agg_mode,
                super::AGG_MODES.map(LossAggMode::as_str).join(", ")
            );
        }
        let kl = self.kl_loss_type.0;
        if self.use_kl_loss && !KL_PENALTIES.contains(&kl) {
            bail!(
                "actor_rollout_ref.actor.kl_loss_type={kl} is not supported by ferl; use one of {}",
                KL_PENALTIES.map(KlPenalty::as_str).join(", ")
            );
        }
        let c = self.policy.clip_ratio_c;
        if c.is_nan() || c <= 1.0 {
            bail!("actor_rollout_ref.actor.clip_ratio_c must be greater than 1.0 for dual-clip PPO, got {c}");
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GrpoSettings;
    use ferl_trainer::config::ppo::AdvEstimator;
    use ferl_trainer::config::PpoConfig;

    fn actor(overrides: &[&str]) -> ActorConfig {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        PpoConfig::load(None, &o).unwrap().actor_rollout_ref.actor
    }

    #[test]
    fn the_loss_keys_are_the_configs_own_values() {
        let d = ActorLossConfig::default();
        assert_eq!(d.policy.clip_ratio, 0.2);
        assert_eq!(
            (d.policy.clip_ratio_low, d.policy.clip_ratio_high),
            (None, None)
        );
        assert_eq!(d.policy.clip_ratio_c, 3.0);
        assert_eq!(d.loss_agg_mode, LossAggMode::TokenMean);
        assert_eq!(d.kl_loss_type, (KlPenalty::LowVarKl, false));
        assert_eq!((d.use_kl_loss, d.kl_loss_coef), (false, 0.001));
        let a = actor(&[
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.clip_ratio_c=10",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.05",
            "actor_rollout_ref.actor.kl_loss_type=k1",
        ]);
        let c = ActorLossConfig::from(&a);
        assert_eq!(c.policy.clip_ratio_high, Some(0.28));
        assert_eq!(c.policy.clip_ratio_c, 10.0);
        assert_eq!(c.loss_agg_mode, LossAggMode::SeqMeanTokenMean);
        assert_eq!(c.entropy_coeff, 0.01);
        assert!(c.use_kl_loss);
        assert_eq!(c.kl_loss_coef, 0.05);
        assert_eq!(c.kl_loss_type, (KlPenalty::Kl, false));
        c.validate().unwrap();
    }

    #[test]
    fn what_the_config_spells_but_ferl_does_not_compute_is_refused_by_key() {
        let norm = actor(&["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"]);
        let e = ActorLossConfig::from(&norm).validate().unwrap_err();
        assert!(
            e.to_string().contains(
                "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm is not supported"
            ),
            "{e}"
        );
        let full = actor(&[
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_type=full",
        ]);
        let e = ActorLossConfig::from(&full).validate().unwrap_err();
        assert!(
            e.to_string()
                .contains("actor_rollout_ref.actor.kl_loss_type=full is not supported"),
            "{e}"
        );
        let mut s = GrpoSettings {
            adv_estimator: AdvEstimator::Gae,
            ..GrpoSettings::default()
        };
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("algorithm.adv_estimator=gae"), "{e}");
        s.adv_estimator = AdvEstimator::Rloo;
        s.validate().unwrap();
    }
}
