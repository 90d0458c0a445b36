//! The metrics actor: the run's loggers (`console`, `jsonl` → `metrics.jsonl` under `trainer.default_local_dir`,
//! and every logger plugin its plugin host has loaded, e.g. `tensorboard`, by name), fed by the driver once per step.
//! The driver adds per-rank peak memory and, where the device's peak FLOP/s is known ([`peak_flops`]), `perf/mfu`.
//! Each step's logging is the plugin host's step boundary (new plugin versions switch in there).

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context as _, Result};
use ferl_plugin_bridge::register_logger_plugins;
use ferl_plugin_host::PluginHost;
use ferl_runtime::{Actor, Context, Handler};
use ferl_trainer::metrics::{LoggerContext, LoggerRegistry, MetricsLogger};

use crate::messages::{FlushLogs, Log};

/// Dense bf16 peak FLOP/s of one device: `FERL_PEAK_FLOPS` when set, else looked up by the GPU's name from
/// `nvidia-smi` (H100/H200: 989e12, A100: 312e12, L40S: 362e12), else unknown (the CPU has no listed peak).
pub fn peak_flops(on_gpu: bool) -> Option<f64> {
    if let Some(v) = std::env::var("FERL_PEAK_FLOPS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Some(v);
    }
    if !on_gpu {
        return None;
    }
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()?;
    let name = String::from_utf8_lossy(&out.stdout).to_uppercase();
    [
        ("H200", 989e12),
        ("H100", 989e12),
        ("A100", 312e12),
        ("L40S", 362e12),
    ]
    .iter()
    .find(|(k, _)| name.contains(k))
    .map(|&(_, v)| v)
}

/// Model FLOPs utilisation: `6 * params * tokens` (forward and backward) over the step time and the peak of
/// `devices` devices.
pub fn mfu(num_params: i64, tokens: i64, seconds: f64, devices: usize, peak: f64) -> f64 {
    6.0 * num_params as f64 * tokens as f64 / (seconds.max(1e-9) * devices as f64 * peak)
}

/// Constructor arguments of [`Metrics`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Clone)]
pub struct MetricsArgs {
    /// `trainer.logger` entries.
    pub loggers: Vec<String>,
    /// The run directory (`trainer.default_local_dir`): `metrics.jsonl` and the plugins' files go there.
    pub dir: String,
    /// `trainer.project_name` (the TensorBoard plugin's folder is `DIR/tensorboard_log/PROJECT/EXPERIMENT`).
    pub project: String,
    /// `trainer.experiment_name`.
    pub experiment: String,
}

/// Writes each step's values to the configured loggers.
pub struct Metrics {
    console: bool,
    jsonl: Mutex<Option<std::fs::File>>,
    plugins: Mutex<PluginLoggers>,
}

/// The logger plugins in use, by `trainer.logger` name.
type PluginLoggers = Vec<(String, Box<dyn MetricsLogger>)>;

impl Metrics {
    /// Opens the built-in loggers only (`console`, `jsonl`); any other name is an error.
    pub fn open(args: &MetricsArgs) -> Result<Self> {
        Self::open_with_plugins(args, None)
    }

