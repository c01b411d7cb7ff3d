//! Per-sequence model state: KDA recurrent states and conv windows, the MLA latent cache.
//!
//! Invariants:
//! - `len` is the number of committed tokens; every MLA cache holds exactly `len` entries and every
//!   KDA state is the state after those `len` tokens.
//! - KDA conv windows hold the last `kernel - 1` pre-conv inputs (oldest first), zeros before the
//!   first token; they are bf16 values in the serving precision.
//! - MLA latent entries live in fixed-size blocks shared copy-on-write between forks: a fork
//!   clones `Arc`s, and a write into a shared block copies that block first.
//! - A verify window is undone by [`SeqState::truncate_mla`] plus restoring the KDA layer states
//!   saved after the last accepted token, which the forward keeps per token for windows.
//!
//! AttnRes has no state across tokens (shared/reference/k3-architecture.md §2.10).

use std::sync::Arc;

use crate::config::{Mixer, ModelConfig};
use crate::float::Real;

/// Tokens per MLA cache block.
pub const MLA_BLOCK_TOKENS: usize = 64;

/// One KDA layer's state.
#[derive(Clone, PartialEq)]
pub struct KdaState<F> {
    /// Recurrent state, `[heads, head_dim (key), head_dim (value)]`, fp32 in serving.
    pub s: Vec<F>,
    /// Pre-conv inputs of q, k and v, each `[kernel - 1, heads * head_dim]`, oldest first.
    pub conv: [Vec<F>; 3],
}

impl<F> std::fmt::Debug for KdaState<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "KdaState {{ s: {} values, conv: {} values }}",
            self.s.len(),
            self.conv.iter().map(Vec::len).sum::<usize>()
        )
    }
}

impl<F: Real> KdaState<F> {
    pub fn zeros(cfg: &ModelConfig) -> Self {
        let k = &cfg.kda;
        let p = k.proj_dim();
        let window = vec![F::ZERO; (k.conv_kernel - 1) * p];
        KdaState {
            s: vec![F::ZERO; k.num_heads * k.head_dim * k.head_dim],
            conv: [window.clone(), window.clone(), window],
        }
    }

    pub fn bytes(&self) -> usize {
        (self.s.len() + self.conv.iter().map(Vec::len).sum::<usize>()) * std::mem::size_of::<F>()
    }
}

/// One MLA layer's latent cache: per token `[c (kv_lora_rank, normalised) | k_rot (rope dim)]`.
/// Two caches are equal when they hold the same entries (what lies past `len` in the tail block is not
/// part of the cache).
#[derive(Clone)]
pub struct MlaCache<F> {
    latent_dim: usize,
    len: usize,
    /// Each block is `[MLA_BLOCK_TOKENS, latent_dim]`.
    blocks: Vec<Arc<Vec<F>>>,
}

impl<F: PartialEq> PartialEq for MlaCache<F> {
    fn eq(&self, other: &Self) -> bool {
        self.latent_dim == other.latent_dim
            && self.len == other.len
            && (0..self.len).all(|t| self.entry(t) == other.entry(t))
    }
}

impl<F> std::fmt::Debug for MlaCache<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MlaCache {{ len: {}, latent_dim: {}, blocks: {} }}", self.len, self.latent_dim, self.blocks.len())
    }
}

impl<F> MlaCache<F> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn latent_dim(&self) -> usize {
        self.latent_dim
    }

    /// The latent entry of token `t` (`t < len`).
    pub fn entry(&self, t: usize) -> &[F] {
        let off = (t % MLA_BLOCK_TOKENS) * self.latent_dim;
        &self.blocks[t / MLA_BLOCK_TOKENS][off..off + self.latent_dim]
    }
}

impl<F: Real> MlaCache<F> {
    pub fn new(latent_dim: usize) -> Self {
        MlaCache { latent_dim, len: 0, blocks: Vec::new() }
    }

    /// A cache of `len` entries from whole blocks (`[MLA_BLOCK_TOKENS, latent_dim]` each, the last one padded),
    /// as a device export builds it; `None` when the blocks do not hold exactly `len` entries.
    pub fn from_blocks(latent_dim: usize, len: usize, blocks: Vec<Vec<F>>) -> Option<Self> {
        let whole = blocks.iter().all(|b| b.len() == MLA_BLOCK_TOKENS * latent_dim);
        (whole && blocks.len() == len.div_ceil(MLA_BLOCK_TOKENS)).then(|| MlaCache {
            latent_dim,
            len,
            blocks: blocks.into_iter().map(Arc::new).collect(),
        })
    }

    /// Appends one entry, copying a shared tail block first.
    pub fn push(&mut self, entry: &[F]) {
        debug_assert_eq!(entry.len(), self.latent_dim);
        let slot = self.len % MLA_BLOCK_TOKENS;
        if slot == 0 && self.len / MLA_BLOCK_TOKENS == self.blocks.len() {
            self.blocks.push(Arc::new(vec![F::ZERO; MLA_BLOCK_TOKENS * self.latent_dim]));
        }
        let block = Arc::make_mut(&mut self.blocks[self.len / MLA_BLOCK_TOKENS]);
        block[slot * self.latent_dim..(slot + 1) * self.latent_dim].copy_from_slice(entry);
        self.len += 1;
    }

