//! What the bad-input rows run against: the tiny model and GSM8K slice of [`Fixture`], a one-step checkpoint, broken
//! copies of each (hard links where a file is unchanged), a running head, and the misbehaving peers.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferl::plugins::cargo_build::{build_plugin, cdylib_file_name, workspace_root, PluginBuild};
use ferl_tests::{ferl_binary, repo_root, Fixture};
use serde_json::Value;

use super::rows::Peer;

/// Junk that is no handshake: its bytes are never 0 or 1, so no status byte read from it means "refused".
const JUNK: &[u8] = b"\xde\xad\xbe\xef";

/// Writes the broken inputs the rows name under the fixture folder `d`, and the checkpoint `{d}/ckpt/global_step_1`
/// with its broken copies.
pub(crate) fn prepare(fx: &Fixture, env: impl Fn(&mut Command)) -> Result<()> {
    let d = fx.dir.path();
    write_files(d)?;
    write_models(d)?;
    write_grpo_inputs(d)?;
    let mut train = Command::new(ferl_binary());
    train.arg("sft").args(fx.overrides(1, "ckpt", &[]));
    env(&mut train);
    let out = train.output()?;
    if !out.status.success() {
        bail!(
            "training the fixture's checkpoint: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    write_checkpoints(d)
}

fn write_files(d: &Path) -> Result<()> {
    let files: &[(&str, &[u8])] = &[
        (
            "bad_line.jsonl",
            b"{\"question\": \"a\", \"answer\": \"b\"}\n{\"question\": \"a\", \"answer\": \n",
        ),
        ("no_prompt.jsonl", b"{\"q\": \"a\", \"answer\": \"b\"}\n"),
        (
            "no_response.jsonl",
            b"{\"question\": \"a\", \"ans\": \"b\"}\n",
        ),
        ("garbage.parquet", &[0x5a; 300]),
        ("empty.jsonl", b""),
        ("bad.yaml", b"data:\n  train_batch_size: [unclosed\n"),
        ("unknown_key.yaml", b"data:\n  train_bach_size: 8\n"),
        ("plugins/libferl_plugin_fake.so", b"not a library\n"),
        ("bad_run/plugins/state.json", b"[{\"name\": 3"),
    ];
    for (name, bytes) in files {
        let file = d.join(name);
        std::fs::create_dir_all(file.parent().unwrap())?;
        std::fs::write(&file, bytes)?;
    }
    Ok(())
}

/// What the `ferl grpo` rows read under `{d}/grpo`: two prompts in verl's RL layout (`train.jsonl`), the same with
/// row 1 over `data.max_prompt_length=64` (`long.jsonl`), a logger plugin where a reward is expected (`logger.so`,
/// the first-party CSV logger beside `ferl`), and the testkit reward (`testkit_reward.so`, which scores a row NaN
/// when `$FERL_TESTKIT_REWARD` says `nan_at=ROW`).
fn write_grpo_inputs(d: &Path) -> Result<()> {
    let dir = d.join("grpo");
    std::fs::create_dir_all(&dir)?;
    let row = |content: &str| {
        serde_json::json!({
            "prompt": [{"role": "user", "content": content}],
            "data_source": "testkit",
            "reward_model": {"ground_truth": "4"},
        })
        .to_string()
    };
    let short = row("What is two plus two?");
    std::fs::write(dir.join("train.jsonl"), format!("{short}\n{short}\n"))?;
    let long = row(&"two plus two ".repeat(40));
    std::fs::write(dir.join("long.jsonl"), format!("{short}\n{long}\n"))?;
    let logger = ferl_binary().with_file_name(cdylib_file_name("ferl-plugin-csv"));
    std::fs::copy(&logger, dir.join("logger.so"))
        .with_context(|| format!("copying {}", logger.display()))?;
    let spec = PluginBuild {
        package: "ferl-plugin-testkit".into(),
        features: vec!["reward".into()],
        ..Default::default()
    };
    // The cache the plugin host's own tests build this into.
    let target = std::env::temp_dir().join("ferl-plugin-builds/ferl-plugin-testkit-reward");
    let built = build_plugin(&workspace_root(&repo_root())?, &target, &spec)?;
    std::fs::copy(&built, dir.join("testkit_reward.so"))?;
    Ok(())
}

/// Broken copies of `{d}/model`: each a hard-linked tree with one file replaced or removed.
fn write_models(d: &Path) -> Result<()> {
    let model = d.join("model");
    let variant = |name: &str| -> Result<PathBuf> {
        let dir = d.join(name);
        link_tree(&model, &dir)?;
        Ok(dir)
    };
    let edit = |name: &str, change: &dyn Fn(&mut serde_json::Map<String, Value>)| -> Result<()> {
        let file = variant(name)?.join("config.json");
        let mut cfg: Value = serde_json::from_slice(&std::fs::read(&file)?)?;
        change(cfg.as_object_mut().context("config.json is an object")?);
        replace(&file, &serde_json::to_vec_pretty(&cfg)?)
    };
    edit("m_type", &|c| {
        c.insert("model_type".into(), "mistral".into());
    })?;
    edit("m_act", &|c| {
        c.insert("hidden_act".into(), "gelu".into());
    })?;
    edit("m_rope", &|c| {
        c.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
        );
    })?;
    edit("m_shape", &|c| {
        c.insert("intermediate_size".into(), 48.into());
    })?;
    replace(
        &variant("m_bad_json")?.join("config.json"),
        b"{\"model_type\": \"qwen2\",",
    )?;
    std::fs::remove_file(variant("m_no_weights")?.join("model.safetensors"))?;
    let weights = std::fs::read(model.join("model.safetensors"))?;
    replace(
        &variant("m_truncated")?.join("model.safetensors"),
        &weights[..weights.len() / 2],
    )?;
    let index = variant("m_index")?;
    std::fs::rename(
        index.join("model.safetensors"),
        index.join("model-00001-of-00001.safetensors"),
    )?;
    let map =
        r#"{"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}"#;
    std::fs::write(index.join("model.safetensors.index.json"), map)?;
    Ok(())
}

/// Broken copies of `{d}/ckpt`: a corrupted model shard, a truncated `meta.json`, a root whose only checkpoint is
/// corrupted (for `resume_mode=auto`), and a root whose latest pointer is garbage.
fn write_checkpoints(d: &Path) -> Result<()> {
    let ckpt = d.join("ckpt");
    let step = "global_step_1";
    for name in ["c_corrupt", "c_meta", "c_auto", "c_latest"] {
        link_tree(&ckpt, &d.join(name))?;
    }
    let shard = Path::new(step).join("model_world_size_1_rank_0.safetensors");
    let mut bytes = std::fs::read(ckpt.join(&shard))?;
    let at = bytes.len() / 2;
    bytes[at..at + 4].copy_from_slice(JUNK);
    for root in ["c_corrupt", "c_auto"] {
        replace(&d.join(root).join(&shard), &bytes)?;
    }
    let meta = std::fs::read(ckpt.join(step).join("meta.json"))?;
    replace(&d.join("c_meta").join(step).join("meta.json"), &meta[..50])?;
    replace(
        &d.join("c_latest/latest_checkpointed_iteration.txt"),
        b"abc",
    )
}

/// Recreates the tree `src` at `dst` with every file hard-linked.
fn link_tree(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst)?;
    for entry in std::fs::read_dir(src)? {
        let entry = entry?;
        let to = dst.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            link_tree(&entry.path(), &to)?;
        } else {
            std::fs::hard_link(entry.path(), &to)
                .with_context(|| format!("linking {}", to.display()))?;
        }
    }
    Ok(())
}

