//! The shipped monitoring files under `dashboards/`, checked statically and then against a real Prometheus.
//!
//! Statically: the Grafana dashboard is current Grafana JSON for import (schemaVersion 42, `__inputs` and
//! `__requires`, a data source variable and a `model` variable from `label_values(..., model_name)`), every query
//! goes to the data source variable and filters every metric it reads by `model_name="$model"`, panels do not
//! overlap, and every metric queried is one the daemon exports; the rules use exported or recorded names only.
//!
//! Live (skipped, saying so, where `prometheus` or `promtool` is not installed, unless `CI` is set: then it fails):
//! `promtool check config` and `check rules` pass on the shipped files; a CPU k3-tiny daemon with forced-acceptance
//! speculation serves a short replay of traces the test writes (chat, resending history: prefix-cache hits; the
//! Responses WebSocket, continuing kept responses: session hits), a Prometheus on loopback scrapes it every second
//! and evaluates the shipped rules every second. Then, through the HTTP API:
//! - every panel query, with Grafana's variables substituted (`$__rate_interval` and `$__interval` the span of the
//!   run), returns at least one series with a finite value at the end of the run, and every panel has a query with
//!   a non-zero finite point over the run as Grafana would draw it (`$__rate_interval` 4 s: four scrapes);
//! - every recording and alerting rule of the file is loaded, healthy and evaluated; each recorded series has a
//!   finite value per served model; each alert's signal (its expression without the trailing threshold
//!   comparison: the rules file writes alerts as `<signal> <comparison> <number>`) returns a finite value;
//! - P90 interactivity read from Prometheus (the daemon's gauge) is within 20% of the replay tool's, computed
//!   from the same requests on the client side.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use sparkd_tests::prometheus::{on_path, Point, Prometheus};
use sparkd_tests::Server;
use sparkd_workloads::metrics::{summarize, RequestRecord};
use sparkd_workloads::replay::ReplayOptions;
use sparkd_workloads::report::RunReport;
use sparkd_workloads::run::{prepare, run_once, Prepared, RunTarget, TransportKind};
use sparkd_workloads::synth::HistoryMode;

/// The served model name: the `model` variable must find it and every query filters by it.
const SERVED_MODEL: &str = "k3-tiny-dashboards";
/// The CPU model with forced acceptance (so the speculation panels have data), and a device state budget of a few
/// states (so kept states are evicted to the host tier and restored from it).
const DAEMON_ARGS: &[&str] = &[
    "--device",
    "cpu",
    "--spec",
    "dspark",
    "--num-spec-tokens",
    "4",
    "--spec-synthetic-al",
    "3",
    "--served-model-name",
    SERVED_MODEL,
    "--state-budget-bytes",
    "3000000",
];
/// Grafana's `$__rate_interval` for a data source scraped every second: four scrapes.
const GRAFANA_RATE_INTERVAL: &str = "4s";
const SCRAPE_INTERVAL_S: f64 = 1.0;
/// Profiling time of each replay (chat and WebSocket run at once); requests in flight then finish.
const REPLAY_DURATION: Duration = Duration::from_secs(20);
/// How long Prometheus may take to see the daemon up, and then its final counts.
const SCRAPE_WAIT: Duration = Duration::from_secs(30);
/// How far P90 interactivity from Prometheus may be from the replay tool's, relatively.
const P90_TOLERANCE: f64 = 0.2;

fn dashboards_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dashboards")
}

fn read_dashboard() -> Value {
    let text = std::fs::read_to_string(dashboards_dir().join("grafana-sparkd.json")).unwrap();
    serde_json::from_str(&text).expect("valid JSON")
}

fn read_rules() -> String {
    std::fs::read_to_string(dashboards_dir().join("sparkd-rules.yml")).unwrap()
}

/// Every panel that draws (rows unfolded, a collapsed row's panels included).
fn drawing_panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        match panel["type"].as_str() {
            Some("row") => out.extend(panel["panels"].as_array().into_iter().flatten()),
            _ => out.push(panel),
        }
    }
    out
}

