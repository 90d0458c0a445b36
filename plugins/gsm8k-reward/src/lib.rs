//! Reward plugin `gsm8k`: verl's GSM8K scorer ([`rule`]) behind the reward ABI.
//!
//! Config: empty for verl's defaults, or a JSON object `{"method": "strict"|"flexible", "format_score": 0.0,
//! "score": 1.0}` (any subset; other keys are refused). Each row's `ground_truth` is the reference answer as verl's
//! `gsm8k.py` preprocessing writes it (`"72"`, commas removed); a row without one is an error naming the row.
//! Extras per row: `acc` (1 when the answer equals the ground truth) and `has_answer` (1 when an answer was read).

pub mod rule;

use ferl_plugin_abi::reward::{RewardInput, RewardPlugin, RewardScore};
use ferl_plugin_abi::Plugin;
use rule::Method;

/// The options of an instance, with verl's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gsm8kReward {
    /// Where the answer is read from.
    pub method: Method,
    /// The score of a well-formed but wrong answer.
    pub format_score: f32,
    /// The score of a correct answer.
    pub score: f32,
}

impl Default for Gsm8kReward {
    fn default() -> Self {
        Self {
            method: Method::Strict,
            format_score: 0.0,
            score: 1.0,
        }
    }
}

impl Gsm8kReward {
    /// Parses the JSON config; an error names the key that is wrong.
    fn from_json(config: &str) -> Result<Self, String> {
        let value: serde_json::Value =
            serde_json::from_str(config).map_err(|e| format!("not JSON: {e}"))?;
        let object = value
            .as_object()
            .ok_or("expected a JSON object such as {\"method\": \"flexible\"}")?;
        let mut me = Self::default();
        for (key, v) in object {
            let number = || {
                v.as_f64()
                    .map(|x| x as f32)
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("`{key}` must be a finite number, not {v}"))
            };
            match key.as_str() {
                "method" => {
                    me.method = match v.as_str() {
                        Some("strict") => Method::Strict,
                        Some("flexible") => Method::Flexible,
                        _ => {
                            return Err(format!(
                                "`method` is {v}; expected \"strict\" or \"flexible\""
                            ))
                        }
                    }
                }
                "format_score" => me.format_score = number()?,
                "score" => me.score = number()?,
                _ => {
                    return Err(format!(
                        "unknown key `{key}` (known: method, format_score, score)"
                    ))
                }
            }
        }
        Ok(me)
    }
}

impl Plugin for Gsm8kReward {
    const NAME: &'static str = "gsm8k";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str =
        "verl's GSM8K rule: the `#### N` answer against the ground truth";
}

impl RewardPlugin for Gsm8kReward {
    fn open(config: &str) -> Result<Self, String> {
        if config.trim().is_empty() {
            return Ok(Self::default());
        }
        Self::from_json(config).map_err(|e| format!("gsm8k reward config `{config}`: {e}"))
    }

    fn extra_names(&self) -> Vec<String> {
        vec!["acc".into(), "has_answer".into()]
    }

    fn score(&mut self, row: &RewardInput<'_>) -> Result<RewardScore, String> {
        if row.ground_truth.is_empty() {
            return Err("no ground truth (verl's reward_model.ground_truth)".into());
        }
        let has_answer = rule::extract_solution(row.response, self.method).is_some();
        let (score, correct) = rule::compute_score(
            row.response,
            row.ground_truth,
            self.method,
            self.format_score,
            self.score,
        );
        Ok(RewardScore {
            score,
            extras: vec![
                f32::from(u8::from(correct)),
                f32::from(u8::from(has_answer)),
            ],
        })
    }
}

ferl_plugin_abi::export_reward!(Gsm8kReward);

#[cfg(test)]
mod tests;
