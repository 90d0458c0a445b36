//! The `ferl` command line: cluster bootstrap (`start`, `status`, `stop`), jobs and logs (`job`, `logs`), SFT (`sft`,
//! `demo`, `data`, `model`, `export`), generation (`generate`) and plugins (`plugin`). Each subcommand lives in its own module
//! under `cmd/`.

mod cmd;

use clap::{Parser, Subcommand};

/// mimalloc keeps freed pages for reuse: the runtime's large message buffers are not page-faulted in again per call
/// (glibc returns every block over 32 MiB to the kernel on free).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// ferl: a Ray-like actor runtime and a verl-style SFT trainer in one binary.
#[derive(Parser)]
#[command(name = "ferl", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a head (`--head`) or a node joining one (`--address HOST:PORT`).
    Start(cmd::cluster::StartArgs),
    /// Show nodes, resources, actors and resource groups of a running cluster.
    Status(cmd::cluster::StatusArgs),
    /// Stop the head and node processes started on this machine.
    Stop(cmd::cluster::StopArgs),
    /// Jobs the cluster owns: submit a driver command for the head to run, see its status and logs, stop it.
    #[command(subcommand)]
    Job(cmd::job::JobCommand),
    /// Node logs through their node agents: `--node NAME` lists them, `--node NAME FILE` or `--actor ID` prints one.
    Logs(cmd::logs::LogsArgs),
    /// Supervised fine-tuning with verl's config keys (`key=value` overrides).
    Sft(cmd::sft::SftArgs),
    /// The main job on its embedded default: a tiny Qwen2, GSM8K, 2 SFT ranks on an embedded cluster (`--out`).
    Demo(cmd::demo::DemoArgs),
    /// Prepare datasets (`ferl data gsm8k`).
    #[command(subcommand)]
    Data(cmd::data::DataCommand),
    /// Model utilities (`ferl model init`).
    #[command(subcommand)]
    Model(cmd::model::ModelCommand),
    /// Export a checkpoint as a Hugging Face folder.
    Export(cmd::export::ExportArgs),
    /// Generate responses to a parquet of chat prompts (verl's main_generation).
    Generate(cmd::generate::GenerateArgs),
    /// GRPO/RLOO with verl's ppo_trainer keys (`key=value` overrides), rollout colocated with the actor.
    Grpo(cmd::grpo::GrpoArgs),
    /// List and reload plugins.
    #[command(subcommand)]
    Plugin(cmd::plugin::PluginCommand),
    /// Draw a run's curves (`metrics.jsonl`) to a PNG or an SVG.
    Plot(cmd::plot::PlotArgs),
}

fn main() -> anyhow::Result<()> {
    // A worker process is this same binary started by a node agent: it must host actors, not parse a command line.
    ferl::enter_worker_mode_if_spawned();
    ferl::init_tracing();
    let cli = Cli::parse();
    match cli.command {
        Command::Start(a) => cmd::cluster::start(a),
        Command::Status(a) => cmd::cluster::status(a),
        Command::Stop(a) => cmd::cluster::stop(a),
        Command::Job(c) => cmd::job::run(c),
        Command::Logs(a) => cmd::logs::run(a),
        Command::Sft(a) => cmd::sft::run(a),
        Command::Grpo(a) => cmd::grpo::run(a),
        Command::Demo(a) => cmd::demo::run(a),
        Command::Data(c) => cmd::data::run(c),
        Command::Model(c) => cmd::model::run(c),
        Command::Export(a) => cmd::export::run(a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::Plugin(c) => cmd::plugin::run(c),
        Command::Plot(a) => cmd::plot::run(a),
    }
}
