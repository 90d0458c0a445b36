//! What a node offers: CPUs, GPUs (detected with `nvidia-smi` when present, or declared), memory and custom
//! resources.

use anyhow::{bail, Context as _, Result};

use crate::protocol::Resources;

/// GPUs visible through `nvidia-smi`, or 0 when it is absent or fails.
pub(crate) fn detect_gpus() -> u32 {
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=index", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .count() as u32
        })
        .unwrap_or(0)
}

fn detect_memory_bytes() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|kb| kb.parse::<f64>().ok())
                })
        })
        .map(|kb| kb * 1024.0)
        .unwrap_or(0.0)
}

/// Parses `k=v` pairs (`--resources disk=2,accel=1`).
pub fn parse_pairs(pairs: &[String]) -> Result<Resources> {
    let mut out = Resources::new();
    for item in pairs
        .iter()
        .flat_map(|s| s.split(','))
        .filter(|s| !s.is_empty())
    {
        let Some((k, v)) = item.split_once('=') else {
            bail!("resource `{item}` is not of the form name=amount")
        };
        let v: f64 = v
            .trim()
            .parse()
            .with_context(|| format!("resource `{item}`: amount is not a number"))?;
        if v < 0.0 {
            bail!("resource `{item}`: amount is negative");
        }
        out.insert(k.trim().to_string(), v);
    }
    Ok(out)
}

/// The node's resources: detected values, overridden by what was declared.
pub(crate) fn node_resources(
    num_cpus: Option<f64>,
    num_gpus: Option<u32>,
    custom: Resources,
) -> Resources {
    let mut r = Resources::new();
    let cpus = num_cpus.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0)
    });
    r.insert("CPU".into(), cpus);
    r.insert("GPU".into(), num_gpus.unwrap_or_else(detect_gpus) as f64);
    r.insert("memory".into(), detect_memory_bytes());
    r.extend(custom);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_resources_override_detection() {
        let r = node_resources(
            Some(3.0),
            Some(2),
            parse_pairs(&["disk=2,accel=0.5".into()]).unwrap(),
        );
        assert_eq!(r["CPU"], 3.0);
        assert_eq!(r["GPU"], 2.0);
        assert_eq!(r["disk"], 2.0);
        assert_eq!(r["accel"], 0.5);
        assert!(parse_pairs(&["oops".into()])
            .unwrap_err()
            .to_string()
            .contains("oops"));
        assert!(parse_pairs(&["x=-1".into()]).is_err());
    }
}
