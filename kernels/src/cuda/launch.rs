//! The one way a kernel is launched ([`KernelLaunch`], built by `Gpu::launcher`), and the raw device
//! addresses ([`DPtr`]) kernels take.
//!
//! Invariants:
//! - Every kernel of the backend goes through [`KernelLaunch::launch`]: from Hopper on it carries programmatic
//!   stream serialisation (the next kernel's blocks may be scheduled while the one before is still running), so
//!   every kernel calls `grid_dependency_wait` (prelude.cuh) before it touches anything but weights, which keeps
//!   the stream order of every buffer read and write (a unit test of `compile` checks every kernel source).
//! - A launch is counted (for `Gpu::issued`) exactly when the driver accepted it; a refused launch is a
//!   [`KernelError::Device`] naming the kernel.
//! - Nothing here allocates per launch beyond the argument list: this runs for every kernel.

use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, DriverError, LaunchConfig};

use crate::cuda::device::device_err;
use crate::error::{KernelError, Result};

/// A raw device address (valid while the slice it came from lives; see `cuda::gpu`).
pub type DPtr = u64;

/// A null device address, for optional kernel arguments.
pub const NULL: DPtr = 0;

/// A kernel launch being built on one lane: the function and the addresses of its arguments, in order.
pub struct KernelLaunch<'a> {
    func: &'a CudaFunction,
    stream: &'a CudaStream,
    dependent: bool,
    /// Blocks per cluster along x (1: no clusters); must divide the grid's x.
    cluster_x: u32,
    args: Vec<*mut std::ffi::c_void>,
    /// The device's launch counter, bumped when the launch is accepted.
    launches: &'a AtomicU64,
}

impl<'a> KernelLaunch<'a> {
    /// A launch of `func` on `stream`, with programmatic dependent launch when `dependent` is set, counted in
    /// `launches`.
    pub(crate) fn new(
        func: &'a CudaFunction,
        stream: &'a CudaStream,
        dependent: bool,
        launches: &'a AtomicU64,
    ) -> Self {
        KernelLaunch { func, stream, dependent, cluster_x: 1, args: Vec::with_capacity(16), launches }
    }

    /// Appends the next argument (passed to the kernel by value; `value` must outlive the launch call).
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut std::ffi::c_void);
        self
    }

    /// Launches the grid as clusters of `blocks` consecutive blocks along x (Hopper and later).
    pub fn cluster_x(&mut self, blocks: u32) -> &mut Self {
        self.cluster_x = blocks;
        self
    }

    /// Submits the kernel `name` (for errors) to the lane's stream and counts it.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every address among them
    /// must be a live buffer of the size the kernel reads or writes; a dependent launch needs a kernel that calls
    /// `grid_dependency_wait` before it touches anything but weights (every kernel in `kernels/cuda` does).
    pub unsafe fn launch(&mut self, cfg: LaunchConfig, name: &str) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit(cfg) }.map_err(launch_err(name))?;
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// # Safety
    /// As [`KernelLaunch::launch`].
    unsafe fn submit(&mut self, cfg: LaunchConfig) -> std::result::Result<(), DriverError> {
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

/// The error of a refused launch of kernel `name`.
pub(crate) fn launch_err(name: &str) -> impl Fn(DriverError) -> KernelError + '_ {
    move |e| device_err(&format!("launching {name}"), e)
}

/// A one-dimensional grid of `block`-thread blocks over `n` elements (at least one block, at most 65,535).
pub(crate) fn grid_1d(n: usize, block: u32) -> LaunchConfig {
    let blocks = n.div_ceil(block as usize).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

/// Raises `func`'s dynamic shared memory limit to `bytes` (the kernel `name`, for errors).
pub(crate) fn allow_shared_memory(func: &CudaFunction, bytes: usize, name: &str) -> Result<()> {
    func.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(|e| device_err(&format!("allowing {name} its shared memory"), e))
}
