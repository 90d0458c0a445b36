//! Collective communication for training ranks.
//!
//! One [`Communicator`] trait (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all, barrier) on tch tensors,
//! with two backends: [`TcpCommunicator`] for CPU tensors (ring algorithms over persistent connections, chunked and
//! pipelined: shared memory between ranks on the same host, TCP across hosts) and [`NcclCommunicator`] for CUDA
//! tensors (NCCL loaded at run time). Ranks find each other through a [`Rendezvous`] (the cluster head's key-value
//! store, an in-process [`MemoryRendezvous`], or the standalone [`TcpStore`] that [`init_from_env`] uses for
//! torchrun/SLURM-style launches). [`flat`] holds the flatten-pad-shard helpers FSDP-style sharding builds on.
//! [`GroupOptions`] lists the environment variables that tune a group (timeouts, transports, buffer sizes).
//!
//! Every TCP connection between ranks (to the [`TcpStore`], and each pair's mesh connection, which also carries the
//! shared-memory offers) is authenticated with a per-job [`JobSecret`] by a mutual HMAC challenge–response (see
//! `auth.rs`): launcher runs read it from `FERL_JOB_SECRET`, cluster runs get a fresh one from the driver in the
//! ranks' spawn messages, threads sharing a [`MemoryRendezvous`] share its random one. A group of one needs none.

mod auth;
mod dtype;
mod env;
pub mod flat;
mod nccl;
mod nccl_stream;
mod rendezvous;
mod store;
mod tcp;
mod tensor;

pub use auth::{JobSecret, HANDSHAKE_TIMEOUT, JOB_SECRET_ENV, MAX_HANDSHAKING};
pub use dtype::{DType, ReduceOp};
pub use env::{free_local_port, init_from_env, init_groups_from_env, LaunchEnv};
pub use nccl::{load_torch_cuda, nccl_available, NcclCommunicator};
pub use nccl_stream::ComputeFence;
pub use rendezvous::{MemoryRendezvous, Rendezvous};
pub use store::{TcpStore, TcpStoreServer};
pub use tcp::{TcpCommunicator, Transport};

use anyhow::Result;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tch::{Device, Tensor};

/// Which transport a communicator uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The CPU backend: TCP between hosts, shared memory between ranks on one host.
    Tcp,
    /// NCCL, for CUDA tensors.
    Nccl,
}

/// Collective operations over a fixed group of ranks. Every rank must call the same collectives in the same order
/// with matching sizes; a mismatch, a dead rank or a stalled one makes the call fail with an error (never hang), and
/// the communicator is unusable afterwards. Tensors must be contiguous and on the communicator's device.
pub trait Communicator: Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// The transport.
    fn backend(&self) -> Backend;
    /// Reduces `tensor` across ranks in place; every rank ends with the result.
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()>;
    /// Concatenates every rank's `input` (in rank order) into `output`, which has `world_size` times its elements.
    fn all_gather(&self, output: &mut Tensor, input: &Tensor) -> Result<()>;
    /// Reduces `input` (split into `world_size` equal blocks) across ranks; rank `r` gets block `r` in `output`.
    fn reduce_scatter(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()>;
    /// Copies `root`'s `tensor` into every other rank's `tensor`.
    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()>;
    /// Splits `input` into `world_size` equal blocks, sends block `j` to rank `j`; `output` block `j` comes from rank `j`.
    fn all_to_all(&self, output: &mut Tensor, input: &Tensor) -> Result<()>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;

    /// All-gathers `input` into a new 1-D tensor of `world_size * input.numel()` elements.
    fn all_gather_flat(&self, input: &Tensor) -> Result<Tensor> {
        let mut out = Tensor::empty(
            [(input.numel() * self.world_size()) as i64],
            (input.kind(), input.device()),
        );
        self.all_gather(&mut out, &input.contiguous())?;
        Ok(out)
    }

    /// Reduce-scatters the 1-D `input` into a new tensor of `input.numel() / world_size` elements.
    fn reduce_scatter_flat(&self, input: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let n = input.numel() / self.world_size();
        let mut out = Tensor::empty([n as i64], (input.kind(), input.device()));
        self.reduce_scatter(&mut out, &input.contiguous(), op)?;
        Ok(out)
    }
}

/// The collective time-out without `FERL_COLLECTIVE_TIMEOUT_S`: 10 minutes, as PyTorch's NCCL process groups.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// The join time-out without `FERL_COLLECTIVE_JOIN_TIMEOUT_S` or `FERL_COLLECTIVE_TIMEOUT_S`.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(30);

