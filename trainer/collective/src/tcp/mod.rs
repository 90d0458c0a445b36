//! The CPU backend: collectives over persistent connections between ranks (one per pair: shared memory between ranks
//! on the same host, TCP otherwise), ring algorithms (all-reduce = ring reduce-scatter + ring all-gather), chunked and
//! pipelined so large tensors stream.

mod engine;
mod join;
mod link;
mod mesh;
mod shm;

pub use link::Transport;

use crate::dtype::{DType, ReduceOp};
use crate::rendezvous::Rendezvous;
use crate::tensor::{check_pair, is_cpu, RawTensor};
use crate::{Backend, Communicator, GroupOptions};
use anyhow::{anyhow, bail, Result};
use engine::{Engine, Plan, RecvMode, RecvPart, SendPart, Step};
use mesh::{connect_mesh, MeshConfig};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// A group of ranks on CPU tensors, connected over TCP, with shared-memory links between ranks on the same host
/// (unless [`GroupOptions::shared_memory`] is off). Calls are serialised; share it with `Arc`.
pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    state: Mutex<State>,
    _rendezvous: Arc<dyn Rendezvous>,
}

struct State {
    engine: Engine,
    seq: u64,
    broken: Option<String>,
}

/// Element range `[start, end)` of segment `i` when `n` elements are split into `parts` nearly equal segments.
fn segment(n: usize, parts: usize, i: usize) -> (usize, usize) {
    (n * i / parts, n * (i + 1) / parts)
}

impl TcpCommunicator {
    /// Joins the group as `rank` of `world`, finding the other ranks through `rendezvous`. Keeps `rendezvous` alive
    /// as long as the communicator (rank 0 may host the store the others still read). Every connection proves
    /// [`GroupOptions::job_secret`], else the rendezvous's [`Rendezvous::job_secret`]; with neither, only a group of
    /// one forms.
    pub fn connect(
        rank: usize,
        world: usize,
        rendezvous: Arc<dyn Rendezvous>,
        options: &GroupOptions,
    ) -> Result<Self> {
        let bind_ip = options.bind_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let secret = options
            .job_secret
            .clone()
            .or_else(|| rendezvous.job_secret());
        let cfg = MeshConfig {
            rank,
            world,
            prefix: &options.prefix,
            bind_ip,
            timeout: options.timeout,
            join_timeout: options.join_timeout,
            socket_buffer: options.socket_buffer,
            shared_memory: options.shared_memory,
            shm_ring_bytes: options.shm_ring_bytes,
            secret: secret.as_ref(),
        };
        let mesh = connect_mesh(&cfg, rendezvous.as_ref())?;
        let engine = Engine::new(mesh, options.timeout, options.chunk_bytes);
        Ok(Self {
            rank,
            world,
            state: Mutex::new(State {
                engine,
                seq: 0,
                broken: None,
            }),
            _rendezvous: rendezvous,
        })
    }

