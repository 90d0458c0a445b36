//! The value types of verl's algorithm keys, defined once and shared by the config, the trainer's RL code
//! (`ferl_rl`, which re-exports them) and `ferl grpo`: [`AdvEstimator`] (`algorithm.adv_estimator`),
//! [`LossAggMode`] (`*.loss_agg_mode`), [`KlPenalty`] (`actor_rollout_ref.actor.kl_loss_type`,
//! `algorithm.kl_penalty`) and [`PolicyLossConfig`] (`actor_rollout_ref.actor.policy_loss.*`).
//!
//! Each enum's `as_str` is its serde name (verl's spelling), so a value printed by `as_str` or [`Display`] loads back
//! as the same value; the tests check that for every variant.
//!
//! [`Display`]: std::fmt::Display

use std::fmt;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// `algorithm.adv_estimator`: verl's advantage estimators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvEstimator {
    /// Generalised advantage estimation with a critic.
    Gae,
    /// Group-relative: each response's reward against its group's mean (and standard deviation).
    Grpo,
    /// REINFORCE++: discounted returns, normalised over the batch.
    ReinforcePlusPlus,
    /// REINFORCE++ with the group mean as baseline.
    ReinforcePlusPlusBaseline,
    /// ReMax: the greedy response's reward as baseline.
    Remax,
    /// REINFORCE leave-one-out: the other responses' mean as baseline.
    Rloo,
    /// Optimal-baseline policy optimisation (length-weighted group baseline).
    Opo,
    /// GRPO for pass@k.
    GrpoPassk,
    /// Group policy gradient.
    Gpg,
}

impl AdvEstimator {
    /// Every estimator, in declaration order.
    pub const ALL: [AdvEstimator; 9] = [
        Self::Gae,
        Self::Grpo,
        Self::ReinforcePlusPlus,
        Self::ReinforcePlusPlusBaseline,
        Self::Remax,
        Self::Rloo,
        Self::Opo,
        Self::GrpoPassk,
        Self::Gpg,
    ];

    /// verl's spelling (the serde name): `gae`, `grpo`, `rloo`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gae => "gae",
            Self::Grpo => "grpo",
            Self::ReinforcePlusPlus => "reinforce_plus_plus",
            Self::ReinforcePlusPlusBaseline => "reinforce_plus_plus_baseline",
            Self::Remax => "remax",
            Self::Rloo => "rloo",
            Self::Opo => "opo",
            Self::GrpoPassk => "grpo_passk",
            Self::Gpg => "gpg",
        }
    }

    /// The estimator spelled `name` (see [`AdvEstimator::as_str`]); the error lists the valid spellings.
    pub fn parse(name: &str) -> Result<Self> {
        match Self::ALL.iter().find(|e| e.as_str() == name) {
            Some(e) => Ok(*e),
            None => bail!(
                "adv_estimator `{name}` is not one of {}",
                Self::ALL.map(Self::as_str).join(", ")
            ),
        }
    }

    /// Whether the estimator compares each response with the others of its prompt, so `rollout.n` must be above 1.
    pub fn needs_groups(self) -> bool {
        matches!(self, Self::Grpo | Self::Rloo | Self::GrpoPassk)
    }

    /// The estimators that need groups ([`AdvEstimator::needs_groups`]).
    pub fn group_estimators() -> impl Iterator<Item = AdvEstimator> {
        Self::ALL.into_iter().filter(|e| e.needs_groups())
    }
}

impl fmt::Display for AdvEstimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `actor_rollout_ref.actor.loss_agg_mode` (and `critic.loss_agg_mode`): how a `[batch, tokens]` loss matrix becomes
/// one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossAggMode {
    /// Sum over every response token of the batch, divided by their count (`token-mean`, the default).
    TokenMean,
    /// Per sequence the sum over its tokens, then the mean over sequences (`seq-mean-token-sum`).
    SeqMeanTokenSum,
    /// Per sequence the mean over its tokens, then the mean over sequences (`seq-mean-token-mean`).
    SeqMeanTokenMean,
    /// Sum over each sequence's tokens divided by the longest response length, mean over sequences (Dr. GRPO,
    /// `seq-mean-token-sum-norm`).
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    /// Every mode with its verl spelling.
    pub const ALL: [(&'static str, LossAggMode); 4] = [
        ("token-mean", Self::TokenMean),
        ("seq-mean-token-sum", Self::SeqMeanTokenSum),
        ("seq-mean-token-mean", Self::SeqMeanTokenMean),
        ("seq-mean-token-sum-norm", Self::SeqMeanTokenSumNorm),
    ];

    /// The mode spelled `name` as verl's `actor.loss_agg_mode`; the error lists the valid spellings.
    pub fn parse(name: &str) -> Result<Self> {
        match Self::ALL.iter().find(|(n, _)| *n == name) {
            Some((_, m)) => Ok(*m),
            None => bail!(
                "loss_agg_mode `{name}` is not one of {}",
                Self::ALL.map(|(n, _)| n).join(", ")
            ),
        }
    }

    /// verl's spelling (the serde name).
    pub fn as_str(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, m)| *m == self)
            .map(|(n, _)| *n)
            .expect("every mode is listed")
    }
}