    /// Opens the loggers `args` names: `console`, `jsonl`, or a logger plugin of `host`; an unknown name is an error
    /// listing the known ones.
    pub fn open_with_plugins(args: &MetricsArgs, host: Option<&Arc<PluginHost>>) -> Result<Self> {
        let mut console = false;
        let mut jsonl = None;
        let mut registry = LoggerRegistry::default();
        let plugin_names = match host {
            Some(h) => register_logger_plugins(&mut registry, h),
            None => Vec::new(),
        };
        let ctx = LoggerContext {
            run_dir: PathBuf::from(&args.dir),
            project: args.project.clone(),
            experiment: args.experiment.clone(),
            progress: None,
        };
        let mut plugins = Vec::new();
        for name in &args.loggers {
            match name.as_str() {
                "console" => console = true,
                "jsonl" => {
                    let dir = PathBuf::from(&args.dir);
                    std::fs::create_dir_all(&dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                    let path = dir.join("metrics.jsonl");
                    let file = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&path)
                        .with_context(|| format!("opening {}", path.display()))?;
                    jsonl = Some(file);
                }
                other if plugin_names.iter().any(|n| n == other) => {
                    let mut built = registry.build(&[other.to_string()], &ctx)?;
                    plugins.push((other.to_string(), built.remove(0)));
                }
                other => {
                    let mut known = vec!["console".to_string(), "jsonl".to_string()];
                    known.extend(plugin_names.iter().cloned());
                    bail!(
                        "trainer.logger: unknown logger `{other}` (known: {}; logger plugins come from \
                         $FERL_PLUGIN_PATH)",
                        known.join(", ")
                    )
                }
            }
        }
        Ok(Self {
            console,
            jsonl: Mutex::new(jsonl),
            plugins: Mutex::new(plugins),
        })
    }
}

impl Actor for Metrics {
    type Args = MetricsArgs;
    const NAME: &'static str = "ferl.actors.Metrics";
    async fn start(args: MetricsArgs, _: &Context) -> Result<Self> {
        let host = crate::plugins::actor_plugin_host()?;
        Self::open_with_plugins(&args, host.as_ref())
    }
}

impl Metrics {
    /// Writes one step's values to every logger.
    pub fn log(&self, m: &Log) -> Result<()> {
        if self.console {
            let parts: Vec<String> = m
                .values
                .iter()
                .map(|(k, v)| format!("{k}:{v:.6}"))
                .collect();
            println!("step:{} - {}", m.step, parts.join(" - "));
        }
        if let Some(file) = self
            .jsonl
            .lock()
            .map_err(|_| anyhow::anyhow!("metrics lock poisoned"))?
            .as_mut()
        {
            let mut row = serde_json::Map::new();
            row.insert("step".into(), m.step.into());
            for (k, v) in &m.values {
                row.insert(k.clone(), serde_json::Value::from(*v));
            }
            writeln!(file, "{}", serde_json::Value::Object(row))
                .context("writing metrics.jsonl")?;
        }
        // Plugin loggers report their own failures as warnings; a panicking one is disabled (the run goes on).
        for (name, logger) in self.plugins_guard()?.iter_mut() {
            logger
                .log(m.step as i64, &m.values)
                .with_context(|| format!("trainer.logger `{name}`"))?;
        }
        Ok(())
    }

    fn plugins_guard(&self) -> Result<std::sync::MutexGuard<'_, PluginLoggers>> {
        self.plugins
            .lock()
            .map_err(|_| anyhow::anyhow!("metrics plugin loggers lock poisoned"))
    }

    /// Flushes every logger.
    pub fn flush(&self) -> Result<()> {
        if let Some(file) = self
            .jsonl
            .lock()
            .map_err(|_| anyhow::anyhow!("metrics lock poisoned"))?
            .as_mut()
        {
            file.flush().context("flushing metrics.jsonl")?;
        }
        for (name, logger) in self.plugins_guard()?.iter_mut() {
            logger
                .finish()
                .with_context(|| format!("trainer.logger `{name}`"))?;
        }
        std::io::stdout().flush().ok();
        Ok(())
    }
}

impl Handler<Log> for Metrics {
    async fn handle(&self, m: Log, _: &Context) -> Result<()> {
        self.log(&m)
    }
}

impl Handler<FlushLogs> for Metrics {
    async fn handle(&self, _: FlushLogs, _: &Context) -> Result<()> {
        self.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mfu_is_six_flops_per_param_token_over_peak() {
        let v = mfu(1_000_000, 1000, 1.0, 2, 6e9);
        assert!((v - 0.5).abs() < 1e-12, "{v}");
    }
}