/// Writes `bytes` to `file` as a new file (a hard link to the original is broken, not written through).
fn replace(file: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::remove_file(file).ok();
    std::fs::write(file, bytes).with_context(|| format!("writing {}", file.display()))
}

/// A head started with `ferl start --head` in its own session root; stopped (and killed if need be) on drop.
pub(crate) struct Head {
    /// `HOST:PORT`.
    pub address: String,
    /// The cluster token.
    pub token: String,
    pid: u32,
    state: PathBuf,
}

impl Head {
    /// Starts a head whose session root is `state`.
    pub(crate) fn start(state: PathBuf) -> Result<Self> {
        let out = Self::command(&state)
            .args(["start", "--head", "--port", "0", "--num-cpus", "1"])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if !out.status.success() {
            bail!(
                "ferl start --head: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let field = |prefix: &str| -> Result<String> {
            let at = text.find(prefix).context("ferl start --head output")?;
            let rest = &text[at + prefix.len()..];
            Ok(rest.split([' ', '\n', ',']).next().unwrap_or("").into())
        };
        Ok(Self {
            address: field("ferl head started at ")?,
            token: field("cluster token: ")?,
            pid: field("(pid ")?.parse()?,
            state,
        })
    }

    fn command(state: &Path) -> Command {
        let mut cmd = Command::new(ferl_binary());
        cmd.env("HOME", state.join("home"))
            .env("FERL_TMPDIR", state)
            .env_remove("FERL_TOKEN")
            .env_remove("FERL_ADDRESS");
        cmd
    }

    /// Whether `ferl status` against the head succeeds.
    pub(crate) fn answers(&self) -> Result<(), String> {
        let out = Self::command(&self.state)
            .args(["status", "--address", &self.address, "--token", &self.token])
            .output()
            .map_err(|e| e.to_string())?;
        match out.status.success() {
            true => Ok(()),
            false => Err(format!(
                "the head no longer answers `ferl status`: {}",
                String::from_utf8_lossy(&out.stderr)
            )),
        }
    }
}

impl Drop for Head {
    fn drop(&mut self) {
        let _ = Self::command(&self.state)
            .args(["stop", "--address", &self.address, "--token", &self.token])
            .output();
        if Path::new(&format!("/proc/{}", self.pid)).exists() {
            // SAFETY: signalling the head process this test started.
            unsafe { libc::kill(self.pid as i32, libc::SIGKILL) };
        }
    }
}

/// A running peer, stopped on drop.
pub(crate) struct PeerGuard {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for PeerGuard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts `peer` against `127.0.0.1:port` or the head at `head` (a fake store is listening when this returns).
pub(crate) fn start_peer(peer: Peer, port: u16, head: &str) -> Result<PeerGuard> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let thread = match peer {
        Peer::None => None,
        Peer::UdpGarbageToHead => {
            udp_garbage(head)?;
            None
        }
        Peer::GarbageClient => Some(std::thread::spawn(move || garbage_client(port, &flag))),
        Peer::GarbageStore => {
            let listener = TcpListener::bind(("127.0.0.1", port))?;
            listener.set_nonblocking(true)?;
            Some(std::thread::spawn(move || garbage_store(listener, &flag)))
        }
    };
    Ok(PeerGuard { stop, thread })
}

/// Junk datagrams at the head's UDP port: runts, QUIC-looking long headers with a made-up version, random bytes.
fn udp_garbage(head: &str) -> Result<()> {
    let socket = UdpSocket::bind("127.0.0.1:0")?;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..300usize {
        let mut datagram: Vec<u8> = (0..1200)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        match i % 3 {
            0 => datagram[..5].copy_from_slice(&[0xc0, 0x0a, 0x0a, 0x0a, 0x0a]),
            1 => datagram.truncate(i % 40),
            _ => {}
        }
        socket.send_to(&datagram, head)?;
    }
    Ok(())
}

/// Connects to the store at `port` again and again until stopped, each time sending junk and reading what comes.
fn garbage_client(port: u16, stop: &AtomicBool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !stop.load(Ordering::Acquire) && Instant::now() < deadline {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(&JUNK.repeat(64));
            let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
            let _ = s.read(&mut [0u8; 256]);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Answers every connection with junk until stopped.
fn garbage_store(listener: TcpListener, stop: &AtomicBool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !stop.load(Ordering::Acquire) && Instant::now() < deadline {
        match listener.accept() {
            Ok((mut s, _)) => {
                let _ = s.write_all(&JUNK.repeat(64));
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
