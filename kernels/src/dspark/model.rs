//! The DSpark drafter on the CPU: context features, the parallel backbone over one block, and the
//! sequential Markov head with the confidence head.
//!
//! Follows shared/reference/dspark.md:
//! - §1.1 KV injection: `H_ctx = RMSNorm(W_c · concat(taps))` per committed target token; each draft
//!   layer projects `H_ctx` with its own `kv_a_proj_with_mqa` (the same projection as for block
//!   tokens) into latent cache entries. Block queries attend, non-causally, over every context entry
//!   (positions before the anchor) and every entry of their own block.
//! - §1.1 `sample_from_anchor`: the block is `[anchor, MASK × (n−1)]` at positions `P..P+n−1`
//!   (P = the anchor's position = the committed length); the hidden state at block position k−1
//!   predicts draft k, so n positions give n drafts.
//! - §1.2 draft loop: `logits_k = U_k + W2ᵀ W1[x_{k−1}]` (x_0 = anchor), `q_k` = those logits under
//!   the request's temperature/top-k/top-p, `x_k` = argmax or a sample from `q_k`, and
//!   §2.1 `c_k = σ(wᵀ[h_k ; W1[x_{k−1}]] + b)`, with `h_k` the final-normed backbone state.
//!
//! Invariants: the drafter never copies the target's embedding or lm_head; it reads them through the
//! [`TargetHead`] passed in (a `CpuModel`'s own, or the whole-vocabulary copy a sharded runner gathers). Draft samples use their own counter-RNG stream ([`DRAFT_STREAM`]) keyed by
//! `(seed, position of the draft)`, independent of the verifier's accept and token streams, so a
//! draft never correlates with the test that judges it. Layers are pre-norm residual
//! (`x += attn(norm x)`, `x += mlp(norm x)`), with activations rounded like the target's.

use crate::config::{MlaConfig, ModelConfig, MLA_NORM_EPS};
use crate::cpu::forward::CpuModel;
use crate::cpu::moe::situ_mlp;
use crate::cpu::ops::{add_rows, dot, softmax_in_place, Linear, RmsNorm};
use crate::cpu::weights::SituMlp;
use crate::dspark::config::DrafterConfig;
use crate::dspark::schema::{
    draft_layer_name, drafter_tensors, CONFIDENCE_BIAS, CONFIDENCE_WEIGHT, CONTEXT_NORM, CONTEXT_PROJ, FINAL_NORM,
    MARKOV_W1, MARKOV_W2,
};
use crate::dspark::state::DrafterState;
use crate::error::{KernelError, Result};
use crate::float::Real;
use crate::runner::{SamplingParams, TokenId, TokenMask};
use crate::sampling::{argmax, hash3, Distribution};
use crate::state::MlaCache;
use crate::tensor::{ExpectedTensor, WeightSource};

/// The target weights a drafter reads in place: the whole-vocabulary embedding and lm_head.
#[derive(Clone, Copy)]
pub struct TargetHead<'a, F> {
    /// `[V, d]`
    pub embed: &'a [F],
    /// `[V, d]`
    pub lm_head: &'a Linear<F>,
}

impl<'a, F: Real> From<&'a CpuModel<F>> for TargetHead<'a, F> {
    /// A whole model's head (a rank of a tensor-parallel group holds only a vocabulary slice of it).
    fn from(model: &'a CpuModel<F>) -> Self {
        TargetHead { embed: &model.weights.embed, lm_head: &model.weights.lm_head }
    }
}

/// The counter-RNG stream of draft samples ("DSPARK" in ASCII), distinct from `sampling::RngStream`'s.
pub const DRAFT_STREAM: u64 = 0x4453_5041_524B;

