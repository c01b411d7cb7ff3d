//! The per-row kernels of `kernels/cuda/common.cu` ([`RowKernels`]): the embedding gather, RMSNorm, the AttnRes
//! read (alone, and fused with the residual add before it and the RMSNorm after it), the in-place add, SiTU and
//! the row gather; and [`RowSplit`], how a per-token kernel spreads one token's row.
//!
//! Invariants:
//! - Shapes are checked by the callers (the weight loader and the forward); kernels trust them, except the
//!   AttnRes source count and width, checked here before any launch.
//! - The per-token kernels that reduce over a whole row (the fused AttnRes read + norm here, the MoE combine +
//!   routed norm in `moe`) spread a token over one block or, from Hopper on and for rows of 1024 and wider, over a
//!   cluster of `ROW_CLUSTER` blocks ([`RowSplit::for_width`]); which form runs depends on the device and the
//!   row width alone, never on the batch.
//! - Argument structs carry device addresses ([`DPtr`]) of buffers the caller keeps alive across the call;
//!   tensors are row-major, `[rows, width]` unless a field says otherwise.

use cudarc::driver::{CudaFunction, LaunchConfig};

use crate::cuda::gpu::Gpu;
use crate::cuda::launch::{allow_shared_memory, grid_1d, DPtr};
use crate::error::{KernelError, Result};

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

impl RowSplit {
    /// How a per-token kernel over rows of `width` spreads each token on a device with (`clusters`) or without
    /// thread-block clusters: a cluster of blocks once every block of it gets at least one column per thread
    /// (`CLUSTER_MIN_WIDTH`), else one block.
    pub fn for_width(clusters: bool, width: usize) -> Self {
        if clusters && width >= CLUSTER_MIN_WIDTH {
            RowSplit::Cluster
        } else {
            RowSplit::OneBlock
        }
    }

    /// The splits a device with (`clusters`) or without thread-block clusters has: the cluster form from Hopper
    /// on, the one-block form always.
    pub fn available(clusters: bool) -> Vec<Self> {
        let cluster = clusters.then_some(RowSplit::Cluster);
        cluster.into_iter().chain([RowSplit::OneBlock]).collect()
    }
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

/// `a = bf(a + b)` over `len` bf16 elements with `func`, the `add_in_place` kernel (also the cuBLAS GEMM's add
/// epilogue).
pub(crate) fn add_in_place(gpu: &Gpu, func: &CudaFunction, a: DPtr, b_: DPtr, len: usize) -> Result<()> {
    let n = len as i64;
    let mut b = gpu.launcher(func);
    b.arg(&a).arg(&b_).arg(&n);
    // SAFETY: the arguments match add_in_place; both buffers hold `len` elements (caller's contract).
    unsafe { b.launch(grid_1d(len, 256), "add_in_place") }
}

/// An RMSNorm of `rows` rows of `dim` (strides in elements), rounded to bf16.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormArgs {
    /// `[rows, x_stride]` bf16 input (the first `dim` of each row are normalised).
    pub x: DPtr,
    pub x_stride: usize,
    /// `[dim]` bf16 weight.
    pub w: DPtr,
    /// `[rows, y_stride]` bf16 output (may be `x`).
    pub y: DPtr,
    pub y_stride: usize,
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
}

impl RmsNormArgs {
    /// The norm of contiguous rows `x` `[rows, dim]` into `y` `[rows, dim]`.
    pub fn packed(x: DPtr, w: DPtr, y: DPtr, rows: usize, dim: usize, eps: f32) -> Self {
        RmsNormArgs { x, x_stride: dim, w, y, y_stride: dim, rows, dim, eps }
    }
}

/// The AttnRes read of `n` tokens of width `d` over `nsrc` sources: `sources` `[nsrc, n, d]` bf16 slots `slot`
/// elements apart (the last one the live sum), pseudo-query `q` `[d]` f32.
#[derive(Clone, Copy, Debug)]
pub struct AttnResRead {
    pub sources: DPtr,
    pub slot: usize,
    pub nsrc: usize,
    pub q: DPtr,
    pub n: usize,
    pub d: usize,
    pub eps: f32,
}

