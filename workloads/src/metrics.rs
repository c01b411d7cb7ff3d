//! Per-request records and the run summary (AIPerf / InferenceX definitions, agentx.md §2).
//!
//! Invariants:
//! - Only profiling requests are recorded; warmup primers never reach a [`RequestRecord`].
//! - Latency statistics use successful requests only; ITL needs at least 2 output tokens:
//!   `ITL = (last content − first content) / (OSL − 1)`, one value per request (§2.1).
//! - Percentiles interpolate linearly at `k = (n − 1)·q` (InferenceX `aggregation_common.percentile`).
//! - P90 interactivity is `1 / P90(ITL)` (§2.2), not the 10th percentile of `1/ITL`.
//! - Throughput divides by `max(end) − min(start)` over successful requests (§2.3); per-GPU values
//!   divide by the GPU count and exist only when it is known (`--gpus`): a CPU run has none.
//! - Request counts are replayed requests (main-agent and subagent turns, one HTTP request or Responses
//!   stream each) of the profiling phase; warmup primers are never counted.

use serde::{Deserialize, Serialize};

use crate::transport::SpecStats;

/// One profiled request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub session: String,
    pub chain: String,
    pub turn: usize,
    /// 0 for the main agent, 1 for a subagent.
    pub depth: u8,
    pub lane: usize,
    /// True when the turn extended its chain's context (the previous prompt and answer are a
    /// prefix of this one); false for a chain's first turn and for a restart (compaction).
    #[serde(default)]
    pub continues: bool,
    /// Seconds since the profiling phase started.
    pub start_s: f64,
    pub end_s: f64,
    pub ttft_s: Option<f64>,
    pub itl_s: Option<f64>,
    pub e2e_s: Option<f64>,
    /// Content tokens planned for the prompt (the scaled trace `in`).
    pub planned_input_tokens: usize,
    pub planned_output_tokens: usize,
    /// From the server's `usage`.
    pub prompt_tokens: Option<u64>,
    pub output_tokens: u64,
    pub cached_tokens: Option<u64>,
    pub content_chunks: usize,
    pub spec: Option<SpecStats>,
    /// The error kind when the request failed.
    pub error: Option<String>,
    pub error_message: Option<String>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// Mean and percentiles of one metric.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// The percentile with linear interpolation over sorted values; `None` when empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let k = (n - 1) as f64 * q;
    let f = k.floor() as usize;
    let c = (f + 1).min(n - 1);
    Some(sorted[f] + (k - f as f64) * (sorted[c] - sorted[f]))
}

impl Stats {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Stats::default();
        }
        v.sort_by(f64::total_cmp);
        let p = |q| percentile(&v, q).unwrap_or(0.0);
        Stats {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: p(0.5),
            p90: p(0.9),
            p99: p(0.99),
            max: v[v.len() - 1],
        }
    }
}

/// Pooled speculation statistics over the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecSummary {
    pub requests: usize,
    pub num_spec_steps: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_draft_tokens: u64,
    /// `1 + accepted / steps`.
    pub acceptance_length: f64,
    /// `accepted / drafted`.
    pub draft_acceptance_rate: f64,
}

/// The per-run numbers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub requests: usize,
    pub successful: usize,
    pub errors: usize,
    pub context_overflows: usize,
    pub ttft_s: Stats,
    pub itl_s: Stats,
    pub e2e_s: Stats,
    pub output_tokens_per_request: Stats,
    /// `1 / P90(ITL)`, tokens/s/user.
    pub p90_interactivity: f64,
    /// `1 / P50(ITL)`.
    pub p50_interactivity: f64,
    pub duration_s: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub total_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    /// `None` when the GPU count is not known (`--gpus` not given, a CPU server).
    pub total_tokens_per_s_per_gpu: Option<f64>,
    pub output_tokens_per_s_per_gpu: Option<f64>,
    /// `Σ cached / Σ prompt` over successful requests that reported both.
    pub cache_hit_rate: f64,
    pub spec: Option<SpecSummary>,
}

