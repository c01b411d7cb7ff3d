//! The linear layers ([`GemmKernels`]): cuBLAS (`cublasGemmEx`, bf16 in and out, fp32 accumulate) and the
//! batch-invariant GEMM, whose result for a token does not depend on the batch ([`Gemm`]): the warpgroup-MMA
//! kernels of `kernels/cuda/gemm_tc.cu` where [`GemmKernels::tc_gemm_takes`] says so (Hopper, aligned operands;
//! `gemm_tc`) and the skinny mma.sync kernels of `kernels/cuda/gemm.cu` everywhere else.
//!
//! Invariants:
//! - Which batch-invariant kernels run a weight depends on the device and the operands' alignment alone, never on
//!   the token count, so a weight's tokens get the same bits at every batch size.
//! - The skinny GEMM's summation order is fixed by its K slice width, which [`skinny_split`] derives from the
//!   weight's shape alone. The [`SkinnyLayout`] of a call (warps per block, row tiles per warp, one block per
//!   slice or one block running every slice) is chosen per call for speed and never changes a bit of the result.
//! - A split launch of more than one slice takes its workspace (`[slices, n, out]` f32) from the stream-ordered
//!   pool, freed in stream order after the launch, and the current lane's tickets, which the kernel leaves at
//!   zero. A lane's launches run in stream order, so no two launches use the same tickets at once.
//! - cuBLAS is bound to the main stream (so [`Gemm::Cublas`] has no side lane; see `cuda::gpu`), and each of its
//!   calls counts as one launch.
//! - Every call is described by a [`LinearArgs`] (weight `[out_dim, in_dim]`, tokens `[n, in_dim]`, output
//!   `[n, out_dim]`, all bf16 and row-major) or, for stacked projections, a [`PartsArgs`].

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};

use crate::cuda::device::device_err;
pub use crate::cuda::gemm_tc::tc_split;
use crate::cuda::gemm_tc::{GemmCall, TcKernels};
use crate::cuda::gpu::{Gemm, Gpu};
use crate::cuda::launch::{allow_shared_memory, DPtr, NULL};
use crate::cuda::rows::add_in_place;
use crate::error::{KernelError, Result};

/// Tokens per chunk of the skinny GEMM (each chunk reads the weight once).
const SKINNY_TOKENS: usize = 64;
/// K columns per staged chunk (`KC` of gemm.cu); a K slice is a whole number of them.
const SKINNY_KC: usize = 256;
/// Row stride of a staged chunk in elements (`XS_STRIDE` of gemm.cu).
const SKINNY_XS_STRIDE: usize = 288;
/// Tickets per lane: at least the row tiles times token chunks of any split launch.
const SKINNY_TICKETS: usize = 1 << 16;
/// The largest workspace of a split launch; larger calls (long prefills) run their slices serially.
const SKINNY_WORKSPACE_BYTES: usize = 64 << 20;
/// The most K slices a shape may have.
const SKINNY_MAX_SPLIT: usize = 64;
/// Whole waves of blocks a split launch of 17 to 64 tokens must fill with two row tiles per warp before it takes
/// them ([`SkinnyLayout::wide`]). On the H200 the lm_head (163,840 rows: 4.8 waves) ran 17-26% faster wide at 32
/// and 64 tokens, while the k3-mini projections of 0.4 to 1.5 waves ran up to 46% slower (docs/perf/decisions.md#d22).
const SKINNY_WIDE_WAVES: usize = 4;

/// Dynamic shared memory of the skinny GEMM for `tiles` token tiles of 8: two staged x chunks,
/// `[2][8 tiles, 288]` bf16.
fn skinny_smem_bytes(tiles: usize) -> usize {
    2 * 8 * tiles * SKINNY_XS_STRIDE * 2
}

/// A lane's tickets, zeroed in that lane's stream order.
fn new_tickets(stream: &std::sync::Arc<CudaStream>) -> Result<CudaSlice<u32>> {
    stream.alloc_zeros::<u32>(SKINNY_TICKETS).map_err(|e| device_err("allocating the GEMM tickets", e))
}

