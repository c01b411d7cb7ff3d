//! A sequence's state on the device ([`DeviceState`]: every KDA layer's recurrent state and conv windows, every
//! MLA layer's latent cache), a forward's per-sequence input ([`DeviceRow`]), and what a verify window keeps to
//! be cut back ([`DeviceUndo`]).
//!
//! Invariants:
//! - The same layout as the CPU reference's `state::SeqState`: KDA states `[H, dk, dk]` fp32, conv windows
//!   `[kernel - 1, P]` bf16 oldest first, MLA latents `[len, latent_dim]` bf16; [`DeviceState::export`] and
//!   [`DeviceState::import`] convert between the two exactly (bf16 values widen to f32 and back unchanged).
//! - An MLA cache holds `capacity >= len` entries, grown by doubling (`reserve`) with its contents kept; the
//!   entries past `len` are scratch, overwritten by later appends.
//! - [`DeviceUndo::commit`] restores the KDA states and conv windows saved after the kept token and moves the
//!   length back; the MLA entries past it are simply overwritten later.

use cudarc::driver::CudaSlice;
use half::bf16;

use crate::config::ModelConfig;
use crate::cuda::gpu::Gpu;
use crate::error::{KernelError, Result};
use crate::runner::TokenId;
use crate::state::{KdaState, MlaCache, SeqState, MLA_BLOCK_TOKENS};

/// Elements per chunk of an export's streamed copies: 8 MB of f32 (`cuda::staging::CHUNK_BYTES`), 4 MB of bf16.
const EXPORT_CHUNK: usize = 2 << 20;

/// One KDA layer's state on the device.
pub struct DeviceKda {
    /// `[H, dk, dk]` fp32
    pub s: CudaSlice<f32>,
    /// q, k, v windows, each `[kernel - 1, P]` bf16, oldest first.
    pub conv: [CudaSlice<bf16>; 3],
}

/// One MLA layer's latent cache on the device: `[capacity, latent_dim]` bf16, the first `len` valid.
pub struct DeviceMla {
    pub cache: CudaSlice<bf16>,
    pub capacity: usize,
}

/// A sequence's state on the device.
pub struct DeviceState {
    pub len: usize,
    pub kda: Vec<DeviceKda>,
    pub mla: Vec<DeviceMla>,
}