/// How a group forms and behaves.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    /// Bound on any wait for a peer during a collective: a rank that makes no progress for this long fails the
    /// collective on the others (a dead peer is detected at once regardless, through its connection). Default
    /// [`DEFAULT_TIMEOUT`] (PyTorch's NCCL default: ranks wait out rank 0's checkpoint writes), or
    /// `FERL_COLLECTIVE_TIMEOUT_S` (seconds, fractions allowed).
    pub timeout: Duration,
    /// Bound on joining the group (reaching the rendezvous store, waiting for every rank to publish its address and
    /// connect): `FERL_COLLECTIVE_JOIN_TIMEOUT_S`, else `FERL_COLLECTIVE_TIMEOUT_S` when set, else
    /// [`DEFAULT_JOIN_TIMEOUT`]: a rank that never arrives is reported soon.
    pub join_timeout: Duration,
    /// Namespace of this group's keys in the rendezvous store (distinct groups sharing a store need distinct ones).
    pub prefix: String,
    /// Address this rank listens on for its peers (TCP backend); default 127.0.0.1.
    pub bind_ip: Option<IpAddr>,
    /// Pipelining chunk of the TCP backend, in bytes (`FERL_COLLECTIVE_CHUNK_BYTES`).
    pub chunk_bytes: usize,
    /// Send and receive buffer of each TCP connection, in bytes; 0 keeps the kernel's auto-tuning
    /// (`FERL_COLLECTIVE_SOCKET_BUFFER`).
    pub socket_buffer: usize,
    /// Whether pairs of ranks on the same host talk through shared memory instead of TCP (TCP backend; on unless
    /// `FERL_COLLECTIVE_SHM=0`). A pair uses it only when both ranks allow it and can map the same segment.
    pub shared_memory: bool,
    /// Bytes of each direction's shared-memory ring, a power of two of at least 128 KiB
    /// (`FERL_COLLECTIVE_SHM_RING_BYTES`).
    pub shm_ring_bytes: usize,
    /// The secret that authenticates every connection of the group; `None` takes the rendezvous's
    /// ([`Rendezvous::job_secret`]). A group of more than one rank without either is refused.
    pub job_secret: Option<JobSecret>,
}

/// The number in environment variable `name`, if set to a finite value of at least `min`; any other value is reported
/// (naming the variable) and ignored.
fn env_number(name: &str, min: f64) -> Option<f64> {
    let raw = std::env::var(name).ok()?;
    match raw.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= min => Some(v),
        _ => {
            tracing::warn!("ignoring {name}={raw:?}: expected a number of at least {min}");
            None
        }
    }
}

impl Default for GroupOptions {
    fn default() -> Self {
        let explicit = env_number("FERL_COLLECTIVE_TIMEOUT_S", 0.001).map(Duration::from_secs_f64);
        let timeout = explicit.unwrap_or(DEFAULT_TIMEOUT);
        let join_timeout = env_number("FERL_COLLECTIVE_JOIN_TIMEOUT_S", 0.001)
            .map(Duration::from_secs_f64)
            .or(explicit)
            .unwrap_or(DEFAULT_JOIN_TIMEOUT);
        Self {
            timeout,
            join_timeout,
            prefix: "ferl/collective".into(),
            bind_ip: None,
            chunk_bytes: env_number("FERL_COLLECTIVE_CHUNK_BYTES", 1.0)
                .map_or(256 << 10, |v| v as usize),
            socket_buffer: env_number("FERL_COLLECTIVE_SOCKET_BUFFER", 0.0)
                .map_or(0, |v| v as usize),
            shared_memory: std::env::var("FERL_COLLECTIVE_SHM").map_or(true, |v| v.trim() != "0"),
            shm_ring_bytes: env_number("FERL_COLLECTIVE_SHM_RING_BYTES", 1.0)
                .map_or(4 << 20, |v| v as usize),
            job_secret: None,
        }
    }
}

/// Forms a group for tensors on `device`: NCCL for CUDA devices, TCP for the CPU.
pub fn connect(
    device: Device,
    rank: usize,
    world: usize,
    rendezvous: Arc<dyn Rendezvous>,
    options: &GroupOptions,
) -> Result<Arc<dyn Communicator>> {
    Ok(match device {
        Device::Cuda(index) => Arc::new(NcclCommunicator::connect(
            index, rank, world, rendezvous, options,
        )?),
        _ => Arc::new(TcpCommunicator::connect(rank, world, rendezvous, options)?),
    })
}

/// Forms more groups over the rendezvous a group formed on: groups of some of its ranks (a sequence-parallel
/// group, say), each in its own namespace below the first group's prefix, with the same options and secret.
#[derive(Clone)]
pub struct Subgroups {
    device: Device,
    rendezvous: Arc<dyn Rendezvous>,
    options: GroupOptions,
}

impl Subgroups {
    /// Subgroups on `device` over `rendezvous`, with the options of the group formed there.
    pub fn new(device: Device, rendezvous: Arc<dyn Rendezvous>, options: GroupOptions) -> Self {
        Self {
            device,
            rendezvous,
            options,
        }
    }

    /// Joins group `name` of `size` ranks as its rank `rank`; every member calls it with the same name and size.
    pub fn connect(&self, name: &str, rank: usize, size: usize) -> Result<Arc<dyn Communicator>> {
        let options = GroupOptions {
            prefix: format!("{}/{name}", self.options.prefix),
            ..self.options.clone()
        };
        connect(self.device, rank, size, self.rendezvous.clone(), &options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_time_outs_wait_out_checkpoint_writes_but_report_a_missing_rank_soon() {
        let set = |k: &str| std::env::var_os(k).is_some();
        if set("FERL_COLLECTIVE_TIMEOUT_S") || set("FERL_COLLECTIVE_JOIN_TIMEOUT_S") {
            return; // the environment chose its own bounds
        }
        let o = GroupOptions::default();
        assert_eq!(o.timeout, Duration::from_secs(600));
        assert_eq!(o.join_timeout, Duration::from_secs(30));
    }
}
