//! The JSON run report, sweep output and the side-by-side comparison of two reports.
//!
//! Invariants:
//! - A report states every factor that changes what was measured: concurrency, transport,
//!   `time_scale`, `token_scale`, idle caps, t* range, seed, GPUs, the traces; so two reports
//!   are only compared knowingly.
//! - `compare` reads reports this tool wrote (a sweep report's runs, or a single run) and prints
//!   ratios B/A; a missing or malformed file is a [`ReplayError::Report`] naming it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{ReplayError, Result};
use crate::metrics::{RequestRecord, Summary};
use crate::pareto::ParetoPoint;

/// The settings a run was made with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub url: String,
    pub transport: String,
    pub model: String,
    pub concurrency: usize,
    pub duration_s: Option<f64>,
    pub max_requests: Option<usize>,
    /// Factor on recorded delays.
    pub time_scale: f64,
    /// Factor on recorded input/output lengths (block size scaled alike).
    pub token_scale: f64,
    pub system_idle_cap_s: Option<f64>,
    pub tree_idle_cap_s: Option<f64>,
    pub start_ratio: Option<(f64, f64)>,
    pub seed: u64,
    pub gpus: u32,
    pub traces: Vec<String>,
    pub sessions: usize,
}

/// One run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub tool: String,
    pub config: RunConfig,
    pub summary: Summary,
    pub warmup_requests: usize,
    pub plays: u64,
    pub wall_s: f64,
    pub idle_skipped_s: f64,
    pub records: Vec<RequestRecord>,
}

/// A sweep: one run per concurrency and the Pareto frontier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    pub tool: String,
    pub runs: Vec<RunReport>,
    pub points: Vec<ParetoPoint>,
    pub frontier: Vec<ParetoPoint>,
}

/// The tool name and version written into reports.
pub fn tool_name() -> String {
    format!("sparkd-replay {}", env!("CARGO_PKG_VERSION"))
}

impl RunReport {
    pub fn point(&self) -> ParetoPoint {
        ParetoPoint {
            concurrency: self.config.concurrency,
            x: self.summary.p90_interactivity,
            y: self.summary.total_tokens_per_s_per_gpu,
            output_tokens_per_s_per_gpu: self.summary.output_tokens_per_s_per_gpu,
            p90_ttft_s: self.summary.ttft_s.p90,
        }
    }
}

/// Writes any report as pretty JSON.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| ReplayError::Report { path: path.to_path_buf(), reason: e.to_string() })?;
    std::fs::write(path, text).map_err(|e| ReplayError::Report { path: path.to_path_buf(), reason: e.to_string() })
}

/// Reads the runs of a report file: a single run, or every run of a sweep.
pub fn read_runs(path: &Path) -> Result<Vec<RunReport>> {
    let err = |reason: String| ReplayError::Report { path: PathBuf::from(path), reason };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
    if value.get("runs").is_some() {
        let sweep: SweepReport = serde_json::from_value(value).map_err(|e| err(format!("not a sweep report: {e}")))?;
        Ok(sweep.runs)
    } else {
        let run: RunReport = serde_json::from_value(value).map_err(|e| err(format!("not a run report: {e}")))?;
        Ok(vec![run])
    }
}

/// A side-by-side table of two reports, matched by concurrency, with ratios B/A.
pub fn compare(a: &[RunReport], b: &[RunReport]) -> String {
    type Row = (&'static str, fn(&Summary) -> f64);
    let rows: [Row; 9] = [
        ("requests ok", |s| s.successful as f64),
        ("errors", |s| s.errors as f64),
        ("P90 TTFT ms", |s| s.ttft_s.p90 * 1000.0),
        ("P90 ITL ms", |s| s.itl_s.p90 * 1000.0),
        ("P90 E2E ms", |s| s.e2e_s.p90 * 1000.0),
        ("P90 interactivity", |s| s.p90_interactivity),
        ("total tok/s/GPU", |s| s.total_tokens_per_s_per_gpu),
        ("output tok/s/GPU", |s| s.output_tokens_per_s_per_gpu),
        ("cache hit %", |s| s.cache_hit_rate * 100.0),
    ];
    let mut out = String::new();
    for ra in a {
        let Some(rb) = b.iter().find(|r| r.config.concurrency == ra.config.concurrency) else { continue };
        out.push_str(&format!("concurrency {}\n", ra.config.concurrency));
        for (what, a_cfg, b_cfg) in [
            ("time scale", ra.config.time_scale, rb.config.time_scale),
            ("token scale", ra.config.token_scale, rb.config.token_scale),
        ] {
            if a_cfg != b_cfg {
                out.push_str(&format!("  warning: {what} differs (A {a_cfg}, B {b_cfg})\n"));
            }
        }
        out.push_str(&format!("  {:<20}{:>14}{:>14}{:>10}\n", "metric", "A", "B", "B/A"));
        for (name, f) in rows {
            let (va, vb) = (f(&ra.summary), f(&rb.summary));
            let ratio = if va != 0.0 { format!("{:.3}", vb / va) } else { "-".into() };
            out.push_str(&format!("  {name:<20}{va:>14.2}{vb:>14.2}{ratio:>10}\n"));
        }
    }
    if out.is_empty() {
        out.push_str("no run of A has a run of B with the same concurrency\n");
    }
    out
}
