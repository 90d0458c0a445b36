//! Reward plugins: score a batch of (prompt, response, ground truth, extra info) rows, as verl's `compute_score`
//! functions do, returning one `f32` score per row and, optionally, named `f32` extras per row (verl's
//! `reward_extra_info`, e.g. `acc`).
//!
//! Call order: `open` once; `extra_names` and `score` any number of times; `close` once. The extras an instance
//! reports are fixed when it opens: `extra_names` answers the same names every time, and the names stay valid until
//! `close`. For a batch of `n` rows and `k` extras the host passes a `scores` buffer of `n` floats and an `extras`
//! buffer of `n * k` floats, row-major (`extras[row * k + j]` is extra `j` of row `row`). A failed call writes an
//! error that names the row (`row 3: ...`) and leaves the buffers unspecified.

use crate::{guard, guard_status, ErrorBuf, FerlStr, Plugin};
use std::ffi::c_void;

/// One row to score, as it crosses the ABI. Every string is borrowed for the duration of the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RewardItem {
    /// The prompt the response answers.
    pub prompt: FerlStr,
    /// The model's response (verl's `solution_str`).
    pub response: FerlStr,
    /// The reference answer (verl's `reward_model.ground_truth`); empty when the dataset has none.
    pub ground_truth: FerlStr,
    /// verl's `extra_info` column as JSON text; empty when there is none.
    pub extra_info: FerlStr,
}

/// The table a reward plugin exports through [`crate::REWARD_SYMBOL`].
#[repr(C)]
pub struct RewardVTable {
    /// `size_of::<RewardVTable>()` as the plugin compiled it.
    pub struct_size: usize,
    /// Creates an instance from a config string (the plugin defines it, e.g. JSON options); writes it to `out`.
    pub open:
        unsafe extern "C" fn(config: FerlStr, out: *mut *mut c_void, err: *mut ErrorBuf) -> i32,
    /// Writes the instance's extra names (`*n` entries at `*names`, valid until `close`).
    pub extra_names: unsafe extern "C" fn(
        inst: *mut c_void,
        names: *mut *const FerlStr,
        n: *mut usize,
        err: *mut ErrorBuf,
    ) -> i32,
    /// Scores `n` rows: writes `n` scores and `n * k` extras (`k` = the number of extra names, row-major).
    pub score: unsafe extern "C" fn(
        inst: *mut c_void,
        items: *const RewardItem,
        n: usize,
        scores: *mut f32,
        extras: *mut f32,
        err: *mut ErrorBuf,
    ) -> i32,
    /// Frees the instance.
    pub close: unsafe extern "C" fn(inst: *mut c_void, err: *mut ErrorBuf) -> i32,
}

/// The `extern "C"` signature of [`crate::REWARD_SYMBOL`].
pub type RewardTableFn = unsafe extern "C" fn() -> *const RewardVTable;

/// One row as a reward author reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RewardInput<'a> {
    /// The prompt.
    pub prompt: &'a str,
    /// The response to score.
    pub response: &'a str,
    /// The reference answer (may be empty).
    pub ground_truth: &'a str,
    /// `extra_info` as JSON text (may be empty).
    pub extra_info: &'a str,
}

/// The score of one row and its extras, in the order of [`RewardPlugin::extra_names`].
#[derive(Clone, Debug, PartialEq)]
pub struct RewardScore {
    /// The reward.
    pub score: f32,
    /// One value per extra name.
    pub extras: Vec<f32>,
}

