//! The batched KDA and MLA kernels of a step (`kda.cu`, `mla.cu`): the per-step row table they read, and
//! one [`Gpu`] method per launch.
//!
//! Invariants:
//! - One table per step: per (KDA layer, row) the state, conv-window and snapshot addresses and the row's
//!   token range and form; per (MLA layer, row) the cache address, length before the window, token range and
//!   split span; per token its row; then the step's token ids and the positions whose logits are wanted
//!   (u32). It is built on the host after every MLA cache of the step has been grown, and uploaded once
//!   into a device buffer that the model keeps ([`StepBuffer`]), so that a captured step (`cuda::graph`)
//!   reads its inputs through fixed addresses and nothing else is copied from the host during a step.
//! - The MLA split count of a step (the grid of `mla_split` and `mla_split_heads`) is rounded up to a power
//!   of two: splits past a token's last are empty and merge as exact zeros, so results do not change, and
//!   steps whose longest context grows share a captured graph until the count doubles.
//! - A row's KDA form and MLA split span depend only on that row (its window length, snapshots and
//!   cache length), never on the batch, so every row's result is independent of the other rows.
//! - Windows that keep snapshots (verify windows) always run the recurrent form; the chunked form takes
//!   windows of at least [`DeviceModel::kda_chunked_min`](crate::cuda::forward::DeviceModel) tokens
//!   (by default none: see [`KDA_CHUNKED_MIN_TOKENS`]).
//! - Layouts match the `#define`s at the top of `kda.cu` (`KDA_ENTRY`) and `mla.cu` (`MLA_ENTRY`).

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, DeviceRepr, LaunchConfig};
use half::bf16;

use crate::config::ModelConfig;
use crate::cuda::device::device_err;
use crate::cuda::forward::{reserve, DeviceRow, KdaUndo};
use crate::cuda::ops::{DPtr, Gpu};
use crate::error::{KernelError, Result};

/// i64 fields per (KDA layer, row) entry: S, 3 conv windows, snapshots, history, offset, t, from, form. Even, so
/// that every entry of the table (a fresh allocation) is 16-byte aligned: `kda_step` reads it in 16-byte loads.
pub const KDA_ENTRY: usize = 10;
const _: () = assert!(KDA_ENTRY % 2 == 0);
/// i64 fields per (MLA layer, row) entry: cache, first, offset, t, split span.
pub const MLA_ENTRY: usize = 5;
/// Positions per tile of the MLA split kernel (`TILE` in `mla.cu`).
const MLA_TILE: usize = 64;
/// The smallest split span of a decode / verify row, and the most splits one token gets.
const MLA_MIN_SPAN: usize = 256;
const MLA_MAX_SPLITS: usize = 64;
/// The most splits `mla_out` merges: it stages each token's split statistics in shared memory
/// (`OUT_MAX_SPLITS` in `mla.cu`).
const MLA_OUT_MAX_SPLITS: usize = 64;
const _: () = assert!(MLA_MAX_SPLITS <= MLA_OUT_MAX_SPLITS);
/// Rows of at most this many tokens are split over their cache (decode and verify windows); longer
/// windows have enough tokens to fill the GPU with one split each.
const MLA_SPLIT_MAX_WINDOW: usize = 16;
/// The largest kv_lora_rank of `mla_split` and `mla_out` (`MAX_CH * 128`, `OUT_MAX_RANK` in `mla.cu`).
const MLA_MAX_RANK: usize = 512;
/// The largest qk_nope_head_dim of `mla_absorb` (`ABSORB_MAX_NOPE`), which must also be a multiple of its MMA
/// k-step (`ABSORB_K`).
const MLA_MAX_NOPE: usize = 128;
const ABSORB_K: usize = 16;
/// Columns of q_lat per block of `mla_absorb` (`ABSORB_COLS`), value channels per block of `mla_out`
/// (`OUT_CHANNELS`), and tokens per block of both (`BLOCK_TOKENS`).
const ABSORB_COLS: usize = 64;
const OUT_CHANNELS: usize = 32;
const BLOCK_TOKENS: usize = 64;
/// Heads per block of `mla_split_heads` (`HEADS_TILE`), cache positions per staged tile (`KV_TILE`), and bf16
/// past each staged row (`ROW_PAD`), as in `mla.cu`.
const HEADS_TILE: usize = 16;
const HEADS_KV_TILE: usize = 64;
const HEADS_ROW_PAD: usize = 8;
/// The dynamic shared memory `mla_split_heads` is allowed (K3's 576-wide entries take 98,048 bytes).
const HEADS_MAX_SHARED: usize = 96 * 1024;

