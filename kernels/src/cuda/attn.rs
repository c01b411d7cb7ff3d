//! The batched KDA and MLA kernels of a step (`kda.cu`, `mla.cu`; [`AttnKernels`]), over every row of the step at
//! once through the step's row table (`cuda::step`).
//!
//! Invariants:
//! - One launch per kernel for all rows of a step; each row reads and writes only its own device state (the
//!   addresses in its table entries), so a row's result never depends on the other rows.
//! - Windows that keep snapshots (verify windows) always run the recurrent KDA form; the chunked form takes
//!   windows of at least `DeviceModel::kda_chunked_min` (`cuda::forward`) tokens
//!   (by default none: see [`KDA_CHUNKED_MIN_TOKENS`]).
//! - The launch constants match the `#define`s of `kda.cu` and `mla.cu` (the tests below pin them).
//! - Launches take argument structs ([`KdaArgs`], [`MlaAppendArgs`], [`MlaAttentionArgs`]) of device addresses the
//!   caller keeps alive across the call.

use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};

use crate::config::MlaConfig;
use crate::cuda::gpu::Gpu;
use crate::cuda::launch::{allow_shared_memory, DPtr};
use crate::cuda::step::{MlaTable, StepTables, KDA_ENTRY, MLA_MAX_SPLITS};
use crate::error::{KernelError, Result};

/// The most splits `mla_out` merges: it stages each token's split statistics in shared memory
/// (`OUT_MAX_SPLITS` in `mla.cu`).
const MLA_OUT_MAX_SPLITS: usize = 64;
const _: () = assert!(MLA_MAX_SPLITS <= MLA_OUT_MAX_SPLITS);
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
/// Heads per block of `mla_split_heads` (`HEADS_TILE`), cache positions per staged tile (`KV_TILE`), bf16 past
/// each staged row (`ROW_PAD`), and tokens per block of `mla_split_heads_tokens` (`HEADS_TOKENS`), as in `mla.cu`.
const HEADS_TILE: usize = 16;
const HEADS_KV_TILE: usize = 64;
const HEADS_ROW_PAD: usize = 8;
const HEADS_TOKENS: usize = 4;
/// The dynamic shared memory `mla_split_heads` is allowed (K3's 576-wide entries take 98,048 bytes), and
/// `mla_split_heads_tokens` (167,936 bytes for K3: one block of 16 warps per SM).
const HEADS_MAX_SHARED: usize = 96 * 1024;
const HEADS_TOKENS_MAX_SHARED: usize = 168 * 1024;

/// The default window length from which MLA tokens run 4 to a block (`mla_split_heads_tokens`, every cache tile
/// staged once for 4 tokens of the row): every verify window and prefill chunk; decode rows run one token to a
/// block (`mla_split_heads`, two blocks per SM). Measured in docs/perf/decisions.md#d84.
pub const MLA_GROUP_FROM_TOKENS: usize = 2;

/// The dynamic shared memory of the head-group kernels for cache entries of `ld` bf16 and `tokens` tokens per
/// block: Q `[16 tokens, ld + pad]`, the staged tile `[64, ld + pad]`, and P_hi and P_lo `[16, 64 + pad]` per token,
/// bf16.
fn heads_shared_bytes(ld: usize, tokens: usize) -> usize {
    ((HEADS_TILE * tokens + HEADS_KV_TILE) * (ld + HEADS_ROW_PAD)
        + 2 * tokens * HEADS_TILE * (HEADS_KV_TILE + HEADS_ROW_PAD))
        * 2
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
        && heads_shared_bytes(r + rope, 1) <= HEADS_MAX_SHARED
        && heads_shared_bytes(r + rope, HEADS_TOKENS) <= HEADS_TOKENS_MAX_SHARED
}

/// The default window length from which KDA runs its chunked form: never. Measured on an H200
/// (docs/perf/decisions.md#d52; one row, 96 heads of 128) the CUDA-core chunked kernel is no faster than the recurrent
/// one (16 / 64 / 256 / 2,048 tokens: 0.083 / 0.260 / 1.060 / 8.41 ms against 0.083 / 0.259 / 1.002 /
/// 8.02 ms): both are bound by one block per head walking its tokens in order. The chunked form pays off
/// once its three 16 x 128 x 128 products per chunk run on tensor cores and its state-independent part
/// (conv, norms, L, A, W, U) runs for all chunks in parallel, as in fla's chunk_kda; until then it is
/// selected only through `DeviceModel::kda_chunked_min` (`cuda::forward`).
pub const KDA_CHUNKED_MIN_TOKENS: usize = usize::MAX;

