//! Runs one collective as a list of steps over the mesh. Each step may send a byte range to one peer and receive a
//! byte range from another (copied straight into the destination, or combined with local data). Large collectives
//! stream: a sender thread and the receiving thread work chunk by chunk, and a send that forwards data received in
//! the previous step waits only for the chunk it needs, so the steps of a ring pipeline overlap.

use super::link::Peer;
use super::mesh::Mesh;
use crate::dtype::{reduce_raw, DType, ReduceOp};
use anyhow::{anyhow, bail, Result};
use std::io::ErrorKind;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

const HEADER_MAGIC: u32 = 0x434c_5246; // "FRLC"
const HEADER_LEN: usize = 24;
/// Steps whose payload is at most this many bytes run on one thread, send then receive (socket buffers hold them).
const SMALL_STEP_BYTES: usize = 32 << 10;

/// What a received range is combined with.
#[derive(Clone, Copy)]
pub(crate) enum RecvMode {
    /// The received bytes are the result.
    Copy,
    /// `dst = op(other, received)`; `other` may equal `dst`.
    Reduce { other: *const u8 },
}

/// Bytes sent to one peer in a step.
#[derive(Clone, Copy)]
pub(crate) struct SendPart {
    pub peer: usize,
    pub ptr: *const u8,
    pub len: usize,
    /// The bytes are the ones the previous step receives (same range): send each chunk once it has arrived.
    pub after_prev_recv: bool,
}

/// Bytes received from one peer in a step.
#[derive(Clone, Copy)]
pub(crate) struct RecvPart {
    pub peer: usize,
    pub ptr: *mut u8,
    pub len: usize,
    pub mode: RecvMode,
}

/// One step of a collective.
#[derive(Clone, Copy, Default)]
pub(crate) struct Step {
    pub send: Option<SendPart>,
    pub recv: Option<RecvPart>,
}

/// A whole collective: its name and sequence number (checked against each peer's), element type, steps.
pub(crate) struct Plan {
    pub name: &'static str,
    pub code: u32,
    pub seq: u64,
    pub dtype: DType,
    pub op: ReduceOp,
    pub steps: Vec<Step>,
}

/// The raw pointers of a plan, shared by the sender and receiver threads of one collective.
struct SharedPlan<'a>(&'a Plan);
// SAFETY: the pointers address caller buffers that outlive the scoped threads; the plan's dependency rule keeps the
// sender from reading bytes the receiver has not finished writing, and steps never write a range another step reads
// concurrently.
unsafe impl Send for SharedPlan<'_> {}
// SAFETY: through a shared reference the plan itself is only read; the buffers its pointers address are accessed
// under the same dependency rule as for `Send` above.
unsafe impl Sync for SharedPlan<'_> {}

impl SharedPlan<'_> {
    fn plan(&self) -> &Plan {
        self.0
    }
}

/// How far the receiving side has got, in bytes over all steps.
struct Progress {
    done: AtomicU64,
    failed: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Progress {
    fn publish(&self, done: u64) {
        self.done.store(done, Ordering::Release);
        let _guard = self.lock.lock();
        self.wake.notify_all();
    }

    fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        let _guard = self.lock.lock();
        self.wake.notify_all();
    }

