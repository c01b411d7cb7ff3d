//! The per-step row table the batched KDA and MLA kernels read ([`StepTables`]), uploaded once per step into a
//! device buffer the model keeps ([`StepBuffer`]).
//!
//! Invariants:
//! - One table per step: per (KDA layer, row) the state, conv-window and snapshot addresses and the row's
//!   token range and form; per (MLA layer, row) the cache address, length before the window, token range and
//!   split span; per token its row; then the step's token ids and the positions whose logits are wanted
//!   (u32). It is built on the host after every MLA cache of the step has been grown, and uploaded once
//!   into the [`StepBuffer`] through page-locked memory without the host waiting (stream order keeps an
//!   earlier step's kernels reading the old contents), so that a captured step (`cuda::graph`) reads its
//!   inputs through fixed addresses and nothing else is copied from the host during a step. A fed step's
//!   token ids are then copied in on the device from the step before it ([`TableSpec::fed_tokens`]).
//! - The MLA split count of a step (the grid of `mla_split` and `mla_split_heads`) is rounded up to a power
//!   of two: splits past a token's last are empty and merge as exact zeros, so results do not change, and
//!   steps whose longest context grows share a captured graph until the count doubles.
//! - A row's KDA form and MLA split span depend only on that row (its window length, snapshots and
//!   cache length), never on the batch, so every row's result is independent of the other rows.
//! - Windows that keep snapshots (verify windows) always run the recurrent form; the chunked form takes
//!   windows of at least `DeviceModel::kda_chunked_min` (`cuda::forward`) tokens.
//! - Layouts match the `#define`s at the top of `kda.cu` (`KDA_ENTRY`) and `mla.cu` (`MLA_ENTRY`).

use std::sync::Mutex;

use cudarc::driver::CudaSlice;
use half::bf16;

use crate::config::ModelConfig;
use crate::cuda::attn::MLA_GROUP_FROM_TOKENS;
use crate::cuda::gpu::Gpu;
use crate::cuda::launch::DPtr;
use crate::cuda::state::{reserve, DeviceRow, KdaUndo};
use crate::error::{KernelError, Result};

/// i64 fields per (KDA layer, row) entry: S, 3 conv windows, snapshots, history, offset, t, from, form. Even, so
/// that every entry of the table (a fresh allocation) is 16-byte aligned: `kda_step` reads it in 16-byte loads.
pub const KDA_ENTRY: usize = 10;
const _: () = assert!(KDA_ENTRY % 2 == 0);
/// i64 fields per (MLA layer, row) entry: cache, first, offset, t, split span.
pub const MLA_ENTRY: usize = 5;
/// Positions per tile of the MLA split kernel (`TILE` in `mla.cu`).
pub const MLA_TILE: usize = 64;
/// The smallest split span of a decode / verify row, and the most splits one token gets.
pub const MLA_MIN_SPAN: usize = 256;
pub const MLA_MAX_SPLITS: usize = 64;
/// Rows of at most this many tokens are split over their cache as finely as [`MLA_MIN_SPAN`] allows (decode and
/// verify windows, whose tokens must split exactly as a decode token does: see the module invariants).
const MLA_SPLIT_MAX_WINDOW: usize = 16;
/// The default [`TableSpec::mla_chunk_split_tokens`]: a longer window (a prefill chunk) gets about this many
/// (token, split) pairs, at least one split per token. Its tokens run 4 to a block in `mla_split_heads_tokens`, so
/// a 64-token chunk in one split per token would give 16 blocks per head group, fewer than the SMs, each walking
/// the whole context; 8 splits fill the GPU, and the partials stay `t × splits ≈ 512` per head (100 MB at K3's
/// widths for 64 tokens), where one split per decode-sized span would write 64 per token.
pub const MLA_CHUNK_SPLIT_TOKENS: usize = 512;