/// The kernels of `kda.cu` and `mla.cu`.
pub struct AttnKernels {
    /// `kda_step_{32,128}` and `kda_chunk_{32,128}`, by head dim ([`KDA_HEAD_DIMS`]).
    kda_step: [CudaFunction; 2],
    kda_chunk: [CudaFunction; 2],
    mla_norm_append: CudaFunction,
    mla_absorb: CudaFunction,
    mla_split: CudaFunction,
    /// `mla_split` for 16 heads per block on the tensor cores, where [`heads_kernel_fits`], and its form for 4
    /// tokens of a window per block: present from Hopper on (they stage the cache by TMA).
    mla_split_heads: Option<[CudaFunction; 2]>,
    mla_out: CudaFunction,
}

/// The head dims the KDA kernels are instantiated for (k3-tiny and K3).
const KDA_HEAD_DIMS: [usize; 2] = [32, 128];

impl AttnKernels {
    /// Looks the kernels up in `gpu`'s module store (`mla_split_heads` from Hopper on: it needs TMA and mbarriers).
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let f = |name: &str| gpu.function(name);
        let by_dim = |prefix: &str| -> Result<[CudaFunction; 2]> {
            Ok([f(&format!("{prefix}_32"))?, f(&format!("{prefix}_128"))?])
        };
        let mla_split_heads = if gpu.hopper() {
            let (one, tokens) = (f("mla_split_heads")?, f("mla_split_heads_tokens")?);
            allow_shared_memory(&one, HEADS_MAX_SHARED, "mla_split_heads")?;
            allow_shared_memory(&tokens, HEADS_TOKENS_MAX_SHARED, "mla_split_heads_tokens")?;
            Some([one, tokens])
        } else {
            None
        };
        Ok(AttnKernels {
            kda_step: by_dim("kda_step")?,
            kda_chunk: by_dim("kda_chunk")?,
            mla_norm_append: f("mla_norm_append")?,
            mla_absorb: f("mla_absorb")?,
            mla_split: f("mla_split")?,
            mla_split_heads,
            mla_out: f("mla_out")?,
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

/// The q_a and kv_a RMSNorms of every token of a step and the append of its latent entry to its row's cache:
/// `qa_n = q_a_norm(qa)` (`qa`, `qa_n` `[n, q_lora_rank]` bf16), and the entry `[kv_a_norm(kva[.., ..r]) |
/// kva[.., r..]]` from `kva` `[n, latent_dim]` bf16 (left unchanged). `q_norm` and `kv_norm` are each norm's bf16
/// weight and epsilon.
#[derive(Clone, Copy, Debug)]
pub struct MlaAppendArgs {
    pub qa: DPtr,
    pub qa_n: DPtr,
    pub kva: DPtr,
    pub q_norm: (DPtr, f32),
    pub kv_norm: (DPtr, f32),
}

/// Absorbed MLA attention of every token of a step over its row's cache: `q` `[n, H * (nope + rope)]`, `kv_b`
/// `[H * (nope + v), r]`, `out` `[n, H * v]` (bf16); with `gate` (`[n, H * v]` logits) `out = bf(o *
/// bf(sigmoid(gate)))`, else the values `o` themselves.
#[derive(Clone, Copy, Debug)]
pub struct MlaAttentionArgs {
    pub q: DPtr,
    pub kv_b: DPtr,
    pub gate: Option<DPtr>,
    pub out: DPtr,
}

/// What every split kernel (`mla_split`, `mla_split_heads`, `mla_split_heads_tokens`) takes: the table, the
/// queries `[n, H, nope + rope]` (bf16) and absorbed queries `q_lat` `[n, H, r]` (f32), the partials `part_o`
/// `[n, H, splits, r]`, `part_m` and `part_l` `[n, H, splits]` (f32), then `[H, nope, rope, r]` and the scale.
struct SplitArgs<'a> {
    table: &'a MlaTable,
    q: DPtr,
    q_lat: DPtr,
    part_o: DPtr,
    part_m: DPtr,
    part_l: DPtr,
    ints: &'a [i32],
    scale: f32,
}

impl SplitArgs<'_> {
    /// Launches `func` with these arguments and, for the head-group kernels, the window length `group_from` from
    /// which `mla_split_heads_tokens` takes a row.
    fn launch(
        &self,
        gpu: &Gpu,
        func: &CudaFunction,
        name: &str,
        cfg: LaunchConfig,
        group_from: Option<i32>,
    ) -> Result<()> {
        let mut b = gpu.launcher(func);
        b.arg(&self.table.entries).arg(&self.table.tok_row).arg(&self.q).arg(&self.q_lat);
        b.arg(&self.part_o).arg(&self.part_m).arg(&self.part_l);
        for x in self.ints {
            b.arg(x);
        }
        b.arg(&self.scale);
        if let Some(g) = &group_from {
            b.arg(g);
        }
        // SAFETY: the caches hold every visible entry (appended before); the partials hold [n, H, splits(, r)] for
        // the table's n tokens and splits; q and q_lat hold the step's n tokens (callers' contract).
        unsafe { b.launch(cfg, name) }
    }
}

/// Whether the MLA kernels take `m`'s widths (a clear error naming the width that does not fit): a kv_lora_rank
/// that is a multiple of 8 and at most 512, a qk_nope_head_dim that is a whole number of `mla_absorb`'s k-steps and
/// at most 128, and a qk_rope_head_dim in 16-byte pieces.
pub fn check_mla_shape(m: &MlaConfig) -> Result<()> {
    let (r, nope, rope) = (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim);
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
    Ok(())
}

/// Whether the KDA kernels take a head dim of `dk` and a conv kernel of `kw` taps (a clear error naming the one
/// that does not fit); returns the index of `dk`'s kernels.
pub fn check_kda_shape(dk: usize, kw: usize) -> Result<usize> {
    let which = KDA_HEAD_DIMS
        .iter()
        .position(|d| *d == dk)
        .ok_or_else(|| KernelError::InvalidInput(format!("KDA head_dim {dk} is not supported on CUDA (32 or 128)")))?;
    if !(1..=8).contains(&kw) {
        return Err(KernelError::InvalidInput(format!("conv kernel {kw} is not supported on CUDA (1..=8)")));
    }
    Ok(which)
}

impl AttnKernels {
    /// Conv, gates, norms, recurrence (or chunked form) and gated norm of KDA layer `layer` for every row of
    /// the step: one launch per form present (see `kda.cu`).
    pub fn kda_layer(&self, gpu: &Gpu, tables: &StepTables, layer: usize, dk: usize, args: &KdaArgs) -> Result<()> {
        let which = check_kda_shape(dk, args.kw.max(0) as usize)?;
        if tables.rows == 0 {
            return Ok(());
        }
        let table = tables.kda + (layer * tables.rows * KDA_ENTRY * 8) as u64;
        // The recurrent kernel runs two threads per channel, the chunked one one.
        let forms = [
            (tables.any_recurrent, &self.kda_step[which], "kda_step", 2 * dk),
            (tables.any_chunked, &self.kda_chunk[which], "kda_chunk", dk),
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
            let mut b = gpu.launcher(func);
            b.arg(&table).arg(args);
            // SAFETY: the table's addresses are live buffers of the rows' states and undo records, and the
            // argument buffers are `[n, ..]` as documented on `KdaArgs` (callers' contract).
            unsafe { b.launch(cfg, name) }?;
        }
        Ok(())
    }

