//! The C ABI between ferl and its plugins, and the safe layer plugin authors write against.
//!
//! # Data model
//! A plugin is a `cdylib` exporting two `extern "C"` functions:
//! - [`MANIFEST_SYMBOL`] (`ferl_plugin_manifest`) returning a [`Manifest`]: name, [`PluginKind`], version and the
//!   [`FERL_PLUGIN_ABI_VERSION`] it was built against;
//! - the table of its kind: [`DATASET_SYMBOL`] → [`dataset::DatasetVTable`], [`LOGGER_SYMBOL`] →
//!   [`logger::LoggerVTable`], [`KERNEL_SYMBOL`] → [`kernel::KernelVTable`] or [`REWARD_SYMBOL`] →
//!   [`reward::RewardVTable`].
//!
//! Authors never write these by hand: they implement [`Plugin`] plus one of [`logger::LoggerPlugin`],
//! [`dataset::DatasetPlugin`], [`kernel::KernelOpImpl`] or [`reward::RewardPlugin`] and call [`export_logger!`],
//! [`export_dataset!`], [`export_kernel!`] or [`export_reward!`].
//!
//! # Invariants (the host relies on them; tests in `ferl-plugin-host` name them)
//! 1. **No unwinding crosses the boundary.** Every exported function runs the author's code under `catch_unwind`; a
//!    panic becomes [`STATUS_PANIC`] with the panic message in the caller's [`ErrorBuf`].
//! 2. **Strings and buffers carry explicit lengths** ([`FerlStr`], pointer + count); nothing is NUL-terminated.
//! 3. **Ownership.** Whoever allocates frees: the host owns every [`ErrorBuf`] and every config string it passes;
//!    the plugin owns instances it returns from `open` until the host calls `close`, and any buffer it hands back
//!    (a dataset example, a manifest) stays valid until the next call on the same instance (manifests: for as long as
//!    the library is loaded). Tensor handles follow [`kernel`]'s rules.
//! 4. **Tables grow only at the end** and start with `struct_size`, so a host can refuse a table that is too short.
//! 5. **Instance pointers are exclusive.** The `inst` a table function receives is one its own `open` returned and
//!    that has not been closed; calls on one instance never overlap (the host holds each instance behind `&mut`),
//!    so a shim may use it as `&mut`. Out-pointers (`out`, `n`, output buffers) are writable for the sizes the
//!    table's documentation gives, and every `err` is null or a valid [`ErrorBuf`].
//!
//! The `// SAFETY:` comments of the plugin-side shims rely on these invariants and on each table's field docs.

pub mod dataset;
pub mod kernel;
pub mod logger;
mod panic;
pub mod reward;
pub mod tensor;

pub use panic::{guard, guard_status};

/// The ABI version this crate defines. A host refuses any plugin whose manifest names another.
pub const FERL_PLUGIN_ABI_VERSION: u32 = 1;

/// Name of the exported `extern "C" fn() -> *const Manifest`.
pub const MANIFEST_SYMBOL: &str = "ferl_plugin_manifest";
/// Name of the exported `extern "C" fn() -> *const DatasetVTable` of a dataset plugin.
pub const DATASET_SYMBOL: &str = "ferl_plugin_dataset";
/// Name of the exported `extern "C" fn() -> *const LoggerVTable` of a logger plugin.
pub const LOGGER_SYMBOL: &str = "ferl_plugin_logger";
/// Name of the exported `extern "C" fn() -> *const KernelVTable` of a kernel plugin.
pub const KERNEL_SYMBOL: &str = "ferl_plugin_kernel";
/// Name of the exported `extern "C" fn() -> *const RewardVTable` of a reward plugin.
pub const REWARD_SYMBOL: &str = "ferl_plugin_reward";

