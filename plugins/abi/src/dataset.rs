//! Dataset plugins: a random-access list of training examples from any source.
//!
//! Call order: `open` once, then `len`/`get` in any order, then `close` once. The [`Example`] a `get` writes points
//! into the instance's memory and stays valid until the next `get` or `close` on that instance; the host copies what
//! it keeps.

use crate::{guard, guard_status, ErrorBuf, FerlStr, Plugin};
use std::ffi::c_void;

/// [`Example::kind`]: a prompt and the response to learn.
pub const EXAMPLE_PROMPT_RESPONSE: u32 = 1;
/// [`Example::kind`]: a chat as a JSON array of `{"role": ..., "content": ...}` objects.
pub const EXAMPLE_MESSAGES_JSON: u32 = 2;
/// [`Example::kind`]: ready token ids with a per-token loss mask (1 = train on this token).
pub const EXAMPLE_TOKENS: u32 = 3;

/// One example as it crosses the ABI. Fields not used by `kind` are empty.
#[repr(C)]
#[derive(Debug)]
pub struct Example {
    /// One of the `EXAMPLE_*` constants.
    pub kind: u32,
    /// Prompt text (`EXAMPLE_PROMPT_RESPONSE`).
    pub prompt: FerlStr,
    /// Response text (`EXAMPLE_PROMPT_RESPONSE`).
    pub response: FerlStr,
    /// Messages as JSON (`EXAMPLE_MESSAGES_JSON`).
    pub messages_json: FerlStr,
    /// `n_tokens` token ids (`EXAMPLE_TOKENS`).
    pub input_ids: *const i64,
    /// `n_tokens` loss-mask bytes, 0 or 1 (`EXAMPLE_TOKENS`).
    pub loss_mask: *const u8,
    /// Length of `input_ids` and `loss_mask`.
    pub n_tokens: usize,
}

impl Example {
    /// An example with every field empty (the host passes this to `get`).
    pub fn empty() -> Self {
        Self {
            kind: 0,
            prompt: FerlStr::empty(),
            response: FerlStr::empty(),
            messages_json: FerlStr::empty(),
            input_ids: std::ptr::null(),
            loss_mask: std::ptr::null(),
            n_tokens: 0,
        }
    }
}

/// The table a dataset plugin exports through [`crate::DATASET_SYMBOL`].
#[repr(C)]
pub struct DatasetVTable {
    /// `size_of::<DatasetVTable>()` as the plugin compiled it.
    pub struct_size: usize,
    /// Opens the dataset described by `config` (a path or JSON options); writes the instance to `out`.
    pub open:
        unsafe extern "C" fn(config: FerlStr, out: *mut *mut c_void, err: *mut ErrorBuf) -> i32,
    /// Writes the number of examples to `out`.
    pub len: unsafe extern "C" fn(inst: *mut c_void, out: *mut u64, err: *mut ErrorBuf) -> i32,
    /// Writes example `index` (< len) to `out`.
    pub get: unsafe extern "C" fn(
        inst: *mut c_void,
        index: u64,
        out: *mut Example,
        err: *mut ErrorBuf,
    ) -> i32,
    /// Frees the instance.
    pub close: unsafe extern "C" fn(inst: *mut c_void, err: *mut ErrorBuf) -> i32,
}

/// The `extern "C"` signature of [`crate::DATASET_SYMBOL`].
pub type DatasetTableFn = unsafe extern "C" fn() -> *const DatasetVTable;

/// An example as a dataset author returns it.
#[derive(Clone, Debug, PartialEq)]
pub enum ExampleData {
    /// A prompt and the response to learn.
    PromptResponse {
        /// The prompt.
        prompt: String,
        /// The response.
        response: String,
    },
    /// A chat as a JSON array of `{"role", "content"}` objects.
    MessagesJson(String),
    /// Ready token ids and a loss mask of the same length.
    Tokens {
        /// Token ids.
        input_ids: Vec<i64>,
        /// 1 where the loss is taken.
        loss_mask: Vec<u8>,
    },
}

/// What a dataset author implements (then `export_dataset!(MyDataset)`).
pub trait DatasetPlugin: Plugin + Sized {
    /// Opens the dataset described by `config`.
    fn open(config: &str) -> Result<Self, String>;
    /// Number of examples.
    fn len(&self) -> u64;
    /// Whether there are no examples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Example `index` (< `len()`).
    fn get(&mut self, index: u64) -> Result<ExampleData, String>;
}

