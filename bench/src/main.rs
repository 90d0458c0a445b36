//! `ferl-bench`: benchmarks that print one figure per line (`name value unit`, or JSON with `--json`), side by side
//! with the peers they are compared against. One module per suite.
//!
//! Every process of a run, the PyTorch and transformers peers included, inherits `THP_MEM_ALLOC_ENABLE=1` (libtorch's
//! large CPU tensors in huge pages, set by `ferl::enter_worker_mode_if_spawned` unless the caller set it), so both
//! sides of a comparison allocate alike; run with `THP_MEM_ALLOC_ENABLE=0` to measure both without.

mod chaos;
mod collectives;
mod kernels;
mod report;
mod rl;
mod runtime;
mod train;

use clap::{Parser, Subcommand};

/// The same allocator as the `ferl` binary (see ferl/src/main.rs), so the figures are the product's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// ferl benchmarks.
#[derive(Parser)]
#[command(name = "ferl-bench", about)]
struct Cli {
    /// Print one JSON object per figure instead of `name value unit`.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    suite: Suite,
}

#[derive(Subcommand)]
enum Suite {
    /// Chaos soak on network namespaces: actors calling each other while nodes are killed and restarted and links
    /// lose packets; calls completed, failed and hung, worst detection time (needs root).
    Chaos(chaos::ChaosArgs),
    /// A node agent of the chaos soak (started by `chaos` inside a host's namespace).
    #[command(hide = true)]
    ChaosNode(chaos::NodeArgs),
    /// A head on loopback in a process of its own, for the runtime suite's remote-head row (internal).
    #[command(hide = true)]
    RuntimeHead(runtime::remote_head::HeadArgs),
    /// CPU collectives of the TCP backend (2 processes on loopback) beside torch.distributed's gloo.
    Collectives(collectives::CollectivesArgs),
    /// Loss step of the tiny Qwen2 with and without the fused linear + cross-entropy kernel (memory, tokens/s).
    Kernels(kernels::KernelsArgs),
    /// Actor runtime: calls, transfers, resource groups, actor creation, cluster start (Ray's microbenchmark rows).
    Runtime(runtime::RuntimeArgs),
    /// RL on the CPU: rollout generation tokens/s beside transformers (tiny and 0.5B-shaped Qwen2), the weight sync
    /// between processes beside the transport, and one GRPO step's time split over verl's phases (`timing_s/*`).
    Rl(rl::RlArgs),
    /// SFT train step of the tiny Qwen2 (vocab 151,936) on GSM8K: ferl beside the PyTorch eager loop (tokens/s, peak RSS);
    /// with --lora-rank also ferl LoRA beside transformers + peft.
    Train(Box<train::TrainArgs>),
}

fn main() -> anyhow::Result<()> {
    // Keeps the standard actors (the rl suite's PolicyActor and Rollout) registered in this binary, whose workers
    // re-run it.
    ferl::actors::ensure_linked();
    ferl::enter_worker_mode_if_spawned();
    let cli = Cli::parse();
    let mut out = report::Report::new(cli.json);
    match cli.suite {
        Suite::Chaos(args) => chaos::run(args, &mut out)?,
        Suite::ChaosNode(args) => chaos::node(args)?,
        Suite::Collectives(args) => collectives::run(args, &mut out)?,
        Suite::Runtime(args) => runtime::run(args, &mut out)?,
        Suite::RuntimeHead(args) => runtime::remote_head::serve(args)?,
        Suite::Kernels(args) => kernels::run(args, &mut out)?,
        Suite::Rl(args) => rl::run(args, &mut out)?,
        Suite::Train(args) => train::run(*args, &mut out)?,
    }
    #[allow(unreachable_code)]
    {
        out.finish();
        Ok(())
    }
}
