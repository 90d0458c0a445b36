//! Helpers shared by the integration tests: a tiny model folder with the real Qwen tokenizer, a GSM8K slice, the
//! config overrides of a short run, the single-process reference run, and the driver binary's path.

pub mod cluster;
pub mod rl;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use ferl_actors::data_loader::load_datasets;
use ferl_actors::rank::{build_stepper, load_model_for};
use ferl_actors::sft::{read_summary, RunSummary, StepRecord};
use ferl_config::SftConfig;
use ferl_data::DataPlan;
use ferl_trainer::batch::SampleRef;
use ferl_trainer::model::config::ModelConfig;
use ferl_trainer::model::layout::ModelLayout;
use ferl_trainer::model::weights;
use ferl_trainer::params::LocalParams;
use ferl_trainer::run::{compute_kind, device_of, RunPlan};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the repository")
        .to_path_buf()
}

/// `target/<profile>/ferl`, built first when missing. It is not rebuilt when present: `scripts/test.sh` builds every
/// target before the tests run (after changing ferl by hand, `cargo build --workspace --bins`). The build is the
/// workspace's, not `-p ferl`'s, whose different feature set would rebuild half the tree.
pub fn ferl_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("the test's own path");
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target/<profile>/deps/<test>")
                .to_path_buf();
            let bin = profile_dir.join("ferl");
            if !bin.exists() {
                let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
                let status = Command::new(cargo)
                    .args(["build", "--workspace", "--bins"])
                    .current_dir(repo_root())
                    .status()
                    .expect("run cargo build --workspace --bins");
                assert!(status.success(), "building the ferl binary failed");
            }
            assert!(bin.exists(), "no ferl binary at {}", bin.display());
            bin
        })
        .clone()
}

/// Writes a 2-layer, 32-wide Qwen2 model (real 151,936-token vocabulary so the Qwen tokenizer's ids fit) with
/// seeded random weights and the tokenizer files into `dir`.
pub fn write_tiny_model(dir: &Path) -> Result<()> {
    write_tiny_model_with_heads(dir, 2, 1)
}

/// [`write_tiny_model`] with `heads` query heads of width 32 / `heads` and `kv_heads` key/value heads.
pub fn write_tiny_model_with_heads(dir: &Path, heads: i64, kv_heads: i64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let root = repo_root();
    let mut raw: serde_json::Value = serde_json::from_slice(&std::fs::read(
        root.join("assets/models/tiny-qwen2/config.json"),
    )?)?;
    let obj = raw.as_object_mut().context("config.json is an object")?;
    for (k, v) in [
        ("hidden_size", 32),
        ("intermediate_size", 64),
        ("num_hidden_layers", 2),
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("head_dim", 32 / heads),
    ] {
        obj.insert(k.into(), v.into());
    }
    obj.insert(
        "layer_types".into(),
        serde_json::json!(["full_attention", "full_attention"]),
    );
    obj.insert("initializer_range".into(), 0.2.into());
    let cfg_file = dir.join("config.json");
    std::fs::write(&cfg_file, serde_json::to_vec_pretty(&raw)?)?;
    let cfg = ModelConfig::from_file(&cfg_file)?;
    let layout = ModelLayout::new(&cfg);
    let params = weights::init_params(&cfg, &layout, 7);
    let tok = root.join("assets/tokenizers/qwen3");
    weights::save_hf_folder(
        dir,
        &cfg,
        &layout,
        &params,
        tch::Kind::Float,
        &[tok.as_path()],
    )?;
    Ok(())
}

/// Writes the first `rows` GSM8K training rows to `file`.
pub fn write_gsm8k_slice(file: &Path, rows: usize) -> Result<()> {
    let text = std::fs::read_to_string(repo_root().join("assets/data/gsm8k/train.jsonl"))?;
    let lines: Vec<&str> = text.lines().take(rows).collect();
    std::fs::write(file, lines.join("\n") + "\n")?;
    Ok(())
}

/// A prepared run folder: model, data, checkpoint root.
pub struct Fixture {
    /// Keeps the folder alive.
    pub dir: tempfile::TempDir,
}