/// The metric selectors of a query: each `vllm:…` or `sparkd:…` name and the label matchers that follow it, if any.
fn selectors(expr: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for prefix in ["vllm:", "sparkd:"] {
        for (start, _) in expr.match_indices(prefix) {
            let name: String =
                expr[start..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':').collect();
            let rest = &expr[start + name.len()..];
            let matchers = rest.strip_prefix('{').and_then(|r| r.split_once('}')).map(|(m, _)| m.to_string());
            out.push((name, matchers));
        }
    }
    out
}

/// A metric name with its histogram suffix stripped.
fn base_name(name: &str) -> &str {
    ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name)
}

fn exported(name: &str) -> bool {
    sparkd::metrics::ALL_METRICS.iter().any(|m| m.name == name)
}

/// `(kind, name)` of every rule in the rules file (`record` or `alert`).
fn rule_names(rules: &str) -> Vec<(&'static str, String)> {
    rules
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            line.strip_prefix("- record: ")
                .map(|n| ("recording", n.to_string()))
                .or_else(|| line.strip_prefix("- alert: ").map(|n| ("alerting", n.to_string())))
        })
        .collect()
}

/// The dashboard variable called `name`.
fn variable<'a>(dash: &'a Value, name: &str) -> &'a Value {
    let variables = dash["templating"]["list"].as_array().expect("variables");
    variables.iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("no variable ${name}"))
}

/// The `label_values(SELECTOR, LABEL)` query of a query variable (a plain string, or Grafana's query object).
fn label_values_query(variable: &Value) -> (String, String) {
    let query = variable["query"].as_str().or_else(|| variable["query"]["query"].as_str()).expect("a query");
    let inner = query.trim().strip_prefix("label_values(").and_then(|q| q.strip_suffix(')')).expect("label_values");
    let (selector, label) = inner.rsplit_once(',').expect("label_values(selector, label)");
    (selector.trim().to_string(), label.trim().to_string())
}

/// Grafana's interpolation of a panel query: the model, the data source, the intervals; a variable left over is a
/// defect of the dashboard.
fn interpolate(expr: &str, model: &str, rate_interval: &str, interval: &str) -> String {
    let out = expr
        .replace("${model}", model)
        .replace("$model", model)
        .replace("$__rate_interval", rate_interval)
        .replace("$__interval", interval)
        .replace("$__range", interval);
    assert!(!out.contains('$'), "an unknown variable is left in {out}");
    out
}

/// An alert's signal: its expression without the trailing top-level `<comparison> <number>`; `None` when it does
/// not end in one.
fn alert_signal(expr: &str) -> Option<&str> {
    let (mut depth, mut quoted, mut last) = (0i32, false, None);
    let bytes = expr.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'"' => quoted = !quoted,
            b'(' | b'{' | b'[' if !quoted => depth += 1,
            b')' | b'}' | b']' if !quoted => depth -= 1,
            b'>' | b'<' | b'=' | b'!' if !quoted && depth == 0 => {
                let op_start = if i > 0 && matches!(bytes[i - 1], b'>' | b'<' | b'=' | b'!') { i - 1 } else { i };
                last = Some((op_start, i + 1));
            }
            _ => {}
        }
    }
    let (start, end) = last?;
    let threshold = expr[end..].trim().trim_start_matches('=').trim();
    threshold.parse::<f64>().ok()?;
    Some(expr[..start].trim())
}

#[test]
fn alert_signals_drop_only_a_trailing_numeric_threshold() {
    assert_eq!(alert_signal("up{job=\"sparkd\"} < 1"), Some("up{job=\"sparkd\"}"));
    assert_eq!(alert_signal("sum by (m) (rate(x[5m])) / sum(y) > 0.1"), Some("sum by (m) (rate(x[5m])) / sum(y)"));
    assert_eq!(alert_signal("max(x{a!=\"b\"}) >= 32"), Some("max(x{a!=\"b\"})"));
    assert_eq!(alert_signal("x > y"), None, "not a numeric threshold");
    assert_eq!(alert_signal("rate(x[5m])"), None);
}

