//! Spellings users copy from verl and torch FSDP example scripts that ferl maps onto its own keys. They are applied
//! to the tree after the files and overrides and after interpolation, just before typing, so the typed
//! [`SftConfig`](crate::SftConfig) (and its `to_yaml()`) holds only the canonical keys:
//!
//! - `model.fsdp_config.sharding_strategy` (torch FSDP1's `ShardingStrategy` names, any case) is removed and sets:
//!   `FULL_SHARD`: the defaults (`reshard_after_forward: true`, `fsdp_size: -1`); `SHARD_GRAD_OP`:
//!   `reshard_after_forward: false`; `NO_SHARD`: `fsdp_size: 1`; `HYBRID_SHARD`: keeps the user's `fsdp_size`, which
//!   must be set and above 1 (HSDP). A key the user also set to a different value is an error naming both keys.
//! - `model.fsdp_config.mixed_precision: true` is [`MixedPrecision::bf16`] (bf16 compute, fp32 reduce, fp32
//!   buffers); `false` is null. The mapping form is unchanged.

use std::collections::BTreeSet;

use anyhow::{bail, Result};
use serde_yaml::Value;

use crate::supported::inline;
use crate::{tree, MixedPrecision};

/// The input-only key naming a torch FSDP1 sharding strategy; it never reaches the typed config.
pub const SHARDING_STRATEGY: &str = "model.fsdp_config.sharding_strategy";
/// The key whose boolean form is rewritten to its mapping form.
pub const MIXED_PRECISION: &str = "model.fsdp_config.mixed_precision";
const RESHARD: &str = "model.fsdp_config.reshard_after_forward";
const FSDP_SIZE: &str = "model.fsdp_config.fsdp_size";

/// torch FSDP1's sharding strategies, as accepted in `model.fsdp_config.sharding_strategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardingStrategy {
    /// Shard parameters, gradients and optimizer state over all ranks; re-shard after forward (the defaults).
    FullShard,
    /// Keep parameters gathered between forward and backward: `reshard_after_forward: false`.
    ShardGradOp,
    /// No sharding (plain data parallelism): `fsdp_size: 1`.
    NoShard,
    /// Shard within groups of `fsdp_size` ranks and replicate across groups (HSDP): needs `fsdp_size` > 1.
    HybridShard,
}

impl ShardingStrategy {
    /// Every strategy, in the order error messages list them.
    pub const ALL: [Self; 4] = [
        Self::FullShard,
        Self::ShardGradOp,
        Self::NoShard,
        Self::HybridShard,
    ];

    /// torch's name (`FULL_SHARD`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::FullShard => "FULL_SHARD",
            Self::ShardGradOp => "SHARD_GRAD_OP",
            Self::NoShard => "NO_SHARD",
            Self::HybridShard => "HYBRID_SHARD",
        }
    }

    /// The strategy named `name`, ignoring ASCII case and surrounding blanks.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|s| s.name().eq_ignore_ascii_case(name.trim()))
    }
}

/// A `mixed_precision` value with the boolean form rewritten: `true` becomes [`MixedPrecision::bf16`]'s mapping,
/// `false` becomes null; any other value is returned unchanged.
pub fn mixed_precision_value(value: Value) -> Value {
    match value {
        Value::Bool(true) => serde_yaml::to_value(MixedPrecision::bf16()).expect("serialises"),
        Value::Bool(false) => Value::Null,
        other => other,
    }
}

/// The value stored when the user assigns `value` to canonical `key` (so later sub-keys of
/// `mixed_precision: true` apply to its mapping form).
pub fn on_assign(key: &str, value: Value) -> Value {
    if key == MIXED_PRECISION {
        mixed_precision_value(value)
    } else {
        value
    }
}

