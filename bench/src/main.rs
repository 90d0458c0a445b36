//! `ferl-bench`: benchmarks that print one figure per line (`name value unit`, or JSON with `--json`), side by side
//! with the peers they are compared against. One module per suite.

mod report;

use clap::{Parser, Subcommand};

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
enum Suite {}

fn main() -> anyhow::Result<()> {
    ferl::enter_worker_mode_if_spawned();
    let cli = Cli::parse();
    let mut out = report::Report::new(cli.json);
    match cli.suite {}
    #[allow(unreachable_code)]
    {
        out.finish();
        Ok(())
    }
}