impl fmt::Display for LossAggMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A KL estimator: `actor_rollout_ref.actor.kl_loss_type` and `algorithm.kl_penalty`. verl's `k1`/`k2`/`k3` names
/// are accepted for `kl`/`mse`/`low_var_kl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KlPenalty {
    /// `log π - log π_ref` (k1).
    #[serde(rename = "kl", alias = "k1")]
    Kl,
    /// `|log π - log π_ref|`.
    #[serde(rename = "abs")]
    Abs,
    /// `½ (log π - log π_ref)²` (k2).
    #[serde(rename = "mse", alias = "k2")]
    Mse,
    /// Schulman's low-variance estimator `r - log r - 1`, `r = π_ref / π`, clamped (k3).
    #[serde(rename = "low_var_kl", alias = "k3")]
    LowVarKl,
    /// The exact KL over the whole vocabulary.
    #[serde(rename = "full")]
    Full,
}

impl KlPenalty {
    /// Every spelling verl accepts, the serde name first for each estimator, then its `kN` alias.
    pub const NAMES: [(&'static str, KlPenalty); 8] = [
        ("kl", Self::Kl),
        ("k1", Self::Kl),
        ("abs", Self::Abs),
        ("mse", Self::Mse),
        ("k2", Self::Mse),
        ("low_var_kl", Self::LowVarKl),
        ("k3", Self::LowVarKl),
        ("full", Self::Full),
    ];

    /// verl's spelling (the serde name): `kl`, `abs`, `mse`, `low_var_kl` or `full`.
    pub fn as_str(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, k)| *k == self)
            .map(|(n, _)| *n)
            .expect("every estimator is listed")
    }

    /// `(estimator, straight_through)` for `name`, as verl's `kl_penalty` reads its argument: any of
    /// [`KlPenalty::NAMES`], optionally with a trailing `+` (keep the value, take k2's gradient). The error lists the
    /// valid names.
    pub fn parse(name: &str) -> Result<(Self, bool)> {
        let (base, plus) = match name.strip_suffix('+') {
            Some(b) => (b, true),
            None => (name, false),
        };
        match Self::NAMES.iter().find(|(n, _)| *n == base) {
            Some((_, k)) => Ok((*k, plus)),
            None => bail!(
                "kl_loss_type `{name}` is not one of {} (each optionally with `+`)",
                Self::NAMES.map(|(n, _)| n).join(", ")
            ),
        }
    }
}

impl fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `actor_rollout_ref.actor.policy_loss.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    /// verl's policy-loss function: `vanilla` (PPO's clipped loss), `gspo`, `clip_cov`, `kl_cov`, ...
    pub loss_mode: String,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            loss_mode: "vanilla".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `value`'s serde spelling.
    fn spelled<T: Serialize>(value: T) -> String {
        serde_yaml::to_value(value)
            .unwrap()
            .as_str()
            .unwrap()
            .to_string()
    }

    fn loaded<T: for<'de> Deserialize<'de>>(name: &str) -> T {
        serde_yaml::from_value(serde_yaml::Value::String(name.into())).unwrap()
    }

    #[test]
    fn every_adv_estimator_prints_and_parses_as_its_serde_name() {
        for e in AdvEstimator::ALL {
            assert_eq!(e.as_str(), spelled(e));
            assert_eq!(e.to_string(), spelled(e));
            assert_eq!(AdvEstimator::parse(e.as_str()).unwrap(), e);
            assert_eq!(loaded::<AdvEstimator>(e.as_str()), e);
        }
        let err = AdvEstimator::parse("ppo").unwrap_err().to_string();
        assert!(err.contains("`ppo`") && err.contains("grpo, "), "{err}");
        let groups: Vec<_> = AdvEstimator::group_estimators().collect();
        assert_eq!(
            groups,
            [
                AdvEstimator::Grpo,
                AdvEstimator::Rloo,
                AdvEstimator::GrpoPassk
            ]
        );
    }

    #[test]
    fn every_loss_agg_mode_prints_and_parses_as_its_serde_name() {
        for (name, m) in LossAggMode::ALL {
            assert_eq!(name, spelled(m));
            assert_eq!(m.as_str(), name);
            assert_eq!(m.to_string(), name);
            assert_eq!(LossAggMode::parse(name).unwrap(), m);
            assert_eq!(loaded::<LossAggMode>(name), m);
        }
        let err = LossAggMode::parse("token_mean").unwrap_err().to_string();
        assert!(
            err.contains("`token_mean`") && err.contains("token-mean"),
            "{err}"
        );
    }

    #[test]
    fn every_kl_spelling_loads_as_serde_does_and_plus_is_straight_through() {
        for (name, k) in KlPenalty::NAMES {
            assert_eq!(loaded::<KlPenalty>(name), k, "{name}");
            assert_eq!(KlPenalty::parse(name).unwrap(), (k, false));
            assert_eq!(KlPenalty::parse(&format!("{name}+")).unwrap(), (k, true));
            assert_eq!(k.as_str(), spelled(k));
            assert_eq!(k.to_string(), spelled(k));
        }
        let err = KlPenalty::parse("k4").unwrap_err().to_string();
        assert!(err.contains("`k4`") && err.contains("low_var_kl"), "{err}");
    }
}