/// The dynamic shared memory of `mla_split_heads` for cache entries of `ld` bf16: Q `[16, ld + pad]`, the staged
/// tile `[64, ld + pad]`, and P_hi and P_lo `[16, 64 + pad]`, bf16.
fn heads_shared_bytes(ld: usize) -> usize {
    ((HEADS_TILE + HEADS_KV_TILE) * (ld + HEADS_ROW_PAD) + 2 * HEADS_TILE * (HEADS_KV_TILE + HEADS_ROW_PAD)) * 2
}

/// Whether `mla_split_heads` takes an MLA of latent rank `r`, rope width `rope` and nope width `nope`: MMA
/// k-steps of 16 over the entry, value channels in n-tiles of 8 for each of its 4 warps (r <= 512, as every MLA
/// kernel here), the query staged in aligned chunks of 8, and its staging within [`HEADS_MAX_SHARED`]. Otherwise
/// `mla_split` runs (one block per head).
fn heads_kernel_fits(r: usize, rope: usize, nope: usize) -> bool {
    (r + rope) % 16 == 0
        && r % 32 == 0
        && r <= MLA_MAX_RANK
        && nope % 8 == 0
        && heads_shared_bytes(r + rope) <= HEADS_MAX_SHARED
}

/// The default window length from which KDA runs its chunked form: never. Measured on an H200
/// (docs/perf/decisions.md#d52; one row, 96 heads of 128) the CUDA-core chunked kernel is no faster than the recurrent
/// one (16 / 64 / 256 / 2,048 tokens: 0.083 / 0.260 / 1.060 / 8.41 ms against 0.083 / 0.259 / 1.002 /
/// 8.02 ms): both are bound by one block per head walking its tokens in order. The chunked form pays off
/// once its three 16 x 128 x 128 products per chunk run on tensor cores and its state-independent part
/// (conv, norms, L, A, W, U) runs for all chunks in parallel, as in fla's chunk_kda; until then it is
/// selected only through [`DeviceModel::kda_chunked_min`](crate::cuda::forward::DeviceModel).
pub const KDA_CHUNKED_MIN_TOKENS: usize = usize::MAX;

/// The kernels of `kda.cu` and `mla.cu`.
pub(crate) struct AttnKernels {
    /// `kda_step_{32,128}` and `kda_chunk_{32,128}`, by head dim ([`KDA_HEAD_DIMS`]).
    kda_step: [CudaFunction; 2],
    kda_chunk: [CudaFunction; 2],
    mla_norm_append: CudaFunction,
    mla_absorb: CudaFunction,
    mla_split: CudaFunction,
    /// `mla_split` for 16 heads per block on the tensor cores, where [`heads_kernel_fits`]: present from Hopper on
    /// (it stages the cache by TMA).
    mla_split_heads: Option<CudaFunction>,
    mla_out: CudaFunction,
}

/// The head dims the KDA kernels are instantiated for (k3-tiny and K3).
const KDA_HEAD_DIMS: [usize; 2] = [32, 128];