/// What a reward author implements (then `export_reward!(MyReward)`).
pub trait RewardPlugin: Plugin + Sized {
    /// Opens the reward described by `config` (empty for the defaults).
    fn open(config: &str) -> Result<Self, String>;
    /// Names of the extras every row reports (none by default); fixed for the life of the instance.
    fn extra_names(&self) -> Vec<String> {
        Vec::new()
    }
    /// Scores one row. An `Err` fails the batch; the shim prefixes the row's index.
    fn score(&mut self, row: &RewardInput<'_>) -> Result<RewardScore, String>;
    /// Scores a batch (override to score rows together); by default [`RewardPlugin::score`] row by row, each error
    /// prefixed with `row I: `.
    fn score_batch(&mut self, rows: &[RewardInput<'_>]) -> Result<Vec<RewardScore>, String> {
        rows.iter()
            .enumerate()
            .map(|(i, r)| self.score(r).map_err(|e| format!("row {i}: {e}")))
            .collect()
    }
}

/// A reward instance plus the extra names it hands out (their buffers back the pointers the host reads).
struct Instance<T> {
    inner: T,
    names: Vec<String>,
    raw_names: Vec<FerlStr>,
}

unsafe extern "C" fn open_shim<T: RewardPlugin>(
    config: FerlStr,
    out: *mut *mut c_void,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: the host keeps `config` alive for this call (crate invariant 3); `out` is writable and `err` is null
    // or valid (crate invariant 5). `out` is written only on success, with a freshly leaked `Box<Instance<T>>`
    // whose `raw_names` borrow its own `names` (heap buffers that do not move with the box).
    unsafe {
        let (status, inst) = guard(err, || {
            let inner = T::open(config.to_str()?)?;
            let names = inner.extra_names();
            Ok(Instance {
                inner,
                names,
                raw_names: Vec::new(),
            })
        });
        if let Some(mut inst) = inst {
            inst.raw_names = inst.names.iter().map(|s| FerlStr::new(s)).collect();
            *out = Box::into_raw(Box::new(inst)).cast();
        }
        status
    }
}

unsafe extern "C" fn extra_names_shim<T: RewardPlugin>(
    inst: *mut c_void,
    names: *mut *const FerlStr,
    n: *mut usize,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: `inst` is a live `Box<Instance<T>>` from `open_shim::<T>`, `names` and `n` are writable and `err` is
    // null or valid (crate invariant 5). The names handed out live in the instance, unchanged until `close`.
    unsafe {
        guard_status(err, || {
            let inst = &*inst.cast::<Instance<T>>();
            *names = inst.raw_names.as_ptr();
            *n = inst.raw_names.len();
            Ok(())
        })
    }
}

/// Reads `n` rows at `items` as UTF-8 strings; an error names the row and the field.
///
/// # Safety
/// `items` points to `n` valid [`RewardItem`]s whose strings live for `'a`.
unsafe fn read_rows<'a>(
    items: *const RewardItem,
    n: usize,
) -> Result<Vec<RewardInput<'a>>, String> {
    // SAFETY: the caller guarantees `n` valid items at `items` (not read when `n == 0`) whose strings live for `'a`,
    // which is what `from_raw_parts` and `FerlStr::to_str` need.
    unsafe {
        let raw = if n == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(items, n)
        };
        raw.iter()
            .enumerate()
            .map(|(i, it)| {
                let field = |s: &FerlStr, what: &str| {
                    s.to_str().map_err(|e| format!("row {i}: {what}: {e}"))
                };
                Ok(RewardInput {
                    prompt: field(&it.prompt, "prompt")?,
                    response: field(&it.response, "response")?,
                    ground_truth: field(&it.ground_truth, "ground_truth")?,
                    extra_info: field(&it.extra_info, "extra_info")?,
                })
            })
            .collect()
    }
}

unsafe extern "C" fn score_shim<T: RewardPlugin>(
    inst: *mut c_void,
    items: *const RewardItem,
    n: usize,
    scores: *mut f32,
    extras: *mut f32,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: `inst` is a live `Box<Instance<T>>` from `open_shim::<T>` that nothing else uses during the call and
    // `err` is null or valid (crate invariant 5); `items` holds `n` rows whose strings live for the call (crate
    // invariants 2 and 3); `scores` has room for `n` floats and `extras` for `n * k` (module docs). Writes happen
    // only after checking `got.len() == n` and each row's `extras.len() == k`, so `i < n` and `i * k + j < n * k`.
    unsafe {
        guard_status(err, || {
            let inst = &mut *inst.cast::<Instance<T>>();
            let rows = read_rows(items, n)?;
            let got = inst.inner.score_batch(&rows)?;
            if got.len() != n {
                return Err(format!("{n} rows were scored into {} scores", got.len()));
            }
            let k = inst.names.len();
            for (i, s) in got.iter().enumerate() {
                if s.extras.len() != k {
                    return Err(format!(
                        "row {i}: {} extras, but the plugin declares {k} ({})",
                        s.extras.len(),
                        inst.names.join(", ")
                    ));
                }
                *scores.add(i) = s.score;
                for (j, v) in s.extras.iter().enumerate() {
                    *extras.add(i * k + j) = *v;
                }
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn close_shim<T: RewardPlugin>(inst: *mut c_void, err: *mut ErrorBuf) -> i32 {
    // SAFETY: `inst` is the `Box<Instance<T>>` leaked by `open_shim::<T>` (crate invariant 5), and the host calls
    // `close` exactly once and never uses `inst` again (module docs), so it is freed exactly once. `err` is null or
    // valid.
    unsafe {
        guard_status(err, || {
            drop(Box::from_raw(inst.cast::<Instance<T>>()));
            Ok(())
        })
    }
}

/// The table for `T` (used by [`crate::export_reward!`] in a `static`).
pub const fn vtable<T: RewardPlugin>() -> RewardVTable {
    RewardVTable {
        struct_size: std::mem::size_of::<RewardVTable>(),
        open: open_shim::<T>,
        extra_names: extra_names_shim::<T>,
        score: score_shim::<T>,
        close: close_shim::<T>,
    }
}

/// Exports `$ty: RewardPlugin` as this library's reward: the manifest and the reward table, panics caught.
#[macro_export]
macro_rules! export_reward {
    ($ty:ty) => {
        $crate::__export_manifest!($ty, $crate::PluginKind::Reward);
        /// This plugin's reward table (`ferl_plugin_abi::reward::RewardVTable`), looked up by this symbol's name.
        #[no_mangle]
        pub extern "C" fn ferl_plugin_reward() -> *const $crate::reward::RewardVTable {
            static TABLE: $crate::reward::RewardVTable = $crate::reward::vtable::<$ty>();
            &TABLE
        }
    };
}
