//! `SpsProfile`: target forward steps per second as a function of the verify batch size in tokens,
//! SPS(B) (DSpark §2.2), measured at start-up or loaded from JSON.
//!
//! Invariants:
//! - Points are strictly increasing in `batch_tokens` with finite, positive rates.
//! - Interpolation is on the step *time* 1/SPS, made non-decreasing in B by a running maximum, linear
//!   between points, linear past the last point with the last segment's slope, and constant below
//!   the first point (vLLM's cost tables, `adaptive_verification.py`). So SPS(B) never increases.
//!
//! File format: `{"points": [{"batch_tokens": 1, "steps_per_second": 80.0}, ...]}`.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Result, SpecError};

/// One measured point.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpsPoint {
    pub batch_tokens: usize,
    pub steps_per_second: f64,
}

/// The SPS(B) table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpsProfile {
    points: Vec<SpsPoint>,
}

impl SpsProfile {
    pub fn from_points(points: Vec<SpsPoint>) -> Result<Self> {
        if points.is_empty() {
            return Err(SpecError::Profile("no points".into()));
        }
        if let Some(p) = points.iter().find(|p| !(p.steps_per_second.is_finite() && p.steps_per_second > 0.0)) {
            return Err(SpecError::Profile(format!(
                "batch {}: steps_per_second {} is not finite and positive",
                p.batch_tokens, p.steps_per_second
            )));
        }
        if let Some(w) = points.windows(2).find(|w| w[1].batch_tokens <= w[0].batch_tokens) {
            return Err(SpecError::Profile(format!(
                "batch sizes must strictly increase, found {} after {}",
                w[1].batch_tokens, w[0].batch_tokens
            )));
        }
        Ok(SpsProfile { points })
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let raw: SpsProfile = serde_json::from_str(text).map_err(|e| SpecError::Profile(format!("bad JSON: {e}")))?;
        SpsProfile::from_points(raw.points)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| SpecError::ProfileFile { path: path.display().to_string(), reason: e.to_string() })?;
        SpsProfile::from_json(&text)
            .map_err(|e| SpecError::ProfileFile { path: path.display().to_string(), reason: e.to_string() })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Measures SPS at each batch size with `time_step(B)`, the wall time of one target step of B
    /// tokens (the caller warms up and averages as it sees fit).
    pub fn measure<E: std::fmt::Display>(
        batch_sizes: &[usize],
        mut time_step: impl FnMut(usize) -> std::result::Result<Duration, E>,
    ) -> Result<Self> {
        let mut points = Vec::with_capacity(batch_sizes.len());
        for &b in batch_sizes {
            let t = time_step(b).map_err(|e| SpecError::Profile(format!("timing batch {b}: {e}")))?;
            let seconds = t.as_secs_f64();
            if seconds <= 0.0 {
                return Err(SpecError::Profile(format!("batch {b} took no measurable time")));
            }
            points.push(SpsPoint { batch_tokens: b, steps_per_second: 1.0 / seconds });
        }
        SpsProfile::from_points(points)
    }

    pub fn points(&self) -> &[SpsPoint] {
        &self.points
    }

    /// Step time at each point after the running maximum.
    fn monotone_times(&self) -> Vec<(f64, f64)> {
        let mut max = 0.0f64;
        self.points
            .iter()
            .map(|p| {
                max = max.max(1.0 / p.steps_per_second);
                (p.batch_tokens as f64, max)
            })
            .collect()
    }

    /// Seconds per target step at `batch_tokens`.
    pub fn step_seconds(&self, batch_tokens: usize) -> f64 {
        let b = batch_tokens as f64;
        let t = self.monotone_times();
        let (first, last) = (t[0], t[t.len() - 1]);
        if b <= first.0 {
            return first.1;
        }
        let segment = match t.windows(2).find(|w| b <= w[1].0) {
            Some(w) => (w[0], w[1]),
            None if t.len() >= 2 => (t[t.len() - 2], last),
            None => return last.1,
        };
        let ((b0, t0), (b1, t1)) = segment;
        t0 + (t1 - t0) * (b - b0) / (b1 - b0)
    }

    /// SPS(B).
    pub fn sps(&self, batch_tokens: usize) -> f64 {
        1.0 / self.step_seconds(batch_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(points: &[(usize, f64)]) -> SpsProfile {
        SpsProfile::from_points(
            points.iter().map(|&(b, s)| SpsPoint { batch_tokens: b, steps_per_second: s }).collect(),
        )
        .unwrap()
    }

    #[test]
    fn interpolates_step_time_linearly() {
        let p = profile(&[(1, 100.0), (9, 50.0)]);
        assert!((p.step_seconds(1) - 0.01).abs() < 1e-12);
        assert!((p.step_seconds(5) - 0.015).abs() < 1e-12);
        assert!((p.step_seconds(17) - 0.03).abs() < 1e-12, "extrapolates the last slope");
        assert!((p.sps(0) - 100.0).abs() < 1e-9, "constant below the first point");
    }

    #[test]
    fn a_jagged_profile_is_made_monotone() {
        let p = profile(&[(1, 100.0), (2, 50.0), (3, 80.0)]);
        assert!((p.sps(3) - 50.0).abs() < 1e-9);
        assert!((2..40).all(|b| p.sps(b) <= p.sps(b - 1) + 1e-12));
    }

    #[test]
    fn json_round_trips_and_bad_profiles_are_errors() {
        let p = profile(&[(1, 100.0), (64, 40.0)]);
        assert_eq!(SpsProfile::from_json(&p.to_json()).unwrap(), p);
        assert_eq!(SpsProfile::from_json("{\"points\": []}").unwrap_err().kind(), "profile");
        assert!(SpsProfile::from_json("{\"points\": [{\"batch_tokens\": 4, \"steps_per_second\": 1.0}, {\"batch_tokens\": 2, \"steps_per_second\": 1.0}]}").is_err());
        assert!(SpsProfile::from_json("{\"points\": [{\"batch_tokens\": 4, \"steps_per_second\": 0.0}]}").is_err());
        assert!(SpsProfile::from_json("not json").is_err());
        let missing = SpsProfile::load(Path::new("/nonexistent/sps.json")).unwrap_err();
        assert_eq!(missing.kind(), "profile_file");
    }

    #[test]
    fn measure_times_each_batch() {
        let p = SpsProfile::measure(&[1, 8], |b| Ok::<_, String>(Duration::from_millis(10 + b as u64))).unwrap();
        assert!((p.sps(8) - 1.0 / 0.018).abs() < 1e-6);
        assert!(SpsProfile::measure(&[1], |_| Err::<Duration, _>("device lost")).is_err());
    }
}
