//! The JSON run report, sweep output and the side-by-side comparison of two reports.
//!
//! Invariants:
//! - A report states every factor that changes what was measured: concurrency, transport,
//!   `time_scale`, `token_scale`, idle caps, t* range, seed, GPUs (when known), the traces; so two
//!   reports are only compared knowingly.
//! - Every run has a label (`run --label`, else the report file's stem): runs with one label are one
//!   series (a sweep's runs share theirs), and tables and plots name runs by it. Reports written
//!   before labels existed get their file's stem when read.
//! - Reports of older versions still read: fields added since (`label`, `server`) are optional, and
//!   a sweep file is read through its `runs` only.
//! - `compare` prints the second report's numbers over the first's; a missing or malformed file is a
//!   [`ReplayError::Report`] naming it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{ReplayError, Result};
use crate::metrics::{RequestRecord, Summary};
use crate::pareto::ParetoPoint;
use crate::prometheus::ServerStats;

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
    /// GPUs the server uses (`--gpus`); `None` when not known (the server does not say), so no per-GPU numbers.
    pub gpus: Option<u32>,
    pub traces: Vec<String>,
    pub sessions: usize,
}

/// The server's counters over a run, or why there are none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ServerCounters {
    /// `GET /metrics` was read after the warmup and after the run: the counters' growth in between.
    Scraped(ServerStats),
    /// `GET /metrics` could not be read or parsed.
    Unavailable { reason: String },
}

/// One run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub tool: String,
    /// Names the run's series in tables and plots.
    #[serde(default)]
    pub label: String,
    pub config: RunConfig,
    /// `None` in reports written before the server was scraped.
    #[serde(default)]
    pub server: Option<ServerCounters>,
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
    #[serde(default)]
    pub label: String,
    pub runs: Vec<RunReport>,
    pub points: Vec<ParetoPoint>,
    pub frontier: Vec<ParetoPoint>,
}

/// The tool name and version written into reports.
pub fn tool_name() -> String {
    format!("sparkd-replay {}", env!("CARGO_PKG_VERSION"))
}

/// Which throughput a Pareto point's y is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Throughput {
    /// Input plus output tokens per second (AgentX's headline).
    Total,
    /// Output tokens per second.
    Output,
}

impl RunReport {
    /// The run as a Pareto point: y is `which` throughput, per GPU when `per_gpu` and the run knows its GPUs.
    pub fn point(&self, which: Throughput, per_gpu: bool) -> ParetoPoint {
        let s = &self.summary;
        let (whole, per) = match which {
            Throughput::Total => (s.total_tokens_per_s, s.total_tokens_per_s_per_gpu),
            Throughput::Output => (s.output_tokens_per_s, s.output_tokens_per_s_per_gpu),
        };
        let per = per.filter(|_| per_gpu);
        ParetoPoint {
            concurrency: self.config.concurrency,
            x: s.p90_interactivity,
            y: per.unwrap_or(whole),
            per_gpu: per.is_some(),
            p90_ttft_s: s.ttft_s.p90,
        }
    }

    /// The server's counters when they were scraped.
    pub fn server_stats(&self) -> Option<&ServerStats> {
        match &self.server {
            Some(ServerCounters::Scraped(stats)) => Some(stats),
            _ => None,
        }
    }
}

/// What a replayed run counted, for the line above its summary: replayed requests (main-agent and subagent
/// turns), the warmup primers left out of them, and the plays.
pub fn run_line(report: &RunReport) -> String {
    format!(
        "{}: concurrency {}, {} replayed requests (main-agent and subagent turns; {} warmup primers not counted) in {} plays of {} sessions",
        report.label,
        report.config.concurrency,
        report.summary.requests,
        report.warmup_requests,
        report.plays,
        report.config.sessions
    )
}

/// Writes any report as pretty JSON.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| ReplayError::Report { path: path.to_path_buf(), reason: e.to_string() })?;
    std::fs::write(path, text).map_err(|e| ReplayError::Report { path: path.to_path_buf(), reason: e.to_string() })
}

/// Reads the runs of a report file: a single run, or every run of a sweep. A run without a label gets the
/// sweep's, else the file's stem.
pub fn read_runs(path: &Path) -> Result<Vec<RunReport>> {
    let err = |reason: String| ReplayError::Report { path: PathBuf::from(path), reason };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let mut value: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
    let (mut runs, file_label) = match value.get_mut("runs") {
        Some(runs) => {
            let runs: Vec<RunReport> =
                serde_json::from_value(runs.take()).map_err(|e| err(format!("not a sweep report: {e}")))?;
            (runs, value.get("label").and_then(|l| l.as_str()).unwrap_or_default().to_owned())
        }
        None => {
            let run: RunReport = serde_json::from_value(value).map_err(|e| err(format!("not a run report: {e}")))?;
            (vec![run], String::new())
        }
    };
    if runs.is_empty() {
        return Err(err("the sweep holds no runs".into()));
    }
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    for run in &mut runs {
        if run.label.is_empty() {
            run.label = if file_label.is_empty() { stem.clone() } else { file_label.clone() };
        }
    }
    Ok(runs)
}

