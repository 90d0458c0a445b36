//! The cluster bootstrap commands of the `ferl` binary, run as a user would on one machine (loopback only, an
//! ephemeral port, a private HOME and session folder per test): `ferl start --head` (daemonized and `--block`),
//! `ferl start --address` (token found on this machine, from `FERL_TOKEN`, from `--token`, or wrong),
//! `ferl status [--json]` and `ferl stop`, with every process checked gone afterwards.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferl_tests::{ferl_binary, field};

/// Whether `pid` runs (a zombie does not).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// A private machine: its own HOME and session root, and every process it started (killed on drop).
struct Machine {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pids: Vec<u32>,
}

impl Drop for Machine {
    fn drop(&mut self) {
        for pid in self.pids.iter().filter(|p| running(**p)) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

impl Machine {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("home")).unwrap();
        Self {
            dir,
            bin: ferl_binary(),
            pids: Vec::new(),
        }
    }

    /// The session root of this machine (`FERL_TMPDIR`).
    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// `ferl ARGS` with this machine's environment (and no cluster variables of the caller).
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env("HOME", self.dir.path().join("home"))
            .env("FERL_TMPDIR", self.state())
            .env("RUST_LOG", "warn")
            .env_remove("FERL_TOKEN")
            .env_remove("FERL_ADDRESS")
            .env_remove("RUST_BACKTRACE");
        cmd
    }

    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        self.command(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("running ferl {args:?}: {e}"))
    }

    /// Runs and requires success; returns stdout.
    fn ok(&self, args: &[&str], env: &[(&str, &str)]) -> String {
        let out = self.run(args, env);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        );
        assert!(
            out.status.success(),
            "ferl {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
            out.status
        );
        stdout
    }

    /// Runs and requires failure; returns stdout and stderr together.
    fn fails(&self, args: &[&str], env: &[(&str, &str)]) -> String {
        let out = self.run(args, env);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "ferl {args:?} should fail:\n{text}");
        text
    }

    /// `ferl status --address A --json`, parsed.
    fn status(&self, address: &str) -> serde_json::Value {
        let text = self.ok(&["status", "--address", address, "--json"], &[]);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("status JSON ({e}):\n{text}"))
    }
}

fn pid_of(started: &str) -> u32 {
    field(started, "(pid ").parse().unwrap()
}

fn node<'a>(status: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    status["nodes"]
        .as_array()
        .expect("a top-level `nodes` list")
        .iter()
        .find(|n| n["name"] == name)
        .unwrap_or_else(|| panic!("no node {name} in {status:#}"))
}