    /// The q_a and kv_a RMSNorms of every token of the step and the append of its latent entry to its row's cache
    /// of MLA layer `layer`, in one launch (see [`MlaAppendArgs`]).
    pub fn mla_norm_append(
        &self,
        gpu: &Gpu,
        m: &MlaConfig,
        tables: &StepTables,
        layer: usize,
        a: &MlaAppendArgs,
    ) -> Result<()> {
        let MlaAppendArgs { qa, qa_n, kva, q_norm, kv_norm } = *a;
        if tables.rows == 0 {
            return Ok(());
        }
        let table = tables.mla_table(layer).entries;
        let cfg = LaunchConfig {
            grid_dim: (tables.max_t as u32, tables.rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (q_rank, width, r) = (m.q_lora_rank as i32, m.latent_dim() as i32, m.kv_lora_rank as i32);
        let mut b = gpu.launcher(&self.mla_norm_append);
        b.arg(&table).arg(&qa).arg(&qa_n).arg(&q_norm.0).arg(&q_rank).arg(&q_norm.1);
        b.arg(&kva).arg(&kv_norm.0).arg(&width).arg(&r).arg(&kv_norm.1);
        // SAFETY: every cache was grown to hold its window when the table was built; qa, qa_n and kva hold
        // the step's n tokens (callers' contract).
        unsafe { b.launch(cfg, "mla_norm_append") }
    }

    /// Absorbed MLA attention of every token of `table` over its window's cache (see [`MlaAttentionArgs`]): a
    /// target step's layer (`StepTables::mla_table`) or the drafter's block (`MlaWindows`). Three launches: the
    /// absorbed queries, the split attention, the merge with `W_UV` and the gate.
    pub fn mla_attention(&self, gpu: &Gpu, m: &MlaConfig, table: &MlaTable, a: &MlaAttentionArgs) -> Result<()> {
        let MlaAttentionArgs { q, kv_b, gate, out } = *a;
        let (h, r, nope, rope, vdim) =
            (m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
        check_mla_shape(m)?;
        let n = table.n;
        if n == 0 {
            return Ok(());
        }
        // Every element of these is written before it is read: q_lat by mla_absorb (all tokens, heads and
        // columns), the partials by the split kernels (every split of every token and head, empty ones included).
        let q_lat = gpu.uninit::<f32>(n * h * r)?; // [n, H, r]
        let splits = table.splits;
        let part_o = gpu.uninit::<f32>(n * h * splits * r)?; // [n, H, splits, r]
        let part_m = gpu.uninit::<f32>(n * h * splits)?; // [n, H, splits]
        let part_l = gpu.uninit::<f32>(n * h * splits)?; // [n, H, splits]
        let (q_lat, part_o, part_m, part_l) = (gpu.ptr(&q_lat), gpu.ptr(&part_o), gpu.ptr(&part_m), gpu.ptr(&part_l));
        let ints = |xs: &[usize]| xs.iter().map(|x| *x as i32).collect::<Vec<i32>>();
        let token_blocks = n.div_ceil(BLOCK_TOKENS) as u32;

        let cfg = LaunchConfig {
            grid_dim: (h as u32, r.div_ceil(ABSORB_COLS) as u32, token_blocks),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let a = ints(&[n, h, nope, rope, vdim, r]);
        let mut b = gpu.launcher(&self.mla_absorb);
        b.arg(&q).arg(&kv_b).arg(&q_lat);
        for x in &a {
            b.arg(x);
        }
        // SAFETY: shapes as documented; q_lat holds [n, H, r]; r % 8 == 0 keeps the 16-byte weight loads aligned.
        unsafe { b.launch(cfg, "mla_absorb") }?;

        let scale = 1.0f32 / (m.q_head_dim() as f32).sqrt();
        // Heads in groups of 16 per cache tile where the device and the shapes allow (the cache is read once per
        // group, not once per head), else one block per head.
        let heads = self.mla_split_heads.as_ref().filter(|_| heads_kernel_fits(r, rope, nope));
        let a = ints(&[h, nope, rope, r]);
        let split_args = SplitArgs { table, q, q_lat, part_o, part_m, part_l, ints: &a, scale };
        match heads {
            Some([one, tokens]) => {
                // Windows of at least group_from tokens run 4 to a block, the others one to a block; each kernel
                // returns at once from the other's blocks, and runs only when the table has rows for it.
                let group_from = table.group_from.min(i32::MAX as usize) as i32;
                for (func, name, tokens_per_block, has_rows) in [
                    (one, "mla_split_heads", 1, table.min_t < table.group_from),
                    (tokens, "mla_split_heads_tokens", HEADS_TOKENS, table.max_t >= table.group_from),
                ] {
                    if !has_rows {
                        continue;
                    }
                    let cfg = LaunchConfig {
                        grid_dim: (splits as u32, h.div_ceil(HEADS_TILE) as u32, n as u32),
                        block_dim: (128 * tokens_per_block as u32, 1, 1),
                        shared_mem_bytes: heads_shared_bytes(r + rope, tokens_per_block) as u32,
                    };
                    split_args.launch(gpu, func, name, cfg, Some(group_from))?;
                }
            }
            None => {
                let cfg = LaunchConfig {
                    grid_dim: (splits as u32, h as u32, n as u32),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: ((r + rope) * 4) as u32,
                };
                split_args.launch(gpu, &self.mla_split, "mla_split", cfg, None)?;
            }
        }

        let cfg = LaunchConfig {
            grid_dim: (h as u32, vdim.div_ceil(OUT_CHANNELS) as u32, token_blocks),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let gate: DPtr = gate.unwrap_or(0);
        let a = ints(&[n, splits, h, nope, vdim, r]);
        let mut b = gpu.launcher(&self.mla_out);
        b.arg(&part_o).arg(&part_m).arg(&part_l).arg(&kv_b).arg(&gate).arg(&out);
        for x in &a {
            b.arg(x);
        }
        // SAFETY: as above; gate (when non-null) and out hold [n, H * v].
        unsafe { b.launch(cfg, "mla_out") }
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
        assert_eq!(HEADS_TOKENS as u32, source_define("mla.cu", "HEADS_TOKENS"));
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
        // K3: 512 + 64 wide entries, 98,048 bytes of staging (two blocks per SM on an H200), and 167,936 for 4
        // tokens a block (one block of 16 warps per SM).
        assert_eq!(heads_shared_bytes(576, 1), 98_048);
        assert_eq!(heads_shared_bytes(576, HEADS_TOKENS), 167_936);
        assert!(heads_kernel_fits(512, 64, 128));
        assert!(heads_kernel_fits(32, 16, 32));
        // Entries not a whole number of MMA k-steps, ranks not split into 8-channel tiles over 4 warps, ranks past
        // every MLA kernel's limit and query rows not in aligned chunks of 8 go to mla_split.
        assert!(!heads_kernel_fits(512, 40, 128));
        assert!(!heads_kernel_fits(48, 16, 128));
        assert!(!heads_kernel_fits(1024, 64, 128));
        assert!(!heads_kernel_fits(512, 64, 100));
    }
}
