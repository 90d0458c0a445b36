//! Logger plugin `tensorboard`: writes each metric as a scalar summary to an event file
//! `events.out.tfevents.SECONDS.HOST.PID.ferl` in the folder named by the config string, which TensorBoard reads.
//!
//! The format, written by hand to keep the plugin dependency-free ([`record`] and [`proto`]):
//! a sequence of TFRecords (`u64 length`, masked CRC-32C of the length, the bytes, masked CRC-32C of the bytes), each
//! an `Event` protobuf; the first carries `file_version = "brain.Event:2"`, the others `step` and a `Summary` of
//! `(tag, simple_value)` values.

mod proto;
mod record;

use ferl_plugin_abi::logger::LoggerPlugin;
use ferl_plugin_abi::Plugin;
use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

/// An open event file.
pub struct TensorBoardLogger {
    out: std::io::BufWriter<std::fs::File>,
}

impl Plugin for TensorBoardLogger {
    const NAME: &'static str = "tensorboard";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str = "scalars in TensorBoard event files";
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

impl TensorBoardLogger {
    fn write_event(&mut self, event: &[u8]) -> Result<(), String> {
        self.out
            .write_all(&record::frame(event))
            .map_err(|e| format!("cannot write event file: {e}"))
    }
}

impl LoggerPlugin for TensorBoardLogger {
    fn open(config: &str) -> Result<Self, String> {
        let dir = std::path::Path::new(config);
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create log folder `{config}`: {e}"))?;
        let now = now_secs();
        let name = format!(
            "events.out.tfevents.{}.{}.{}.ferl",
            now as u64,
            host_name(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::File::create(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let mut me = Self {
            out: std::io::BufWriter::new(file),
        };
        me.write_event(&proto::file_version_event(now))?;
        Ok(me)
    }

    fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), String> {
        let event = proto::scalars_event(now_secs(), step as i64, metrics);
        self.write_event(&event)
    }

    fn flush(&mut self) -> Result<(), String> {
        self.out.flush().map_err(|e| format!("flush failed: {e}"))
    }
}

ferl_plugin_abi::export_logger!(TensorBoardLogger);