impl AttnKernels {
    /// The kernels of the two modules; `hopper` says whether the device has TMA and mbarriers (compute capability 9
    /// and later).
    pub(crate) fn load(kda: &Arc<CudaModule>, mla: &Arc<CudaModule>, hopper: bool) -> Result<Self> {
        let f = |m: &Arc<CudaModule>, name: &str| {
            m.load_function(name).map_err(|e| device_err(&format!("kernel {name}"), e))
        };
        let by_dim = |prefix: &str| -> Result<[CudaFunction; 2]> {
            Ok([f(kda, &format!("{prefix}_32"))?, f(kda, &format!("{prefix}_128"))?])
        };
        let mla_split_heads = if hopper {
            let func = f(mla, "mla_split_heads")?;
            func.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                HEADS_MAX_SHARED as i32,
            )
            .map_err(|e| device_err("allowing mla_split_heads its shared memory", e))?;
            Some(func)
        } else {
            None
        };
        Ok(AttnKernels {
            kda_step: by_dim("kda_step")?,
            kda_chunk: by_dim("kda_chunk")?,
            mla_norm_append: f(mla, "mla_norm_append")?,
            mla_absorb: f(mla, "mla_absorb")?,
            mla_split: f(mla, "mla_split")?,
            mla_split_heads,
            mla_out: f(mla, "mla_out")?,
        })
    }
}

/// The arguments `kda_step_*` / `kda_chunk_*` take besides the table (`KdaArgs` in `kda.cu`, same layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KdaArgs {
    /// Pre-conv q, k, v, each `[n, P]` bf16.
    pub qkv: [DPtr; 3],
    /// Conv weights of q, k, v, each `[P, kw]` fp32.
    pub conv_w: [DPtr; 3],
    /// `[n, P]` forget-gate input, `[n, H]` beta logits, `[n, P]` output-gate logits (bf16).
    pub f: DPtr,
    pub b: DPtr,
    pub g: DPtr,
    /// `exp(A_log)` `[H]`, `dt_bias` `[P]`, `o_norm` `[K]` (fp32).
    pub a: DPtr,
    pub dt_bias: DPtr,
    pub o_norm: DPtr,
    /// `[n, P]` bf16 output.
    pub o: DPtr,
    pub heads: i32,
    pub kw: i32,
    pub lower_bound: f32,
    pub l2_eps: f32,
    pub norm_eps: f32,
}

// SAFETY: plain old data with the C layout of `KdaArgs` in kda.cu (pointers, then ints, then floats).
unsafe impl DeviceRepr for KdaArgs {}

/// The device buffer the step tables are uploaded into, kept for the model's life.
#[derive(Default)]
pub struct StepBuffer {
    buf: Mutex<Option<CudaSlice<i64>>>,
}

impl StepBuffer {
    /// Uploads `bytes` into the buffer (grown by doubling) and returns its device address. The copy is
    /// synchronous after the stream drains, so no kernel of an earlier step still reads the old contents.
    fn upload(&self, gpu: &Gpu, bytes: &[u8]) -> Result<DPtr> {
        let mut guard = self.buf.lock().map_err(|_| KernelError::Device("the step table lock is poisoned".into()))?;
        let words = bytes.len().div_ceil(8);
        let fits = guard.as_ref().is_some_and(|b| b.len() >= words);
        if !fits {
            let old = guard.as_ref().map_or(0, |b| b.len());
            *guard = Some(gpu.zeros::<i64>(words.max(2 * old).max(256))?);
        }
        let buf = guard.as_ref().ok_or_else(|| KernelError::Device("no step table buffer".into()))?;
        let ptr = gpu.ptr(buf);
        gpu.upload_bytes_at(ptr, bytes)?;
        Ok(ptr)
    }
}

