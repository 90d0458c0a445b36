//! placeholder for flat helpers
