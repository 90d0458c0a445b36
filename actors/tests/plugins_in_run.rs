//! The plugins inside real one-process runs (world 1 of the one run loop): a logger plugin replaced in the middle
//! of training switches at the next step without changing the losses, a dataset plugin feeds the tokenizer,
//! `model.use_liger=true` (RMSNorm, SwiGLU and the head through the `liger` kernels) matches the built-in ops, and
//! the plugins' step boundary serves reload requests.

#[path = "../../plugins/bridge/tests/common/mod.rs"]
mod common;

use common::{build, tiny_model};
use ferl_actors::sft::{run_in_process_with_data, InProcessOptions, RunSummary};
use ferl_data::SftDataset;
use ferl_plugin_bridge::{job_plugin_host, plugin_dataset, StepBoundary};
use ferl_plugin_host::cargo_build::workspace_root;
use ferl_trainer::config::SftConfig;
use ferl_trainer::metrics::{LoggerRegistry, MetricsLogger};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

fn quiet() -> InProcessOptions {
    InProcessOptions::default()
}

fn run_with_data(
    cfg: &SftConfig,
    train: &dyn Fn() -> SftDataset,
    val: Option<SftDataset>,
    opts: InProcessOptions,
) -> anyhow::Result<RunSummary> {
    run_in_process_with_data(cfg.clone(), train(), val, opts)
}

fn dataset() -> SftDataset {
    common::dataset(16)
}

fn config(model: &Path, run_dir: &Path, loggers: &str) -> SftConfig {
    let o: Vec<String> = vec![
        format!("model.partial_pretrain={}", model.display()),
        format!("trainer.default_local_dir={}", run_dir.display()),
        "trainer.device=cpu".into(),
        "data.train_batch_size=4".into(),
        "data.micro_batch_size_per_gpu=2".into(),
        "trainer.total_epochs=2".into(),
        "optim.lr=1e-2".into(),
        format!("trainer.logger={loggers}"),
    ];
    SftConfig::load(None, &o).unwrap()
}

/// Replaces the installed plugin file with another build after logging step `at`.
struct Swapper {
    at: i64,
    from: PathBuf,
    to: PathBuf,
}

impl MetricsLogger for Swapper {
    fn log(&mut self, step: i64, _: &[(String, f64)]) -> anyhow::Result<()> {
        if step == self.at {
            let tmp = self.to.with_extension("tmp");
            std::fs::copy(&self.from, &tmp)?;
            std::fs::rename(&tmp, &self.to)?;
        }
        Ok(())
    }
}

#[test]
fn hot_reload_mid_training_switches_at_next_step_and_keeps_losses() {
    tch::set_num_threads(1);
    let (v1, v2) = (
        build("ferl-plugin-testkit", &[("FERL_TESTKIT_VERSION", "1.0.0")]),
        build("ferl-plugin-testkit", &[("FERL_TESTKIT_VERSION", "2.0.0")]),
    );
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let train = dataset; // 16 samples: 4 steps per epoch, 8 steps

    let plain = run_with_data(
        &config(&model, &dir.path().join("plain"), "[jsonl]"),
        &train,
        None,
        quiet(),
    )
    .unwrap();

    let folder = dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    let installed = folder.join(format!("testkit{}", std::env::consts::DLL_SUFFIX));
    std::fs::copy(&v1, &installed).unwrap();
    let run_dir = dir.path().join("hot");
    let mut loggers = LoggerRegistry::default();
    let (from, to) = (v2.clone(), installed.clone());
    loggers.register(
        "swapper",
        Box::new(move |_| {
            Ok(Box::new(Swapper {
                at: 3,
                from: from.clone(),
                to: to.clone(),
            }))
        }),
    );
    let opts = InProcessOptions {
        loggers: Some(loggers),
        plugin_folders: vec![folder],
        ..quiet()
    };
    let hot = run_with_data(
        &config(&model, &run_dir, "[testkit,swapper]"),
        &train,
        None,
        opts,
    )
    .unwrap();

    assert_eq!(
        hot.losses(),
        plain.losses(),
        "a logger reload does not touch training"
    );
    let text = std::fs::read_to_string(run_dir.join("testkit.log")).unwrap();
    let mut seen = Vec::new();
    for line in text.lines() {
        let mut f = line.split(' ');
        let (version, step) = (f.next().unwrap(), f.next().unwrap().parse::<i64>().unwrap());
        let want = if step <= 3 { "1.0.0" } else { "2.0.0" };
        assert_eq!(version, want, "step {step} logged by {version}:\n{text}");
        seen.push(step);
    }
    assert!(
        seen.contains(&1) && seen.contains(&8),
        "every step logged:\n{text}"
    );
    // The run's host unloaded every version when the run ended and removed their private copies.
    let copies = run_dir.join("plugins/copies");
    let left = std::fs::read_dir(&copies).map_or(0, |d| d.count());
    assert_eq!(
        left,
        0,
        "private plugin copies left in {}",
        copies.display()
    );
}

