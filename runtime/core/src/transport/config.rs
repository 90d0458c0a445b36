//! The transport's settings ([`TransportConfig`]): read once from the environment by the bootstrap layer
//! (`RuntimeConfig::from_env`, through its one lookup function) and passed down to every endpoint, connection,
//! lane and stream of a process. Nothing in this layer reads the environment itself.

use std::time::Duration;

use crate::codec::DEFAULT_MAX_FRAME;
use crate::transport::bulk::inbox::{
    BulkLimits, DEFAULT_UNCLAIMED_BYTES, DEFAULT_UNCLAIMED_PAYLOADS, DEFAULT_UNCLAIMED_TIMEOUT_S,
};
use crate::transport::bulk::{DEFAULT_SHM_BYTES, MAX_SHM_BYTES};

/// Environment variable: `0` keeps calls between processes of one host on QUIC (guarantee 13).
pub(crate) const LANES_ENV: &str = "FERL_LANES";
/// Environment variable: size of each same-host payload ring in bytes (0 turns the ring off; guarantee 13).
pub(crate) const SHM_BYTES_ENV: &str = "FERL_SHM_BYTES";
/// Environment variable: most unclaimed bulk bytes one peer may hold (guarantee 15).
pub(crate) const BULK_UNCLAIMED_BYTES_ENV: &str = "FERL_BULK_UNCLAIMED_BYTES";
/// Environment variable: most unclaimed bulk payloads one peer may hold (guarantee 15).
pub(crate) const BULK_UNCLAIMED_PAYLOADS_ENV: &str = "FERL_BULK_UNCLAIMED_PAYLOADS";
/// Environment variable: longest a payload stays unclaimed, or a stream waits for room, in seconds (guarantee 15).
pub(crate) const BULK_UNCLAIMED_TIMEOUT_ENV: &str = "FERL_BULK_UNCLAIMED_TIMEOUT_S";

/// How a process moves bytes: same-host lanes and rings, bulk-stream limits, the largest frame.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransportConfig {
    /// Whether this process offers and uses same-host lanes (`FERL_LANES`, default on; `0` turns them off).
    pub lanes: bool,
    /// Size of each same-host payload ring this process offers, at most 1 TiB (`FERL_SHM_BYTES`, default 256 MiB;
    /// 0: no ring, and offers from peers are refused).
    pub shm_bytes: u64,
    /// What one connection's peer may hold in unclaimed bulk payloads (`FERL_BULK_UNCLAIMED_*`).
    pub bulk: BulkLimits,
    /// Largest frame accepted on a call stream.
    pub max_frame: usize,
}

impl Default for TransportConfig {
    /// The documented defaults (what an empty environment gives).
    fn default() -> Self {
        Self {
            lanes: true,
            shm_bytes: DEFAULT_SHM_BYTES,
            bulk: BulkLimits {
                bytes: DEFAULT_UNCLAIMED_BYTES,
                payloads: DEFAULT_UNCLAIMED_PAYLOADS,
                timeout: Duration::from_secs(DEFAULT_UNCLAIMED_TIMEOUT_S),
            },
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}

impl TransportConfig {
    /// The settings `lookup` gives (a variable's value by name, `None` when unset), else the defaults. A bad bulk
    /// limit is ignored and reported through `warn` naming the variable; a bad `FERL_SHM_BYTES` means the default.
    pub(crate) fn from_lookup(
        lookup: &dyn Fn(&str) -> Option<String>,
        warn: &mut dyn FnMut(String),
    ) -> Self {
        let d = Self::default();
        let mut number = |name: &str, default: f64| -> f64 {
            let Some(text) = lookup(name) else {
                return default;
            };
            match text.trim().parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => v,
                _ => {
                    warn(format!(
                        "{name}={text:?} is not a non-negative number; using {default}"
                    ));
                    default
                }
            }
        };
        let bulk = BulkLimits {
            bytes: number(BULK_UNCLAIMED_BYTES_ENV, d.bulk.bytes as f64) as u64,
            payloads: number(BULK_UNCLAIMED_PAYLOADS_ENV, d.bulk.payloads as f64) as usize,
            timeout: Duration::from_secs_f64(number(
                BULK_UNCLAIMED_TIMEOUT_ENV,
                d.bulk.timeout.as_secs_f64(),
            )),
        };
        Self {
            lanes: lookup(LANES_ENV).is_none_or(|v| v.trim() != "0"),
            shm_bytes: lookup(SHM_BYTES_ENV)
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(DEFAULT_SHM_BYTES)
                .min(MAX_SHM_BYTES),
            bulk,
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}
