//! Kimi Delta Attention for one sequence: short conv, gates, the delta-rule recurrence (token by
//! token) or its chunked WY form (prefill), and the gated output norm.
//!
//! Invariants:
//! - The state `S` of a head is `[K, V]` (key channels by value channels), decayed by rows.
//! - The recurrent and the chunked forms compute the same function; in f64 they agree to ~1e-13.
//!   Windows that may be rolled back (verify windows) always use the recurrent form and keep a
//!   per-token snapshot of the layer state, so committing `m` of `T` tokens restores exactly the state
//!   a run of those `m` tokens would leave.
//! - Conv windows hold the last `kernel - 1` pre-conv inputs (already bf16 in serving).
//!
//! Math: shared/reference/k3-architecture.md §2.4 (decode) and §3.2 (chunked form, after fla's
//! `naive_recurrent_kda` / `naive_chunk_kda`).

use crate::config::{KdaConfig, L2_NORM_EPS};
use crate::cpu::weights::KdaWeights;
use crate::float::Real;
use crate::state::KdaState;

/// Windows longer than this use the chunked form unless snapshots are needed.
pub const CHUNKED_MIN_TOKENS: usize = 16;
/// Chunk length of the chunked form (fla uses 64 on the GPU; 16 keeps `exp(G)` far from underflow in f32).
pub const CHUNK: usize = 16;

/// Projected inputs of one sequence's window of `t` tokens.
pub struct KdaInputs<'a, F> {
    /// Pre-conv q, k, v, each `[t, P]`.
    pub qkv: [&'a [F]; 3],
    /// Forget-gate input `f_b(f_a(h))`, `[t, P]`.
    pub f: &'a [F],
    /// Beta logits, `[t, H]`.
    pub b: &'a [F],
    /// Output-gate logits, `[t, P]`.
    pub g: &'a [F],
}

/// Per-token, per-head recurrence inputs after conv, norms and gates.
struct HeadSeq<F> {
    /// `[t, K]`, l2-normalised and scaled.
    q: Vec<F>,
    /// `[t, K]`, l2-normalised.
    k: Vec<F>,
    /// `[t, V]`
    v: Vec<F>,
    /// Log-decay, `[t, K]`.
    g: Vec<F>,
    /// `[t]`
    beta: Vec<F>,
}

