//! A background thread that runs every collective of one store in submission order, so the main thread can compute
//! while an all-gather (prefetch) or a reduce-scatter is in flight.
//!
//! # Invariants
//! 1. Collectives run one at a time, in the order they were submitted. Every rank submits the same sequence (the
//!    schedule is the same on every rank), so the ranks' collectives always match.
//! 2. Nothing else calls the communicators while the worker exists: all collectives of the store go through it.
//! 3. Under HSDP a reduce-scatter runs within the shard group only; the replica group's all-reduces are jobs of
//!    their own (`all_reduce_replicas`, once per unit per step), so every rank of both groups sees the same order.
//! 4. On CUDA each job carries a [`ComputeFence`] recorded at submission: its NCCL collectives wait for the
//!    computation enqueued before the submission only, not for what the main thread enqueued since (the layer it
//!    computes while a prefetch or a reduction is in flight).
//! 5. Every tensor a collective writes is allocated by the submitting (compute) thread before the fence is recorded.
//!    The caching allocator may hand out a block that the compute thread freed while kernels queued before the free
//!    still read it; allocated after the fence, NCCL (which waits for the fence only) could write it under them.

use anyhow::{anyhow, Result};
use ferl_collective::{Backend, Communicator, ComputeFence, ReduceOp};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use tch::{Device, Tensor};

type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// The result of a submitted collective, to be waited for.
pub(crate) struct Pending {
    rx: Receiver<Result<Tensor>>,
    what: &'static str,
}

impl Pending {
    /// Blocks until the collective finished; returns its output tensor.
    pub(crate) fn wait(self) -> Result<Tensor> {
        self.rx
            .recv()
            .map_err(|_| anyhow!("{}: the communication thread exited", self.what))?
    }
}

/// The sending end of the thread's queue.
struct Queue {
    /// The device the collectives' tensors live on (where fences are recorded).
    device: Device,
    tx: Sender<Job>,
}

impl Queue {
    fn submit<F>(&self, what: &'static str, f: F) -> Pending
    where
        F: FnOnce(&dyn Communicator) -> Result<Tensor> + Send + 'static,
    {
        let (tx, rx) = channel();
        let fence = ComputeFence::record(self.device).unwrap_or_else(|e| {
            tracing::warn!(
                "{what}: no fence at submission, the collective waits for its launch: {e:#}"
            );
            ComputeFence::none()
        });
        let job: Job = Box::new(move |c| {
            let _ = tx.send(fence.scope(|| f(c)));
        });
        // A send error means the thread is gone; `wait` then reports it.
        let _ = self.tx.send(job);
        Pending { rx, what }
    }
}

/// The thread that owns the communicators' calls.
pub(crate) struct CommWorker {
    /// Ranks of the shard group.
    world: usize,
    rank: usize,
    backend: Backend,
    replicate: Option<Arc<dyn Communicator>>,
    queue: Option<Arc<Queue>>,
    handle: Option<JoinHandle<()>>,
}

impl CommWorker {
    /// Starts the thread for the shard group `comm` and, under HSDP, the replica group `replicate`.
    pub(crate) fn new(
        device: Device,
        comm: Arc<dyn Communicator>,
        replicate: Option<Arc<dyn Communicator>>,
    ) -> Self {
        let replicate = replicate.filter(|r| r.world_size() > 1);
        let (tx, rx) = channel::<Job>();
        let (rank, world, backend) = (comm.rank(), comm.world_size(), comm.backend());
        let handle = std::thread::Builder::new()
            .name(format!("ferl-fsdp-comm-{rank}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    job(comm.as_ref());
                }
            })
            .expect("spawning the communication thread");
        Self {
            world,
            rank,
            backend,
            replicate,
            queue: Some(Arc::new(Queue { device, tx })),
            handle: Some(handle),
        }
    }