/// Success.
pub const STATUS_OK: i32 = 0;
/// The plugin's code returned an error; the message is in the [`ErrorBuf`].
pub const STATUS_ERROR: i32 = -1;
/// The plugin's code panicked; the panic message is in the [`ErrorBuf`].
pub const STATUS_PANIC: i32 = -2;

/// What a plugin provides, as stored in [`Manifest::kind`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PluginKind {
    /// Yields training examples ([`dataset`]).
    Dataset = 1,
    /// Receives each step's metrics ([`logger`]).
    Logger = 2,
    /// Replaces model ops ([`kernel`]).
    Kernel = 3,
    /// Scores responses for RL ([`reward`]).
    Reward = 4,
}

impl PluginKind {
    /// The kind stored as `raw` in a manifest, or `None` for an unknown value.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(Self::Dataset),
            2 => Some(Self::Logger),
            3 => Some(Self::Kernel),
            4 => Some(Self::Reward),
            _ => None,
        }
    }

    /// The lower-case name used in configs and `ferl plugin list`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dataset => "dataset",
            Self::Logger => "logger",
            Self::Kernel => "kernel",
            Self::Reward => "reward",
        }
    }

    /// The symbol of this kind's table.
    pub fn table_symbol(self) -> &'static str {
        match self {
            Self::Dataset => DATASET_SYMBOL,
            Self::Logger => LOGGER_SYMBOL,
            Self::Kernel => KERNEL_SYMBOL,
            Self::Reward => REWARD_SYMBOL,
        }
    }
}

