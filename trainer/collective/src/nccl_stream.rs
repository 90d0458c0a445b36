//! The NCCL backend's own CUDA stream, so that collectives overlap computation.
//!
//! tch enqueues every operation on the legacy default stream (torch's default current stream). A collective runs
//! on a non-blocking stream of its own ([`CommStream`]), which does not synchronise with the default stream, so an
//! all-gather prefetched for the next layer or a reduce-scatter of a gradient runs while the default stream computes.
//! Order is kept with two events:
//! 1. an event recorded on the default stream and waited for by the comm stream: the collective starts after every
//!    kernel enqueued before that point (the producers of its input, and the last users of its output's memory when
//!    the output is allocated before that point, as the FSDP store does), whatever thread enqueued them. The point is the collective's submission when the
//!    submitting thread recorded a [`ComputeFence`] (the FSDP store does, so that a prefetch launched later by its
//!    communication thread does not also wait for the layer the compute thread enqueued meanwhile), else its launch;
//! 2. after the launch, an event recorded on the comm stream, which the calling thread polls
//!    ([`wait_until_done`]) together with NCCL's asynchronous error, up to the group's timeout. Only the thread that
//!    runs the collective (the FSDP store's communication thread) waits; results are handed over after the
//!    collective finished, so the default stream never reads a buffer NCCL is still writing, and an input is freed
//!    only once NCCL is done with it.

use anyhow::{anyhow, bail, Result};
use cudarc::driver::result::{event, stream};
use cudarc::driver::sys::{self, cudaError_enum, CUevent, CUstream};
use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    /// The fence of the job the communication thread is running ([`ComputeFence::scope`]).
    static FENCE: Cell<Option<CUevent>> = const { Cell::new(None) };
}

/// A point in the default stream's work, recorded when a collective is submitted, for it to wait for when it is
/// launched later from another thread (see the module docs). Empty on CPU devices, and wherever no CUDA context is
/// current on the recording thread (the collective then waits for the work enqueued before its launch).
pub struct ComputeFence(Option<CUevent>);

// SAFETY: an event handle is valid in any thread of the process while its context lives; the fence only records it
// once (on creation) and is then only waited for.
unsafe impl Send for ComputeFence {}

impl ComputeFence {
    /// No point to wait for: collectives wait for the work enqueued before their launch.
    pub fn none() -> Self {
        Self(None)
    }

    /// Records the default stream's current point on `device` (a no-op on the CPU).
    pub fn record(device: tch::Device) -> Result<Self> {
        if !matches!(device, tch::Device::Cuda(_)) {
            return Ok(Self::none());
        }
        let current = cudarc::driver::result::ctx::get_current()
            .map_err(|e| anyhow!("reading the current CUDA context: {e:?}"))?;
        if current.is_none() {
            return Ok(Self::none());
        }
        let fence = event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| anyhow!("creating a CUDA event: {e:?}"))?;
        // SAFETY: a live event of the current context; the null stream is the legacy default stream.
        unsafe { event::record(fence, stream::null()) }
            .map_err(|e| anyhow!("recording a CUDA event on the default stream: {e:?}"))?;
        Ok(Self(Some(fence)))
    }

    /// Runs `f` on this thread with this fence as the point its NCCL collectives wait for.
    pub fn scope<T>(&self, f: impl FnOnce() -> T) -> T {
        let previous = FENCE.with(|c| c.replace(self.0));
        let out = f();
        FENCE.with(|c| c.set(previous));
        out
    }
}

impl Drop for ComputeFence {
    fn drop(&mut self) {
        if let Some(fence) = self.0.take() {
            // SAFETY: created by `record` and destroyed once; the driver frees it when its work completes.
            let _ = unsafe { event::destroy(fence) };
        }
    }
}

/// A non-blocking CUDA stream for collectives, and the two events that order it (see the module docs).
pub(crate) struct CommStream {
    stream: CUstream,
    ready: CUevent,
    done: CUevent,
}

// SAFETY: the stream and events are driver handles valid in any thread of the process while their context lives;
// the communicator uses them under its lock, one collective at a time.
unsafe impl Send for CommStream {}

impl CommStream {
    /// Creates the stream and events in the context current on this thread (the communicator's device).
    pub(crate) fn new() -> Result<Self> {
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let stream = stream::create(stream::StreamKind::NonBlocking)
            .map_err(|e| anyhow!("creating the collectives' CUDA stream: {e:?}"))?;
        let ready = event::create(flags).map_err(|e| anyhow!("creating a CUDA event: {e:?}"))?;
        let done = event::create(flags).map_err(|e| anyhow!("creating a CUDA event: {e:?}"))?;
        Ok(Self {
            stream,
            ready,
            done,
        })
    }