    /// Queues `f`; its tensor comes back through the returned [`Pending`].
    pub(crate) fn submit<F>(&self, what: &'static str, f: F) -> Pending
    where
        F: FnOnce(&dyn Communicator) -> Result<Tensor> + Send + 'static,
    {
        let queue = self
            .queue
            .as_ref()
            .expect("the queue lives as long as the worker");
        queue.submit(what, f)
    }

    /// The shard group as a [`Communicator`] whose every call runs on this thread, in order with the store's own
    /// collectives (the split head's exchanges). It fails once the worker is gone.
    pub(crate) fn shard_group(&self) -> Arc<dyn Communicator> {
        let queue = self
            .queue
            .as_ref()
            .expect("the queue lives as long as the worker");
        Arc::new(QueuedComm {
            queue: Arc::downgrade(queue),
            rank: self.rank,
            world: self.world,
            backend: self.backend,
        })
    }

    /// Sums `t` across the replica group (HSDP), or returns it without one.
    pub(crate) fn all_reduce_replicas(&self, mut t: Tensor) -> Pending {
        let replicate = self.replicate.clone();
        self.submit("all_reduce", move |_| {
            if let Some(r) = replicate {
                r.all_reduce(&mut t, ReduceOp::Sum)?;
            }
            Ok(t)
        })
    }

    /// All-gathers the 1-D `shard` into a new tensor of `world * shard.numel()` elements.
    pub(crate) fn all_gather(&self, shard: Tensor) -> Pending {
        if self.world == 1 {
            return self.submit("all_gather", move |_| Ok(shard));
        }
        // Invariant 5: the output (and a contiguous input) are allocated here, before the fence.
        let shard = shard.contiguous();
        let n = shard.numel() as i64 * self.world as i64;
        let mut out = Tensor::empty([n], (shard.kind(), shard.device()));
        self.submit("all_gather", move |c| {
            c.all_gather(&mut out, &shard)?;
            Ok(out)
        })
    }

    /// Sums the 1-D `full` across the shard group and returns this rank's block of it (a reduce-scatter; under HSDP
    /// the replica group's sum is the store's `finish_grads`).
    pub(crate) fn reduce_scatter(&self, full: Tensor) -> Pending {
        // Invariant 5: the output (and a contiguous input) are allocated here, before the fence.
        let (full, out) = match self.world {
            1 => (full, None),
            world => {
                let full = full.contiguous();
                let n = full.numel() as i64 / world as i64;
                let out = Tensor::empty([n], (full.kind(), full.device()));
                (full, Some(out))
            }
        };
        self.submit("reduce_scatter", move |c| match out {
            None => Ok(full),
            Some(mut out) => {
                c.reduce_scatter(&mut out, &full, ferl_collective::ReduceOp::Sum)?;
                Ok(out)
            }
        })
    }

    /// Sums `t` across every rank (shard group, then replica group) and returns it.
    pub(crate) fn all_reduce(&self, t: Tensor) -> Pending {
        self.all_reduce_in(t, true)
    }

    /// Sums `t` across the shard group only (the ranks that together hold one copy of the model).
    pub(crate) fn all_reduce_shard_group(&self, t: Tensor) -> Pending {
        self.all_reduce_in(t, false)
    }

    fn all_reduce_in(&self, mut t: Tensor, replicas: bool) -> Pending {
        let replicate = self.replicate.clone().filter(|_| replicas);
        self.submit("all_reduce", move |c| {
            if c.world_size() > 1 {
                c.all_reduce(&mut t, ferl_collective::ReduceOp::Sum)?;
            }
            if let Some(r) = replicate {
                r.all_reduce(&mut t, ferl_collective::ReduceOp::Sum)?;
            }
            Ok(t)
        })
    }
}

impl Drop for CommWorker {
    fn drop(&mut self) {
        self.queue.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The shard group's communicator seen through the worker's queue ([`CommWorker::shard_group`]): each call is a job
/// on the communication thread, waited for. Output tensors are the caller's (shallow handles travel to the thread).
struct QueuedComm {
    queue: Weak<Queue>,
    rank: usize,
    world: usize,
    backend: Backend,
}

impl QueuedComm {
    fn run<F>(&self, what: &'static str, f: F) -> Result<()>
    where
        F: FnOnce(&dyn Communicator) -> Result<()> + Send + 'static,
    {
        let queue = self
            .queue
            .upgrade()
            .ok_or_else(|| anyhow!("{what}: the store's communication thread is gone"))?;
        let pending = queue.submit(what, move |c| f(c).map(|()| Tensor::new()));
        drop(queue);
        pending.wait().map(drop)
    }

    /// [`Self::run`] of a collective writing the caller's `output` from `input`.
    fn run_into<F>(&self, what: &'static str, output: &Tensor, input: &Tensor, f: F) -> Result<()>
    where
        F: FnOnce(&dyn Communicator, &mut Tensor, &Tensor) -> Result<()> + Send + 'static,
    {
        let (mut out, input) = (output.shallow_clone(), input.shallow_clone());
        self.run(what, move |c| f(c, &mut out, &input))
    }
}

impl Communicator for QueuedComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> Backend {
        self.backend
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        let mut t = tensor.shallow_clone();
        self.run("all_reduce", move |c| c.all_reduce(&mut t, op))
    }

    fn all_gather(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        self.run_into("all_gather", output, input, |c, o, i| c.all_gather(o, i))
    }

    fn reduce_scatter(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.run_into("reduce_scatter", output, input, move |c, o, i| {
            c.reduce_scatter(o, i, op)
        })
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        let mut t = tensor.shallow_clone();
        self.run("broadcast", move |c| c.broadcast(&mut t, root))
    }

    fn all_to_all(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        self.run_into("all_to_all", output, input, |c, o, i| c.all_to_all(o, i))
    }

    fn barrier(&self) -> Result<()> {
        self.run("barrier", |c| c.barrier())
    }
}
