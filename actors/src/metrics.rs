//! The metrics actor: the run's loggers (`console`, `jsonl` → `metrics.jsonl` under `trainer.default_local_dir`),
//! fed by the driver once per step. The driver adds per-rank peak memory and, where the device's peak FLOP/s is
//! known ([`peak_flops`]), `perf/mfu`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{Context as _, Result};
use ferl_runtime::{Actor, Context, Handler};

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
    /// Folder of `metrics.jsonl`.
    pub dir: String,
}

/// Writes each step's values to the configured loggers.
pub struct Metrics {
    console: bool,
    jsonl: Mutex<Option<std::fs::File>>,
}

impl Metrics {
    /// Opens the loggers; unknown names are reported and skipped (logger plugins are hosted elsewhere).
    pub fn open(args: &MetricsArgs) -> Result<Self> {
        let mut console = false;
        let mut jsonl = None;
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
                other => tracing::warn!(
                    logger = other,
                    "trainer.logger: `{other}` is not handled by the metrics actor"
                ),
            }
        }
        Ok(Self {
            console,
            jsonl: Mutex::new(jsonl),
        })
    }
}

impl Actor for Metrics {
    type Args = MetricsArgs;
    const NAME: &'static str = "ferl.actors.Metrics";
    async fn start(args: MetricsArgs, _: &Context) -> Result<Self> {
        Self::open(&args)
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
        Ok(())
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
