//! Reward plugins through the host: the first-party `gsm8k`, the template's reward, the testkit's failures, hot
//! versions, and rewards written in a driver behind the same [`RewardFn`] trait.

mod common;

use ferl_plugin_host::{
    FnReward, HotReward, LoggerInstance, PluginHost, PluginKind, RewardFn, RewardInput,
    RewardInstance,
};
use std::sync::Arc;

fn row<'a>(response: &'a str, ground_truth: &'a str) -> RewardInput<'a> {
    RewardInput {
        prompt: "Natalia sold clips to 48 of her friends...",
        response,
        ground_truth,
        extra_info: r#"{"split":"test","index":0}"#,
    }
}

fn load(
    host: &PluginHost,
    package: &str,
    features: &[&str],
) -> Arc<ferl_plugin_host::LoadedPlugin> {
    host.load_file(
        &common::build(package, features, &[]),
        Some(PluginKind::Reward),
    )
    .unwrap_or_else(|e| panic!("{e:#}"))
}

fn err_text<T>(r: anyhow::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn gsm8k_scores_a_batch_with_extras() {
    let dir = tempfile::tempdir().unwrap();
    let host = PluginHost::new(dir.path().join("copies"));
    let p = load(&host, "ferl-plugin-gsm8k", &[]);
    assert_eq!(
        (p.info().name.as_str(), p.info().kind),
        ("gsm8k", PluginKind::Reward)
    );
    let rows = [
        row("48 + 24 = 72\n#### 72", "72"),
        row("#### 71", "72"),
        row("The answer is 72", "72"),
        row("#### 1,234", "1234"),
        row("#### -5", "-5"),
    ];
    let mut strict = RewardInstance::open(p.clone(), r#"{"format_score": 0.1}"#).unwrap();
    assert_eq!(strict.extra_names(), ["acc", "has_answer"]);
    let out = strict.score(&rows).unwrap();
    assert_eq!(out.scores, [1.0, 0.1, 0.0, 1.0, 1.0]);
    assert_eq!(out.extra("acc").unwrap(), [1.0, 0.0, 0.0, 1.0, 1.0]);
    assert_eq!(out.extra("has_answer").unwrap(), [1.0, 1.0, 0.0, 1.0, 1.0]);
    let mut flexible = RewardInstance::open(p, r#"{"method": "flexible"}"#).unwrap();
    assert_eq!(
        flexible.score(&rows).unwrap().scores,
        [1.0, 0.0, 1.0, 0.0, 1.0]
    );
    assert_eq!(flexible.score(&[]).unwrap().scores, Vec::<f32>::new());
}

#[test]
fn gsm8k_errors_name_the_plugin_and_the_row() {
    let dir = tempfile::tempdir().unwrap();
    let host = PluginHost::new(dir.path().join("copies"));
    let p = load(&host, "ferl-plugin-gsm8k", &[]);
    let mut r = RewardInstance::open(p.clone(), "").unwrap();
    let e = r
        .score(&[row("#### 1", "1"), row("#### 2", "")])
        .unwrap_err();
    assert!(!e.panicked);
    let text = e.to_string();
    assert!(
        text.contains("gsm8k@")
            && text.contains("score(2 rows)")
            && text.contains("row 1: no ground truth"),
        "{text}"
    );
    // The instance stays usable after an ordinary error.
    assert_eq!(r.score(&[row("#### 1", "1")]).unwrap().scores, [1.0]);
    let e = err_text(RewardInstance::open(
        p,
        r#"{"method": "strict", "scor": 2}"#,
    ));
    assert!(
        e.contains("open(") && e.contains("unknown key `scor`"),
        "{e}"
    );
    // A reward where a logger is expected, and a logger where a reward is expected, are refused.
    let file = common::build("ferl-plugin-gsm8k", &[], &[]);
    let e = err_text(host.load_file(&file, Some(PluginKind::Logger)));
    assert!(
        e.contains("says kind reward, but a logger plugin was expected"),
        "{e}"
    );
    let logger = host
        .load_file(&common::testkit_logger("1.0.0"), None)
        .unwrap();
    let e = err_text(RewardInstance::open(logger.clone(), ""));
    assert!(e.contains("is a logger plugin, not a reward"), "{e}");
    let e = err_text(LoggerInstance::open(
        host.get_kind("gsm8k", PluginKind::Reward).unwrap(),
        "x",
    ));
    assert!(e.contains("is a reward plugin, not a logger"), "{e}");
}

#[test]
fn template_reward_loads_with_its_feature() {
    let dir = tempfile::tempdir().unwrap();
    let host = PluginHost::new(dir.path().join("copies"));
    let p = load(&host, "ferl-plugin-template", &["reward"]);
    assert_eq!(p.info().name, "template-reward");
    let mut r = RewardInstance::open(p, "ignore_case").unwrap();
    let out = r
        .score(&[row(" Seventy-two ", "seventy-two"), row("72", "71")])
        .unwrap();
    assert_eq!(out.scores, [1.0, 0.0]);
    assert_eq!(out.extra("response_chars").unwrap(), [13.0, 2.0]);
}

#[test]
fn testkit_panic_poisons_and_nan_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let host = PluginHost::new(dir.path().join("copies"));
    let p = load(&host, "ferl-plugin-testkit", &["reward"]);
    let rows = [row("abc", "de"), row("", "xyz"), row("hello", "")];
    let mut ok = RewardInstance::open(p.clone(), "").unwrap();
    let out = ok.score(&rows).unwrap();
    assert_eq!(
        (out.scores.as_slice(), out.extra("gt_chars").unwrap()),
        ([3.0, 0.0, 5.0].as_slice(), [2.0, 3.0, 0.0].as_slice())
    );
    let mut nan = RewardInstance::open(p.clone(), "nan_at=2").unwrap();
    let e = nan.score(&rows).unwrap_err().to_string();
    assert!(
        e.contains("testkit@") && e.contains("row 2: score is NaN"),
        "{e}"
    );
    let mut panics = RewardInstance::open(p, "panic_at=1").unwrap();
    let e = panics.score(&rows).unwrap_err();
    assert!(e.panicked && e.message.contains("panic at row 1"), "{e}");
    let e = panics.score(&rows[..1]).unwrap_err();
    assert!(
        !e.panicked && e.message.contains("unusable after an earlier panic"),
        "{e}"
    );
}

#[test]
fn hot_reward_follows_new_versions_and_reopens_after_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let host = Arc::new(PluginHost::new(dir.path().join("copies")));
    let build = |v: &str| {
        common::build(
            "ferl-plugin-testkit",
            &["reward"],
            &[("FERL_TESTKIT_VERSION", v)],
        )
    };
    let installed = plugins.join(format!("libtestkit{}", std::env::consts::DLL_SUFFIX));
    std::fs::copy(build("1.0.0"), &installed).unwrap();
    host.load_file(&installed, Some(PluginKind::Reward))
        .unwrap();
    let mut hot = HotReward::new(host.clone(), "testkit", "panic_at=3").unwrap();
    assert_eq!(hot.version().as_deref(), Some("1.0.0"));
    assert_eq!(hot.score_checked(&[row("ab", "c")]).unwrap().scores, [2.0]);
    let four = [row("a", ""), row("b", ""), row("c", ""), row("d", "")];
    let e = err_text(hot.score(&four));
    assert!(e.contains("panicked") && e.contains("row 3"), "{e}");
    // A fresh instance after the panic: the next batch is scored again.
    assert_eq!(hot.score(&four[..1]).unwrap().scores, [1.0]);
    std::fs::copy(build("2.0.0"), &installed).unwrap();
    host.reload("testkit").unwrap();
    host.step_boundary();
    hot.score(&four[..1]).unwrap();
    assert_eq!(hot.version().as_deref(), Some("2.0.0"));
    assert_eq!(
        host.loaded_versions("testkit"),
        1,
        "the old version was not unloaded"
    );
    let e = err_text(HotReward::new(host, "gsm8k", ""));
    assert!(e.contains("gsm8k"), "{e}");
}

#[test]
fn driver_rewards_and_plugins_share_the_trait() {
    let dir = tempfile::tempdir().unwrap();
    let host = Arc::new(PluginHost::new(dir.path().join("copies")));
    load(&host, "ferl-plugin-gsm8k", &[]);
    let contains = FnReward::new("contains", |r: &RewardInput<'_>| {
        if r.ground_truth.is_empty() {
            anyhow::bail!("empty ground truth");
        }
        Ok(if r.response.contains(r.ground_truth) {
            1.0
        } else {
            0.0
        })
    });
    let mut rewards: Vec<Box<dyn RewardFn>> = vec![
        Box::new(HotReward::new(host, "gsm8k", "").unwrap()),
        Box::new(contains),
    ];
    let rows = [
        row("so 72\n#### 72", "72"),
        row("it is 72", "72"),
        row("#### 7", "72"),
    ];
    let scores: Vec<Vec<f32>> = rewards
        .iter_mut()
        .map(|r| r.score_checked(&rows).unwrap().scores)
        .collect();
    assert_eq!(scores, [vec![1.0, 0.0, 0.0], vec![1.0, 1.0, 0.0]]);
    let e = err_text(rewards[1].score_checked(&[row("x", "1"), row("y", "")]));
    assert!(
        e.contains("reward `contains`: row 1: empty ground truth"),
        "{e}"
    );
    let mut nan = FnReward::new("nan", |_: &RewardInput<'_>| Ok(f32::NAN));
    let e = err_text(nan.score_checked(&rows));
    assert!(e.contains("reward `nan`: row 0: score is NaN"), "{e}");
}
