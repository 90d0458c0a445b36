//! The CUDA backend: NCCL collectives on CUDA tensors. The NCCL types come from cudarc's `nccl::sys`; the library is
//! opened at run time (no CUDA needed to build), by the names `libnccl.so.2` (what torch's wheels ship under the
//! venv's `nvidia/nccl/lib`, already loaded by libtorch_cuda) and `libnccl.so`, or from `FERL_NCCL_LIBRARY`. cudarc's
//! own loader only tries unversioned or CUDA-versioned names, which miss torch's `libnccl.so.2`.
//!
//! Collectives run on a non-blocking stream of their own, ordered after the computation with events
//! ([`crate::nccl_stream`]), so they overlap the default stream's work (the FSDP store's prefetched all-gathers and
//! its reduce-scatters run on its communication thread while the compute thread goes on). The calling thread waits
//! for the collective's completion event, polling NCCL's asynchronous error state; past the timeout the communicator
//! is aborted, so a dead peer yields an error, not a hang.

use crate::dtype::{DType, ReduceOp};
use crate::nccl_stream::{wait_until_done, CommStream};
use crate::rendezvous::Rendezvous;
use crate::tensor::{check_pair, RawTensor};
use crate::{Backend, Communicator, GroupOptions};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tch::{Device, Tensor};

type Stream = *mut c_void;

/// The NCCL entry points ferl uses, resolved from the loaded library.
struct NcclApi {
    _lib: libloading::Library,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t,
    comm_init_rank:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t,
    get_error_string: unsafe extern "C" fn(ncclResult_t) -> *const c_char,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        Stream,
    ) -> ncclResult_t,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        Stream,
    ) -> ncclResult_t,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        Stream,
    ) -> ncclResult_t,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        Stream,
    ) -> ncclResult_t,
    send: unsafe extern "C" fn(
        *const c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        Stream,
    ) -> ncclResult_t,
    recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        Stream,
    ) -> ncclResult_t,
    group_start: unsafe extern "C" fn() -> ncclResult_t,
    group_end: unsafe extern "C" fn() -> ncclResult_t,
}

fn library_candidates() -> Vec<String> {
    let mut names = Vec::new();
    if let Ok(path) = std::env::var("FERL_NCCL_LIBRARY") {
        names.push(path);
    }
    names.extend(["libnccl.so.2".to_string(), "libnccl.so".to_string()]);
    names
}

impl NcclApi {
    fn load() -> Result<Self> {
        let mut tried = Vec::new();
        for name in library_candidates() {
            // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
            match unsafe { libloading::Library::new(&name) } {
                Ok(lib) => {
                    return Self::resolve(lib).with_context(|| format!("NCCL library {name}"))
                }
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        bail!(
            "cannot load NCCL (set FERL_NCCL_LIBRARY to libnccl.so.2's path); tried {}",
            tried.join("; ")
        )
    }

    fn resolve(lib: libloading::Library) -> Result<Self> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is NCCL's documented C signature.
                *unsafe { lib.get($name) }
                    .with_context(|| format!("missing symbol {}", String::from_utf8_lossy($name)))?
            };
        }
        Ok(Self {
            get_unique_id: sym!(b"ncclGetUniqueId"),
            comm_init_rank: sym!(b"ncclCommInitRank"),
            comm_abort: sym!(b"ncclCommAbort"),
            comm_destroy: sym!(b"ncclCommDestroy"),
            comm_get_async_error: sym!(b"ncclCommGetAsyncError"),
            get_error_string: sym!(b"ncclGetErrorString"),
            all_reduce: sym!(b"ncclAllReduce"),
            all_gather: sym!(b"ncclAllGather"),
            reduce_scatter: sym!(b"ncclReduceScatter"),
            broadcast: sym!(b"ncclBroadcast"),
            send: sym!(b"ncclSend"),
            recv: sym!(b"ncclRecv"),
            group_start: sym!(b"ncclGroupStart"),
            group_end: sym!(b"ncclGroupEnd"),
            _lib: lib,
        })
    }

    /// Turns an NCCL status into a result naming the call.
    fn check(&self, what: &str, status: ncclResult_t) -> Result<()> {
        if status == ncclResult_t::ncclSuccess || status == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(status)) }.to_string_lossy();
        Err(anyhow!("{what}: NCCL error {status:?}: {text}"))
    }
}

