//! `ferl sft` with plugins: one call that sets up the job's plugin host and runs the trainer with it.

use crate::{
    job_plugin_host, liger_kernels, plugin_dataset, register_logger_plugins, StepBoundary,
};
use anyhow::{Context, Result};
use ferl_plugin_host::PluginHost;
use ferl_trainer::config::{expand_path, SftConfig};
use ferl_trainer::sft::{run as run_plain, run_with_data, RunOptions, RunSummary};
use std::path::PathBuf;
use std::sync::Arc;

/// The run options of `cfg` with its plugins: the host of the run directory (`trainer.default_local_dir`) watching
/// `folders` and `$FERL_PLUGIN_PATH`, every loaded logger plugin as a `trainer.logger` kind, the `liger` kernels
/// (RMSNorm, SwiGLU, fused linear + cross-entropy) when `model.use_liger=true` (the loaded `liger` plugin, else the
/// built-in copy), and the plugins' step boundary after every step (reload requests of `ferl plugin reload` are
/// served there, whatever the loggers are).
pub fn plugin_run_options(
    cfg: &SftConfig,
    folders: &[PathBuf],
) -> Result<(RunOptions, Arc<PluginHost>)> {
    let run_dir = expand_path(&cfg.trainer.default_local_dir);
    let host = job_plugin_host(&run_dir, folders)?;
    let mut opts = RunOptions::default();
    register_logger_plugins(&mut opts.loggers, &host);
    if cfg.model.use_liger {
        opts.kernels = liger_kernels(Some(host.clone()));
    }
    let mut boundary = StepBoundary::new(host.clone());
    opts.on_step_end = Some(Box::new(move |step| boundary.run(step)));
    Ok((opts, host))
}

/// Runs SFT as `cfg` says, with plugins (see [`plugin_run_options`]); `data.plugin=NAME` (or
/// `data.custom_cls.path=LIB` with `data.custom_cls.name=NAME`) reads `data.train_files` and `data.val_files` through
/// that dataset plugin.
pub fn run_sft(cfg: &SftConfig, folders: &[PathBuf]) -> Result<RunSummary> {
    let (opts, host) = plugin_run_options(cfg, folders)?;
    // verl's data.custom_cls.path/name: a dataset plugin file, read as data.plugin.
    let mut cfg = cfg.clone();
    crate::dataset::resolve_custom_cls(&host, &mut cfg)?;
    let cfg = &cfg;
    if cfg.data.plugin.is_none() {
        return run_plain(cfg, opts);
    }
    let tokenizer_dir = expand_path(&cfg.model.partial_pretrain);
    let d = &cfg.data;
    let train = plugin_dataset(
        &host,
        d,
        d.train_files.as_slice(),
        &tokenizer_dir,
        d.train_max_samples,
    )
    .context("loading data.train_files")?;
    let val = if d.val_files.as_slice().is_empty() {
        None
    } else {
        Some(
            plugin_dataset(
                &host,
                d,
                d.val_files.as_slice(),
                &tokenizer_dir,
                d.val_max_samples,
            )
            .context("loading data.val_files")?,
        )
    };
    run_with_data(cfg, &train, val.as_ref(), opts)
}