impl DeviceState {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig) -> Result<Self> {
        let k = &cfg.kda;
        let window = (k.conv_kernel - 1) * k.proj_dim();
        let mut kda = Vec::new();
        for _ in cfg.kda_layers() {
            kda.push(DeviceKda {
                s: gpu.zeros(k.num_heads * k.head_dim * k.head_dim)?,
                conv: [gpu.zeros(window)?, gpu.zeros(window)?, gpu.zeros(window)?],
            });
        }
        let mut mla = Vec::new();
        for _ in cfg.mla_layers() {
            mla.push(DeviceMla { cache: gpu.zeros(0)?, capacity: 0 });
        }
        Ok(DeviceState { len: 0, kda, mla })
    }

    /// A device copy of `self`.
    pub fn duplicate(&self, gpu: &Gpu, cfg: &ModelConfig) -> Result<Self> {
        let mut out = DeviceState::new(gpu, cfg)?;
        out.len = self.len;
        for (dst, src) in out.kda.iter_mut().zip(&self.kda) {
            gpu.copy::<f32>(gpu.ptr(&dst.s), gpu.ptr(&src.s), src.s.len())?;
            for (d, s) in dst.conv.iter().zip(&src.conv) {
                gpu.copy::<bf16>(gpu.ptr(d), gpu.ptr(s), s.len())?;
            }
        }
        let ld = cfg.mla.latent_dim();
        for (dst, src) in out.mla.iter_mut().zip(&self.mla) {
            reserve(gpu, dst, self.len, ld)?;
            gpu.copy::<bf16>(gpu.ptr(&dst.cache), gpu.ptr(&src.cache), self.len * ld)?;
        }
        Ok(out)
    }

    /// Device bytes the state holds.
    pub fn bytes(&self, cfg: &ModelConfig) -> usize {
        let kda: usize =
            self.kda.iter().map(|k| k.s.len() * 4 + k.conv.iter().map(|c| c.len() * 2).sum::<usize>()).sum();
        kda + self.mla.iter().map(|m| m.capacity * cfg.mla.latent_dim() * 2).sum::<usize>()
    }

    /// A host copy in the CPU reference's layout (f32 values; conv windows and latents are bf16 values).
    pub fn export(&self, gpu: &Gpu, cfg: &ModelConfig) -> Result<SeqState<f32>> {
        let widened = |b: &CudaSlice<bf16>| -> Result<Vec<f32>> {
            let mut out = Vec::with_capacity(b.len());
            gpu.download_chunked::<bf16>(gpu.ptr(b), b.len(), EXPORT_CHUNK, |_, x| {
                out.extend(x.iter().map(|v| v.to_f32()))
            })?;
            Ok(out)
        };
        let mut kda = Vec::with_capacity(self.kda.len());
        for k in &self.kda {
            let mut s = Vec::with_capacity(k.s.len());
            gpu.download_chunked::<f32>(gpu.ptr(&k.s), k.s.len(), EXPORT_CHUNK, |_, x| s.extend_from_slice(x))?;
            kda.push(KdaState { s, conv: [widened(&k.conv[0])?, widened(&k.conv[1])?, widened(&k.conv[2])?] });
        }
        let ld = cfg.mla.latent_dim();
        let block = MLA_BLOCK_TOKENS * ld;
        let mut mla = Vec::with_capacity(self.mla.len());
        for m in &self.mla {
            // Whole blocks per chunk, each widened straight into its host block (the last one zero-padded).
            let mut blocks: Vec<Vec<f32>> = Vec::with_capacity(self.len.div_ceil(MLA_BLOCK_TOKENS));
            let chunk = (EXPORT_CHUNK / block).max(1) * block;
            gpu.download_chunked::<bf16>(gpu.ptr(&m.cache), self.len * ld, chunk, |_, x| {
                for part in x.chunks(block) {
                    let mut b = Vec::with_capacity(block);
                    b.extend(part.iter().map(|v| v.to_f32()));
                    b.resize(block, 0.0);
                    blocks.push(b);
                }
            })?;
            let cache = MlaCache::from_blocks(ld, self.len, blocks)
                .ok_or_else(|| KernelError::Device("an exported MLA cache does not hold its length".into()))?;
            mla.push(cache);
        }
        Ok(SeqState { len: self.len, kda, mla })
    }

    /// Uploads a host state (checked against the model's layers by the caller).
    pub fn import(gpu: &Gpu, cfg: &ModelConfig, host: &SeqState<f32>) -> Result<Self> {
        let narrowed = |v: &[f32]| -> Result<CudaSlice<bf16>> {
            let dev = gpu.uninit::<bf16>(v.len())?; // written in full by the copies
            gpu.upload_chunked::<bf16>(gpu.ptr(&dev), v.len(), EXPORT_CHUNK, |off, out| {
                out.iter_mut().zip(&v[off..]).for_each(|(o, x)| *o = bf16::from_f32(*x))
            })?;
            Ok(dev)
        };
        let mut kda = Vec::with_capacity(host.kda.len());
        for k in &host.kda {
            let s = gpu.uninit::<f32>(k.s.len())?; // written in full by the copies
            gpu.upload_chunked::<f32>(gpu.ptr(&s), k.s.len(), EXPORT_CHUNK, |off, out| {
                out.copy_from_slice(&k.s[off..off + out.len()])
            })?;
            kda.push(DeviceKda { s, conv: [narrowed(&k.conv[0])?, narrowed(&k.conv[1])?, narrowed(&k.conv[2])?] });
        }
        let ld = cfg.mla.latent_dim();
        let mut mla = Vec::with_capacity(host.mla.len());
        for m in &host.mla {
            let mut dev = DeviceMla { cache: gpu.zeros(0)?, capacity: 0 };
            reserve(gpu, &mut dev, m.len(), ld)?;
            // Whole entries per chunk, each narrowed straight from its host block.
            let chunk = (EXPORT_CHUNK / ld).max(1) * ld;
            gpu.upload_chunked::<bf16>(gpu.ptr(&dev.cache), m.len() * ld, chunk, |off, out| {
                for (i, row) in out.chunks_mut(ld).enumerate() {
                    row.iter_mut().zip(m.entry(off / ld + i)).for_each(|(o, x)| *o = bf16::from_f32(*x));
                }
            })?;
            mla.push(dev);
        }
        Ok(DeviceState { len: host.len, kda, mla })
    }
}