/// Runs the KDA mixer over a window of `t` tokens of one sequence and returns the gated, normalised
/// head outputs `[t, P]` (the input of `o_proj`). With `snapshots = Some((from, out))` it runs token
/// by token and pushes into `out` the layer state after `m` tokens for every `from <= m < t` (the state
/// after all `t` tokens is the updated `state` itself).
pub fn kda_window<F: Real>(
    cfg: &KdaConfig,
    w: &KdaWeights<F>,
    state: &mut KdaState<F>,
    inp: &KdaInputs<'_, F>,
    snapshots: Option<(usize, &mut Vec<KdaState<F>>)>,
) -> Vec<F> {
    let p = cfg.proj_dim();
    let t = inp.f.len() / p;
    let (dk, heads) = (cfg.head_dim, cfg.num_heads);
    let kw = cfg.conv_kernel;

    // Short causal depthwise conv with SiLU on q, k and v; the window carries the last kw-1 inputs.
    let mut conv_out: [Vec<F>; 3] = Default::default();
    let mut full_windows: [Vec<F>; 3] = Default::default();
    for x in 0..3 {
        let mut win = state.conv[x].clone();
        win.extend_from_slice(inp.qkv[x]); // [kw - 1 + t, P]
        let wx = &w.conv[x]; // [P, kw]
        let mut out = vec![F::ZERO; t * p];
        for ti in 0..t {
            for c in 0..p {
                let mut acc = F::ZERO;
                for j in 0..kw {
                    acc += wx[c * kw + j] * win[(ti + j) * p + c];
                }
                out[ti * p + c] = acc.silu().act();
            }
        }
        conv_out[x] = out;
        full_windows[x] = win;
    }
    let window_after = |x: usize, m: usize| full_windows[x][m * p..(m + kw - 1) * p].to_vec();

    // Per head: l2 norms, gates; then the recurrence.
    let scale = F::from_f64(1.0 / (dk as f64).sqrt());
    let lb = F::from_f32(cfg.gate_lower_bound);
    let l2eps = F::from_f32(L2_NORM_EPS);
    let mut heads_in = Vec::with_capacity(heads);
    for h in 0..heads {
        let mut hs = HeadSeq {
            q: vec![F::ZERO; t * dk],
            k: vec![F::ZERO; t * dk],
            v: vec![F::ZERO; t * dk],
            g: vec![F::ZERO; t * dk],
            beta: vec![F::ZERO; t],
        };
        for ti in 0..t {
            let off = ti * p + h * dk;
            let qn = l2_inv(&conv_out[0][off..off + dk], l2eps) * scale;
            let kn = l2_inv(&conv_out[1][off..off + dk], l2eps);
            for i in 0..dk {
                hs.q[ti * dk + i] = conv_out[0][off + i] * qn;
                hs.k[ti * dk + i] = conv_out[1][off + i] * kn;
                hs.v[ti * dk + i] = conv_out[2][off + i];
                let z = w.a[h] * (inp.f[off + i] + w.dt_bias[h * dk + i]);
                hs.g[ti * dk + i] = lb * z.sigmoid();
            }
            hs.beta[ti] = inp.b[ti * heads + h].sigmoid();
        }
        heads_in.push(hs);
    }

    let mut o = vec![F::ZERO; t * p]; // [t, P] raw head outputs
    let state_len = dk * dk;
    match snapshots {
        Some((from, snaps)) => {
            // Token by token across all heads so the state after each token can be saved.
            for ti in 0..t {
                for (h, hs) in heads_in.iter().enumerate() {
                    let s = &mut state.s[h * state_len..(h + 1) * state_len];
                    recurrent_step(s, hs, ti, dk, &mut o[ti * p + h * dk..ti * p + (h + 1) * dk]);
                }
                let m = ti + 1;
                if m >= from && m < t {
                    snaps.push(KdaState {
                        s: state.s.clone(),
                        conv: [window_after(0, m), window_after(1, m), window_after(2, m)],
                    });
                }
            }
        }
        None => {
            for (h, hs) in heads_in.iter().enumerate() {
                let s = &mut state.s[h * state_len..(h + 1) * state_len];
                if t > CHUNKED_MIN_TOKENS {
                    chunked_head(s, hs, t, dk, &mut o, p, h);
                } else {
                    for ti in 0..t {
                        recurrent_step(s, hs, ti, dk, &mut o[ti * p + h * dk..ti * p + (h + 1) * dk]);
                    }
                }
            }
        }
    }
    for x in 0..3 {
        state.conv[x] = window_after(x, t);
    }

    // Gated output RMSNorm per head (fp32), then bf16.
    let eps = w.o_norm_eps;
    for ti in 0..t {
        for h in 0..heads {
            let off = ti * p + h * dk;
            let r = crate::cpu::ops::rms_inv(&o[off..off + dk], eps);
            for i in 0..dk {
                o[off + i] = (o[off + i] * r * w.o_norm[i] * inp.g[off + i].sigmoid()).act();
            }
        }
    }
    o
}

/// `1 / sqrt(Σ x² + eps)` (fla's l2 norm).
fn l2_inv<F: Real>(x: &[F], eps: F) -> F {
    F::ONE / (crate::cpu::ops::dot(x, x) + eps).sqrt()
}

/// One token of the delta rule for one head: decay, predict, write, read with the updated state.
fn recurrent_step<F: Real>(s: &mut [F], hs: &HeadSeq<F>, ti: usize, dk: usize, out: &mut [F]) {
    let dv = dk;
    let k = &hs.k[ti * dk..(ti + 1) * dk];
    let q = &hs.q[ti * dk..(ti + 1) * dk];
    let v = &hs.v[ti * dv..(ti + 1) * dv];
    let g = &hs.g[ti * dk..(ti + 1) * dk];
    for i in 0..dk {
        let decay = g[i].exp();
        for x in &mut s[i * dv..(i + 1) * dv] {
            *x *= decay;
        }
    }
    let mut u = v.to_vec();
    for i in 0..dk {
        for (uj, sij) in u.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
            *uj -= k[i] * *sij;
        }
    }
    let beta = hs.beta[ti];
    for i in 0..dk {
        let bk = beta * k[i];
        for (sij, uj) in s[i * dv..(i + 1) * dv].iter_mut().zip(&u) {
            *sij += bk * *uj;
        }
    }
    out.fill(F::ZERO);
    for i in 0..dk {
        for (oj, sij) in out.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
            *oj += q[i] * *sij;
        }
    }
}