/// The residual add, AttnRes read and RMSNorm fused (`attn_res_norm` in common.cu).
#[derive(Clone, Copy, Debug)]
pub struct AttnResNormArgs {
    pub read: AttnResRead,
    /// `[n, d]` bf16 added to the live source first (`bf(live + addend)`, written back); `NULL`: no add.
    pub addend: DPtr,
    /// The norm's `[d]` bf16 weight and epsilon.
    pub norm: (DPtr, f32),
    /// `[n, d]` bf16: `rms_norm(read)`.
    pub out: DPtr,
    /// `[n, d]` bf16: the read itself; `NULL`: not kept.
    pub read_out: DPtr,
}

/// SiTU of `len` elements: `out = situ(g, u)` with the model's `beta` and linear `lbeta` (bf16 `[len]` each).
#[derive(Clone, Copy, Debug)]
pub struct SituArgs {
    pub g: DPtr,
    pub u: DPtr,
    pub out: DPtr,
    pub len: usize,
    pub beta: f32,
    pub lbeta: f32,
}

/// `out[s, j] = src[s, rows[j]]` for `slots` slots of rows of `d` (bf16), `rows` `[nrows]` u32.
#[derive(Clone, Copy, Debug)]
pub struct GatherArgs {
    /// `[slots, src_slot]` bf16.
    pub src: DPtr,
    pub src_slot: usize,
    pub rows: DPtr,
    pub nrows: usize,
    /// `[slots, out_slot]` bf16.
    pub out: DPtr,
    pub out_slot: usize,
    pub slots: usize,
    pub d: usize,
}

/// A vocabulary-parallel embedding gather ([`RowKernels::embed_part`]): `table` `[rows, d]` bf16 holds ids
/// `first..first + rows`; `tokens` `[n]` u32; `out` `[n, d]` bf16.
#[derive(Clone, Copy, Debug)]
pub struct EmbedPartArgs {
    pub table: DPtr,
    pub first: usize,
    pub rows: usize,
    pub tokens: DPtr,
    pub out: DPtr,
    pub n: usize,
    pub d: usize,
}

/// The kernels of `common.cu`.
pub struct RowKernels {
    embed_gather: CudaFunction,
    rms_norm: CudaFunction,
    attn_res_read: CudaFunction,
    attn_res_norm: CudaFunction,
    /// `attn_res_norm` over a cluster of blocks per token: present from Hopper on.
    attn_res_norm_cluster: Option<CudaFunction>,
    add_in_place: CudaFunction,
    situ: CudaFunction,
    gather_rows: CudaFunction,
    /// The sharded forward's (`cuda::tp`): a vocabulary-parallel embedding, the rounding of an all-reduced partial,
    /// and the all-gathered lm_head slices laid out as whole rows.
    embed_gather_part: CudaFunction,
    round_partial: CudaFunction,
    vocab_interleave: CudaFunction,
}

