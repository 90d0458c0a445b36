//! The template's reward function: 1 when the response, trimmed, equals the ground truth, else 0, with the
//! response's length in characters as a named extra. Build it as the library's plugin with `--features reward`
//! (a library exports one plugin: the logger by default, this reward with the feature).

use ferl_plugin_abi::reward::{RewardInput, RewardPlugin, RewardScore};
use ferl_plugin_abi::Plugin;

/// The reward; its config is empty, or `ignore_case` to compare without case.
#[derive(Debug)]
pub struct ExactMatch {
    ignore_case: bool,
}

impl Plugin for ExactMatch {
    // The name a trainer asks for.
    const NAME: &'static str = "template-reward";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str = "exact match against the ground truth (plugin template)";
}

impl RewardPlugin for ExactMatch {
    fn open(config: &str) -> Result<Self, String> {
        match config.trim() {
            "" => Ok(Self { ignore_case: false }),
            "ignore_case" => Ok(Self { ignore_case: true }),
            other => Err(format!(
                "unknown config `{other}` (expected nothing or `ignore_case`)"
            )),
        }
    }

    fn extra_names(&self) -> Vec<String> {
        vec!["response_chars".to_string()]
    }

    fn score(&mut self, row: &RewardInput<'_>) -> Result<RewardScore, String> {
        // Errors are ordinary `Err`s: the host reports them with the plugin's name and the row's index.
        if row.ground_truth.is_empty() {
            return Err("no ground truth to compare with".to_string());
        }
        let (got, want) = (row.response.trim(), row.ground_truth.trim());
        let equal = if self.ignore_case {
            got.to_lowercase() == want.to_lowercase()
        } else {
            got == want
        };
        Ok(RewardScore {
            score: if equal { 1.0 } else { 0.0 },
            extras: vec![row.response.chars().count() as f32],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_exact_matches() {
        let row = |response| RewardInput {
            prompt: "2+2?",
            response,
            ground_truth: "Four",
            extra_info: "",
        };
        let mut strict = ExactMatch::open("").unwrap();
        let mut loose = ExactMatch::open("ignore_case").unwrap();
        assert_eq!(strict.score(&row(" Four\n")).unwrap().score, 1.0);
        assert_eq!(strict.score(&row("four")).unwrap().score, 0.0);
        assert_eq!(loose.score(&row("four")).unwrap().extras, vec![4.0]);
        assert_eq!(loose.score(&row("four")).unwrap().score, 1.0);
        assert!(ExactMatch::open("fuzzy").unwrap_err().contains("fuzzy"));
    }
}
