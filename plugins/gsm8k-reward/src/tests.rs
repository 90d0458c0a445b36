//! The verl scorer table: responses and the score verl's `gsm8k.compute_score` gives them (derived from its rule:
//! the last 300 characters; strict = the last `#### N`, commas and `$` removed; flexible = the last number run that
//! is not `.`, commas kept; text equality with the ground truth). `format_score` is 0.1 so a wrong answer (0.1) and
//! no answer (0) differ.

use super::*;
use rule::{compute_score, Method::*};

const F: f32 = 0.1;

/// `(what, response, ground truth, method, expected score)` for fixed responses.
const CASES: &[(&str, &str, &str, Method, f32)] = &[
    ("correct", "3 + 4 = 7\n#### 7", "7", Strict, 1.0),
    ("correct, flexible", "3 + 4 = 7\n#### 7", "7", Flexible, 1.0),
    ("wrong", "#### 8", "7", Strict, F),
    ("wrong, flexible", "I think 8", "7", Flexible, F),
    ("missing ####", "The answer is 7", "7", Strict, 0.0),
    (
        "missing ####, flexible",
        "The answer is 7",
        "7",
        Flexible,
        1.0,
    ),
    ("no space after ####", "####7", "7", Strict, 0.0),
    ("empty response", "", "7", Strict, 0.0),
    ("empty response, flexible", "", "7", Flexible, 0.0),
    ("commas removed", "#### 1,234", "1234", Strict, 1.0),
    ("commas kept, flexible", "#### 1,234", "1234", Flexible, F),
    ("negative", "#### -5", "-5", Strict, 1.0),
    ("negative, wrong sign", "#### 5", "-5", Strict, F),
    ("sign apart from digits", "#### - 5", "-5", Strict, 0.0),
    ("sign apart, flexible", "#### - 5", "-5", Flexible, F),
    ("plus sign", "#### +5", "5", Strict, 0.0),
    ("minus in an equation", "9-4=5", "5", Flexible, 1.0),
    ("dollar before", "#### $18", "18", Strict, 0.0),
    (
        "dollar before, flexible",
        "It costs $18",
        "18",
        Flexible,
        1.0,
    ),
    ("dollar after", "#### 18$", "18", Strict, 1.0),
    ("decimal zeros", "#### 18.00", "18", Strict, F),
    ("decimal", "#### 2.5", "2.5", Strict, 1.0),
    ("trailing period", "#### 18.", "18", Strict, F),
    (
        "trailing period, flexible",
        "so it is 18.",
        "18",
        Flexible,
        F,
    ),
    ("only a period, flexible", "Done.", "18", Flexible, F),
    ("no number, flexible", "Done", "18", Flexible, 0.0),
    (
        "last #### wins",
        "#### 5\nno wait\n#### 7",
        "7",
        Strict,
        1.0,
    ),
    (
        "earlier #### ignored",
        "#### 7\nno wait\n#### 5",
        "7",
        Strict,
        F,
    ),
    (
        "last number, flexible",
        "#### 7 (checked 3 times)",
        "7",
        Flexible,
        F,
    ),
];

/// `(what, response, ground truth, method, expected score)`: [`CASES`], then the cases of the 300-character clip.
fn table() -> Vec<(&'static str, String, &'static str, Method, f32)> {
    let fixed = CASES
        .iter()
        .map(|&(what, response, gt, method, want)| (what, response.to_string(), gt, method, want));
    let clipped = [
        ("300 chars kept", format!("#### 7{}", "x".repeat(294)), 1.0),
        (
            "301 chars clipped",
            format!("#### 7{}", "x".repeat(295)),
            0.0,
        ),
        (
            "clip counts characters",
            format!("#### 7{}", "é".repeat(294)),
            1.0,
        ),
    ]
    .map(|(what, response, want)| (what, response, "7", Strict, want));
    fixed.chain(clipped).collect()
}

#[test]
fn agrees_with_verls_scorer() {
    let mut failures = Vec::new();
    for (what, response, gt, method, want) in table() {
        let (got, _) = compute_score(&response, gt, method, F, 1.0);
        if got != want {
            failures.push(format!(
                "{what}: {response:?} gt {gt} {method:?}: got {got}, want {want}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn plugin_scores_rows_with_extras_and_names_bad_rows() {
    let mut r = Gsm8kReward::open(r#"{"format_score": 0.1}"#).unwrap();
    assert_eq!(r.method, Strict);
    let row = |response, ground_truth| RewardInput {
        prompt: "q",
        response,
        ground_truth,
        extra_info: "",
    };
    let out = r
        .score_batch(&[row("#### 7", "7"), row("#### 8", "7"), row("7", "7")])
        .unwrap();
    let got: Vec<(f32, Vec<f32>)> = out.into_iter().map(|s| (s.score, s.extras)).collect();
    assert_eq!(
        got,
        vec![
            (1.0, vec![1.0, 1.0]),
            (0.1, vec![0.0, 1.0]),
            (0.0, vec![0.0, 0.0])
        ]
    );
    let e = r
        .score_batch(&[row("#### 7", "7"), row("#### 7", "")])
        .unwrap_err();
    assert!(e.starts_with("row 1: no ground truth"), "{e}");
    let e = Gsm8kReward::open(r#"{"methd": "strict"}"#).unwrap_err();
    assert!(e.contains("unknown key `methd`"), "{e}");
    let e = Gsm8kReward::open(r#"{"method": "loose"}"#).unwrap_err();
    assert!(e.contains("`method` is \"loose\""), "{e}");
    let e = Gsm8kReward::open(r#"{"score": "high"}"#).unwrap_err();
    assert!(e.contains("`score` must be a finite number"), "{e}");
    assert_eq!(Gsm8kReward::open("").unwrap(), Gsm8kReward::default());
}