/// The device buffer the step tables are uploaded into, kept for the model's life.
#[derive(Default)]
pub struct StepBuffer {
    buf: Mutex<Option<CudaSlice<i64>>>,
}

impl StepBuffer {
    /// Uploads `bytes` into the buffer (grown by doubling) and returns its device address. The copy is
    /// stream-ordered and does not make the host wait: it lands after every kernel issued before it (an
    /// earlier step still reading the old contents) and before every kernel issued after it.
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
        gpu.upload_async_at(ptr, bytes)?;
        Ok(ptr)
    }
}

/// What a step's table is built from besides its rows.
#[derive(Clone, Copy)]
pub struct TableSpec<'a> {
    /// `offsets[r]..offsets[r + 1]` are row `r`'s tokens among the step's.
    pub offsets: &'a [usize],
    /// Step positions whose logits are produced.
    pub wanted: &'a [u32],
    /// Windows of at least this many tokens without snapshots take the chunked KDA form.
    pub chunked_min: usize,
    /// About how many (token, split) pairs a window longer than a verify window gets ([`mla_span`]).
    pub mla_chunk_split_tokens: usize,
    /// Windows of at least this many tokens run 4 tokens to a block of `mla_split_heads_tokens` ([`MlaTable`]).
    pub mla_group_from: usize,
    /// A fed step (`crate::launches`): its token ids (u32, one per row) are copied from this device address
    /// after the upload, in place of the rows' placeholder tokens.
    pub fed_tokens: Option<DPtr>,
}

/// A step's tables on the device and what the rows keep for rollback.
pub struct StepTables {
    /// The table's device address (what a captured step reads it through).
    base: DPtr,
    /// `[kda layers, rows, KDA_ENTRY]`, `[mla layers, rows, MLA_ENTRY]`, `[n]` token rows (i64).
    pub(crate) kda: DPtr,
    pub(crate) mla: DPtr,
    pub(crate) tok_row: DPtr,
    /// `[n]` token ids and `[wanted]` step positions whose logits are produced (u32).
    token_ids: DPtr,
    wanted: DPtr,
    wanted_len: usize,
    pub(crate) rows: usize,
    /// Tokens of the step, of its shortest row and of its longest row.
    pub(crate) n: usize,
    pub(crate) min_t: usize,
    pub(crate) max_t: usize,
    /// Splits of the most split token (the grid of `mla_split`).
    pub(crate) mla_splits: usize,
    /// The spec's [`TableSpec::mla_group_from`].
    pub(crate) mla_group_from: usize,
    pub(crate) any_chunked: bool,
    pub(crate) any_recurrent: bool,
    /// Per row: the snapshots and conv histories of every KDA layer (rows that asked for snapshots).
    pub(crate) undo: Vec<Option<KdaUndo>>,
}

/// The split span of an MLA row whose window has `t` tokens after `first` cached ones: windows of up to
/// [`MLA_SPLIT_MAX_WINDOW`] tokens in up to [`MLA_MAX_SPLITS`] splits of at least [`MLA_MIN_SPAN`] positions,
/// longer ones in about `chunk_split_tokens / t` splits (one when that is 0), in whole tiles.
pub fn mla_span(first: usize, t: usize, chunk_split_tokens: usize) -> usize {
    let visible = first + t;
    let splits = if t <= MLA_SPLIT_MAX_WINDOW {
        MLA_MAX_SPLITS
    } else {
        match chunk_split_tokens / t {
            0 | 1 => return visible,
            pairs => pairs.min(MLA_MAX_SPLITS),
        }
    };
    visible.div_ceil(splits).div_ceil(MLA_TILE).max(1).saturating_mul(MLA_TILE).max(MLA_MIN_SPAN)
}

/// The MLA split grid of a table whose most split window has `splits` splits: rounded up to a power of two (see
/// the module invariants), at most [`MLA_MAX_SPLITS`].
pub fn mla_grid_splits(splits: usize) -> usize {
    splits.next_power_of_two().min(MLA_MAX_SPLITS)
}