/// A dataset instance plus the example last handed out (its buffers back the pointers the host reads).
struct Instance<T> {
    inner: T,
    current: Option<ExampleData>,
}

unsafe extern "C" fn open_shim<T: DatasetPlugin>(
    config: FerlStr,
    out: *mut *mut c_void,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: the host keeps `config` alive for this call (crate invariant 3); `out` is writable and `err` is null
    // or valid (crate invariant 5). `out` is written only on success, with a freshly leaked `Box<Instance<T>>`.
    unsafe {
        let (status, inst) = guard(err, || T::open(config.to_str()?));
        if let Some(inner) = inst {
            *out = Box::into_raw(Box::new(Instance {
                inner,
                current: None,
            }))
            .cast();
        }
        status
    }
}

unsafe extern "C" fn len_shim<T: DatasetPlugin>(
    inst: *mut c_void,
    out: *mut u64,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: `inst` is a live `Box<Instance<T>>` from `open_shim::<T>`, `out` is a writable `u64` and `err` is null
    // or valid (crate invariant 5).
    unsafe {
        guard_status(err, || {
            *out = (*inst.cast::<Instance<T>>()).inner.len();
            Ok(())
        })
    }
}

unsafe extern "C" fn get_shim<T: DatasetPlugin>(
    inst: *mut c_void,
    index: u64,
    out: *mut Example,
    err: *mut ErrorBuf,
) -> i32 {
    // SAFETY: `inst` is a live `Box<Instance<T>>` from `open_shim::<T>` that nothing else uses during the call, `out`
    // is a writable `Example` and `err` is null or valid (crate invariant 5). The pointers written to `out` borrow
    // `inst.current`, which stays put until the next `get` or `close`, as the module docs promise the host.
    unsafe {
        guard_status(err, || {
            let inst = &mut *inst.cast::<Instance<T>>();
            let len = inst.inner.len();
            if index >= len {
                return Err(format!(
                    "example index {index} is out of range (the dataset has {len})"
                ));
            }
            let ex = inst.inner.get(index)?;
            if let ExampleData::Tokens {
                input_ids,
                loss_mask,
            } = &ex
            {
                if input_ids.len() != loss_mask.len() {
                    return Err(format!(
                        "example {index}: {} token ids but {} loss-mask entries",
                        input_ids.len(),
                        loss_mask.len()
                    ));
                }
            }
            let ex = inst.current.insert(ex);
            let o = &mut *out;
            *o = Example::empty();
            match ex {
                ExampleData::PromptResponse { prompt, response } => {
                    o.kind = crate::dataset::EXAMPLE_PROMPT_RESPONSE;
                    o.prompt = FerlStr::new(prompt);
                    o.response = FerlStr::new(response);
                }
                ExampleData::MessagesJson(json) => {
                    o.kind = EXAMPLE_MESSAGES_JSON;
                    o.messages_json = FerlStr::new(json);
                }
                ExampleData::Tokens {
                    input_ids,
                    loss_mask,
                } => {
                    o.kind = EXAMPLE_TOKENS;
                    o.input_ids = input_ids.as_ptr();
                    o.loss_mask = loss_mask.as_ptr();
                    o.n_tokens = input_ids.len();
                }
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn close_shim<T: DatasetPlugin>(inst: *mut c_void, err: *mut ErrorBuf) -> i32 {
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

/// The table for `T` (used by [`crate::export_dataset!`] in a `static`).
pub const fn vtable<T: DatasetPlugin>() -> DatasetVTable {
    DatasetVTable {
        struct_size: std::mem::size_of::<DatasetVTable>(),
        open: open_shim::<T>,
        len: len_shim::<T>,
        get: get_shim::<T>,
        close: close_shim::<T>,
    }
}

/// Exports `$ty: DatasetPlugin` as this library's dataset: the manifest and the dataset table, panics caught.
#[macro_export]
macro_rules! export_dataset {
    ($ty:ty) => {
        $crate::__export_manifest!($ty, $crate::PluginKind::Dataset);
        /// This plugin's dataset table (`ferl_plugin_abi::dataset::DatasetVTable`), looked up by this symbol's name.
        #[no_mangle]
        pub extern "C" fn ferl_plugin_dataset() -> *const $crate::dataset::DatasetVTable {
            static TABLE: $crate::dataset::DatasetVTable = $crate::dataset::vtable::<$ty>();
            &TABLE
        }
    };
}
