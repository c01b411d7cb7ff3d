//! The one-page HTML report of several runs (`sparkd-replay report RUN.json... --html OUT.html`): summary
//! table, overlaid Pareto frontiers, ITL and TTFT distributions, acceptance by draft position and cache hit
//! rates.
//!
//! Invariants:
//! - The page is self-contained: inline CSS and inline SVG, no script, no font, image or style sheet from
//!   anywhere, so it renders offline exactly as written.
//! - Runs with the same label are one series: one colour everywhere, one Pareto frontier; two runs of one
//!   series at the same concurrency are refused (give the files distinct `--label`s).
//! - Throughput is per GPU only when every run knows its GPU count; otherwise every number is for the whole
//!   server, and the axis and headers say which.
//! - Distributions come from the per-request records (every successful request's TTFT and ITL); speculation
//!   and server-side cache numbers come from the server's counters and read "not reported by the server" when
//!   it did not export them, never zero.
//! - Every text taken from a report (labels, paths, URLs) is HTML-escaped.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use crate::error::{ReplayError, Result};
use crate::metrics::{percentile, RequestRecord, Summary};
use crate::plot::{self, css_color, headroom, Axes, Chart, Dash, Line, ParetoSeries};
use crate::report::{tool_name, RunReport, ServerCounters, Throughput};

/// Points per distribution curve (quantiles 0, 0.5%, …, 100%).
const CDF_POINTS: usize = 200;

/// The runs of one label, in order of concurrency.
struct Series<'a> {
    label: &'a str,
    runs: Vec<&'a RunReport>,
}

/// Groups runs by label in order of first appearance; refuses two runs of one series at one concurrency.
fn series(runs: &[RunReport]) -> Result<Vec<Series<'_>>> {
    let mut out: Vec<Series> = Vec::new();
    for run in runs {
        match out.iter_mut().find(|s| s.label == run.label) {
            Some(s) => {
                if s.runs.iter().any(|r| r.config.concurrency == run.config.concurrency) {
                    return Err(ReplayError::option(
                        "--label",
                        format!(
                            "two runs labelled {:?} at concurrency {}: give their files different labels (--label, in file order)",
                            run.label, run.config.concurrency
                        ),
                    ));
                }
                s.runs.push(run);
            }
            None => out.push(Series { label: &run.label, runs: vec![run] }),
        }
    }
    for s in &mut out {
        s.runs.sort_by_key(|r| r.config.concurrency);
    }
    Ok(out)
}

/// Escapes text for HTML.
pub fn esc(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn run_name(run: &RunReport) -> String {
    format!("{} · c={}", run.label, run.config.concurrency)
}

fn swatch(i: usize) -> String {
    format!("<span class=\"sw\" style=\"background:{}\"></span>", css_color(i))
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "–".into(), |v| format!("{:.1}%", v * 100.0))
}

/// A percentage with a bar under it, and what it was computed from.
fn rate_cell(rate: Option<f64>, detail: &str) -> String {
    match rate {
        Some(r) => format!(
            "<td class=\"rate\">{}<div class=\"bar\"><div style=\"width:{:.1}%\"></div></div><small>{}</small></td>",
            pct(Some(r)),
            (r * 100.0).clamp(0.0, 100.0),
            esc(detail)
        ),
        None => format!("<td class=\"na\">{}</td>", esc(detail)),
    }
}

/// The whole page.
pub fn report(runs: &[RunReport]) -> Result<String> {
    if runs.is_empty() {
        return Err(ReplayError::option("report", "no runs to report"));
    }
    let series = series(runs)?;
    let per_gpu = runs.iter().all(|r| r.config.gpus.is_some());
    let mut page = String::new();
    page.push_str(HEAD);
    let labels: Vec<String> =
        series.iter().enumerate().map(|(i, s)| format!("{}{}", swatch(i), esc(s.label))).collect();
    let _ = write!(
        page,
        "<h1>sparkd-replay report</h1>\n<p class=\"lead\">{} runs in {} series: {}. Written by {}.</p>\n",
        runs.len(),
        series.len(),
        labels.join(", "),
        esc(&tool_name())
    );
    page.push_str(&warnings(runs));
    page.push_str(&summary_section(&series, per_gpu));
    page.push_str(&pareto_section(&series, per_gpu)?);
    page.push_str(&latency_section(&series)?);
    page.push_str(&spec_section(&series)?);
    page.push_str(&cache_section(&series));
    page.push_str(&runs_section(&series));
    page.push_str("</main>\n</body>\n</html>\n");
    Ok(page)
}

