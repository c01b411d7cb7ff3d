//! The device-side communicator seam ([`DeviceCommunicator`]) and its NCCL implementation ([`NcclComm`]): the
//! collectives of a sharded CUDA forward over device buffers, issued on the caller's stream so that they sit
//! inside captured CUDA graphs like any kernel (NCCL's collectives are stream-ordered and capturable).
//!
//! Invariants:
//! - Nothing here calls into NCCL before [`library`] has loaded `libnccl.so.2` (the name NCCL ships, which the
//!   nvidia-nccl-cu13 wheel puts in `nvidia/nccl/lib`), falling back to `libnccl.so`. cudarc's own loader tries
//!   neither `.so.2` nor anything but a panic when it fails, so the symbols are loaded here with `libloading`;
//!   cudarc's `nccl` feature gives the C types (`ncclComm_t`, `ncclUniqueId`, the enums). A library that does not
//!   load is a [`KernelError::Device`] naming it and `LD_LIBRARY_PATH`, never a panic.
//! - Every collective is a group-wide call (every rank makes the same calls in the same order with the same
//!   counts, as `crate::comm` requires of the host seam). The results are identical on every rank (NCCL's
//!   all-reduce finishes with the reduced chunks broadcast, so every rank holds the same bits); the summation
//!   order is NCCL's (ring or tree chunks), not `crate::comm`'s rank order, so a sharded CUDA forward over `N > 1`
//!   ranks agrees with the CPU reference's `N` ranks only to the f32 rounding of the sums. Over one rank a
//!   collective is a copy (or nothing, in place), so a group of one computes exactly the unsharded bits.
//! - [`DeviceCommunicator::abort`] (`ncclCommAbort`) may be called from any thread, e.g. the launch contract's
//!   liveness thread when a peer goes away, while the engine thread waits on a collective that will never end:
//!   NCCL's abort is what ends it (NCCL's documented use of `ncclCommAbort`, and PyTorch's `ProcessGroupNCCL`
//!   watchdog, which this follows). After it, every call on this rank fails with the reason before touching NCCL.
//!   Dropping an [`NcclComm`] aborts it too (`ncclCommDestroy` may wait on peers; abort never does).
//! - [`NcclComm::init`] is `ncclCommInitRank`, which waits for every rank of the group; a peer that never comes is
//!   the launch contract's to detect (its rendezvous and heartbeat timeouts end the process), not this module's.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use libloading::Library;

use crate::cuda::launch::DPtr;
use crate::error::{KernelError, Result};

/// The library names tried, in order: the soname NCCL installs (and the nvidia-nccl wheels ship), then the
/// development link name.
pub const NCCL_LIBRARIES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];
/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// The element type of a collective's buffers: activations (bf16), partial sums and logits (f32), and bytes (a
/// step's plan broadcast from rank 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    Bf16,
    F32,
    U8,
}

impl Elem {
    fn nccl(self) -> ncclDataType_t {
        match self {
            Elem::Bf16 => ncclDataType_t::ncclBfloat16,
            Elem::F32 => ncclDataType_t::ncclFloat32,
            Elem::U8 => ncclDataType_t::ncclUint8,
        }
    }
}

/// `count` elements of type `elem` at device address `at`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBuf {
    pub at: DPtr,
    pub count: usize,
    pub elem: Elem,
}

/// One rank's handle on a group of GPUs: the collectives of the sharded CUDA forward, each enqueued on `stream`
/// (the caller's, so they order with its kernels and are captured with them). Buffers are the caller's and must
/// stay alive until the stream has run the collective.
pub trait DeviceCommunicator: Send + Sync {
    /// This rank, `0..world_size`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Sums `buf` over every rank in place (`ncclAllReduce`, sum).
    fn all_reduce_sum(&self, buf: DeviceBuf, stream: &CudaStream) -> Result<()>;

    /// Every rank's `send` (equal counts) concatenated in rank order into `recv` (`[world, send.count]`,
    /// `ncclAllGather`).
    fn all_gather(&self, send: DeviceBuf, recv: DPtr, stream: &CudaStream) -> Result<()>;

    /// Sums `send` (`[world, recv.count]`) over every rank and keeps chunk `rank` of the sum in `recv`
    /// (`ncclReduceScatter`, sum).
    fn reduce_scatter_sum(&self, send: DPtr, recv: DeviceBuf, stream: &CudaStream) -> Result<()>;

    /// Copies `root`'s `buf` into every rank's `buf` (`ncclBroadcast`, in place).
    fn broadcast(&self, root: usize, buf: DeviceBuf, stream: &CudaStream) -> Result<()>;