/// The number of K slices of the skinny GEMM for a `[out_dim, in_dim]` weight: the fewest (a power of two)
/// that give at least 192 blocks of 64 rows (about 1.5 per SM of an H200), with every slice wider than three
/// staged chunks (768 columns). A function of the shape alone, so results stay batch-invariant.
///
/// Swept on the H200 over the k3-mini shapes at 1 to 64 tokens (`gemm_bandwidth`, docs/perf/decisions.md#d18):
/// the rule picks the split with the least time weighted towards 1 and 8 tokens for all eleven of them. Fewer
/// blocks leave SMs without weights to stream; more slices cost at 32 and 64 tokens, where each slice stages
/// its own copy of the tokens and writes fp32 partials.
pub fn skinny_split(out_dim: usize, in_dim: usize) -> usize {
    const BLOCKS: usize = 192;
    const NARROWEST: usize = 3 * SKINNY_KC;
    let tiles = out_dim.div_ceil(64);
    let mut split = 1;
    while split < SKINNY_MAX_SPLIT && tiles * split < BLOCKS && in_dim / (2 * split) > NARROWEST {
        split *= 2;
    }
    split
}

/// The K slice width for `split` slices asked of `in_dim` columns: a whole number of staged chunks.
pub fn skinny_kslice(in_dim: usize, split: usize) -> usize {
    in_dim.div_ceil(split.max(1)).div_ceil(SKINNY_KC).max(1) * SKINNY_KC
}

/// How one skinny GEMM call is laid out on the device. Only `split` (with the shape) sets the summation
/// order; `warps` and `serial` change the speed alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkinnyLayout {
    /// K slices asked for (1 to 64); the slice width is [`skinny_kslice`].
    pub split: usize,
    /// Warps per block, 4 or 8: 16 weight rows each in split launches, 32 in serial ones.
    pub warps: usize,
    /// One block runs every slice of its rows in turn, instead of one block per slice.
    pub serial: bool,
    /// A split launch of 17 to 64 tokens gives each warp two 16-row tiles instead of one (`skinny_gemm_wide_t*`):
    /// each token fragment read from shared memory feeds both, and the launch has half the blocks. Serial
    /// launches always have two.
    pub wide: bool,
}

/// How many blocks of each split entry point the device holds at once, `[4 warps, 8 warps]` per block: SMs times
/// the occupancy the driver reports for the kernel's registers and shared memory.
#[derive(Clone, Copy, Debug)]
struct SkinnySlots {
    /// `skinny_gemm_t{1,2,4,8}`.
    narrow: [[usize; 2]; 4],
    /// `skinny_gemm_wide_t{4,8}`.
    wide: [[usize; 2]; 2],
}

/// Reads [`SkinnySlots`] of a device of `sms` SMs from the driver's occupancy of each entry point.
fn skinny_slots(sms: usize, narrow_funcs: &[CudaFunction; 4], wide_funcs: &[CudaFunction; 2]) -> Result<SkinnySlots> {
    let slots = |func: &cudarc::driver::CudaFunction, tiles: usize| -> Result<[usize; 2]> {
        let mut per_warps = [0usize; 2];
        for (j, warps) in [4u32, 8].into_iter().enumerate() {
            let per_sm = func
                .occupancy_max_active_blocks_per_multiprocessor(32 * warps, skinny_smem_bytes(tiles), None)
                .map_err(|e| device_err("reading the skinny GEMM's occupancy", e))?;
            per_warps[j] = sms.max(1) * per_sm as usize;
        }
        Ok(per_warps)
    };
    let mut narrow = [[0usize; 2]; 4];
    for (i, tiles) in [1usize, 2, 4, 8].into_iter().enumerate() {
        narrow[i] = slots(&narrow_funcs[i], tiles)?;
    }
    let wide = [slots(&wide_funcs[0], 4)?, slots(&wide_funcs[1], 8)?];
    Ok(SkinnySlots { narrow, wide })
}

