//! Helpers of the multi-process tests: an embedded head whose workers run `ferl-runtime-testbed`, and extra node
//! agents started as separate processes with declared resources.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ferl_runtime::{Cluster, HeadHandle, HeadOptions, NodeOptions};

/// The worker binary of these tests.
pub(crate) fn testbed() -> std::path::PathBuf {
    env!("CARGO_BIN_EXE_ferl-runtime-testbed").into()
}

/// Sets environment variable `key` of this test process, which the runtime (and every worker it spawns) reads.
///
/// Call it only at the start of a test, before it starts a head or a cluster.
pub(crate) fn set_env(key: &str, value: impl AsRef<std::ffi::OsStr>) {
    // SAFETY: `set_var` is unsound only while another thread reads or writes the environment. The tests call this
    // before they start any runtime code (the only readers besides the test harness), the tokio worker threads of the
    // test are idle until its first `.await`, and nextest (`scripts/test.sh`) runs each test in its own process, so
    // no other test's thread exists. Under plain `cargo test` tests of one binary share a process: run those with
    // `--test-threads=1`.
    unsafe { std::env::set_var(key, value) };
}

/// Points session folders at a private temporary folder (leaked for the life of the test process).
pub(crate) fn private_tmp() {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"));
    // Each test binary runs one test per process under nextest; with plain `cargo test` the value is the same.
    set_env("FERL_TMPDIR", dir.path());
}

/// An embedded head (with its own node of `cpus` CPUs) whose workers run the testbed binary.
pub(crate) async fn head(cpus: f64, heartbeat: Duration) -> HeadHandle {
    private_tmp();
    let opts = HeadOptions::new()
        .node(
            NodeOptions::new()
                .num_cpus(cpus)
                .num_gpus(0)
                .heartbeat_bound(heartbeat),
        )
        .worker_binary(testbed());
    ferl_runtime::start_head(opts)
        .await
        .expect("starting the head")
}

/// An embedded cluster with 4 CPUs.
pub(crate) async fn cluster() -> Cluster {
    head(4.0, Duration::from_secs(3)).await.cluster
}

/// A node agent process that kills itself when dropped.
pub(crate) struct NodeProc {
    pub child: Child,
    pub name: String,
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a node agent process joined to `head` with extra flags (`--num-cpus 2 --resources x=1`).
pub(crate) fn node(head: &HeadHandle, flags: &[&str], env: &[(&str, &str)]) -> NodeProc {
    let address = head.cluster.head_address().unwrap().to_string();
    let mut cmd = Command::new(testbed());
    cmd.arg("node")
        .args(["--address", &address, "--token", &head.token])
        .args(flags);
    cmd.envs(env.iter().copied())
        .env("FERL_TMPDIR", std::env::var("FERL_TMPDIR").unwrap());
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("starting a node agent");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("node agent output");
    let name = line
        .trim()
        .strip_prefix("NODE ")
        .unwrap_or_else(|| panic!("node agent said `{line}`"))
        .to_string();
    NodeProc { child, name }
}

/// Calls, a stream, ordered tells and a large payload to one fresh actor: what every call path must carry.
pub(crate) async fn exercise_call_paths(cluster: &Cluster) {
    use ferl_runtime::testbed::*;
    let actor = cluster
        .spawn::<Counter>(0, ferl_runtime::SpawnOptions::new())
        .await
        .expect("spawn");
    assert_eq!(actor.call(Add(2)).await.unwrap(), 2);
    let mut items = actor.stream(CountTo(50)).await.unwrap();
    let mut got = Vec::new();
    while let Some(item) = items.next().await {
        got.push(item.unwrap());
    }
    assert_eq!(got, (0..50).collect::<Vec<u64>>());
    for seq in 0..200u64 {
        actor.tell(Record { sender: 3, seq }).await.unwrap();
    }
    let seen = actor.call(Recorded).await.unwrap();
    assert_eq!(seen, (0..200).map(|s| (3, s)).collect::<Vec<_>>());
    let big: Vec<u8> = (0..(3usize << 20)).map(|i| (i % 253) as u8).collect();
    assert!(actor.call(Echo(big.clone())).await.unwrap() == big);
    let err = actor.call(Fail("on purpose".into())).await.unwrap_err();
    assert!(err.to_string().contains("on purpose"), "{err}");
}

/// A connection to the head with member credentials obtained through the join handshake (an authenticated peer
/// that can then send anything).
pub(crate) async fn member_connection(head: &HeadHandle) -> quinn::Connection {
    let addr = head.cluster.head_address().unwrap();
    let creds = ferl_runtime::testing::join(addr, &head.token, Duration::from_secs(10))
        .await
        .unwrap();
    let cfg = ferl_runtime::testing::client_config(&creds).unwrap();
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(cfg).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(std::sync::Arc::new(quic)));
    endpoint
        .connect(addr, ferl_runtime::testing::CLUSTER_SERVER_NAME)
        .unwrap()
        .await
        .unwrap()
}
