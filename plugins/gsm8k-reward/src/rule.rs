//! verl's GSM8K rule (`verl/utils/reward_score/gsm8k.py`, ReFT's scorer), written from its behaviour:
//!
//! 1. Only the last 300 characters (Unicode scalar values, as Python slices a `str`) of the response are read.
//! 2. `strict`: the answer is the number after the **last** `#### ` (`#### ` then `-?[0-9.,]+`), with `,` and `$`
//!    removed; no `#### N` means no answer.
//! 3. `flexible`: the answer is the last run of `-?[0-9.,]+` that is not `.` (when every run is `.`, the first run
//!    is kept, as verl's loop leaves it); commas are kept; no run means no answer.
//! 4. Score: no answer → 0; the answer equal (as text) to the ground truth → `score`; else `format_score`.

use regex::Regex;
use std::sync::LazyLock;

/// How many trailing characters of a response verl reads.
pub const CLIP_CHARS: usize = 300;

static STRICT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"#### (-?[0-9.,]+)").expect("valid regex"));
static NUMBER: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"-?[0-9.,]+").expect("valid regex"));

/// verl's `method`: where the answer is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// The `#### N` line (the default; it also checks the model's format).
    Strict,
    /// The last number anywhere.
    Flexible,
}

/// The last [`CLIP_CHARS`] characters of `s`.
fn clip(s: &str) -> &str {
    match s.char_indices().rev().nth(CLIP_CHARS - 1) {
        Some((start, _)) => &s[start..],
        None => s,
    }
}

/// The answer `method` reads from `response`, or `None` when there is none.
pub fn extract_solution(response: &str, method: Method) -> Option<String> {
    let text = clip(response);
    match method {
        Method::Strict => STRICT
            .captures_iter(text)
            .last()
            .map(|c| c[1].replace([',', '$'], "")),
        Method::Flexible => {
            let runs: Vec<&str> = NUMBER.find_iter(text).map(|m| m.as_str()).collect();
            let first = *runs.first()?;
            let last_valid = runs.iter().rev().find(|r| !matches!(**r, "" | "."));
            Some(last_valid.copied().unwrap_or(first).to_string())
        }
    }
}

/// verl's `compute_score`: 0 without an answer, `score` when it equals `ground_truth`, else `format_score`.
/// Returns the score and whether the answer was correct.
pub fn compute_score(
    response: &str,
    ground_truth: &str,
    method: Method,
    format_score: f32,
    score: f32,
) -> (f32, bool) {
    match extract_solution(response, method) {
        None => (0.0, false),
        Some(answer) if answer == ground_truth => (score, true),
        Some(_) => (format_score, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_counts_characters_not_bytes() {
        let s = "é".repeat(CLIP_CHARS + 5);
        assert_eq!(clip(&s).chars().count(), CLIP_CHARS);
        assert_eq!(clip("short"), "short");
        let exact = "a".repeat(CLIP_CHARS);
        assert_eq!(clip(&exact), exact);
    }

    #[test]
    fn extracts_as_verl() {
        use Method::*;
        let cases: &[(&str, Method, Option<&str>)] = &[
            ("so 3 + 4 = 7\n#### 7", Strict, Some("7")),
            ("#### 1,234", Strict, Some("1234")),
            ("#### 1,234", Flexible, Some("1,234")),
            ("#### 5 then #### 6", Strict, Some("6")),
            ("it is 7.", Flexible, Some("7.")),
            ("Done.", Flexible, Some(".")),
            ("no digits", Flexible, None),
            ("####7", Strict, None),
            ("5-3=2", Flexible, Some("2")),
            ("#### -3.5", Strict, Some("-3.5")),
        ];
        for (text, method, want) in cases {
            assert_eq!(
                extract_solution(text, *method).as_deref(),
                *want,
                "{text:?} {method:?}"
            );
        }
    }
}
