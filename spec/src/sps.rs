//! `SpsProfile`: target forward steps per second as a function of the verify batch size in tokens,
//! SPS(B) (DSpark §2.2), and the model drafter's cost per round as a function of the rows it drafts
//! (vLLM's `draft_cost[n_reqs]`, dspark.md §2.2), measured at start-up or loaded from JSON.
//!
//! Invariants:
//! - Points are strictly increasing in `batch_tokens` with finite, positive rates; draft points are
//!   strictly increasing in `rows` with finite, non-negative seconds.
//! - Interpolation is on the step *time* 1/SPS (and on the draft time), made non-decreasing by a
//!   running maximum, linear between points, linear past the last point with the last segment's
//!   slope, and constant below the first point (vLLM's cost tables, `adaptive_verification.py`). So
//!   SPS(B) never increases and the draft cost never decreases with rows. Without a draft table
//!   (model-free proposers) drafting costs nothing; drafting no row costs nothing.
//!
//! File format: `{"points": [{"batch_tokens": 1, "steps_per_second": 80.0}, ...], "draft": [{"rows": 1,
//! "seconds": 0.0014}, ...]}`; `draft` is optional (older files have none).

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

/// One measured drafter round: `seconds` to draft a block for each of `rows` rows.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DraftPoint {
    pub rows: usize,
    pub seconds: f64,
}

/// The SPS(B) table and the draft-cost table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpsProfile {
    points: Vec<SpsPoint>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    draft: Vec<DraftPoint>,
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
        Ok(SpsProfile { points, draft: Vec::new() })
    }

    /// The same profile with the draft-cost table `draft` (replacing any earlier one).
    pub fn with_draft_cost(self, draft: Vec<DraftPoint>) -> Result<Self> {
        if let Some(p) = draft.iter().find(|p| !(p.seconds.is_finite() && p.seconds >= 0.0)) {
            return Err(SpecError::Profile(format!(
                "draft of {} rows: seconds {} is not finite and non-negative",
                p.rows, p.seconds
            )));
        }
        if let Some(w) = draft.windows(2).find(|w| w[1].rows <= w[0].rows) {
            return Err(SpecError::Profile(format!(
                "draft row counts must strictly increase, found {} after {}",
                w[1].rows, w[0].rows
            )));
        }
        Ok(SpsProfile { draft, ..self })
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let raw: SpsProfile = serde_json::from_str(text).map_err(|e| SpecError::Profile(format!("bad JSON: {e}")))?;
        SpsProfile::from_points(raw.points)?.with_draft_cost(raw.draft)
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

    /// Measures the draft cost at each row count with `time_draft(rows)`, the wall time of one drafter
    /// round over that many rows; returns the table for [`Self::with_draft_cost`].
    pub fn measure_draft<E: std::fmt::Display>(
        row_counts: &[usize],
        mut time_draft: impl FnMut(usize) -> std::result::Result<Duration, E>,
    ) -> Result<Vec<DraftPoint>> {
        row_counts
            .iter()
            .map(|&rows| {
                let t =
                    time_draft(rows).map_err(|e| SpecError::Profile(format!("timing a draft of {rows} rows: {e}")))?;
                Ok(DraftPoint { rows, seconds: t.as_secs_f64() })
            })
            .collect()
    }

    pub fn points(&self) -> &[SpsPoint] {
        &self.points
    }

    pub fn draft_points(&self) -> &[DraftPoint] {
        &self.draft
    }

    /// Seconds per target step at `batch_tokens`.
    pub fn step_seconds(&self, batch_tokens: usize) -> f64 {
        let times = self.points.iter().map(|p| (p.batch_tokens as f64, 1.0 / p.steps_per_second));
        monotone_interpolate(&running_max(times), batch_tokens as f64)
    }

    /// Seconds of one drafter round over `rows` rows (0 without a draft table or without rows).
    pub fn draft_seconds(&self, rows: usize) -> f64 {
        if rows == 0 || self.draft.is_empty() {
            return 0.0;
        }
        let times = self.draft.iter().map(|p| (p.rows as f64, p.seconds));
        monotone_interpolate(&running_max(times), rows as f64)
    }

    /// SPS(B).
    pub fn sps(&self, batch_tokens: usize) -> f64 {
        1.0 / self.step_seconds(batch_tokens)
    }
}

/// `(x, y)` points with `y` replaced by its running maximum.
fn running_max(points: impl Iterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
    let mut max = 0.0f64;
    points
        .map(|(x, y)| {
            max = max.max(y);
            (x, max)
        })
        .collect()
}

/// Linear interpolation over non-empty `t` (x strictly increasing): constant below the first point,
/// the last segment's slope past the last point.
fn monotone_interpolate(t: &[(f64, f64)], x: f64) -> f64 {
    let (first, last) = (t[0], t[t.len() - 1]);
    if x <= first.0 {
        return first.1;
    }
    let segment = match t.windows(2).find(|w| x <= w[1].0) {
        Some(w) => (w[0], w[1]),
        None if t.len() >= 2 => (t[t.len() - 2], last),
        None => return last.1,
    };
    let ((x0, y0), (x1, y1)) = segment;
    y0 + (y1 - y0) * (x - x0) / (x1 - x0)
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
    fn the_draft_table_is_optional_interpolated_and_validated() {
        let old = SpsProfile::from_json(r#"{"points": [{"batch_tokens": 1, "steps_per_second": 100.0}]}"#).unwrap();
        assert_eq!((old.draft_seconds(1), old.draft_seconds(64)), (0.0, 0.0), "older files: drafting is free");
        assert!(!old.to_json().contains("draft"), "no table, none written");
        let draft = vec![DraftPoint { rows: 1, seconds: 0.002 }, DraftPoint { rows: 9, seconds: 0.004 }];
        let p = old.with_draft_cost(draft).unwrap();
        assert_eq!(p.draft_seconds(0), 0.0, "no rows, no draft");
        assert!((p.draft_seconds(1) - 0.002).abs() < 1e-12);
        assert!((p.draft_seconds(5) - 0.003).abs() < 1e-12);
        assert!((p.draft_seconds(17) - 0.006).abs() < 1e-12, "extrapolates the last slope");
        assert_eq!(SpsProfile::from_json(&p.to_json()).unwrap(), p);
        let bad = r#"{"points": [{"batch_tokens": 1, "steps_per_second": 1.0}], "draft": [{"rows": 8, "seconds": 0.1}, {"rows": 8, "seconds": 0.2}]}"#;
        assert_eq!(SpsProfile::from_json(bad).unwrap_err().kind(), "profile");
        let negative = vec![DraftPoint { rows: 1, seconds: -1.0 }];
        assert!(SpsProfile::from_points(vec![SpsPoint { batch_tokens: 1, steps_per_second: 1.0 }])
            .unwrap()
            .with_draft_cost(negative)
            .is_err());
        let table =
            SpsProfile::measure_draft(&[1, 8], |rows| Ok::<_, String>(Duration::from_millis(rows as u64))).unwrap();
        assert_eq!(table[1], DraftPoint { rows: 8, seconds: 0.008 });
        assert!(SpsProfile::measure_draft(&[1], |_| Err::<Duration, _>("no drafter")).is_err());
    }

    #[test]
    fn measure_times_each_batch() {
        let p = SpsProfile::measure(&[1, 8], |b| Ok::<_, String>(Duration::from_millis(10 + b as u64))).unwrap();
        assert!((p.sps(8) - 1.0 / 0.018).abs() < 1e-6);
        assert!(SpsProfile::measure(&[1], |_| Err::<Duration, _>("device lost")).is_err());
    }
}
