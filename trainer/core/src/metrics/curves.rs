//! The picture every run leaves: `curves.png` in the run folder (`trainer.default_local_dir`), drawn by
//! [`ferl_plot`] when the run ends, and when it fails, up to the failure. It shows the whole run: the run folder's
//! `metrics.jsonl` when the `jsonl` logger wrote one (it holds the steps of earlier, resumed attempts too), else the
//! steps this process logged. It is not a `trainer.logger` kind: the registry adds it to every run's loggers.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use ferl_plot::{Series, CURVES_FILE};

use super::MetricsLogger;

/// Keeps the logged values and draws them when the run ends.
pub struct CurvesLogger {
    run_dir: PathBuf,
    values: BTreeMap<String, BTreeMap<u64, f64>>,
    drawn: bool,
}

impl CurvesLogger {
    /// Draws into `run_dir`.
    pub fn new(run_dir: PathBuf) -> Self {
        Self {
            run_dir,
            values: BTreeMap::new(),
            drawn: false,
        }
    }

    /// Where the picture goes.
    pub fn path(&self) -> PathBuf {
        self.run_dir.join(CURVES_FILE)
    }

    /// Draws the picture (once); a run with nothing logged leaves none.
    fn draw(&mut self) -> Result<()> {
        self.drawn = true;
        let jsonl = self.run_dir.join("metrics.jsonl");
        let series: Series = match jsonl.is_file() {
            true => ferl_plot::read_metrics(&jsonl)?,
            false => self
                .values
                .iter()
                .map(|(k, v)| (k.clone(), v.iter().map(|(&s, &x)| (s, x)).collect()))
                .collect(),
        };
        if series.is_empty() {
            return Ok(());
        }
        ferl_plot::draw(&series, None, &self.path())
    }
}

impl MetricsLogger for CurvesLogger {
    fn log(&mut self, step: i64, metrics: &[(String, f64)]) -> Result<()> {
        for (k, v) in metrics.iter().filter(|(_, v)| v.is_finite()) {
            self.values
                .entry(k.clone())
                .or_default()
                .insert(step.max(0) as u64, *v);
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.draw()
    }
}

impl Drop for CurvesLogger {
    /// A failed run never finishes its loggers: its picture is drawn here, up to the failure (a picture that
    /// cannot be drawn then is only a warning: the run's own error is the one that matters).
    fn drop(&mut self) {
        if !self.drawn {
            if let Err(e) = self.draw() {
                tracing::warn!("drawing {}: {e:#}", self.path().display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_that_fails_draws_its_curves_up_to_the_failure_and_an_empty_one_draws_none() {
        let dir = tempfile::tempdir().unwrap();
        let mut logger = CurvesLogger::new(dir.path().to_path_buf());
        for step in 1..=3 {
            let loss = vec![("train/loss".to_string(), 1.0 / step as f64)];
            logger.log(step, &loss).unwrap();
        }
        let path = logger.path();
        drop(logger); // a failed run never calls finish
        let drawn = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        assert!(drawn > 10_000, "{}: {drawn} bytes", path.display());
        let empty = tempfile::tempdir().unwrap();
        CurvesLogger::new(empty.path().to_path_buf())
            .finish()
            .unwrap();
        assert!(!empty.path().join(CURVES_FILE).exists());
    }
}
