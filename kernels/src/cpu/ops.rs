//! Elementwise and small-matrix ops of the CPU reference: linear layers, RMSNorm, SiTU, the AttnRes
//! depth-softmax read.
//!
//! Invariants: every op computes in the scalar type `F` and rounds its output with `Real::act` where
//! K3 keeps the result in bf16 (GEMM outputs, norm outputs, activations); reductions (RMS, softmax,
//! dot products) accumulate in `F` (fp32 in serving, f64 when checking).
//! Source of the math: shared/reference/k3-architecture.md §2.2 (AttnRes), §2.3 (RMSNorm), §2.7 (SiTU).

use crate::float::Real;

/// Layers with at least this many weights run on several threads.
const PARALLEL_MIN_WEIGHTS: usize = 1 << 20;

/// The number of threads large layers use (the machine's parallelism).
fn worker_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// A linear layer `y = W x` with `W` stored `[out, in]` (PyTorch layout).
#[derive(Clone, Debug)]
pub struct Linear<F> {
    pub out_dim: usize,
    pub in_dim: usize,
    /// `[out, in]`
    pub w: Vec<F>,
}

impl<F: Real> Linear<F> {
    pub fn new(out_dim: usize, in_dim: usize, w: Vec<F>) -> Self {
        debug_assert_eq!(w.len(), out_dim * in_dim);
        Linear { out_dim, in_dim, w }
    }

    /// `x`: `[n, in]` → `[n, out]`, each output rounded to the activation precision. Large layers
    /// (the lm_head) split their output rows over the machine's threads; every output is the same
    /// dot product either way, so the result does not depend on the split.
    pub fn forward(&self, x: &[F]) -> Vec<F> {
        self.forward_with(x, true)
    }

    /// [`Self::forward`] without the rounding: the partial sums of a row-parallel shard (`W`'s columns
    /// split over ranks), rounded only once every rank's part is added (`cpu::shard`).
    pub fn forward_partial(&self, x: &[F]) -> Vec<F> {
        self.forward_with(x, false)
    }

