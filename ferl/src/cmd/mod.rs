//! One module per `ferl` subcommand.

pub mod cluster;
pub mod data;
pub mod export;
pub mod generate;
pub mod model;
pub mod plugin;
pub mod sft;
pub mod sft_dist;