    /// Takes the group down (`ncclCommAbort`): a collective that waits on a peer ends, and every later call on
    /// this rank fails with `reason`.
    fn abort(&self, reason: &str);

    /// Whether the collectives can be captured into a CUDA graph with the kernels around them (NCCL's can).
    fn capturable(&self) -> bool {
        true
    }
}

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type CommAbort = unsafe extern "C" fn(ncclComm_t) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type GetLastError = unsafe extern "C" fn(ncclComm_t) -> *const c_char;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, cudaStream_t) -> c_int;
type ReduceScatter = AllReduce;
type Broadcast =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> c_int;

/// The NCCL entry points sparkd calls, loaded once per process.
struct Nccl {
    /// Where they were loaded from (one of [`NCCL_LIBRARIES`]).
    name: &'static str,
    get_version: GetVersion,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    comm_abort: CommAbort,
    comm_get_async_error: CommGetAsyncError,
    get_error_string: GetErrorString,
    get_last_error: GetLastError,
    all_reduce: AllReduce,
    all_gather: AllGather,
    reduce_scatter: ReduceScatter,
    broadcast: Broadcast,
    /// Keeps the symbols above valid for the process's life.
    _lib: Library,
}

/// Copies symbol `name` (NUL-terminated) out of `lib`.
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn symbol<T: Copy>(lib: &Library, lib_name: &str, name: &[u8]) -> std::result::Result<T, String> {
    // SAFETY: the caller names the symbol's signature.
    unsafe { lib.get::<T>(name) }.map(|s| *s).map_err(|e| {
        let shown = String::from_utf8_lossy(&name[..name.len() - 1]).into_owned();
        format!("{lib_name} has no symbol {shown} ({e}); sparkd needs NCCL 2.18 or later")
    })
}

impl Nccl {
    fn load() -> std::result::Result<Nccl, String> {
        let mut tried = Vec::new();
        for name in NCCL_LIBRARIES {
            // SAFETY: loading NCCL runs its library constructors, which only set up NCCL's own globals.
            let lib = match unsafe { Library::new(name) } {
                Ok(lib) => lib,
                Err(e) => {
                    tried.push(format!("{name}: {e}"));
                    continue;
                }
            };
            // SAFETY: each type above is the C signature of the symbol of the same name in nccl.h.
            return unsafe {
                Ok(Nccl {
                    name,
                    get_version: symbol(&lib, name, b"ncclGetVersion\0")?,
                    get_unique_id: symbol(&lib, name, b"ncclGetUniqueId\0")?,
                    comm_init_rank: symbol(&lib, name, b"ncclCommInitRank\0")?,
                    comm_abort: symbol(&lib, name, b"ncclCommAbort\0")?,
                    comm_get_async_error: symbol(&lib, name, b"ncclCommGetAsyncError\0")?,
                    get_error_string: symbol(&lib, name, b"ncclGetErrorString\0")?,
                    get_last_error: symbol(&lib, name, b"ncclGetLastError\0")?,
                    all_reduce: symbol(&lib, name, b"ncclAllReduce\0")?,
                    all_gather: symbol(&lib, name, b"ncclAllGather\0")?,
                    reduce_scatter: symbol(&lib, name, b"ncclReduceScatter\0")?,
                    broadcast: symbol(&lib, name, b"ncclBroadcast\0")?,
                    _lib: lib,
                })
            };
        }
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        Err(format!(
            "NCCL not found: {} could not be loaded (LD_LIBRARY_PATH={path:?}); install NCCL 2 for CUDA 13 (e.g. the \
             nvidia-nccl-cu13 wheel) and put the folder holding libnccl.so.2 (the wheel's nvidia/nccl/lib) on \
             LD_LIBRARY_PATH ({})",
            NCCL_LIBRARIES.join(" or "),
            tried.join("; ")
        ))
    }

    /// NCCL's message for `code`, with the last error's details when a communicator is at hand.
    fn describe(&self, code: c_int, comm: Option<ncclComm_t>) -> String {
        let text = |p: *const c_char| {
            // SAFETY: NCCL returns NUL-terminated static or per-communicator strings (or null).
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        // SAFETY: ncclGetErrorString takes any result code.
        let what = text(unsafe { (self.get_error_string)(code) }).unwrap_or_default();
        // SAFETY: ncclGetLastError reads the thread's (or the communicator's) last error message.
        let last = text(unsafe { (self.get_last_error)(comm.unwrap_or(std::ptr::null_mut())) }).unwrap_or_default();
        match last.is_empty() {
            true => format!("NCCL error {code}: {what}"),
            false => format!("NCCL error {code}: {what} ({last})"),
        }
    }

    fn check(&self, code: c_int, what: &str, comm: Option<ncclComm_t>) -> Result<()> {
        match code {
            0 => Ok(()),
            _ => Err(KernelError::Device(format!("{what}: {}", self.describe(code, comm)))),
        }
    }
}

/// NCCL, loaded on first use; the error says which library was looked for and where.
fn library() -> Result<&'static Nccl> {
    static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(Nccl::load).as_ref().map_err(|e| KernelError::Device(e.clone()))
}

