//! [`Gpu`]: one device ready to run kernels: its context, the main and side lanes (streams and the events that
//! fork and join them), stream-ordered memory, the launch and memory counters and the profiler's marks, and the
//! [`ModuleStore`] of every kernel compiled once. It knows no op: the op families (`rows`, `gemm`, `moe`,
//! `attn`, `sample`, `drafter`) look their kernels up in its store and launch them through [`Gpu::launcher`].
//!
//! Invariants:
//! - Event tracking is off and every launch, copy, allocation and GEMM goes to the current lane's stream
//!   in issue order, so buffers are passed to kernels as raw device addresses ([`DPtr`]) and are valid as
//!   long as their owning `CudaSlice` lives across the call (the callers own every buffer for a whole
//!   forward). The main lane is the backend's own stream (never the legacy default stream, which cannot
//!   be captured into a CUDA graph); [`Gpu::on_side`] issues a closure on the side lane, forked from the
//!   main stream through an event, and [`Gpu::join_side`] makes the main stream wait for it, so the two
//!   overlap on the device, eagerly and inside a graph capture alike ([`Gpu::mark_side`] and
//!   [`Gpu::wait_side_mark`] join the side ops issued up to the mark only). Work on the side lane reads only
//!   buffers allocated before the fork, and the main lane reads its results only after the (partial) join.
//! - Every kernel launch goes through [`Gpu::launcher`] (`cuda::launch`), with programmatic stream serialisation
//!   from Hopper on unless turned off ([`Gpu::dependent_launch`]).
//! - Memory comes from the device's stream-ordered pool, which keeps what is freed (see
//!   `keep_pool_memory`): steps reuse the same memory instead of mapping it afresh.
//! - Every launch and memory operation is counted ([`Gpu::issued`]); while a profile is recorded,
//!   [`Gpu::mark`] puts timed events on the stream, so spans of the forward are timed on the device.
//! - The GEMM choice ([`Gemm`]) is a setting of the device, not of the GEMM family alone: cuBLAS is bound to the
//!   main stream, so with [`Gemm::Cublas`] there is no side lane (`on_side` runs its work on the main lane).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};

use crate::cuda::device::{device_err, info, DeviceInfo};
use crate::cuda::launch::{DPtr, KernelLaunch};
use crate::cuda::staging::{Download, Staging};
use crate::cuda::store::ModuleStore;
use crate::error::{KernelError, Result};

/// Whether the environment leaves programmatic dependent launch on (`SPARKD_PDL` unset, or anything but `off`,
/// `0` or `false`).
fn dependent_launch_wanted() -> bool {
    std::env::var("SPARKD_PDL").map(|v| !matches!(v.trim(), "off" | "0" | "false")).unwrap_or(true)
}

/// Which GEMM the linear layers use (`cuda::gemm` implements both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Gemm {
    /// cuBLAS `GemmEx`: fastest, but its algorithm (and so the fp32 summation order) depends on the
    /// number of tokens in the batch.
    Cublas,
    /// The skinny tensor-core GEMM (`gemm_tc.cu`'s warpgroup MMA on Hopper, `gemm.cu`'s mma.sync elsewhere):
    /// each weight read once per 64 tokens, every output summed in a fixed order, so it is batch-invariant bit
    /// for bit: a seeded request gives the same tokens whatever is batched with it (the runner contract).
    BatchInvariant,
}

/// Stream operations issued, for benchmarks.
#[derive(Default)]
struct Counters {
    launches: AtomicU64,
    memory_ops: AtomicU64,
}

/// A recorded event of a profile.
struct Mark {
    label: &'static str,
    event: cudarc::driver::CudaEvent,
    launches: u64,
    memory_ops: u64,
}

/// The device time between two marks, attributed to the first one's label.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Span {
    pub label: &'static str,
    pub ms: f64,
    /// Kernel launches (cuBLAS calls count one each) in the span.
    pub launches: u64,
    /// Memsets of fresh buffers and device-to-device copies in the span.
    pub memory_ops: u64,
}

/// One GPU: context, lanes, memory, counters, profile and the compiled kernels (see the module invariants).
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    /// The main lane: the stream every op goes to unless [`Gpu::on_side`] says otherwise.
    pub stream: Arc<CudaStream>,
    /// The side lane, and the events that fork it from the main lane and join it back.
    side: Arc<CudaStream>,
    on_side: AtomicBool,
    fork_event: CudaEvent,
    join_event: CudaEvent,
    /// Where the side lane had been issued to at the last [`Gpu::mark_side`].
    side_mark_event: CudaEvent,
    /// Every kernel source, compiled once.
    store: ModuleStore,
    pub info: DeviceInfo,
    /// The device's streaming multiprocessors.
    pub sms: usize,
    pub gemm: Gemm,
    /// See [`Gpu::dependent_launch`].
    dependent_launch: bool,
    counters: Counters,
    profile: Mutex<Option<Vec<Mark>>>,
    /// Page-locked buffers for the copies that do not wait ([`Gpu::upload_async_at`], [`Gpu::download_async`]).
    staging: Arc<Staging>,
}

