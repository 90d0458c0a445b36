//! The adapters between the plugin host and the trainer (neither depends on the other):
//!
//! - [`logger`]: every loaded logger plugin becomes a `trainer.logger` kind of the trainer's
//!   [`ferl_trainer::metrics::LoggerRegistry`]; each step's metrics call is also the job's plugin **step boundary**
//!   (reload requests are served and new versions switched in there);
//! - [`dataset`]: `data.plugin=NAME` reads examples from a dataset plugin as a [`ferl_trainer::data::DataSource`];
//! - [`kernels`]: `model.use_liger=true` runs the trainer's RMSNorm, SwiGLU and head through the `liger` kernel plugin
//!   ([`kernels::liger_kernels`], set on each rank's engine);
//! - [`reward`]: reward plugins as the trainer's [`ferl_rl::Reward`], and verl's `naive` reward manager
//!   (each row scored by its `data_source`'s reward);
//! - [`setup`]: one [`ferl_plugin_host::PluginHost`] per job, in its run directory, watching the plugin folders.

pub mod dataset;
pub mod kernels;
pub mod logger;
pub mod reward;
pub mod setup;

pub use dataset::{plugin_dataset, PluginDataSource};
pub use kernels::{liger_kernels, LigerKernels};
pub use logger::{register_logger_plugins, PluginMetricsLogger, StepBoundary};
pub use reward::{reward_plugin_for, DataSourceReward, PluginReward};
pub use setup::job_plugin_host;
