//! The skinny GEMM on Hopper's warpgroup MMA and copy engine (`kernels/cuda/gemm_tc.cu`): the batch-invariant
//! linear layers on sm_90 (`GemmKernels::tc_gemm_takes`), where it streams the weights at 32 to 64 tokens as fast as at
//! one (the mma.sync kernels of `gemm.cu` run everywhere else).
//!
//! Invariants:
//! - The summation order is fixed by the K slice width, which [`tc_split`] derives from the weight's shape alone;
//!   the token chunk (`NT` = 8, 16, 32 or 64) and the form (split or serial) follow the call and never change a
//!   bit of a token's result (the H200's wgmma gives a token the same bits for every N; cuda_gemm checks calls of
//!   1 to 512 tokens against each other).
//! - Whether a call takes this path depends on the device and on the operands' alignment and K alone, never on
//!   the token count: a weight's calls all take the same path, so its tokens' bits never depend on the batch.
//! - A call's tensor maps are encoded on the host (no device work) and passed by value; nothing outlives the
//!   launch. A split launch of more than one slice runs each row tile's slices as one thread-block cluster that
//!   folds them in distributed shared memory: it needs no workspace and no tickets.

use cudarc::driver::{sys, CudaFunction, DeviceRepr, LaunchConfig};

use crate::cuda::gpu::Gpu;
use crate::cuda::launch::{allow_shared_memory, DPtr, NULL};
use crate::error::{KernelError, Result};

/// One batch-invariant GEMM call: `y[n, out] (+ addend) = bf(x[n, in] · w[out, in]ᵀ)`, the add epilogue when
/// `addend` is not [`NULL`] (bf(bf(x · wᵀ) + addend), `addend` laid out as `y` and possibly `y` itself), row-major
/// output or segment-major for `parts` (bounds on the device, and their count). When `partial` is not [`NULL`] the
/// call writes its fp32 sums there unrounded, laid out as `y` (which it then leaves alone; gemm.cu's partial epilogue).
#[derive(Clone, Copy)]
pub(crate) struct GemmCall {
    pub w: DPtr,
    pub out_dim: usize,
    pub in_dim: usize,
    pub x: DPtr,
    pub n: usize,
    pub y: DPtr,
    pub addend: DPtr,
    pub partial: DPtr,
    pub parts: Option<(DPtr, usize)>,
}

/// Weight rows per block (`TC_ROWS`: two m64 tiles).
const TC_ROWS: usize = 128;
/// K columns per stage (`TC_K`).
const TC_K: usize = 64;
/// Token chunk sizes of the entry points (`skinny_wgmma_t{8,16,32,64}`).
const TC_TOKENS: [usize; 4] = [8, 16, 32, 64];
/// The SMs of an H200, by which [`tc_split`] measures a weight: a weight of more than half as many row tiles is
/// not split (the MLA merged input projection, 113 row tiles, streams 4.0 TB/s at one token in one slice and 3.8
/// in two; the shared expert's gate/up, 96, 3.9 and 3.4), and the others are cut into at most two blocks per SM
/// (the o_proj at one token streams 3.9 TB/s in 224 blocks against 3.8 in 112, the MoE latent down 3.5 in 224
/// against 3.2 in 112). `gemm_bandwidth`, docs/perf/decisions.md#d26.
const TC_SMS: usize = 132;
/// The narrowest K slice [`tc_split`] cuts: twelve stages, enough to fill the four-stage ring three times over.
const TC_NARROWEST: usize = 12 * TC_K;
/// Shared memory per SM that blocks may take on Hopper (228 KB less 1 KB reserved per block, for up to 3 blocks).
const TC_SM_SHARED_BYTES: usize = 225 << 10;
/// The most K slices a shape may have: a split launch's cluster holds them all, and 8 blocks is the portable
/// cluster size (`TC_MAX_SPLIT` in gemm_tc.cu).
const TC_MAX_SPLIT: usize = 8;

