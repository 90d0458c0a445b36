//! Where per-step metrics go: the [`MetricsLogger`] trait and a [`LoggerRegistry`] of logger kinds by name.
//!
//! `trainer.logger` lists kinds by name; the trainer asks the registry to build each. Built in: `console` (one line
//! per step, printed above the progress bar), `jsonl` (`<default_local_dir>/metrics.jsonl`, one JSON object per
//! step) and `mlflow` (MLflow's file store, see [`mlflow`]). Another kind — e.g. a logger plugin loaded by the plugin host — is added with [`LoggerRegistry::register`]
//! before the run starts; nothing else changes.

use anyhow::{bail, Context, Result};
use ferl_data::Progress;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;

pub mod curves;
pub mod mlflow;
pub use curves::CurvesLogger;
pub use mlflow::MlflowLogger;

/// Receives the metrics of each step (`train/loss`, `train/lr`, `val/loss`, ...).
pub trait MetricsLogger: Send {
    /// Records `metrics` of optimizer step `step` (1-based).
    fn log(&mut self, step: i64, metrics: &[(String, f64)]) -> Result<()>;
    /// Flushes at the end of the run.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// What a logger kind may need to set itself up.
#[derive(Clone)]
pub struct LoggerContext {
    /// `trainer.default_local_dir`.
    pub run_dir: PathBuf,
    /// `trainer.project_name`.
    pub project: String,
    /// `trainer.experiment_name`.
    pub experiment: String,
    /// The run's progress, if one is shown (print through it: the bar stays intact, and a printed line counts as
    /// one of its plain lines in a log).
    pub progress: Option<Progress>,
    /// The run's resolved config as `(dotted key, value)` pairs ([`config_params`]), for loggers that record them
    /// (mlflow's params).
    pub params: Vec<(String, String)>,
}

/// Every set leaf of `cfg`'s resolved config as `(dotted key, value as typed in an override)`; nulls left out.
pub fn config_params<T: serde::Serialize>(cfg: &T) -> Vec<(String, String)> {
    let Ok(tree) = serde_yaml::to_value(cfg) else {
        return Vec::new();
    };
    ferl_config::tree::leaves(&tree)
        .into_iter()
        .filter(|(_, v)| !v.is_null() && !v.is_mapping())
        .map(|(k, v)| (k, ferl_config::supported::inline(&v)))
        .collect()
}

/// Builds a logger of one kind.
pub type LoggerFactory =
    Box<dyn Fn(&LoggerContext) -> Result<Box<dyn MetricsLogger>> + Send + Sync>;

/// Logger kinds by name.
pub struct LoggerRegistry {
    kinds: BTreeMap<String, LoggerFactory>,
}

impl Default for LoggerRegistry {
    fn default() -> Self {
        let mut r = Self {
            kinds: BTreeMap::new(),
        };
        r.register(
            "console",
            Box::new(|ctx| {
                Ok(Box::new(ConsoleLogger {
                    progress: ctx.progress.clone(),
                }))
            }),
        );
        r.register(
            "mlflow",
            Box::new(|ctx| {
                let uri = std::env::var("MLFLOW_TRACKING_URI").ok();
                let root = mlflow::tracking_root(uri.as_deref())?;
                Ok(Box::new(MlflowLogger::create(&root, ctx)?))
            }),
        );
        r.register(
            "jsonl",
            Box::new(|ctx| {
                Ok(Box::new(JsonlLogger::create(
                    ctx.run_dir.join("metrics.jsonl"),
                )?))
            }),
        );
        r
    }
}

impl LoggerRegistry {
    /// Adds (or replaces) the kind `name`.
    pub fn register(&mut self, name: &str, factory: LoggerFactory) {
        self.kinds.insert(name.to_string(), factory);
    }

    /// Adds every kind of `other` (replacing kinds of the same name).
    pub fn merge(&mut self, other: LoggerRegistry) {
        self.kinds.extend(other.kinds);
    }

    /// Names of the registered kinds.
    pub fn names(&self) -> Vec<String> {
        self.kinds.keys().cloned().collect()
    }

    /// Builds one logger per name (an unknown name is an error listing the known ones), then the run's picture
    /// ([`CurvesLogger`], last: it reads what the `jsonl` logger flushed).
    pub fn build(
        &self,
        names: &[String],
        ctx: &LoggerContext,
    ) -> Result<Vec<Box<dyn MetricsLogger>>> {
        let mut loggers = names
            .iter()
            .map(|n| match self.kinds.get(n) {
                Some(f) => f(ctx).with_context(|| format!("trainer.logger: setting up `{n}`")),
                None => bail!(
                    "trainer.logger: unknown logger `{n}` (known: {})",
                    self.names().join(", ")
                ),
            })
            .collect::<Result<Vec<_>>>()?;
        loggers.push(Box::new(CurvesLogger::new(ctx.run_dir.clone())));
        Ok(loggers)
    }
}

/// Prints `step N | key value ...` lines.
pub struct ConsoleLogger {
    progress: Option<Progress>,
}

impl MetricsLogger for ConsoleLogger {
    fn log(&mut self, step: i64, metrics: &[(String, f64)]) -> Result<()> {
        let mut line = format!("step {step}");
        for (k, v) in metrics {
            line.push_str(&format!(" | {k} {v:.6}"));
        }
        match &self.progress {
            Some(p) => p.println(line),
            None => println!("{line}"),
        }
        Ok(())
    }
}

/// Appends one JSON object per step to a file.
pub struct JsonlLogger {
    file: File,
    path: PathBuf,
}

impl JsonlLogger {
    /// Opens `path` for appending (a resumed run continues the same file), creating its folder.
    pub fn create(path: PathBuf) -> Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { file, path })
    }
}

impl MetricsLogger for JsonlLogger {
    fn log(&mut self, step: i64, metrics: &[(String, f64)]) -> Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        for (k, v) in metrics {
            obj.insert(k.clone(), serde_json::Value::from(*v));
        }
        writeln!(self.file, "{}", serde_json::Value::Object(obj))
            .with_context(|| format!("writing {}", self.path.display()))
    }

    fn finish(&mut self) -> Result<()> {
        self.file
            .flush()
            .with_context(|| format!("flushing {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_writes_one_object_per_step_and_unknown_kinds_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = LoggerContext {
            run_dir: dir.path().into(),
            project: "p".into(),
            experiment: "e".into(),
            progress: None,
            params: Vec::new(),
        };
        let reg = LoggerRegistry::default();
        let mut loggers = reg.build(&["jsonl".into()], &ctx).unwrap();
        loggers[0].log(1, &[("train/loss".into(), 2.5)]).unwrap();
        loggers[0]
            .log(2, &[("train/loss".into(), 2.0), ("val/loss".into(), 2.1)])
            .unwrap();
        loggers[0].finish().unwrap();
        let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["step"], 2);
        assert_eq!(lines[1]["val/loss"], 2.1);
        let err = reg
            .build(&["wandb".into()], &ctx)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("wandb") && err.contains("console"), "{err}");
    }
}