#[test]
fn grafana_dashboard_is_current_importable_json_and_filters_every_query_by_model() {
    let dash = read_dashboard();
    assert_eq!(dash["schemaVersion"], 42, "Grafana's current classic schema");
    let inputs = dash["__inputs"].as_array().expect("__inputs");
    let input = inputs.iter().find(|i| i["pluginId"] == "prometheus").expect("a Prometheus data source input");
    let input_ref = format!("${{{}}}", input["name"].as_str().unwrap());
    let requires = dash["__requires"].as_array().expect("__requires");
    let required = |kind: &str, id: &str| requires.iter().any(|r| r["type"] == kind && r["id"] == id);
    assert!(required("grafana", "grafana") && required("datasource", "prometheus"));
    let datasource = variable(&dash, "datasource");
    assert_eq!((&datasource["type"], &datasource["query"]), (&json!("datasource"), &json!("prometheus")));
    assert_eq!(datasource["current"]["value"], input_ref.as_str(), "import picks the data source the user chose");
    let model = variable(&dash, "model");
    assert_eq!((&model["type"], &model["datasource"]["uid"]), (&json!("query"), &json!("${datasource}")));
    let (selector, label) = label_values_query(model);
    assert_eq!(label, "model_name");
    assert!(exported(&selector), "the model variable reads {selector}, which sparkd does not export");

    let panels = drawing_panels(&dash);
    assert!(panels.len() >= 20, "{} panels", panels.len());
    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    let mut queried = BTreeSet::new();
    for panel in dash["panels"].as_array().unwrap() {
        let nested = panel["panels"].as_array().into_iter().flatten();
        for p in std::iter::once(panel).chain(nested) {
            assert!(ids.insert(p["id"].as_u64().expect("id")), "duplicate panel id {}", p["id"]);
        }
    }
    for panel in &panels {
        let title = panel["title"].as_str().expect("title");
        assert!(required("panel", panel["type"].as_str().unwrap()), "{title}: its panel type is not in __requires");
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let grid = &panel["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| grid[k].as_u64().expect("gridPos"));
        assert!(x + w <= 24, "{title} is wider than the dashboard");
        for cell in (x..x + w).flat_map(|cx| (y..y + h).map(move |cy| (cx, cy))) {
            assert!(cells.insert(cell), "{title} overlaps another panel at {cell:?}");
        }
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title} has no query");
        for target in targets {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
            let expr = target["expr"].as_str().expect("expr");
            let found = selectors(expr);
            assert!(!found.is_empty(), "{title}: {expr} reads no sparkd metric");
            for (name, matchers) in found {
                assert!(
                    matchers.as_deref().is_some_and(|m| m.split(", ").any(|m| m == "model_name=\"$model\"")),
                    "{title}: {name} is not filtered by model_name=\"$model\" in {expr}"
                );
                assert!(exported(base_name(&name)), "{title} queries {name}, which sparkd does not export");
                queried.insert(base_name(&name).to_string());
            }
        }
    }
    for needed in [
        "sparkd:interactivity_p90_tokens_per_second",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "sparkd:spec_decode_num_draft_tokens_per_pos_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "sparkd:spec_decode_forced_acceptance_length",
        "vllm:prefix_cache_hits_total",
        "sparkd:session_cache_hits_total",
        "sparkd:state_memory_bytes",
        "sparkd:sessions_kept_total",
        "sparkd:sessions_evicted_total",
        "sparkd:sessions_restored_total",
        "sparkd:errors_total",
        "sparkd:engine_phase_seconds",
    ] {
        assert!(queried.contains(needed), "the dashboard has no panel reading {needed}");
    }
}

#[test]
fn rules_use_exported_or_recorded_names_and_the_scrape_config_loads_them() {
    let rules = read_rules();
    let names = rule_names(&rules);
    let records: Vec<&String> = names.iter().filter(|(kind, _)| *kind == "recording").map(|(_, n)| n).collect();
    assert!(records.len() >= 12 && names.len() > records.len(), "recording and alerting rules");
    assert!(records.iter().all(|n| n.starts_with("sparkd:")), "{records:?}");
    for expr in rules.lines().filter_map(|l| l.trim().strip_prefix("expr: ")) {
        for (name, _) in selectors(expr) {
            let recorded = records.iter().any(|r| **r == name);
            assert!(exported(base_name(&name)) || recorded, "a rule reads {name}, neither exported nor recorded");
        }
    }
    assert!(!rules.contains("interval:"), "groups run at the global evaluation_interval");
    let scrape = std::fs::read_to_string(dashboards_dir().join("prometheus.yml")).unwrap();
    assert!(scrape.contains("- sparkd-rules.yml") && scrape.contains("metrics_path: /metrics"));
    assert!(scrape.contains("job_name: sparkd"), "the SparkdDown alert watches job \"sparkd\"");
}

