//! [`Gpu`]: one device, one stream, cuBLAS and the compiled kernels, with one method per op of the
//! K3 forward.
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
//! - Every kernel launch goes through [`Gpu::launcher`]. From Hopper on it carries programmatic stream
//!   serialisation ([`Gpu::dependent_launch`]): the next kernel's blocks may be scheduled while the one before is
//!   still running, so every kernel calls `grid_dependency_wait` (prelude.cuh) before it touches anything but
//!   weights, which keeps the stream order of every buffer read and write (a unit test checks every kernel source).
//! - Memory comes from the device's stream-ordered pool, which keeps what is freed (see
//!   `keep_pool_memory`): steps reuse the same memory instead of mapping it afresh.
//! - Shapes are checked by the callers (the weight loader and the forward); kernels trust them.
//! - Every launch and memory operation is counted ([`Gpu::issued`]); while a profile is recorded,
//!   [`Gpu::mark`] puts timed events on the stream, so spans of the forward are timed on the device.
//! - GEMMs have two implementations: cuBLAS (`cublasGemmEx`, bf16 in/out, fp32 accumulate) and the
//!   batch-invariant tensor-core GEMM, whose result for a token does not depend on the batch (see [`Gemm`]):
//!   on Hopper the warpgroup-MMA kernels of `gemm_tc.cu` ([`tc_split`]), elsewhere the mma.sync kernels of
//!   `gemm.cu` ([`skinny_split`]); either K split is a function of the weight's shape alone. Their launches
//!   live in `gemm_ops` and `gemm_tc`.
//! - The per-token kernels that reduce over a whole row (the fused AttnRes read + norm, the MoE combine +
//!   routed norm) spread a token over one block or, from Hopper on and for rows of 1024 and wider, over a
//!   cluster of `ROW_CLUSTER` blocks ([`Gpu::row_split`]); which form runs depends on the device and the
//!   row width alone, never on the batch.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, LaunchConfig,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::cuda::attn::AttnKernels;
use crate::cuda::compile::{Compiler, SOURCES};
use crate::cuda::device::{device_err, info, DeviceInfo};
pub use crate::cuda::gemm_ops::{skinny_split, SkinnyLayout};
pub use crate::cuda::gemm_tc::tc_split;
pub use crate::cuda::moe_ops::{moe_group_len, ExpertForm, RouteArgs};
use crate::error::{KernelError, Result};

/// A raw device address (valid while the slice it came from lives; see the module invariants).
pub type DPtr = u64;

/// A null device address, for optional kernel arguments.
pub const NULL: DPtr = 0;

/// Blocks per token of the cluster forms of the per-token kernels (`RES_CLUSTER` in `kernels/cuda/common.cu`,
/// `COMBINE_CLUSTER` in `kernels/cuda/moe_route.cu`).
pub(crate) const ROW_CLUSTER: u32 = 8;

/// The narrowest row the cluster forms take: 128 columns (one per thread) for each of the `ROW_CLUSTER` blocks.
const CLUSTER_MIN_WIDTH: usize = 128 * ROW_CLUSTER as usize;

/// The largest dynamic shared memory of `attn_res_norm_cluster`: 64 sources of a 1536-column window (d = 12288 over
/// `ROW_CLUSTER` blocks) in bf16.
const RES_STAGED_MAX_BYTES: usize = 64 * res_span(12_288) * 2;

/// The window of each block of `attn_res_norm_cluster` (`res_span` in `kernels/cuda/common.cu`): a multiple of 8
/// columns, `ROW_CLUSTER` of them cover `d`.
const fn res_span(d: usize) -> usize {
    d.div_ceil(ROW_CLUSTER as usize).div_ceil(8) * 8
}

/// Whether `attn_res_norm_cluster` can take rows of width `d` whose sources lie `slot` elements apart: it moves
/// them in 16-byte chunks.
const fn res_cluster_takes(d: usize, slot: usize) -> bool {
    d % 8 == 0 && slot % 8 == 0
}

/// How a per-token kernel (the fused AttnRes read + norm, the MoE combine + routed norm) spreads one token's row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowSplit {
    /// One block per token.
    OneBlock,
    /// A cluster of `ROW_CLUSTER` blocks per token, each over one contiguous window of the columns (Hopper and
    /// later); the row's sums meet through distributed shared memory in rank order.
    Cluster,
}

