//! Reports: reading files of this and older versions, labels, `compare`'s columns, and the HTML page's content
//! for runs with and without server counters (generated fixtures; the page is rendered in Chromium by
//! `tests/tests/replay.rs`).

use std::path::{Path, PathBuf};

use serde_json::json;
use sparkd_workloads::html;
use sparkd_workloads::metrics::{summarize, RequestRecord};
use sparkd_workloads::prometheus::{KeptStateCounters, PrefixCacheCounters, ServerStats, SpecCounters};
use sparkd_workloads::report::{compare, read_labelled, read_runs, write_json, RunConfig, RunReport, ServerCounters};

fn record(i: usize, itl: f64, ttft: f64) -> RequestRecord {
    RequestRecord {
        session: "s".into(),
        chain: "s".into(),
        turn: i,
        depth: 0,
        lane: 0,
        continues: i > 0,
        start_s: i as f64,
        end_s: i as f64 + 1.0,
        ttft_s: Some(ttft),
        itl_s: Some(itl),
        e2e_s: Some(1.0),
        planned_input_tokens: 100,
        planned_output_tokens: 10,
        prompt_tokens: Some(100),
        output_tokens: 10,
        cached_tokens: Some(if i > 0 { 60 } else { 0 }),
        content_chunks: 10,
        spec: None,
        error: None,
        error_message: None,
    }
}

/// A run of `n` requests whose ITLs grow from `itl` and whose server counters are `server`.
fn run(label: &str, concurrency: usize, itl: f64, gpus: Option<u32>, server: Option<ServerCounters>) -> RunReport {
    let records: Vec<RequestRecord> =
        (0..20).map(|i| record(i, itl * (1.0 + i as f64 / 20.0), 0.05 + i as f64 * 0.01)).collect();
    RunReport {
        tool: "sparkd-replay test".into(),
        label: label.into(),
        config: RunConfig {
            url: "http://127.0.0.1:1".into(),
            transport: "chat".into(),
            model: "k3-tiny".into(),
            concurrency,
            duration_s: Some(10.0),
            max_requests: None,
            time_scale: 0.01,
            token_scale: 0.1,
            system_idle_cap_s: None,
            tree_idle_cap_s: None,
            start_ratio: None,
            seed: 1,
            gpus,
            traces: vec!["traces/<a&b>.json".into()],
            sessions: 3,
        },
        server,
        summary: summarize(&records, gpus),
        warmup_requests: 2,
        plays: 4,
        wall_s: 20.0,
        idle_skipped_s: 0.0,
        records,
    }
}

fn scraped(spec: Option<SpecCounters>) -> Option<ServerCounters> {
    Some(ServerCounters::Scraped(ServerStats {
        spec,
        prefix_cache: Some(PrefixCacheCounters { queried_tokens: 2000, hit_tokens: 1200 }),
        kept_state: Some(KeptStateCounters { from_device: 3, from_host: 1, rebuilt: 0 }),
    }))
}

fn dspark() -> SpecCounters {
    SpecCounters { drafts: 100, draft_tokens: 400, accepted_tokens: 150, accepted_per_position: vec![80, 45, 20, 5] }
}

fn write(dir: &Path, name: &str, value: &impl serde::Serialize) -> PathBuf {
    let path = dir.join(name);
    write_json(&path, value).unwrap();
    path
}

#[test]
fn reports_of_older_versions_still_read_with_their_stem_as_label() {
    let dir = tempfile::tempdir().unwrap();
    // A run written before labels, server counters and optional GPUs: no `label`, no `server`, `gpus: 1`.
    let mut old = serde_json::to_value(run("x", 2, 0.01, Some(1), None)).unwrap();
    let obj = old.as_object_mut().unwrap();
    obj.remove("label");
    obj.remove("server");
    let old_path = write(&dir.path().join(""), "spec-off.json", &old);
    let runs = read_runs(&old_path).unwrap();
    assert_eq!((runs[0].label.as_str(), runs[0].config.gpus, runs[0].server.is_none()), ("spec-off", Some(1), true));
    // An old sweep: points in the old shape (`output_tokens_per_s_per_gpu`, no `per_gpu`) are not read.
    let sweep = json!({"tool": "old", "runs": [old.clone()],
        "points": [{"concurrency": 2, "x": 1.0, "y": 2.0, "output_tokens_per_s_per_gpu": 1.0, "p90_ttft_s": 0.1}],
        "frontier": []});
    let sweep_path = write(dir.path(), "sweep.json", &sweep);
    assert_eq!(read_runs(&sweep_path).unwrap()[0].label, "sweep");
    // A malformed file names itself and what it is not.
    let bad = write(dir.path(), "bad.json", &json!({"tool": "x"}));
    let err = read_runs(&bad).unwrap_err().to_string();
    assert!(err.contains("bad.json") && err.contains("not a run report"), "{err}");
    let empty = write(dir.path(), "empty.json", &json!({"tool": "x", "runs": []}));
    assert!(read_runs(&empty).unwrap_err().to_string().contains("holds no runs"));
}

