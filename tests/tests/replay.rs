//! The replay tool against the real daemon: `sparkd serve --device null`, three small Weka traces from the
//! shared workloads folder, replayed by the `sparkd-workloads` library at concurrency 2 over both transports
//! (chat/completions SSE and the Responses WebSocket), the daemon keyed with `--api-key` as an exposed one is.
//!
//! Invariants checked: no request fails; every request gets exactly its planned output tokens (`ignore_eos`
//! with a token limit) as streamed text; TTFT and ITL are present and lie inside the request's end-to-end time;
//! a turn that extends its chain's context reuses what the server holds (`cached_tokens > 0`: the prefix cache
//! for chat, the kept response for WebSocket). A turn that restarts its chain (the trace's next input is shorter
//! than the previous input plus output, as after a compaction) is not required to hit: sparkd snapshots a
//! hybrid model's state only at the last full block of each prompt, so a prompt that diverges earlier misses.
//!
//! The traces come from `$SPARKD_WORKLOADS` (default `../shared/workloads` next to the repository root); when
//! that folder is absent the tests print that they were SKIPPED and pass.
//! Time is compressed 1000x and token counts scaled by 1/50, and each run is bounded by request count and
//! duration, so a run takes seconds.

use std::path::PathBuf;
use std::time::Duration;

use sparkd_tests::Server;
use sparkd_workloads::replay::ReplayOptions;
use sparkd_workloads::report::RunReport;
use sparkd_workloads::run::{prepare, run_once, RunTarget, TransportKind};
use sparkd_workloads::synth::HistoryMode;

/// Small traces: a short main-agent session and two with subagents (parallel streams on one lane).
const TRACES: [&str; 3] = ["trace_0538.json", "trace_0291.json", "trace_0277.json"];
const MAX_REQUESTS: usize = 40;
const CONCURRENCY: usize = 2;
/// The daemon runs with an API key, so every request of both transports must carry it (a 401 fails the run).
const REPLAY_KEY: &str = "replay-secret";

/// The Weka trace folder, or `None` (after saying the test is skipped) when the workloads are absent.
fn weka_dir(test: &str) -> Option<PathBuf> {
    let root = std::env::var_os("SPARKD_WORKLOADS").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("..").join("shared").join("workloads")
    });
    let dir = root.join("weka-kv-cache-tester");
    if TRACES.iter().all(|t| dir.join(t).is_file()) {
        Some(dir)
    } else {
        eprintln!("SKIPPED {test}: trace files {TRACES:?} not found under {} (set SPARKD_WORKLOADS)", dir.display());
        None
    }
}

async fn replay_against_null_daemon(transport: TransportKind, dir: PathBuf) -> RunReport {
    let server = Server::start(&["--device", "null", "--api-key", REPLAY_KEY]).await.expect("server starts");
    let target = RunTarget {
        url: server.base.clone(),
        api_key: Some(REPLAY_KEY.into()),
        transport,
        traces: TRACES.iter().map(|t| dir.join(t)).collect(),
        options: ReplayOptions {
            concurrency: CONCURRENCY,
            duration: Some(Duration::from_secs(30)),
            max_requests: Some(MAX_REQUESTS),
            time_scale: 0.001,
            system_idle_cap: Some(Duration::from_millis(50)),
            tree_idle_cap: Some(Duration::from_millis(200)),
            start_ratio: Some((0.25, 0.75)),
            seed: 7,
            model: "k3-tiny".into(),
            history: HistoryMode::Resend,
            grace: Duration::from_secs(20),
            progress_every: None,
        },
        token_scale: 0.02,
        gpus: 1,
        tokenizer_dir: None,
    };
    let prepared = prepare(&target).expect("traces load and the token pool is vetted");
    let report = run_once(&target, &prepared, CONCURRENCY).await.expect("replay runs");
    drop(server);
    report
}

fn check(report: &RunReport, transport: &str) {
    let records = &report.records;
    assert!(!records.is_empty(), "{transport}: no request was profiled");
    assert!(records.len() <= MAX_REQUESTS, "{transport}: {} requests exceed --max-requests", records.len());
    let failed: Vec<_> = records.iter().filter(|r| !r.ok()).map(|r| (&r.error, &r.error_message)).collect();
    assert!(failed.is_empty(), "{transport}: failed requests: {failed:#?}");

    let mut continued = 0;
    for r in records {
        let what = format!("{transport} {} turn {}", r.chain, r.turn);
        assert!(r.planned_output_tokens > 0, "{what}: planned no output");
        assert_eq!(r.output_tokens, r.planned_output_tokens as u64, "{what}: output tokens differ from the plan");
        assert!(r.content_chunks > 0, "{what}: no streamed text");
        let prompt = r.prompt_tokens.unwrap_or_else(|| panic!("{what}: usage has no prompt tokens"));
        assert!(
            prompt >= r.planned_input_tokens as u64,
            "{what}: prompt {prompt} < planned {}",
            r.planned_input_tokens
        );
        let e2e = r.e2e_s.unwrap_or_else(|| panic!("{what}: no end-to-end time"));
        let ttft = r.ttft_s.unwrap_or_else(|| panic!("{what}: no TTFT"));
        assert!(ttft > 0.0 && ttft <= e2e, "{what}: TTFT {ttft} outside (0, e2e {e2e}]");
        if r.output_tokens >= 2 {
            let itl = r.itl_s.unwrap_or_else(|| panic!("{what}: no ITL with {} output tokens", r.output_tokens));
            assert!(
                itl >= 0.0 && itl * (r.output_tokens - 1) as f64 <= e2e,
                "{what}: ITL {itl} implausible (e2e {e2e})"
            );
        }
        let cached = r.cached_tokens.unwrap_or_else(|| panic!("{what}: usage has no cached tokens"));
        assert!(cached <= prompt, "{what}: cached {cached} > prompt {prompt}");
        if r.continues {
            continued += 1;
            assert!(cached > 0, "{what}: a turn that extends its chain reused no cached prefix");
        }
    }
    let subagent_turns = records.iter().filter(|r| r.depth > 0).count();
    assert!(subagent_turns > 0, "{transport}: no subagent turn ran, so parallel chains went untested");
    assert!(continued > 0, "{transport}: no turn extended its chain, so prefix reuse went untested");
    let summary = &report.summary;
    eprintln!(
        "{transport}: {} requests ({continued} extending their chain, {subagent_turns} of subagents), cache hit rate {:.2}, TTFT p50 {:.4}s, ITL p50 {:.5}s",
        records.len(),
        summary.cache_hit_rate,
        summary.ttft_s.p50,
        summary.itl_s.p50
    );
    assert_eq!((summary.errors, summary.successful), (0, records.len()), "{transport}: summary disagrees");
    assert_eq!(summary.ttft_s.count, records.len(), "{transport}: summary TTFT count");
    assert!(summary.cached_tokens > 0 && summary.cache_hit_rate > 0.0, "{transport}: summary shows no cache reuse");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_replay_of_weka_traces_against_the_null_daemon() {
    let Some(dir) = weka_dir("chat_replay_of_weka_traces_against_the_null_daemon") else { return };
    let report = replay_against_null_daemon(TransportKind::Chat, dir).await;
    check(&report, "chat");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_replay_of_weka_traces_against_the_null_daemon() {
    let Some(dir) = weka_dir("websocket_replay_of_weka_traces_against_the_null_daemon") else { return };
    let report = replay_against_null_daemon(TransportKind::Ws, dir).await;
    check(&report, "ws");
}