    /// Moves the length pointer back to `len` (a rollback); blocks past it are released.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.blocks.truncate(len.div_ceil(MLA_BLOCK_TOKENS));
        }
    }

    /// Bytes of the blocks this cache references (shared blocks are counted in full).
    pub fn bytes(&self) -> usize {
        self.blocks.len() * MLA_BLOCK_TOKENS * self.latent_dim * std::mem::size_of::<F>()
    }

    /// How many of this cache's blocks are shared with another cache.
    pub fn shared_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| Arc::strong_count(b) > 1).count()
    }
}

/// The whole per-sequence state of one model.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState<F = f32> {
    /// Committed tokens.
    pub len: usize,
    /// One per KDA layer, in layer order.
    pub kda: Vec<KdaState<F>>,
    /// One per MLA layer, in layer order.
    pub mla: Vec<MlaCache<F>>,
}

impl<F: Real> SeqState<F> {
    /// The state of an empty sequence.
    pub fn new(cfg: &ModelConfig) -> Self {
        let kda = cfg.layers.iter().filter(|k| k.mixer == Mixer::Kda).map(|_| KdaState::zeros(cfg)).collect();
        let mla =
            cfg.layers.iter().filter(|k| k.mixer == Mixer::Mla).map(|_| MlaCache::new(cfg.mla.latent_dim())).collect();
        SeqState { len: 0, kda, mla }
    }

    /// Checks that this state has the layers and widths of `cfg`'s model (an imported state must).
    pub fn check_fits(&self, cfg: &ModelConfig) -> crate::error::Result<()> {
        let fresh = SeqState::<F>::new(cfg);
        let kda_ok =
            self.kda.len() == fresh.kda.len()
                && self.kda.iter().zip(&fresh.kda).all(|(k, f)| {
                    k.s.len() == f.s.len() && k.conv.iter().zip(&f.conv).all(|(a, b)| a.len() == b.len())
                });
        let latent = cfg.mla.latent_dim();
        let mla_ok = self.mla.len() == fresh.mla.len()
            && self.mla.iter().all(|m| m.len() == self.len && m.latent_dim() == latent);
        if !kda_ok || !mla_ok {
            return Err(crate::error::KernelError::InvalidInput(
                "imported state does not match the model's layers".into(),
            ));
        }
        Ok(())
    }

    /// Rolls every MLA cache back to `len` tokens.
    pub fn truncate_mla(&mut self, len: usize) {
        for c in &mut self.mla {
            c.truncate(len);
        }
    }

    pub fn bytes(&self) -> usize {
        self.kda.iter().map(KdaState::bytes).sum::<usize>() + self.mla.iter().map(MlaCache::bytes).sum::<usize>()
    }

    /// The same state in another precision.
    pub fn convert<G: Real>(&self) -> SeqState<G> {
        let conv = |v: &Vec<F>| v.iter().map(|x| G::from_f64(x.to_f64())).collect::<Vec<G>>();
        SeqState {
            len: self.len,
            kda: self
                .kda
                .iter()
                .map(|k| KdaState { s: conv(&k.s), conv: [conv(&k.conv[0]), conv(&k.conv[1]), conv(&k.conv[2])] })
                .collect(),
            mla: self
                .mla
                .iter()
                .map(|m| {
                    let mut out = MlaCache::new(m.latent_dim);
                    for t in 0..m.len {
                        let e: Vec<G> = m.entry(t).iter().map(|x| G::from_f64(x.to_f64())).collect();
                        out.push(&e);
                    }
                    out
                })
                .collect(),
        }
    }
}

/// Checks that keeping the first `m` tokens of a verify window of `window_len` tokens is possible with state
/// snapshots taken from token `from` on (both backends' undo records).
pub(crate) fn check_commit(m: usize, from: usize, window_len: usize) -> crate::error::Result<()> {
    if m < from || m > window_len {
        return Err(crate::error::KernelError::InvalidInput(format!(
            "cannot commit {m} tokens of a window of {window_len} with snapshots from {from}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_fits_only_its_own_model() {
        let tiny = ModelConfig::preset("k3-tiny").unwrap();
        let mini = ModelConfig::preset("k3-mini").unwrap();
        let mut state = SeqState::<f32>::new(&tiny);
        assert!(state.check_fits(&tiny).is_ok());
        assert!(state.check_fits(&mini).is_err());
        // A length that disagrees with the MLA caches is refused too.
        state.len = 3;
        assert!(state.check_fits(&tiny).is_err());
    }

    #[test]
    fn mla_cache_blocks_are_copy_on_write() {
        let mut a: MlaCache<f32> = MlaCache::new(3);
        for t in 0..(MLA_BLOCK_TOKENS + 5) {
            a.push(&[t as f32, 0.0, 1.0]);
        }
        let mut b = a.clone();
        assert_eq!(b.shared_blocks(), 2);
        b.push(&[-1.0, -1.0, -1.0]);
        // The fork's write copied only the tail block.
        assert_eq!(b.shared_blocks(), 1);
        assert_eq!(a.len(), MLA_BLOCK_TOKENS + 5);
        assert_eq!(b.entry(MLA_BLOCK_TOKENS + 5), &[-1.0, -1.0, -1.0]);
        b.truncate(10);
        assert_eq!(b.len(), 10);
        assert_eq!(b.entry(9), &[9.0, 0.0, 1.0]);
        assert_eq!(a.entry(MLA_BLOCK_TOKENS + 4)[0], (MLA_BLOCK_TOKENS + 4) as f32);
    }
}