/// One MLA layer's part of a table, as the MLA attention kernels read it: `[windows, MLA_ENTRY]` i64 entries,
/// `[n]` i64 the window of each token, and the split grid.
#[derive(Clone, Copy, Debug)]
pub struct MlaTable {
    pub(crate) entries: DPtr,
    pub(crate) tok_row: DPtr,
    pub(crate) n: usize,
    pub(crate) splits: usize,
    /// Tokens of the table's shortest and longest window.
    pub(crate) min_t: usize,
    pub(crate) max_t: usize,
    /// Windows of at least this many tokens run in `mla_split_heads_tokens` (4 tokens to a block), shorter ones in
    /// `mla_split_heads` (`cuda::attn`).
    pub(crate) group_from: usize,
}

/// MLA windows laid out as a step table's MLA part (`[layers, windows, MLA_ENTRY]`, then `[n]` token windows),
/// for attention outside a target step (the DSpark drafter's block). Window `w` holds `t` tokens at step offset
/// `offset` after `first` cached entries; the same windows are used in every layer, each with its own caches.
#[derive(Debug, Default)]
pub struct MlaWindows {
    /// Per window: (first, offset, t).
    windows: Vec<(usize, usize, usize)>,
    n: usize,
}

impl MlaWindows {
    /// Adds a window of `t` tokens starting at step token `offset`, after `first` cached entries. Windows are
    /// added in step-token order and cover the tokens without gaps.
    pub fn push(&mut self, first: usize, offset: usize, t: usize) -> Result<()> {
        if offset != self.n || t == 0 {
            return Err(KernelError::InvalidInput(format!(
                "an MLA window of {t} tokens at step token {offset} does not follow the {} tokens before it",
                self.n
            )));
        }
        self.windows.push((first, offset, t));
        self.n += t;
        Ok(())
    }

    /// Uploads the table with `caches[layer][window]` as each window's cache in each layer; the caches must hold
    /// `first + t` entries. Returns the buffer (to keep alive while the kernels run) and each layer's view.
    pub fn upload(&self, gpu: &Gpu, caches: &[Vec<DPtr>]) -> Result<(CudaSlice<i64>, Vec<MlaTable>)> {
        let mut table = Vec::with_capacity((caches.len() * self.windows.len()) * MLA_ENTRY + self.n);
        let mut splits = 1;
        for layer in caches {
            if layer.len() != self.windows.len() {
                return Err(KernelError::InvalidInput(format!(
                    "{} caches for {} MLA windows",
                    layer.len(),
                    self.windows.len()
                )));
            }
            for (cache, &(first, offset, t)) in layer.iter().zip(&self.windows) {
                let span = mla_span(first, t, MLA_CHUNK_SPLIT_TOKENS);
                splits = splits.max((first + t).div_ceil(span));
                table.extend([*cache as i64, first as i64, offset as i64, t as i64, span as i64]);
            }
        }
        for (w, &(_, _, t)) in self.windows.iter().enumerate() {
            table.extend(std::iter::repeat_n(w as i64, t));
        }
        let buf = gpu.upload(&table)?;
        let base = gpu.ptr(&buf);
        let layer_bytes = (self.windows.len() * MLA_ENTRY * 8) as u64;
        let tok_row = base + caches.len() as u64 * layer_bytes;
        let splits = mla_grid_splits(splits);
        let views = (0..caches.len())
            .map(|l| MlaTable {
                entries: base + l as u64 * layer_bytes,
                tok_row,
                n: self.n,
                splits,
                min_t: self.windows.iter().map(|w| w.2).min().unwrap_or(0),
                max_t: self.windows.iter().map(|w| w.2).max().unwrap_or(0),
                group_from: MLA_GROUP_FROM_TOKENS,
            })
            .collect();
        Ok((buf, views))
    }
}

