//! The latent MoE block and the dense SiTU MLP.
//!
//! Invariants: routing is an fp32 island over the full hidden vector (sigmoid scores; the correction
//! bias only selects; top-k ties go to the lowest expert index; weights come from the unbiased scores,
//! renormalised); the routed experts run in the latent space and are combined in fp32 before the
//! routed norm and the up-projection; the shared experts run on the pre-projection hidden.
//!
//! Math: shared/reference/k3-architecture.md §2.7 and §2.8.

use crate::config::ModelConfig;
use crate::cpu::ops::{add_rows, situ_rows, Linear};
use crate::cpu::shard::{Reduce, Unsharded};
use crate::cpu::weights::{MoeWeights, SituMlp};
use crate::error::Result;
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
    trace: Option<&mut Vec<Routing<F>>>,
) -> Vec<F> {
    // The identity reduction cannot fail.
    latent_moe_reduced(cfg, w, h, trace, &Unsharded).unwrap_or_default()
}

/// [`latent_moe`] on one rank of a tensor-parallel group (`cpu::shard`). Every rank routes every token
/// (the router is replicated and its inputs are bit-identical across ranks) and runs the experts it
/// holds. Under expert parallelism each rank's partial routed latent output `[n, latent]` is all-reduced
/// before `routed_expert_norm`; with experts split by width, the per-expert outputs `[n, top_k, latent]`
/// are all-reduced instead (before their bf16 rounding, so the combine adds exactly the values the whole
/// model adds) and the combine is then complete on every rank. The shared experts are row-parallel.
///
/// Dispatch and combine are this all-reduce of partial outputs, not an all-to-all: under tensor
/// parallelism every rank already holds every token's latent input, so an all-to-all dispatch would move
/// bytes the ranks already have and still need an all-gather to replicate the output. Measured on the
/// in-process communicator at k3-tiny's shapes (`tests/cpu_tp.rs`,
/// `ep_dispatch_by_all_reduce_against_all_to_all`, 2 cores): at 2 ranks and 64 tokens the all-reduce
/// contributes 16 KiB per rank in 36 µs, the all-to-all dispatch, combine and all-gather 40 KiB in 121 µs;
/// at 1 token, 256 B in 15 µs against 1.3 KiB in 73 µs (one collective against three).
pub fn latent_moe_reduced<F: Real, R: Reduce<F> + ?Sized>(
    cfg: &ModelConfig,
    w: &MoeWeights<F>,
    h: &[F],
    trace: Option<&mut Vec<Routing<F>>>,
    reduce: &R,
) -> Result<Vec<F>> {
    let d = cfg.hidden_size;
    let latent = cfg.moe.latent_dim;
    let beta = F::from_f32(cfg.situ_beta);
    let lbeta = F::from_f32(cfg.situ_linear_beta);
    let n = h.len() / d;
    let z = w.down.forward(h); // [n, latent]
    let k = cfg.moe.top_k;
    let held = w.first_expert..w.first_expert + w.experts.len();
    let routings: Vec<Routing<F>> = (0..n).map(|t| route(cfg, w, &h[t * d..(t + 1) * d])).collect();
    // One routed expert's output for token t's latent input, this rank's partial sum when split by width.
    let expert = |e: usize, zt: &[F]| {
        let ex = &w.experts[e - w.first_expert];
        let a = situ_rows(&ex.w1.forward(zt), &ex.w3.forward(zt), beta, lbeta);
        if w.partial_experts {
            ex.w2.forward_partial(&a)
        } else {
            ex.w2.forward(&a)
        }
    };
    let mut combined = vec![F::ZERO; n * latent]; // [n, latent]; under expert parallelism, this rank's part
    if w.partial_experts {
        // [n, top_k, latent]: split by width, each expert's partial output is completed by one all-reduce for
        // the whole layer and only then rounded, so the combine adds the same bf16 values as the whole model.
        let mut outputs = vec![F::ZERO; n * k * latent];
        for (t, routing) in routings.iter().enumerate() {
            for (slot, e) in routing.experts.iter().enumerate() {
                let y = expert(*e, &z[t * latent..(t + 1) * latent]);
                outputs[(t * k + slot) * latent..(t * k + slot + 1) * latent].copy_from_slice(&y);
            }
        }
        reduce.all_reduce(&mut outputs)?;
        for (t, routing) in routings.iter().enumerate() {
            let acc = &mut combined[t * latent..(t + 1) * latent];
            for (slot, wt) in routing.weights.iter().enumerate() {
                let y = &outputs[(t * k + slot) * latent..(t * k + slot + 1) * latent];
                for (c, yv) in acc.iter_mut().zip(y) {
                    *c += yv.act() * *wt;
                }
            }
        }
    } else {
        // Whole experts: each rank weights in the ones it holds; the ranks' parts are summed after.
        for (t, routing) in routings.iter().enumerate() {
            let acc = &mut combined[t * latent..(t + 1) * latent];
            for (e, wt) in routing.experts.iter().zip(&routing.weights) {
                if !held.contains(e) {
                    continue;
                }
                for (c, yv) in acc.iter_mut().zip(&expert(*e, &z[t * latent..(t + 1) * latent])) {
                    *c += *yv * *wt;
                }
            }
        }
        reduce.all_reduce(&mut combined)?;
    }
    for c in combined.iter_mut() {
        *c = c.act();
    }
    if let Some(trace) = trace {
        trace.extend(routings);
    }
    let routed = w.up.forward(&w.norm.forward(&combined));
    Ok(match &w.shared {
        Some(shared) => add_rows(&routed, &situ_mlp_reduced(cfg, shared, h, reduce)?),
        None => routed,
    })
}

/// [`situ_mlp`] on one rank of a tensor-parallel group: `gate`/`up` column-parallel, `down` row-parallel,
/// its partial output all-reduced, then rounded.
pub fn situ_mlp_reduced<F: Real, R: Reduce<F> + ?Sized>(
    cfg: &ModelConfig,
    w: &SituMlp<F>,
    x: &[F],
    reduce: &R,
) -> Result<Vec<F>> {
    let g = w.gate.forward(x);
    let u = w.up.forward(x);
    let a = situ_rows(&g, &u, F::from_f32(cfg.situ_beta), F::from_f32(cfg.situ_linear_beta));
    reduced(&w.down, &a, reduce)
}

/// `act(Σ_ranks W_r x_r)`: a row-parallel linear layer's partial output, all-reduced, then rounded (on a
/// whole model, exactly `w.forward(x)`).
pub fn reduced<F: Real, R: Reduce<F> + ?Sized>(w: &Linear<F>, x: &[F], reduce: &R) -> Result<Vec<F>> {
    let mut y = w.forward_partial(x);
    reduce.all_reduce(&mut y)?;
    for v in y.iter_mut() {
        *v = v.act();
    }
    Ok(y)
}
