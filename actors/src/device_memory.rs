//! The memory a training rank reports as `perf/max_memory_gb/rank_R`: the process's peak resident set on CPU, the
//! device's memory in use on CUDA.
//!
//! tch exposes no statistics of torch's caching allocator, so a CUDA rank asks the driver instead
//! ([`device_memory_in_use`]: total − free of the device, read in its primary context, the one libtorch uses). The
//! allocator keeps what it reserved (ferl never calls `empty_cache`), so that figure sampled at the end of each step
//! is the high-water mark of torch's reservations plus the CUDA context (and whatever any other process holds on the
//! device); [`peak_memory_bytes`] keeps the highest sample per device. libcuda is loaded at run time: without a
//! driver the query returns an error (never panics) and the rank falls back to its resident set.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use anyhow::{anyhow, Context as _, Result};
use cudarc::driver::{result, sys};
use tch::Device;

/// Peak memory of a rank on `device` in bytes, sampling it now (call it at the end of each step; 0 when unknown):
/// - CPU (and any device but CUDA): the process's peak resident set ([`peak_resident_bytes`]).
/// - `Device::Cuda(i)`: the highest [`device_memory_in_use`] of device `i` over this process's samples, i.e. the
///   high-water mark of torch's reservations plus the CUDA context (plus any other process's memory on the device).
///   If the driver query fails, the peak resident set instead, with one warning naming the error.
pub fn peak_memory_bytes(device: Device) -> u64 {
    let Device::Cuda(ordinal) = device else {
        return peak_resident_bytes();
    };
    match device_memory_in_use(ordinal) {
        Ok(bytes) => record_device_peak(ordinal, bytes),
        Err(e) => {
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "perf/max_memory_gb: cannot read the memory in use on cuda:{ordinal} ({e:#}); reporting the \
                     process's peak resident memory instead"
                );
            }
            peak_resident_bytes()
        }
    }
}

/// The host memory available to new allocations without swapping (`MemAvailable` of `/proc/meminfo`) in bytes;
/// `None` when unknown.
pub fn available_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Peak resident set of this process (`VmHWM` of `/proc/self/status`) in bytes, 0 when unknown.
pub fn peak_resident_bytes() -> u64 {
    status_field_bytes("VmHWM:").unwrap_or(0)
}

/// A `kB` field of `/proc/self/status` (`VmHWM:`, `VmRSS:`), in bytes.
fn status_field_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb = line.split_whitespace().nth(1)?.parse::<u64>().ok()?;
    Some(kb * 1024)
}

/// Memory in use on CUDA device `ordinal` now, in bytes: the driver's total − free (`cuMemGetInfo`), read with the
/// device's primary context current (retained for the call, then released; the thread's current context is
/// restored). That counts torch's caching-allocator reservations, the CUDA context, and any other process's memory
/// on the device. An error, never a panic, when libcuda is missing or a driver call fails.
pub fn device_memory_in_use(ordinal: usize) -> Result<u64> {
    driver_loaded().map_err(|e| anyhow!("{e}"))?;
    result::init().map_err(|e| anyhow!("cuInit: {e}"))?;
    let index = i32::try_from(ordinal).context("CUDA device ordinal out of range")?;
    let dev = result::device::get(index).map_err(|e| anyhow!("cuDeviceGet({ordinal}): {e}"))?;
    // SAFETY: `dev` comes from `device::get` just above, as `retain` requires.
    let ctx = unsafe { result::primary_ctx::retain(dev) }
        .map_err(|e| anyhow!("cuDevicePrimaryCtxRetain({ordinal}): {e}"))?;
    let used = used_in_context(ctx);
    // SAFETY: releases the one reference retained just above on the same device; libtorch holds its own, so this
    // does not tear down the context it uses.
    let released = unsafe { result::primary_ctx::release(dev) }
        .map_err(|e| anyhow!("cuDevicePrimaryCtxRelease({ordinal}): {e}"));
    let used = used?;
    released?;
    Ok(used)
}

/// total − free of the device of `ctx` (a retained context), with `ctx` made current on this thread for the query
/// and the thread's previous current context (possibly none) restored after.
fn used_in_context(ctx: sys::CUcontext) -> Result<u64> {
    let previous = result::ctx::get_current()
        .map_err(|e| anyhow!("cuCtxGetCurrent: {e}"))?
        .unwrap_or(std::ptr::null_mut());
    // SAFETY: `ctx` is a primary context the caller retained and releases only after this returns, so it is alive.
    unsafe { result::ctx::set_current(ctx) }.map_err(|e| anyhow!("cuCtxSetCurrent: {e}"))?;
    let info = result::mem_get_info().map_err(|e| anyhow!("cuMemGetInfo: {e}"));
    // SAFETY: `previous` was this thread's current context a moment ago and nothing on this thread destroyed it
    // since; null (no context was current) unbinds, as before.
    let restored = unsafe { result::ctx::set_current(previous) }
        .map_err(|e| anyhow!("cuCtxSetCurrent (restoring the previous context): {e}"));
    let (free, total) = info?;
    restored?;
    Ok(total.saturating_sub(free) as u64)
}

