//! `ferl sft`: supervised fine-tuning with verl's config keys (`--config FILE`, `key=value` overrides, `--cfg job`).

use anyhow::Result;
use clap::Args;
use ferl_trainer::config::SftConfig;

/// Arguments of `ferl sft`.
#[derive(Args, Debug)]
pub(crate) struct SftArgs {
    /// The config file, overrides and `--cfg job`.
    #[command(flatten)]
    pub config: super::ConfigArgs,
    /// Distributed training: `--nproc-per-node`, `--nnodes`, `--address` (see `sft_dist`).
    #[command(flatten)]
    pub dist: super::sft_dist::DistArgs,
}

/// Loads the config and trains as the flags say (one process, a cluster, or a launcher rank).
pub(crate) fn run(args: SftArgs) -> Result<()> {
    let c = &args.config;
    let cfg = SftConfig::load(c.config.as_deref(), &c.overrides)?;
    if c.print_job(|| cfg.to_yaml())? {
        return Ok(());
    }
    super::sft_dist::run(cfg, &args.dist)
}