impl Fixture {
    /// A tiny model and 40 GSM8K rows.
    pub fn new() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        write_tiny_model(&dir.path().join("model"))?;
        write_gsm8k_slice(&dir.path().join("train.jsonl"), 40)?;
        Ok(Self { dir })
    }

    /// Config overrides of a short CPU run: global batch 8, micro-batch 2 (gradient accumulation on every rank),
    /// `steps` steps, checkpoints under `ckpt`, plus `extra`.
    pub fn overrides(&self, steps: usize, ckpt: &str, extra: &[&str]) -> Vec<String> {
        let d = self.dir.path();
        let mut o = vec![
            format!("model.partial_pretrain={}", d.join("model").display()),
            format!("data.train_files={}", d.join("train.jsonl").display()),
            "data.val_files=[]".into(),
            "data.train_batch_size=8".into(),
            "data.micro_batch_size_per_gpu=2".into(),
            "data.max_length=96".into(),
            "data.truncation=right".into(),
            format!("trainer.total_training_steps={steps}"),
            format!("trainer.default_local_dir={}", d.join(ckpt).display()),
            "trainer.device=cpu".into(),
            "trainer.logger=[console]".into(),
            "model.enable_gradient_checkpointing=false".into(),
            "optim.lr=1e-3".into(),
            "optim.lr_warmup_steps_ratio=0".into(),
        ];
        o.extend(extra.iter().map(|s| s.to_string()));
        o
    }
}

/// The golden reference of every launch path: the trainer's own `Stepper::step` over the unsharded
/// [`LocalParams`] store on each whole global batch, outside the run loop.
pub fn reference_run(overrides: &[String]) -> Result<Vec<StepRecord>> {
    let cfg = SftConfig::load(None, overrides)?;
    let device = device_of(&cfg, 0)?;
    let (train, _) = load_datasets(&cfg)?;
    let d = &cfg.data;
    let mut plan = DataPlan::new(train.len(), d.train_batch_size, cfg.trainer.seed, d.shuffle)?;
    let total = RunPlan::new(&cfg, train.len())?.total_steps;
    let (config, layout, params) = load_model_for(&cfg)?;
    let params = params.into_iter().map(|t| t.to_device(device)).collect();
    let store = LocalParams::new(layout, params, compute_kind(&cfg)?);
    let mut stepper = build_stepper(&cfg, config, store, device, total)?;
    let mut out = Vec::new();
    for step in 1..=total {
        let indices = plan.next_batch();
        let refs: Vec<SampleRef<'_>> = indices
            .iter()
            .map(|&i| {
                let s = train.get(i);
                SampleRef {
                    input_ids: &s.input_ids,
                    loss_mask: &s.loss_mask,
                }
            })
            .collect();
        let stats = stepper.step(&refs)?;
        out.push(StepRecord {
            step,
            loss: stats.loss,
            grad_norm: stats.grad_norm,
            lr: stats.lr,
        });
    }
    Ok(out)
}

/// A launch path of `ferl sft`, as the driver binary runs it.
#[derive(Clone, Copy, Debug)]
pub enum LaunchPath {
    /// World 1 in the driver's process (`ferl sft` without `--nproc-per-node`).
    OneProcess,
    /// `--nproc-per-node N`: actor ranks on an embedded cluster.
    Actors(usize),
    /// N processes with torchrun's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
    Launcher(usize),
}

/// A fresh job secret (hex) for the ranks of one launcher run, to pass as `FERL_JOB_SECRET`.
pub fn job_secret_hex() -> String {
    ferl_collective::JobSecret::generate()
        .expect("a random job secret")
        .to_hex()
}