/// One linear layer call: `y[n, out_dim] = bf(x[n, in_dim] · w[out_dim, in_dim]ᵀ)`, bf16, row-major.
#[derive(Clone, Copy, Debug)]
pub struct LinearArgs {
    pub w: DPtr,
    pub out_dim: usize,
    pub in_dim: usize,
    pub x: DPtr,
    pub n: usize,
    pub y: DPtr,
}

impl LinearArgs {
    fn call(&self, addend: DPtr, parts: Option<(DPtr, usize)>) -> GemmCall {
        let LinearArgs { w, out_dim, in_dim, x, n, y } = *self;
        GemmCall { w, out_dim, in_dim, x, n, y, addend, partial: NULL, parts }
    }
}

/// A merged projection: `w` stacks parts of `bounds[i + 1] - bounds[i]` rows (`bounds` starts at 0 and ends at
/// the total), `[total, in_dim]`; the result `y` is segment-major: part `i` is a contiguous
/// `[n, bounds[i + 1] - bounds[i]]` block at element offset `n * bounds[i]`. `bounds_dev` holds `bounds` as i32
/// on the device.
#[derive(Clone, Copy, Debug)]
pub struct PartsArgs<'a> {
    pub w: DPtr,
    pub bounds: &'a [usize],
    pub bounds_dev: DPtr,
    pub in_dim: usize,
    pub x: DPtr,
    pub n: usize,
    pub y: DPtr,
}

/// The GEMM kernels of `gemm.cu` and (on Hopper) `gemm_tc.cu`, the cuBLAS handle, and each lane's tickets.
pub struct GemmKernels {
    /// `skinny_gemm_t{1,2,4,8}`: token chunks of up to 8, 16, 32, 64 tokens, one block per K slice.
    skinny_gemm: [CudaFunction; 4],
    /// `skinny_gemm_serial_t{1,2,4,8}`: the same sums, one block running every K slice of its rows.
    skinny_gemm_serial: [CudaFunction; 4],
    /// `skinny_gemm_wide_t{4,8}`: split launches of up to 32 and 64 tokens with two 16-row tiles per warp.
    skinny_gemm_wide: [CudaFunction; 2],
    /// `skinny_wgmma{,_serial}_t{8,16,32,64}` (gemm_tc.cu): the batch-invariant GEMM on Hopper, `None` elsewhere.
    tc: Option<TcKernels>,
    /// `add_in_place` (common.cu), for cuBLAS's add epilogue.
    add_in_place: CudaFunction,
    blas: CudaBlas,
    /// The skinny GEMM's tickets of the main and the side lane (all zeros between launches; see `gemm.cu`).
    tickets: [CudaSlice<u32>; 2],
    /// Blocks of each split skinny GEMM entry point the device holds at once, at 4 and 8 warps per block.
    slots: SkinnySlots,
}

