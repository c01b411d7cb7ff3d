//! The K3 forward on the CPU over a batch of sequence windows of different lengths.
//!
//! Invariants:
//! - Row `r` appends `tokens[r]` to its state; after the call the state holds them all. A row that
//!   asked for snapshots can then be cut back to any `m >= snapshots_from` of its window tokens with
//!   [`WindowUndo::commit`], which leaves the state exactly as a run of those `m` tokens would.
//! - Per-token work (projections, AttnRes, norms, FFN) is batched over every token of every row;
//!   sequence work (KDA recurrence, MLA attention) runs per row over that row's state.
//! - Logits are computed only for the positions a row asks for (`logits_from..`).
//! - On one rank of a tensor-parallel group ([`CpuModel::forward_reduced`], `cpu::shard`) the same walk
//!   runs over the rank's heads, widths and vocabulary slice; each row-parallel output is completed by
//!   the group's all-reduce before it is rounded, so every rank's activations stay full-width and
//!   bit-identical, and the logits are this rank's vocabulary slice.
//!
//! Layer walk: shared/reference/k3-architecture.md §2.1 (AttnRes seals before the attention of
//! layers `l % block == 0`; the pre-attention read is skipped while the bank is empty).

use crate::config::ModelConfig;
use crate::cpu::kda::{kda_window, KdaInputs};
use crate::cpu::mla::mla_window;
use crate::cpu::moe::{latent_moe_reduced, reduced, situ_mlp_reduced};
use crate::cpu::ops::add_rows;
use crate::cpu::shard::{Reduce, Unsharded};
use crate::cpu::weights::{FfnWeights, MixerWeights, ModelWeights};
use crate::error::{KernelError, Result};
use crate::float::Real;
use crate::routing::Routing;
use crate::runner::TokenId;
use crate::shard_rule::Shard;
use crate::state::{KdaState, SeqState};
use crate::tensor::WeightSource;

/// A model ready to run on the CPU in precision `F`.
pub struct CpuModel<F> {
    pub cfg: ModelConfig,
    pub weights: ModelWeights<F>,
}

/// One sequence's window in a forward call.
pub struct WindowRow<'a, F> {
    pub state: &'a mut SeqState<F>,
    pub tokens: &'a [TokenId],
    /// Logits are returned for window positions `logits_from..tokens.len()`.
    pub logits_from: usize,
    /// Keep what is needed to commit only the first `m >= snapshots_from` tokens afterwards.
    pub snapshots_from: Option<usize>,
}

/// What a verify window keeps so that it can be cut back to an accepted prefix.
#[derive(Debug)]
pub struct WindowUndo<F> {
    start_len: usize,
    from: usize,
    window_len: usize,
    /// `[kda layer][m - from]`: the layer's state after `m` window tokens, for `from <= m < window_len`.
    kda: Vec<Vec<KdaState<F>>>,
}

impl<F: Real> WindowUndo<F> {
    /// Keeps the first `m` tokens of the window in `state` and drops the rest.
    pub fn commit(self, state: &mut SeqState<F>, m: usize) -> Result<()> {
        crate::state::check_commit(m, self.from, self.window_len)?;
        if m == self.window_len {
            return Ok(());
        }
        for (layer, snaps) in state.kda.iter_mut().zip(self.kda) {
            *layer = snaps.into_iter().nth(m - self.from).ok_or_else(|| {
                KernelError::InvalidInput("window snapshots do not match the state's KDA layers".into())
            })?;
        }
        state.len = self.start_len + m;
        state.truncate_mla(self.start_len + m);
        Ok(())
    }
}

/// Router decisions of one forward call: `routing[moe layer][token]`, tokens in row order.
#[derive(Debug, Default)]
pub struct RoutingTrace<F> {
    pub routing: Vec<Vec<Routing<F>>>,
}

/// What a forward call records besides logits, for the drafter and for numerical comparisons.
///
/// Tokens are in row order (all of row 0's window, then row 1's, ...).
#[derive(Debug, Default)]
pub struct Probe<F> {
    /// Record every router decision into `routing[moe layer][token]`.
    pub record_routing: bool,
    pub routing: Vec<Vec<Routing<F>>>,
    /// Target layers whose hidden state to tap, ascending. The hidden state of layer `l` is what the
    /// next layer consumes: the pre-attention AttnRes read of layer `l + 1` (before its input norm),
    /// or, for the last layer, the final AttnRes read (before `model.norm`), so "the output of layer l"
    /// as HF's `hidden_states[l + 1]` means it, adapted to AttnRes.
    pub tap_layers: Vec<usize>,
    /// `taps[i]` is `[tokens, hidden]` for `tap_layers[i]`.
    pub taps: Vec<Vec<F>>,
}

/// A row's results.
pub struct WindowOutput<F> {
    /// `[tokens.len() - logits_from, vocab]` (on a rank of a group, `vocab / N` ids from `vocab_start`)
    pub logits: Vec<F>,
    pub undo: Option<WindowUndo<F>>,
}