#[test]
fn labels_override_in_file_order_and_name_compare_columns() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a.json", &run("a", 4, 0.02, None, scraped(None)));
    let b = write(dir.path(), "b.json", &run("b", 4, 0.01, None, scraped(Some(dspark()))));
    let runs = read_labelled(&[a.clone(), b], &["spec off".into()]).unwrap();
    assert_eq!((runs[0].label.as_str(), runs[1].label.as_str()), ("spec off", "b"));
    let err = read_labelled(std::slice::from_ref(&a), &["x".into(), "y".into()]).unwrap_err();
    assert_eq!(err.kind(), "option");
    let table = compare(&runs[..1], &runs[1..]);
    let header = table.lines().find(|l| l.contains("metric")).unwrap();
    assert!(header.contains("spec off") && header.contains(" b") && !header.contains(" A "), "{table}");
    assert!(table.contains("concurrency 4 (b over spec off)"), "{table}");
    // No GPU count: plain tok/s, never per GPU.
    assert!(table.contains("total tok/s ") && !table.contains("GPU"), "{table}");
    let same = compare(&runs[1..], &runs[1..]);
    assert!(same.contains("b #1") && same.contains("b #2"), "{same}");
}

#[test]
fn the_page_shows_every_section_and_says_what_the_server_did_not_report() {
    let runs = vec![
        run("spec off", 1, 0.02, Some(1), scraped(Some(SpecCounters::default()))),
        run("spec off", 4, 0.03, Some(1), scraped(Some(SpecCounters::default()))),
        run("dspark", 1, 0.01, Some(1), scraped(Some(dspark()))),
        run("dspark", 4, 0.015, Some(1), scraped(Some(dspark()))),
        run("other server", 2, 0.02, Some(1), Some(ServerCounters::Scraped(ServerStats::default()))),
        run("old", 2, 0.02, Some(1), None),
    ];
    let page = html::report(&runs).unwrap();
    for text in [
        "<!DOCTYPE html>",
        "6 runs in 4 series",
        "Total (input + output) throughput against P90 interactivity",
        "tokens/s per GPU",
        "Inter-token latency: cumulative distribution",
        "Time to first token: cumulative distribution",
        "Acceptance rate by draft position",
        "2.50",
        "no speculation in this run",
        "not reported by the server",
        "not recorded (the report predates server counters)",
        "60.0%",
        "device 3, host 1, rebuilt 0",
        "traces/&lt;a&amp;b&gt;.json",
    ] {
        assert!(page.contains(text), "the page lacks {text:?}");
    }
    assert_eq!(page.matches("<svg").count(), 5, "2 Pareto, 2 distributions, 1 acceptance chart");
    for outside in ["<script", "http://www", "https://", "<link", "@import", "url("] {
        let allowed = outside == "http://www"
            && page.matches(outside).count() == page.matches("http://www.w3.org/2000/svg").count();
        assert!(allowed || !page.contains(outside), "the page reaches outside: {outside}");
    }
    // One run without a GPU count: the whole page speaks of the whole server.
    let mut mixed = runs.clone();
    mixed[5].config.gpus = None;
    let page = html::report(&mixed).unwrap();
    assert!(page.contains("tokens/s, whole server") && !page.contains("per GPU"));
}

#[test]
fn two_runs_of_one_series_at_one_concurrency_are_refused() {
    let runs = vec![run("run", 2, 0.02, None, None), run("run", 2, 0.01, None, None)];
    let err = html::report(&runs).unwrap_err();
    assert_eq!(err.kind(), "option");
    assert!(err.to_string().contains("two runs labelled \"run\" at concurrency 2"), "{err}");
    assert_eq!(html::report(&[]).unwrap_err().kind(), "option");
}
