//! The plugins inside real trainer runs (`ferl_trainer::sft::run_with_data`): a logger plugin replaced in the middle
//! of training switches at the next step without changing the losses, and a dataset plugin feeds the tokenizer.

use ferl_plugin_bridge::{job_plugin_host, plugin_dataset, register_logger_plugins, LigerHeadLoss};
use ferl_plugin_host::cargo_build::{build_plugin, workspace_root, PluginBuild};
use ferl_trainer::config::SftConfig;
use ferl_trainer::data::{SftDataset, TokenizedSample};
use ferl_trainer::metrics::{LoggerRegistry, MetricsLogger};
use ferl_trainer::sft::{run_with_data, RunOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn build(package: &str, env: &[(&str, &str)]) -> PathBuf {
    let ws = workspace_root(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
    let key: String = std::iter::once(package.to_string())
        .chain(env.iter().map(|(k, v)| format!("{k}={v}")))
        .collect::<Vec<_>>()
        .join("-");
    let target = std::env::temp_dir().join("ferl-plugin-builds").join(key);
    let spec = PluginBuild {
        package: package.into(),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    build_plugin(&ws, &target, &spec).unwrap_or_else(|e| panic!("{e:#}"))
}

fn tiny_model(dir: &Path) -> PathBuf {
    let cfg = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 97, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true,
        "hidden_act": "silu", "initializer_range": 0.02, "torch_dtype": "float32", "eos_token_id": 1
    });
    std::fs::create_dir_all(dir).unwrap();
    let file = dir.join("source_config.json");
    std::fs::write(&file, cfg.to_string()).unwrap();
    ferl_trainer::model::init_model(&file, None, &dir.join("model"), 3).unwrap();
    dir.join("model")
}

fn dataset(n: usize) -> SftDataset {
    let samples = (0..n)
        .map(|i| {
            let len = 6 + i % 7;
            TokenizedSample {
                input_ids: (0..len).map(|t| ((i * 31 + t * 7) % 97) as i64).collect(),
                loss_mask: (0..len).map(|t| t >= 2).collect(),
            }
        })
        .collect();
    SftDataset::from_samples(samples, 0, 1)
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
    let train = dataset(16); // 4 steps per epoch, 8 steps
    let quiet = || RunOptions {
        progress: false,
        ..RunOptions::default()
    };

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
    let host = job_plugin_host(&run_dir, &[folder]).unwrap();
    let mut loggers = LoggerRegistry::default();
    assert_eq!(register_logger_plugins(&mut loggers, &host), ["testkit"]);
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
    let opts = RunOptions { loggers, ..quiet() };
    let hot = run_with_data(
        &config(&model, &run_dir, "[testkit,swapper]"),
        &train,
        None,
        opts,
    )
    .unwrap();

    assert_eq!(
        hot.train_losses, plain.train_losses,
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
    // v1 is gone: one version loaded, one private copy left.
    assert_eq!(host.loaded_versions("testkit"), 1);
    assert_eq!(host.get("testkit").unwrap().info().version, "2.0.0");
    assert_eq!(
        std::fs::read_dir(run_dir.join("plugins/copies"))
            .unwrap()
            .count(),
        1
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

#[test]
fn use_liger_matches_the_plain_head_within_1e_4_per_step() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let train = dataset(16);
    let quiet = || RunOptions {
        progress: false,
        ..RunOptions::default()
    };
    let plain = run_with_data(
        &config(&model, &dir.path().join("plain"), "[jsonl]"),
        &train,
        None,
        quiet(),
    )
    .unwrap();

    // use_liger=true without a kernel is refused with a message saying what is missing.
    let mut cfg = config(&model, &dir.path().join("none"), "[jsonl]");
    cfg.model.use_liger = true;
    let e = format!(
        "{:#}",
        run_with_data(&cfg, &train, None, quiet()).unwrap_err()
    );
    assert!(
        e.contains("model.use_liger=true needs the liger kernel"),
        "{e}"
    );

    // The liger plugin loaded from its file through the job's host.
    let folder = dir.path().join("plugins");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(
        build("ferl-plugin-liger", &[]),
        folder.join(format!("liger{}", std::env::consts::DLL_SUFFIX)),
    )
    .unwrap();
    let run_dir = dir.path().join("liger");
    let host = job_plugin_host(&run_dir, &[folder]).unwrap();
    assert!(host.get("liger").is_some());
    let mut cfg = config(&model, &run_dir, "[jsonl]");
    cfg.model.use_liger = true;
    let opts = RunOptions {
        head_loss: Some(Arc::new(LigerHeadLoss::new(Some(host)))),
        ..quiet()
    };
    let fused = run_with_data(&cfg, &train, None, opts).unwrap();

    assert_eq!(fused.train_losses.len(), plain.train_losses.len());
    for ((s, a), (t, b)) in plain.train_losses.iter().zip(&fused.train_losses) {
        assert_eq!(s, t);
        assert!((a - b).abs() <= 1e-4, "step {s}: plain {a} vs liger {b}");
    }
}