impl<F: Real> CpuModel<F> {
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        let weights = ModelWeights::load(&cfg, src)?;
        Ok(CpuModel { cfg, weights })
    }

    /// Loads `shard`'s part of the model `cfg` (the whole model's config) from `src`; the model's `cfg` is
    /// then the rank's ([`Shard::local_config`]).
    pub fn load_shard(cfg: &ModelConfig, src: &dyn WeightSource, shard: Shard) -> Result<Self> {
        let weights = ModelWeights::load_shard(cfg, src, shard)?;
        Ok(CpuModel { cfg: shard.local_config(cfg)?, weights })
    }

    /// Runs every row's window through the model.
    pub fn forward(&self, rows: &mut [WindowRow<'_, F>]) -> Result<Vec<WindowOutput<F>>> {
        self.forward_probed(rows, &mut Probe::default())
    }

    /// [`Self::forward`], recording every router decision into `trace` when one is given.
    pub fn forward_traced(
        &self,
        rows: &mut [WindowRow<'_, F>],
        trace: Option<&mut RoutingTrace<F>>,
    ) -> Result<Vec<WindowOutput<F>>> {
        let mut probe = Probe { record_routing: trace.is_some(), ..Probe::default() };
        let out = self.forward_probed(rows, &mut probe)?;
        if let Some(t) = trace {
            t.routing = probe.routing;
        }
        Ok(out)
    }

    /// [`Self::forward`], also recording what `probe` asks for: router decisions (for comparisons
    /// that must tell a routing near-tie flip from a numerical error) and hidden-state taps (the
    /// drafter's context features).
    pub fn forward_probed(&self, rows: &mut [WindowRow<'_, F>], probe: &mut Probe<F>) -> Result<Vec<WindowOutput<F>>> {
        self.forward_reduced(rows, probe, &Unsharded)
    }

    /// [`Self::forward_probed`] on one rank of a tensor-parallel group: `reduce` completes the
    /// row-parallel partial sums (every rank of the group calls this with the same rows).
    pub fn forward_reduced<R: Reduce<F> + ?Sized>(
        &self,
        rows: &mut [WindowRow<'_, F>],
        probe: &mut Probe<F>,
        reduce: &R,
    ) -> Result<Vec<WindowOutput<F>>> {
        if let Some(bad) = probe.tap_layers.iter().find(|l| **l >= self.cfg.num_layers()) {
            return Err(KernelError::InvalidInput(format!(
                "tap layer {bad} outside the model's {} layers",
                self.cfg.num_layers()
            )));
        }
        probe.routing.clear();
        probe.taps = vec![Vec::new(); probe.tap_layers.len()];
        let cfg = &self.cfg;
        let d = cfg.hidden_size;
        let offsets = crate::runner::window_offsets(
            rows.iter().map(|r| (r.tokens, r.logits_from, r.snapshots_from)),
            cfg.vocab_size,
        )?;
        let n = *offsets.last().unwrap_or(&0);

        // [n, d] embeddings: this rank's vocabulary rows, zeros for the others' ids, summed exactly.
        let held = self.weights.vocab_start..self.weights.vocab_start + self.weights.embed.len() / d;
        let mut x = Vec::with_capacity(n * d);
        for r in rows.iter() {
            for t in r.tokens {
                let t = *t as usize;
                if held.contains(&t) {
                    let i = t - held.start;
                    x.extend_from_slice(&self.weights.embed[i * d..(i + 1) * d]);
                } else {
                    x.resize(x.len() + d, F::ZERO);
                }
            }
        }
        if held.len() < cfg.vocab_size {
            reduce.all_reduce(&mut x)?;
        }
        let start_lens: Vec<usize> = rows.iter().map(|r| r.state.len).collect();
        let mut snapshots: Vec<Vec<Vec<KdaState<F>>>> = rows.iter().map(|_| Vec::new()).collect();

        let mut bank: Vec<Vec<F>> = Vec::new(); // sealed AttnRes blocks, each [n, d]
        let mut live: Option<Vec<F>> = Some(x); // the running within-block sum, [n, d]
        let (mut kda_idx, mut mla_idx) = (0usize, 0usize);
        for (l, lw) in self.weights.layers.iter().enumerate() {
            let h = match (&live, bank.is_empty()) {
                (Some(lv), true) => lv.clone(),
                _ => lw.attn_res.read(&sources(&bank, &live)),
            };
            if let Some(i) = l.checked_sub(1).and_then(|prev| probe.tap_layers.iter().position(|t| *t == prev)) {
                probe.taps[i] = h.clone();
            }
            let h = lw.input_norm.forward(&h);
            if cfg.seals_before(l) {
                if let Some(lv) = live.take() {
                    bank.push(lv);
                }
            }
            let a = match &lw.mixer {
                MixerWeights::Kda(w) => {
                    let p = cfg.kda.proj_dim();
                    let heads = cfg.kda.num_heads;
                    let q = w.q_proj.forward(&h);
                    let k = w.k_proj.forward(&h);
                    let v = w.v_proj.forward(&h);
                    let f = w.f_b_proj.forward(&w.f_a_proj.forward(&h));
                    let b = w.b_proj.forward(&h);
                    let g = w.g_proj.forward(&h);
                    let mut o = Vec::with_capacity(n * p);
                    for (ri, row) in rows.iter_mut().enumerate() {
                        let (s, e) = (offsets[ri], offsets[ri + 1]);
                        let inputs = KdaInputs {
                            qkv: [&q[s * p..e * p], &k[s * p..e * p], &v[s * p..e * p]],
                            f: &f[s * p..e * p],
                            b: &b[s * heads..e * heads],
                            g: &g[s * p..e * p],
                        };
                        let mut layer_snaps = Vec::new();
                        let snaps = row.snapshots_from.map(|from| (from, &mut layer_snaps));
                        o.extend(kda_window(&cfg.kda, w, &mut row.state.kda[kda_idx], &inputs, snaps));
                        if row.snapshots_from.is_some() {
                            snapshots[ri].push(layer_snaps);
                        }
                    }
                    kda_idx += 1;
                    reduced(&w.o_proj, &o, reduce)?
                }
                MixerWeights::Mla(w) => {
                    let m = &cfg.mla;
                    let q = w.q_b_proj.forward(&w.q_a_norm.forward(&w.q_a_proj.forward(&h)));
                    let kva = w.kv_a_proj.forward(&h); // [n, kv_lora + rope]
                    let ld = m.latent_dim();
                    let mut latent = kva.clone();
                    for (lat, raw) in latent.chunks_exact_mut(ld).zip(kva.chunks_exact(ld)) {
                        let c = w.kv_a_norm.forward(&raw[..m.kv_lora_rank]);
                        lat[..m.kv_lora_rank].copy_from_slice(&c);
                    }
                    let qw = m.num_heads * m.q_head_dim();
                    let mut o = Vec::with_capacity(n * m.num_heads * m.v_head_dim);
                    for (ri, row) in rows.iter_mut().enumerate() {
                        let (s, e) = (offsets[ri], offsets[ri + 1]);
                        o.extend(mla_window(
                            m,
                            &w.kv_b_proj,
                            &mut row.state.mla[mla_idx],
                            &q[s * qw..e * qw],
                            &latent[s * ld..e * ld],
                        ));
                    }
                    mla_idx += 1;
                    let gate = w.g_proj.forward(&h);
                    let gated: Vec<F> = o.iter().zip(&gate).map(|(ov, gv)| (*ov * gv.sigmoid().act()).act()).collect();
                    reduced(&w.o_proj, &gated, reduce)?
                }
            };
            live = Some(match live {
                None => a,
                Some(lv) => add_rows(&lv, &a),
            });
            let h = lw.post_norm.forward(&lw.mlp_res.read(&sources(&bank, &live)));
            let f = match &lw.ffn {
                FfnWeights::Dense(w) => situ_mlp_reduced(cfg, w, &h, reduce)?,
                FfnWeights::Moe(w) => {
                    let mut layer_trace = probe.record_routing.then(Vec::new);
                    let out = latent_moe_reduced(cfg, w, &h, layer_trace.as_mut(), reduce)?;
                    if let Some(lt) = layer_trace {
                        probe.routing.push(lt);
                    }
                    out
                }
            };
            live = live.map(|lv| add_rows(&lv, &f));
        }

        // Final read, norm and lm_head, only at the positions that want logits.
        let last = cfg.num_layers() - 1;
        if let Some(i) = probe.tap_layers.iter().position(|t| *t == last) {
            probe.taps[i] = self.weights.out_res.read(&sources(&bank, &live));
        }
        let wanted: Vec<usize> =
            rows.iter().enumerate().flat_map(|(ri, r)| (offsets[ri] + r.logits_from)..offsets[ri + 1]).collect();
        let gather =
            |src: &[F]| -> Vec<F> { wanted.iter().flat_map(|i| src[i * d..(i + 1) * d].iter().copied()).collect() };
        let bank_w: Vec<Vec<F>> = bank.iter().map(|b| gather(b)).collect();
        let live_w = live.as_deref().map(gather);
        let h = self.weights.norm.forward(&self.weights.out_res.read(&sources(&bank_w, &live_w)));
        let logits = self.weights.lm_head.forward(&h);

        let vocab = self.weights.lm_head.out_dim;
        let mut outputs = Vec::with_capacity(rows.len());
        let mut cursor = 0;
        for ((ri, row), snaps) in rows.iter_mut().enumerate().zip(snapshots) {
            let t = row.tokens.len();
            let count = t - row.logits_from;
            row.state.len = start_lens[ri] + t;
            outputs.push(WindowOutput {
                logits: logits[cursor * vocab..(cursor + count) * vocab].to_vec(),
                undo: row.snapshots_from.map(|from| WindowUndo {
                    start_len: start_lens[ri],
                    from,
                    window_len: t,
                    kda: snaps,
                }),
            });
            cursor += count;
        }
        Ok(outputs)
    }
}

/// The AttnRes sources: sealed blocks in seal order, then the live sum.
fn sources<'a, F>(bank: &'a [Vec<F>], live: &'a Option<Vec<F>>) -> Vec<&'a [F]> {
    bank.iter().map(Vec::as_slice).chain(live.as_deref()).collect()
}
