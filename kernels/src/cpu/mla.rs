//! Gated NoPE multi-head latent attention for one sequence, in the absorbed form over the latent cache.
//!
//! Invariants: the cache holds, per token, `[c (kv_lora, after kv_a_layernorm) | k_rot (rope dim, raw)]`;
//! a window of `t` tokens appends its `t` entries first, then token `i` of the window attends causally
//! over every cached entry up to and including its own. No positions are stored: K3's MLA is NoPE.
//!
//! Math: shared/reference/k3-architecture.md §2.6: `q_lat_h = W_UK_hᵀ q_nope_h`,
//! `score_h(t) = scale·(q_lat_h·c_t + q_rot_h·k_rot_t)`, `o_h = W_UV_h Σ_t softmax(score)_t c_t`.

use crate::config::MlaConfig;
use crate::cpu::ops::{dot, softmax_in_place, Linear};
use crate::float::Real;
use crate::state::MlaCache;

/// Attention for a window of `t` tokens: `q` `[t, H * (nope + rope)]`, `latent` `[t, kv_lora + rope]` (the
/// new cache entries). Returns the per-head values `[t, H * v]` (before the output gate).
pub fn mla_window<F: Real>(
    cfg: &MlaConfig,
    kv_b_proj: &Linear<F>,
    cache: &mut MlaCache<F>,
    q: &[F],
    latent: &[F],
) -> Vec<F> {
    let (heads, nope, rope, vdim, r) =
        (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank);
    let qh = cfg.q_head_dim();
    let ld = cfg.latent_dim();
    let t = latent.len() / ld;
    let first = cache.len();
    for e in latent.chunks_exact(ld) {
        cache.push(e);
    }
    let scale = F::from_f64(1.0 / (qh as f64).sqrt());
    let per_head = nope + vdim; // rows of kv_b_proj per head
    let mut out = vec![F::ZERO; t * heads * vdim];
    let mut q_lat = vec![F::ZERO; r];
    let mut o_lat = vec![F::ZERO; r];
    for ti in 0..t {
        let visible = first + ti + 1;
        let mut scores = vec![F::ZERO; visible];
        for h in 0..heads {
            let qrow = &q[ti * heads * qh + h * qh..ti * heads * qh + (h + 1) * qh];
            let (q_nope, q_rot) = qrow.split_at(nope);
            // q_lat = W_UKᵀ q_nope, with W_UK = kv_b rows [h*per_head, h*per_head + nope).
            q_lat.fill(F::ZERO);
            for (i, qi) in q_nope.iter().enumerate() {
                let wrow = &kv_b_proj.w[(h * per_head + i) * r..(h * per_head + i + 1) * r];
                for (acc, wv) in q_lat.iter_mut().zip(wrow) {
                    *acc += *qi * *wv;
                }
            }
            for x in q_lat.iter_mut() {
                *x = x.act();
            }
            for (pos, s) in scores.iter_mut().enumerate() {
                let e = cache.entry(pos);
                *s = scale * (dot(&q_lat, &e[..r]) + dot(q_rot, &e[r..r + rope]));
            }
            softmax_in_place(&mut scores);
            o_lat.fill(F::ZERO);
            for (pos, p) in scores.iter().enumerate() {
                for (acc, c) in o_lat.iter_mut().zip(&cache.entry(pos)[..r]) {
                    *acc += *p * *c;
                }
            }
            for x in o_lat.iter_mut() {
                *x = x.act();
            }
            // o_h = W_UV o_lat, with W_UV = kv_b rows [h*per_head + nope, (h+1)*per_head).
            let o = &mut out[(ti * heads + h) * vdim..(ti * heads + h + 1) * vdim];
            for (j, oj) in o.iter_mut().enumerate() {
                *oj = kv_b_proj.row_dot(h * per_head + nope + j, &o_lat).act();
            }
        }
    }
    out
}