/// The driver functions [`device_memory_in_use`] calls. cudarc resolves each on first use and panics if it is
/// missing, so they are all checked up front.
const DRIVER_SYMBOLS: [&str; 8] = [
    "cuInit",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuMemGetInfo_v2",
    "cuGetErrorString",
];

/// Whether cudarc can load libcuda with every function in [`DRIVER_SYMBOLS`] (checked once per process): cudarc's
/// loader panics on a missing library or symbol, so this is checked before any driver call.
fn driver_loaded() -> Result<(), &'static str> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: tries to open libcuda under cudarc's own candidate names, running its initialisers as any CUDA
            // user (libtorch included) does; nothing from it is called.
            if !unsafe { sys::is_culib_present() } {
                return Err("no CUDA driver library (libcuda) could be loaded".to_string());
            }
            // SAFETY: `is_culib_present` just found one of the candidates `culib` tries, in the same order, so it
            // loads instead of panicking.
            let lib = unsafe { sys::culib() };
            for name in DRIVER_SYMBOLS {
                // SAFETY: only looks the symbol up; the returned pointer is never used.
                if unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err() {
                    return Err(format!("the CUDA driver library lacks {name}"));
                }
            }
            Ok(())
        })
        .as_ref()
        .map(|_| ())
        .map_err(String::as_str)
}

/// The most CUDA devices a process keeps high-water marks for; a higher ordinal reports each sample as is.
const TRACKED_DEVICES: usize = 64;

/// Records a sample of device `ordinal`'s memory in use and returns the highest so far.
fn record_device_peak(ordinal: usize, bytes: u64) -> u64 {
    static PEAKS: [HighWater; TRACKED_DEVICES] = [const { HighWater::new() }; TRACKED_DEVICES];
    PEAKS.get(ordinal).map_or(bytes, |p| p.record(bytes))
}

/// The highest of the samples recorded so far.
struct HighWater(AtomicU64);

impl HighWater {
    /// No sample yet (0).
    const fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// Records `sample` and returns the highest sample so far, this one included.
    fn record(&self, sample: u64) -> u64 {
        self.0.fetch_max(sample, Ordering::Relaxed).max(sample)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_reports_the_peak_resident_set() {
        const TOUCHED: u64 = 256 << 20;
        let block = vec![1u8; TOUCHED as usize]; // written, so resident
        let rss = status_field_bytes("VmRSS:").expect("VmRSS in /proc/self/status");
        let peak = peak_memory_bytes(Device::Cpu);
        std::hint::black_box(&block);
        assert!(rss >= TOUCHED, "VmRSS {rss} with {TOUCHED} bytes written");
        // VmHWM is never below VmRSS: read after it, the peak bounds it.
        assert!(peak >= rss, "VmHWM {peak} < VmRSS {rss}");
    }

    #[test]
    fn high_water_keeps_the_max_over_samples() {
        let mark = HighWater::new();
        assert_eq!(mark.record(5), 5);
        assert_eq!(mark.record(3), 5);
        assert_eq!(mark.record(7), 7);
        assert_eq!(mark.record(0), 7);
        assert_eq!(mark.record(7), 7);
    }

    #[test]
    fn device_peaks_are_per_device_and_untracked_ordinals_pass_through() {
        // Ordinals no other test samples.
        assert_eq!(record_device_peak(40, 10), 10);
        assert_eq!(record_device_peak(41, 4), 4);
        assert_eq!(record_device_peak(40, 2), 10);
        assert_eq!(record_device_peak(TRACKED_DEVICES, 3), 3);
        assert_eq!(record_device_peak(TRACKED_DEVICES, 1), 1);
    }

    #[test]
    fn cuda_without_a_driver_falls_back_to_the_resident_set() {
        if driver_loaded().is_ok() {
            eprintln!("skipped: a CUDA driver is present");
            return;
        }
        let err = device_memory_in_use(0).expect_err("no driver, no device memory");
        assert!(err.to_string().contains("libcuda"), "{err:#}");
        let before = peak_resident_bytes();
        let reported = peak_memory_bytes(Device::Cuda(0));
        let after = peak_resident_bytes();
        assert!(reported > 0);
        assert!(
            before <= reported && reported <= after,
            "{before} <= {reported} <= {after}"
        );
        // A second sample takes the same path (the library check is cached, the warning given once).
        assert!(peak_memory_bytes(Device::Cuda(0)) >= reported);
    }
}