/// Applies every spelling to a fully resolved tree; `explicit` holds the canonical keys the user set (files and
/// overrides, minus resets), which decide whether a mapped key conflicts or takes the strategy's value.
pub fn resolve(tree: &mut Value, explicit: &BTreeSet<String>) -> Result<()> {
    if let Some(v) = tree::get(tree, MIXED_PRECISION).cloned() {
        tree::set(tree, MIXED_PRECISION, mixed_precision_value(v))?;
    }
    resolve_sharding(tree, explicit)
}

fn resolve_sharding(tree: &mut Value, explicit: &BTreeSet<String>) -> Result<()> {
    let Some(value) = tree::get(tree, SHARDING_STRATEGY).cloned() else {
        return Ok(());
    };
    tree::remove(tree, SHARDING_STRATEGY);
    let Some(strategy) = parse_strategy(&value)? else {
        return Ok(());
    };
    let mut need = |key: &str, want: Value| require(tree, explicit, strategy, key, want);
    match strategy {
        ShardingStrategy::FullShard => {
            need(RESHARD, Value::Bool(true))?;
            need(FSDP_SIZE, Value::from(-1))
        }
        ShardingStrategy::ShardGradOp => need(RESHARD, Value::Bool(false)),
        ShardingStrategy::NoShard => need(FSDP_SIZE, Value::from(1)),
        ShardingStrategy::HybridShard => require_hybrid(tree, explicit),
    }
}

/// The strategy a `sharding_strategy` value names; `None` for null.
fn parse_strategy(value: &Value) -> Result<Option<ShardingStrategy>> {
    let parsed = match value {
        Value::Null => return Ok(None),
        Value::String(s) => ShardingStrategy::parse(s),
        _ => None,
    };
    match parsed {
        Some(s) => Ok(Some(s)),
        None => {
            let names: Vec<&str> = ShardingStrategy::ALL.iter().map(|s| s.name()).collect();
            bail!(
                "bad value for `{SHARDING_STRATEGY}`: `{}`; expected one of {} (any case)",
                inline(value),
                names.join(", ")
            )
        }
    }
}

/// Sets `key` to `want` unless the user set it: then a different value of the same kind is a conflict (a value of
/// the wrong kind is left for typing to report).
fn require(
    tree: &mut Value,
    explicit: &BTreeSet<String>,
    strategy: ShardingStrategy,
    key: &str,
    want: Value,
) -> Result<()> {
    match tree::get(tree, key).filter(|_| explicit.contains(key)) {
        Some(have) if differs(have, &want) => bail!(
            "`{SHARDING_STRATEGY}={}` conflicts with `{key}={}`: {} means `{key}={}`; set only one of them",
            strategy.name(),
            inline(have),
            strategy.name(),
            inline(&want)
        ),
        Some(_) => Ok(()),
        None => tree::set(tree, key, want),
    }
}

fn differs(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::Bool(a), Value::Bool(b)) => a != b,
        (Value::Number(a), Value::Number(b)) => a.as_f64() != b.as_f64(),
        _ => false,
    }
}

/// HSDP: the user's `fsdp_size` is kept, and must be given and above 1.
fn require_hybrid(tree: &Value, explicit: &BTreeSet<String>) -> Result<()> {
    let name = ShardingStrategy::HybridShard.name();
    match tree::get(tree, FSDP_SIZE).filter(|_| explicit.contains(FSDP_SIZE)) {
        None => bail!(
            "`{SHARDING_STRATEGY}={name}` needs `{FSDP_SIZE}`: HSDP shards within groups of `{FSDP_SIZE}` ranks \
             (> 1) and replicates across groups; set `{FSDP_SIZE}`"
        ),
        Some(have) if have.as_i64().is_some_and(|n| n <= 1) => bail!(
            "`{SHARDING_STRATEGY}={name}` conflicts with `{FSDP_SIZE}={}`: {name} (HSDP) needs `{FSDP_SIZE}` > 1; \
             use NO_SHARD or FULL_SHARD instead, or a group size above 1",
            inline(have)
        ),
        Some(_) => Ok(()),
    }
}
