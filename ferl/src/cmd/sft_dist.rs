//! `ferl sft` across several ranks: `--nproc-per-node N` (an embedded cluster, or the running one at `--address`
//! with `--nnodes M`) trains with the standard actors; ranks started by an external launcher (torchrun's `RANK`/
//! `WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`, or `srun` with several tasks) each run one rank in-process.

use anyhow::Result;
use clap::Args;
use ferl_actors::sft::{coordinates, run as run_sft, Launch, RunSummary};
use ferl_trainer::config::SftConfig;

/// The distribution flags of `ferl sft`.
#[derive(Args, Debug, Default, Clone)]
pub(crate) struct DistArgs {
    /// Ranks per machine: one trainer actor per bundle of a resource group (GPU bundles on GPU machines).
    #[arg(long = "nproc-per-node", visible_alias = "nproc_per_node")]
    pub nproc_per_node: Option<usize>,
    /// Machines of a running cluster: --nproc-per-node ranks on each of --nnodes distinct nodes, as torchrun
    /// places them, or a refusal naming the shortfall (needs --address).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// A running cluster's head, `HOST:PORT` (token from FERL_TOKEN or the local head); default: FERL_ADDRESS, else
    /// an embedded cluster.
    #[arg(long, env = "FERL_ADDRESS")]
    pub address: Option<String>,
}

/// Whether this process was started as one rank of an external launch (torchrun, or `srun` with several tasks).
pub(crate) fn launched_externally() -> bool {
    let set = |k: &str| std::env::var_os(k).is_some();
    let slurm_tasks = std::env::var("SLURM_NTASKS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1);
    (set("RANK") && set("WORLD_SIZE")) || (set("SLURM_PROCID") && slurm_tasks > 1)
}

impl DistArgs {
    /// The launch these flags (and the environment) ask for.
    pub(crate) fn launch(&self) -> Launch {
        match self.nproc_per_node {
            Some(n) => Launch::Cluster {
                nproc_per_node: n,
                nnodes: self.nnodes,
                address: self.address.clone(),
            },
            None if launched_externally() => Launch::Launcher,
            None if self.nnodes > 1 => Launch::Cluster {
                nproc_per_node: 1,
                nnodes: self.nnodes,
                address: self.address.clone(),
            },
            None => Launch::OneProcess,
        }
    }
}

/// Trains `cfg` as the flags say and prints what happened (only rank 0 of an external launch: every rank's summary
/// is the same).
pub(crate) fn run(cfg: SftConfig, args: &DistArgs) -> Result<()> {
    let launch = args.launch();
    let run_dir = ferl_data::expand_path(&cfg.trainer.default_local_dir);
    let summary = run_sft(cfg, &launch)?;
    if coordinates(&launch) {
        print_summary(&summary);
        super::print_curves(&run_dir);
    }
    Ok(())
}

fn print_summary(summary: &RunSummary) {
    match (summary.steps.first(), summary.steps.last()) {
        (Some(a), Some(b)) => println!(
            "trained steps {}..{} on {} rank(s): train/loss {:.4} -> {:.4}",
            a.step, b.step, summary.world_size, a.loss, b.loss
        ),
        _ => println!("nothing to train: already at step {}", summary.global_step),
    }
    if let Some((step, v)) = summary.val_losses.last() {
        println!("val/loss {v:.4} at step {step}");
    }
    if let Some(c) = &summary.last_checkpoint {
        println!("checkpoint: {}", c.display());
    }
    for r in &summary.restarts {
        println!(
            "restarted after step {} ({}), resumed from step {} on {} rank(s): {}",
            r.failed_after_step, r.cause_kind, r.resumed_from, r.world_size, r.cause
        );
    }
}