    /// How this rank reaches `peer` (`None` for itself or a rank outside the group).
    pub fn transport(&self, peer: usize) -> Option<Transport> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .engine
            .mesh
            .peers
            .get(peer)?
            .as_ref()
            .map(|p| p.transport())
    }

    fn right(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn left(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Runs the steps built by `build` as collective `name`; a failure poisons the communicator.
    fn execute(
        &self,
        name: &'static str,
        code: u32,
        dtype: DType,
        op: ReduceOp,
        steps: Vec<Step>,
    ) -> Result<()> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| anyhow!("rank {}: communicator lock poisoned", self.rank))?;
        if let Some(why) = &state.broken {
            bail!(
                "rank {}: {name}: the group failed earlier and cannot be used: {why}",
                self.rank
            );
        }
        let plan = Plan {
            name,
            code,
            seq: state.seq,
            dtype,
            op,
            steps,
        };
        state.seq += 1;
        let result = state.engine.run(&plan);
        if let Err(e) = &result {
            state.broken = Some(format!("{e:#}"));
        }
        result
    }

    /// In-place ring all-reduce of `n` elements at `ptr`.
    fn ring_all_reduce(&self, ptr: *mut u8, n: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        let (w, r, es) = (self.world, self.rank, dtype.size());
        let seg = |i: usize| {
            let (a, b) = segment(n, w, i % w);
            // SAFETY (for the callers of these pointers): offsets stay inside the tensor.
            (ptr.wrapping_add(a * es), (b - a) * es)
        };
        let mut steps = Vec::with_capacity(2 * w);
        for s in 0..w.saturating_sub(1) {
            let (sp, sl) = seg(r + w - s);
            let (rp, rl) = seg(r + 2 * w - s - 1);
            steps.push(Step {
                send: Some(SendPart {
                    peer: self.right(),
                    ptr: sp,
                    len: sl,
                    after_prev_recv: s > 0,
                }),
                recv: Some(RecvPart {
                    peer: self.left(),
                    ptr: rp,
                    len: rl,
                    mode: RecvMode::Reduce { other: rp },
                }),
            });
        }
        for s in 0..w.saturating_sub(1) {
            let (sp, sl) = seg(r + 1 + w - s);
            let (rp, rl) = seg(r + w - s);
            steps.push(Step {
                send: Some(SendPart {
                    peer: self.right(),
                    ptr: sp,
                    len: sl,
                    after_prev_recv: true,
                }),
                recv: Some(RecvPart {
                    peer: self.left(),
                    ptr: rp,
                    len: rl,
                    mode: RecvMode::Copy,
                }),
            });
        }
        self.execute("all_reduce", 1, dtype, op, steps)
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> Backend {
        Backend::Tcp
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        let t = RawTensor::of(tensor, is_cpu, "all_reduce")?;
        if op == ReduceOp::Avg && !t.dtype.is_float() {
            bail!(
                "all_reduce: Avg needs a floating-point tensor, got {:?}",
                t.dtype
            );
        }
        self.ring_all_reduce(t.ptr, t.numel, t.dtype, op)?;
        if op == ReduceOp::Avg && t.numel > 0 {
            let _ = tensor.g_div_scalar_(self.world as f64);
        }
        Ok(())
    }

    fn all_gather(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        let inp = RawTensor::of(input, is_cpu, "all_gather input")?;
        let out = RawTensor::of(output, is_cpu, "all_gather output")?;
        check_pair("all_gather", &inp, &out, inp.numel * self.world)?;
        let (w, r, m) = (self.world, self.rank, inp.bytes());
        let block = |i: usize| out.ptr.wrapping_add((i % w) * m);
        if m > 0 {
            // SAFETY: both ranges are `m` valid bytes and do not overlap (input is a different tensor).
            unsafe { std::ptr::copy_nonoverlapping(inp.ptr, block(r), m) };
        }
        let steps = (0..w.saturating_sub(1))
            .map(|s| Step {
                send: Some(SendPart {
                    peer: self.right(),
                    ptr: if s == 0 { inp.ptr } else { block(r + w - s) },
                    len: m,
                    after_prev_recv: s > 0,
                }),
                recv: Some(RecvPart {
                    peer: self.left(),
                    ptr: block(r + 2 * w - s - 1),
                    len: m,
                    mode: RecvMode::Copy,
                }),
            })
            .collect();
        self.execute("all_gather", 2, inp.dtype, ReduceOp::Sum, steps)
    }

    fn reduce_scatter(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        let inp = RawTensor::of(input, is_cpu, "reduce_scatter input")?;
        let out = RawTensor::of(output, is_cpu, "reduce_scatter output")?;
        let w = self.world;
        if inp.numel % w != 0 {
            bail!(
                "reduce_scatter: input has {} elements, not a multiple of the world size {w}",
                inp.numel
            );
        }
        check_pair("reduce_scatter", &inp, &out, inp.numel / w)?;
        if op == ReduceOp::Avg && !inp.dtype.is_float() {
            bail!(
                "reduce_scatter: Avg needs a floating-point tensor, got {:?}",
                inp.dtype
            );
        }
        let (r, m) = (self.rank, out.bytes());
        let in_block = |i: usize| inp.ptr.wrapping_add((i % w) * m) as *const u8;
        // Partial sums travel through a scratch buffer (one block per step) so the input stays untouched.
        let mut partial = vec![0u64; (m * w.saturating_sub(2)).div_ceil(8)];
        let partial_base = partial.as_mut_ptr() as *mut u8;
        let part = |s: usize| partial_base.wrapping_add(s * m);
        let mut steps = Vec::with_capacity(w);
        for s in 0..w.saturating_sub(1) {
            let last = s + 2 == w;
            let send_ptr = if s == 0 {
                in_block(r + w - 1)
            } else {
                part(s - 1) as *const u8
            };
            let dst = if last { out.ptr } else { part(s) };
            let other = in_block(r + 2 * w - s - 2);
            steps.push(Step {
                send: Some(SendPart {
                    peer: self.right(),
                    ptr: send_ptr,
                    len: m,
                    after_prev_recv: s > 0,
                }),
                recv: Some(RecvPart {
                    peer: self.left(),
                    ptr: dst,
                    len: m,
                    mode: RecvMode::Reduce { other },
                }),
            });
        }
        if w == 1 && m > 0 {
            // SAFETY: distinct tensors of `m` bytes each.
            unsafe { std::ptr::copy_nonoverlapping(inp.ptr, out.ptr, m) };
        }
        self.execute("reduce_scatter", 3, inp.dtype, op, steps)?;
        drop(partial);
        if op == ReduceOp::Avg && out.numel > 0 {
            let _ = output.g_div_scalar_(w as f64);
        }
        Ok(())
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        let t = RawTensor::of(tensor, is_cpu, "broadcast")?;
        let w = self.world;
        if root >= w {
            bail!("broadcast: root {root} is not a rank of a group of {w}");
        }
        let pos = (self.rank + w - root) % w;
        let mut steps = Vec::new();
        if w > 1 {
            if pos == 0 {
                steps.push(Step {
                    send: Some(SendPart {
                        peer: self.right(),
                        ptr: t.ptr,
                        len: t.bytes(),
                        after_prev_recv: false,
                    }),
                    recv: None,
                });
            } else {
                let recv = RecvPart {
                    peer: self.left(),
                    ptr: t.ptr,
                    len: t.bytes(),
                    mode: RecvMode::Copy,
                };
                steps.push(Step {
                    send: None,
                    recv: Some(recv),
                });
                if pos + 1 < w {
                    let send = SendPart {
                        peer: self.right(),
                        ptr: t.ptr,
                        len: t.bytes(),
                        after_prev_recv: true,
                    };
                    steps.push(Step {
                        send: Some(send),
                        recv: None,
                    });
                }
            }
        }
        self.execute("broadcast", 4, t.dtype, ReduceOp::Sum, steps)
    }

    fn all_to_all(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        let inp = RawTensor::of(input, is_cpu, "all_to_all input")?;
        let out = RawTensor::of(output, is_cpu, "all_to_all output")?;
        let (w, r) = (self.world, self.rank);
        if inp.numel % w != 0 {
            bail!(
                "all_to_all: input has {} elements, not a multiple of the world size {w}",
                inp.numel
            );
        }
        check_pair("all_to_all", &inp, &out, inp.numel)?;
        let m = inp.bytes() / w;
        if m > 0 {
            // SAFETY: distinct tensors; block r of each is `m` bytes.
            unsafe { std::ptr::copy_nonoverlapping(inp.ptr.add(r * m), out.ptr.add(r * m), m) };
        }
        let steps = (1..w)
            .map(|s| {
                let to = (r + s) % w;
                let from = (r + w - s) % w;
                Step {
                    send: Some(SendPart {
                        peer: to,
                        ptr: inp.ptr.wrapping_add(to * m),
                        len: m,
                        after_prev_recv: false,
                    }),
                    recv: Some(RecvPart {
                        peer: from,
                        ptr: out.ptr.wrapping_add(from * m),
                        len: m,
                        mode: RecvMode::Copy,
                    }),
                }
            })
            .collect();
        self.execute("all_to_all", 5, inp.dtype, ReduceOp::Sum, steps)
    }

    fn barrier(&self) -> Result<()> {
        // w-1 ring exchanges: afterwards every rank has heard (transitively) from every other.
        let step = Step {
            send: Some(SendPart {
                peer: self.right(),
                ptr: std::ptr::null(),
                len: 0,
                after_prev_recv: false,
            }),
            recv: Some(RecvPart {
                peer: self.left(),
                ptr: std::ptr::null_mut(),
                len: 0,
                mode: RecvMode::Copy,
            }),
        };
        self.execute(
            "barrier",
            6,
            DType::U8,
            ReduceOp::Sum,
            vec![step; self.world.saturating_sub(1)],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::segment;

    #[test]
    fn segments_cover_the_range_without_gaps() {
        for n in [0usize, 1, 5, 7, 100] {
            for parts in 1..5 {
                let mut next = 0;
                for i in 0..parts {
                    let (a, b) = segment(n, parts, i);
                    assert_eq!(a, next);
                    assert!(b - a <= n / parts + 1);
                    next = b;
                }
                assert_eq!(next, n);
            }
        }
    }
}