    /// The stream to launch collectives on.
    pub(crate) fn stream(&self) -> CUstream {
        self.stream
    }

    /// Makes the comm stream wait for the default stream's work up to this thread's [`ComputeFence`], or else up
    /// to now (event 1).
    pub(crate) fn after_compute(&self) -> Result<()> {
        let point = match FENCE.with(Cell::get) {
            Some(fence) => fence,
            None => {
                // SAFETY: `ready` is a live event of this context; the null stream is the legacy default stream,
                // always valid while a context is current.
                unsafe { event::record(self.ready, stream::null()) }
                    .map_err(|e| anyhow!("recording a CUDA event on the default stream: {e:?}"))?;
                self.ready
            }
        };
        // SAFETY: `stream` and `point` are live handles of this context (a fence outlives its scope).
        unsafe {
            stream::wait_event(
                self.stream,
                point,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| anyhow!("ordering the collectives' stream after computation: {e:?}"))
    }

    /// Marks the end of the collective just launched on the comm stream (event 2).
    pub(crate) fn mark_done(&self) -> Result<()> {
        // SAFETY: live handles of this context.
        unsafe { event::record(self.done, self.stream) }
            .map_err(|e| anyhow!("recording a CUDA event on the collectives' stream: {e:?}"))
    }

    /// Whether the collective marked by [`CommStream::mark_done`] has finished.
    pub(crate) fn is_done(&self) -> Result<bool> {
        // SAFETY: `done` is a live event of this context.
        match unsafe { sys::cuEventQuery(self.done) } {
            cudaError_enum::CUDA_SUCCESS => Ok(true),
            cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            other => bail!("CUDA error {other:?} while waiting for a collective"),
        }
    }
}

impl Drop for CommStream {
    fn drop(&mut self) {
        // SAFETY: handles created by `new` and destroyed once; the driver releases them when pending work completes.
        unsafe {
            let _ = event::destroy(self.ready);
            let _ = event::destroy(self.done);
            let _ = stream::destroy(self.stream);
        }
    }
}

/// Polls `is_done` (which also reports asynchronous errors) until it says done, sleeping `pause` between polls;
/// fails with its error, or once `timeout` has passed without completion, naming `what`.
pub(crate) fn wait_until_done(
    mut is_done: impl FnMut() -> Result<bool>,
    timeout: Duration,
    pause: Duration,
    what: &str,
) -> Result<()> {
    let start = Instant::now();
    loop {
        if is_done()? {
            return Ok(());
        }
        if start.elapsed() > timeout {
            bail!("{what} did not complete within {timeout:?} (a peer died or stalled)");
        }
        std::thread::sleep(pause);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAUSE: Duration = Duration::from_micros(50);

    #[test]
    fn a_cpu_fence_is_empty_and_its_scope_restores_the_previous_one() {
        assert!(ComputeFence::record(tch::Device::Cpu).unwrap().0.is_none());
        let point = 0x40 as CUevent; // never handed to a driver
        let outer = ComputeFence(Some(point));
        let (inside, nested) = outer.scope(|| {
            let nested = ComputeFence(None).scope(|| FENCE.with(Cell::get));
            (FENCE.with(Cell::get), nested)
        });
        assert_eq!((inside, nested), (Some(point), None));
        assert!(FENCE.with(Cell::get).is_none(), "restored after the scope");
        std::mem::forget(outer); // no driver here to destroy it
    }

    #[test]
    fn waits_until_the_collective_is_done() {
        let mut polls = 0;
        let poll = || {
            polls += 1;
            Ok(polls == 3)
        };
        wait_until_done(poll, Duration::from_secs(5), PAUSE, "rank 0: all_gather").unwrap();
        assert_eq!(polls, 3);
    }

    #[test]
    fn an_error_while_waiting_fails_at_once() {
        let mut polls = 0;
        let poll = || {
            polls += 1;
            match polls {
                1 => Ok(false),
                _ => Err(anyhow!("rank 1: all_gather: NCCL error ncclRemoteError")),
            }
        };
        let e = wait_until_done(poll, Duration::from_secs(5), PAUSE, "rank 1: all_gather");
        assert!(e.unwrap_err().to_string().contains("ncclRemoteError"));
        assert_eq!(polls, 2);
    }

    #[test]
    fn a_collective_that_never_finishes_times_out_naming_it() {
        let start = Instant::now();
        let timeout = Duration::from_millis(30);
        let e =
            wait_until_done(|| Ok(false), timeout, PAUSE, "rank 2: reduce_scatter").unwrap_err();
        assert!(start.elapsed() >= timeout);
        assert!(
            e.to_string()
                .contains("rank 2: reduce_scatter did not complete within"),
            "{e}"
        );
    }
}