/// Whether the environment leaves programmatic dependent launch on (`SPARKD_PDL` unset, or anything but `off`,
/// `0` or `false`).
fn dependent_launch_wanted() -> bool {
    std::env::var("SPARKD_PDL").map(|v| !matches!(v.trim(), "off" | "0" | "false")).unwrap_or(true)
}

/// The error for a cluster form asked of a device without thread-block clusters.
pub(crate) fn no_clusters() -> KernelError {
    KernelError::InvalidInput(
        "the cluster form of a per-token kernel needs thread-block clusters (Hopper or later)".into(),
    )
}

/// The launch of a cluster form over `n` tokens with `shared_floats` floats of dynamic shared memory per block:
/// grid (`ROW_CLUSTER`, n), 128 threads per block (the kernels' `__launch_bounds__(128)`).
pub(crate) fn row_cluster_launch(n: usize, shared_floats: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (ROW_CLUSTER, n as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: (shared_floats * 4) as u32,
    }
}

/// Which GEMM the linear layers use.
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

pub(crate) struct Kernels {
    pub(crate) embed_gather: CudaFunction,
    pub(crate) rms_norm: CudaFunction,
    pub(crate) attn_res_read: CudaFunction,
    pub(crate) attn_res_norm: CudaFunction,
    /// `attn_res_norm` over a cluster of blocks per token: present from Hopper on.
    pub(crate) attn_res_norm_cluster: Option<CudaFunction>,
    pub(crate) add_in_place: CudaFunction,
    pub(crate) situ: CudaFunction,
    pub(crate) gather_rows: CudaFunction,
    /// `skinny_gemm_t{1,2,4,8}`: token chunks of up to 8, 16, 32, 64 tokens, one block per K slice.
    pub(crate) skinny_gemm: [CudaFunction; 4],
    /// `skinny_gemm_serial_t{1,2,4,8}`: the same sums, one block running every K slice of its rows.
    pub(crate) skinny_gemm_serial: [CudaFunction; 4],
    /// `skinny_gemm_wide_t{4,8}`: split launches of up to 32 and 64 tokens with two 16-row tiles per warp.
    pub(crate) skinny_gemm_wide: [CudaFunction; 2],
    /// `skinny_wgmma{,_serial}_t{8,16,32,64}` (gemm_tc.cu): the batch-invariant GEMM on Hopper, `None` elsewhere.
    pub(crate) skinny_wgmma: Option<crate::cuda::gemm_tc::TcKernels>,
    /// `moe_router_logits`, then its form for batches (`moe_router_logits_tiled`: several tokens per warp).
    pub(crate) moe_router_logits: [CudaFunction; 2],
    pub(crate) moe_route: CudaFunction,
    /// `moe_router` and `moe_router_tiled` (both in one launch, thread-block clusters): present from Hopper on.
    pub(crate) moe_router: Option<[CudaFunction; 2]>,
    pub(crate) moe_group: CudaFunction,
    pub(crate) moe_gate_up: CudaFunction,
    /// The grouped down projection: `[0]` any width, `[1]` widths whose steps are all full (no masks).
    pub(crate) moe_down: [CudaFunction; 2],
    pub(crate) moe_gate_up_staged: CudaFunction,
    pub(crate) moe_down_staged: CudaFunction,
    pub(crate) moe_combine_norm: CudaFunction,
    /// `moe_combine_norm` over a cluster of blocks per token: present from Hopper on.
    pub(crate) moe_combine_norm_cluster: Option<CudaFunction>,
    pub(crate) sample_rows: CudaFunction,
    pub(crate) sample_rows_f32: CudaFunction,
    pub(crate) rng_hash3: CudaFunction,
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

/// One GPU ready to run the K3 ops.
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
    pub(crate) blas: CudaBlas,
    /// The skinny GEMM's tickets of the main and the side lane (all zeros between launches; see `gemm.cu`).
    pub(crate) gemm_tickets: [CudaSlice<u32>; 2],
    /// Blocks of each split skinny GEMM entry point the device holds at once, at 4 and 8 warps per block.
    pub(crate) skinny_slots: crate::cuda::gemm_ops::SkinnySlots,
    pub(crate) k: Kernels,
    pub(crate) attn: AttnKernels,
    pub info: DeviceInfo,
    pub gemm: Gemm,
    /// See [`Gpu::dependent_launch`].
    dependent_launch: bool,
    counters: Counters,
    profile: Mutex<Option<Vec<Mark>>>,
}

