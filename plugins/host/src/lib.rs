//! The plugin host: loads ferl plugins (`cdylib`s built against [`ferl_plugin_abi`]), validates them, hot-reloads
//! new versions at step boundaries and unloads old ones when nothing uses them.
//!
//! # Data model
//! - [`LoadedPlugin`] ([`library`]): one version of one plugin, loaded from its own private copy of the file, with
//!   its validated [`PluginInfo`] and kind table. Shared as `Arc<LoadedPlugin>`; the library is unloaded and the copy
//!   deleted when the last `Arc` goes.
//! - [`PluginHost`] ([`registry`]): the plugins of a job by name: the current version of each, watched source files,
//!   reload requests, step-boundary switching.
//! - Kind wrappers: [`HotLogger`] ([`logger`]), [`DatasetInstance`] ([`dataset`]), [`KernelOpRef`] ([`kernel`]),
//!   [`RewardInstance`] and [`HotReward`] ([`reward`]), the latter two implementing [`RewardFn`], the trait rewards
//!   written in a driver implement too.
//! - [`control`]: the run-directory control channel `ferl plugin list|reload` talks to; [`store`]: the
//!   content-addressed cache the runtime ships plugin files through.
//!
//! # Invariants (tests in `tests/` name them)
//! 1. A file is never loaded in place: each load copies it to a fresh path first, so a rebuilt file loads beside the
//!    old version (`hot_reload_*`).
//! 2. A file with a wrong ABI version, a missing symbol or a manifest of the wrong kind is refused with an error naming
//!    the file and the problem (`refuses_*`).
//! 3. A new version becomes current only in [`PluginHost::step_boundary`]; work that holds the old `Arc` keeps it.
//! 4. The old library is unloaded once its last user drops it (`old_version_unloaded_*`).
//! 5. A plugin panic never unwinds into the host: it is an error of the call; a panicking logger is disabled with a
//!    warning until a new version is loaded (`logger_panic_*`, `dataset_panic_*`).

pub mod cargo_build;
pub mod control;
pub mod dataset;
pub mod kernel;
pub mod library;
pub mod logger;
pub mod registry;
pub mod reward;
pub mod store;

pub use dataset::{DatasetExample, DatasetInstance};
pub use ferl_plugin_abi as abi;
pub use ferl_plugin_abi::PluginKind;
pub use kernel::KernelOpRef;
pub use library::{LoadedPlugin, PluginInfo};
pub use logger::{HotLogger, LoggerInstance};
pub use registry::{PluginHost, PluginStatus, Switch};
pub use reward::{FnReward, HotReward, RewardFn, RewardInput, RewardInstance, RewardScores};
pub use store::PluginStore;

/// An error from a call into a plugin: which plugin, which call, what it said, and whether it panicked.
#[derive(Debug, thiserror::Error)]
#[error("plugin {plugin} ({file}): {call} {}: {message}", if *.panicked { "panicked" } else { "failed" })]
pub struct PluginCallError {
    /// Plugin name and version, `name@version`.
    pub plugin: String,
    /// The file the plugin was loaded from.
    pub file: String,
    /// What was called (`log`, `get(17)`, `fused_linear_cross_entropy.forward`...).
    pub call: String,
    /// The plugin's message.
    pub message: String,
    /// Whether the plugin panicked (caught at the boundary).
    pub panicked: bool,
}
