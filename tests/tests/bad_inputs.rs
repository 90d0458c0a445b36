//! Bad inputs (issue #15): a table of config keys, data rows, model folders, checkpoints, plugins, CLI flags and
//! network peers (wrong token, wrong job secret, garbage frames), each run as a real process (`ferl sft`,
//! `ferl export`, `ferl start/status/stop`, `ferl plugin`, `ferl model`, `ferl data`, or launcher ranks through the
//! sft driver) with a time bound. Every row must exit non-zero without a panic, print its expected error (naming the
//! file, row, key, node or flag), and leave nothing behind: no run folder for a refused run, no export folder, no
//! daemon log of a failed `ferl start`. Rows that meet the head leave it answering `ferl status`.
//!
//! The table is `bad_inputs/rows.rs`; the fixture, the head and the peers are `bad_inputs/setup.rs`.

#[path = "bad_inputs/rows.rs"]
mod rows;
#[path = "bad_inputs/setup.rs"]
mod setup;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferl_tests::{ferl_binary, job_secret_hex, Fixture};
use rows::{Cmd, Row, LAUNCH_ENV, ROWS};
use setup::{start_peer, Head};

const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");
/// Longest any one row may run.
const ROW_LIMIT: Duration = Duration::from_secs(60);
/// Rows run at once.
const WORKERS: usize = 3;
/// Least rows in the table, and per category.
const MIN_ROWS: usize = 44;
const MIN_PER_CATEGORY: &[(&str, usize)] = &[
    ("config", 12),
    ("data", 5),
    ("model", 5),
    ("checkpoint", 4),
    ("plugin", 2),
    ("cli", 4),
    ("network", 3),
];
/// Variables cleared in every process, so the caller's shell cannot change a row.
const CLEARED: &[&str] = &[
    "RUST_BACKTRACE",
    "RUST_LIB_BACKTRACE",
    "FERL_TOKEN",
    "FERL_ADDRESS",
    "FERL_JOB_SECRET",
    "FERL_PLUGIN_PATH",
    "FERL_RUN_DIR",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "TORCHELASTIC_USE_AGENT_STORE",
];

/// What the rows share.
struct Ctx {
    fx: Fixture,
    head: Head,
}

