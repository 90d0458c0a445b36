//! The umbrella crate a driver script depends on: the runtime, the trainer, the standard actors and the plugin host,
//! re-exported under one name, plus the process-level glue the `ferl` binary uses.

pub use ferl_actors as actors;
pub use ferl_plugin_host as plugins;
pub use ferl_rl as rl;
pub use ferl_runtime as runtime;
pub use ferl_trainer as trainer;

/// The driver API of the runtime under short names (see [`ferl_runtime`] for the data model).
pub use ferl_runtime::{
    bundle, connect, connect_or_init, init, message, register_actor, stream_message, Actor,
    ActorRef, Cluster, Context, Error, Event, Handler, HeadOptions, ItemSink, Message, NodeOptions,
    ResourceGroup, Resources, SpawnOptions, Strategy, StreamHandler, StreamMessage, WorkerGroup,
};

/// If this process was started by a node agent as a worker, host actors until told to stop, then exit; otherwise
/// return at once. Every binary that spawns actors calls this first thing in `main`. Before that it makes libtorch
/// put large CPU tensors in huge pages ([`ferl_trainer::huge_pages::prefer_huge_pages`]) in this process and the
/// workers it starts.
pub fn enter_worker_mode_if_spawned() {
    ferl_trainer::huge_pages::prefer_huge_pages();
    ferl_runtime::enter_worker_mode_if_spawned();
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`), in colour only when [`stderr_wants_colour`].
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(stderr_wants_colour())
        .try_init();
}

/// Whether log lines on stderr may carry ANSI colour codes: only when stderr is a terminal and `$NO_COLOR` is unset
/// or empty (<https://no-color.org>), so a redirected log (`2>log`, a pipe, a worker's log file) stays plain text.
pub fn stderr_wants_colour() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
