//! Per-sequence drafter state: the context K/V (MLA latent entries) of every committed target token,
//! one cache per draft layer.
//!
//! Invariants:
//! - Every layer's cache holds the entries of the same positions `start..len()`; entry `t` is
//!   `[c (kv_lora, after kv_a_layernorm) | k_rot (rope dim, rotated at position t)]` of the context
//!   feature `H_ctx` of committed target token `t` (dspark.md §1.1, §4.3).
//! - `len()` equals the target state's committed length: the runner appends exactly the tokens the
//!   target commits and truncates exactly when the target rolls back.
//! - `start` is 0 except for a state imported without drafter context, whose earlier features are
//!   unavailable; drafts then attend over `start..len()` only (still verified losslessly).
//! - Blocks are shared copy-on-write between forks, like the target's MLA cache.

use crate::float::Real;
use crate::state::MlaCache;

/// The drafter's context cache for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct DrafterState<F> {
    start: usize,
    /// One per draft layer.
    layers: Vec<MlaCache<F>>,
}

impl<F: Real> DrafterState<F> {
    /// An empty context whose first entry will be the token at position `start`.
    pub fn new(num_layers: usize, latent_dim: usize, start: usize) -> Self {
        DrafterState { start, layers: (0..num_layers).map(|_| MlaCache::new(latent_dim)).collect() }
    }

    /// The position after the last context entry (the target's committed length).
    pub fn len(&self) -> usize {
        self.start + self.layers.first().map_or(0, MlaCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The position of the first entry.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Draft layer `i`'s cache.
    pub fn layer(&self, i: usize) -> &MlaCache<F> {
        &self.layers[i]
    }

    /// Appends one token's entry to each layer: `entries[i]` is layer i's `[latent]` entry.
    pub(crate) fn push(&mut self, entries: &[&[F]]) {
        for (cache, e) in self.layers.iter_mut().zip(entries) {
            cache.push(e);
        }
    }

    /// Rolls the context back to `len` committed tokens (a verify window's rejected tail).
    pub fn truncate(&mut self, len: usize) {
        if len < self.start {
            self.start = len;
        }
        for c in &mut self.layers {
            c.truncate(len - self.start);
        }
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(MlaCache::bytes).sum()
    }
}