/// Summarises records; per-GPU throughput needs the server's GPU count.
pub fn summarize(records: &[RequestRecord], gpus: Option<u32>) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let errors = records.len() - ok.len();
    let context_overflows = records.iter().filter(|r| r.error.as_deref() == Some("context_overflow")).count();
    let itl = Stats::of(ok.iter().filter_map(|r| r.itl_s));
    let start = ok.iter().map(|r| r.start_s).fold(f64::INFINITY, f64::min);
    let end = ok.iter().map(|r| r.end_s).fold(f64::NEG_INFINITY, f64::max);
    let duration_s = if ok.is_empty() { 0.0 } else { (end - start).max(0.0) };
    let input_tokens: u64 = ok.iter().map(|r| r.prompt_tokens.unwrap_or(r.planned_input_tokens as u64)).sum();
    let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let (cached, queried) = ok
        .iter()
        .filter_map(|r| Some((r.cached_tokens?, r.prompt_tokens?)))
        .fold((0u64, 0u64), |(c, q), (rc, rq)| (c + rc, q + rq));
    let per_s = |tokens: u64| if duration_s > 0.0 { tokens as f64 / duration_s } else { 0.0 };
    let inverse = |x: f64| if x > 0.0 { 1.0 / x } else { 0.0 };
    let spec_records: Vec<&SpecStats> = ok.iter().filter_map(|r| r.spec.as_ref()).collect();
    let spec = (!spec_records.is_empty()).then(|| {
        let steps: u64 = spec_records.iter().map(|s| s.num_spec_steps).sum();
        let drafted: u64 = spec_records.iter().map(|s| s.num_draft_tokens).sum();
        let accepted: u64 = spec_records.iter().map(|s| s.num_accepted_draft_tokens).sum();
        SpecSummary {
            requests: spec_records.len(),
            num_spec_steps: steps,
            num_draft_tokens: drafted,
            num_accepted_draft_tokens: accepted,
            acceptance_length: if steps > 0 { 1.0 + accepted as f64 / steps as f64 } else { 0.0 },
            draft_acceptance_rate: if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
        }
    });
    Summary {
        requests: records.len(),
        successful: ok.len(),
        errors,
        context_overflows,
        ttft_s: Stats::of(ok.iter().filter_map(|r| r.ttft_s)),
        p90_interactivity: inverse(itl.p90),
        p50_interactivity: inverse(itl.p50),
        itl_s: itl,
        e2e_s: Stats::of(ok.iter().filter_map(|r| r.e2e_s)),
        output_tokens_per_request: Stats::of(ok.iter().map(|r| r.output_tokens as f64)),
        duration_s,
        input_tokens,
        output_tokens,
        cached_tokens: cached,
        total_tokens_per_s: per_s(input_tokens + output_tokens),
        output_tokens_per_s: per_s(output_tokens),
        total_tokens_per_s_per_gpu: gpus.map(|g| per_s(input_tokens + output_tokens) / f64::from(g.max(1))),
        output_tokens_per_s_per_gpu: gpus.map(|g| per_s(output_tokens) / f64::from(g.max(1))),
        cache_hit_rate: if queried > 0 { cached as f64 / queried as f64 } else { 0.0 },
        spec,
    }
}