/// Dynamic shared memory of `skinny_wgmma_*_t{nt}`: 4 stages of 16 KB of weights and `nt` rows of 128 bytes of
/// tokens, 8 mbarriers, and 1 KB to align the stages to the 128-byte swizzle's 1024-byte atoms.
fn tc_smem_bytes(nt: usize) -> usize {
    4 * (TC_ROWS * TC_K * 2 + nt * TC_K * 2) + 8 * 8 + 1024
}

/// Dynamic shared memory a launch of `skinny_wgmma_*_t{nt}` asks for so that at most `per_sm` (2 or 3) of its
/// blocks fit on an SM: what the stages need, or just over the share of `per_sm + 1` blocks when that is more.
fn tc_launch_smem_bytes(nt: usize, per_sm: usize) -> usize {
    tc_smem_bytes(nt).max(TC_SM_SHARED_BYTES / (per_sm + 1) + 1024)
}

/// The entry points of gemm_tc.cu on a Hopper device.
pub(crate) struct TcKernels {
    /// `[split, serial]`, each for chunks of 8, 16, 32 and 64 tokens.
    funcs: [[CudaFunction; 4]; 2],
    /// The device's SMs.
    sms: usize,
}

impl TcKernels {
    /// The entry points of gemm_tc.cu from `gpu`'s module store, with their shared memory allowed; `None` off
    /// Hopper (compute capability 9.x).
    pub(crate) fn load(gpu: &Gpu) -> Result<Option<Self>> {
        if gpu.info.compute_capability.0 != 9 {
            return Ok(None);
        }
        let f = |form: &str, nt: usize| -> Result<CudaFunction> {
            let func = gpu.function(&format!("skinny_wgmma{form}_t{nt}"))?;
            allow_shared_memory(&func, tc_launch_smem_bytes(nt, 2), "the warpgroup-MMA GEMM")?;
            Ok(func)
        };
        let set = |form: &str| -> Result<[CudaFunction; 4]> {
            Ok([f(form, TC_TOKENS[0])?, f(form, TC_TOKENS[1])?, f(form, TC_TOKENS[2])?, f(form, TC_TOKENS[3])?])
        };
        Ok(Some(TcKernels { funcs: [set("")?, set("_serial")?], sms: gpu.sms.max(1) }))
    }
}

/// The number of K slices of the warpgroup-MMA GEMM for a `[out_dim, in_dim]` weight: 1 for a weight of more than
/// half of [`TC_SMS`] row tiles of 128, else the most (a power of two, at most [`TC_MAX_SPLIT`]) that keep the
/// blocks within two per SM, with every slice at least [`TC_NARROWEST`] columns wide. A function of the shape
/// alone, so results stay batch-invariant.
pub fn tc_split(out_dim: usize, in_dim: usize) -> usize {
    let tiles = out_dim.div_ceil(TC_ROWS);
    if 2 * tiles > TC_SMS {
        return 1;
    }
    let mut split = 1;
    while split < TC_MAX_SPLIT && tiles * split * 2 <= 2 * TC_SMS && in_dim / (2 * split) >= TC_NARROWEST {
        split *= 2;
    }
    split
}

/// The K slice width for `split` slices of `in_dim` columns: a whole number of 256-column chunks, as gemm.cu's.
fn tc_kslice(in_dim: usize, split: usize) -> usize {
    in_dim.div_ceil(split.max(1)).div_ceil(256).max(1) * 256
}

/// A `CUtensorMap` as a kernel parameter (`TensorMap` of gemm_tc.cu).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct TensorMap(sys::CUtensorMap);

// SAFETY: a plain 128-byte value that the kernel reads by value (`__grid_constant__`).
unsafe impl DeviceRepr for TensorMap {}