/// True when NCCL can be loaded (never panics).
pub fn nccl_present() -> bool {
    library().is_ok()
}

/// The loaded NCCL's library name and version (`major, minor, patch`).
pub fn nccl_version() -> Result<(&'static str, (i32, i32, i32))> {
    let nccl = library()?;
    let mut v: c_int = 0;
    // SAFETY: ncclGetVersion writes one int.
    nccl.check(unsafe { (nccl.get_version)(&mut v) }, "ncclGetVersion", None)?;
    // NCCL_VERSION(X, Y, Z) is X * 10000 + Y * 100 + Z from 2.9 on.
    Ok((nccl.name, (v / 10000, v / 100 % 100, v % 100)))
}

/// A fresh group id (`ncclGetUniqueId`): drawn on rank 0 and handed to every rank by the launch contract. Its
/// bytes carry the address NCCL's bootstrap listens on, in this process, which must stay alive until every rank
/// has joined.
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    let nccl = library()?;
    let mut id = ncclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
    // SAFETY: ncclGetUniqueId fills the 128-byte id.
    nccl.check(unsafe { (nccl.get_unique_id)(&mut id) }, "ncclGetUniqueId", None)?;
    Ok(id.internal.map(|c| c as u8))
}

/// What [`NcclComm::init`] joins.
#[derive(Clone, Copy, Debug)]
pub struct NcclGroup<'a> {
    /// The group's id, from [`unique_id`] on rank 0 (the launch contract's `welcome` carries it).
    pub id: &'a [u8; UNIQUE_ID_BYTES],
    pub rank: usize,
    pub world: usize,
}

/// One rank of an NCCL group, on one GPU.
pub struct NcclComm {
    comm: ncclComm_t,
    rank: usize,
    world: usize,
    aborted: AtomicBool,
    /// Why the group went down, once it has.
    reason: Mutex<Option<String>>,
}

