//! Logger plugins: receive each step's metrics as `(name, value)` pairs.
//!
//! Call order the host guarantees: `open` once, then any number of `log`/`flush`, then `close` exactly once (which
//! also flushes). Metric names and the config string are borrowed for the duration of one call.

use crate::{guard, guard_status, ErrorBuf, FerlStr, Plugin};
use std::ffi::c_void;

/// One metric of a step.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    /// Metric name, e.g. `train/loss`.
    pub name: FerlStr,
    /// Its value.
    pub value: f64,
}

/// The table a logger plugin exports through [`crate::LOGGER_SYMBOL`].
#[repr(C)]
pub struct LoggerVTable {
    /// `size_of::<LoggerVTable>()` as the plugin compiled it.
    pub struct_size: usize,
    /// Creates an instance from a config string (a path or JSON options); writes it to `out`.
    pub open:
        unsafe extern "C" fn(config: FerlStr, out: *mut *mut c_void, err: *mut ErrorBuf) -> i32,
    /// Records the metrics of `step` (`n` entries at `metrics`).
    pub log: unsafe extern "C" fn(
        inst: *mut c_void,
        step: u64,
        metrics: *const Metric,
        n: usize,
        err: *mut ErrorBuf,
    ) -> i32,
    /// Makes everything logged so far durable.
    pub flush: unsafe extern "C" fn(inst: *mut c_void, err: *mut ErrorBuf) -> i32,
    /// Flushes and frees the instance; the host never uses it again.
    pub close: unsafe extern "C" fn(inst: *mut c_void, err: *mut ErrorBuf) -> i32,
}

/// The `extern "C"` signature of [`crate::LOGGER_SYMBOL`].
pub type LoggerTableFn = unsafe extern "C" fn() -> *const LoggerVTable;

/// What a logger author implements (then `export_logger!(MyLogger)`).
pub trait LoggerPlugin: Plugin + Sized {
    /// Opens the logger described by `config` (the plugin defines its format: a path, JSON options...).
    fn open(config: &str) -> Result<Self, String>;
    /// Records one step's metrics.
    fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), String>;
    /// Makes everything logged so far durable.
    fn flush(&mut self) -> Result<(), String>;
}

unsafe extern "C" fn open_shim<T: LoggerPlugin>(
    config: FerlStr,
    out: *mut *mut c_void,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: the host keeps `config` alive for this call (crate invariant 3); `out` is writable and `err` is null
    // or valid (crate invariant 5). `out` is written only on success, with a freshly leaked `Box<T>`.
    unsafe {
        let (status, inst) = guard(err, || T::open(config.to_str()?));
        if let Some(inst) = inst {
            *out = Box::into_raw(Box::new(inst)).cast();
        }
        status
    }
}

unsafe extern "C" fn log_shim<T: LoggerPlugin>(
    inst: *mut c_void,
    step: u64,
    metrics: *const Metric,
    n: usize,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: `inst` is a live `Box<T>` from `open_shim::<T>` that nothing else uses during the call and `err` is
    // null or valid (crate invariant 5); `metrics` holds `n` entries (not read when `n == 0`) whose names the host
    // keeps alive for this call (crate invariants 2 and 3).
    unsafe {
        guard_status(err, || {
            let raw = if n == 0 {
                &[][..]
            } else {
                std::slice::from_raw_parts(metrics, n)
            };
            let mut pairs = Vec::with_capacity(raw.len());
            for m in raw {
                pairs.push((m.name.to_str()?, m.value));
            }
            (*inst.cast::<T>()).log(step, &pairs)
        })
    }
}

unsafe extern "C" fn flush_shim<T: LoggerPlugin>(inst: *mut c_void, err: *mut ErrorBuf) -> i32 {
    // SAFETY: `inst` is a live `Box<T>` from `open_shim::<T>` that nothing else uses during the call and `err` is
    // null or valid (crate invariant 5).
    unsafe { guard_status(err, || (*inst.cast::<T>()).flush()) }
}

unsafe extern "C" fn close_shim<T: LoggerPlugin>(inst: *mut c_void, err: *mut ErrorBuf) -> i32 {
    // SAFETY: `inst` is the `Box<T>` leaked by `open_shim::<T>` (crate invariant 5), and the host calls `close`
    // exactly once and never uses `inst` again (module docs), so rebuilding the box frees it exactly once. `err` is
    // null or valid.
    unsafe {
        guard_status(err, || {
            let mut boxed = Box::from_raw(inst.cast::<T>());
            boxed.flush()
        })
    }
}

/// The table for `T` (used by [`crate::export_logger!`] in a `static`).
pub const fn vtable<T: LoggerPlugin>() -> LoggerVTable {
    LoggerVTable {
        struct_size: std::mem::size_of::<LoggerVTable>(),
        open: open_shim::<T>,
        log: log_shim::<T>,
        flush: flush_shim::<T>,
        close: close_shim::<T>,
    }
}

/// Exports `$ty: LoggerPlugin` as this library's logger: the manifest and the logger table, panics caught.
#[macro_export]
macro_rules! export_logger {
    ($ty:ty) => {
        $crate::__export_manifest!($ty, $crate::PluginKind::Logger);
        /// This plugin's logger table (`ferl_plugin_abi::logger::LoggerVTable`), looked up by this symbol's name.
        #[no_mangle]
        pub extern "C" fn ferl_plugin_logger() -> *const $crate::logger::LoggerVTable {
            static TABLE: $crate::logger::LoggerVTable = $crate::logger::vtable::<$ty>();
            &TABLE
        }
    };
}
