//! The verl scorer table: responses and the score verl's `gsm8k.compute_score` gives them (derived from its rule:
//! the last 300 characters; strict = the last `#### N`, commas and `$` removed; flexible = the last number run that
//! is not `.`, commas kept; text equality with the ground truth). `format_score` is 0.1 so a wrong answer (0.1) and
//! no answer (0) differ.

use super::*;
use rule::{compute_score, Method::*};

const F: f32 = 0.1;

/// `(what, response, ground truth, method, expected score)`.
fn table() -> Vec<(&'static str, String, &'static str, Method, f32)> {
    let s = |x: &str| x.to_string();
    vec![
        ("correct", s("3 + 4 = 7\n#### 7"), "7", Strict, 1.0),
        (
            "correct, flexible",
            s("3 + 4 = 7\n#### 7"),
            "7",
            Flexible,
            1.0,
        ),
        ("wrong", s("#### 8"), "7", Strict, F),
        ("wrong, flexible", s("I think 8"), "7", Flexible, F),
        ("missing ####", s("The answer is 7"), "7", Strict, 0.0),
        (
            "missing ####, flexible",
            s("The answer is 7"),
            "7",
            Flexible,
            1.0,
        ),
        ("no space after ####", s("####7"), "7", Strict, 0.0),
        ("empty response", s(""), "7", Strict, 0.0),
        ("empty response, flexible", s(""), "7", Flexible, 0.0),
        ("commas removed", s("#### 1,234"), "1234", Strict, 1.0),
        (
            "commas kept, flexible",
            s("#### 1,234"),
            "1234",
            Flexible,
            F,
        ),
        ("negative", s("#### -5"), "-5", Strict, 1.0),
        ("negative, wrong sign", s("#### 5"), "-5", Strict, F),
        ("sign apart from digits", s("#### - 5"), "-5", Strict, 0.0),
        ("sign apart, flexible", s("#### - 5"), "-5", Flexible, F),
        ("plus sign", s("#### +5"), "5", Strict, 0.0),
        ("minus in an equation", s("9-4=5"), "5", Flexible, 1.0),
        ("dollar before", s("#### $18"), "18", Strict, 0.0),
        (
            "dollar before, flexible",
            s("It costs $18"),
            "18",
            Flexible,
            1.0,
        ),
        ("dollar after", s("#### 18$"), "18", Strict, 1.0),
        ("decimal zeros", s("#### 18.00"), "18", Strict, F),
        ("decimal", s("#### 2.5"), "2.5", Strict, 1.0),
        ("trailing period", s("#### 18."), "18", Strict, F),
        (
            "trailing period, flexible",
            s("so it is 18."),
            "18",
            Flexible,
            F,
        ),
        ("only a period, flexible", s("Done."), "18", Flexible, F),
        ("no number, flexible", s("Done"), "18", Flexible, 0.0),
        (
            "last #### wins",
            s("#### 5\nno wait\n#### 7"),
            "7",
            Strict,
            1.0,
        ),
        (
            "earlier #### ignored",
            s("#### 7\nno wait\n#### 5"),
            "7",
            Strict,
            F,
        ),
        (
            "last number, flexible",
            s("#### 7 (checked 3 times)"),
            "7",
            Flexible,
            F,
        ),
        (
            "300 chars kept",
            format!("#### 7{}", "x".repeat(294)),
            "7",
            Strict,
            1.0,
        ),
        (
            "301 chars clipped",
            format!("#### 7{}", "x".repeat(295)),
            "7",
            Strict,
            0.0,
        ),
        (
            "clip counts characters",
            format!("#### 7{}", "é".repeat(294)),
            "7",
            Strict,
            1.0,
        ),
    ]
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
