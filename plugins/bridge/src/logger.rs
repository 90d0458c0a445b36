//! Logger plugins as trainer loggers.

use anyhow::Result;
use ferl_plugin_host::{HotLogger, PluginHost, PluginKind, PluginStatus};
use ferl_trainer::metrics::{LoggerContext, LoggerRegistry, MetricsLogger};
use std::path::PathBuf;
use std::sync::Arc;

/// A logger plugin behind the trainer's [`MetricsLogger`]. Each `log` is a step boundary of the job's plugins
/// (see the crate docs); a plugin error is reported as a warning and a panic disables the plugin (the run goes on).
pub struct PluginMetricsLogger {
    boundary: StepBoundary,
    logger: HotLogger,
}

impl PluginMetricsLogger {
    /// Opens logger plugin `name` of `host` with `config`.
    pub fn open(host: Arc<PluginHost>, name: &str, config: &str) -> Result<Self> {
        Ok(Self {
            logger: HotLogger::new(host.clone(), name, config)?,
            boundary: StepBoundary::new(host),
        })
    }

    /// The plugin version in use.
    pub fn version(&self) -> Option<String> {
        self.logger.version()
    }
}

impl MetricsLogger for PluginMetricsLogger {
    fn log(&mut self, step: i64, metrics: &[(String, f64)]) -> Result<()> {
        self.boundary.run(step);
        let pairs: Vec<(&str, f64)> = metrics.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        if let Err(e) = self.logger.log(step.max(0) as u64, &pairs) {
            tracing::warn!("{e}");
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if let Err(e) = self.logger.flush() {
            tracing::warn!("{e}");
        }
        Ok(())
    }
}

/// The plugin step boundary of a job (see [`PluginHost::step_boundary`]): serves reload requests, switches pending
/// versions in (logged), and republishes the state file when what is loaded changed since this boundary last looked
/// (a retired version let go by its last user). Harmless to run more than once per step.
pub struct StepBoundary {
    host: Arc<PluginHost>,
    seen: Vec<PluginStatus>,
}

impl StepBoundary {
    /// The step boundary of `host`.
    pub fn new(host: Arc<PluginHost>) -> Self {
        let seen = host.list();
        Self { host, seen }
    }

    /// Runs the boundary after training step `step`.
    pub fn run(&mut self, step: i64) {
        for s in self.host.step_boundary() {
            tracing::info!(
                "plugin `{}`: version {} -> {} after step {step}",
                s.name,
                s.from,
                s.to
            );
        }
        let now = self.host.list();
        if now != self.seen {
            self.host.publish_state();
            self.seen = now;
        }
    }
}

/// The config string a logger plugin gets in a run: `tensorboard` a folder
/// (`$TENSORBOARD_DIR`, else `RUN_DIR/tensorboard_log/PROJECT/EXPERIMENT`, as verl lays it out), `csv`
/// `RUN_DIR/metrics.csv`, any other plugin `RUN_DIR/NAME.log` (the plugin decides what to do with it).
pub fn logger_config(name: &str, ctx: &LoggerContext) -> PathBuf {
    match name {
        "tensorboard" => std::env::var_os("TENSORBOARD_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                ctx.run_dir
                    .join("tensorboard_log")
                    .join(&ctx.project)
                    .join(&ctx.experiment)
            }),
        "csv" => ctx.run_dir.join("metrics.csv"),
        other => ctx.run_dir.join(format!("{other}.log")),
    }
}

/// Registers every logger plugin `host` has loaded as a `trainer.logger` kind of the same name (a plugin named
/// like a built-in kind replaces it). Returns the names registered.
pub fn register_logger_plugins(
    registry: &mut LoggerRegistry,
    host: &Arc<PluginHost>,
) -> Vec<String> {
    let names: Vec<String> = host
        .list()
        .into_iter()
        .filter(|r| r.state == "current" && r.kind == PluginKind::Logger.as_str())
        .map(|r| r.name)
        .collect();
    for name in &names {
        let (host, n) = (host.clone(), name.clone());
        registry.register(
            name,
            Box::new(move |ctx| {
                let config = logger_config(&n, ctx);
                Ok(Box::new(PluginMetricsLogger::open(
                    host.clone(),
                    &n,
                    &config.to_string_lossy(),
                )?) as Box<dyn MetricsLogger>)
            }),
        );
    }
    names
}