/// A kernel launch being built on one lane: the function and the addresses of its arguments, in order. Every
/// kernel of the backend goes through it, so that from Hopper on each is launched with programmatic stream
/// serialisation (see the module invariants and `grid_dependency_wait` in `prelude.cuh`).
pub(crate) struct KernelLaunch<'a> {
    func: &'a CudaFunction,
    stream: &'a CudaStream,
    dependent: bool,
    /// Blocks per cluster along x (1: no clusters); must divide the grid's x.
    cluster_x: u32,
    args: Vec<*mut std::ffi::c_void>,
}

impl<'a> KernelLaunch<'a> {
    /// Appends the next argument (passed to the kernel by value; `value` must outlive the launch call).
    pub(crate) fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut std::ffi::c_void);
        self
    }

    /// Launches the grid as clusters of `blocks` consecutive blocks along x (Hopper and later).
    pub(crate) fn cluster_x(&mut self, blocks: u32) -> &mut Self {
        self.cluster_x = blocks;
        self
    }

    /// Submits the kernel to the lane's stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every address among them
    /// must be a live buffer of the size the kernel reads or writes; a dependent launch needs a kernel that calls
    /// `grid_dependency_wait` before it touches anything but weights (every kernel in `kernels/cuda` does).
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> std::result::Result<(), DriverError> {
        use cudarc::driver::sys;
        self.stream.context().bind_to_thread()?;
        // The launch's attributes, the first `count` of them set (no allocation: this runs for every kernel).
        let serialization = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let cluster = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: self.cluster_x, y: 1, z: 1 },
            },
        };
        let mut attrs = [serialization, cluster];
        let mut count = 0;
        for (wanted, attr) in [(self.dependent, serialization), (self.cluster_x > 1, cluster)] {
            if wanted {
                attrs[count] = attr;
                count += 1;
            }
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if count == 0 { std::ptr::null_mut() } else { attrs.as_mut_ptr() },
            numAttrs: count as u32,
        };
        // SAFETY: `config` and `attrs` live across the call; the argument addresses are the caller's contract.
        unsafe { sys::cuLaunchKernelEx(&config, self.func.cu_function(), self.args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
    }
}

pub(crate) fn launch_err(name: &str) -> impl Fn(cudarc::driver::DriverError) -> KernelError + '_ {
    move |e| device_err(&format!("launching {name}"), e)
}

/// The element type of the logits rows [`Gpu::sample_rows`] reads: the target's bf16 logits, or the DSpark
/// drafter's f32 Markov logits (never rounded to bf16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsDtype {
    Bf16,
    F32,
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

