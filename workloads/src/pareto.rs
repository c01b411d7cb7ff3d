//! The throughput–interactivity Pareto frontier and its curve (agentx.md §2.5); [`crate::plot`] draws them.
//!
//! Invariants:
//! - The frontier follows InferenceX-app's `paretoFrontUpperLeft`: sort by x ascending (ties: y
//!   descending, keep the first), then for each point pop from the back while its y ≥ the last
//!   kept y, and push it. Kept points trade lower interactivity for strictly higher throughput.
//! - The line is a monotone cubic Hermite spline (Steffen 1990, like `d3.curveMonotoneX`) through
//!   the frontier only, never extrapolated.

use serde::{Deserialize, Serialize};

/// One run of a sweep.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParetoPoint {
    pub concurrency: usize,
    /// P90 interactivity, tokens/s/user.
    pub x: f64,
    /// Throughput in tokens/s: per GPU when `per_gpu`, else for the whole server.
    pub y: f64,
    pub per_gpu: bool,
    pub p90_ttft_s: f64,
}

/// The upper-left frontier of `points`.
pub fn frontier(points: &[ParetoPoint]) -> Vec<ParetoPoint> {
    let mut sorted: Vec<&ParetoPoint> = points.iter().filter(|p| p.x.is_finite() && p.y.is_finite()).collect();
    sorted.sort_by(|a, b| a.x.total_cmp(&b.x).then(b.y.total_cmp(&a.y)));
    sorted.dedup_by(|later, earlier| later.x == earlier.x);
    let mut front: Vec<ParetoPoint> = Vec::new();
    for p in sorted {
        while front.last().is_some_and(|last| p.y >= last.y) {
            front.pop();
        }
        front.push(p.clone());
    }
    front
}

/// Steffen's monotone slopes at each knot.
fn steffen_slopes(xs: &[f64], ys: &[f64]) -> Vec<f64> {
    let n = xs.len();
    if n < 2 {
        return vec![0.0; n];
    }
    let h: Vec<f64> = xs.windows(2).map(|w| w[1] - w[0]).collect();
    let s: Vec<f64> = (0..n - 1).map(|i| (ys[i + 1] - ys[i]) / h[i]).collect();
    let mut m = vec![0.0; n];
    for i in 1..n - 1 {
        let p = (s[i - 1] * h[i] + s[i] * h[i - 1]) / (h[i - 1] + h[i]);
        m[i] = (s[i - 1].signum() + s[i].signum()) * s[i - 1].abs().min(s[i].abs()).min(0.5 * p.abs());
    }
    m[0] = s[0];
    m[n - 1] = s[n - 2];
    m
}

/// Samples the monotone spline through the frontier, `per_segment` points per segment.
pub fn spline(front: &[ParetoPoint], per_segment: usize) -> Vec<(f64, f64)> {
    let xs: Vec<f64> = front.iter().map(|p| p.x).collect();
    let ys: Vec<f64> = front.iter().map(|p| p.y).collect();
    if xs.len() < 2 {
        return xs.into_iter().zip(ys).collect();
    }
    let m = steffen_slopes(&xs, &ys);
    let mut out = Vec::new();
    for i in 0..xs.len() - 1 {
        let h = xs[i + 1] - xs[i];
        for j in 0..per_segment {
            let t = j as f64 / per_segment as f64;
            let (t2, t3) = (t * t, t * t * t);
            let y = (2.0 * t3 - 3.0 * t2 + 1.0) * ys[i]
                + (t3 - 2.0 * t2 + t) * h * m[i]
                + (-2.0 * t3 + 3.0 * t2) * ys[i + 1]
                + (t3 - t2) * h * m[i + 1];
            out.push((xs[i] + t * h, y));
        }
    }
    out.push((xs[xs.len() - 1], ys[ys.len() - 1]));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(c: usize, x: f64, y: f64) -> ParetoPoint {
        ParetoPoint { concurrency: c, x, y, per_gpu: false, p90_ttft_s: 0.0 }
    }

    #[test]
    fn frontier_keeps_points_where_lower_interactivity_buys_more_throughput() {
        // c=4 is dominated by c=8 (more interactive and more throughput).
        let pts = [p(1, 100.0, 10.0), p(2, 80.0, 18.0), p(4, 50.0, 20.0), p(8, 60.0, 30.0), p(16, 20.0, 35.0)];
        let front: Vec<usize> = frontier(&pts).iter().map(|q| q.concurrency).collect();
        assert_eq!(front, vec![16, 8, 2, 1]);
    }

    #[test]
    fn spline_is_monotone_between_knots_and_hits_them() {
        let front = frontier(&[p(1, 100.0, 10.0), p(2, 80.0, 18.0), p(8, 60.0, 30.0), p(16, 20.0, 35.0)]);
        let curve = spline(&front, 20);
        for w in curve.windows(2) {
            assert!(w[1].0 >= w[0].0 && w[1].1 <= w[0].1 + 1e-9, "not monotone: {w:?}");
        }
        assert_eq!(curve.first(), Some(&(20.0, 35.0)));
        assert_eq!(curve.last(), Some(&(100.0, 10.0)));
    }
}