/// The tensor map of a row-major bf16 `[rows, cols]` matrix at `ptr`, read in boxes of `[box_rows, 64]` with the
/// 128-byte swizzle; reads past the rows or columns give zeros.
fn tensor_map(ptr: DPtr, rows: usize, cols: usize, box_rows: usize) -> Result<TensorMap> {
    let dims: [sys::cuuint64_t; 2] = [cols as u64, rows as u64];
    let strides: [sys::cuuint64_t; 1] = [(cols * 2) as u64];
    let boxes: [sys::cuuint32_t; 2] = [TC_K as u32, box_rows as u32];
    let unit: [sys::cuuint32_t; 2] = [1, 1];
    // SAFETY: an all-zero CUtensorMap is a valid value to be overwritten by the encoder.
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    // SAFETY: every pointer is to a live local array of the rank the call names; the encoder only writes `map`.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(KernelError::Device(format!(
            "encoding the tensor map of a [{rows}, {cols}] bf16 matrix: {status:?}"
        )));
    }
    Ok(TensorMap(map))
}

impl TcKernels {
    /// Launches `skinny_wgmma_t*` in clusters of its slices, or `skinny_wgmma_serial_t*` when `serial` says so or
    /// there is one slice (gemm_tc.cu), for `call`. The caller has checked `GemmKernels::tc_gemm_takes`.
    pub(crate) fn tc_gemm(&self, gpu: &Gpu, call: GemmCall, split: usize, serial: bool) -> Result<()> {
        let GemmCall { w, out_dim, in_dim, x, n, y, addend, partial, parts } = call;
        if !(1..=TC_MAX_SPLIT).contains(&split) {
            return Err(KernelError::InvalidInput(format!(
                "warpgroup-MMA GEMM split {split} (1 to {TC_MAX_SPLIT} slices supported)"
            )));
        }
        if out_dim > i32::MAX as usize || in_dim > i32::MAX as usize || n > i32::MAX as usize {
            return Err(KernelError::InvalidInput(format!(
                "GEMM of [{n}, {in_dim}] x [{out_dim}, {in_dim}] is too large"
            )));
        }
        if n == 0 || out_dim == 0 {
            return Ok(());
        }
        let size = TC_TOKENS.iter().position(|&t| n <= t).unwrap_or(TC_TOKENS.len() - 1);
        let nt = TC_TOKENS[size];
        let chunks = n.div_ceil(nt);
        if chunks > 65_535 {
            return Err(KernelError::InvalidInput(format!("GEMM of {n} tokens (at most {} per call)", 65_535 * 64)));
        }
        let kslice = tc_kslice(in_dim, split);
        let slices = in_dim.div_ceil(kslice);
        let row_tiles = out_dim.div_ceil(TC_ROWS);
        let serial = serial || slices == 1;
        let tw = tensor_map(w, out_dim, in_dim, TC_ROWS)?;
        let tx = tensor_map(x, n, in_dim, nt)?;
        let blocks = if serial { row_tiles } else { row_tiles * slices };
        // Blocks per SM: as many as one wave of the launch needs (2 or 3), so that no SM holds more than the others
        // (shared memory beyond what the stages need only limits the occupancy). The dense gate/up (264 blocks) at
        // one token streamed 3.4 TB/s with room for 3 blocks per SM and 4.3 with room for 2.
        let per_sm = (blocks * chunks).div_ceil(self.sms).clamp(2, 3);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, chunks as u32, 1),
            block_dim: (160, 1, 1),
            shared_mem_bytes: tc_launch_smem_bytes(nt, per_sm) as u32,
        };
        let (seg, nseg) = parts.unwrap_or((NULL, 0));
        let (nn, kk, mm, nseg, ks) = (out_dim as i32, in_dim as i32, n as i32, nseg as i32, kslice as i32);
        let mut b = gpu.launcher(&self.funcs[usize::from(serial)][size]);
        b.arg(&tw).arg(&tx).arg(&y).arg(&addend).arg(&partial);
        b.arg(&nn).arg(&kk).arg(&mm).arg(&seg).arg(&nseg).arg(&ks);
        if !serial {
            b.cluster_x(slices as u32);
        }
        // SAFETY: the arguments match skinny_wgmma_* in order and type; the maps name live device buffers of the
        // shapes given (the caller's contract for w, x, y and addend); a split launch's grid is whole clusters.
        unsafe { b.launch(cfg, "skinny_wgmma") }
    }
}
