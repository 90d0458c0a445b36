//! Plugins across a cluster (issue 5, point 4): the driver ships the plugin files the actors use to their nodes,
//! content-addressed and cached per node, and a distributed run with a dataset plugin, the TensorBoard logger
//! plugin and `model.use_liger=true` trains exactly as the same run in one process.
//!
//! The nodes are separate `ferl start` processes with private caches and no plugin folders; only the driver has
//! `$FERL_PLUGIN_PATH`.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::SystemTime;

use ferl::plugins::cargo_build::{build_plugin, workspace_root, PluginBuild};
use ferl_config::SftConfig;
use ferl_tests::*;

/// Relative tolerance of the loss comparison against the single-process run.
const REL: f64 = 1e-4;

/// Builds the first-party plugins the runs use into `dir` (the driver's only plugin folder).
fn plugin_folder(dir: &Path) -> PathBuf {
    let ws = workspace_root(&repo_root()).unwrap();
    let folder = dir.join("driver-plugins");
    std::fs::create_dir_all(&folder).unwrap();
    for package in [
        "ferl-plugin-alpaca",
        "ferl-plugin-tensorboard",
        "ferl-plugin-liger",
    ] {
        let target = std::env::temp_dir()
            .join("ferl-plugin-builds")
            .join(package);
        let spec = PluginBuild {
            package: package.into(),
            ..Default::default()
        };
        let built = build_plugin(&ws, &target, &spec).unwrap_or_else(|e| panic!("{e:#}"));
        std::fs::copy(&built, folder.join(built.file_name().unwrap())).unwrap();
    }
    folder
}

/// 16 Alpaca-style records (a format only the `alpaca` dataset plugin reads).
fn write_alpaca(file: &Path) {
    let rows: Vec<serde_json::Value> = (0..16)
        .map(|i| {
            serde_json::json!({
                "instruction": format!("Add {i} and {}.", i + 3),
                "input": if i % 2 == 0 { String::new() } else { format!("Show the sum of {i} and {}.", i + 3) },
                "output": format!("{i} + {} = {}", i + 3, 2 * i + 3),
            })
        })
        .collect();
    std::fs::write(file, serde_json::Value::Array(rows).to_string()).unwrap();
}

/// Overrides of a 3-step CPU run over the Alpaca file with the TensorBoard logger and the liger kernels; `data`
/// picks the dataset plugin (`data.plugin=...` or the `data.custom_cls.*` keys).
fn overrides(fx: &Fixture, run: &str, data: &[String]) -> Vec<String> {
    let d = fx.dir.path();
    let mut o = vec![
        format!("model.partial_pretrain={}", d.join("model").display()),
        format!("data.train_files={}", d.join("alpaca.json").display()),
        "data.val_files=[]".into(),
        "data.train_batch_size=4".into(),
        "data.micro_batch_size_per_gpu=2".into(),
        "data.max_length=64".into(),
        "data.truncation=right".into(),
        "trainer.total_training_steps=3".into(),
        format!("trainer.default_local_dir={}", d.join(run).display()),
        "trainer.device=cpu".into(),
        "trainer.logger=[console,jsonl,tensorboard]".into(),
        "model.use_liger=true".into(),
        "model.enable_gradient_checkpointing=false".into(),
        "optim.lr=1e-3".into(),
        "optim.lr_warmup_steps_ratio=0".into(),
    ];
    o.extend(data.iter().cloned());
    o
}

