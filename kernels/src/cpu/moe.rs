//! The latent MoE block and the dense SiTU MLP.
//!
//! Invariants: routing is an fp32 island over the full hidden vector (sigmoid scores; the correction
//! bias only selects; top-k ties go to the lowest expert index; weights come from the unbiased scores,
//! renormalised); the routed experts run in the latent space and are combined in fp32 before the
//! routed norm and the up-projection; the shared experts run on the pre-projection hidden.
//!
//! Math: shared/reference/k3-architecture.md §2.7 and §2.8.

use crate::config::ModelConfig;
use crate::cpu::ops::{add_rows, situ_rows};
use crate::cpu::weights::{MoeWeights, SituMlp};
use crate::float::Real;
use crate::routing::Routing;

/// `down(SiTU(gate x, up x))` over rows `[n, d]`.
pub fn situ_mlp<F: Real>(cfg: &ModelConfig, w: &SituMlp<F>, x: &[F]) -> Vec<F> {
    let g = w.gate.forward(x);
    let u = w.up.forward(x);
    let a = situ_rows(&g, &u, F::from_f32(cfg.situ_beta), F::from_f32(cfg.situ_linear_beta));
    w.down.forward(&a)
}

/// The router for one token `h` `[d]`: top-k of `sigmoid(W h) + bias`, weights from the unbiased scores.
pub fn route<F: Real>(cfg: &ModelConfig, w: &MoeWeights<F>, h: &[F]) -> Routing<F> {
    let e = cfg.moe.num_experts;
    let scores: Vec<F> = (0..e).map(|i| w.router.row_dot(i, h).sigmoid()).collect();
    let mut order: Vec<usize> = (0..e).collect();
    let choice = |i: usize| scores[i] + w.bias[i];
    // Descending by choice; equal choices keep ascending index order (stable sort).
    order.sort_by(|a, b| choice(*b).partial_cmp(&choice(*a)).unwrap_or(std::cmp::Ordering::Equal));
    let margin = match order.get(cfg.moe.top_k) {
        Some(next) => choice(order[cfg.moe.top_k - 1]) - choice(*next),
        None => F::ZERO,
    };
    order.truncate(cfg.moe.top_k);
    order.sort_unstable();
    let mut weights: Vec<F> = order.iter().map(|i| scores[*i]).collect();
    if cfg.moe.renormalize {
        let sum = weights.iter().fold(F::ZERO, |a, b| a + *b) + F::from_f64(1e-20);
        for x in weights.iter_mut() {
            *x = *x / sum;
        }
    }
    let scale = F::from_f32(cfg.moe.routed_scaling_factor);
    for x in weights.iter_mut() {
        *x *= scale;
    }
    Routing { experts: order, weights, margin }
}

/// The latent MoE over rows `h` `[n, d]`; returns `[n, d]`. Each token's routing is appended to
/// `trace` when one is given.
pub fn latent_moe<F: Real>(
    cfg: &ModelConfig,
    w: &MoeWeights<F>,
    h: &[F],
    mut trace: Option<&mut Vec<Routing<F>>>,
) -> Vec<F> {
    let d = cfg.hidden_size;
    let latent = cfg.moe.latent_dim;
    let beta = F::from_f32(cfg.situ_beta);
    let lbeta = F::from_f32(cfg.situ_linear_beta);
    let n = h.len() / d;
    let z = w.down.forward(h); // [n, latent]
    let mut combined = vec![F::ZERO; n * latent];
    for t in 0..n {
        let routing = route(cfg, w, &h[t * d..(t + 1) * d]);
        let zt = &z[t * latent..(t + 1) * latent];
        let acc = &mut combined[t * latent..(t + 1) * latent];
        for (e, wt) in routing.experts.iter().zip(&routing.weights) {
            let ex = &w.experts[*e];
            let a = situ_rows(&ex.w1.forward(zt), &ex.w3.forward(zt), beta, lbeta);
            let y = ex.w2.forward(&a);
            for (c, yv) in acc.iter_mut().zip(&y) {
                *c += *yv * *wt;
            }
        }
        for c in acc.iter_mut() {
            *c = c.act();
        }
        if let Some(trace) = trace.as_deref_mut() {
            trace.push(routing);
        }
    }
    let routed = w.up.forward(&w.norm.forward(&combined));
    match &w.shared {
        Some(shared) => add_rows(&routed, &situ_mlp(cfg, shared, h)),
        None => routed,
    }
}