    fn forward_with(&self, x: &[F], round: bool) -> Vec<F> {
        let n = x.len() / self.in_dim;
        let mut y = vec![F::ZERO; n * self.out_dim];
        let threads = if self.out_dim * self.in_dim >= PARALLEL_MIN_WEIGHTS { worker_threads() } else { 1 };
        if threads <= 1 {
            self.forward_rows(x, &mut y, 0, self.out_dim, round);
            return y;
        }
        // Each worker computes a contiguous band of output rows for every token.
        let band = self.out_dim.div_ceil(threads);
        let bands: Vec<Vec<F>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|i| {
                    let (lo, hi) = (i * band, ((i + 1) * band).min(self.out_dim));
                    scope.spawn(move || {
                        let mut part = vec![F::ZERO; n * (hi - lo)];
                        self.forward_rows(x, &mut part, lo, hi, round);
                        part
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
        });
        for (i, part) in bands.iter().enumerate() {
            let (lo, hi) = (i * band, ((i + 1) * band).min(self.out_dim));
            for t in 0..n {
                y[t * self.out_dim + lo..t * self.out_dim + hi]
                    .copy_from_slice(&part[t * (hi - lo)..(t + 1) * (hi - lo)]);
            }
        }
        y
    }

    /// Output rows `lo..hi` for every token into `out` (`[n, hi - lo]`), rounded when `round`. Weight rows
    /// are the outer loop, so each is read from memory once per call whatever the number of tokens.
    fn forward_rows(&self, x: &[F], out: &mut [F], lo: usize, hi: usize, round: bool) {
        let width = hi - lo;
        let rows = &self.w[lo * self.in_dim..hi * self.in_dim];
        for (r, wr) in rows.chunks_exact(self.in_dim).enumerate() {
            for (t, xr) in x.chunks_exact(self.in_dim).enumerate() {
                let y = dot(wr, xr);
                out[t * width + r] = if round { y.act() } else { y };
            }
        }
    }

    /// One row of the output for one input vector, unrounded (for fp32 islands such as the router).
    pub fn row_dot(&self, row: usize, x: &[F]) -> F {
        dot(&self.w[row * self.in_dim..(row + 1) * self.in_dim], x)
    }
}

/// Dot product with eight independent accumulators, so the compiler vectorises it.
#[inline]
pub fn dot<F: Real>(a: &[F], b: &[F]) -> F {
    let mut acc = [F::ZERO; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: F = ac.remainder().iter().zip(bc.remainder()).fold(F::ZERO, |s, (x, y)| s + *x * *y);
    for (x, y) in ac.zip(bc) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// An RMSNorm weight with its epsilon.
#[derive(Clone, Debug)]
pub struct RmsNorm<F> {
    /// `[dim]`
    pub w: Vec<F>,
    pub eps: F,
}

impl<F: Real> RmsNorm<F> {
    /// KimiRMSNorm over rows of `x` (`[n, dim]`): `w * act(x * rsqrt(mean(x^2) + eps))`, rounded.
    pub fn forward(&self, x: &[F]) -> Vec<F> {
        let dim = self.w.len();
        let mut y = vec![F::ZERO; x.len()];
        for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
            let r = rms_inv(xr, self.eps);
            for ((o, xv), wv) in yr.iter_mut().zip(xr).zip(&self.w) {
                *o = (*wv * (*xv * r).act()).act();
            }
        }
        y
    }
}

/// `1 / sqrt(mean(x^2) + eps)`.
#[inline]
pub fn rms_inv<F: Real>(x: &[F], eps: F) -> F {
    let ss = dot(x, x);
    F::ONE / (ss / F::from_f64(x.len() as f64) + eps).sqrt()
}

/// SiTU (an fp32 island): `[β·tanh(g/β)·σ(g)] · [β_l·tanh(u/β_l)]`.
#[inline]
pub fn situ<F: Real>(g: F, u: F, beta: F, linear_beta: F) -> F {
    (beta * (g / beta).tanh() * g.sigmoid()) * (linear_beta * (u / linear_beta).tanh())
}

/// SiTU over paired rows, rounded: `gate`, `up` `[n, width]` → `[n, width]`.
pub fn situ_rows<F: Real>(gate: &[F], up: &[F], beta: F, linear_beta: F) -> Vec<F> {
    gate.iter().zip(up).map(|(g, u)| situ(*g, *u, beta, linear_beta).act()).collect()
}

/// The folded AttnRes pseudo-query of one read: `q[c] = w_norm[c] * w_proj[0, c]` (exact in fp32).
#[derive(Clone, Debug)]
pub struct AttnResQuery<F> {
    /// `[d]`
    pub q: Vec<F>,
    pub eps: F,
}

impl<F: Real> AttnResQuery<F> {
    /// The depth-wise softmax read over `sources` (each `[n, d]`, sealed blocks first, the live sum last)
    /// for every one of the `n` tokens: `out = Σ_i softmax_i(Σ_c v_i[c] r_i q[c]) v_i`, rounded.
    pub fn read(&self, sources: &[&[F]]) -> Vec<F> {
        let d = self.q.len();
        let n = sources[0].len() / d;
        let mut out = vec![F::ZERO; n * d];
        let mut scores = vec![F::ZERO; sources.len()];
        for t in 0..n {
            for (s, src) in scores.iter_mut().zip(sources) {
                let v = &src[t * d..(t + 1) * d];
                *s = dot(v, &self.q) * rms_inv(v, self.eps);
            }
            softmax_in_place(&mut scores);
            let o = &mut out[t * d..(t + 1) * d];
            for (p, src) in scores.iter().zip(sources) {
                for (oc, vc) in o.iter_mut().zip(&src[t * d..(t + 1) * d]) {
                    *oc += *p * *vc;
                }
            }
            for oc in o.iter_mut() {
                *oc = oc.act();
            }
        }
        out
    }
}

/// Numerically stable softmax.
pub fn softmax_in_place<F: Real>(x: &mut [F]) {
    let m = x.iter().copied().fold(x[0], F::max);
    let mut sum = F::ZERO;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v = *v / sum;
    }
}

/// Elementwise `act(a + b)` (the bf16 residual add).
pub fn add_rows<F: Real>(a: &[F], b: &[F]) -> Vec<F> {
    a.iter().zip(b).map(|(x, y)| (*x + *y).act()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attn_res_read_weights_sources_by_similarity_to_the_query() {
        // Two sources of d = 2; the query points along the first axis.
        let q = AttnResQuery { q: vec![1.0f64, 0.0], eps: 0.0 };
        let a = [3.0f64, 0.0];
        let b = [0.0f64, 5.0];
        let out = q.read(&[&a, &b]);
        // scores: a → 3 * rsqrt(4.5) = sqrt(2); b → 0.
        let pa = 1.0 / (1.0 + (-(2f64).sqrt()).exp());
        assert!((out[0] - 3.0 * pa).abs() < 1e-12);
        assert!((out[1] - 5.0 * (1.0 - pa)).abs() < 1e-12);
    }

    #[test]
    fn situ_tends_to_swiglu_for_large_betas() {
        let (g, u) = (0.7f64, -1.3f64);
        let big = situ(g, u, 1e6, 1e6);
        assert!((big - g / (1.0 + (-g).exp()) * u).abs() < 1e-9);
        // The gate branch is soft-capped near beta.
        assert!(situ(100.0f64, 1.0, 4.0, 25.0) < 4.0 * 1.0 + 1e-9);
    }

    #[test]
    fn rmsnorm_normalises_rows() {
        let n = RmsNorm { w: vec![1.0f64; 4], eps: 0.0 };
        let y = n.forward(&[1.0, -1.0, 1.0, -1.0, 2.0, 2.0, 2.0, 2.0]);
        assert_eq!(y, vec![1.0, -1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0]);
    }
}
