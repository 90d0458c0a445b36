//! Rewards of the plugin host ([`RewardFn`]: reward plugins, or closures of a driver) as the trainer's
//! [`Reward`], and verl's `naive` reward manager: each row is scored by the reward of its `data_source`.
//!
//! A row's `extra` (what the trainer hands the reward) carries `data_source` and verl's `extra_info`; the plugin sees
//! `extra_info` as JSON text.

use anyhow::{bail, Context, Result};
use ferl_plugin_host::{RewardFn, RewardInput};
use ferl_rl::{Reward, RewardRow};
use serde_json::Value;
use std::collections::BTreeMap;

/// The first-party reward plugin verl's `default_compute_score` would use for `data_source`, if ferl has one.
pub fn reward_plugin_for(data_source: &str) -> Option<&'static str> {
    match data_source {
        "openai/gsm8k" | "gsm8k" => Some("gsm8k"),
        _ => None,
    }
}

/// One [`RewardFn`] scoring every row.
pub struct PluginReward(Box<dyn RewardFn>);

impl PluginReward {
    /// Scores with `reward`.
    pub fn new(reward: Box<dyn RewardFn>) -> Self {
        Self(reward)
    }
}

impl Reward for PluginReward {
    fn name(&self) -> String {
        self.0.name()
    }

    fn score(&mut self, rows: &[RewardRow<'_>]) -> Result<Vec<f64>> {
        let extras: Vec<String> = rows.iter().map(|r| extra_info_text(r.extra)).collect();
        let inputs: Vec<RewardInput<'_>> = rows
            .iter()
            .zip(&extras)
            .map(|(r, extra_info)| RewardInput {
                prompt: r.prompt,
                response: r.response,
                ground_truth: r.ground_truth,
                extra_info,
            })
            .collect();
        let out = self.0.score_checked(&inputs)?;
        Ok(out.scores.into_iter().map(f64::from).collect())
    }
}

/// verl's `naive` reward manager: the rows of each `data_source` are scored by that source's reward.
pub struct DataSourceReward {
    by_source: BTreeMap<String, PluginReward>,
}

impl DataSourceReward {
    /// Routes rows by their `data_source` to `rewards` (source → reward).
    pub fn new(rewards: BTreeMap<String, PluginReward>) -> Self {
        Self { by_source: rewards }
    }
}

impl Reward for DataSourceReward {
    fn name(&self) -> String {
        let names: Vec<String> = self.by_source.values().map(|r| r.name()).collect();
        format!("naive({})", names.join(","))
    }

    fn score(&mut self, rows: &[RewardRow<'_>]) -> Result<Vec<f64>> {
        let mut by_source: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, r) in rows.iter().enumerate() {
            let source = r
                .extra
                .get("data_source")
                .and_then(Value::as_str)
                .unwrap_or("");
            by_source.entry(source).or_default().push(i);
        }
        let mut scores = vec![0.0; rows.len()];
        for (source, index) in by_source {
            let Some(reward) = self.by_source.get_mut(source) else {
                bail!(
                    "row {}: no reward for data_source `{source}` (rewards are set for: {})",
                    index[0],
                    self.by_source
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            };
            let subset: Vec<RewardRow<'_>> = index.iter().map(|&i| rows[i]).collect();
            let got = reward
                .score(&subset)
                .with_context(|| format!("scoring the rows of data_source `{source}`"))?;
            for (i, s) in index.into_iter().zip(got) {
                scores[i] = s;
            }
        }
        Ok(scores)
    }
}

/// verl's `extra_info` of a row as JSON text: `extra.extra_info` when present, else nothing.
fn extra_info_text(extra: &Value) -> String {
    match extra.get("extra_info") {
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferl_plugin_host::FnReward;

    fn row<'a>(response: &'a str, extra: &'a Value) -> RewardRow<'a> {
        RewardRow {
            prompt: "p",
            response,
            ground_truth: "7",
            prompt_ids: &[],
            response_ids: &[],
            extra,
        }
    }

    fn exact(name: &str) -> PluginReward {
        let f = FnReward::new(name, |r: &RewardInput<'_>| {
            Ok(f32::from(u8::from(r.response == r.ground_truth)))
        });
        PluginReward::new(Box::new(f))
    }

    #[test]
    fn rows_go_to_their_data_sources_reward_and_unknown_sources_are_named() {
        let (a, b) = (
            serde_json::json!({"data_source": "a", "extra_info": {"k": 1}}),
            serde_json::json!({"data_source": "b"}),
        );
        let mut rewards = BTreeMap::new();
        rewards.insert("a".to_string(), exact("ra"));
        let half = FnReward::new("rb", |_: &RewardInput<'_>| Ok(0.5));
        rewards.insert("b".to_string(), PluginReward::new(Box::new(half)));
        let mut naive = DataSourceReward::new(rewards);
        let rows = [row("7", &a), row("x", &b), row("8", &a)];
        assert_eq!(naive.score(&rows).unwrap(), vec![1.0, 0.5, 0.0]);
        let c = serde_json::json!({"data_source": "c"});
        let err = naive.score(&[row("7", &c)]).unwrap_err().to_string();
        assert!(
            err.contains("data_source `c`") && err.contains("a, b"),
            "{err}"
        );
    }

    #[test]
    fn the_plugin_sees_extra_info_as_json_text() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let s = seen.clone();
        let f = FnReward::new("spy", move |r: &RewardInput<'_>| {
            *s.lock().unwrap() = r.extra_info.to_string();
            Ok(1.0)
        });
        let extra = serde_json::json!({"data_source": "a", "extra_info": {"index": 3}});
        PluginReward::new(Box::new(f))
            .score(&[row("7", &extra)])
            .unwrap();
        assert_eq!(*seen.lock().unwrap(), r#"{"index":3}"#);
    }

    #[test]
    fn first_party_rewards_by_data_source() {
        assert_eq!(reward_plugin_for("openai/gsm8k"), Some("gsm8k"));
        assert_eq!(reward_plugin_for("lighteval/MATH"), None);
    }
}
