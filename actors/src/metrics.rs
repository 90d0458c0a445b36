//! The run's loggers: `trainer.logger` names built from one [`LoggerRegistry`] — the built-in `console`, `jsonl`
//! (`metrics.jsonl` under `trainer.default_local_dir`) and `mlflow` (MLflow's file store) and every logger plugin the plugin host has loaded, e.g.
//! `tensorboard`, by name. The run loop logs through [`build_loggers`]; the [`Metrics`] actor offers the same loggers
//! to driver scripts that want them behind an actor.

use std::sync::{Arc, Mutex};

use anyhow::{Context as _, Result};
use ferl_config::{expand_path, SftConfig};
use ferl_plugin_bridge::register_logger_plugins;
use ferl_plugin_host::PluginHost;
use ferl_runtime::{Actor, Context, Handler};
use ferl_trainer::metrics::{config_params, LoggerContext, LoggerRegistry, MetricsLogger};
use ferl_trainer::run::Progress;

use crate::messages::{FlushLogs, Log};

/// The logger kinds of this process: the built-in ones and the logger plugins `host` has loaded.
pub fn logger_registry(host: Option<&Arc<PluginHost>>) -> LoggerRegistry {
    let mut registry = LoggerRegistry::default();
    if let Some(h) = host {
        register_logger_plugins(&mut registry, h);
    }
    registry
}

/// The loggers `trainer.logger` names, built from `registry` (printing through `progress` when given).
pub fn build_loggers(
    cfg: &SftConfig,
    registry: &LoggerRegistry,
    progress: Option<Progress>,
) -> Result<Vec<Box<dyn MetricsLogger>>> {
    let ctx = LoggerContext {
        run_dir: expand_path(&cfg.trainer.default_local_dir),
        project: cfg.trainer.project_name.clone(),
        experiment: cfg.trainer.experiment_name.clone(),
        progress,
        params: config_params(cfg),
    };
    registry.build(cfg.trainer.logger.as_slice(), &ctx)
}

/// Constructor arguments of [`Metrics`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct MetricsArgs {
    /// The resolved config as YAML (`trainer.logger`, the run directory, project and experiment names).
    pub config_yaml: String,
}

/// Writes each step's values to the configured loggers.
pub struct Metrics {
    loggers: Mutex<Vec<Box<dyn MetricsLogger>>>,
}

impl Metrics {
    /// The loggers of `cfg`, with the logger plugins of `host`.
    pub fn open(cfg: &SftConfig, host: Option<&Arc<PluginHost>>) -> Result<Self> {
        let loggers = build_loggers(cfg, &logger_registry(host), None)?;
        Ok(Self {
            loggers: Mutex::new(loggers),
        })
    }

    fn loggers(&self) -> Result<std::sync::MutexGuard<'_, Vec<Box<dyn MetricsLogger>>>> {
        self.loggers
            .lock()
            .map_err(|_| anyhow::anyhow!("metrics lock poisoned"))
    }
}

impl Actor for Metrics {
    type Args = MetricsArgs;
    const NAME: &'static str = "ferl.actors.Metrics";
    async fn start(args: MetricsArgs, _: &Context) -> Result<Self> {
        let cfg =
            SftConfig::from_yaml(&args.config_yaml, &[]).context("metrics: reading the config")?;
        let host = crate::plugins::actor_plugin_host()?;
        Self::open(&cfg, host.as_ref())
    }
}

impl Handler<Log> for Metrics {
    async fn handle(&self, m: Log, _: &Context) -> Result<()> {
        for l in self.loggers()?.iter_mut() {
            l.log(m.step as i64, &m.values)?;
        }
        Ok(())
    }
}

impl Handler<FlushLogs> for Metrics {
    async fn handle(&self, _: FlushLogs, _: &Context) -> Result<()> {
        for l in self.loggers()?.iter_mut() {
            l.finish()?;
        }
        Ok(())
    }
}