/// The `prometheus` and `promtool` binaries, or `None` (after saying the test is skipped) when either is missing
/// and `CI` is not set.
fn prometheus_tools(test: &str) -> Option<(PathBuf, PathBuf)> {
    match (on_path("prometheus"), on_path("promtool")) {
        (Some(prometheus), Some(promtool)) => Some((prometheus, promtool)),
        _ if std::env::var_os("CI").is_some() => {
            panic!("{test}: prometheus and promtool must be installed in CI (scripts/test.sh installs them)")
        }
        _ => {
            eprintln!("SKIPPED {test}: prometheus or promtool is not on PATH (Debian: apt-get install prometheus)");
            None
        }
    }
}

fn promtool_check(promtool: &Path, what: &str, file: &Path) {
    let out = std::process::Command::new(promtool).args(["check", what]).arg(file).output().expect("promtool runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool check {what} {}:\n{text}", file.display());
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_secs_f64()
}

/// Four agent sessions of four turns, each turn extending the last (its prompt and answer, plus two new blocks):
/// small enough for the CPU model, long enough to pass prefix-cache block boundaries.
fn write_traces(dir: &Path) -> Vec<PathBuf> {
    const BLOCK: u32 = 64;
    const OUT: u32 = 24;
    (0..4)
        .map(|session| {
            let mut input = 4 * BLOCK;
            let mut requests = Vec::new();
            for turn in 0..4u32 {
                let blocks = input.div_ceil(BLOCK) as u64;
                requests.push(json!({"type": "n", "t": f64::from(turn) * 10.0, "model": "agent", "in": input,
                    "out": OUT, "hash_ids": (1..=blocks).collect::<Vec<u64>>()}));
                input += OUT + 2 * BLOCK;
            }
            let trace = json!({"id": format!("dashboards-{session}"), "models": ["agent"], "block_size": BLOCK,
                "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": BLOCK, "requests": requests});
            let path = dir.join(format!("trace_{session}.json"));
            std::fs::write(&path, trace.to_string()).unwrap();
            path
        })
        .collect()
}

fn replay_target(server: &Server, transport: TransportKind, traces: &[PathBuf]) -> RunTarget {
    RunTarget {
        url: server.base.clone(),
        api_key: None,
        transport,
        traces: traces.to_vec(),
        options: ReplayOptions {
            concurrency: 2,
            duration: Some(REPLAY_DURATION),
            max_requests: None,
            time_scale: 0.0,
            system_idle_cap: Some(Duration::from_millis(50)),
            tree_idle_cap: Some(Duration::from_millis(200)),
            start_ratio: None,
            seed: 11,
            model: SERVED_MODEL.into(),
            history: HistoryMode::Resend,
            grace: Duration::from_secs(60),
            progress_every: None,
        },
        token_scale: 1.0,
        gpus: None,
        tokenizer_dir: None,
        label: format!("dashboards {}", transport.name()),
    }
}