/// The uniform that decides the draft token at `position` of a request with `seed`.
pub fn draft_uniform(seed: u64, position: u64) -> f64 {
    (hash3(seed, position, DRAFT_STREAM) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// One draft layer's RoPE MLA (no output gate).
struct DraftAttention<F> {
    q_a_proj: Linear<F>,
    q_a_norm: RmsNorm<F>,
    q_b_proj: Linear<F>,
    kv_a_proj: Linear<F>,
    kv_a_norm: RmsNorm<F>,
    /// `[H * (nope + v), kv_lora]`: per head, nope rows of W_UK then v rows of W_UV.
    kv_b_proj: Linear<F>,
    o_proj: Linear<F>,
}

struct DraftLayer<F> {
    input_norm: RmsNorm<F>,
    attn: DraftAttention<F>,
    post_norm: RmsNorm<F>,
    mlp: SituMlp<F>,
}

/// What one block pass and the Markov loop produce for one row.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockDraft {
    pub tokens: Vec<TokenId>,
    /// `c_k` per draft.
    pub confidences: Vec<f32>,
    /// `[tokens.len(), vocab]`: the logits `q_k` was built from (before temperature).
    pub logits: Vec<f32>,
}

/// A loaded drafter (its own weights only).
pub struct DrafterModel<F> {
    cfg: DrafterConfig,
    /// The target's model config (the drafter reuses its situ betas through `situ_mlp`).
    target_cfg: ModelConfig,
    context_proj: Linear<F>,
    context_norm: RmsNorm<F>,
    layers: Vec<DraftLayer<F>>,
    norm: RmsNorm<F>,
    /// `[V, r]`
    markov_w1: Vec<F>,
    /// `W2ᵀ` as a Linear r → V.
    markov_w2: Linear<F>,
    /// `[d + r]`
    confidence_w: Vec<F>,
    confidence_b: F,
}

impl<F: Real> DrafterModel<F> {
    /// Loads and checks every drafter tensor from `src`; `cfg` must fit `target`.
    pub fn load(cfg: DrafterConfig, target: &ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        cfg.check_against(target)?;
        let specs: Vec<ExpectedTensor> = drafter_tensors(&cfg);
        let values = |name: &str| -> Result<Vec<F>> {
            let spec = specs
                .iter()
                .find(|s| s.name == name)
                .ok_or_else(|| KernelError::MissingTensor { name: name.to_string() })?;
            Ok(src.tensor(spec)?.to_f32()?.into_iter().map(F::from_f32).collect())
        };
        let linear = |name: &str| -> Result<Linear<F>> {
            let spec = specs
                .iter()
                .find(|s| s.name == name)
                .ok_or_else(|| KernelError::MissingTensor { name: name.to_string() })?;
            let shape = spec.shape.canonical();
            Ok(Linear::new(shape[0], shape[1], values(name)?))
        };
        let norm =
            |name: &str, eps: f32| -> Result<RmsNorm<F>> { Ok(RmsNorm { w: values(name)?, eps: F::from_f32(eps) }) };
        let eps = cfg.rms_norm_eps;
        let mut layers = Vec::with_capacity(cfg.num_draft_layers);
        for i in 0..cfg.num_draft_layers {
            let n = |s: &str| draft_layer_name(i, s);
            layers.push(DraftLayer {
                input_norm: norm(&n("input_layernorm.weight"), eps)?,
                attn: DraftAttention {
                    q_a_proj: linear(&n("self_attn.q_a_proj.weight"))?,
                    q_a_norm: norm(&n("self_attn.q_a_layernorm.weight"), MLA_NORM_EPS)?,
                    q_b_proj: linear(&n("self_attn.q_b_proj.weight"))?,
                    kv_a_proj: linear(&n("self_attn.kv_a_proj_with_mqa.weight"))?,
                    kv_a_norm: norm(&n("self_attn.kv_a_layernorm.weight"), MLA_NORM_EPS)?,
                    kv_b_proj: linear(&n("self_attn.kv_b_proj.weight"))?,
                    o_proj: linear(&n("self_attn.o_proj.weight"))?,
                },
                post_norm: norm(&n("post_attention_layernorm.weight"), eps)?,
                mlp: SituMlp {
                    gate: linear(&n("mlp.gate_proj.weight"))?,
                    up: linear(&n("mlp.up_proj.weight"))?,
                    down: linear(&n("mlp.down_proj.weight"))?,
                },
            });
        }
        let confidence_b = values(CONFIDENCE_BIAS)?[0];
        let mut target_cfg = target.clone();
        target_cfg.situ_beta = cfg.situ_beta;
        target_cfg.situ_linear_beta = cfg.situ_linear_beta;
        Ok(DrafterModel {
            context_proj: linear(CONTEXT_PROJ)?,
            context_norm: norm(CONTEXT_NORM, eps)?,
            layers,
            norm: norm(FINAL_NORM, eps)?,
            markov_w1: values(MARKOV_W1)?,
            markov_w2: linear(MARKOV_W2)?,
            confidence_w: values(CONFIDENCE_WEIGHT)?,
            confidence_b,
            target_cfg,
            cfg,
        })
    }

    /// Opens a drafter folder (`config.json` + `model.safetensors`, see `dspark::schema`) and loads it
    /// for `target`.
    pub fn open(dir: &std::path::Path, target: &ModelConfig) -> Result<Self> {
        let ckpt = crate::dspark::schema::DrafterCheckpoint::open(dir, target)?;
        Self::load(ckpt.config().clone(), target, &ckpt)
    }

    pub fn config(&self) -> &DrafterConfig {
        &self.cfg
    }

    /// An empty context for a sequence whose first committed token will sit at `start`.
    pub fn new_state(&self, start: usize) -> DrafterState<F> {
        DrafterState::new(self.cfg.num_draft_layers, self.cfg.mla().latent_dim(), start)
    }

    /// Appends the context entries of `n` newly committed target tokens. `taps[i]` is `[n, d]`, the
    /// hidden states of target layer `target_layer_ids[i]` at those tokens, in order.
    pub fn append_context(&self, state: &mut DrafterState<F>, taps: &[&[F]]) -> Result<()> {
        let d = self.cfg.hidden_size;
        if taps.len() != self.cfg.num_taps() {
            return Err(KernelError::InvalidInput(format!(
                "the drafter needs {} taps, got {}",
                self.cfg.num_taps(),
                taps.len()
            )));
        }
        let n = taps[0].len() / d;
        if taps.iter().any(|t| t.len() != n * d) {
            return Err(KernelError::InvalidInput("drafter taps have different token counts".into()));
        }
        if n == 0 {
            return Ok(());
        }
        // [n, m·d]: per token, the taps concatenated in `target_layer_ids` order.
        let mut concat = Vec::with_capacity(n * taps.len() * d);
        for t in 0..n {
            for tap in taps {
                concat.extend_from_slice(&tap[t * d..(t + 1) * d]);
            }
        }
        let ctx = self.context_norm.forward(&self.context_proj.forward(&concat)); // [n, d]
        let first = state.len();
        let latents: Vec<Vec<F>> = self.layers.iter().map(|l| self.latents(&l.attn, &ctx, first)).collect(); // [layer][n, ld]
        let ld = self.cfg.mla().latent_dim();
        for t in 0..n {
            let entries: Vec<&[F]> = latents.iter().map(|l| &l[t * ld..(t + 1) * ld]).collect();
            state.push(&entries);
        }
        Ok(())
    }

    /// Cache entries `[n, kv_lora + rope]` of hidden rows `h` `[n, d]` at positions `first..first+n`.
    fn latents(&self, attn: &DraftAttention<F>, h: &[F], first: usize) -> Vec<F> {
        let m = self.cfg.mla();
        let ld = m.latent_dim();
        let mut kva = attn.kv_a_proj.forward(h);
        for (t, row) in kva.chunks_exact_mut(ld).enumerate() {
            let c = attn.kv_a_norm.forward(&row[..m.kv_lora_rank]);
            row[..m.kv_lora_rank].copy_from_slice(&c);
            rope_in_place(&mut row[m.kv_lora_rank..], first + t, self.cfg.rope_theta);
        }
        kva
    }

    /// The backbone over the block `[anchor, MASK × (n−1)]` at positions `P..P+n−1`, P = `state.len()`:
    /// returns the final-normed hidden states `[n, d]` and the base logits `U` `[n, V]`.
    pub fn block_forward<'t>(
        &self,
        target: impl Into<TargetHead<'t, F>>,
        state: &DrafterState<F>,
        anchor: TokenId,
        n: usize,
    ) -> Result<(Vec<F>, Vec<F>)> {
        let d = self.cfg.hidden_size;
        if anchor as usize >= self.cfg.vocab_size {
            return Err(KernelError::InvalidInput(format!(
                "anchor token {anchor} outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        if n == 0 || n > crate::dspark::config::MAX_BLOCK {
            return Err(KernelError::InvalidInput(format!(
                "a draft block of {n} tokens is outside 1..={}",
                crate::dspark::config::MAX_BLOCK
            )));
        }
        let target = target.into();
        let embed = target.embed;
        let mut x = Vec::with_capacity(n * d); // [n, d]
        for k in 0..n {
            let t = if k == 0 { anchor } else { self.cfg.mask_token_id } as usize;
            x.extend_from_slice(&embed[t * d..(t + 1) * d]);
        }
        let p = state.len();
        let mla = self.cfg.mla();
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.input_norm.forward(&x);
            let a = &layer.attn;
            let mut q = a.q_b_proj.forward(&a.q_a_norm.forward(&a.q_a_proj.forward(&h))); // [n, H·(nope+rope)]
            for (k, row) in q.chunks_exact_mut(mla.q_head_dim()).enumerate() {
                rope_in_place(&mut row[mla.qk_nope_head_dim..], p + k / mla.num_heads, self.cfg.rope_theta);
            }
            let block = self.latents(a, &h, p); // [n, ld]
            let o = attend(&mla, &a.kv_b_proj, state.layer(i), &block, &q);
            x = add_rows(&x, &a.o_proj.forward(&o));
            let f = situ_mlp(&self.target_cfg, &layer.mlp, &layer.post_norm.forward(&x));
            x = add_rows(&x, &f);
        }
        let hidden = self.norm.forward(&x);
        let logits = target.lm_head.forward(&hidden);
        Ok((hidden, logits))
    }

    /// One round for one row: the backbone pass, then the Markov loop drafting `n` tokens from the
    /// anchor (greedy for greedy `params`, else sampled from `q_k` with the draft stream at the
    /// draft's position `P + k`). Ids outside `mask` (the runner's emittable tokens) get logit `-inf`
    /// in every `q_k`, so the drafter never proposes a token the target may not emit.
    pub fn draft<'t>(
        &self,
        target: impl Into<TargetHead<'t, F>>,
        state: &DrafterState<F>,
        anchor: TokenId,
        n: usize,
        params: &SamplingParams,
        mask: Option<&TokenMask>,
    ) -> Result<BlockDraft> {
        crate::sampling::check_params(params)?;
        let (hidden, base) = self.block_forward(target, state, anchor, n)?;
        let (d, r, vocab) = (self.cfg.hidden_size, self.cfg.markov_rank, self.cfg.vocab_size);
        let mut out = BlockDraft {
            tokens: Vec::with_capacity(n),
            confidences: Vec::with_capacity(n),
            logits: Vec::with_capacity(n * vocab),
        };
        let mut prev = anchor;
        for k in 0..n {
            let e = &self.markov_w1[prev as usize * r..(prev as usize + 1) * r]; // W1[x_{k-1}], [r]
            let bias = self.markov_w2.forward(e); // [V]
            let mut logits: Vec<f32> =
                base[k * vocab..(k + 1) * vocab].iter().zip(&bias).map(|(u, b)| (*u + *b).to_f32()).collect();
            if let Some(m) = mask {
                m.apply(&mut logits);
            }
            let h = &hidden[k * d..(k + 1) * d];
            let z = dot(&self.confidence_w[..d], h) + dot(&self.confidence_w[d..], e) + self.confidence_b;
            let position = (state.len() + 1 + k) as u64;
            let token = if params.is_greedy() {
                argmax(&logits)?
            } else {
                Distribution::from_logits(&logits, params)?.sample_with(draft_uniform(params.seed, position))
            };
            out.confidences.push(z.sigmoid().to_f32());
            out.tokens.push(token);
            out.logits.extend_from_slice(&logits);
            prev = token;
        }
        Ok(out)
    }
}

/// Rotates one RoPE vector in place at `position` (the half-split pairing `(x_i, x_{i+half})`,
/// frequency `theta^(-2i/len)`), rounded to the activation precision.
fn rope_in_place<F: Real>(x: &mut [F], position: usize, theta: f64) {
    let half = x.len() / 2;
    for i in 0..half {
        let angle = position as f64 * theta.powf(-2.0 * i as f64 / x.len() as f64);
        let (sin, cos) = angle.sin_cos();
        let (a, b) = (x[i].to_f64(), x[i + half].to_f64());
        x[i] = F::from_f64(a * cos - b * sin).act();
        x[i + half] = F::from_f64(a * sin + b * cos).act();
    }
}

/// Non-causal MLA in the absorbed form: every query of the block sees every context entry and every
/// block entry. `block` `[n, ld]`, `q` `[n, H·(nope+rope)]` (rope part rotated); returns `[n, H·v]`.
fn attend<F: Real>(cfg: &MlaConfig, kv_b_proj: &Linear<F>, ctx: &MlaCache<F>, block: &[F], q: &[F]) -> Vec<F> {
    let (heads, nope, rope, vdim, r) =
        (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank);
    let (qh, ld) = (cfg.q_head_dim(), cfg.latent_dim());
    let n = block.len() / ld;
    let scale = F::from_f64(1.0 / (qh as f64).sqrt());
    let per_head = nope + vdim;
    let entry = |pos: usize| -> &[F] {
        if pos < ctx.len() {
            ctx.entry(pos)
        } else {
            &block[(pos - ctx.len()) * ld..(pos - ctx.len() + 1) * ld]
        }
    };
    let visible = ctx.len() + n;
    let mut out = vec![F::ZERO; n * heads * vdim];
    let mut q_lat = vec![F::ZERO; r];
    let mut o_lat = vec![F::ZERO; r];
    let mut scores = vec![F::ZERO; visible];
    for ti in 0..n {
        for h in 0..heads {
            let qrow = &q[(ti * heads + h) * qh..(ti * heads + h + 1) * qh];
            let (q_nope, q_rot) = qrow.split_at(nope);
            q_lat.fill(F::ZERO);
            for (i, qi) in q_nope.iter().enumerate() {
                let wrow = &kv_b_proj.w[(h * per_head + i) * r..(h * per_head + i + 1) * r];
                for (acc, wv) in q_lat.iter_mut().zip(wrow) {
                    *acc += *qi * *wv;
                }
            }
            for v in q_lat.iter_mut() {
                *v = v.act();
            }
            for (pos, s) in scores.iter_mut().enumerate() {
                let e = entry(pos);
                *s = scale * (dot(&q_lat, &e[..r]) + dot(q_rot, &e[r..r + rope]));
            }
            softmax_in_place(&mut scores);
            o_lat.fill(F::ZERO);
            for (pos, p) in scores.iter().enumerate() {
                for (acc, c) in o_lat.iter_mut().zip(&entry(pos)[..r]) {
                    *acc += *p * *c;
                }
            }
            for v in o_lat.iter_mut() {
                *v = v.act();
            }
            let o = &mut out[(ti * heads + h) * vdim..(ti * heads + h + 1) * vdim];
            for (j, oj) in o.iter_mut().enumerate() {
                *oj = kv_b_proj.row_dot(h * per_head + nope + j, &o_lat).act();
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_preserves_norm_and_is_identity_at_position_zero() {
        let x0 = vec![0.3f64, -1.2, 0.7, 2.0];
        let mut x = x0.clone();
        rope_in_place(&mut x, 0, 10_000.0);
        assert_eq!(x, x0);
        rope_in_place(&mut x, 37, 10_000.0);
        let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>();
        assert!((norm(&x) - norm(&x0)).abs() < 1e-12);
        assert_ne!(x, x0);
    }

    #[test]
    fn draft_uniform_is_its_own_stream() {
        use crate::sampling::{uniform, RngStream};
        for pos in 0..100 {
            let u = draft_uniform(5, pos);
            assert!((0.0..1.0).contains(&u));
            assert_ne!(u, uniform(5, pos, RngStream::Token));
            assert_ne!(u, uniform(5, pos, RngStream::Accept));
        }
    }
}
