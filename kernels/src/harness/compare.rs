//! The comparisons every check of the harness makes: one output against its reference, as an [`OpCheck`]
//! (relative L2 error, largest absolute error, tolerance, verdict), and the random bf16 inputs they run on.
//!
//! Invariants: a comparison with any non-finite value on the checked side, or of two lengths, fails; inputs
//! are random bf16 values (never zeros), so a kernel that writes nothing cannot pass.

use cudarc::driver::CudaSlice;
use half::bf16;
use rand::Rng;

use crate::cuda::gpu::Gpu;
use crate::error::Result;

/// One op comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpCheck {
    pub op: String,
    /// `|gpu - cpu|_2 / |cpu|_2`
    pub rel_l2: f64,
    pub max_abs: f64,
    pub tolerance: f64,
    pub pass: bool,
}

/// `gpu` against the reference `cpu` under `tolerance` (relative L2).
pub fn compare(op: &str, gpu: &[f32], cpu: &[f32], tolerance: f64) -> OpCheck {
    let (mut num, mut den, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
    for (g, c) in gpu.iter().zip(cpu) {
        let d = (*g as f64 - *c as f64).abs();
        num += d * d;
        den += (*c as f64) * (*c as f64);
        max_abs = max_abs.max(d);
    }
    let finite = gpu.iter().all(|x| x.is_finite()) && gpu.len() == cpu.len();
    let rel_l2 = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    OpCheck { op: op.into(), rel_l2, max_abs, tolerance, pass: finite && rel_l2 <= tolerance }
}

/// Random values rounded to bf16, `[n]`.
pub fn random_bf16(rng: &mut rand_chacha::ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| bf16::from_f32(rng.gen_range(-scale..scale)).to_f32()).collect()
}

/// `x` rounded to bf16 on the device, `[x.len()]`.
pub fn up(gpu: &Gpu, x: &[f32]) -> Result<CudaSlice<bf16>> {
    gpu.upload(&x.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>())
}

/// The first `n` values of a bf16 device buffer, widened to f32.
pub fn down(gpu: &Gpu, x: &CudaSlice<bf16>, n: usize) -> Result<Vec<f32>> {
    Ok(gpu.download(x, n)?.into_iter().map(f32::from).collect())
}

/// Relative L2 error of `a` against the reference `b`.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// The greedy token of a logits row (the first of equal maxima).
pub fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}