// SAFETY: an NCCL communicator may be used from any thread (one at a time for enqueues, which the engine thread
// owning the forward guarantees), and ncclCommAbort is meant to be called from another thread.
unsafe impl Send for NcclComm {}
// SAFETY: as above; the only `&self` mutation is the abort, guarded by `aborted` and `reason`.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins group `group` on `ctx`'s device (`ncclCommInitRank`; it returns once every rank has joined).
    pub fn init(ctx: &CudaContext, group: NcclGroup<'_>) -> Result<Self> {
        let NcclGroup { id, rank, world } = group;
        if world == 0 || rank >= world {
            return Err(KernelError::InvalidInput(format!("rank {rank} of an NCCL group of {world}")));
        }
        let nccl = library()?;
        ctx.bind_to_thread().map_err(|e| KernelError::Device(format!("binding the device for NCCL: {e}")))?;
        let id = ncclUniqueId { internal: id.map(|b| b as c_char) };
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` receives the communicator; the id is the group's, the rank within it.
        let code = unsafe { (nccl.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        nccl.check(code, &format!("ncclCommInitRank (rank {rank} of {world})"), None)?;
        Ok(NcclComm { comm, rank, world, aborted: AtomicBool::new(false), reason: Mutex::new(None) })
    }

    /// Fails when the group is down: aborted here, or an error NCCL met asynchronously (a peer that failed).
    pub fn health(&self) -> Result<()> {
        self.live()?;
        let nccl = library()?;
        let mut state: c_int = 0;
        // SAFETY: the communicator is live (not aborted); ncclCommGetAsyncError writes one result code.
        let code = unsafe { (nccl.comm_get_async_error)(self.comm, &mut state) };
        nccl.check(code, "ncclCommGetAsyncError", Some(self.comm))?;
        nccl.check(state, &format!("rank {}'s NCCL communicator", self.rank), Some(self.comm))
    }

    /// Checks the group end to end on a stream of its own on `ctx`: every rank contributes `rank + 1` to an f32
    /// all-reduce and must read back `world (world + 1) / 2` (exact in f32). A group-wide call.
    pub fn check_sum(&self, ctx: &Arc<CudaContext>) -> Result<()> {
        let err = |what: &str, e: cudarc::driver::DriverError| KernelError::Device(format!("{what}: {e}"));
        let stream = ctx.new_stream().map_err(|e| err("creating the NCCL check's stream", e))?;
        let buf = stream.clone_htod(&[(self.rank + 1) as f32]).map_err(|e| err("uploading the NCCL check", e))?;
        let at = buf.device_ptr(&stream).0;
        self.all_reduce_sum(DeviceBuf { at, count: 1, elem: Elem::F32 }, &stream)?;
        let mut sum = [0f32];
        stream.memcpy_dtoh(&buf, &mut sum).map_err(|e| err("reading the NCCL check back", e))?;
        stream.synchronize().map_err(|e| err("waiting for the NCCL check", e))?;
        let want = (self.world * (self.world + 1) / 2) as f32;
        match sum[0] == want {
            true => Ok(()),
            false => Err(KernelError::Device(format!(
                "the NCCL check on rank {} of {}: the all-reduce gave {} instead of {want}",
                self.rank, self.world, sum[0]
            ))),
        }
    }

    fn live(&self) -> Result<&'static Nccl> {
        if self.aborted.load(Ordering::Acquire) {
            let reason = self.reason.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default();
            return Err(KernelError::Device(format!("the NCCL group is down: {reason}")));
        }
        library()
    }

    /// Issues one collective on a live group; a failed enqueue is an error naming the call and the rank.
    fn issue(&self, what: &str, code: impl FnOnce(&Nccl) -> c_int) -> Result<()> {
        let nccl = self.live()?;
        nccl.check(code(nccl), &format!("{what} on rank {} of {}", self.rank, self.world), Some(self.comm))
    }
}

fn stream_of(stream: &CudaStream) -> cudaStream_t {
    stream.cu_stream() as cudaStream_t
}

impl DeviceCommunicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: DeviceBuf, stream: &CudaStream) -> Result<()> {
        let p = buf.at as *mut c_void;
        self.issue("ncclAllReduce", |n| {
            // SAFETY: `buf` is the caller's live device buffer of `count` elements; in place is allowed.
            unsafe {
                (n.all_reduce)(p, p, buf.count, buf.elem.nccl(), ncclRedOp_t::ncclSum, self.comm, stream_of(stream))
            }
        })
    }

    fn all_gather(&self, send: DeviceBuf, recv: DPtr, stream: &CudaStream) -> Result<()> {
        self.issue("ncclAllGather", |n| {
            // SAFETY: `send` holds `count` elements and `recv` `world * count`, both the caller's live buffers.
            unsafe {
                (n.all_gather)(
                    send.at as *const c_void,
                    recv as *mut c_void,
                    send.count,
                    send.elem.nccl(),
                    self.comm,
                    stream_of(stream),
                )
            }
        })
    }

    fn reduce_scatter_sum(&self, send: DPtr, recv: DeviceBuf, stream: &CudaStream) -> Result<()> {
        self.issue("ncclReduceScatter", |n| {
            // SAFETY: `send` holds `world * count` elements and `recv` `count`, both the caller's live buffers.
            unsafe {
                (n.reduce_scatter)(
                    send as *const c_void,
                    recv.at as *mut c_void,
                    recv.count,
                    recv.elem.nccl(),
                    ncclRedOp_t::ncclSum,
                    self.comm,
                    stream_of(stream),
                )
            }
        })
    }

    fn broadcast(&self, root: usize, buf: DeviceBuf, stream: &CudaStream) -> Result<()> {
        if root >= self.world {
            return Err(KernelError::InvalidInput(format!("broadcast root {root} outside a group of {}", self.world)));
        }
        let p = buf.at as *mut c_void;
        self.issue("ncclBroadcast", |n| {
            // SAFETY: `buf` is the caller's live device buffer of `count` elements; in place is allowed.
            unsafe { (n.broadcast)(p, p, buf.count, buf.elem.nccl(), root as c_int, self.comm, stream_of(stream)) }
        })
    }

    fn abort(&self, reason: &str) {
        if self.aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("rank {} aborted: {reason}", self.rank));
        if let Ok(nccl) = library() {
            // SAFETY: the communicator was live until the swap above, which only this call won.
            unsafe { (nccl.comm_abort)(self.comm) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.abort("the communicator was dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_nccl_is_an_error_naming_the_library_and_the_path() {
        if nccl_present() {
            eprintln!("SKIPPED: NCCL loads on this machine ({:?})", nccl_version());
            return;
        }
        let err = unique_id().unwrap_err();
        assert_eq!(err.kind(), "device");
        let text = err.to_string();
        assert!(text.contains("libnccl.so.2") && text.contains("LD_LIBRARY_PATH"), "{text}");
    }
}