/// The summary as a plain-text table.
pub fn summary_table(s: &Summary) -> String {
    let ms = |x: f64| format!("{:.1}", x * 1000.0);
    let mut out = String::new();
    out.push_str(&format!(
        "replayed requests {} (ok {}, errors {}, context overflows {}) over {:.1} s\n",
        s.requests, s.successful, s.errors, s.context_overflows, s.duration_s
    ));
    out.push_str(&format!("{:<14}{:>10}{:>10}{:>10}{:>10}{:>10}\n", "metric", "mean", "p50", "p90", "p99", "max"));
    for (name, st) in [("TTFT ms", &s.ttft_s), ("ITL ms", &s.itl_s), ("E2E ms", &s.e2e_s)] {
        out.push_str(&format!(
            "{:<14}{:>10}{:>10}{:>10}{:>10}{:>10}\n",
            name,
            ms(st.mean),
            ms(st.p50),
            ms(st.p90),
            ms(st.p99),
            ms(st.max)
        ));
    }
    out.push_str(&format!(
        "P90 interactivity {:.2} tok/s/user (P50 {:.2})\n",
        s.p90_interactivity, s.p50_interactivity
    ));
    let per_gpu = |v: Option<f64>| v.map(|v| format!(" ({v:.1}/GPU)")).unwrap_or_default();
    out.push_str(&format!(
        "throughput: total {:.1} tok/s{}, output {:.1} tok/s{}\n",
        s.total_tokens_per_s,
        per_gpu(s.total_tokens_per_s_per_gpu),
        s.output_tokens_per_s,
        per_gpu(s.output_tokens_per_s_per_gpu)
    ));
    out.push_str(&format!(
        "tokens: input {}, output {}, cached {} (cache hit rate {:.1}%)\n",
        s.input_tokens,
        s.output_tokens,
        s.cached_tokens,
        s.cache_hit_rate * 100.0
    ));
    if let Some(spec) = &s.spec {
        out.push_str(&format!(
            "speculation: AL {:.3}, draft acceptance {:.1}% over {} steps\n",
            spec.acceptance_length,
            spec.draft_acceptance_rate * 100.0,
            spec.num_spec_steps
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_like_inferencex() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), Some(2.5));
        assert!((percentile(&v, 0.9).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[], 0.9), None);
    }

    fn record(start: f64, end: f64, itl: f64, out: u64, prompt: u64, cached: u64) -> RequestRecord {
        RequestRecord {
            session: "s".into(),
            chain: "s".into(),
            turn: 0,
            depth: 0,
            lane: 0,
            continues: false,
            start_s: start,
            end_s: end,
            ttft_s: Some(0.1),
            itl_s: Some(itl),
            e2e_s: Some(end - start),
            planned_input_tokens: prompt as usize,
            planned_output_tokens: out as usize,
            prompt_tokens: Some(prompt),
            output_tokens: out,
            cached_tokens: Some(cached),
            content_chunks: out as usize,
            spec: None,
            error: None,
            error_message: None,
        }
    }

    #[test]
    fn summary_follows_the_definitions() {
        let mut recs: Vec<RequestRecord> =
            (0..10).map(|i| record(i as f64, i as f64 + 1.0, 0.01 * (i + 1) as f64, 10, 100, 50)).collect();
        let mut failed = record(0.0, 100.0, 1.0, 0, 0, 0);
        failed.error = Some("server".into());
        recs.push(failed);
        let s = summarize(&recs, Some(2));
        assert_eq!((s.requests, s.successful, s.errors), (11, 10, 1));
        // ITLs 0.01..0.10: P90 = 0.091 → interactivity 1/0.091.
        assert!((s.itl_s.p90 - 0.091).abs() < 1e-12);
        assert!((s.p90_interactivity - 1.0 / 0.091).abs() < 1e-9);
        assert_eq!(s.duration_s, 10.0);
        assert_eq!(s.total_tokens_per_s, 110.0);
        assert_eq!(s.output_tokens_per_s_per_gpu, Some(5.0));
        assert_eq!(s.cache_hit_rate, 0.5);
        let table = summary_table(&s);
        assert!(table.contains("replayed requests 11 (ok 10, errors 1"), "{table}");
        assert!(table.contains("(55.0/GPU)"), "{table}");
    }

    #[test]
    fn without_a_gpu_count_there_is_no_per_gpu_throughput() {
        let recs: Vec<RequestRecord> = (0..4).map(|i| record(i as f64, i as f64 + 1.0, 0.01, 10, 100, 0)).collect();
        let s = summarize(&recs, None);
        assert_eq!((s.total_tokens_per_s_per_gpu, s.output_tokens_per_s_per_gpu), (None, None));
        assert_eq!(s.output_tokens_per_s, 10.0);
        let table = summary_table(&s);
        assert!(!table.contains("GPU"), "a run without a GPU count printed per-GPU numbers: {table}");
    }
}