fn check(out: Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ferl sft` with `args`, the driver's plugin folder, and `cache` as its own node's file cache.
fn ferl_sft(plugins: &Path, cache: &Path, args: &[String], what: &str) {
    let out = Command::new(ferl_binary())
        .arg("sft")
        .args(args)
        .env("FERL_PLUGIN_PATH", plugins)
        .env("FERL_BIN_CACHE", cache)
        .env("OMP_NUM_THREADS", "1")
        .env("RUST_LOG", "warn")
        .output()
        .expect("start ferl sft");
    check(out, what);
}

/// `(step, train/loss)` rows of `run/metrics.jsonl`.
fn logged_losses(run: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["train/loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn assert_losses_match(what: &str, got: &[(u64, f64)], want: &[(u64, f64)]) {
    assert_eq!(got.len(), want.len(), "{what}: steps {got:?} vs {want:?}");
    for ((gs, g), (ws, w)) in got.iter().zip(want) {
        assert_eq!(gs, ws, "{what}: step numbers");
        let err = (g - w).abs() / w.abs().max(1e-12);
        assert!(
            g.is_finite() && err <= REL,
            "{what}: step {gs} loss {g} vs single-process {w} (relative error {err:e} > {REL:e})"
        );
    }
}

fn python() -> PathBuf {
    let venv = std::env::var_os("FERL_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/ferl/venv"));
    let py = venv.join("bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/setup.sh (the venv holds the tensorboard package)",
        py.display()
    );
    py
}

/// `train/loss` scalars TensorBoard itself reads from the run's `tensorboard_log` folder.
fn tensorboard_losses(run: &Path) -> Vec<(u64, f64)> {
    let script = r#"
import sys, glob, os
from tensorboard.backend.event_processing import event_accumulator as ea
files = glob.glob(os.path.join(sys.argv[1], "**", "*tfevents*"), recursive=True)
assert len(files) == 1, files
acc = ea.EventAccumulator(os.path.dirname(files[0]), size_guidance={ea.SCALARS: 0})
acc.Reload()
for e in acc.Scalars("train/loss"):
    print(e.step, repr(e.value))
"#;
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(run.join("tensorboard_log"))
        .output()
        .unwrap();
    check(out.clone(), "reading the TensorBoard event files");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (s, v) = l.split_once(' ').unwrap();
            (s.parse().unwrap(), v.parse().unwrap())
        })
        .collect()
}

/// The TensorBoard file holds the same losses as `metrics.jsonl` (stored as f32).
fn assert_tensorboard_matches(run: &Path) {
    let tb = tensorboard_losses(run);
    let jsonl = logged_losses(run);
    assert_eq!(tb.len(), jsonl.len(), "{tb:?} vs {jsonl:?}");
    for ((ts, tv), (js, jv)) in tb.iter().zip(&jsonl) {
        assert_eq!(ts, js);
        assert!(
            (tv - jv).abs() <= 1e-6 * jv.abs(),
            "step {ts}: {tv} vs {jv}"
        );
    }
}

/// A node agent process (`ferl start --address`) with its own file cache and no plugin folder (its log is
/// `CACHE.log`); killed on drop.
struct Node {
    child: Child,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_node(address: &str, token: &str, cache: &Path, tmp: &Path) -> Node {
    let mut child = Command::new(ferl_binary())
        .args(["start", "--block", "--address", address, "--token", token])
        .args(["--num-cpus", "1", "--num-gpus", "0"])
        .env("FERL_BIN_CACHE", cache)
        .env("FERL_TMPDIR", tmp)
        .env_remove("FERL_PLUGIN_PATH")
        .env("OMP_NUM_THREADS", "1")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(cache.with_extension("log")).unwrap())
        .spawn()
        .expect("start a node agent");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.starts_with("ferl node joined as "),
        "node agent said `{line}`"
    );
    Node { child }
}

/// The files of a node's shipped-file cache: name → (inode, mtime).
fn cached(cache: &Path) -> Vec<(String, u64, SystemTime)> {
    let dir = cache.join("files");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            (
                e.file_name().into_string().unwrap(),
                m.ino(),
                m.modified().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

fn sha256_of(path: &Path) -> String {
    ferl::plugins::PluginStore::hash_file(path).unwrap()
}

/// Points this process (the driver and the head) at the test's session folder, head file cache and plugin folder.
fn set_driver_env(tmp: &Path, head_cache: &Path, plugins: &Path) {
    // SAFETY: `set_var` is unsound only while another thread reads or writes the environment. This runs before the
    // test starts the head (the runtime is what reads these variables), its tokio worker threads are idle until
    // the first `.await`, and nextest (`scripts/test.sh`) runs each test in its own process, so no other test's
    // thread exists. Under plain `cargo test` this binary's tests share a process: run it with `--test-threads=1`.
    unsafe {
        std::env::set_var("FERL_TMPDIR", tmp);
        std::env::set_var("FERL_BIN_CACHE", head_cache);
        std::env::set_var("FERL_PLUGIN_PATH", plugins);
    }
}

/// The shipped-file cache of each of `caches` (empty for a head cache that was never created).
fn cache_snapshots(caches: &[PathBuf], head_cache: &Path) -> Vec<Vec<(String, u64, SystemTime)>> {
    caches
        .iter()
        .map(|cache| {
            if cache == head_cache && !cache.join("files").exists() {
                Vec::new()
            } else {
                cached(cache)
            }
        })
        .collect()
}

/// After the first distributed run: each node holds the liger plugin (its trainer rank used it) under the file's
/// sha256, with nothing else but what its actors used; the dataset plugin went only where the data loader ran, and
/// the logger plugin (which runs in the driver) went nowhere. Returns the caches' contents (`caches` order).
fn assert_first_run_shipping(
    plugins: &Path,
    caches: &[PathBuf],
    head_cache: &Path,
) -> Vec<Vec<(String, u64, SystemTime)>> {
    let liger = sha256_of(&plugins.join("libferl_plugin_liger.so"));
    let alpaca = sha256_of(&plugins.join("libferl_plugin_alpaca.so"));
    let tensorboard = sha256_of(&plugins.join("libferl_plugin_tensorboard.so"));
    let snapshots = cache_snapshots(caches, head_cache);
    let mut with_alpaca = 0;
    for (cache, files) in caches.iter().zip(&snapshots) {
        let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
        if cache != head_cache {
            assert!(
                names.contains(&format!("{liger}.so").as_str()),
                "{}: {names:?}",
                cache.display()
            );
        }
        with_alpaca += names.contains(&format!("{alpaca}.so").as_str()) as usize;
        assert!(
            !names.contains(&format!("{tensorboard}.so").as_str()),
            "the logger plugin runs in the driver and is never shipped: {names:?}"
        );
        for n in &names {
            assert!(
                *n == format!("{liger}.so") || *n == format!("{alpaca}.so"),
                "{n}"
            );
        }
    }
    assert_eq!(
        with_alpaca, 1,
        "the dataset plugin goes to the data loader's node only"
    );
    snapshots
}

/// The same run in one process (`ferl sft` without --nproc-per-node) gives the same losses as the distributed runs
/// `(name, summary)`, in their summaries, their `metrics.jsonl` and their TensorBoard files.
fn assert_runs_match_one_process(
    fx: &Fixture,
    plugins: &Path,
    runs: [(&str, &ferl::actors::sft::RunSummary); 2],
) {
    let d = fx.dir.path();
    let local = overrides(fx, "local", &["data.plugin=alpaca".into()]);
    ferl_sft(
        plugins,
        &d.join("cache-local"),
        &local,
        "single-process ferl sft",
    );
    let want = logged_losses(&d.join("local"));
    assert_eq!(want.len(), 3);
    for (run, summary) in runs {
        let got: Vec<(u64, f64)> = summary.steps.iter().map(|s| (s.step, s.loss)).collect();
        assert_losses_match(&format!("distributed run `{run}`"), &got, &want);
        assert_losses_match(
            &format!("{run}/metrics.jsonl"),
            &logged_losses(&d.join(run)),
            &want,
        );
        assert_tensorboard_matches(&d.join(run));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_files_travel_once_to_each_node_and_the_run_matches_one_process() {
    let fx = Fixture::new().unwrap();
    let d = fx.dir.path().to_path_buf();
    write_alpaca(&d.join("alpaca.json"));
    let plugins = plugin_folder(&d);
    let tmp = d.join("sessions");
    std::fs::create_dir_all(&tmp).unwrap();
    // This process is the driver and the head (its own node declares no CPUs, so the ranks go to the two nodes).
    let head_cache = d.join("cache-head");
    set_driver_env(&tmp, &head_cache, &plugins);
    let head = ferl_runtime_head().await;
    let address = head.cluster.head_address().unwrap().to_string();
    let caches = [d.join("cache-node-a"), d.join("cache-node-b")];
    let _nodes: Vec<Node> = caches
        .iter()
        .map(|c| start_node(&address, &head.token, c, &tmp))
        .collect();
    let all_caches = [caches[0].clone(), caches[1].clone(), head_cache.clone()];

    let dist = overrides(&fx, "dist", &["data.plugin=alpaca".into()]);
    let cfg = SftConfig::load(None, &dist).unwrap();
    let served_before = ferl::runtime::stats().file_chunks_served;
    let first = ferl::actors::sft::train_on_cluster(&head.cluster, &cfg, 2)
        .await
        .unwrap();
    assert_eq!(first.world_size, 2);
    let served_first = ferl::runtime::stats().file_chunks_served - served_before;
    let snapshots = assert_first_run_shipping(&plugins, &all_caches, &head_cache);
    // Three transfers (liger to two nodes, alpaca to one), each file under one 4 MiB chunk.
    assert!(served_first >= 3, "chunks served: {served_first}");

    // A second run on the same nodes: every file is found in the node caches, nothing travels again.
    let again = overrides(&fx, "dist-again", &["data.plugin=alpaca".into()]);
    let cfg2 = SftConfig::load(None, &again).unwrap();
    let served_before = ferl::runtime::stats().file_chunks_served;
    let second = ferl::actors::sft::train_on_cluster(&head.cluster, &cfg2, 2)
        .await
        .unwrap();
    assert_eq!(
        ferl::runtime::stats().file_chunks_served,
        served_before,
        "a cached plugin was sent again"
    );
    let now = cache_snapshots(&all_caches, &head_cache);
    for ((cache, now), before) in all_caches.iter().zip(&now).zip(&snapshots) {
        assert_eq!(now, before, "{} changed on the second run", cache.display());
    }

    assert_runs_match_one_process(&fx, &plugins, [("dist", &first), ("dist-again", &second)]);
    head.cluster.shutdown().await;
}

async fn ferl_runtime_head() -> ferl::runtime::HeadHandle {
    let opts = ferl::HeadOptions::new()
        .node(ferl::NodeOptions::new().num_cpus(0.0).num_gpus(0))
        .worker_binary(ferl_binary());
    ferl::runtime::start_head(opts)
        .await
        .expect("starting the head")
}

#[test]
fn ferl_sft_nproc_per_node_2_with_custom_cls_tensorboard_and_liger_matches_one_process() {
    let fx = Fixture::new().unwrap();
    let d = fx.dir.path().to_path_buf();
    write_alpaca(&d.join("alpaca.json"));
    let plugins = plugin_folder(&d);
    // verl's key for a custom dataset: here the dataset plugin's file and name.
    let custom = [
        format!(
            "data.custom_cls.path={}",
            plugins.join("libferl_plugin_alpaca.so").display()
        ),
        "data.custom_cls.name=alpaca".to_string(),
    ];
    let cache = d.join("cache");
    let mut dist = vec!["--nproc-per-node".to_string(), "2".into()];
    dist.extend(overrides(&fx, "dist", &custom));
    ferl_sft(&plugins, &cache, &dist, "ferl sft --nproc-per-node 2");
    // One process reads the same keys the same way.
    let local = overrides(&fx, "local", &custom);
    ferl_sft(
        &plugins,
        &d.join("cache-local"),
        &local,
        "single-process ferl sft",
    );
    let want = logged_losses(&d.join("local"));
    assert_eq!(want.len(), 3);
    assert_losses_match(
        "ferl sft --nproc-per-node 2",
        &logged_losses(&d.join("dist")),
        &want,
    );
    assert_tensorboard_matches(&d.join("dist"));
    // The embedded node received both plugins its actors used (data loader: alpaca; ranks: liger) once.
    let names: Vec<String> = cached(&cache).into_iter().map(|f| f.0).collect();
    let mut want_names = vec![
        format!(
            "{}.so",
            sha256_of(&plugins.join("libferl_plugin_alpaca.so"))
        ),
        format!("{}.so", sha256_of(&plugins.join("libferl_plugin_liger.so"))),
    ];
    want_names.sort();
    assert_eq!(names, want_names);
    // The run directory's plugin state lists what the driver loaded, as `ferl plugin list --run-dir` shows it.
    let state = std::fs::read_to_string(d.join("dist/plugins/state.json")).unwrap();
    for name in ["alpaca", "tensorboard", "liger"] {
        assert!(state.contains(&format!("\"name\": \"{name}\"")), "{state}");
    }
}

#[test]
fn launcher_ranks_load_plugins_from_their_plugin_path_and_match_one_process() {
    let fx = Fixture::new().unwrap();
    let d = fx.dir.path().to_path_buf();
    write_alpaca(&d.join("alpaca.json"));
    let plugins = plugin_folder(&d);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // Two ranks as torchrun starts them: each has the plugin folder itself; rank 0 logs.
    let o = overrides(&fx, "launch", &["data.plugin=alpaca".into()]);
    let secret = job_secret_hex();
    let ranks: Vec<Child> = (0..2)
        .map(|rank| {
            Command::new(ferl_binary())
                .arg("sft")
                .args(&o)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("FERL_JOB_SECRET", &secret)
                .env("MASTER_PORT", port.to_string())
                .env("FERL_PLUGIN_PATH", &plugins)
                .env("OMP_NUM_THREADS", "1")
                .env("RUST_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        check(
            child.wait_with_output().unwrap(),
            &format!("launcher rank {rank}"),
        );
    }
    let local = overrides(&fx, "local", &["data.plugin=alpaca".into()]);
    ferl_sft(
        &plugins,
        &d.join("cache-local"),
        &local,
        "single-process ferl sft",
    );
    let want = logged_losses(&d.join("local"));
    assert_eq!(want.len(), 3);
    assert_losses_match("launcher ranks", &logged_losses(&d.join("launch")), &want);
    assert_tensorboard_matches(&d.join("launch"));
}
