//! Joining a group from an external launcher's environment: torchrun-style `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`, or SLURM's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` (with `MASTER_ADDR` from
//! the job script, else `SLURM_LAUNCH_NODE_IPADDR`). Rank 0 hosts the rendezvous store at `MASTER_ADDR:MASTER_PORT`
//! unless `FERL_STORE_HOSTED=1` says one already runs there.
//!
//! Every rank needs the same per-job secret in `FERL_JOB_SECRET` (hex, e.g. `export FERL_JOB_SECRET=$(openssl rand
//! -hex 32)` in the job script before `torchrun`/`srun`): it authenticates the store and every connection of the
//! group, and a launch of more than one rank without it is refused. A launch of one rank needs no store and no secret.

use crate::{
    connect, Communicator, GroupOptions, JobSecret, MemoryRendezvous, Rendezvous, Subgroups,
    TcpStore,
};
use anyhow::{bail, Context, Result};
use std::net::IpAddr;
use std::sync::Arc;
use tch::Device;

/// Where this process sits in a launch, read from environment variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank on this machine (picks the GPU).
    pub local_rank: usize,
    /// Host of the rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store (torchrun's default 29500 when unset).
    pub master_port: u16,
}

impl LaunchEnv {
    /// Reads the launch from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the launch through `get` (a variable name to its value); torchrun's names win over SLURM's.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let first = |names: &[&'static str]| first_set(&get, names);
        let number = |names: &[&'static str], default: Option<usize>| -> Result<usize> {
            match first(names) {
                Some((name, v)) => v
                    .trim()
                    .parse()
                    .with_context(|| format!("environment variable {name}={v:?} is not a number")),
                None => default
                    .with_context(|| format!("none of the environment variables {names:?} is set")),
            }
        };
        let rank = number(&["RANK", "SLURM_PROCID"], None)?;
        let world_size = number(&["WORLD_SIZE", "SLURM_NTASKS"], None)?;
        let local_rank = number(&["LOCAL_RANK", "SLURM_LOCALID"], Some(0))?;
        let master_port = number(&["MASTER_PORT"], Some(29500))?;
        let Some((_, master_addr)) = first(&["MASTER_ADDR", "SLURM_LAUNCH_NODE_IPADDR"]) else {
            bail!("MASTER_ADDR is not set (the host where rank 0 runs the rendezvous store)");
        };
        if world_size == 0 || rank >= world_size {
            bail!("rank {rank} is out of range for world size {world_size} (from RANK/WORLD_SIZE or SLURM)");
        }
        let master_port = u16::try_from(master_port)
            .with_context(|| format!("MASTER_PORT {master_port} is out of range"))?;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }

    /// Connects to (rank 0: hosts, unless `hosted`) the rendezvous store at `MASTER_ADDR:MASTER_PORT`, proving
    /// `options.job_secret`, else the secret in `FERL_JOB_SECRET` (an error names the variable when it is unset).
    pub fn rendezvous(&self, hosted: bool, options: &GroupOptions) -> Result<TcpStore> {
        let secret = match &options.job_secret {
            Some(secret) => secret.clone(),
            None => JobSecret::from_env()?,
        };
        let addr = format!("{}:{}", self.master_addr, self.master_port);
        if self.rank == 0 && !hosted {
            TcpStore::host(&addr, &secret, options.join_timeout)
                .with_context(|| format!("rank 0: hosting the rendezvous store at {addr}"))
        } else {
            TcpStore::connect(&addr, &secret, options.join_timeout)
        }
    }
}

/// The first of `names` that is set, with its value.
fn first_set(
    get: &impl Fn(&str) -> Option<String>,
    names: &[&'static str],
) -> Option<(&'static str, String)> {
    names.iter().find_map(|n| get(n).map(|v| (*n, v)))
}

/// Forms the group described by the environment for tensors on `device` (NCCL for CUDA, TCP for the CPU). Ranks
/// listen on the address they reach the store from, or on `FERL_COLLECTIVE_HOST` when set; all of them need the job
/// secret in `FERL_JOB_SECRET`, except a group of one, which forms in-process.
pub fn init_from_env(device: Device) -> Result<Arc<dyn Communicator>> {
    Ok(init_groups_from_env(device)?.0)
}

/// [`init_from_env`], and what forms groups of some of its ranks over the same store.
pub fn init_groups_from_env(device: Device) -> Result<(Arc<dyn Communicator>, Subgroups)> {
    let launch = LaunchEnv::from_env()?;
    let mut options = GroupOptions::default();
    if launch.world_size == 1 {
        let store: Arc<dyn Rendezvous> = Arc::new(MemoryRendezvous::new());
        let world = connect(device, 0, 1, store.clone(), &options)?;
        return Ok((world, Subgroups::new(device, store, options)));
    }
    let hosted = std::env::var("FERL_STORE_HOSTED").is_ok_and(|v| v == "1");
    let store = launch.rendezvous(hosted, &options)?;
    options.bind_ip = Some(match std::env::var("FERL_COLLECTIVE_HOST") {
        Ok(host) => host
            .parse::<IpAddr>()
            .with_context(|| format!("FERL_COLLECTIVE_HOST={host:?} is not an IP address"))?,
        Err(_) => store.local_ip(),
    });
    let store: Arc<dyn Rendezvous> = Arc::new(store);
    let world = connect(
        device,
        launch.rank,
        launch.world_size,
        store.clone(),
        &options,
    )?;
    Ok((world, Subgroups::new(device, store, options)))
}

/// A `MASTER_PORT` for ranks started on this machine: a TCP port free on 127.0.0.1 now, below the kernel's ephemeral
/// range (32768-60999 by default). A port picked by binding port 0 comes from that range, so an outgoing connection
/// could take it before rank 0's store binds it; ports 20000-31999 are probed from a start that differs per process
/// and per call.
pub fn free_local_port() -> u16 {
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id().wrapping_mul(2_654_435_761);
    (0..SPAN)
        .map(|i| (FIRST + (seed.wrapping_add(i.wrapping_mul(7_919))) % SPAN) as u16)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port below the ephemeral range")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn torchrun_variables_win_and_slurm_fills_in() {
        let env = LaunchEnv::from_lookup(lookup(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("SLURM_PROCID", "0"),
        ]))
        .unwrap();
        assert_eq!(
            (env.rank, env.world_size, env.local_rank, env.master_port),
            (2, 4, 0, 29500)
        );
        let slurm = LaunchEnv::from_lookup(lookup(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.9"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            slurm,
            LaunchEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                master_addr: "10.0.0.9".into(),
                master_port: 1234
            }
        );
    }

    #[test]
    fn bad_launch_variables_are_named() {
        let err = LaunchEnv::from_lookup(lookup(&[
            ("RANK", "x"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err();
        assert!(format!("{err:#}").contains("RANK"), "{err:#}");
        let err = LaunchEnv::from_lookup(lookup(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
        let err =
            LaunchEnv::from_lookup(lookup(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("MASTER_ADDR"), "{err}");
    }
}