/// A step's tables on the device and what the rows keep for rollback.
pub struct StepTables {
    /// The table's device address (what a captured step reads it through).
    base: DPtr,
    /// `[kda layers, rows, KDA_ENTRY]`, `[mla layers, rows, MLA_ENTRY]`, `[n]` token rows (i64).
    kda: DPtr,
    mla: DPtr,
    tok_row: DPtr,
    /// `[n]` token ids and `[wanted]` step positions whose logits are produced (u32).
    token_ids: DPtr,
    wanted: DPtr,
    wanted_len: usize,
    rows: usize,
    /// Tokens of the step and of its longest row.
    n: usize,
    max_t: usize,
    /// Splits of the most split token (the grid of `mla_split`).
    mla_splits: usize,
    any_chunked: bool,
    any_recurrent: bool,
    /// Per row: the snapshots and conv histories of every KDA layer (rows that asked for snapshots).
    pub(crate) undo: Vec<Option<KdaUndo>>,
}

/// The split span of an MLA row whose window has `t` tokens after `first` cached ones.
fn mla_span(first: usize, t: usize) -> usize {
    let visible = first + t;
    if t > MLA_SPLIT_MAX_WINDOW {
        return visible;
    }
    visible.div_ceil(MLA_MAX_SPLITS).div_ceil(MLA_TILE).max(1).saturating_mul(MLA_TILE).max(MLA_MIN_SPAN)
}