/// The fewest entries an MLA cache is allocated with.
pub const MLA_MIN_CAPACITY: usize = 64;

/// Grows an MLA cache to hold at least `tokens` entries (doubling), keeping its contents.
pub(crate) fn reserve(gpu: &Gpu, m: &mut DeviceMla, tokens: usize, ld: usize) -> Result<()> {
    if tokens <= m.capacity {
        return Ok(());
    }
    let capacity = tokens.max(2 * m.capacity).max(MLA_MIN_CAPACITY);
    let fresh = gpu.zeros::<bf16>(capacity * ld)?;
    if m.capacity > 0 {
        gpu.copy::<bf16>(gpu.ptr(&fresh), gpu.ptr(&m.cache), m.capacity * ld)?;
    }
    m.cache = fresh;
    m.capacity = capacity;
    Ok(())
}

/// What a verify window keeps on the device to be cut back to an accepted prefix.
pub struct DeviceUndo {
    /// The state's length before the window, the first token a cut may keep up to, and the window's tokens.
    pub(crate) start_len: usize,
    pub(crate) from: usize,
    pub(crate) window_len: usize,
    pub(crate) kda: KdaUndo,
}

/// The KDA part of a [`DeviceUndo`], every KDA layer of one row (written by the batched KDA kernel).
pub struct KdaUndo {
    /// The states after `m` tokens for `from <= m < window_len`, `[layers, window_len - from, H, dk, dk]`.
    pub(crate) snaps: CudaSlice<f32>,
    /// The q/k/v conv histories `[layers, 3, kernel - 1 + window_len, P]` (old window, then the window's inputs).
    pub(crate) hist: CudaSlice<bf16>,
}

impl DeviceUndo {
    /// Keeps the first `m` tokens of the window in `state`.
    pub fn commit(self, gpu: &Gpu, cfg: &ModelConfig, state: &mut DeviceState, m: usize) -> Result<()> {
        crate::state::check_commit(m, self.from, self.window_len)?;
        if m == self.window_len {
            return Ok(());
        }
        let k = &cfg.kda;
        let (state_len, p, kw) = (k.num_heads * k.head_dim * k.head_dim, k.proj_dim(), k.conv_kernel);
        let (snaps, hist) = (gpu.ptr(&self.kda.snaps), gpu.ptr(&self.kda.hist));
        let kept = self.window_len - self.from;
        let hist_len = kw - 1 + self.window_len;
        for (l, layer) in state.kda.iter_mut().enumerate() {
            let snap = snaps + ((l * kept + m - self.from) * state_len * 4) as u64;
            gpu.copy::<f32>(gpu.ptr(&layer.s), snap, state_len)?;
            for (x, window) in layer.conv.iter().enumerate() {
                let rows = hist + (((l * 3 + x) * hist_len + m) * p * 2) as u64;
                gpu.copy::<bf16>(gpu.ptr(window), rows, (kw - 1) * p)?;
            }
        }
        state.len = self.start_len + m;
        Ok(())
    }
}

/// One sequence's window in a forward call.
pub struct DeviceRow<'a> {
    pub state: &'a mut DeviceState,
    pub tokens: &'a [TokenId],
    /// Logits are produced for window positions `logits_from..tokens.len()`.
    pub logits_from: usize,
    /// Keep what is needed to commit only the first `m >= snapshots_from` tokens afterwards.
    pub snapshots_from: Option<usize>,
}