/// The placeholder values of one row (see `rows.rs`).
struct Vars(Vec<(&'static str, String)>);

impl Vars {
    fn new(ctx: &Ctx, index: usize) -> Self {
        let d = ctx.fx.dir.path();
        Self(vec![
            (
                "{run}",
                d.join(format!("runs/{index}")).display().to_string(),
            ),
            (
                "{state}",
                d.join(format!("states/{index}")).display().to_string(),
            ),
            ("{d}", d.display().to_string()),
            ("{head}", ctx.head.address.clone()),
            ("{port}", ferl_collective::free_local_port().to_string()),
            ("{secret}", job_secret_hex()),
            ("{secret2}", job_secret_hex()),
        ])
    }

    fn get(&self, name: &str) -> &str {
        &self.0.iter().find(|(k, _)| *k == name).unwrap().1
    }

    fn fill(&self, text: &str) -> String {
        self.0
            .iter()
            .fold(text.to_string(), |t, (k, v)| t.replace(k, v))
    }
}

/// A process of `program` with the row's private HOME and session root, and a clean environment.
fn base_command(program: &Path, vars: &Vars, row: &Row) -> Command {
    let state = PathBuf::from(vars.get("{state}"));
    let mut cmd = Command::new(program);
    for k in CLEARED {
        cmd.env_remove(k);
    }
    cmd.env("HOME", state.join("home"))
        .env("FERL_TMPDIR", &state)
        .env("RUST_LOG", "warn")
        .env("OMP_NUM_THREADS", "1")
        .env("HF_HUB_OFFLINE", "1")
        .stdin(Stdio::null());
    for (k, v) in row.env {
        cmd.env(k, vars.fill(v));
    }
    cmd
}

/// The fixture's overrides of a one-step run into the row's run folder.
fn overrides(ctx: &Ctx, index: usize) -> Vec<String> {
    ctx.fx.overrides(1, &format!("runs/{index}"), &[])
}

/// The processes of a row.
fn commands(ctx: &Ctx, index: usize, row: &Row, vars: &Vars) -> Vec<Command> {
    let args: Vec<String> = row.args.iter().map(|a| vars.fill(a)).collect();
    match row.cmd {
        Cmd::Ferl => {
            let mut cmd = base_command(&ferl_binary(), vars, row);
            cmd.args(&args);
            vec![cmd]
        }
        Cmd::Sft => {
            let mut cmd = base_command(&ferl_binary(), vars, row);
            cmd.arg("sft").args(overrides(ctx, index)).args(&args);
            vec![cmd]
        }
        Cmd::Ranks(ranks) => ranks
            .iter()
            .map(|rank_env| {
                let mut cmd = base_command(Path::new(DRIVER), vars, row);
                for (k, v) in LAUNCH_ENV.iter().chain(rank_env.iter()) {
                    cmd.env(k, vars.fill(v));
                }
                cmd.args(overrides(ctx, index)).args(&args);
                cmd
            })
            .collect(),
    }
}

/// Runs `cmds` at once, stdout and stderr to files under `logs`; each is killed past [`ROW_LIMIT`]. Returns each
/// exit status and stdout + stderr.
fn run_all(cmds: Vec<Command>, logs: &Path) -> Result<Vec<(ExitStatus, String)>, String> {
    std::fs::create_dir_all(logs).map_err(|e| e.to_string())?;
    let mut children: Vec<(Child, PathBuf)> = Vec::new();
    for (i, mut cmd) in cmds.into_iter().enumerate() {
        let log = logs.join(format!("{i}.log"));
        let file = File::create(&log).map_err(|e| e.to_string())?;
        cmd.stdout(file.try_clone().map_err(|e| e.to_string())?)
            .stderr(file);
        let child = cmd.spawn().map_err(|e| format!("starting {cmd:?}: {e}"))?;
        children.push((child, log));
    }
    let deadline = Instant::now() + ROW_LIMIT;
    let mut out = Vec::new();
    for (mut child, log) in children {
        let status = loop {
            if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
                break Some(s);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        match status {
            Some(s) => out.push((s, text)),
            None => return Err(format!("still running after {ROW_LIMIT:?}:\n{text}")),
        }
    }
    Ok(out)
}

/// Whether `pattern` (a path, or a name prefix ending in `*`) names nothing that exists.
fn is_gone(pattern: &str) -> bool {
    match pattern.strip_suffix('*') {
        None => !Path::new(pattern).exists(),
        Some(prefix) => {
            let p = Path::new(prefix);
            let (dir, stem) = (
                p.parent().unwrap(),
                p.file_name().unwrap().to_string_lossy(),
            );
            std::fs::read_dir(dir).map_or(true, |d| {
                d.flatten()
                    .all(|e| !e.file_name().to_string_lossy().starts_with(stem.as_ref()))
            })
        }
    }
}

/// Runs row `index` and checks it; the error says what went wrong, with the processes' output.
fn check_row(ctx: &Ctx, index: usize, row: &Row) -> Result<(), String> {
    let vars = Vars::new(ctx, index);
    std::fs::create_dir_all(Path::new(vars.get("{state}")).join("home"))
        .map_err(|e| e.to_string())?;
    let port: u16 = vars.get("{port}").parse().unwrap();
    let peer = start_peer(row.peer, port, &ctx.head.address).map_err(|e| format!("peer: {e:#}"))?;
    let outcomes = run_all(
        commands(ctx, index, row, &vars),
        &ctx.fx.dir.path().join(format!("logs/{index}")),
    );
    drop(peer);
    let outcomes = outcomes?;
    let all: String = outcomes.iter().map(|(_, t)| t.as_str()).collect();
    for (status, text) in &outcomes {
        match status.code() {
            Some(0) => return Err(format!("exited 0:\n{text}")),
            None | Some(101) => return Err(format!("crashed ({status}):\n{text}")),
            Some(_) => {}
        }
    }
    for bad in ["panicked", "RUST_BACKTRACE"] {
        if all.contains(bad) {
            return Err(format!("panic text `{bad}`:\n{all}"));
        }
    }
    for want in row.expect.iter().map(|e| vars.fill(e)) {
        if !all.contains(&want) {
            return Err(format!("no `{want}` in:\n{all}"));
        }
    }
    let auto_gone = matches!(row.cmd, Cmd::Sft | Cmd::Ranks(_)).then_some("{run}");
    for pattern in row.gone.iter().copied().chain(auto_gone) {
        let path = vars.fill(pattern);
        if !is_gone(&path) {
            return Err(format!("left behind: {path}\n{all}"));
        }
    }
    if row.head_answers {
        ctx.head.answers()?;
    }
    Ok(())
}

/// The table's size per category, checked against the floors.
fn check_table() {
    let mut per: BTreeMap<&str, usize> = BTreeMap::new();
    for row in ROWS {
        *per.entry(row.cat).or_default() += 1;
    }
    assert!(ROWS.len() >= MIN_ROWS, "{} rows: {per:?}", ROWS.len());
    for (cat, least) in MIN_PER_CATEGORY {
        let n = per.get(cat).copied().unwrap_or(0);
        assert!(
            n >= *least,
            "{n} {cat} rows, want at least {least}: {per:?}"
        );
    }
    println!("{} rows: {per:?}", ROWS.len());
}

/// Runs every row on [`WORKERS`] threads; returns the failures as `(row, why)`.
fn run_rows(ctx: &Ctx) -> Vec<(String, String)> {
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..WORKERS {
            s.spawn(|| loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(row) = ROWS.get(index) else { break };
                let t0 = Instant::now();
                let result = check_row(ctx, index, row);
                let label = format!("#{index} {}: {}", row.cat, row.name);
                let ok = if result.is_ok() { "ok" } else { "FAILED" };
                println!("{label}: {ok} in {:.1}s", t0.elapsed().as_secs_f64());
                if let Err(why) = result {
                    failures.lock().unwrap().push((label, why));
                }
            });
        }
    });
    failures.into_inner().unwrap()
}

#[test]
fn every_bad_input_gets_its_error_without_panic_or_leftovers() {
    check_table();
    let fx = Fixture::new().unwrap();
    let d = fx.dir.path().to_path_buf();
    setup::prepare(&fx, |cmd| {
        cmd.env("OMP_NUM_THREADS", "1")
            .env("FERL_TMPDIR", d.join("states/prepare"))
            .env_remove("FERL_JOB_SECRET");
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let head = Head::start(d.join("states/head")).unwrap_or_else(|e| panic!("{e:#}"));
    let ctx = Ctx { fx, head };
    let failures = run_rows(&ctx);
    let report: Vec<String> = failures
        .iter()
        .map(|(row, why)| format!("{row}\n{why}"))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n\n{}",
        failures.len(),
        ROWS.len(),
        report.join("\n\n")
    );
}
