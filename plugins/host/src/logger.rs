//! Logger plugins on the host side: one open instance ([`LoggerInstance`]) and the hot-switching, panic-proof
//! wrapper a trainer keeps per configured logger ([`HotLogger`]).

use crate::library::{KindTable, LoadedPlugin};
use crate::registry::PluginHost;
use crate::PluginCallError;
use anyhow::{anyhow, Result};
use ferl_plugin_abi::logger::{LoggerVTable, Metric};
use ferl_plugin_abi::{ErrorMessage, FerlStr};
use std::ffi::c_void;
use std::sync::Arc;

/// One open instance of a logger plugin version. Closed (and flushed) on drop.
pub struct LoggerInstance {
    plugin: Arc<LoadedPlugin>,
    table: &'static LoggerVTable,
    inst: *mut c_void,
}

// SAFETY: the instance is used by one thread at a time (`&mut self`); loggers own their state.
unsafe impl Send for LoggerInstance {}

impl LoggerInstance {
    /// Opens `plugin` (a logger) with `config`.
    pub fn open(plugin: Arc<LoadedPlugin>, config: &str) -> Result<Self> {
        let KindTable::Logger(table) = plugin.table else {
            return Err(anyhow!(
                "plugin {} is a {} plugin, not a logger",
                plugin.label(),
                plugin.info().kind.as_str()
            ));
        };
        let inst = plugin.open_instance(table.open, "open", config)?;
        Ok(Self {
            plugin,
            table,
            inst,
        })
    }

    /// The plugin version this instance runs.
    pub fn plugin(&self) -> &Arc<LoadedPlugin> {
        &self.plugin
    }

    /// Sends one step's metrics.
    pub fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), PluginCallError> {
        let raw: Vec<Metric> = metrics
            .iter()
            .map(|(n, v)| Metric {
                name: FerlStr::new(n),
                value: *v,
            })
            .collect();
        let mut err = ErrorMessage::new();
        // SAFETY: `raw` and the names it borrows outlive the call.
        let status =
            unsafe { (self.table.log)(self.inst, step, raw.as_ptr(), raw.len(), err.as_mut_ptr()) };
        self.plugin.check(format!("log(step {step})"), status, &err)
    }

    /// Asks the plugin to make what it has logged durable.
    pub fn flush(&mut self) -> Result<(), PluginCallError> {
        let mut err = ErrorMessage::new();
        // SAFETY: the instance is open.
        let status = unsafe { (self.table.flush)(self.inst, err.as_mut_ptr()) };
        self.plugin.check("flush", status, &err)
    }

    /// Flushes and closes, reporting a failure (drop closes too but can only log it).
    pub fn close(mut self) -> Result<(), PluginCallError> {
        // `Drop` then finds the instance already closed and only releases the plugin.
        self.close_inner()
    }

    fn close_inner(&mut self) -> Result<(), PluginCallError> {
        let inst = std::mem::replace(&mut self.inst, std::ptr::null_mut());
        if inst.is_null() {
            return Ok(());
        }
        let mut err = ErrorMessage::new();
        // SAFETY: the instance is open and is never used again.
        let status = unsafe { (self.table.close)(inst, err.as_mut_ptr()) };
        self.plugin.check("close", status, &err)
    }
}

impl Drop for LoggerInstance {
    fn drop(&mut self) {
        if let Err(e) = self.close_inner() {
            tracing::warn!("{e}");
        }
    }
}

/// A logger chosen by name that follows the host's current version of that plugin: at each `log` (a step boundary)
/// it switches to a newly loaded version (closing the old instance, which lets the old library unload). A panic
/// disables it with a warning until a new version arrives; the trainer never sees the panic.
pub struct HotLogger {
    host: Arc<PluginHost>,
    name: String,
    config: String,
    current: Option<(u64, LoggerInstance)>,
    disabled: Option<(u64, String)>,
}

impl HotLogger {
    /// A logger following plugin `name` of `host`, opened with `config`. Fails when no such logger is loaded or it
    /// does not open.
    pub fn new(host: Arc<PluginHost>, name: &str, config: &str) -> Result<Self> {
        let mut me = Self {
            host,
            name: name.to_string(),
            config: config.to_string(),
            current: None,
            disabled: None,
        };
        me.ensure_current()?;
        Ok(me)
    }

    /// The name this logger follows.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Why the logger is disabled, if it is.
    pub fn disabled_reason(&self) -> Option<&str> {
        self.disabled.as_ref().map(|(_, r)| r.as_str())
    }

    /// The version currently in use.
    pub fn version(&self) -> Option<String> {
        self.current
            .as_ref()
            .map(|(_, i)| i.plugin().info().version.clone())
    }

    /// Opens the host's current version if it differs from the one in use.
    fn ensure_current(&mut self) -> Result<()> {
        let (generation, plugin) = self.host.current(&self.name).ok_or_else(|| {
            anyhow!(
                "no logger plugin named `{}` is loaded (see `ferl plugin list`)",
                self.name
            )
        })?;
        if self.current.as_ref().is_some_and(|(g, _)| *g == generation) {
            return Ok(());
        }
        if let Some((_, old)) = self.current.take() {
            if let Err(e) = old.close() {
                tracing::warn!(
                    "closing the previous version of logger `{}`: {e}",
                    self.name
                );
            }
        }
        self.current = Some((generation, LoggerInstance::open(plugin, &self.config)?));
        Ok(())
    }

    /// Sends one step's metrics. Never fails the step for a panic: the logger is disabled with a warning instead.
    /// An ordinary error of the plugin is returned for the caller to report.
    pub fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), PluginCallError> {
        let generation = self.host.current(&self.name).map(|(g, _)| g);
        if let Some((g, _)) = &self.disabled {
            if Some(*g) == generation {
                return Ok(());
            }
            self.disabled = None; // a new version was loaded: try it
        }
        if let Err(e) = self.ensure_current() {
            self.disable(generation.unwrap_or(0), format!("{e:#}"));
            return Ok(());
        }
        let Some((g, inst)) = self.current.as_mut() else {
            return Ok(());
        };
        match inst.log(step, metrics) {
            Err(e) if e.panicked => {
                let g = *g;
                // Safe Rust state stays memory-safe after a caught panic, so closing is allowed; its result is moot.
                if let Some((_, inst)) = self.current.take() {
                    let _ = inst.close();
                }
                self.disable(g, e.to_string());
                Ok(())
            }
            other => other,
        }
    }

    /// Flushes the instance in use.
    pub fn flush(&mut self) -> Result<(), PluginCallError> {
        match self.current.as_mut() {
            Some((_, inst)) => inst.flush(),
            None => Ok(()),
        }
    }

    fn disable(&mut self, generation: u64, reason: String) {
        tracing::warn!(
            "logger `{}` disabled until a new version is loaded: {reason}",
            self.name
        );
        self.disabled = Some((generation, reason));
    }
}