impl RowKernels {
    /// Looks the kernels up in `gpu`'s module store.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let f = |name: &str| gpu.function(name);
        let attn_res_norm_cluster = gpu.hopper().then(|| f("attn_res_norm_cluster")).transpose()?;
        if let Some(kernel) = &attn_res_norm_cluster {
            allow_shared_memory(kernel, RES_STAGED_MAX_BYTES, "attn_res_norm_cluster")?;
        }
        Ok(RowKernels {
            embed_gather: f("embed_gather")?,
            rms_norm: f("rms_norm")?,
            attn_res_read: f("attn_res_read")?,
            attn_res_norm: f("attn_res_norm")?,
            attn_res_norm_cluster,
            add_in_place: f("add_in_place")?,
            situ: f("situ")?,
            gather_rows: f("gather_rows")?,
            embed_gather_part: f("embed_gather_part")?,
            round_partial: f("round_partial")?,
            vocab_interleave: f("vocab_interleave")?,
        })
    }

    /// `out[i] = table[tokens[i]]`, `[n, d]` (`tokens` `[n]` u32, `table` `[V, d]` bf16).
    pub fn embed(&self, gpu: &Gpu, table: DPtr, tokens: DPtr, out: DPtr, n: usize, d: usize) -> Result<()> {
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let d = d as i32;
        let mut b = gpu.launcher(&self.embed_gather);
        b.arg(&table).arg(&tokens).arg(&out).arg(&d);
        // SAFETY: the arguments match embed_gather; the buffers are the caller's (module invariants).
        unsafe { b.launch(cfg, "embed_gather") }
    }

    /// [`RowKernels::embed`] from a vocabulary-parallel shard of the table, `[rows, d]` holding ids
    /// `first..first + rows`: tokens outside it get zero rows (`cuda::tp`).
    pub fn embed_part(&self, gpu: &Gpu, a: &EmbedPartArgs) -> Result<()> {
        let cfg = LaunchConfig { grid_dim: (a.n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (d, first, rows) = (a.d as i32, a.first as u32, a.rows as u32);
        let mut b = gpu.launcher(&self.embed_gather_part);
        b.arg(&a.table).arg(&a.tokens).arg(&a.out).arg(&d).arg(&first).arg(&rows);
        // SAFETY: the arguments match embed_gather_part; the buffers are the caller's (module invariants).
        unsafe { b.launch(cfg, "embed_gather_part") }
    }

    /// `y = bf(x)` over `len` values: `x` f32, `y` bf16.
    pub fn round_partial(&self, gpu: &Gpu, x: DPtr, y: DPtr, len: usize) -> Result<()> {
        let n = len as i64;
        let mut b = gpu.launcher(&self.round_partial);
        b.arg(&x).arg(&y).arg(&n);
        // SAFETY: the arguments match round_partial; both buffers hold `len` elements (caller's contract).
        unsafe { b.launch(grid_1d(len, 256), "round_partial") }
    }

    /// `out[p, r * slice + j] = parts[r, p, j]`: `world` all-gathered `[positions, slice]` bf16 slices as
    /// `[positions, world * slice]`.
    pub fn vocab_interleave(
        &self,
        gpu: &Gpu,
        parts: DPtr,
        out: DPtr,
        positions: usize,
        world: usize,
        slice: usize,
    ) -> Result<()> {
        if positions == 0 {
            return Ok(());
        }
        let cfg =
            LaunchConfig { grid_dim: (positions as u32, world as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (p, s) = (positions as i32, slice as i32);
        let mut b = gpu.launcher(&self.vocab_interleave);
        b.arg(&parts).arg(&out).arg(&p).arg(&s);
        // SAFETY: the arguments match vocab_interleave; `parts` holds [world, positions, slice] and `out`
        // [positions, world * slice] (caller's contract).
        unsafe { b.launch(cfg, "vocab_interleave") }
    }

    /// RMSNorm as `a` says, rounded to bf16.
    pub fn rms_norm(&self, gpu: &Gpu, a: &RmsNormArgs) -> Result<()> {
        let cfg = LaunchConfig { grid_dim: (a.rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (xs, ys, dim) = (a.x_stride as i64, a.y_stride as i64, a.dim as i32);
        let mut b = gpu.launcher(&self.rms_norm);
        b.arg(&a.x).arg(&xs).arg(&a.w).arg(&a.y).arg(&ys).arg(&dim).arg(&a.eps);
        // SAFETY: the arguments match rms_norm; the buffers are the caller's (module invariants).
        unsafe { b.launch(cfg, "rms_norm") }
    }

    /// The AttnRes read `r` into `out` `[n, d]` bf16.
    pub fn attn_res_read(&self, gpu: &Gpu, r: &AttnResRead, out: DPtr) -> Result<()> {
        if r.nsrc == 0 || r.nsrc > 64 {
            return Err(KernelError::InvalidInput(format!("AttnRes read over {} sources (1..=64 supported)", r.nsrc)));
        }
        let cfg = LaunchConfig { grid_dim: (r.n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (slot, nsrc, d) = (r.slot as i64, r.nsrc as i32, r.d as i32);
        let mut b = gpu.launcher(&self.attn_res_read);
        b.arg(&r.sources).arg(&slot).arg(&nsrc).arg(&r.q).arg(&out).arg(&d).arg(&r.eps);
        // SAFETY: the arguments match attn_res_read; the buffers are the caller's (module invariants).
        unsafe { b.launch(cfg, "attn_res_read") }
    }

    /// The residual add, AttnRes read and RMSNorm fused (see [`AttnResNormArgs`]). Each token's row is spread as
    /// [`RowKernels::row_split`] says, over one block when the cluster form cannot take the row (`d` or `slot`
    /// not a multiple of 8).
    pub fn attn_res_norm(&self, gpu: &Gpu, a: &AttnResNormArgs) -> Result<()> {
        let (d, slot) = (a.read.d, a.read.slot);
        let split = match self.row_split(d) {
            RowSplit::Cluster if res_cluster_takes(d, slot) => RowSplit::Cluster,
            _ => RowSplit::OneBlock,
        };
        self.attn_res_norm_as(gpu, split, a)
    }

    /// [`RowKernels::attn_res_norm`] spread as `split` says (for the equivalence checks of both forms). The
    /// one-block form is bit-identical to [`RowKernels::add`], [`RowKernels::attn_res_read`] and
    /// [`RowKernels::rms_norm`] in sequence; the cluster form sums in another fixed order (the two differ by
    /// rounding), and moves the row in 16-byte chunks, so it takes `d` and `slot` that are multiples of 8.
    pub fn attn_res_norm_as(&self, gpu: &Gpu, split: RowSplit, a: &AttnResNormArgs) -> Result<()> {
        let AttnResRead { sources, slot, nsrc, q, n, d, eps } = a.read;
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
                (self.attn_res_norm_cluster.as_ref().ok_or_else(no_clusters)?, row_cluster_launch(n, staged_floats))
            }
            RowSplit::OneBlock => (
                &self.attn_res_norm,
                LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: (d * 4) as u32 },
            ),
        };
        let (slot, nsrc, d) = (slot as i64, nsrc as i32, d as i32);
        let mut b = gpu.launcher(kernel);
        b.arg(&sources)
            .arg(&slot)
            .arg(&nsrc)
            .arg(&q)
            .arg(&a.addend)
            .arg(&a.norm.0)
            .arg(&a.norm.1)
            .arg(&a.out)
            .arg(&a.read_out)
            .arg(&d)
            .arg(&eps);
        // SAFETY: the arguments match both forms of attn_res_norm; the buffers are the caller's.
        unsafe { b.launch(cfg, "attn_res_norm") }
    }

    /// The row splits this device has: the cluster form from Hopper on, the one-block form always.
    pub fn row_splits(&self) -> Vec<RowSplit> {
        RowSplit::available(self.attn_res_norm_cluster.is_some())
    }

    /// How a per-token kernel over rows of `width` spreads each token on this device ([`RowSplit::for_width`]).
    pub fn row_split(&self, width: usize) -> RowSplit {
        RowSplit::for_width(self.attn_res_norm_cluster.is_some(), width)
    }

    /// `a = bf(a + b)` over `len` bf16 elements.
    pub fn add(&self, gpu: &Gpu, a: DPtr, b: DPtr, len: usize) -> Result<()> {
        add_in_place(gpu, &self.add_in_place, a, b, len)
    }

    /// SiTU as `a` says.
    pub fn situ(&self, gpu: &Gpu, a: &SituArgs) -> Result<()> {
        let n = a.len as i64;
        let mut b = gpu.launcher(&self.situ);
        b.arg(&a.g).arg(&a.u).arg(&a.out).arg(&n).arg(&a.beta).arg(&a.lbeta);
        // SAFETY: the arguments match situ; the buffers hold `len` elements (caller's contract).
        unsafe { b.launch(grid_1d(a.len, 256), "situ") }
    }

    /// The row gather `a` describes.
    pub fn gather_rows(&self, gpu: &Gpu, a: &GatherArgs) -> Result<()> {
        let cfg =
            LaunchConfig { grid_dim: (a.nrows as u32, a.slots as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (ss, os, d) = (a.src_slot as i64, a.out_slot as i64, a.d as i32);
        let mut b = gpu.launcher(&self.gather_rows);
        b.arg(&a.src).arg(&ss).arg(&a.rows).arg(&a.out).arg(&os).arg(&d);
        // SAFETY: the arguments match gather_rows; the buffers are the caller's (module invariants).
        unsafe { b.launch(cfg, "gather_rows") }
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

    #[test]
    fn rows_of_1024_and_wider_take_clusters_where_the_device_has_them() {
        assert_eq!(RowSplit::for_width(true, 1024), RowSplit::Cluster);
        assert_eq!(RowSplit::for_width(true, 1023), RowSplit::OneBlock);
        assert_eq!(RowSplit::for_width(false, 7168), RowSplit::OneBlock);
        assert_eq!(RowSplit::available(false), [RowSplit::OneBlock]);
        assert_eq!(RowSplit::available(true), [RowSplit::Cluster, RowSplit::OneBlock]);
    }
}
