//! `ferl sft`: supervised fine-tuning with verl's config keys (`--config FILE`, `key=value` overrides, `--cfg job`).

use anyhow::{bail, Result};
use clap::Args;
use ferl_trainer::config::SftConfig;
use std::path::PathBuf;

/// Arguments of `ferl sft`.
#[derive(Args, Debug)]
pub(crate) struct SftArgs {
    /// A YAML file with verl's `sft_trainer.yaml` keys.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// `--cfg job` prints the resolved config and exits without training.
    #[arg(long = "cfg", value_name = "job")]
    pub cfg: Option<String>,
    /// Overrides: `a.b=c`, `+a.b=c`, `~a.b`, lists as `[x,y]`.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Distributed training: `--nproc-per-node`, `--nnodes`, `--address` (see `sft_dist`).
    #[command(flatten)]
    pub dist: super::sft_dist::DistArgs,
}

/// Loads the config and trains as the flags say (one process, a cluster, or a launcher rank).
pub(crate) fn run(args: SftArgs) -> Result<()> {
    let cfg = SftConfig::load(args.config.as_deref(), &args.overrides)?;
    match args.cfg.as_deref() {
        Some("job") => {
            print!("{}", cfg.to_yaml());
            return Ok(());
        }
        Some(other) => bail!("--cfg {other}: only `--cfg job` is supported"),
        None => {}
    }
    super::sft_dist::run(cfg, &args.dist)
}