fn grid_1d(n: usize, block: u32) -> LaunchConfig {
    let blocks = n.div_ceil(block as usize).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads from the cache) every kernel for its arch.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = crate::cuda::device::open(ordinal)?;
        // SAFETY: called before any allocation; the backend keeps to one stream (module invariants).
        unsafe { ctx.disable_event_tracking() };
        let info = info(&ctx)?;
        let compiler = Compiler {
            arch: info.arch(),
            include_dir: crate::cuda::compile::default_include_dir(),
            cache_dir: crate::cuda::compile::default_cache_dir(),
        };
        let mut modules = std::collections::HashMap::new();
        for src in SOURCES {
            let cubin = compiler.cubin(src)?;
            let m = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(|e| device_err(&format!("loading {}", src.name), e))?;
            modules.insert(src.name, m);
        }
        let module =
            |name: &str| modules.get(name).ok_or_else(|| KernelError::Device(format!("no kernel source {name}")));
        let f = |src: &str, name: &str| {
            module(src)?.load_function(name).map_err(|e| device_err(&format!("kernel {name} of {src}"), e))
        };
        // Thread-block clusters (the one-launch router, the cluster forms of the per-token norms) from Hopper on.
        let hopper = info.compute_capability.0 >= 9;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| device_err("reading the SM count", e))? as usize;
        let k = Kernels {
            embed_gather: f("common.cu", "embed_gather")?,
            rms_norm: f("common.cu", "rms_norm")?,
            attn_res_read: f("common.cu", "attn_res_read")?,
            attn_res_norm: f("common.cu", "attn_res_norm")?,
            attn_res_norm_cluster: hopper.then(|| f("common.cu", "attn_res_norm_cluster")).transpose()?,
            add_in_place: f("common.cu", "add_in_place")?,
            situ: f("common.cu", "situ")?,
            gather_rows: f("common.cu", "gather_rows")?,
            moe_router_logits: [f("moe_route.cu", "moe_router_logits")?, f("moe_route.cu", "moe_router_logits_tiled")?],
            moe_route: f("moe_route.cu", "moe_route")?,
            moe_router: hopper
                .then(|| {
                    Ok::<_, KernelError>([f("moe_route.cu", "moe_router")?, f("moe_route.cu", "moe_router_tiled")?])
                })
                .transpose()?,
            moe_group: f("moe_route.cu", "moe_group")?,
            moe_gate_up: f("moe.cu", "moe_gate_up")?,
            moe_down: [f("moe.cu", "moe_down")?, f("moe.cu", "moe_down_full")?],
            moe_gate_up_staged: f("moe.cu", "moe_gate_up_staged")?,
            moe_down_staged: f("moe.cu", "moe_down_staged")?,
            moe_combine_norm: f("moe_route.cu", "moe_combine_norm")?,
            moe_combine_norm_cluster: hopper.then(|| f("moe_route.cu", "moe_combine_norm_cluster")).transpose()?,
            sample_rows: f("sample.cu", "sample_rows")?,
            sample_rows_f32: f("sample.cu", "sample_rows_f32")?,
            rng_hash3: f("sample.cu", "rng_hash3")?,
            skinny_gemm: [
                f("gemm.cu", "skinny_gemm_t1")?,
                f("gemm.cu", "skinny_gemm_t2")?,
                f("gemm.cu", "skinny_gemm_t4")?,
                f("gemm.cu", "skinny_gemm_t8")?,
            ],
            skinny_gemm_wide: [f("gemm.cu", "skinny_gemm_wide_t4")?, f("gemm.cu", "skinny_gemm_wide_t8")?],
            skinny_wgmma: crate::cuda::gemm_tc::load_tc_kernels(module("gemm_tc.cu")?, info.compute_capability.0, sms)?,
            skinny_gemm_serial: [
                f("gemm.cu", "skinny_gemm_serial_t1")?,
                f("gemm.cu", "skinny_gemm_serial_t2")?,
                f("gemm.cu", "skinny_gemm_serial_t4")?,
                f("gemm.cu", "skinny_gemm_serial_t8")?,
            ],
        };
        crate::cuda::gemm_ops::allow_skinny_shared_memory(&k)?;
        crate::cuda::moe_ops::allow_expert_shared_memory(&k)?;
        if let Some(kernel) = &k.attn_res_norm_cluster {
            kernel
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    RES_STAGED_MAX_BYTES as i32,
                )
                .map_err(|e| device_err("allowing attn_res_norm_cluster its shared memory", e))?;
        }
        let skinny_slots = crate::cuda::gemm_ops::skinny_slots(sms, &k)?;
        let attn = AttnKernels::load(module("kda.cu")?, module("mla.cu")?, hopper)?;
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
        let blas = CudaBlas::new(stream.clone()).map_err(|e| device_err("creating the cuBLAS handle", e))?;
        let gemm_tickets = [crate::cuda::gemm_ops::new_tickets(&stream)?, crate::cuda::gemm_ops::new_tickets(&side)?];
        Ok(Gpu {
            ctx,
            stream,
            side,
            on_side: AtomicBool::new(false),
            fork_event,
            join_event,
            side_mark_event,
            blas,
            gemm_tickets,
            skinny_slots,
            k,
            attn,
            info,
            gemm: Gemm::BatchInvariant,
            dependent_launch: hopper && dependent_launch_wanted(),
            counters: Counters::default(),
            profile: Mutex::new(None),
        })
    }

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
    /// is on.
    pub(crate) fn launcher<'a>(&'a self, func: &'a CudaFunction) -> KernelLaunch<'a> {
        KernelLaunch {
            func,
            stream: self.lane(),
            dependent: self.dependent_launch,
            cluster_x: 1,
            args: Vec::with_capacity(16),
        }
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

    /// `out[i] = table[tokens[i]]`, `[n, d]`.
    pub fn embed(&self, table: DPtr, tokens: DPtr, out: DPtr, n: usize, d: usize) -> Result<()> {
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let d = d as i32;
        let mut b = self.launcher(&self.k.embed_gather);
        b.arg(&table).arg(&tokens).arg(&out).arg(&d);
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err("embed_gather"))
    }

    /// RMSNorm of `rows` rows of `dim` (strides in elements), rounded to bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: DPtr,
        x_stride: usize,
        w: DPtr,
        y: DPtr,
        y_stride: usize,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (xs, ys, dim) = (x_stride as i64, y_stride as i64, dim as i32);
        let mut b = self.launcher(&self.k.rms_norm);
        b.arg(&x).arg(&xs).arg(&w).arg(&y).arg(&ys).arg(&dim).arg(&eps);
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err("rms_norm"))
    }

    /// The AttnRes read over `nsrc` slots of `[n, d]` at stride `slot` elements.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_res_read(
        &self,
        sources: DPtr,
        slot: usize,
        nsrc: usize,
        q: DPtr,
        out: DPtr,
        n: usize,
        d: usize,
        eps: f32,
    ) -> Result<()> {
        if nsrc == 0 || nsrc > 64 {
            return Err(KernelError::InvalidInput(format!("AttnRes read over {nsrc} sources (1..=64 supported)")));
        }
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (slot, nsrc, d) = (slot as i64, nsrc as i32, d as i32);
        let mut b = self.launcher(&self.k.attn_res_read);
        b.arg(&sources).arg(&slot).arg(&nsrc).arg(&q).arg(&out).arg(&d).arg(&eps);
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err("attn_res_read"))
    }

    /// The residual add, AttnRes read and RMSNorm fused (`attn_res_norm` in common.cu): when `addend`
    /// is not [`NULL`], the live slot (the last of `nsrc`) first becomes `bf(live + addend)`; then
    /// `out = rms_norm(read)`, `[n, d]`, and, when `read_out` is not [`NULL`], `read_out = read` `[n, d]`.
    /// Each token's row is spread as [`Gpu::row_split`] says, over one block when the cluster form cannot take
    /// the row (`d` or `slot` not a multiple of 8).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_res_norm(
        &self,
        sources: DPtr,
        slot: usize,
        nsrc: usize,
        q: DPtr,
        addend: DPtr,
        norm: (DPtr, f32),
        out: DPtr,
        read_out: DPtr,
        n: usize,
        d: usize,
        eps: f32,
    ) -> Result<()> {
        let split = match self.row_split(d) {
            RowSplit::Cluster if res_cluster_takes(d, slot) => RowSplit::Cluster,
            _ => RowSplit::OneBlock,
        };
        self.attn_res_norm_as(split, sources, slot, nsrc, q, addend, norm, out, read_out, n, d, eps)
    }

    /// [`Gpu::attn_res_norm`] spread as `split` says (for the equivalence checks of both forms). The one-block
    /// form is bit-identical to [`Gpu::add`], [`Gpu::attn_res_read`] and [`Gpu::rms_norm`] in sequence; the
    /// cluster form sums in another fixed order (the two differ by rounding), and moves the row in 16-byte chunks, so
    /// it takes `d` and `slot` that are multiples of 8.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_res_norm_as(
        &self,
        split: RowSplit,
        sources: DPtr,
        slot: usize,
        nsrc: usize,
        q: DPtr,
        addend: DPtr,
        norm: (DPtr, f32),
        out: DPtr,
        read_out: DPtr,
        n: usize,
        d: usize,
        eps: f32,
    ) -> Result<()> {
        if nsrc == 0 || nsrc > 64 {
            return Err(KernelError::InvalidInput(format!("AttnRes read over {nsrc} sources (1..=64 supported)")));
        }
        if d > 12_288 {
            return Err(KernelError::InvalidInput(format!("fused AttnRes read + norm of width {d} (at most 12288)")));
        }
        let (kernel, cfg) = match split {
            RowSplit::Cluster => {
                if !res_cluster_takes(d, slot) {
                    return Err(KernelError::InvalidInput(format!(
                        "the cluster form of the AttnRes read + norm moves 16-byte chunks: width {d} and source \
                         stride {slot} must be multiples of 8"
                    )));
                }
                let staged_floats = nsrc * res_span(d) / 2; // nsrc windows of bf16
                (self.k.attn_res_norm_cluster.as_ref().ok_or_else(no_clusters)?, row_cluster_launch(n, staged_floats))
            }
            RowSplit::OneBlock => (
                &self.k.attn_res_norm,
                LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: (d * 4) as u32 },
            ),
        };
        let (slot, nsrc, d) = (slot as i64, nsrc as i32, d as i32);
        let mut b = self.launcher(kernel);
        b.arg(&sources)
            .arg(&slot)
            .arg(&nsrc)
            .arg(&q)
            .arg(&addend)
            .arg(&norm.0)
            .arg(&norm.1)
            .arg(&out)
            .arg(&read_out)
            .arg(&d)
            .arg(&eps);
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err("attn_res_norm"))
    }

    /// The row splits this device has: the cluster form from Hopper on, the one-block form always.
    pub fn row_splits(&self) -> Vec<RowSplit> {
        let cluster = self.k.attn_res_norm_cluster.is_some().then_some(RowSplit::Cluster);
        cluster.into_iter().chain([RowSplit::OneBlock]).collect()
    }

    /// How a per-token kernel over rows of `width` spreads each token: a cluster of blocks (Hopper and later)
    /// once every block of it gets at least one column per thread (`CLUSTER_MIN_WIDTH`), else one block.
    pub fn row_split(&self, width: usize) -> RowSplit {
        if self.k.attn_res_norm_cluster.is_some() && width >= CLUSTER_MIN_WIDTH {
            RowSplit::Cluster
        } else {
            RowSplit::OneBlock
        }
    }

    /// `a = bf(a + b)` over `len` elements.
    pub fn add(&self, a: DPtr, b_: DPtr, len: usize) -> Result<()> {
        let n = len as i64;
        let mut b = self.launcher(&self.k.add_in_place);
        b.arg(&a).arg(&b_).arg(&n);
        unsafe { b.launch(grid_1d(len, 256)) }.map(|_| self.count_launch()).map_err(launch_err("add_in_place"))
    }

    pub fn situ(&self, g: DPtr, u: DPtr, out: DPtr, len: usize, beta: f32, lbeta: f32) -> Result<()> {
        let n = len as i64;
        let mut b = self.launcher(&self.k.situ);
        b.arg(&g).arg(&u).arg(&out).arg(&n).arg(&beta).arg(&lbeta);
        unsafe { b.launch(grid_1d(len, 256)) }.map(|_| self.count_launch()).map_err(launch_err("situ"))
    }

    /// `out[s, j] = src[s, rows[j]]` for `slots` slots of rows of `d`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(
        &self,
        src: DPtr,
        src_slot: usize,
        rows: DPtr,
        nrows: usize,
        out: DPtr,
        out_slot: usize,
        slots: usize,
        d: usize,
    ) -> Result<()> {
        let cfg =
            LaunchConfig { grid_dim: (nrows as u32, slots as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (ss, os, d) = (src_slot as i64, out_slot as i64, d as i32);
        let mut b = self.launcher(&self.k.gather_rows);
        b.arg(&src).arg(&ss).arg(&rows).arg(&out).arg(&os).arg(&d);
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err("gather_rows"))
    }

    /// Sampling, log-probabilities and acceptance of `rows` logits rows described by `desc` (see
    /// `cuda::sample`), whose logits are `dtype` (`sample_rows` or `sample_rows_f32`): one block of 1024
    /// threads per row.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_rows(
        &self,
        dtype: LogitsDtype,
        desc: DPtr,
        mask: DPtr,
        vocab: usize,
        rows: usize,
        status: DPtr,
        top: DPtr,
    ) -> Result<()> {
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let v = vocab as i32;
        let (func, name) = match dtype {
            LogitsDtype::Bf16 => (&self.k.sample_rows, "sample_rows"),
            LogitsDtype::F32 => (&self.k.sample_rows_f32, "sample_rows_f32"),
        };
        let mut b = self.launcher(func);
        b.arg(&desc).arg(&mask).arg(&v).arg(&status).arg(&top);
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err(name))
    }

    /// `out[i] = hash3(seeds[i], positions[i], streams[i])` (u64) on the device, for `n` triples.
    pub fn rng_hash3(&self, seeds: DPtr, positions: DPtr, streams: DPtr, out: DPtr, n: usize) -> Result<()> {
        let ni = n as i32;
        let mut b = self.launcher(&self.k.rng_hash3);
        b.arg(&seeds).arg(&positions).arg(&streams).arg(&out).arg(&ni);
        unsafe { b.launch(grid_1d(n, 256)) }.map(|_| self.count_launch()).map_err(launch_err("rng_hash3"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::compile::source_define;

    #[test]
    fn the_attn_res_cluster_constants_match_common_cu() {
        // A launch with another cluster size or a window wider than the kernel's threads cover would leave columns
        // of the row unread.
        assert_eq!(ROW_CLUSTER, source_define("common.cu", "RES_CLUSTER"));
        let covered = 8 * 128 * source_define("common.cu", "RES_CHUNKS") as usize; // 8 columns per chunk, 128 threads
        assert!(res_span(12_288) <= covered, "the widest row's window {} > {covered}", res_span(12_288));
        assert!(res_cluster_takes(7168, 9 * 7168) && !res_cluster_takes(1004, 1004) && !res_cluster_takes(1000, 1004));
    }
}