/// Reads several report files, giving the runs of file `i` the label `labels[i]` where one is given.
pub fn read_labelled(paths: &[PathBuf], labels: &[String]) -> Result<Vec<RunReport>> {
    if labels.len() > paths.len() {
        return Err(ReplayError::option(
            "--label",
            format!("{} labels for {} report files: give at most one per file, in order", labels.len(), paths.len()),
        ));
    }
    let mut out = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let mut runs = read_runs(path)?;
        if let Some(label) = labels.get(i) {
            if label.trim().is_empty() {
                return Err(ReplayError::option("--label", format!("label {} is empty", i + 1)));
            }
            runs.iter_mut().for_each(|r| r.label = label.clone());
        }
        out.extend(runs);
    }
    Ok(out)
}

/// A side-by-side table of two reports, matched by concurrency, columns named by the runs' labels, with the
/// ratio second / first.
pub fn compare(a: &[RunReport], b: &[RunReport]) -> String {
    let per_gpu = a.iter().chain(b).all(|r| r.config.gpus.is_some());
    type Row = (&'static str, Box<dyn Fn(&Summary) -> f64>);
    let per = |v: Option<f64>| v.unwrap_or(f64::NAN);
    let mut rows: Vec<Row> = vec![
        ("requests ok", Box::new(|s| s.successful as f64)),
        ("errors", Box::new(|s| s.errors as f64)),
        ("P90 TTFT ms", Box::new(|s| s.ttft_s.p90 * 1000.0)),
        ("P90 ITL ms", Box::new(|s| s.itl_s.p90 * 1000.0)),
        ("P90 E2E ms", Box::new(|s| s.e2e_s.p90 * 1000.0)),
        ("P90 interactivity", Box::new(|s| s.p90_interactivity)),
    ];
    if per_gpu {
        rows.push(("total tok/s/GPU", Box::new(move |s| per(s.total_tokens_per_s_per_gpu))));
        rows.push(("output tok/s/GPU", Box::new(move |s| per(s.output_tokens_per_s_per_gpu))));
    } else {
        rows.push(("total tok/s", Box::new(|s| s.total_tokens_per_s)));
        rows.push(("output tok/s", Box::new(|s| s.output_tokens_per_s)));
    }
    rows.push(("cache hit %", Box::new(|s| s.cache_hit_rate * 100.0)));
    let mut out = String::new();
    for ra in a {
        let Some(rb) = b.iter().find(|r| r.config.concurrency == ra.config.concurrency) else { continue };
        let (la, lb) = column_names(&ra.label, &rb.label);
        let width = la.chars().count().max(lb.chars().count()).max(12) + 2;
        out.push_str(&format!("concurrency {} ({lb} over {la})\n", ra.config.concurrency));
        for (what, a_cfg, b_cfg) in [
            ("time scale", ra.config.time_scale, rb.config.time_scale),
            ("token scale", ra.config.token_scale, rb.config.token_scale),
        ] {
            if a_cfg != b_cfg {
                out.push_str(&format!("  warning: {what} differs ({la} {a_cfg}, {lb} {b_cfg})\n"));
            }
        }
        out.push_str(&format!("  {:<20}{la:>width$}{lb:>width$}{:>10}\n", "metric", "ratio"));
        for (name, f) in &rows {
            let (va, vb) = (f(&ra.summary), f(&rb.summary));
            let ratio =
                if va != 0.0 && va.is_finite() && vb.is_finite() { format!("{:.3}", vb / va) } else { "-".into() };
            out.push_str(&format!("  {name:<20}{va:>width$.2}{vb:>width$.2}{ratio:>10}\n"));
        }
    }
    if out.is_empty() {
        let names = |runs: &[RunReport]| runs.first().map(|r| r.label.clone()).unwrap_or_default();
        out.push_str(&format!("no run of {} has a run of {} with the same concurrency\n", names(a), names(b)));
    }
    out
}

/// Column names for two labels; equal labels get `#1` and `#2`.
fn column_names(a: &str, b: &str) -> (String, String) {
    if a == b {
        (format!("{a} #1"), format!("{b} #2"))
    } else {
        (a.to_owned(), b.to_owned())
    }
}
