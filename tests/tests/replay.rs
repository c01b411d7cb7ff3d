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
//! A third run pair, speculation off and `--spec suffix`, each against a daemon serving another model name than
//! any default, checks that the replay asks the model of `GET /v1/models`, that the server's counters around the
//! run land in the report (no verify round with speculation off; rounds, per-position acceptance summing to the
//! accepted tokens, and prefix-cache hits with it on), and that the HTML report of both renders in headless
//! Chromium with no script exception, no console or log error and no request leaving the page, its five charts
//! laid out with a size. Without `chromium` on `PATH` the render is SKIPPED (said on stderr), except under `CI`,
//! where it fails: `scripts/test.sh` installs Debian's.
//!
//! The traces come from `$SPARKD_WORKLOADS` (default `../shared/workloads` next to the repository root); when
//! that folder is absent the tests print that they were SKIPPED and pass.
//! Time is compressed 1000x and token counts scaled by 1/50, and each run is bounded by request count and
//! duration, so a run takes seconds.

use std::path::PathBuf;
use std::time::Duration;

use sparkd_tests::chromium::{check_page, chromium_bin};
use sparkd_tests::Server;
use sparkd_workloads::replay::ReplayOptions;
use sparkd_workloads::report::{read_labelled, write_json, RunReport};
use sparkd_workloads::run::{prepare, run_once, RunTarget, TransportKind};
use sparkd_workloads::server::ServerClient;
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

/// Replays the traces once against `server` at [`CONCURRENCY`].
async fn replay(
    server: &Server,
    transport: TransportKind,
    dir: &std::path::Path,
    label: &str,
    model: &str,
) -> RunReport {
    let target = RunTarget {
        label: label.into(),
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
            model: model.into(),
            history: HistoryMode::Resend,
            grace: Duration::from_secs(20),
            progress_every: None,
        },
        token_scale: 0.02,
        gpus: None,
        tokenizer_dir: None,
    };
    let prepared = prepare(&target).expect("traces load and the token pool is vetted");
    run_once(&target, &prepared, CONCURRENCY).await.expect("replay runs")
}

async fn replay_against_null_daemon(transport: TransportKind, dir: PathBuf) -> RunReport {
    let server = Server::start(&["--device", "null", "--api-key", REPLAY_KEY]).await.expect("server starts");
    replay(&server, transport, &dir, "null", "k3-tiny-trained").await
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

/// The model name both daemons of the report test serve: not a default of the replay or the daemon.
const SERVED_MODEL: &str = "replay-report-model";

/// The page's charts (size in CSS pixels), its section count and its title.
const PROBE: &str = "(() => ({ svgs: [...document.querySelectorAll('svg')].map(s => { const r = s.getBoundingClientRect(); \
                     return [Math.round(r.width), Math.round(r.height)]; }), sections: document.querySelectorAll('h2').length, \
                     title: document.title }))()";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_of_speculation_off_and_on_renders_in_chromium() {
    let Some(dir) = weka_dir("report_of_speculation_off_and_on_renders_in_chromium") else { return };
    let out = tempfile::tempdir().expect("temp dir");
    let mut files = Vec::new();
    let configs = [("spec off", &[][..], false), ("suffix", &["--spec", "suffix", "--num-spec-tokens", "4"][..], true)];
    for (label, spec_args, speculates) in configs {
        let mut args = vec!["--device", "null", "--api-key", REPLAY_KEY, "--served-model-name", SERVED_MODEL];
        args.extend_from_slice(spec_args);
        let server = Server::start(&args).await.expect("server starts");
        let model = ServerClient::new(&server.base, Some(REPLAY_KEY)).unwrap().served_model().await.expect("model");
        assert_eq!(model, SERVED_MODEL, "the replay must send the model the server lists");
        let report = replay(&server, TransportKind::Chat, &dir, label, &model).await;
        drop(server);
        check(&report, label);
        let stats = report.server_stats().unwrap_or_else(|| panic!("{label}: no server counters: {:?}", report.server));
        let spec = stats.spec.as_ref().unwrap_or_else(|| panic!("{label}: sparkd exports the spec_decode counters"));
        if speculates {
            assert!(spec.drafts > 0 && spec.draft_tokens >= spec.drafts, "{label}: no verify round: {spec:?}");
            assert!(spec.accepted_per_position.len() <= 4, "{label}: positions past --num-spec-tokens: {spec:?}");
            let per_position: u64 = spec.accepted_per_position.iter().sum();
            assert_eq!(per_position, spec.accepted_tokens, "{label}: per-position acceptance disagrees: {spec:?}");
        } else {
            assert_eq!((spec.drafts, spec.draft_tokens), (0, 0), "{label}: verify rounds with speculation off");
        }
        let cache = stats.prefix_cache.as_ref().unwrap_or_else(|| panic!("{label}: no prefix-cache counters"));
        assert!(cache.hit_tokens > 0 && cache.hit_tokens <= cache.queried_tokens, "{label}: prefix cache {cache:?}");
        eprintln!("{label}: server counters {stats:?}");
        let path = out.path().join(format!("{}.json", label.replace(' ', "-")));
        write_json(&path, &report).expect("report written");
        files.push(path);
    }
    let runs = read_labelled(&files, &[]).expect("reports read back");
    assert_eq!(runs.iter().map(|r| r.label.as_str()).collect::<Vec<_>>(), ["spec off", "suffix"]);
    let page = sparkd_workloads::html::report(&runs).expect("the report is built");
    assert!(!page.contains("per GPU"), "runs without a GPU count must not show per-GPU throughput");
    let html = out.path().join("report.html");
    std::fs::write(&html, &page).expect("page written");

    let Some(bin) = chromium_bin() else {
        assert!(std::env::var_os("CI").is_none(), "chromium is not on PATH under CI (scripts/test.sh installs it)");
        eprintln!("SKIPPED the Chromium render of {}: no `chromium` on PATH", html.display());
        return;
    };
    let seen = check_page(&bin, &html, PROBE).await.expect("chromium loads the page");
    eprintln!("chromium: {} errors, {} bad requests, probe {}", seen.errors.len(), seen.bad_requests.len(), seen.probe);
    assert!(seen.errors.is_empty(), "the page logged errors: {:#?}", seen.errors);
    assert!(seen.bad_requests.is_empty(), "the page made requests: {:#?}", seen.bad_requests);
    assert_eq!(seen.probe["title"], "sparkd-replay report");
    assert_eq!(seen.probe["sections"], 6, "summary, Pareto, latency, speculation, cache, runs");
    let svgs = seen.probe["svgs"].as_array().expect("svg sizes");
    assert_eq!(svgs.len(), 5, "2 Pareto charts, 2 distributions, acceptance by position: {svgs:?}");
    for size in svgs {
        let (w, h) = (size[0].as_f64().unwrap_or(0.0), size[1].as_f64().unwrap_or(0.0));
        assert!(w >= 200.0 && h >= 150.0, "a chart is laid out too small: {svgs:?}");
    }
}