/// Polls `query` at the present until `done` holds of its answer, for at most [`SCRAPE_WAIT`].
async fn wait_for(prom: &Prometheus, query: &str, done: impl Fn(&[Point]) -> bool) -> Vec<Point> {
    let started = Instant::now();
    loop {
        let points = prom.query(query, unix_now()).await.expect("query answers");
        if done(&points) {
            return points;
        }
        assert!(started.elapsed() < SCRAPE_WAIT, "{query} stayed at {points:?} for {SCRAPE_WAIT:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn finite(points: &[Point]) -> bool {
    points.iter().any(|p| p.value.is_finite())
}

/// The run's time span as a PromQL duration, whole seconds rounded up.
fn window(start: f64, end: f64) -> String {
    format!("{}s", (end - start).ceil() as u64 + 1)
}

/// Every panel query at the end of the run (a finite series each) and over the run (a non-zero point per panel).
/// Returns the number of queries evaluated, or panics naming every failure.
async fn check_panels(prom: &Prometheus, dash: &Value, start: f64, end: f64) -> usize {
    let mut failures = Vec::new();
    let mut evaluated = 0;
    for panel in drawing_panels(dash) {
        let title = panel["title"].as_str().unwrap();
        let mut drawn = false;
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let whole = interpolate(expr, SERVED_MODEL, &window(start, end), &window(start, end));
            match prom.query(&whole, end).await {
                Ok(points) if finite(&points) => {}
                Ok(points) => failures.push(format!("{title}: {whole} returned no finite value: {points:?}")),
                Err(e) => failures.push(format!("{title}: {e:#}")),
            }
            let drawn_expr = interpolate(expr, SERVED_MODEL, GRAFANA_RATE_INTERVAL, "1s");
            match prom.query_range(&drawn_expr, start, end, SCRAPE_INTERVAL_S).await {
                Ok(points) => drawn |= points.iter().any(|p| p.value.is_finite() && p.value != 0.0),
                Err(e) => failures.push(format!("{title}: {e:#}")),
            }
            evaluated += 1;
        }
        if !drawn {
            failures.push(format!("{title}: no query has a non-zero point over the run"));
        }
    }
    assert!(failures.is_empty(), "{} panel failures:\n{}", failures.len(), failures.join("\n"));
    evaluated
}

/// Every rule of the rules file: loaded, healthy, evaluated, and with data. Polls (at most [`SCRAPE_WAIT`]) so
/// that every rule has been evaluated after the last scrape; returns how many rules were checked.
async fn check_rules(prom: &Prometheus, rules_text: &str) -> usize {
    let expected = rule_names(rules_text);
    let started = Instant::now();
    loop {
        let failures = rule_failures(prom, &expected).await;
        if failures.is_empty() {
            return expected.len();
        }
        assert!(started.elapsed() < SCRAPE_WAIT, "{} rule failures:\n{}", failures.len(), failures.join("\n"));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn rule_failures(prom: &Prometheus, expected: &[(&str, String)]) -> Vec<String> {
    let data = prom.api("rules", &[]).await.expect("/api/v1/rules answers");
    let loaded: Vec<&Value> =
        data["groups"].as_array().expect("groups").iter().flat_map(|g| g["rules"].as_array().unwrap()).collect();
    let mut failures = Vec::new();
    if loaded.len() != expected.len() {
        failures.push(format!("{} rules loaded, the file has {}", loaded.len(), expected.len()));
    }
    let now = unix_now();
    for (kind, name) in expected {
        let Some(rule) = loaded.iter().find(|r| r["name"] == name.as_str()) else {
            failures.push(format!("{name} is not loaded"));
            continue;
        };
        let evaluated = rule["lastEvaluation"].as_str().is_some_and(|t| !t.starts_with("0001-"));
        if rule["type"] != *kind || rule["health"] != "ok" || !evaluated {
            failures.push(format!("{name}: {kind} expected, found {rule}"));
            continue;
        }
        let query = match *kind {
            "recording" => name.clone(),
            _ => match alert_signal(rule["query"].as_str().unwrap_or_default()) {
                Some(signal) => signal.to_string(),
                None => {
                    failures.push(format!("{name}: {} does not end in a numeric threshold", rule["query"]));
                    continue;
                }
            },
        };
        match prom.query(&query, now).await {
            Ok(points) if finite(&points) => {
                let models: BTreeSet<&str> =
                    points.iter().filter_map(|p| p.labels.get("model_name").and_then(Value::as_str)).collect();
                if *kind == "recording" && models != BTreeSet::from([SERVED_MODEL]) {
                    failures.push(format!("{name}: series of models {models:?}"));
                }
            }
            Ok(points) => failures.push(format!("{name}: {query} returned no finite value: {points:?}")),
            Err(e) => failures.push(format!("{name}: {e:#}")),
        }
    }
    failures
}

/// The Prometheus configuration of the test: the daemon scraped, the shipped rules evaluated, every second.
fn prometheus_config(daemon_port: u16, rules: &Path) -> String {
    format!(
        "global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n  evaluation_interval: {SCRAPE_INTERVAL_S}s\n\
         rule_files:\n  - {}\n\
         scrape_configs:\n  - job_name: sparkd\n    metrics_path: /metrics\n    static_configs:\n      \
         - targets: [\"127.0.0.1:{daemon_port}\"]\n",
        rules.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_and_rule_has_data_in_prometheus_scraping_a_replayed_daemon() {
    let test = "every_panel_and_rule_has_data_in_prometheus_scraping_a_replayed_daemon";
    let Some((prometheus, promtool)) = prometheus_tools(test) else { return };
    let rules_path = dashboards_dir().join("sparkd-rules.yml").canonicalize().unwrap();
    promtool_check(&promtool, "config", &dashboards_dir().join("prometheus.yml"));
    promtool_check(&promtool, "rules", &rules_path);

    let dir = tempfile::tempdir().unwrap();
    let traces = write_traces(dir.path());
    let server = Server::start(DAEMON_ARGS).await.expect("the daemon starts");
    let prom_dir = dir.path().join("prometheus");
    std::fs::create_dir(&prom_dir).unwrap();
    let prom = Prometheus::start(&prometheus, &prometheus_config(server.port, &rules_path), &prom_dir)
        .await
        .expect("prometheus starts");
    wait_for(&prom, "up{job=\"sparkd\"}", |p| p.iter().any(|p| p.value == 1.0)).await;

    let dash = read_dashboard();
    let (selector, label) = label_values_query(variable(&dash, "model"));
    let models = prom.api(&format!("label/{label}/values"), &[("match[]", &selector)]).await.unwrap();
    assert_eq!(models, json!([SERVED_MODEL]), "the model variable lists the served model");

    let start = unix_now();
    // A malformed body: the errors panel has a kind to draw.
    let (status, _) = server.post_raw("/v1/chat/completions", "{not json").await.unwrap();
    assert_eq!(status, 400);
    let chat = replay_target(&server, TransportKind::Chat, &traces);
    let ws = replay_target(&server, TransportKind::Ws, &traces);
    let prepared: Prepared = prepare(&chat).expect("traces load");
    let (chat_report, ws_report) = tokio::join!(run_once(&chat, &prepared, 2), run_once(&ws, &prepared, 2));
    let reports: [RunReport; 2] = [chat_report.expect("chat replay runs"), ws_report.expect("ws replay runs")];
    let records: Vec<RequestRecord> = reports.iter().flat_map(|r| r.records.iter().cloned()).collect();
    let failed: Vec<_> = records.iter().filter(|r| !r.ok()).map(|r| (&r.error, &r.error_message)).collect();
    assert!(failed.is_empty(), "failed requests: {failed:#?}");
    assert!(records.iter().any(|r| r.continues), "no turn continued a chain");

    // Prometheus has scraped the final counts once it sees every finished request the daemon counted.
    let finished = server.metrics().await.unwrap().value("vllm:request_success_total", &[]).unwrap();
    let total = format!("sum(vllm:request_success_total{{model_name=\"{SERVED_MODEL}\"}})");
    wait_for(&prom, &total, |p| p.iter().any(|p| p.value >= finished)).await;
    let end = unix_now();

    let queries = check_panels(&prom, &dash, start, end).await;
    let rules = check_rules(&prom, &read_rules()).await;

    let gauge = format!("sparkd:interactivity_p90_tokens_per_second{{model_name=\"{SERVED_MODEL}\"}}");
    let from_prometheus = prom.query(&gauge, end).await.unwrap().first().expect("the P90 gauge").value;
    let from_replay = summarize(&records, None).p90_interactivity;
    let off = (from_prometheus - from_replay).abs() / from_replay;
    eprintln!(
        "{} requests ({} chat, {} ws); {queries} panel queries and {rules} rules have data; P90 interactivity \
         {from_prometheus:.2} tok/s/user from Prometheus, {from_replay:.2} from the replay ({:.1}% apart)",
        records.len(),
        reports[0].records.len(),
        reports[1].records.len(),
        off * 100.0
    );
    assert!(off <= P90_TOLERANCE, "P90 interactivity {from_prometheus} (Prometheus) vs {from_replay} (replay)");
}