impl StepTables {
    /// Grows every MLA cache of the rows to hold their windows, allocates the rows' snapshot buffers, and
    /// uploads the table with the step's token ids and `wanted` logits positions. `offsets[r]..offsets[r + 1]`
    /// are row `r`'s tokens; windows of at least `chunked_min` tokens without snapshots take the chunked KDA
    /// form.
    pub fn build(
        gpu: &Gpu,
        cfg: &ModelConfig,
        buffer: &StepBuffer,
        rows: &mut [DeviceRow<'_>],
        offsets: &[usize],
        wanted: &[u32],
        chunked_min: usize,
    ) -> Result<Self> {
        let k = &cfg.kda;
        let (p, kw, state_len) = (k.proj_dim(), k.conv_kernel, k.num_heads * k.head_dim * k.head_dim);
        let (kda_layers, mla_layers) = (cfg.kda_layers().len(), cfg.mla_layers().len());
        let nrows = rows.len();
        let n = offsets[nrows];
        let ld = cfg.mla.latent_dim();
        let mut undo = Vec::with_capacity(nrows);
        let mut forms = Vec::with_capacity(nrows);
        for row in rows.iter_mut() {
            let t = row.tokens.len();
            let first = row.state.len;
            for cache in row.state.mla.iter_mut() {
                reserve(gpu, cache, first + t, ld)?;
            }
            // Written in full by the KDA kernel (every snapshot from..t and every history row; kda.cu).
            undo.push(match row.snapshots_from {
                Some(from) => Some(KdaUndo {
                    snaps: gpu.uninit::<f32>(kda_layers * (t - from) * state_len)?,
                    hist: gpu.uninit::<bf16>(kda_layers * 3 * (kw - 1 + t) * p)?,
                }),
                None => None,
            });
            forms.push(i64::from(row.snapshots_from.is_none() && t >= chunked_min));
        }
        let mut table = Vec::with_capacity((kda_layers * KDA_ENTRY + mla_layers * MLA_ENTRY) * nrows + n);
        for layer in 0..kda_layers {
            for (ri, row) in rows.iter().enumerate() {
                let st = &row.state.kda[layer];
                let t = row.tokens.len();
                let (snaps, hist, from) = match (&undo[ri], row.snapshots_from) {
                    (Some(u), Some(from)) => (
                        gpu.ptr(&u.snaps) + (layer * (t - from) * state_len * 4) as u64,
                        gpu.ptr(&u.hist) + (layer * 3 * (kw - 1 + t) * p * 2) as u64,
                        from,
                    ),
                    _ => (0, 0, 0),
                };
                table.extend([
                    gpu.ptr(&st.s) as i64,
                    gpu.ptr(&st.conv[0]) as i64,
                    gpu.ptr(&st.conv[1]) as i64,
                    gpu.ptr(&st.conv[2]) as i64,
                    snaps as i64,
                    hist as i64,
                    offsets[ri] as i64,
                    t as i64,
                    from as i64,
                    forms[ri],
                ]);
            }
        }
        let mut mla_splits = 1;
        for layer in 0..mla_layers {
            for (ri, row) in rows.iter().enumerate() {
                let (first, t) = (row.state.len, row.tokens.len());
                let span = mla_span(first, t);
                mla_splits = mla_splits.max((first + t).div_ceil(span));
                let cache = gpu.ptr(&row.state.mla[layer].cache);
                table.extend([cache as i64, first as i64, offsets[ri] as i64, t as i64, span as i64]);
            }
        }
        for ri in 0..nrows {
            table.extend(std::iter::repeat_n(ri as i64, offsets[ri + 1] - offsets[ri]));
        }
        let mut bytes: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
        let token_ids_at = bytes.len() as u64;
        bytes.extend(rows.iter().flat_map(|r| r.tokens.iter().flat_map(|t| t.to_le_bytes())));
        let wanted_at = bytes.len() as u64;
        bytes.extend(wanted.iter().flat_map(|p| p.to_le_bytes()));
        let base = buffer.upload(gpu, &bytes)?;
        let kda_bytes = (kda_layers * nrows * KDA_ENTRY * 8) as u64;
        let mla_bytes = (mla_layers * nrows * MLA_ENTRY * 8) as u64;
        Ok(StepTables {
            base,
            kda: base,
            mla: base + kda_bytes,
            tok_row: base + kda_bytes + mla_bytes,
            token_ids: base + token_ids_at,
            wanted: base + wanted_at,
            wanted_len: wanted.len(),
            rows: nrows,
            n,
            max_t: rows.iter().map(|r| r.tokens.len()).max().unwrap_or(0),
            mla_splits: mla_splits.next_power_of_two().min(MLA_MAX_SPLITS),
            any_chunked: forms.contains(&1),
            any_recurrent: forms.contains(&0),
            undo,
        })
    }

    /// Tokens of the step.
    pub fn tokens(&self) -> usize {
        self.n
    }

    /// The device address of the table (part of a captured step's shape).
    pub fn base(&self) -> DPtr {
        self.base
    }

    /// `[tokens]` u32: the step's token ids, rows in order.
    pub fn token_ids(&self) -> DPtr {
        self.token_ids
    }

    /// `[wanted]` u32: the step positions whose logits are produced, and how many there are.
    pub fn wanted(&self) -> (DPtr, usize) {
        (self.wanted, self.wanted_len)
    }

    /// Splits of the most split token of the step (the `splits` dimension of the MLA partials).
    pub fn mla_splits(&self) -> usize {
        self.mla_splits
    }
}

fn launch_err(name: &str) -> impl Fn(cudarc::driver::DriverError) -> KernelError + '_ {
    move |e| device_err(&format!("launching {name}"), e)
}