fn api() -> Result<&'static NcclApi> {
    static API: OnceLock<std::result::Result<NcclApi, String>> = OnceLock::new();
    API.get_or_init(|| NcclApi::load().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|e| anyhow!("{e}"))
}

/// Loads libtorch_cuda into the process (once). The linker's `--as-needed` drops it from binaries that never name
/// one of its symbols, and without it torch sees no CUDA device; loading it also brings torch's libnccl.so.2.
/// Looks in `FERL_TORCH_LIB` (set by `scripts/env.sh`) and then on the library path.
pub fn load_torch_cuda() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut names: Vec<String> = Vec::new();
            if let Ok(dir) = std::env::var("FERL_TORCH_LIB") {
                names.push(format!("{dir}/libtorch_cuda.so"));
            }
            names.push("libtorch_cuda.so".into());
            let mut tried = Vec::new();
            for name in &names {
                // SAFETY: libtorch_cuda's initialisers only register CUDA hooks with the already-loaded libtorch.
                match unsafe { libloading::Library::new(name) } {
                    Ok(lib) => {
                        // Keep it loaded for the life of the process: torch holds pointers into it.
                        std::mem::forget(lib);
                        return Ok(());
                    }
                    Err(e) => tried.push(format!("{name}: {e}")),
                }
            }
            Err(format!(
                "cannot load libtorch_cuda (a CPU-only torch?): {}",
                tried.join("; ")
            ))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Whether NCCL can be used here: a CUDA device is visible and the NCCL library loads. `Err` says why not.
pub fn nccl_available() -> Result<()> {
    load_torch_cuda()?;
    if !tch::Cuda::is_available() {
        bail!("no CUDA device is available to torch");
    }
    api().map(|_| ())
}

fn nccl_dtype(dtype: DType) -> Result<ncclDataType_t> {
    Ok(match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::I8 => ncclDataType_t::ncclInt8,
        DType::U8 => ncclDataType_t::ncclUint8,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::I16 => bail!("NCCL has no 16-bit integer type"),
    })
}

fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

struct CommHandle(ncclComm_t);
// SAFETY: an NCCL communicator may be used from any thread as long as calls are serialised (the Mutex does that).
unsafe impl Send for CommHandle {}

struct NcclState {
    comm: CommHandle,
    /// The stream collectives run on (dropped after the communicator, see `Drop`).
    stream: CommStream,
    broken: Option<String>,
}

/// A group of ranks on CUDA devices, one device per rank, talking through NCCL.
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    device: usize,
    timeout: Duration,
    ctx: Arc<cudarc::driver::CudaContext>,
    state: Mutex<NcclState>,
}

