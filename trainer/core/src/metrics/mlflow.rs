//! The `mlflow` logger: writes MLflow's file store (the `mlruns/` folder `MlflowClient(tracking_uri=...)`, `mlflow ui`
//! and `mlflow migrate-filestore` read) with no MLflow client in the process.
//!
//! The store is `$MLFLOW_TRACKING_URI` when it is a `file:` URI or a plain path (as verl users set it), else
//! `./mlruns`; another scheme (`http:`, `databricks`, `sqlite:`) is refused when the logger is built, before training.
//! The layout is MLflow's `FileStore` (mlflow 3.x, readable by 2.x too):
//! - `<root>/<experiment_id>/meta.yaml`: the experiment named `trainer.project_name` (reused when it exists, else
//!   created with an 18-digit id), beside the `0/` "Default" experiment and `.trash/` of a new (missing or empty)
//!   store;
//! - `<root>/<experiment_id>/<run_id>/meta.yaml`: one run per launch named `trainer.experiment_name`, `status` 1
//!   (RUNNING) while it trains, 3 (FINISHED) once the loggers finish, 4 (FAILED) when dropped unfinished (the run
//!   stopped on an error), with `start_time`/`end_time` in milliseconds;
//! - `metrics/<name>`: one `<timestamp_ms> <value> <step>` line per step (a `/` in a name is a folder, as in MLflow);
//! - `params/<dotted.key>`: the resolved config's values; `tags/mlflow.runName` and a few other `mlflow.*` tags.

use anyhow::{bail, Context, Result};
use serde_yaml::{Mapping, Value};
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{LoggerContext, MetricsLogger};

/// MLflow's `RunStatus` values as stored in a run's `meta.yaml`.
const RUNNING: i64 = 1;
const FINISHED: i64 = 3;
const FAILED: i64 = 4;
/// MLflow refuses longer param values (`MAX_PARAM_VAL_LENGTH`).
const MAX_PARAM_LEN: usize = 6000;

/// The MLflow run of this launch, in a file store.
pub struct MlflowLogger {
    run_dir: PathBuf,
    meta: Mapping,
    finished: bool,
}

/// The file store `MLFLOW_TRACKING_URI` names (`None` or empty: `./mlruns`), as an absolute folder.
pub fn tracking_root(uri: Option<&str>) -> Result<PathBuf> {
    let uri = uri.map(str::trim).filter(|u| !u.is_empty());
    let path = match uri {
        None => PathBuf::from("mlruns"),
        Some(u) if u.starts_with("file:") => {
            let rest = &u["file:".len()..];
            // file:///abs, file://localhost/abs, file:/abs and file:rel all name local paths.
            let rest = match rest.strip_prefix("//") {
                Some(r) => &r[r.find('/').unwrap_or(r.len())..],
                None => rest,
            };
            PathBuf::from(percent_decode(rest))
        }
        Some(u) if has_scheme(u) => bail!(
            "MLFLOW_TRACKING_URI={u}: ferl's `mlflow` logger writes MLflow's file store only; set \
             MLFLOW_TRACKING_URI to a folder or a file: URI (unset: ./mlruns), then serve or migrate it with MLflow \
             (`mlflow server --backend-store-uri <folder>`, `mlflow migrate-filestore`)"
        ),
        Some(u) => ferl_config::expand_path(u),
    };
    if path.is_absolute() {
        return Ok(path);
    }
    let cwd = std::env::current_dir().context("mlflow: the current folder")?;
    Ok(cwd.join(path))
}