impl StepTables {
    /// Grows every MLA cache of the rows to hold their windows, allocates the rows' snapshot buffers, and
    /// uploads the table with the step's token ids and `wanted` logits positions (see [`TableSpec`]).
    pub fn build(
        gpu: &Gpu,
        cfg: &ModelConfig,
        buffer: &StepBuffer,
        rows: &mut [DeviceRow<'_>],
        spec: &TableSpec<'_>,
    ) -> Result<Self> {
        let TableSpec { offsets, wanted, chunked_min, mla_chunk_split_tokens, mla_group_from, fed_tokens } = *spec;
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
                let span = mla_span(first, t, mla_chunk_split_tokens);
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
        if let Some(fed) = fed_tokens {
            if n != nrows {
                return Err(KernelError::InvalidInput(format!(
                    "a fed step has one token per row, not {n} for {nrows} rows"
                )));
            }
            // Stream-ordered after the upload: the fed ids replace the placeholders before any kernel reads them.
            gpu.copy::<u32>(base + token_ids_at, fed, n)?;
        }
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
            min_t: rows.iter().map(|r| r.tokens.len()).min().unwrap_or(0),
            max_t: rows.iter().map(|r| r.tokens.len()).max().unwrap_or(0),
            mla_splits: mla_grid_splits(mla_splits),
            mla_group_from,
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

    /// MLA layer `layer`'s part of the table.
    pub fn mla_table(&self, layer: usize) -> MlaTable {
        MlaTable {
            entries: self.mla + (layer * self.rows * MLA_ENTRY * 8) as u64,
            tok_row: self.tok_row,
            n: self.n,
            splits: self.mla_splits,
            min_t: self.min_t,
            max_t: self.max_t,
            group_from: self.mla_group_from,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mla_windows_cover_the_tokens_in_order() {
        let mut w = MlaWindows::default();
        w.push(10, 0, 1).unwrap();
        w.push(10, 1, 1).unwrap();
        // A window that leaves a gap, repeats a token or holds none is refused, naming the tokens.
        let gap = w.push(4, 3, 1).unwrap_err().to_string();
        assert!(gap.contains("step token 3") && gap.contains("the 2 tokens"), "{gap}");
        assert!(w.push(4, 1, 1).is_err());
        assert!(w.push(4, 2, 0).is_err());
        w.push(4, 2, 3).unwrap();
        assert_eq!(w.n, 5);
    }

    #[test]
    fn decode_rows_split_long_caches_and_chunks_split_by_their_length() {
        let chunks = MLA_CHUNK_SPLIT_TOKENS;
        assert_eq!(mla_span(0, 1, chunks), MLA_MIN_SPAN);
        assert_eq!(mla_span(100, 8, chunks), MLA_MIN_SPAN);
        // 4,096 cached tokens: 16 splits of 256.
        assert_eq!(4097usize.div_ceil(mla_span(4096, 1, chunks)), 17);
        // Very long caches keep at most MLA_MAX_SPLITS splits, in whole tiles.
        let span = mla_span(1_000_000, 1, chunks);
        assert!(1_000_001usize.div_ceil(span) <= MLA_MAX_SPLITS);
        assert_eq!(span % MLA_TILE, 0);
        // A 64-token chunk at a 16,384-token context: 8 splits of 2,056 positions rounded up to whole tiles.
        let span = mla_span(16_384, 64, chunks);
        assert_eq!((span, 16_448usize.div_ceil(span)), (2_112, 8));
        // Short contexts keep the smallest span; chunks of more than half the pairs take one split per token, and so
        // does every chunk without a pair budget.
        assert_eq!(mla_span(100, 64, chunks), MLA_MIN_SPAN);
        assert_eq!(mla_span(10_000, 300, chunks), 10_300);
        assert_eq!(mla_span(16_384, 64, 0), 16_448);
    }
}