impl GemmKernels {
    /// Looks the kernels up in `gpu`'s module store, allows them their shared memory, reads their occupancy,
    /// creates the cuBLAS handle on the main stream and each lane's tickets.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let f = |name: &str| gpu.function(name);
        let skinny_gemm = [f("skinny_gemm_t1")?, f("skinny_gemm_t2")?, f("skinny_gemm_t4")?, f("skinny_gemm_t8")?];
        let skinny_gemm_serial = [
            f("skinny_gemm_serial_t1")?,
            f("skinny_gemm_serial_t2")?,
            f("skinny_gemm_serial_t4")?,
            f("skinny_gemm_serial_t8")?,
        ];
        let skinny_gemm_wide = [f("skinny_gemm_wide_t4")?, f("skinny_gemm_wide_t8")?];
        let tiles = [1usize, 2, 4, 8];
        let entries = tiles.iter().zip(&skinny_gemm).chain(tiles.iter().zip(&skinny_gemm_serial));
        for (tiles, func) in entries.chain([4usize, 8].iter().zip(&skinny_gemm_wide)) {
            allow_shared_memory(func, skinny_smem_bytes(*tiles), "the skinny GEMM")?;
        }
        let slots = skinny_slots(gpu.sms, &skinny_gemm, &skinny_gemm_wide)?;
        let tc = TcKernels::load(gpu)?;
        let blas = CudaBlas::new(gpu.stream.clone()).map_err(|e| device_err("creating the cuBLAS handle", e))?;
        let tickets = [new_tickets(&gpu.stream)?, new_tickets(gpu.side_stream())?];
        Ok(GemmKernels {
            skinny_gemm,
            skinny_gemm_serial,
            skinny_gemm_wide,
            tc,
            add_in_place: f("add_in_place")?,
            blas,
            tickets,
            slots,
        })
    }

    /// `y[n, out] = bf(x[n, in] · w[out, in]ᵀ)` with fp32 accumulation, by `gpu`'s selected [`Gemm`].
    pub fn linear(&self, gpu: &Gpu, a: &LinearArgs) -> Result<()> {
        match gpu.gemm {
            Gemm::Cublas => self.linear_cublas(gpu, a),
            Gemm::BatchInvariant => self.batch_invariant(gpu, a.call(NULL, None)),
        }
    }

    /// A merged projection (see [`PartsArgs`]), exactly as if each part had run alone.
    pub fn linear_parts(&self, gpu: &Gpu, a: &PartsArgs<'_>) -> Result<()> {
        let PartsArgs { w, bounds, bounds_dev, in_dim, x, n, y } = *a;
        let out_dim = *bounds.last().unwrap_or(&0);
        if bounds.len() < 2 || bounds[0] != 0 || bounds.windows(2).any(|b| b[0] > b[1]) || out_dim > i32::MAX as usize {
            return Err(KernelError::InvalidInput(format!(
                "merged projection bounds {bounds:?} are not ascending from 0"
            )));
        }
        match gpu.gemm {
            Gemm::Cublas => {
                for b in bounds.windows(2) {
                    let part_w = w + (b[0] * in_dim * 2) as u64;
                    let part =
                        LinearArgs { w: part_w, out_dim: b[1] - b[0], in_dim, x, n, y: y + (n * b[0] * 2) as u64 };
                    self.linear_cublas(gpu, &part)?;
                }
                Ok(())
            }
            Gemm::BatchInvariant => {
                let parts = Some((bounds_dev, bounds.len() - 1));
                let whole = LinearArgs { w, out_dim, in_dim, x, n, y };
                self.batch_invariant(gpu, whole.call(NULL, parts))
            }
        }
    }

    /// `y = bf(bf(x · wᵀ) + addend)` (`addend` `[n, out_dim]` bf16, which may be `y` itself): bit-identical
    /// to [`GemmKernels::linear`] followed by an add, in one pass with the batch-invariant GEMM (a residual or
    /// a sum of expert outputs added where the GEMM writes).
    pub fn linear_add(&self, gpu: &Gpu, a: &LinearArgs, addend: DPtr) -> Result<()> {
        let (y, len) = (a.y, a.n * a.out_dim);
        match gpu.gemm {
            Gemm::Cublas if addend == y => {
                let product = gpu.uninit::<half::bf16>(len)?;
                self.linear_cublas(gpu, &LinearArgs { y: gpu.ptr(&product), ..*a })?;
                add_in_place(gpu, &self.add_in_place, y, gpu.ptr(&product), len)
            }
            Gemm::Cublas => {
                self.linear_cublas(gpu, a)?;
                add_in_place(gpu, &self.add_in_place, y, addend, len)
            }
            Gemm::BatchInvariant => self.batch_invariant(gpu, a.call(addend, None)),
        }
    }

    /// `yf[n, out] = x[n, in] · w[out, in]ᵀ` in fp32, unrounded (`a.y` is not written): a row-parallel projection's
    /// share of a sharded forward, completed by an all-reduce and rounded after it (`cuda::tp`). Its sums are those
    /// [`GemmKernels::linear`] rounds, so over a group of one the rounded partial is exactly `linear`'s output.
    pub fn linear_partial(&self, gpu: &Gpu, a: &LinearArgs, yf: DPtr) -> Result<()> {
        match gpu.gemm {
            Gemm::Cublas => self.cublas(gpu, a, yf, blas_sys::cudaDataType_t::CUDA_R_32F),
            Gemm::BatchInvariant => self.batch_invariant(gpu, GemmCall { partial: yf, ..a.call(NULL, None) }),
        }
    }

    /// The batch-invariant GEMM of `call`: the warpgroup-MMA kernels at [`tc_split`] of the shape where they take
    /// the call, else the skinny kernels at [`skinny_split`] in the call's [`GemmKernels::skinny_layout`].
    fn batch_invariant(&self, gpu: &Gpu, call: GemmCall) -> Result<()> {
        let GemmCall { w, out_dim, in_dim, x, n, .. } = call;
        if let Some(tc) = self.tc.as_ref().filter(|_| self.tc_gemm_takes(w, x, in_dim)) {
            return tc.tc_gemm(gpu, call, tc_split(out_dim, in_dim), false);
        }
        self.skinny(gpu, call, self.skinny_layout(out_dim, in_dim, n, skinny_split(out_dim, in_dim)))
    }

    /// The skinny mma.sync GEMM with an explicit K split (1 to 64 slices), row-major output or segment-major output
    /// `(bounds on the device, parts)`, on any device. Results are batch-invariant for a fixed `split`;
    /// [`GemmKernels::linear`] takes [`skinny_split`] of the shape where the warpgroup-MMA GEMM does not run, and
    /// tests and benchmarks try the others.
    pub fn linear_skinny(&self, gpu: &Gpu, a: &LinearArgs, parts: Option<(DPtr, usize)>, split: usize) -> Result<()> {
        let layout = self.skinny_layout(a.out_dim, a.in_dim, a.n, split);
        self.skinny(gpu, a.call(NULL, parts), layout)
    }

    /// The skinny GEMM with an explicit layout (tests and benchmarks: every layout of one `split` gives the
    /// same bits).
    pub fn linear_skinny_layout(&self, gpu: &Gpu, a: &LinearArgs, layout: SkinnyLayout) -> Result<()> {
        self.skinny(gpu, a.call(NULL, None), layout)
    }

    /// Whether the batch-invariant GEMM of a weight at `w` with `in_dim` columns on tokens at `x` runs on the
    /// warpgroup-MMA kernels: a Hopper device, and operands a tensor map can read (16-byte aligned rows).
    pub fn tc_gemm_takes(&self, w: DPtr, x: DPtr, in_dim: usize) -> bool {
        self.tc.is_some() && w % 16 == 0 && x % 16 == 0 && in_dim % 8 == 0
    }

    /// The warpgroup-MMA GEMM with an explicit K split (tests and benchmarks; [`GemmKernels::linear`] takes
    /// [`tc_split`] of the shape): its slices run serially in one block per row tile, or as clusters of their own
    /// blocks, as `serial` says. Every choice gives the same bits.
    pub fn linear_tc(&self, gpu: &Gpu, a: &LinearArgs, split: usize, serial: bool) -> Result<()> {
        let tc = self.tc.as_ref().filter(|_| self.tc_gemm_takes(a.w, a.x, a.in_dim)).ok_or_else(|| {
            KernelError::InvalidInput(format!(
                "the warpgroup-MMA GEMM needs a Hopper GPU and 16-byte aligned rows (in_dim {})",
                a.in_dim
            ))
        })?;
        tc.tc_gemm(gpu, a.call(NULL, None), split, serial)
    }

    /// The layout of an `n`-token call with `split` slices. Two row tiles per warp ([`SkinnyLayout::wide`]) above
    /// 16 tokens when that still fills [`SKINNY_WIDE_WAVES`] waves of blocks at 4 warps. Warps per block: whichever
    /// of 4 and 8 fills its last wave of blocks better, 4 up to 8 tokens and 8 above when they fill equally (the
    /// fastest over the k3-mini shapes; docs/perf/decisions.md#d20). Slices run on their own blocks unless the
    /// workspace or the tickets would run out.
    pub fn skinny_layout(&self, out_dim: usize, in_dim: usize, n: usize, split: usize) -> SkinnyLayout {
        let tiles = n.min(SKINNY_TOKENS).div_ceil(8).next_power_of_two();
        let slices = in_dim.div_ceil(skinny_kslice(in_dim, split));
        let chunks = n.div_ceil(SKINNY_TOKENS);
        let wide_slots = self.slots.wide[usize::from(tiles == 8)];
        let wide = tiles >= 4 && out_dim.div_ceil(32 * 4) * slices * chunks >= SKINNY_WIDE_WAVES * wide_slots[0].max(1);
        let (rows, slots) = match wide {
            true => (32, wide_slots),
            false => (16, self.slots.narrow[tiles.trailing_zeros() as usize]),
        }; // slots: [4 warps, 8 warps]
        let blocks = |warps: usize| out_dim.div_ceil(rows * warps) * slices * chunks;
        // The share of the launch's waves that is busy: blocks over whole waves of the device's slots.
        let fill = |warps: usize| {
            let (b, s) = (blocks(warps), slots[usize::from(warps == 8)].max(1));
            b as f64 / (b.div_ceil(s) * s) as f64
        };
        let preferred = if n <= 8 { 4 } else { 8 };
        let other = 12 - preferred;
        let warps = if fill(other) > fill(preferred) { other } else { preferred };
        let workspace = slices * n * out_dim * 4;
        let serial = workspace > SKINNY_WORKSPACE_BYTES || blocks(warps) / slices > SKINNY_TICKETS;
        SkinnyLayout { split, warps, serial, wide: wide && !serial }
    }

    /// One launch of `skinny_gemm_t*`, `skinny_gemm_wide_t*` or `skinny_gemm_serial_t*` for `call` in `layout`.
    fn skinny(&self, gpu: &Gpu, call: GemmCall, layout: SkinnyLayout) -> Result<()> {
        let GemmCall { w, out_dim, in_dim, x, n, y, addend, partial, parts } = call;
        let SkinnyLayout { split, warps, serial, wide } = layout;
        if !(1..=SKINNY_MAX_SPLIT).contains(&split) {
            return Err(KernelError::InvalidInput(format!(
                "skinny GEMM split {split} (1 to {SKINNY_MAX_SPLIT} slices supported)"
            )));
        }
        if warps != 4 && warps != 8 {
            return Err(KernelError::InvalidInput(format!("skinny GEMM of {warps} warps per block (4 or 8)")));
        }
        if out_dim > i32::MAX as usize || in_dim > i32::MAX as usize || n > i32::MAX as usize {
            return Err(KernelError::InvalidInput(format!(
                "GEMM of [{n}, {in_dim}] x [{out_dim}, {in_dim}] is too large"
            )));
        }
        if n == 0 || out_dim == 0 {
            return Ok(());
        }
        let chunks = n.div_ceil(SKINNY_TOKENS);
        if chunks > 65_535 {
            return Err(KernelError::InvalidInput(format!("GEMM of {n} tokens (at most {} per call)", 65_535 * 64)));
        }
        let kslice = skinny_kslice(in_dim, split);
        let slices = in_dim.div_ceil(kslice);
        let tiles = n.min(SKINNY_TOKENS).div_ceil(8).next_power_of_two();
        if wide && (serial || tiles < 4) {
            return Err(KernelError::InvalidInput(format!(
                "wide skinny GEMM layout for {n} tokens{}: only split launches of more than 16 tokens have one",
                if serial { " run serially" } else { "" }
            )));
        }
        // Weight rows per warp: one MMA row tile in narrow split launches, two in wide and serial ones (gemm.cu).
        let rows_per_warp = if serial || wide { 32 } else { 16 };
        let row_tiles = out_dim.div_ceil(rows_per_warp * warps);
        let blocks = if serial { row_tiles } else { row_tiles * slices };
        if blocks > i32::MAX as usize {
            return Err(KernelError::InvalidInput(format!("GEMM of {out_dim} rows in {slices} slices is too large")));
        }
        let split_blocks = !serial && slices > 1;
        if split_blocks && row_tiles * chunks > SKINNY_TICKETS {
            return Err(KernelError::InvalidInput(format!(
                "skinny GEMM of {row_tiles} row tiles x {chunks} token chunks has more than {SKINNY_TICKETS} tickets"
            )));
        }
        // [slices, n, out] f32 partials, freed in stream order after the launch.
        let workspace = if split_blocks { Some(gpu.uninit::<f32>(slices * n * out_dim)?) } else { None };
        let ws = workspace.as_ref().map_or(NULL, |b| gpu.ptr(b));
        let tickets = gpu.ptr(&self.tickets[usize::from(gpu.on_side_lane())]);
        let func = match (serial, wide) {
            (true, _) => &self.skinny_gemm_serial[tiles.trailing_zeros() as usize],
            (false, true) => &self.skinny_gemm_wide[usize::from(tiles == 8)],
            (false, false) => &self.skinny_gemm[tiles.trailing_zeros() as usize],
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, chunks as u32, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: skinny_smem_bytes(tiles) as u32,
        };
        let aligned = |p: DPtr| p % 16 == 0 && in_dim % 8 == 0;
        let vec = aligned(w) as i32 | ((aligned(x) as i32) << 1);
        let (seg, nseg) = parts.unwrap_or((NULL, 0));
        let (nn, kk, mm, nseg, ks) = (out_dim as i32, in_dim as i32, n as i32, nseg as i32, kslice as i32);
        let mut b = gpu.launcher(func);
        b.arg(&w).arg(&x).arg(&y).arg(&addend).arg(&partial).arg(&nn).arg(&kk).arg(&mm).arg(&seg).arg(&nseg);
        b.arg(&ks).arg(&ws).arg(&tickets).arg(&vec);
        // SAFETY: the arguments match skinny_gemm_*; the workspace and tickets cover the launch (checked above).
        unsafe { b.launch(cfg, "skinny_gemm") }
    }

    /// The cuBLAS GEMM: row-major `y = x wᵀ` is column-major `yᵀ = w xᵀ` with `w` transposed
    /// (shared/reference/rust-stack.md §1.5).
    pub fn linear_cublas(&self, gpu: &Gpu, a: &LinearArgs) -> Result<()> {
        self.cublas(gpu, a, a.y, blas_sys::cudaDataType_t::CUDA_R_16BF)
    }

    /// `cublasGemmEx` of `a` into `y` of type `y_type` (bf16, or f32 for a partial).
    fn cublas(&self, gpu: &Gpu, a: &LinearArgs, y: DPtr, y_type: blas_sys::cudaDataType_t) -> Result<()> {
        let LinearArgs { w, out_dim, in_dim, x, n, .. } = *a;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf = blas_sys::cudaDataType_t::CUDA_R_16BF;
        // SAFETY: w is [out, in], x is [n, in] (bf16), y is [n, out] of `y_type`, all live (caller's contract).
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                out_dim as i32,
                n as i32,
                in_dim as i32,
                (&alpha) as *const f32 as *const _,
                w as *const std::ffi::c_void,
                bf,
                in_dim as i32,
                x as *const std::ffi::c_void,
                bf,
                in_dim as i32,
                (&beta) as *const f32 as *const _,
                y as *mut std::ffi::c_void,
                y_type,
                out_dim as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map(|_| gpu.count_launch())
        .map_err(|e| device_err("cublasGemmEx", e))
    }
}