/// `scheme:` at the start (two letters at least, so a Windows drive letter is not one).
fn has_scheme(u: &str) -> bool {
    u.split_once(':').is_some_and(|(s, _)| {
        s.len() > 1
            && s.starts_with(|c: char| c.is_ascii_alphabetic())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b.get(i + 1..i + 3).and_then(|h| {
            std::str::from_utf8(h)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        });
        match (b[i], hex) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `path` as a `file://` URI, percent-encoding what a URI path may not hold (pathlib's `as_uri`).
fn file_uri(path: &Path) -> String {
    let mut out = String::from("file://");
    for b in path.to_string_lossy().bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~!$&'()*+,;=:@".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn yaml_map(pairs: Vec<(&str, Value)>) -> Mapping {
    pairs
        .into_iter()
        .map(|(k, v)| (Value::from(k), v))
        .collect()
}

/// Writes `meta` to `dir/meta.yaml` (keys sorted, as MLflow's `write_yaml` does).
fn write_meta(dir: &Path, meta: &Mapping) -> Result<()> {
    let mut sorted: Vec<(&Value, &Value)> = meta.iter().collect();
    sorted.sort_by_key(|(k, _)| k.as_str().unwrap_or_default().to_string());
    let sorted: Mapping = sorted
        .into_iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let file = dir.join("meta.yaml");
    let text = serde_yaml::to_string(&sorted)?;
    // Write beside, then rename: a reader never sees half a file.
    let tmp = dir.join(".meta.yaml.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &file).with_context(|| format!("writing {}", file.display()))
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Creates an experiment folder `root/id` with its `meta.yaml`.
fn create_experiment(root: &Path, id: &str, name: &str) -> Result<()> {
    let dir = root.join(id);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let now = now_ms();
    let meta = yaml_map(vec![
        ("artifact_location", file_uri(&dir).into()),
        ("creation_time", now.into()),
        ("effective_trace_archival_retention", Value::Null),
        ("experiment_id", id.into()),
        ("last_update_time", now.into()),
        ("lifecycle_stage", "active".into()),
        ("name", name.into()),
        ("trace_location", Value::Null),
        ("workspace", "default".into()),
    ]);
    write_meta(&dir, &meta)
}

/// The id of the experiment named `name` in the store at `root`, created (with the store) when missing.
fn experiment_id(root: &Path, name: &str) -> Result<String> {
    let is_new = match std::fs::read_dir(root) {
        Ok(mut entries) => entries.next().is_none(),
        Err(_) => true,
    };
    if is_new {
        std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
        create_experiment(root, "0", "Default")?;
    }
    std::fs::create_dir_all(root.join(".trash"))?;
    let entries = std::fs::read_dir(root).with_context(|| format!("reading {}", root.display()))?;
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path().join("meta.yaml")) else {
            continue;
        };
        let Ok(meta) = serde_yaml::from_str::<Mapping>(&text) else {
            continue;
        };
        if meta.get("name").and_then(Value::as_str) != Some(name) {
            continue;
        }
        if meta.get("lifecycle_stage").and_then(Value::as_str) != Some("active") {
            bail!(
                "mlflow: experiment `{name}` in {} is deleted; restore it or pick another trainer.project_name",
                root.display()
            );
        }
        return Ok(entry.file_name().to_string_lossy().into_owned());
    }
    // MLflow's `_generate_unique_integer_id`: 18 digits, no leading zero.
    let id =
        (100_000_000_000_000_000 + rand::random::<u64>() % 900_000_000_000_000_000).to_string();
    create_experiment(root, &id, name)?;
    Ok(id)
}

/// A uuid4 as 32 hex digits (MLflow's run ids).
fn run_uuid() -> String {
    let mut v: u128 = rand::random();
    v = (v & !(0xF << 76)) | (0x4 << 76);
    v = (v & !(0x3 << 62)) | (0x2 << 62);
    format!("{v:032x}")
}

/// A metric or param name as MLflow accepts it: letters, digits, `_ - . space / :`, no `..` and no leading `/`.
fn mlflow_key(key: &str) -> String {
    let mut k: String = key
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || "_-. /:".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    while k.contains("..") {
        k = k.replace("..", "_");
    }
    k.trim_start_matches('/').to_string()
}

impl MlflowLogger {
    /// Starts a run named `ctx.experiment` in experiment `ctx.project` of the store at `root`, with `ctx.params`.
    pub fn create(root: &Path, ctx: &LoggerContext) -> Result<Self> {
        let exp = experiment_id(root, &ctx.project)?;
        let run_id = run_uuid();
        let run_dir = root.join(&exp).join(&run_id);
        for sub in ["metrics", "params", "artifacts", "tags"] {
            let d = run_dir.join(sub);
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        let user = std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .unwrap_or_else(|_| "unknown".into());
        let meta = yaml_map(vec![
            ("artifact_uri", file_uri(&run_dir.join("artifacts")).into()),
            ("end_time", Value::Null),
            ("entry_point_name", "".into()),
            ("experiment_id", exp.as_str().into()),
            ("lifecycle_stage", "active".into()),
            ("run_id", run_id.as_str().into()),
            // MLflow 2.x reads `run_uuid`; 3.x ignores it.
            ("run_uuid", run_id.as_str().into()),
            ("run_name", ctx.experiment.as_str().into()),
            ("source_name", "".into()),
            ("source_type", 4.into()),
            ("source_version", "".into()),
            ("start_time", now_ms().into()),
            ("status", RUNNING.into()),
            ("tags", Value::Sequence(vec![])),
            ("user_id", user.as_str().into()),
        ]);
        write_meta(&run_dir, &meta)?;
        let tags = [
            ("mlflow.runName", ctx.experiment.as_str()),
            ("mlflow.user", user.as_str()),
            ("mlflow.source.name", "ferl"),
            ("mlflow.source.type", "LOCAL"),
        ];
        for (k, v) in tags {
            write_file(&run_dir.join("tags").join(k), v)?;
        }
        for (k, v) in &ctx.params {
            if v.len() <= MAX_PARAM_LEN {
                write_file(&run_dir.join("params").join(mlflow_key(k)), v)?;
            }
        }
        Ok(Self {
            run_dir,
            meta,
            finished: false,
        })
    }

    /// The run's folder, `<root>/<experiment_id>/<run_id>`.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    fn set_status(&mut self, status: i64, end_time: Option<i64>) -> Result<()> {
        self.meta.insert("status".into(), status.into());
        let end_time = end_time.map_or(Value::Null, Value::from);
        self.meta.insert("end_time".into(), end_time);
        write_meta(&self.run_dir, &self.meta)
    }
}

impl MetricsLogger for MlflowLogger {
    fn log(&mut self, step: i64, metrics: &[(String, f64)]) -> Result<()> {
        if self.finished {
            self.finished = false;
            self.set_status(RUNNING, None)?;
        }
        let ts = now_ms();
        for (name, value) in metrics {
            let path = self.run_dir.join("metrics").join(mlflow_key(name));
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            let mut f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            // `{:?}` keeps a decimal point (`2.0`) and round-trips, as Python's `str(float)` does.
            writeln!(f, "{ts} {value:?} {step}")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.finished = true;
        self.set_status(FINISHED, Some(now_ms()))
    }
}

impl Drop for MlflowLogger {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.set_status(FAILED, Some(now_ms()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(params: Vec<(String, String)>) -> LoggerContext {
        LoggerContext {
            run_dir: PathBuf::from("unused"),
            project: "proj".into(),
            experiment: "exp 1".into(),
            progress: None,
            params,
        }
    }

    fn meta(dir: &Path) -> Mapping {
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("meta.yaml")).unwrap()).unwrap()
    }

    #[test]
    fn tracking_uris_name_local_folders_or_are_refused() {
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(tracking_root(None).unwrap(), cwd.join("mlruns"));
        assert_eq!(tracking_root(Some("")).unwrap(), cwd.join("mlruns"));
        assert_eq!(
            tracking_root(Some("file:///tmp/a%20b/mlruns")).unwrap(),
            PathBuf::from("/tmp/a b/mlruns")
        );
        assert_eq!(
            tracking_root(Some("file://localhost/x")).unwrap(),
            PathBuf::from("/x")
        );
        assert_eq!(tracking_root(Some("/abs")).unwrap(), PathBuf::from("/abs"));
        assert_eq!(tracking_root(Some("rel")).unwrap(), cwd.join("rel"));
        let err = tracking_root(Some("http://host:5000"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("file store only"), "{err}");
    }

    #[test]
    fn a_run_is_laid_out_as_mlflow_file_store() {
        let root = tempfile::tempdir().unwrap();
        let params = vec![("trainer.logger".to_string(), "[console,mlflow]".to_string())];
        let mut l = MlflowLogger::create(root.path(), &ctx(params.clone())).unwrap();
        let run = l.run_dir().to_path_buf();
        let exp_dir = run.parent().unwrap().to_path_buf();
        assert_eq!(meta(&root.path().join("0"))["name"], "Default");
        let exp = meta(&exp_dir);
        assert_eq!(exp["name"], "proj");
        assert_eq!(exp["lifecycle_stage"], "active");
        assert_eq!(exp["experiment_id"].as_str().unwrap().len(), 18);
        assert_eq!(meta(&run)["status"], RUNNING);
        assert_eq!(meta(&run)["run_name"], "exp 1");
        l.log(1, &[("train/loss".into(), 2.0)]).unwrap();
        l.log(2, &[("train/loss".into(), 0.1)]).unwrap();
        l.finish().unwrap();
        let m = meta(&run);
        assert_eq!(m["status"], FINISHED);
        assert!(m["end_time"].as_i64().unwrap() >= m["start_time"].as_i64().unwrap());
        let lines = std::fs::read_to_string(run.join("metrics/train/loss")).unwrap();
        let rows: Vec<Vec<&str>> = lines.lines().map(|l| l.split(' ').collect()).collect();
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0][1], rows[0][2]), ("2.0", "1"));
        assert_eq!((rows[1][1], rows[1][2]), ("0.1", "2"));
        let p = std::fs::read_to_string(run.join("params/trainer.logger")).unwrap();
        assert_eq!(p, "[console,mlflow]");
        let tag = std::fs::read_to_string(run.join("tags/mlflow.runName")).unwrap();
        assert_eq!(tag, "exp 1");

        // A second launch reuses the experiment; a run dropped unfinished is FAILED.
        let again = MlflowLogger::create(root.path(), &ctx(params)).unwrap();
        let run2 = again.run_dir().to_path_buf();
        assert_eq!(run2.parent().unwrap(), exp_dir);
        assert_ne!(run2, run);
        drop(again);
        assert_eq!(meta(&run2)["status"], FAILED);
    }

    #[test]
    fn keys_are_made_acceptable_to_mlflow() {
        assert_eq!(mlflow_key("train/loss"), "train/loss");
        assert_eq!(mlflow_key("/a/../b*c"), "a/_/b_c");
    }
}