/// Runs the driver binary `exe` on `path` with `overrides`; the summary (rank 0's on the launcher path), or the
/// error the run printed (from its `Error:` line on).
pub fn run_path(
    exe: &str,
    dir: &Path,
    path: LaunchPath,
    overrides: &[String],
    tag: &str,
) -> std::result::Result<RunSummary, String> {
    let summary = |r: usize| dir.join(format!("summary-{tag}-{r}.json"));
    let mut children = Vec::new();
    match path {
        LaunchPath::OneProcess | LaunchPath::Actors(_) => {
            let mut cmd = driver_command(exe);
            match path {
                LaunchPath::Actors(n) => cmd.args(["--nproc-per-node", &n.to_string()]),
                _ => cmd.arg("--one-process"),
            };
            cmd.arg("--summary").arg(summary(0)).args(overrides);
            children.push(cmd);
        }
        LaunchPath::Launcher(n) => {
            let port = ferl_collective::free_local_port().to_string();
            let secret = job_secret_hex();
            for r in 0..n {
                let mut cmd = driver_command(exe);
                cmd.env("FERL_JOB_SECRET", &secret)
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("LOCAL_RANK", r.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", &port);
                cmd.arg("--summary").arg(summary(r)).args(overrides);
                children.push(cmd);
            }
        }
    }
    let running: Vec<_> = children
        .iter_mut()
        .map(|c| {
            c.stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start the driver")
        })
        .collect();
    let outputs: Vec<_> = running
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait"))
        .collect();
    if let Some(out) = outputs.iter().find(|o| !o.status.success()) {
        let err = String::from_utf8_lossy(&out.stderr);
        let from = err.find("Error:").unwrap_or(0);
        let to = err
            .find("\n\nStack backtrace:")
            .unwrap_or(err.len())
            .max(from);
        return Err(err[from..to].trim().to_string());
    }
    read_summary(&summary(0)).map_err(|e| format!("{e:#}"))
}

/// A command running the driver binary `exe` (tests pass `env!("CARGO_BIN_EXE_ferl-sft-driver")`).
pub fn driver_command(exe: &str) -> Command {
    let mut cmd = Command::new(exe);
    // Several ranks share few cores: one intra-op thread each keeps them from fighting.
    cmd.env("OMP_NUM_THREADS", "1").env("RUST_LOG", "warn");
    cmd
}

/// Asserts two loss/grad-norm curves agree within `rel` relative error, step by step.
pub fn assert_curves_match(what: &str, got: &[StepRecord], want: &[StepRecord], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: number of steps");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.step, w.step, "{what}: step numbers");
        for (name, a, b) in [
            ("loss", g.loss, w.loss),
            ("grad_norm", g.grad_norm, w.grad_norm),
            ("lr", g.lr, w.lr),
        ] {
            let err = (a - b).abs() / b.abs().max(1e-12);
            assert!(
                err <= rel,
                "{what}: step {} {name} {a} vs reference {b} (relative error {err:e} > {rel:e})",
                g.step
            );
        }
    }
}

/// The value after `prefix` in `text` (what a command printed), up to the next space, comma, `)` or line end.
pub fn field<'a>(text: &'a str, prefix: &str) -> &'a str {
    let at = text
        .find(prefix)
        .unwrap_or_else(|| panic!("no `{prefix}` in:\n{text}"));
    text[at + prefix.len()..]
        .split([' ', '\n', ',', ')'])
        .next()
        .unwrap()
}

/// Asserts that the finished command `out` succeeded; otherwise fails showing `what` and its stdout and stderr.
pub fn assert_success(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The venv's `torchrun`, or `None` (with the reason printed).
pub fn torchrun() -> Option<PathBuf> {
    let venv = std::env::var_os("FERL_VENV")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/ferl/venv")))?;
    let bin = venv.join("bin/torchrun");
    if bin.exists() {
        Some(bin)
    } else {
        // Under CI a missing reference environment fails the run: parity tests never pass vacuously there.
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but no torchrun at {}: .ci/run must install it (scripts/setup.sh)",
            bin.display()
        );
        println!(
            "SKIP: no torchrun at {} (run scripts/setup.sh)",
            bin.display()
        );
        None
    }
}

/// Runs `ferl <args>` as `nproc` ranks of the real `torchrun --no-python --standalone` (one intra-op thread each, a
/// fresh job secret) inside a private network namespace with only loopback: torchrun opens its own sockets.
pub fn run_under_torchrun(torchrun: &Path, nproc: usize, args: &[String]) -> std::process::Output {
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    let script = format!(
        "ip link set lo up && exec {} --no-python --standalone --nnodes=1 --nproc_per_node={nproc} {} {}",
        torchrun.display(),
        ferl_binary().display(),
        quoted.join(" ")
    );
    Command::new("unshare")
        .args(["-n", "bash", "-c", &script])
        .env("OMP_NUM_THREADS", "1")
        .env("FERL_JOB_SECRET", job_secret_hex())
        .output()
        .expect("run unshare -n torchrun")
}

/// Runs the `ferl` binary with `args` and one intra-op thread, as a user would; returns what it did.
pub fn run_ferl(args: &[String]) -> std::process::Output {
    Command::new(ferl_binary())
        .env("OMP_NUM_THREADS", "1")
        .args(args)
        .output()
        .expect("run ferl")
}

/// What a command printed, stdout then stderr, for assertion messages.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