impl Gpu {
    /// Conv, gates, norms, recurrence (or chunked form) and gated norm of KDA layer `layer` for every row of
    /// the step: one launch per form present (see `kda.cu`).
    pub fn kda_layer(&self, tables: &StepTables, layer: usize, dk: usize, args: &KdaArgs) -> Result<()> {
        let which = KDA_HEAD_DIMS.iter().position(|d| *d == dk).ok_or_else(|| {
            KernelError::InvalidInput(format!("KDA head_dim {dk} is not supported on CUDA (32 or 128)"))
        })?;
        if args.kw < 1 || args.kw > 8 {
            return Err(KernelError::InvalidInput(format!("conv kernel {} is not supported on CUDA (1..=8)", args.kw)));
        }
        if tables.rows == 0 {
            return Ok(());
        }
        let table = tables.kda + (layer * tables.rows * KDA_ENTRY * 8) as u64;
        // The recurrent kernel runs two threads per channel, the chunked one one.
        let forms = [
            (tables.any_recurrent, &self.attn.kda_step[which], "kda_step", 2 * dk),
            (tables.any_chunked, &self.attn.kda_chunk[which], "kda_chunk", dk),
        ];
        for (present, func, name, threads) in forms {
            if !present {
                continue;
            }
            let cfg = LaunchConfig {
                grid_dim: (args.heads as u32, tables.rows as u32, 1),
                block_dim: (threads as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.launcher(func);
            b.arg(&table).arg(args);
            // SAFETY: the table's addresses are live buffers of the rows' states and undo records, and the
            // argument buffers are `[n, ..]` as documented on `KdaArgs` (callers' contract).
            unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err(name))?;
        }
        Ok(())
    }

    /// The q_a and kv_a RMSNorms of every token of the step and the append of its latent entry to its row's
    /// cache of MLA layer `layer`, in one launch: `qa_n = q_a_norm(qa)` (`qa`, `qa_n` `[n, q_lora_rank]`), and
    /// the entry `[kv_a_norm(kva[.., ..r]) | kva[.., r..]]` from `kva` `[n, latent_dim]` (left unchanged).
    /// `q_norm` and `kv_norm` are each norm's bf16 weight and epsilon.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_norm_append(
        &self,
        m: &crate::config::MlaConfig,
        tables: &StepTables,
        layer: usize,
        qa: DPtr,
        qa_n: DPtr,
        kva: DPtr,
        q_norm: (DPtr, f32),
        kv_norm: (DPtr, f32),
    ) -> Result<()> {
        if tables.rows == 0 {
            return Ok(());
        }
        let table = tables.mla + (layer * tables.rows * MLA_ENTRY * 8) as u64;
        let cfg = LaunchConfig {
            grid_dim: (tables.max_t as u32, tables.rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (q_rank, width, r) = (m.q_lora_rank as i32, m.latent_dim() as i32, m.kv_lora_rank as i32);
        let mut b = self.launcher(&self.attn.mla_norm_append);
        b.arg(&table).arg(&qa).arg(&qa_n).arg(&q_norm.0).arg(&q_rank).arg(&q_norm.1);
        b.arg(&kva).arg(&kv_norm.0).arg(&width).arg(&r).arg(&kv_norm.1);
        // SAFETY: every cache was grown to hold its window when the table was built; qa, qa_n and kva hold
        // the step's n tokens (callers' contract).
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err("mla_norm_append"))
    }

    /// Absorbed MLA attention of every token of the step over its row's cache of layer `layer`:
    /// `q` `[n, H * (nope + rope)]`, `kv_b` `[H * (nope + v), r]`, `out` `[n, H * v]`; with `gate`
    /// (`[n, H * v]` logits) `out = bf(o * bf(sigmoid(gate)))`, else the values `o` themselves. Three
    /// launches: the absorbed queries, the split attention, the merge with `W_UV` and the gate.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention(
        &self,
        m: &crate::config::MlaConfig,
        tables: &StepTables,
        layer: usize,
        q: DPtr,
        kv_b: DPtr,
        gate: Option<DPtr>,
        out: DPtr,
    ) -> Result<()> {
        let (h, r, nope, rope, vdim) =
            (m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
        if r > MLA_MAX_RANK || r % 8 != 0 {
            return Err(KernelError::InvalidInput(format!(
                "MLA kv_lora_rank {r} is not supported on CUDA (a multiple of 8, at most {MLA_MAX_RANK})"
            )));
        }
        if nope > MLA_MAX_NOPE || nope % ABSORB_K != 0 {
            return Err(KernelError::InvalidInput(format!(
                "MLA qk_nope_head_dim {nope} is not supported on CUDA (a multiple of {ABSORB_K}, at most \
                 {MLA_MAX_NOPE})"
            )));
        }
        if rope % 8 != 0 {
            return Err(KernelError::InvalidInput(format!(
                "MLA qk_rope_head_dim {rope} is not supported on CUDA (a multiple of 8: mla_absorb reads each head's \
                 query in 16-byte pieces)"
            )));
        }
        let n = tables.n;
        if n == 0 {
            return Ok(());
        }
        // Every element of these is written before it is read: q_lat by mla_absorb (all tokens, heads and
        // columns), the partials by mla_split or mla_split_heads (every split of every token and head, empty
        // ones included).
        let q_lat = self.uninit::<f32>(n * h * r)?; // [n, H, r]
        let splits = tables.mla_splits;
        let part_o = self.uninit::<f32>(n * h * splits * r)?; // [n, H, splits, r]
        let part_m = self.uninit::<f32>(n * h * splits)?; // [n, H, splits]
        let part_l = self.uninit::<f32>(n * h * splits)?; // [n, H, splits]
        let (q_lat, part_o, part_m, part_l) =
            (self.ptr(&q_lat), self.ptr(&part_o), self.ptr(&part_m), self.ptr(&part_l));
        let ints = |xs: &[usize]| xs.iter().map(|x| *x as i32).collect::<Vec<i32>>();
        let token_blocks = n.div_ceil(BLOCK_TOKENS) as u32;

        let cfg = LaunchConfig {
            grid_dim: (h as u32, r.div_ceil(ABSORB_COLS) as u32, token_blocks),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let a = ints(&[n, h, nope, rope, vdim, r]);
        let mut b = self.launcher(&self.attn.mla_absorb);
        b.arg(&q).arg(&kv_b).arg(&q_lat);
        for x in &a {
            b.arg(x);
        }
        // SAFETY: shapes as documented; q_lat holds [n, H, r]; r % 8 == 0 keeps the 16-byte weight loads aligned.
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err("mla_absorb"))?;

        let table = tables.mla + (layer * tables.rows * MLA_ENTRY * 8) as u64;
        let scale = 1.0f32 / (m.q_head_dim() as f32).sqrt();
        // Heads in groups of 16 per cache tile where the device and the shapes allow (the cache is read once per
        // group, not once per head), else one block per head.
        let heads = self.attn.mla_split_heads.as_ref().filter(|_| heads_kernel_fits(r, rope, nope));
        let (split, name, cfg) = if let Some(heads) = heads {
            let cfg = LaunchConfig {
                grid_dim: (splits as u32, h.div_ceil(HEADS_TILE) as u32, n as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: heads_shared_bytes(r + rope) as u32,
            };
            (heads, "mla_split_heads", cfg)
        } else {
            let cfg = LaunchConfig {
                grid_dim: (splits as u32, h as u32, n as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: ((r + rope) * 4) as u32,
            };
            (&self.attn.mla_split, "mla_split", cfg)
        };
        let a = ints(&[h, nope, rope, r]);
        let mut b = self.launcher(split);
        b.arg(&table).arg(&tables.tok_row).arg(&q).arg(&q_lat).arg(&part_o).arg(&part_m).arg(&part_l);
        for x in &a {
            b.arg(x);
        }
        b.arg(&scale);
        // SAFETY: the caches hold every visible entry (appended before); partials hold [n, H, splits(, r)].
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err(name))?;

        let cfg = LaunchConfig {
            grid_dim: (h as u32, vdim.div_ceil(OUT_CHANNELS) as u32, token_blocks),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let gate: DPtr = gate.unwrap_or(0);
        let a = ints(&[n, splits, h, nope, vdim, r]);
        let mut b = self.launcher(&self.attn.mla_out);
        b.arg(&part_o).arg(&part_m).arg(&part_l).arg(&kv_b).arg(&gate).arg(&out);
        for x in &a {
            b.arg(x);
        }
        // SAFETY: as above; gate (when non-null) and out hold [n, H * v].
        unsafe { b.launch(cfg) }.map(|_| self.count_launch()).map_err(launch_err("mla_out"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::compile::source_define;

    #[test]
    fn the_head_group_kernel_constants_match_mla_cu() {
        // Shared memory sized from other constants than the kernel's would let its staging overrun.
        assert_eq!(HEADS_TILE as u32, source_define("mla.cu", "HEADS_TILE"));
        assert_eq!(HEADS_KV_TILE as u32, source_define("mla.cu", "KV_TILE"));
        assert_eq!(HEADS_ROW_PAD as u32, source_define("mla.cu", "ROW_PAD"));
        assert_eq!(
            MLA_MAX_RANK as u32,
            8 * source_define("mla.cu", "HEADS_MAX_NT") * source_define("mla.cu", "HEADS_WARPS")
        );
    }

    #[test]
    fn the_mla_absorb_constants_match_mla_cu() {
        // A grid sized from other columns per block than the kernel's would leave columns of q_lat unwritten, and a
        // larger or ragged nope than the kernel stages would overrun its shared memory.
        assert_eq!(ABSORB_COLS as u32, source_define("mla.cu", "ABSORB_COLS"));
        assert_eq!(ABSORB_K as u32, source_define("mla.cu", "ABSORB_K"));
        assert_eq!(MLA_MAX_NOPE as u32, source_define("mla.cu", "ABSORB_MAX_NOPE"));
    }

    #[test]
    fn the_mla_out_constants_match_mla_cu() {
        // A grid sized from other channels per block than the kernel's would leave value channels unwritten, and
        // more splits than it stages would overrun its shared memory.
        assert_eq!(OUT_CHANNELS as u32, source_define("mla.cu", "OUT_CHANNELS"));
        assert_eq!(
            MLA_MAX_RANK as u32,
            source_define("mla.cu", "OUT_WARPS") * source_define("mla.cu", "OUT_WARP_COLS")
        );
        assert_eq!(MLA_OUT_MAX_SPLITS as u32, source_define("mla.cu", "OUT_MAX_SPLITS"));
        assert_eq!(BLOCK_TOKENS as u32, source_define("mla.cu", "BLOCK_TOKENS"));
    }

    #[test]
    fn head_groups_take_k3_and_k3_tiny_and_leave_odd_shapes_to_one_head_per_block() {
        // K3: 512 + 64 wide entries, 98,048 bytes of staging (two blocks per SM on an H200).
        assert_eq!(heads_shared_bytes(576), 98_048);
        assert!(heads_kernel_fits(512, 64, 128));
        assert!(heads_kernel_fits(32, 16, 32));
        // Entries not a whole number of MMA k-steps, ranks not split into 8-channel tiles over 4 warps, ranks past
        // every MLA kernel's limit and query rows not in aligned chunks of 8 go to mla_split.
        assert!(!heads_kernel_fits(512, 40, 128));
        assert!(!heads_kernel_fits(48, 16, 128));
        assert!(!heads_kernel_fits(1024, 64, 128));
        assert!(!heads_kernel_fits(512, 64, 100));
    }

    #[test]
    fn decode_rows_split_long_caches_and_windows_do_not() {
        assert_eq!(mla_span(0, 1), MLA_MIN_SPAN);
        assert_eq!(mla_span(100, 8), MLA_MIN_SPAN);
        // 4,096 cached tokens: 16 splits of 256.
        assert_eq!(4097usize.div_ceil(mla_span(4096, 1)), 17);
        // Very long caches keep at most MLA_MAX_SPLITS splits, in whole tiles.
        let span = mla_span(1_000_000, 1);
        assert!(1_000_001usize.div_ceil(span) <= MLA_MAX_SPLITS);
        assert_eq!(span % MLA_TILE, 0);
        // A prefill chunk attends in one split per token.
        assert_eq!(mla_span(10, 100), 110);
    }
}