const HEAD: &str = "<!DOCTYPE html>
<html lang=\"en\">
<head>
<meta charset=\"utf-8\">
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">
<title>sparkd-replay report</title>
<style>
body { margin: 0; background: #f6f7f9; color: #1d2330; font: 15px/1.45 system-ui, -apple-system, 'Segoe UI', sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 28px; margin: 8px 0 4px; }
h2 { font-size: 20px; margin: 36px 0 8px; padding-bottom: 4px; border-bottom: 2px solid #d9dde5; }
p.lead { color: #4a5263; margin: 0 0 12px; }
p.note { color: #4a5263; font-size: 14px; margin: 6px 0 12px; }
.warn { background: #fff4e0; border-left: 4px solid #e8a33d; padding: 8px 12px; margin: 12px 0; }
.figure { background: #fff; border: 1px solid #e1e4ea; border-radius: 6px; padding: 8px; margin: 12px 0; }
.figure svg { display: block; max-width: 100%; height: auto; margin: 0 auto; }
table { border-collapse: collapse; background: #fff; width: 100%; margin: 10px 0; font-size: 14px; }
th, td { padding: 6px 10px; border-bottom: 1px solid #e6e8ee; text-align: right; vertical-align: top; }
th { background: #eef0f4; font-weight: 600; }
th:first-child, td:first-child { text-align: left; }
td.na { color: #8a90a0; font-style: italic; }
td.rate small { display: block; color: #6a7182; }
.bar { height: 6px; background: #e8ebf0; border-radius: 3px; margin: 3px 0; }
.bar div { height: 6px; background: #3d7cc9; border-radius: 3px; }
.sw { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 6px; vertical-align: baseline; }
code { font-size: 13px; }
</style>
</head>
<body>
<main>
";

/// Settings that make runs incomparable, said once at the top.
fn warnings(runs: &[RunReport]) -> String {
    let mut out = String::new();
    for (what, values) in [
        ("token scale", runs.iter().map(|r| r.config.token_scale.to_string()).collect::<BTreeSet<_>>()),
        ("time scale", runs.iter().map(|r| r.config.time_scale.to_string()).collect()),
        ("transport", runs.iter().map(|r| r.config.transport.clone()).collect()),
        ("traces", runs.iter().map(|r| r.config.traces.join(" ")).collect()),
    ] {
        if values.len() > 1 {
            let list: Vec<String> = values.iter().map(|v| esc(v)).collect();
            let _ = writeln!(
                out,
                "<p class=\"warn\">The runs differ in {what} ({}): compare them knowingly.</p>",
                list.join("; ")
            );
        }
    }
    out
}

fn throughput_unit(per_gpu: bool) -> &'static str {
    if per_gpu {
        "tokens/s per GPU"
    } else {
        "tokens/s, whole server"
    }
}

fn summary_section(series: &[Series], per_gpu: bool) -> String {
    let unit = if per_gpu { "tok/s/GPU" } else { "tok/s" };
    let mut out = String::from("<h2>Summary</h2>\n");
    out.push_str(
        "<p class=\"note\">Replayed requests are the profiled main-agent and subagent turns (one chat request or \
         Responses stream each); warmup primers are not counted. Latencies are over successful requests. \
         P90 interactivity is 1 / P90(ITL).</p>\n",
    );
    let _ = writeln!(
        out,
        "<table><tr><th>run</th><th>replayed requests<br>(ok / errors)</th><th>seconds</th><th>TTFT ms<br>p50 / p90</th>\
         <th>ITL ms<br>p50 / p90</th><th>P90 interactivity<br>tok/s/user</th><th>total<br>{unit}</th>\
         <th>output<br>{unit}</th><th>acceptance length<br>(server)</th></tr>"
    );
    for (i, s) in series.iter().enumerate() {
        for run in &s.runs {
            let m = &run.summary;
            let (total, output) = if per_gpu {
                (m.total_tokens_per_s_per_gpu.unwrap_or(f64::NAN), m.output_tokens_per_s_per_gpu.unwrap_or(f64::NAN))
            } else {
                (m.total_tokens_per_s, m.output_tokens_per_s)
            };
            let al = run.server_stats().and_then(|st| st.spec.as_ref()).and_then(|sp| sp.acceptance_length());
            let _ = writeln!(
                out,
                "<tr><td>{}{}</td><td>{} ({} / {})</td><td>{:.1}</td><td>{:.1} / {:.1}</td><td>{:.2} / {:.2}</td>\
                 <td>{:.1}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                swatch(i),
                esc(&run_name(run)),
                m.requests,
                m.successful,
                m.errors,
                m.duration_s,
                m.ttft_s.p50 * 1e3,
                m.ttft_s.p90 * 1e3,
                m.itl_s.p50 * 1e3,
                m.itl_s.p90 * 1e3,
                m.p90_interactivity,
                plot::tick(total.round()),
                plot::tick(output.round()),
                al.map_or_else(|| "–".into(), |a| format!("{a:.2}"))
            );
        }
    }
    out.push_str("</table>\n");
    out
}

fn figure(svg: &str) -> String {
    format!("<div class=\"figure\">{svg}</div>\n")
}

fn pareto_section(series: &[Series], per_gpu: bool) -> Result<String> {
    let mut out = String::from("<h2>Throughput against interactivity</h2>\n");
    out.push_str(
        "<p class=\"note\">One point per run, labelled with its concurrency (live session trees); the curve is \
         each series' Pareto frontier (filled points), where lower interactivity buys strictly more throughput; \
         hollow points are dominated.</p>\n",
    );
    for (which, name) in [(Throughput::Total, "Total (input + output)"), (Throughput::Output, "Output")] {
        let plotted: Vec<ParetoSeries> = series
            .iter()
            .map(|s| ParetoSeries {
                label: s.label.to_owned(),
                points: s.runs.iter().map(|r| r.point(which, per_gpu)).collect(),
            })
            .collect();
        let chart = Chart {
            title: format!("{name} throughput against P90 interactivity"),
            x_label: "P90 interactivity (tokens/s/user)".into(),
            y_label: format!("{name} throughput ({})", throughput_unit(per_gpu)),
            width: 1100,
            height: 540,
        };
        out.push_str(&figure(&plot::pareto(&chart, &plotted)?));
    }
    Ok(out)
}

/// The distribution of `values` as `(value, percent of requests at or below it)`, cut at `x_max`.
fn cdf(values: impl Iterator<Item = f64>, x_max: f64) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let mut out = Vec::new();
    for i in 0..=CDF_POINTS {
        let q = i as f64 / CDF_POINTS as f64;
        let Some(x) = percentile(&v, q) else { break };
        if x > x_max {
            if let Some(&(_, last_q)) = out.last() {
                out.push((x_max, last_q));
            }
            break;
        }
        out.push((x, q * 100.0));
    }
    out
}

/// A latency distribution: its title, x axis, each request's value and the run's P99, in seconds.
type Distribution = (&'static str, &'static str, fn(&RequestRecord) -> Option<f64>, fn(&Summary) -> f64);

fn latency_section(series: &[Series]) -> Result<String> {
    let mut out = String::from("<h2>Latency distributions</h2>\n");
    out.push_str(
        "<p class=\"note\">Share of successful requests at or below each latency, one curve per run. ITL is \
         per request: (last − first content chunk) / (output tokens − 1). Each axis ends a little past the \
         largest P99 of the runs, so a curve that stops short of 100% goes on to its slowest requests beyond \
         it. Runs of one series share its colour and differ by dash pattern.</p>\n",
    );
    let metrics: [Distribution; 2] = [
        ("Inter-token latency", "ITL (ms)", |r| r.itl_s, |s| s.itl_s.p99),
        ("Time to first token", "TTFT (ms)", |r| r.ttft_s, |s| s.ttft_s.p99),
    ];
    for (title, x_label, pick, p99) in metrics {
        let x_max = headroom(series.iter().flat_map(|s| &s.runs).map(|r| p99(&r.summary) * 1e3).fold(0.0, f64::max));
        let mut lines = Vec::new();
        for (i, s) in series.iter().enumerate() {
            for (j, run) in s.runs.iter().enumerate() {
                let values = run.records.iter().filter(|r| r.ok()).filter_map(pick).map(|v| v * 1e3);
                let points = cdf(values, x_max);
                if !points.is_empty() {
                    lines.push(Line { label: run_name(run), color: i, points, markers: false, dash: Dash::nth(j) });
                }
            }
        }
        let chart = Chart {
            title: format!("{title}: cumulative distribution"),
            x_label: x_label.into(),
            y_label: "requests at or below (%)".into(),
            width: 1100,
            height: 460,
        };
        let axes = Axes { x: (0.0, x_max), y: (0.0, 105.0), integer_x: false };
        out.push_str(&figure(&plot::lines(&chart, &lines, axes)?));
    }
    Ok(out)
}

/// What a run's server said about a section, when it said nothing usable.
fn missing(run: &RunReport) -> String {
    match &run.server {
        None => "not recorded (the report predates server counters)".into(),
        Some(ServerCounters::Unavailable { reason }) => format!("not reported by the server ({reason})"),
        Some(ServerCounters::Scraped(_)) => "not reported by the server".into(),
    }
}

fn spec_section(series: &[Series]) -> Result<String> {
    let mut out = String::from("<h2>Speculative decoding</h2>\n");
    out.push_str(
        "<p class=\"note\">From the server's counters over the profiled requests (vLLM's \
         <code>spec_decode</code> counters): acceptance length is 1 + accepted draft tokens / verify rounds with \
         drafts (the bonus token included); the rate at draft position k is the share of those rounds that \
         accepted the k-th draft token.</p>\n",
    );
    out.push_str(
        "<table><tr><th>run</th><th>verify rounds<br>with drafts</th><th>draft tokens</th><th>accepted</th>\
         <th>acceptance length</th><th>draft acceptance rate</th></tr>\n",
    );
    let mut lines = Vec::new();
    let mut positions = 0;
    for (i, s) in series.iter().enumerate() {
        for (j, run) in s.runs.iter().enumerate() {
            let name = format!("{}{}", swatch(i), esc(&run_name(run)));
            match run.server_stats().and_then(|st| st.spec.as_ref()) {
                None => {
                    let _ = writeln!(
                        out,
                        "<tr><td>{name}</td><td class=\"na\" colspan=\"5\">{}</td></tr>",
                        esc(&missing(run))
                    );
                }
                Some(spec) if spec.drafts == 0 => {
                    let _ = writeln!(
                        out,
                        "<tr><td>{name}</td><td>0</td><td class=\"na\" colspan=\"4\">no speculation in this run</td></tr>"
                    );
                }
                Some(spec) => {
                    let _ = writeln!(
                        out,
                        "<tr><td>{name}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                        plot::tick(spec.drafts as f64),
                        plot::tick(spec.draft_tokens as f64),
                        plot::tick(spec.accepted_tokens as f64),
                        spec.acceptance_length().map_or_else(|| "–".into(), |a| format!("{a:.2}")),
                        pct(spec.acceptance_rate())
                    );
                    let rates = spec.position_rates();
                    positions = positions.max(rates.len());
                    let points = rates.iter().enumerate().map(|(k, r)| ((k + 1) as f64, r * 100.0)).collect();
                    lines.push(Line { label: run_name(run), color: i, points, markers: true, dash: Dash::nth(j) });
                }
            }
        }
    }
    out.push_str("</table>\n");
    if lines.is_empty() {
        out.push_str("<p class=\"note\">No run has per-position acceptance to plot.</p>\n");
        return Ok(out);
    }
    let chart = Chart {
        title: "Acceptance rate by draft position".into(),
        x_label: "draft position".into(),
        y_label: "verify rounds accepting it (%)".into(),
        width: 1100,
        height: 440,
    };
    let axes = Axes { x: (0.5, positions as f64 + 0.5), y: (0.0, 105.0), integer_x: true };
    out.push_str(&figure(&plot::lines(&chart, &lines, axes)?));
    Ok(out)
}

fn cache_section(series: &[Series]) -> String {
    let mut out = String::from("<h2>Cache hit rates</h2>\n");
    out.push_str(
        "<p class=\"note\">Cached prompt tokens as each response's <code>usage</code> reports them; the server's \
         prefix cache (<code>vllm:prefix_cache_hits / queries</code>, in tokens); and continuations of kept \
         responses (<code>previous_response_id</code>) whose state was reused from device or host memory rather \
         than rebuilt by prefill (<code>sparkd:sessions_restored_total</code>).</p>\n",
    );
    out.push_str(
        "<table><tr><th>run</th><th>cached prompt tokens (usage)</th><th>prefix cache (server)</th>\
         <th>kept-state reuse (server)</th></tr>\n",
    );
    for (i, s) in series.iter().enumerate() {
        for run in &s.runs {
            let m = &run.summary;
            let usage = (m.input_tokens > 0).then_some(m.cache_hit_rate);
            let usage_detail =
                format!("{} of {} tokens", plot::tick(m.cached_tokens as f64), plot::tick(m.input_tokens as f64));
            let stats = run.server_stats();
            let prefix = match stats.and_then(|st| st.prefix_cache.as_ref()) {
                Some(c) if c.queried_tokens > 0 => rate_cell(
                    c.hit_rate(),
                    &format!("{} of {} tokens", plot::tick(c.hit_tokens as f64), plot::tick(c.queried_tokens as f64)),
                ),
                Some(_) => rate_cell(None, "no prompt tokens looked up"),
                None => rate_cell(None, &missing(run)),
            };
            let kept = match stats.and_then(|st| st.kept_state.as_ref()) {
                Some(k) if k.reuse_rate().is_some() => rate_cell(
                    k.reuse_rate(),
                    &format!("device {}, host {}, rebuilt {}", k.from_device, k.from_host, k.rebuilt),
                ),
                Some(_) => rate_cell(None, "no continuation of a kept response"),
                None => rate_cell(None, &missing(run)),
            };
            let _ = writeln!(
                out,
                "<tr><td>{}{}</td>{}{}{}</tr>",
                swatch(i),
                esc(&run_name(run)),
                rate_cell(usage, &usage_detail),
                prefix,
                kept
            );
        }
    }
    out.push_str("</table>\n");
    out
}

fn runs_section(series: &[Series]) -> String {
    let mut out = String::from("<h2>Runs</h2>\n");
    out.push_str(
        "<table><tr><th>run</th><th>server</th><th>transport</th><th>GPUs</th><th>token / time scale</th>\
         <th>profiling</th><th>sessions</th><th>plays</th><th>warmup primers</th></tr>\n",
    );
    for (i, s) in series.iter().enumerate() {
        for run in &s.runs {
            let c = &run.config;
            let limit = match (c.duration_s, c.max_requests) {
                (Some(d), Some(n)) => format!("{d} s or {n} requests"),
                (Some(d), None) => format!("{d} s"),
                (None, Some(n)) => format!("{n} requests"),
                (None, None) => "–".into(),
            };
            let _ = writeln!(
                out,
                "<tr><td>{}{}</td><td>{} <small>({})</small></td><td>{}</td><td>{}</td><td>{} / {}</td><td>{}</td>\
                 <td>{}</td><td>{}</td><td>{}</td></tr>",
                swatch(i),
                esc(&run_name(run)),
                esc(&c.model),
                esc(&c.url),
                esc(&c.transport),
                c.gpus.map_or_else(|| "not given".into(), |g| g.to_string()),
                c.token_scale,
                c.time_scale,
                esc(&limit),
                c.sessions,
                run.plays,
                run.warmup_requests
            );
        }
    }
    out.push_str("</table>\n");
    let traces: BTreeSet<String> = series.iter().flat_map(|s| &s.runs).flat_map(|r| r.config.traces.clone()).collect();
    let list: Vec<String> = traces.iter().map(|t| format!("<code>{}</code>", esc(t))).collect();
    let _ = writeln!(out, "<p class=\"note\">Traces: {}.</p>", list.join(", "));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_distribution_is_cut_at_the_axis_end_and_never_leaves_it() {
        let values = (1..=100).map(f64::from);
        let points = cdf(values, 50.5);
        assert_eq!(points.first(), Some(&(1.0, 0.0)));
        assert!(points.iter().all(|&(x, _)| x <= 50.5));
        let last = points.last().unwrap();
        assert_eq!(last.0, 50.5);
        assert!((last.1 - 50.0).abs() < 1.0, "{last:?}");
        assert!(cdf(std::iter::empty(), 10.0).is_empty());
    }

    #[test]
    fn text_from_reports_is_escaped() {
        assert_eq!(esc("<a href=\"x\">&</a>"), "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;");
    }
}
