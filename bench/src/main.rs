//! `ferl-bench`: benchmarks that print one figure per line (`name value unit`, or JSON with `--json`), side by side
//! with the peers they are compared against. One module per suite.

mod collectives;
mod kernels;
mod report;
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
    /// CPU collectives of the TCP backend (2 processes on loopback) beside torch.distributed's gloo.
    Collectives(collectives::CollectivesArgs),
    /// Loss step of the tiny Qwen2 with and without the fused linear + cross-entropy kernel (memory, tokens/s).
    Kernels(kernels::KernelsArgs),
    /// Actor runtime: calls, transfers, resource groups, actor creation, cluster start (Ray's microbenchmark rows).
    Runtime(runtime::RuntimeArgs),
    /// SFT train step of the tiny Qwen2 (vocab 151,936) on GSM8K: ferl beside the PyTorch eager loop (tokens/s, peak RSS);
    /// with --lora-rank also ferl LoRA beside transformers + peft.
    Train(Box<train::TrainArgs>),
}

fn main() -> anyhow::Result<()> {
    ferl::enter_worker_mode_if_spawned();
    let cli = Cli::parse();
    let mut out = report::Report::new(cli.json);
    match cli.suite {
        Suite::Collectives(args) => collectives::run(args, &mut out)?,
        Suite::Runtime(args) => runtime::run(args, &mut out)?,
        Suite::Kernels(args) => kernels::run(args, &mut out)?,
        Suite::Train(args) => train::run(*args, &mut out)?,
    }
    #[allow(unreachable_code)]
    {
        out.finish();
        Ok(())
    }
}