#[test]
fn alpaca_plugin_feeds_the_trainer_tokenizer() {
    let ws = workspace_root(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(
        build("ferl-plugin-alpaca", &[]),
        folder.join(format!("alpaca{}", std::env::consts::DLL_SUFFIX)),
    )
    .unwrap();
    let host = job_plugin_host(&dir.path().join("run"), &[folder]).unwrap();
    let data = dir.path().join("train.json");
    std::fs::write(&data, r#"[{"instruction":"Add the numbers.","input":"2 and 2","output":"4"},{"instruction":"Say hi.","output":"hi"}]"#).unwrap();
    let cfg = SftConfig::load(
        None,
        &[
            "data.plugin=alpaca".to_string(),
            "data.max_length=256".to_string(),
        ],
    )
    .unwrap();
    let ds = plugin_dataset(
        &host,
        &cfg.data,
        &[data.display().to_string()],
        &ws.join("assets/tokenizers/qwen3"),
        -1,
    )
    .unwrap();
    assert_eq!(ds.len(), 2);
    for i in 0..2 {
        let s = ds.get(i);
        let trained = s.loss_mask.iter().filter(|m| **m).count();
        // The response and its EOS are trained on, the prompt is not.
        assert!(
            trained >= 2 && trained < s.input_ids.len(),
            "sample {i}: {trained} of {} tokens trained",
            s.input_ids.len()
        );
        assert!(!s.loss_mask[0]);
    }
}

/// `(step, train/loss, train/grad_norm)` of every step, shared with the test.
type Curve = Arc<Mutex<Vec<(i64, f64, f64)>>>;

/// A logger kind `record` that keeps each step's loss and grad norm.
struct Recorder(Curve);

impl MetricsLogger for Recorder {
    fn log(&mut self, step: i64, metrics: &[(String, f64)]) -> anyhow::Result<()> {
        let get = |k: &str| metrics.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        if let (Some(l), Some(g)) = (get("train/loss"), get("train/grad_norm")) {
            self.0.lock().unwrap().push((step, l, g));
        }
        Ok(())
    }
}

/// Run options with a `record` logger feeding the returned curve.
fn recording() -> (InProcessOptions, Curve) {
    let curve = Curve::default();
    let mut loggers = LoggerRegistry::default();
    let c = curve.clone();
    loggers.register(
        "record",
        Box::new(move |_| Ok(Box::new(Recorder(c.clone())) as Box<dyn MetricsLogger>)),
    );
    let opts = InProcessOptions {
        loggers: Some(loggers),
        ..quiet()
    };
    (opts, curve)
}

fn assert_curves_match(what: &str, a: &Curve, b: &Curve, tol: f64) {
    let (a, b) = (a.lock().unwrap().clone(), b.lock().unwrap().clone());
    assert_eq!(a.len(), b.len(), "{what}: steps");
    assert!(!a.is_empty(), "{what}: no steps recorded");
    for ((s, la, ga), (t, lb, gb)) in a.iter().zip(&b) {
        assert_eq!(s, t);
        assert!((la - lb).abs() <= tol, "{what}: step {s} loss {la} vs {lb}");
        assert!(
            (ga - gb).abs() <= tol,
            "{what}: step {s} grad norm {ga} vs {gb}"
        );
    }
}

/// `model.use_liger=true` runs RMSNorm, SwiGLU and the head through the `liger` plugin file; per step, loss and
/// grad norm match the built-in ops within 1e-4, with and without gradient checkpointing.
#[test]
fn use_liger_matches_the_builtin_ops_within_1e_4_per_step() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let train = dataset;

    // The liger plugin loaded from its file through the job's host.
    let folder = dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(
        build("ferl-plugin-liger", &[]),
        folder.join(format!("liger{}", std::env::consts::DLL_SUFFIX)),
    )
    .unwrap();
    for checkpointing in [false, true] {
        let ckpt = format!("model.enable_gradient_checkpointing={checkpointing}");
        let run = |name: &str, liger: bool| {
            let mut cfg = config(&model, &dir.path().join(name), "[record]");
            cfg.model.enable_gradient_checkpointing = checkpointing;
            cfg.model.use_liger = liger;
            let (mut opts, curve) = recording();
            opts.plugin_folders = vec![folder.clone()];
            run_with_data(&cfg, &train, None, opts).unwrap();
            curve
        };
        let plain = run(&format!("plain-{checkpointing}"), false);
        let fused = run(&format!("liger-{checkpointing}"), true);
        assert_curves_match(&ckpt, &plain, &fused, 1e-4);
    }
}

/// The same in bf16 compute (fp32 masters), with the built-in copy of the kernels when no `liger` plugin file is
/// loaded: the kernels get fp32 inputs and the run stays within bf16's precision of the built-in ops (losses within
/// 2%, grad norms within 5%), with gradient checkpointing.
#[test]
fn use_liger_in_bf16_with_checkpointing_tracks_the_builtin_ops() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let train = dataset;
    let run = |name: &str, liger: bool| {
        let mut cfg = config(&model, &dir.path().join(name), "[record]");
        cfg.model.enable_gradient_checkpointing = true;
        cfg.model.use_liger = liger;
        cfg.model.fsdp_config.model_dtype = ferl_trainer::config::Dtype::Bf16;
        let (opts, curve) = recording();
        run_with_data(&cfg, &train, None, opts).unwrap();
        let c = curve.lock().unwrap().clone();
        c
    };
    let plain = run("plain", false);
    let fused = run("liger", true);
    assert_eq!(plain.len(), fused.len());
    for ((s, la, ga), (_, lb, gb)) in plain.iter().zip(&fused) {
        assert!(la.is_finite() && lb.is_finite() && ga.is_finite() && gb.is_finite());
        assert!(
            (la - lb).abs() <= 0.02 * la.abs(),
            "step {s}: loss {la} vs {lb}"
        );
        assert!(
            (ga - gb).abs() <= 0.05 * ga.abs(),
            "step {s}: grad norm {ga} vs {gb}"
        );
    }
}

/// The plugins' step boundary (run by the loop after every step) serves `ferl plugin reload` requests even when
/// no logger plugin is in use (the step boundary is the run's own hook, not a logger's side effect).
#[test]
fn step_boundary_serves_reload_requests_without_logger_plugins() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(
        build("ferl-plugin-liger", &[]),
        folder.join(format!("liger{}", std::env::consts::DLL_SUFFIX)),
    )
    .unwrap();
    let run_dir = dir.path().join("run");
    let host = job_plugin_host(&run_dir, &[folder]).unwrap();
    let mut boundary = StepBoundary::new(host.clone());
    let control = ferl_plugin_host::control::ControlDir::new(&run_dir);
    let id = control.submit_reload("liger").unwrap();
    boundary.run(1);
    let answer = control
        .wait_response(&id, std::time::Duration::from_secs(5))
        .unwrap();
    assert!(answer.ok, "{answer:?}");
    assert!(answer.message.contains("liger"), "{answer:?}");
    assert!(host.get("liger").is_some());
}
