//! Worker mode: a node agent starts the driver's own binary with [`env::ACTOR_ID`] set; the binary's first call,
//! [`enter_worker_mode_if_spawned`], notices, builds the actor it was started for, hosts it, and exits when its node
//! agent goes away. Without that variable the call returns at once.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context as _, Result};
use rkyv::util::AlignedVec;

use crate::actor::process::{Process, NODE_ACTOR};
use crate::actor::{self, Context};
use crate::control::config::RuntimeConfig;
use crate::protocol::{WorkerHello, WorkerReady};
use crate::security::tls::Credentials;

/// Environment variables a node agent sets for its workers.
pub(crate) mod env {
    /// The actor id the worker hosts; its presence means "worker mode".
    pub(crate) const ACTOR_ID: &str = "FERL_WORKER_ACTOR_ID";
    /// The node agent's address.
    pub(crate) const NODE_ADDR: &str = "FERL_NODE_ADDR";
    /// The head's address.
    pub(crate) const HEAD_ADDR: &str = "FERL_HEAD_ADDR";
    /// Path of the credentials file (0600).
    pub(crate) const CREDS: &str = "FERL_WORKER_CREDS";
    /// The node's name.
    pub(crate) const NODE_NAME: &str = "FERL_NODE_NAME";
    /// The IP to bind.
    pub(crate) const BIND_IP: &str = "FERL_BIND_IP";
}

/// A variable of the process environment by name (the bootstrap layer's one lookup function).
pub(crate) type Lookup = fn(&str) -> Option<String>;

/// If this process was started as a worker (its environment, read through `lookup`, has [`env::ACTOR_ID`]), host
/// its actor until the node agent goes away, then exit; otherwise return at once. Every binary that spawns actors
/// calls this (through the facade's `enter_worker_mode_if_spawned`) first thing in `main`.
pub(crate) fn enter_worker_mode_if_spawned(lookup: Lookup) {
    let Some(id) = lookup(env::ACTOR_ID) else {
        return;
    };
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // A worker's stderr is its log file: colour only if someone runs it on a terminal by hand.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && lookup("NO_COLOR").is_none_or(|v| v.is_empty());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .try_init();
    let config = RuntimeConfig::from_lookup(lookup);
    // Run on a thread of our own: `main` may already be inside a tokio runtime (`#[tokio::main]`).
    let worker = std::thread::spawn(move || {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        if let Some(n) = config.worker_threads {
            builder.worker_threads(n);
        }
        let rt = builder
            .enable_all()
            .build()
            .expect("building the worker's tokio runtime");
        rt.block_on(run(id, lookup, config))
    });
    let code = match worker.join() {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            eprintln!("ferl worker: {e:#}");
            1
        }
        Err(_) => {
            eprintln!("ferl worker: panicked");
            1
        }
    };
    std::process::exit(code);
}

async fn run(id: String, lookup: Lookup, config: RuntimeConfig) -> Result<()> {
    let var = |name: &str| {
        lookup(name).with_context(|| format!("worker environment variable {name} is missing"))
    };
    let id: u64 = id
        .parse()
        .with_context(|| format!("{} = `{id}` is not a number", env::ACTOR_ID))?;
    let node: SocketAddr = var(env::NODE_ADDR)?.parse()?;
    let head: SocketAddr = var(env::HEAD_ADDR)?.parse()?;
    let creds = Credentials::load(&PathBuf::from(var(env::CREDS)?))?;
    let ip = var(env::BIND_IP).unwrap_or_else(|_| "127.0.0.1".into());
    let process = Process::start(
        creds,
        SocketAddr::new(ip.parse()?, 0),
        Duration::from_secs(10),
        config.transport,
    )?;
    let _ = process.head.set(head);
    let _ = process
        .node
        .set((node, var(env::NODE_NAME).unwrap_or_default()));
    let spec = process
        .call_at(
            node,
            NODE_ACTOR,
            &WorkerHello {
                id,
                addr: process.addr.to_string(),
            },
        )
        .await?;
    let built = construct(&process, id, &spec).await;
    let error = built.as_ref().err().map(|e| format!("{e:#}"));
    process
        .call_at(
            node,
            NODE_ACTOR,
            &WorkerReady {
                id,
                error: error.clone(),
            },
        )
        .await?;
    built?;
    if let Err(e) = process.follow_head_events().await {
        tracing::warn!("worker for actor {id} cannot follow cluster events: {e}");
    }
    // Live as long as the node agent does.
    let conn = process.conns.get(node).await?;
    conn.closed().await;
    Err(anyhow!("node agent at {node} went away"))
}

async fn construct(
    process: &Arc<Process>,
    id: u64,
    spec: &crate::protocol::SpawnSpec,
) -> Result<()> {
    let factory = actor::lookup(&spec.type_name).ok_or_else(|| {
        anyhow!(
            "actor type `{}` is not registered in {} (registered: {})",
            spec.type_name,
            std::env::current_exe()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            actor::registered_names().join(", ")
        )
    })?;
    let mut args = AlignedVec::<16>::with_capacity(spec.args.len());
    args.extend_from_slice(&spec.args);
    let ctx = Context {
        actor_id: id,
        process: process.clone(),
    };
    let actor = (factory.construct)(args, ctx)
        .await
        .with_context(|| format!("constructor of actor {} {id} failed", spec.type_name))?;
    process.host_any(
        id,
        actor,
        (factory.dispatch)(),
        spec.max_concurrency.max(1) as usize,
        spec.mailbox.max(1) as usize,
    );
    Ok(())
}