/// Keeps memory freed to the device's default pool (the stream-ordered allocator every `CudaSlice` uses) in
/// the pool instead of returning it to the driver at each synchronisation, the pool's default. Otherwise a step
/// that allocates what the previous step freed (a verify window's KDA snapshots: 38 MB per draft token on
/// k3-mini) maps fresh memory every time, which costs more than the step's kernels that fill it.
fn keep_pool_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: plain driver calls on the context's device; `threshold` outlives the call that reads it.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(|e| device_err("getting the device's memory pool", e))?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .map_err(|e| device_err("setting the memory pool's release threshold", e))
    }
}

impl Gpu {
    /// Opens device `ordinal` and compiles (or loads from the cache) every kernel source for its arch.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = crate::cuda::device::open(ordinal)?;
        // SAFETY: called before any allocation; the backend keeps to one stream (module invariants).
        unsafe { ctx.disable_event_tracking() };
        let info = info(&ctx)?;
        let store = ModuleStore::load(&ctx, &info)?;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| device_err("reading the SM count", e))? as usize;
        keep_pool_memory(&ctx)?;
        // The main lane at the device's highest stream priority, the side lane at its lowest: when both have
        // blocks waiting, the critical path (router, experts) gets the SMs first and the shared expert fills
        // in around it (the latent down projection, first on the side lane, runs beside the router, which
        // holds few SMs). Graph capture keeps each kernel's priority.
        ctx.bind_to_thread().map_err(|e| device_err("binding the context", e))?;
        let (lowest, highest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(|e| device_err("reading the stream priority range", e))?;
        let stream = ctx.new_stream_with_priority(highest).map_err(|e| device_err("creating the main stream", e))?;
        let side = ctx.new_stream_with_priority(lowest).map_err(|e| device_err("creating the side stream", e))?;
        let untimed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let fork_event = ctx.new_event(untimed).map_err(|e| device_err("creating an event", e))?;
        let join_event = ctx.new_event(untimed).map_err(|e| device_err("creating an event", e))?;
        let side_mark_event = ctx.new_event(untimed).map_err(|e| device_err("creating an event", e))?;
        let hopper = info.compute_capability.0 >= 9;
        Ok(Gpu {
            ctx,
            stream,
            side,
            on_side: AtomicBool::new(false),
            fork_event,
            join_event,
            side_mark_event,
            store,
            info,
            sms,
            gemm: Gemm::BatchInvariant,
            dependent_launch: hopper && dependent_launch_wanted(),
            counters: Counters::default(),
            profile: Mutex::new(None),
            staging: Arc::new(Staging::new()),
        })
    }

    /// Counts a launch made outside [`Gpu::launcher`] (a cuBLAS call).
    pub(crate) fn count_launch(&self) {
        self.counters.launches.fetch_add(1, Ordering::Relaxed);
    }

    fn count_memory_op(&self) {
        self.counters.memory_ops.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether ops go to the side lane now.
    pub(crate) fn on_side_lane(&self) -> bool {
        self.on_side.load(Ordering::Relaxed)
    }

    /// A launch of `func` on the current lane, dependent on the kernel before it when [`Gpu::dependent_launch`]
    /// is on: the one way every kernel of the backend is launched (see `cuda::launch`).
    pub fn launcher<'a>(&'a self, func: &'a CudaFunction) -> KernelLaunch<'a> {
        KernelLaunch::new(func, self.lane(), self.dependent_launch, &self.counters.launches)
    }

    /// The kernel `name` from the device's [`ModuleStore`].
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.store.function(name)
    }

    /// Whether the device has thread-block clusters, TMA and mbarriers (compute capability 9 and later): the
    /// cluster forms of the per-token kernels, the one-launch router and the head-group MLA kernel need them.
    pub fn hopper(&self) -> bool {
        self.info.compute_capability.0 >= 9
    }

    /// The stream of the side lane (where `on_side` work goes; see the module invariants).
    pub(crate) fn side_stream(&self) -> &Arc<CudaStream> {
        &self.side
    }

    /// Whether kernels are launched with programmatic dependent launch: every kernel may be scheduled while the one
    /// before it on its stream is still running, and waits for it inside (`grid_dependency_wait`), so a kernel's
    /// launch and its first weight loads overlap its predecessor's tail. On from Hopper on unless `SPARKD_PDL=off`.
    pub fn dependent_launch(&self) -> bool {
        self.dependent_launch
    }

    /// Turns programmatic dependent launch on or off for the launches that follow (it stays off before Hopper).
    /// Graphs captured before keep the setting they were captured with.
    pub fn set_dependent_launch(&mut self, on: bool) {
        self.dependent_launch = on && self.info.compute_capability.0 >= 9;
    }

    /// The stream of the current lane.
    pub(crate) fn lane(&self) -> &Arc<CudaStream> {
        if self.on_side_lane() {
            &self.side
        } else {
            &self.stream
        }
    }

    /// Issues `work` on the side lane: the side stream first waits for everything issued to the main
    /// stream so far, then runs `work`'s ops, overlapping main-lane ops issued after this call, until
    /// [`Gpu::join_side`]. cuBLAS is bound to the main stream, so with [`Gemm::Cublas`] `work` runs on
    /// the main lane.
    pub fn on_side<T>(&self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.gemm == Gemm::Cublas {
            return work();
        }
        if self.on_side.swap(true, Ordering::Relaxed) {
            return Err(KernelError::Device("the side lane is already in use".into()));
        }
        let forked = self
            .fork_event
            .record(&self.stream)
            .and_then(|_| self.side.wait(&self.fork_event))
            .map_err(|e| device_err("forking the side lane", e));
        let out = forked.and_then(|_| work());
        self.on_side.store(false, Ordering::Relaxed);
        out
    }

    /// Makes the main stream wait for every op issued on the side lane so far (a no-op when none is
    /// outstanding). Every [`Gpu::on_side`] is joined before its results are read and before a graph
    /// capture ends.
    pub fn join_side(&self) -> Result<()> {
        self.join_event
            .record(&self.side)
            .and_then(|_| self.stream.wait(&self.join_event))
            .map_err(|e| device_err("joining the side lane", e))
    }

    /// Records how far the side lane has been issued, for [`Gpu::wait_side_mark`]; side ops issued after this
    /// call are not covered by that wait. A no-op with [`Gemm::Cublas`] (no side lane).
    pub fn mark_side(&self) -> Result<()> {
        if self.gemm == Gemm::Cublas {
            return Ok(());
        }
        self.side_mark_event.record(&self.side).map_err(|e| device_err("marking the side lane", e))
    }

    /// Makes the main stream wait for the side ops issued before the last [`Gpu::mark_side`] (a partial join:
    /// the later side ops keep overlapping the main lane until [`Gpu::join_side`]).
    pub fn wait_side_mark(&self) -> Result<()> {
        if self.gemm == Gemm::Cublas {
            return Ok(());
        }
        self.stream.wait(&self.side_mark_event).map_err(|e| device_err("waiting for the side lane's mark", e))
    }

    /// `(kernel launches incl. cuBLAS calls, memsets + device copies)` issued so far.
    pub fn issued(&self) -> (u64, u64) {
        (self.counters.launches.load(Ordering::Relaxed), self.counters.memory_ops.load(Ordering::Relaxed))
    }

    /// Starts recording [`Gpu::mark`]s (timed events) until [`Gpu::finish_profile`].
    pub fn start_profile(&self) {
        if let Ok(mut p) = self.profile.lock() {
            *p = Some(Vec::new());
        }
    }

    /// Records a timed event labelled `label` on the stream while a profile is being recorded;
    /// the span up to the next mark is attributed to `label`.
    pub fn mark(&self, label: &'static str) -> Result<()> {
        let Ok(mut guard) = self.profile.lock() else { return Ok(()) };
        let Some(marks) = guard.as_mut() else { return Ok(()) };
        let event = self
            .stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| device_err("recording an event", e))?;
        let (launches, memory_ops) = self.issued();
        marks.push(Mark { label, event, launches, memory_ops });
        Ok(())
    }

    /// Whether a profile is being recorded.
    pub fn profiling(&self) -> bool {
        self.profile.lock().map(|p| p.is_some()).unwrap_or(false)
    }

    /// Stops recording and returns the spans between consecutive marks (waits for the device).
    pub fn finish_profile(&self) -> Result<Vec<Span>> {
        let marks = self.profile.lock().ok().and_then(|mut p| p.take()).unwrap_or_default();
        marks
            .windows(2)
            .map(|w| {
                let ms = w[0].event.elapsed_ms(&w[1].event).map_err(|e| device_err("reading an event", e))?;
                Ok(Span {
                    label: w[0].label,
                    ms: ms as f64,
                    launches: w[1].launches - w[0].launches,
                    memory_ops: w[1].memory_ops - w[0].memory_ops,
                })
            })
            .collect()
    }

    /// The device address of a slice.
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> DPtr {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    /// A zeroed device buffer of `n` elements (at least one, so that every buffer has an address).
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.count_memory_op();
        self.lane().alloc_zeros::<T>(n.max(1)).map_err(|e| device_err(&format!("allocating {n} elements"), e))
    }

    /// A device buffer of `n` elements (at least one) left uninitialised: only for outputs that a kernel writes
    /// in full before anything reads them (it saves the memset of [`Gpu::zeros`]).
    pub fn uninit<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: plain device memory; the caller's contract (above) keeps uninitialised values from being read.
        unsafe { self.lane().alloc::<T>(n.max(1)) }.map_err(|e| device_err(&format!("allocating {n} elements"), e))
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            // SAFETY: a one-element allocation that nothing reads.
            return unsafe { self.stream.alloc::<T>(1) }.map_err(|e| device_err("allocating", e));
        }
        self.stream.clone_htod(host).map_err(|e| device_err("host to device copy", e))
    }

    /// A device buffer of `T` holding little-endian `bytes` (a whole number of elements), copied
    /// without converting on the host.
    pub fn upload_bytes<T: DeviceRepr + ValidAsZeroBits>(&self, bytes: &[u8]) -> Result<CudaSlice<T>> {
        let size = std::mem::size_of::<T>();
        if bytes.len() % size != 0 {
            return Err(KernelError::InvalidInput(format!(
                "{} bytes are not a whole number of {size}-byte elements",
                bytes.len()
            )));
        }
        // SAFETY: every element is overwritten by the copy below before any use.
        let dst =
            unsafe { self.stream.alloc::<T>((bytes.len() / size).max(1)) }.map_err(|e| device_err("allocating", e))?;
        self.upload_bytes_at(self.ptr(&dst), bytes)?;
        Ok(dst)
    }

    /// Copies `bytes` to device address `dst` (which must have room for them), after everything issued
    /// before and before anything issued after, and returns once the copy is done. The copy goes to the
    /// main stream, not the legacy default one, which the backend's streams do not synchronise with.
    pub fn upload_bytes_at(&self, dst: DPtr, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.synchronize()?;
        // SAFETY: callers pass the address of a live buffer with room for `bytes`; the stream is
        // synchronised before returning, so `bytes` outlives the copy.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, bytes, self.stream.cu_stream()) }
            .map_err(|e| device_err("host to device copy", e))?;
        self.synchronize()
    }

    /// Copies `bytes` to device address `dst` (which must have room for them) in stream order on the main
    /// lane, without waiting: the bytes go through a page-locked buffer (`cuda::staging`).
    pub fn upload_async_at(&self, dst: DPtr, bytes: &[u8]) -> Result<()> {
        self.staging.upload(&self.ctx, &self.stream, dst, bytes)
    }

    /// Starts copying `n` elements from device address `src` to the host in stream order on the main lane;
    /// [`Download::wait`] waits for this copy alone and returns them.
    pub fn download_async<T: Copy + Default>(&self, src: DPtr, n: usize) -> Result<Download<T>> {
        self.staging.download(&self.ctx, &self.stream, src, n)
    }

    /// Copies `n` elements to device address `dst` in chunks of `chunk` elements, each written by `fill(offset,
    /// elements)` into page-locked memory while the device copies the one before (`cuda::staging`; a state import).
    pub fn upload_chunked<T: Copy>(
        &self,
        dst: DPtr,
        n: usize,
        chunk: usize,
        fill: impl FnMut(usize, &mut [T]),
    ) -> Result<()> {
        self.staging.upload_chunked(&self.ctx, &self.stream, dst, n, chunk, fill)
    }

    /// Copies `n` elements from device address `src` to the host in chunks of `chunk` elements, handing each to
    /// `take(offset, elements)` while the device copies the next (`cuda::staging`; a state export).
    pub fn download_chunked<T: Copy>(
        &self,
        src: DPtr,
        n: usize,
        chunk: usize,
        take: impl FnMut(usize, &[T]),
    ) -> Result<()> {
        self.staging.download_chunked(&self.ctx, &self.stream, src, n, chunk, take)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, s: &CudaSlice<T>, n: usize) -> Result<Vec<T>> {
        let mut out = vec![T::default(); n];
        if n > 0 {
            let view = s.try_slice(..n).ok_or_else(|| {
                KernelError::Device(format!("copy of {n} elements from a device buffer of {}", s.len()))
            })?;
            self.stream.memcpy_dtoh(&view, &mut out).map_err(|e| device_err("device to host copy", e))?;
        }
        Ok(out)
    }

    /// Copies `count` elements of `T` from `src` to `dst` (device to device, stream-ordered).
    pub fn copy<T>(&self, dst: DPtr, src: DPtr, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let bytes = count * std::mem::size_of::<T>();
        // SAFETY: callers pass addresses of live buffers with at least `count` elements each.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.lane().cu_stream()) }
            .map(|_| self.count_memory_op())
            .map_err(|e| device_err("device to device copy", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| device_err("synchronizing", e))
    }
}