/// The chunked (WY) form for one head over all `t` tokens; writes head `h`'s outputs into `o` (`[t, p]`).
fn chunked_head<F: Real>(s: &mut [F], hs: &HeadSeq<F>, t: usize, dk: usize, o: &mut [F], p: usize, h: usize) {
    let dv = dk;
    let mut start = 0;
    while start < t {
        let n = CHUNK.min(t - start);
        let row = |i: usize, width: usize| (start + i) * width;
        // G: in-chunk cumulative log-decay, [n, K].
        let mut gc = vec![F::ZERO; n * dk];
        for i in 0..n {
            for c in 0..dk {
                let prev = if i == 0 { F::ZERO } else { gc[(i - 1) * dk + c] };
                gc[i * dk + c] = prev + hs.g[row(i, dk) + c];
            }
        }
        let k = |i: usize| &hs.k[row(i, dk)..row(i, dk) + dk];
        let q = |i: usize| &hs.q[row(i, dk)..row(i, dk) + dk];
        let v = |i: usize| &hs.v[row(i, dv)..row(i, dv) + dv];
        let beta = |i: usize| hs.beta[start + i];
        // Decayed inner products: kk[i][j] = Σ_c k_i e^{G_i - G_j} k_j, qk likewise with q_i.
        let decayed = |a: &[F], i: usize, j: usize| {
            let mut acc = F::ZERO;
            for c in 0..dk {
                acc += a[c] * (gc[i * dk + c] - gc[j * dk + c]).exp() * k(j)[c];
            }
            acc
        };
        // Forward substitution for (I + L) X = diag(β) [e^G ⊙ K | V]: rows of W (K wide) and U (V wide).
        let mut wmat = vec![F::ZERO; n * dk];
        let mut umat = vec![F::ZERO; n * dv];
        for i in 0..n {
            for c in 0..dk {
                wmat[i * dk + c] = beta(i) * gc[i * dk + c].exp() * k(i)[c];
            }
            for c in 0..dv {
                umat[i * dv + c] = beta(i) * v(i)[c];
            }
            for j in 0..i {
                let lij = beta(i) * decayed(k(i), i, j);
                for c in 0..dk {
                    let x = wmat[j * dk + c];
                    wmat[i * dk + c] -= lij * x;
                }
                for c in 0..dv {
                    let x = umat[j * dv + c];
                    umat[i * dv + c] -= lij * x;
                }
            }
        }
        // V' = U − W S.
        let mut vp = umat;
        for i in 0..n {
            for c in 0..dk {
                let wic = wmat[i * dk + c];
                for (x, sc) in vp[i * dv..(i + 1) * dv].iter_mut().zip(&s[c * dv..(c + 1) * dv]) {
                    *x -= wic * *sc;
                }
            }
        }
        // O = (Q ⊙ e^G) S + A V'.
        for i in 0..n {
            let out = &mut o[(start + i) * p + h * dk..(start + i) * p + (h + 1) * dk];
            out.fill(F::ZERO);
            for c in 0..dk {
                let qc = q(i)[c] * gc[i * dk + c].exp();
                for (oj, sc) in out.iter_mut().zip(&s[c * dv..(c + 1) * dv]) {
                    *oj += qc * *sc;
                }
            }
            for j in 0..=i {
                let aij = decayed(q(i), i, j);
                for (oj, x) in out.iter_mut().zip(&vp[j * dv..(j + 1) * dv]) {
                    *oj += aij * *x;
                }
            }
        }
        // S_new = diag(e^{G_n}) S + (e^{G_n − G} ⊙ K)ᵀ V'.
        let last = n - 1;
        for c in 0..dk {
            let d = gc[last * dk + c].exp();
            for x in &mut s[c * dv..(c + 1) * dv] {
                *x *= d;
            }
            for j in 0..n {
                let kc = (gc[last * dk + c] - gc[j * dk + c]).exp() * k(j)[c];
                for (x, vv) in s[c * dv..(c + 1) * dv].iter_mut().zip(&vp[j * dv..(j + 1) * dv]) {
                    *x += kc * *vv;
                }
            }
        }
        start += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::Linear;
    use rand::{Rng, SeedableRng};

    fn random_layer<F: Real>(cfg: &KdaConfig, rng: &mut rand_chacha::ChaCha8Rng) -> KdaWeights<F> {
        let p = cfg.proj_dim();
        let mut v =
            |n: usize, lo: f64, hi: f64| -> Vec<F> { (0..n).map(|_| F::from_f64(rng.gen_range(lo..hi))).collect() };
        let empty = || Linear::new(0, 0, Vec::new());
        KdaWeights {
            q_proj: empty(),
            k_proj: empty(),
            v_proj: empty(),
            g_proj: empty(),
            o_proj: empty(),
            f_a_proj: empty(),
            f_b_proj: empty(),
            b_proj: empty(),
            conv: [
                v(p * cfg.conv_kernel, -0.5, 0.5),
                v(p * cfg.conv_kernel, -0.5, 0.5),
                v(p * cfg.conv_kernel, -0.5, 0.5),
            ],
            a: v(cfg.num_heads, 1.0, 16.0),
            dt_bias: v(p, -5.0, -1.0),
            o_norm: v(cfg.head_dim, 0.5, 1.5),
            o_norm_eps: F::from_f64(1e-5),
        }
    }

    struct Window {
        qkv: [Vec<f64>; 3],
        f: Vec<f64>,
        b: Vec<f64>,
        g: Vec<f64>,
    }

    fn random_window(cfg: &KdaConfig, t: usize, rng: &mut rand_chacha::ChaCha8Rng) -> Window {
        let p = cfg.proj_dim();
        let mut v = |n: usize, scale: f64| -> Vec<f64> { (0..n).map(|_| rng.gen_range(-scale..scale)).collect() };
        Window {
            qkv: [v(t * p, 2.0), v(t * p, 2.0), v(t * p, 2.0)],
            f: v(t * p, 2.0),
            b: v(t * cfg.num_heads, 2.0),
            g: v(t * p, 2.0),
        }
    }

    fn run(
        cfg: &KdaConfig,
        w: &KdaWeights<f64>,
        state: &mut KdaState<f64>,
        win: &Window,
        range: std::ops::Range<usize>,
        snaps: Option<(usize, &mut Vec<KdaState<f64>>)>,
    ) -> Vec<f64> {
        let p = cfg.proj_dim();
        let h = cfg.num_heads;
        let (s, e) = (range.start, range.end);
        let inputs = KdaInputs {
            qkv: [&win.qkv[0][s * p..e * p], &win.qkv[1][s * p..e * p], &win.qkv[2][s * p..e * p]],
            f: &win.f[s * p..e * p],
            b: &win.b[s * h..e * h],
            g: &win.g[s * p..e * p],
        };
        kda_window(cfg, w, state, &inputs, snaps)
    }

    fn cfg() -> KdaConfig {
        KdaConfig { num_heads: 2, head_dim: 8, conv_kernel: 4, gate_lower_bound: -5.0 }
    }

    fn zeros(cfg: &KdaConfig) -> KdaState<f64> {
        let p = cfg.proj_dim();
        KdaState {
            s: vec![0.0; cfg.num_heads * cfg.head_dim * cfg.head_dim],
            conv: [vec![0.0; 3 * p], vec![0.0; 3 * p], vec![0.0; 3 * p]],
        }
    }

    fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    }

    #[test]
    fn chunked_form_equals_the_recurrence_in_f64() {
        let cfg = cfg();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let w = random_layer::<f64>(&cfg, &mut rng);
        let t = 3 * CHUNK + 5; // several chunks and a partial one
        let win = random_window(&cfg, t, &mut rng);
        // Start both from the same non-zero state.
        let mut warm = zeros(&cfg);
        let warmup = random_window(&cfg, 6, &mut rng);
        run(&cfg, &w, &mut warm, &warmup, 0..6, None);

        let mut chunked = warm.clone();
        let out_chunked = run(&cfg, &w, &mut chunked, &win, 0..t, None);
        assert!(t > CHUNKED_MIN_TOKENS);
        let mut recurrent = warm;
        let mut out_rec = Vec::new();
        for i in 0..t {
            out_rec.extend(run(&cfg, &w, &mut recurrent, &win, i..i + 1, None));
        }
        let d_out = max_diff(&out_chunked, &out_rec);
        let d_state = max_diff(&chunked.s, &recurrent.s);
        assert!(d_out < 1e-11, "outputs differ by {d_out}");
        assert!(d_state < 1e-11, "states differ by {d_state}");
        assert_eq!(chunked.conv, recurrent.conv);
        // The outputs are not trivially zero.
        assert!(out_rec.iter().map(|x| x.abs()).fold(0.0, f64::max) > 1e-3);
    }

    #[test]
    fn snapshots_restore_the_state_of_a_shorter_run_exactly() {
        let cfg = cfg();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let w = random_layer::<f64>(&cfg, &mut rng);
        let t = 8;
        let win = random_window(&cfg, t, &mut rng);
        let mut full = zeros(&cfg);
        let mut snaps = Vec::new();
        run(&cfg, &w, &mut full, &win, 0..t, Some((1, &mut snaps)));
        assert_eq!(snaps.len(), t - 1);
        for m in 1..t {
            let mut short = zeros(&cfg);
            run(&cfg, &w, &mut short, &win, 0..m, None);
            assert_eq!(snaps[m - 1], short, "state after {m} tokens");
        }
    }
}