fn wait_gone(pids: &[u32], within: Duration) {
    let t0 = Instant::now();
    while pids.iter().any(|p| running(*p)) {
        assert!(
            t0.elapsed() < within,
            "still running {:?} after `ferl stop`",
            pids.iter().filter(|p| running(**p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `ferl start --head` (daemonized, 2 CPUs, 1 GPU, `special=3`) on `here`: the daemon runs after the command returns,
/// and the token it prints once is kept with mode 0600 where local commands find it. Returns the address and token.
fn start_daemon_head(here: &mut Machine) -> (String, String) {
    let started = here.ok(
        &[
            "start",
            "--head",
            "--port",
            "0",
            "--num-cpus",
            "2",
            "--num-gpus",
            "1",
            "--resources",
            "special=3",
        ],
        &[],
    );
    let address = field(&started, "ferl head started at ").to_string();
    assert!(address.starts_with("127.0.0.1:"), "{started}");
    let head_pid = pid_of(&started);
    here.pids.push(head_pid);
    assert!(
        running(head_pid),
        "the daemon runs after `ferl start` returned"
    );
    let token = field(&started, "cluster token: ").to_string();
    let token_file = here.state().join("session_latest/token");
    assert_eq!(std::fs::read_to_string(&token_file).unwrap().trim(), token);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&token_file).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    (address, token)
}

/// Another machine (no head, so no token on disk) is refused without a token or with a wrong one, and joins with
/// `FERL_TOKEN` or `--token`. Returns the names of the two nodes it started.
fn join_from_another_machine(there: &mut Machine, address: &str, token: &str) -> (String, String) {
    let err = there.fails(&["start", "--address", address], &[]);
    assert!(err.contains("no cluster token"), "{err}");
    let err = there.fails(
        &["start", "--address", address, "--token", "not-the-token"],
        &[],
    );
    assert!(err.contains("wrong cluster token"), "{err}");
    let by_env = there.ok(
        &["start", "--address", address, "--num-cpus", "1"],
        &[("FERL_TOKEN", token)],
    );
    let env_node = field(&by_env, "ferl node started: ").to_string();
    there.pids.push(pid_of(&by_env));
    let by_flag = there.ok(
        &[
            "start",
            "--address",
            address,
            "--num-cpus",
            "1",
            "--token",
            token,
        ],
        &[],
    );
    let flag_node = field(&by_flag, "ferl node started: ").to_string();
    there.pids.push(pid_of(&by_flag));
    (env_node, flag_node)
}

/// Reserves `special=2` and `gpuish=1` in a group, so `used` is not all zeros; the group lives as long as the
/// returned connection.
fn reserve_some(
    rt: &tokio::runtime::Runtime,
    address: &str,
    token: &str,
) -> (ferl::Cluster, ferl::ResourceGroup) {
    rt.block_on(async {
        let cluster = ferl::connect(address, Some(token.to_string()))
            .await
            .unwrap();
        let group = cluster
            .create_group(
                vec![
                    ferl::bundle(&[("special", 2.0)]),
                    ferl::bundle(&[("gpuish", 1.0)]),
                ],
                ferl::Strategy::Spread,
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        (cluster, group)
    })
}

/// `ferl status --json` of the daemonized cluster: the head's node and the three joined nodes with their resources
/// (totals and what the group uses), every node's log folder (the other machine's in its session root), one group.
fn assert_daemon_status(
    status: &serde_json::Value,
    address: &str,
    local_node: &str,
    other_nodes: [&str; 2],
    there: &Machine,
) {
    assert_eq!(status["head"], address);
    assert_eq!(status["nodes"].as_array().unwrap().len(), 4, "{status:#}");
    let head_node = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["address"] == address)
        .expect("the head's own node");
    assert_eq!(head_node["resources_total"]["CPU"], 2.0);
    assert_eq!(head_node["resources_total"]["GPU"], 1.0);
    assert_eq!(head_node["resources_total"]["special"], 3.0);
    assert_eq!(head_node["resources_used"]["special"], 2.0);
    assert_eq!(node(status, local_node)["resources_total"]["gpuish"], 2.0);
    assert_eq!(node(status, local_node)["resources_used"]["gpuish"], 1.0);
    for name in [local_node, other_nodes[0], other_nodes[1]] {
        let n = node(status, name);
        assert_eq!(n["alive"], true);
        assert_eq!(n["resources_total"]["CPU"], 1.0);
        assert_eq!(n["resources_used"]["CPU"], 0.0);
    }
    for n in status["nodes"].as_array().unwrap() {
        let logs = PathBuf::from(n["log_dir"].as_str().expect("log_dir"));
        assert!(
            logs.is_dir(),
            "log folder {} of {}",
            logs.display(),
            n["name"]
        );
    }
    assert!(node(status, other_nodes[0])["log_dir"]
        .as_str()
        .unwrap()
        .starts_with(there.state().to_str().unwrap()));
    assert_eq!(status["groups"].as_array().unwrap().len(), 1);
}

#[test]
fn daemonized_head_and_nodes_join_report_status_and_stop() {
    let mut here = Machine::new();
    let (address, token) = start_daemon_head(&mut here);

    // A node on this machine finds the token by itself.
    let joined = here.ok(
        &[
            "start",
            "--address",
            &address,
            "--num-cpus",
            "1",
            "--resources",
            "gpuish=2",
        ],
        &[],
    );
    let local_node = field(&joined, "ferl node started: ").to_string();
    here.pids.push(pid_of(&joined));

    let mut there = Machine::new();
    let (env_node, flag_node) = join_from_another_machine(&mut there, &address, &token);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let _group = reserve_some(&rt, &address, &token);
    let status = here.status(&address);
    assert_daemon_status(
        &status,
        &address,
        &local_node,
        [&env_node, &flag_node],
        &there,
    );

    // Plain `ferl status` on the head's machine needs neither address nor token.
    let text = here.ok(&["status"], &[]);
    assert!(text.contains(&format!("head {address}")), "{text}");
    assert!(text.contains(&format!("node {local_node} ")), "{text}");

    // `ferl stop` on the head's machine stops the whole cluster, the other machine's nodes included.
    let stopped = here.ok(&["stop"], &[]);
    assert!(
        stopped.contains(&format!("asked the head at {address}")),
        "{stopped}"
    );
    let all: Vec<u32> = here.pids.iter().chain(&there.pids).copied().collect();
    wait_gone(&all, Duration::from_secs(30));
    // Local commands no longer reach for the stopped head.
    let err = here.fails(&["status"], &[]);
    assert!(err.contains("no head address"), "{err}");
}

/// Reads lines of a foreground command until one starts with `prefix`; returns the rest of that line.
fn wait_line(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        let n = out.read_line(&mut line).unwrap();
        assert!(n > 0, "output ended before `{prefix}`:\n{seen}");
        if let Some(rest) = line.trim_end().strip_prefix(prefix) {
            return rest.to_string();
        }
        seen.push_str(&line);
    }
}

fn wait_exit(child: &mut Child, what: &str, within: Duration) {
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < within, "{what} still runs after `ferl stop`");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn block_keeps_head_and_node_in_the_foreground_until_stopped() {
    let mut here = Machine::new();
    let mut head = here
        .command(&[
            "start",
            "--head",
            "--block",
            "--port",
            "0",
            "--num-cpus",
            "1",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    here.pids.push(head.id());
    let mut head_out = BufReader::new(head.stdout.take().unwrap());
    let address = wait_line(&mut head_out, "ferl head listening on ");
    let token = wait_line(&mut head_out, "cluster token: ");
    assert_eq!(token.len(), 64, "a 256-bit token in hex: {token}");

    let mut node_proc = here
        .command(&[
            "start",
            "--address",
            &address,
            "--block",
            "--num-cpus",
            "1",
            "--num-gpus",
            "0",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    here.pids.push(node_proc.id());
    let mut node_out = BufReader::new(node_proc.stdout.take().unwrap());
    let joined = wait_line(&mut node_out, "ferl node joined as ");
    let name = joined.split(' ').next().unwrap().to_string();

    // Both stay in the foreground.
    std::thread::sleep(Duration::from_millis(500));
    assert!(head.try_wait().unwrap().is_none(), "--block head exited");
    assert!(
        node_proc.try_wait().unwrap().is_none(),
        "--block node exited"
    );
    let status = here.status(&address);
    assert_eq!(status["nodes"].as_array().unwrap().len(), 2, "{status:#}");
    assert_eq!(node(&status, &name)["alive"], true);

    here.ok(&["stop", "--address", &address], &[]);
    wait_exit(&mut head, "the --block head", Duration::from_secs(30));
    wait_exit(&mut node_proc, "the --block node", Duration::from_secs(30));
}