/// A borrowed UTF-8 string: pointer and byte length, no terminator. Valid for as long as its owner says
/// (see the invariants above).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FerlStr {
    /// First byte (may dangle when `len == 0`).
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl FerlStr {
    /// Borrows `s` (the caller keeps `s` alive while the `FerlStr` is used).
    pub const fn new(s: &str) -> Self {
        Self {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    /// The empty string.
    pub const fn empty() -> Self {
        Self {
            ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
            len: 0,
        }
    }

    /// The bytes, or an empty slice for a null pointer.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable bytes that outlive `'a`.
    pub unsafe fn as_bytes<'a>(&self) -> &'a [u8] {
        // SAFETY: a null or empty string never reaches `from_raw_parts`; otherwise the caller guarantees `len`
        // readable bytes at `ptr` that live for `'a`.
        unsafe {
            if self.ptr.is_null() || self.len == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(self.ptr, self.len)
            }
        }
    }

    /// The string, or an error naming the bad byte offset when it is not UTF-8.
    ///
    /// # Safety
    /// As [`FerlStr::as_bytes`].
    pub unsafe fn to_str<'a>(&self) -> Result<&'a str, String> {
        // SAFETY: forwards this function's own contract, which is `as_bytes`'s.
        unsafe {
            std::str::from_utf8(self.as_bytes())
                .map_err(|e| format!("string passed across the plugin ABI is not UTF-8: {e}"))
        }
    }
}

/// A message buffer owned by the caller; the callee writes at most `cap` bytes of UTF-8 and sets `len`.
#[repr(C)]
#[derive(Debug)]
pub struct ErrorBuf {
    /// Start of the caller's buffer.
    pub buf: *mut u8,
    /// Capacity in bytes.
    pub cap: usize,
    /// Bytes written.
    pub len: usize,
}

impl ErrorBuf {
    /// Writes `msg` (truncated at a character boundary to fit) into the buffer behind `err`; a null `err` is ignored.
    ///
    /// # Safety
    /// `err` is null or points to a valid `ErrorBuf` whose `buf` has `cap` writable bytes.
    pub unsafe fn write(err: *mut ErrorBuf, msg: &str) {
        // SAFETY: the caller guarantees `err` is null (handled by `as_mut`) or a valid, exclusive `ErrorBuf`; its
        // `buf` is checked for null and has `cap` writable bytes, and `n <= cap` and `n <= msg.len()`, so the copy
        // stays inside both buffers (a caller-owned buffer cannot overlap the borrowed `msg`).
        unsafe {
            let Some(e) = err.as_mut() else { return };
            if e.buf.is_null() {
                return;
            }
            let mut n = msg.len().min(e.cap);
            while n > 0 && !msg.is_char_boundary(n) {
                n -= 1;
            }
            std::ptr::copy_nonoverlapping(msg.as_ptr(), e.buf, n);
            e.len = n;
        }
    }
}

/// Host-side owner of an [`ErrorBuf`]'s memory.
pub struct ErrorMessage {
    bytes: Vec<u8>,
    raw: ErrorBuf,
}

impl Default for ErrorMessage {
    fn default() -> Self {
        Self::new()
    }
}

impl ErrorMessage {
    /// A 4 KiB buffer.
    pub fn new() -> Self {
        let mut bytes = vec![0u8; 4096];
        let raw = ErrorBuf {
            buf: bytes.as_mut_ptr(),
            cap: bytes.len(),
            len: 0,
        };
        Self { bytes, raw }
    }

    /// The pointer to hand to a plugin call.
    pub fn as_mut_ptr(&mut self) -> *mut ErrorBuf {
        self.raw.len = 0;
        &mut self.raw
    }

    /// What the callee wrote (lossy UTF-8).
    pub fn message(&self) -> String {
        String::from_utf8_lossy(&self.bytes[..self.raw.len.min(self.bytes.len())]).into_owned()
    }
}

/// What every plugin declares about itself, returned by [`MANIFEST_SYMBOL`]. Points only to `'static` data.
#[repr(C)]
#[derive(Debug)]
pub struct Manifest {
    /// Size of this struct as the plugin compiled it.
    pub struct_size: usize,
    /// The [`FERL_PLUGIN_ABI_VERSION`] the plugin was built against.
    pub abi_version: u32,
    /// A [`PluginKind`] as `u32`.
    pub kind: u32,
    /// Unique name configs refer to (`trainer.logger=[tensorboard]`, `data.plugin=alpaca`).
    pub name: FerlStr,
    /// The plugin's own version (semver by convention), shown by `ferl plugin list`.
    pub version: FerlStr,
    /// One line for humans.
    pub description: FerlStr,
}

// SAFETY: a manifest only points to `'static` string data that is never written.
unsafe impl Sync for Manifest {}

/// The `extern "C"` signature of [`MANIFEST_SYMBOL`].
pub type ManifestFn = unsafe extern "C" fn() -> *const Manifest;

/// Identity every plugin type declares; the export macros turn it into the [`Manifest`].
pub trait Plugin {
    /// Unique name configs refer to.
    const NAME: &'static str;
    /// The plugin's version.
    const VERSION: &'static str;
    /// One line for humans.
    const DESCRIPTION: &'static str;
}

/// Builds the manifest of `P` (used by the export macros in a `static`).
pub const fn manifest_of<P: Plugin>(kind: PluginKind) -> Manifest {
    Manifest {
        struct_size: std::mem::size_of::<Manifest>(),
        abi_version: FERL_PLUGIN_ABI_VERSION,
        kind: kind as u32,
        name: FerlStr::new(P::NAME),
        version: FerlStr::new(P::VERSION),
        description: FerlStr::new(P::DESCRIPTION),
    }
}

/// Exports the manifest symbol for plugin type `$ty` of kind `$kind` (used by the kind macros).
#[doc(hidden)]
#[macro_export]
macro_rules! __export_manifest {
    ($ty:ty, $kind:expr) => {
        /// This plugin's manifest (`ferl_plugin_abi::Manifest`: name, kind, version, ABI version), which the host
        /// looks up by this symbol's name before anything else.
        #[no_mangle]
        pub extern "C" fn ferl_plugin_manifest() -> *const $crate::Manifest {
            static MANIFEST: $crate::Manifest = $crate::manifest_of::<$ty>($kind);
            &MANIFEST
        }
    };
}