impl NcclCommunicator {
    /// Joins the group as `rank` of `world` on CUDA device `device`; rank 0 publishes NCCL's unique id through
    /// `rendezvous`.
    pub fn connect(
        device: usize,
        rank: usize,
        world: usize,
        rendezvous: Arc<dyn Rendezvous>,
        options: &GroupOptions,
    ) -> Result<Self> {
        nccl_available().context("the NCCL backend cannot start")?;
        let api = api()?;
        let ctx = cudarc::driver::CudaContext::new(device)
            .map_err(|e| anyhow!("CUDA device {device}: {e:?}"))?;
        let key = format!("{}/nccl/unique_id", options.prefix);
        let id = if rank == 0 {
            let mut id = ncclUniqueId { internal: [0; 128] };
            // SAFETY: `id` is a valid out-pointer.
            api.check("ncclGetUniqueId", unsafe { (api.get_unique_id)(&mut id) })?;
            let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
            rendezvous.set(&key, &bytes)?;
            id
        } else {
            let bytes = rendezvous.get(&key, options.join_timeout)?;
            if bytes.len() != 128 {
                bail!(
                    "rank {rank}: NCCL unique id under `{key}` has {} bytes, expected 128",
                    bytes.len()
                );
            }
            let mut id = ncclUniqueId { internal: [0; 128] };
            for (dst, src) in id.internal.iter_mut().zip(&bytes) {
                *dst = *src as c_char;
            }
            id
        };
        ctx.bind_to_thread()
            .map_err(|e| anyhow!("rank {rank}: binding CUDA device {device}: {e:?}"))?;
        let stream = CommStream::new()?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the device's context is current on this thread.
        let status = unsafe { (api.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        api.check(
            &format!("rank {rank}: ncclCommInitRank (world {world}, device {device})"),
            status,
        )?;
        Ok(Self {
            rank,
            world,
            device,
            timeout: options.timeout,
            ctx,
            state: Mutex::new(NcclState {
                comm: CommHandle(comm),
                stream,
                broken: None,
            }),
        })
    }

    fn on_device(&self, device: Device) -> bool {
        device == Device::Cuda(self.device)
    }

    /// Enqueues `launch` on the collectives' stream after the computation enqueued so far, then waits for its
    /// completion event with the timeout; any failure aborts the group.
    fn run(
        &self,
        name: &str,
        launch: impl FnOnce(&NcclApi, ncclComm_t, Stream) -> Result<()>,
    ) -> Result<()> {
        let api = api()?;
        let mut state = self
            .state
            .lock()
            .map_err(|_| anyhow!("rank {}: NCCL lock poisoned", self.rank))?;
        if let Some(why) = &state.broken {
            bail!(
                "rank {}: {name}: the group failed earlier and cannot be used: {why}",
                self.rank
            );
        }
        self.ctx.bind_to_thread().map_err(|e| {
            anyhow!(
                "rank {}: binding CUDA device {}: {e:?}",
                self.rank,
                self.device
            )
        })?;
        let comm = state.comm.0;
        let stream = &state.stream;
        let result = stream
            .after_compute()
            .and_then(|_| launch(api, comm, stream.stream() as Stream))
            .and_then(|_| stream.mark_done())
            .and_then(|_| self.wait(api, comm, stream, name));
        if let Err(e) = &result {
            // SAFETY: `comm` is live; aborting frees its resources and unblocks pending kernels.
            unsafe { (api.comm_abort)(comm) };
            state.comm.0 = std::ptr::null_mut();
            state.broken = Some(format!("{e:#}"));
        }
        result
    }

    /// Waits for the collective marked on `stream`, failing on NCCL's asynchronous error or past the timeout.
    fn wait(&self, api: &NcclApi, comm: ncclComm_t, stream: &CommStream, name: &str) -> Result<()> {
        let what = format!("rank {}: {name}", self.rank);
        let poll = || {
            let mut async_err = ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is live and `async_err` a valid out-pointer.
            api.check("ncclCommGetAsyncError", unsafe {
                (api.comm_get_async_error)(comm, &mut async_err)
            })?;
            api.check(&what, async_err)?;
            stream.is_done().map_err(|e| anyhow!("{what}: {e:#}"))
        };
        wait_until_done(poll, self.timeout, Duration::from_micros(50), &what)
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        if let (Ok(api), Ok(state)) = (api(), self.state.get_mut()) {
            if !state.comm.0.is_null() {
                // SAFETY: the communicator is live and no call is in flight (we hold it exclusively).
                unsafe { (api.comm_destroy)(state.comm.0) };
            }
        }
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> Backend {
        Backend::Nccl
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        let t = RawTensor::of(tensor, |d| self.on_device(d), "all_reduce")?;
        let dt = nccl_dtype(t.dtype)?;
        self.run("all_reduce", |api, comm, stream| {
            // SAFETY: in-place on a live device buffer of `numel` elements.
            let status = unsafe {
                (api.all_reduce)(
                    t.ptr as _,
                    t.ptr as _,
                    t.numel,
                    dt,
                    nccl_op(op),
                    comm,
                    stream,
                )
            };
            api.check("ncclAllReduce", status)
        })
    }

    fn all_gather(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        let inp = RawTensor::of(input, |d| self.on_device(d), "all_gather input")?;
        let out = RawTensor::of(output, |d| self.on_device(d), "all_gather output")?;
        check_pair("all_gather", &inp, &out, inp.numel * self.world)?;
        let dt = nccl_dtype(inp.dtype)?;
        self.run("all_gather", |api, comm, stream| {
            // SAFETY: device buffers of the checked sizes.
            let status = unsafe {
                (api.all_gather)(inp.ptr as _, out.ptr as _, inp.numel, dt, comm, stream)
            };
            api.check("ncclAllGather", status)
        })
    }

    fn reduce_scatter(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        let inp = RawTensor::of(input, |d| self.on_device(d), "reduce_scatter input")?;
        let out = RawTensor::of(output, |d| self.on_device(d), "reduce_scatter output")?;
        if inp.numel % self.world != 0 {
            bail!(
                "reduce_scatter: input has {} elements, not a multiple of the world size {}",
                inp.numel,
                self.world
            );
        }
        check_pair("reduce_scatter", &inp, &out, inp.numel / self.world)?;
        let dt = nccl_dtype(inp.dtype)?;
        self.run("reduce_scatter", |api, comm, stream| {
            // SAFETY: device buffers of the checked sizes.
            let status = unsafe {
                (api.reduce_scatter)(
                    inp.ptr as _,
                    out.ptr as _,
                    out.numel,
                    dt,
                    nccl_op(op),
                    comm,
                    stream,
                )
            };
            api.check("ncclReduceScatter", status)
        })
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        let t = RawTensor::of(tensor, |d| self.on_device(d), "broadcast")?;
        if root >= self.world {
            bail!(
                "broadcast: root {root} is not a rank of a group of {}",
                self.world
            );
        }
        let dt = nccl_dtype(t.dtype)?;
        self.run("broadcast", |api, comm, stream| {
            // SAFETY: in-place on a live device buffer.
            let status = unsafe {
                (api.broadcast)(
                    t.ptr as _,
                    t.ptr as _,
                    t.numel,
                    dt,
                    root as c_int,
                    comm,
                    stream,
                )
            };
            api.check("ncclBroadcast", status)
        })
    }

    fn all_to_all(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        let inp = RawTensor::of(input, |d| self.on_device(d), "all_to_all input")?;
        let out = RawTensor::of(output, |d| self.on_device(d), "all_to_all output")?;
        let w = self.world;
        if inp.numel % w != 0 {
            bail!(
                "all_to_all: input has {} elements, not a multiple of the world size {w}",
                inp.numel
            );
        }
        check_pair("all_to_all", &inp, &out, inp.numel)?;
        let dt = nccl_dtype(inp.dtype)?;
        let (count, block) = (inp.numel / w, inp.bytes() / w);
        self.run("all_to_all", |api, comm, stream| {
            // SAFETY: ncclGroupStart takes no arguments; it only defers this thread's next calls to ncclGroupEnd.
            api.check("ncclGroupStart", unsafe { (api.group_start)() })?;
            for peer in 0..w {
                // SAFETY: block `peer` of the input (checked to hold `w * count` elements) holds `count` elements,
                // and `comm` is the live communicator `run` holds exclusively.
                let s = unsafe {
                    (api.send)(
                        inp.ptr.wrapping_add(peer * block) as _,
                        count,
                        dt,
                        peer as c_int,
                        comm,
                        stream,
                    )
                };
                // SAFETY: block `peer` of the output (checked to match the input's size and dtype) has room for
                // `count` elements, and `comm` is live.
                let r = unsafe {
                    (api.recv)(
                        out.ptr.wrapping_add(peer * block) as _,
                        count,
                        dt,
                        peer as c_int,
                        comm,
                        stream,
                    )
                };
                api.check("ncclSend", s)?;
                api.check("ncclRecv", r)?;
            }
            // SAFETY: closes the group opened above; the buffers it launches on outlive the call (`run` waits for
            // the collective's completion event before returning).
            api.check("ncclGroupEnd", unsafe { (api.group_end)() })
        })
    }

    fn barrier(&self) -> Result<()> {
        let mut token = Tensor::zeros([1], (tch::Kind::Float, Device::Cuda(self.device)));
        self.all_reduce(&mut token, ReduceOp::Sum)
    }
}