    /// Waits until at least `needed` bytes have been received; false if the collective failed meanwhile.
    fn wait_for(&self, needed: u64) -> bool {
        if self.done.load(Ordering::Acquire) >= needed {
            return true;
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.done.load(Ordering::Acquire) >= needed {
                return true;
            }
            if self.failed.load(Ordering::Acquire) {
                return false;
            }
            guard = self
                .wake
                .wait_timeout(guard, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn header(plan: &Plan, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&plan.code.to_le_bytes());
    h[8..16].copy_from_slice(&plan.seq.to_le_bytes());
    h[16..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// Describes an I/O failure with a peer in words a user can act on.
fn io_error(
    me: usize,
    plan: &Plan,
    verb: &str,
    peer: usize,
    e: std::io::Error,
    timeout: Duration,
) -> anyhow::Error {
    let why = match e.kind() {
        ErrorKind::UnexpectedEof => {
            "the connection was closed (the rank died or left the group)".to_string()
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            format!("no progress within the {timeout:?} timeout")
        }
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted => {
            format!("the connection was reset ({e}): the rank died or failed")
        }
        _ => e.to_string(),
    };
    anyhow!(
        "rank {me}: {} #{}: {verb} rank {peer} failed: {why}",
        plan.name,
        plan.seq
    )
}

fn check_header(
    me: usize,
    plan: &Plan,
    peer: usize,
    got: &[u8; HEADER_LEN],
    expected_len: usize,
) -> Result<()> {
    let expected = header(plan, expected_len);
    if *got != expected {
        let code = u32::from_le_bytes(got[4..8].try_into()?);
        let seq = u64::from_le_bytes(got[8..16].try_into()?);
        let len = u64::from_le_bytes(got[16..].try_into()?);
        bail!(
            "rank {me}: {} #{} expected {expected_len} bytes from rank {peer}, but rank {peer} sent collective code \
             {code} #{seq} with {len} bytes: the ranks called different collectives or sizes",
            plan.name,
            plan.seq
        );
    }
    Ok(())
}

/// Executes collectives over one mesh.
pub(crate) struct Engine {
    pub mesh: Mesh,
    pub timeout: Duration,
    pub chunk_bytes: usize,
    recv_scratch: Vec<u64>,
}

impl Engine {
    /// An engine over `mesh` with the given I/O timeout and pipelining chunk size.
    pub(super) fn new(mesh: Mesh, timeout: Duration, chunk_bytes: usize) -> Self {
        Self {
            mesh,
            timeout,
            chunk_bytes: chunk_bytes.max(4096),
            recv_scratch: Vec::new(),
        }
    }

    /// Runs `plan`; on any failure closes every connection (so all ranks fail promptly) and returns the first cause.
    pub(super) fn run(&mut self, plan: &Plan) -> Result<()> {
        let largest = plan
            .steps
            .iter()
            .map(|s| s.send.map_or(0, |p| p.len).max(s.recv.map_or(0, |p| p.len)))
            .max();
        let mut scratch = std::mem::take(&mut self.recv_scratch);
        let result = if largest.unwrap_or(0) <= SMALL_STEP_BYTES {
            self.run_sequential(plan, &mut scratch)
        } else {
            self.run_pipelined(plan, &mut scratch)
        };
        self.recv_scratch = scratch;
        if result.is_err() {
            self.mesh.shutdown_all();
        }
        result
    }

    fn run_sequential(&self, plan: &Plan, scratch: &mut Vec<u64>) -> Result<()> {
        let me = self.mesh.rank;
        let tmp = scratch_bytes(scratch, SMALL_STEP_BYTES);
        let mut frame = Vec::with_capacity(HEADER_LEN + SMALL_STEP_BYTES);
        for step in &plan.steps {
            if let Some(s) = step.send {
                frame.clear();
                frame.extend_from_slice(&header(plan, s.len));
                if s.len > 0 {
                    // SAFETY: the plan guarantees `ptr` addresses `len` readable bytes.
                    frame.extend_from_slice(unsafe { std::slice::from_raw_parts(s.ptr, s.len) });
                }
                let peer = self.mesh.peer(s.peer);
                peer.send(&frame)
                    .and_then(|()| peer.end_send_frame())
                    .map_err(|e| io_error(me, plan, "sending to", s.peer, e, self.timeout))?;
            }
            if let Some(r) = step.recv {
                let peer = self.mesh.peer(r.peer);
                let fail = |e| io_error(me, plan, "receiving from", r.peer, e, self.timeout);
                let mut h = [0u8; HEADER_LEN];
                peer.recv_exact(&mut h).map_err(fail)?;
                check_header(me, plan, r.peer, &h, r.len)?;
                receive_into(peer, r, tmp, 0, r.len, plan)
                    .and_then(|()| peer.end_recv_frame())
                    .map_err(fail)?;
            }
        }
        Ok(())
    }

    fn run_pipelined(&self, plan: &Plan, scratch: &mut Vec<u64>) -> Result<()> {
        let me = self.mesh.rank;
        let chunk = self.chunk_bytes / plan.dtype.size() * plan.dtype.size();
        let tmp = scratch_bytes(scratch, chunk);
        let timeout = self.timeout;
        // recv_before[i]: bytes received in steps before step i.
        let mut recv_before = Vec::with_capacity(plan.steps.len() + 1);
        let mut total = 0u64;
        for s in &plan.steps {
            recv_before.push(total);
            total += s.recv.map_or(0, |r| r.len as u64);
        }
        let progress = Progress {
            done: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        };
        let shared = SharedPlan(plan);
        let mesh = &self.mesh;
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| -> Result<()> {
                let plan = shared.plan();
                let sent = send_all(plan, mesh, &progress, &recv_before, chunk, timeout);
                if sent.is_err() {
                    // Wake the receiving thread: its peers see the closed connections too.
                    progress.fail();
                    mesh.shutdown_all();
                }
                sent
            });
            let received = (|| -> Result<()> {
                for (i, step) in plan.steps.iter().enumerate() {
                    let Some(r) = step.recv else { continue };
                    let peer = mesh.peer(r.peer);
                    let fail = |e| io_error(me, plan, "receiving from", r.peer, e, timeout);
                    let mut h = [0u8; HEADER_LEN];
                    peer.recv_exact(&mut h).map_err(fail)?;
                    check_header(me, plan, r.peer, &h, r.len)?;
                    let mut off = 0;
                    while off < r.len {
                        let end = (off + chunk).min(r.len);
                        receive_into(peer, r, tmp, off, end, plan).map_err(fail)?;
                        progress.publish(recv_before[i] + end as u64);
                        off = end;
                    }
                    peer.end_recv_frame().map_err(fail)?;
                    if progress.failed.load(Ordering::Acquire) {
                        bail!(
                            "rank {me}: {} #{}: stopped receiving after a failure",
                            plan.name,
                            plan.seq
                        );
                    }
                }
                Ok(())
            })();
            if received.is_err() {
                progress.fail();
                mesh.shutdown_all();
            }
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(anyhow!("rank {me}: sender thread panicked")));
            if sent.is_err() {
                mesh.shutdown_all();
            }
            // Report the sender's error first when the receiver only stopped because of it.
            match (received, sent) {
                (Ok(()), Ok(())) => Ok(()),
                (Err(r), Ok(())) => Err(r),
                (Ok(()), Err(s)) => Err(s),
                (Err(r), Err(s)) => {
                    if s.to_string().contains("stopped sending after a failure") {
                        Err(r)
                    } else {
                        Err(s.context(r.to_string()))
                    }
                }
            }
        })
    }
}

/// The first `bytes` bytes of `words` (grown as needed): an 8-byte aligned buffer TCP reductions receive into.
fn scratch_bytes(words: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    if words.len() * 8 < bytes {
        words.resize(bytes.div_ceil(8), 0);
    }
    // SAFETY: the vector owns at least `bytes` initialised bytes; u8 has no alignment or validity requirements.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, bytes) }
}

/// The sending half of a pipelined collective: every step's send, each chunk once its bytes are ready.
fn send_all(
    plan: &Plan,
    mesh: &Mesh,
    progress: &Progress,
    recv_before: &[u64],
    chunk: usize,
    timeout: Duration,
) -> Result<()> {
    let me = mesh.rank;
    for (i, step) in plan.steps.iter().enumerate() {
        let Some(s) = step.send else { continue };
        let peer = mesh.peer(s.peer);
        let fail = |e| io_error(me, plan, "sending to", s.peer, e, timeout);
        peer.send(&header(plan, s.len)).map_err(fail)?;
        let mut off = 0;
        while off < s.len {
            let end = (off + chunk).min(s.len);
            if s.after_prev_recv && i > 0 && !progress.wait_for(recv_before[i - 1] + end as u64) {
                bail!(
                    "rank {me}: {} #{}: stopped sending after a failure",
                    plan.name,
                    plan.seq
                );
            }
            // SAFETY: bytes [off, end) of the send range are initialised and no longer written.
            let bytes = unsafe { std::slice::from_raw_parts(s.ptr.add(off), end - off) };
            peer.send(bytes).map_err(fail)?;
            off = end;
        }
        peer.end_send_frame().map_err(fail)?;
    }
    Ok(())
}

/// Receives bytes [off, end) of `r`: straight into the destination, or combined with local data (in place from
/// shared memory, through `tmp` from TCP).
fn receive_into(
    peer: &Peer,
    r: RecvPart,
    tmp: &mut [u8],
    off: usize,
    end: usize,
    plan: &Plan,
) -> std::io::Result<()> {
    let len = end - off;
    if len == 0 {
        return Ok(());
    }
    match r.mode {
        RecvMode::Copy => {
            // SAFETY: the destination range is valid for writes and read by nobody until this chunk is published.
            let dst = unsafe { std::slice::from_raw_parts_mut(r.ptr.add(off), len) };
            peer.recv_exact(dst)
        }
        RecvMode::Reduce { other } => {
            let es = plan.dtype.size();
            peer.recv_pieces(len, es, tmp, |at, piece| {
                let o = off + at;
                // SAFETY: dst/other ranges are valid for the piece's elements; the piece (ring or scratch bytes,
                // aligned for the element type) overlaps neither.
                unsafe {
                    reduce_raw(
                        plan.dtype,
                        plan.op,
                        r.ptr.add(o),
                        other.add(o),
                        piece.as_ptr(),
                        piece.len() / es,
                    )
                };
            })
        }
    }
}
