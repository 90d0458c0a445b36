//! One module per `ferl` subcommand.

pub(crate) mod cluster;
pub(crate) mod data;
pub(crate) mod export;
pub(crate) mod generate;
pub(crate) mod grpo;
pub(crate) mod model;
pub(crate) mod plugin;
pub(crate) mod sft;
pub(crate) mod sft_dist;
