//! The daemon's log as an operator reads it, black-box: one access-log line per request (HTTP and each WebSocket
//! `response.create`) with its id, endpoint, status, tokens, TTFT and duration; a periodic throughput line;
//! `--log-format json` writes one JSON object per line; text written to a pipe has no colour codes; and a port in
//! use is reported before the model loads.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sparkd_tests::{sparkd_bin, Server};

/// The null device outruns any reader: its streams must not be cut as slow readers.
const NULL: [&str; 4] = ["--device", "null", "--max-event-backlog", "100000000"];

/// Waits until `done` holds for the server's log lines, up to 10 s; returns the lines.
async fn wait_log(s: &Server, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    let start = Instant::now();
    loop {
        let lines = s.log.lock().unwrap().clone();
        if done(&lines) || start.elapsed() > Duration::from_secs(10) {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn json_lines(lines: &[String]) -> Vec<Value> {
    lines.iter().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))).collect()
}

fn access(lines: &[Value]) -> Vec<&Value> {
    lines.iter().filter(|l| l["target"] == "sparkd::access").collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_gets_one_json_access_line_and_the_interval_a_throughput_line() {
    let mut args = NULL.to_vec();
    args.extend(["--log-format", "json", "--log-stats-interval", "1"]);
    let s = Server::start(&args).await.expect("server starts");
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "ignore_eos": true});
    let (status, body) = s.post("/v1/chat/completions", &chat).await.unwrap();
    assert_eq!(status, 200, "{body}");
    let chat_id = body["id"].as_str().unwrap().to_owned();
    let stream = json!({"prompt": "Once", "max_tokens": 40, "ignore_eos": true, "stream": true});
    let events = s.sse_all("/v1/completions", &stream).await.unwrap();
    assert!(events.last().unwrap().is_done());
    assert_eq!(s.get("/v1/models").await.unwrap().0, 200);
    assert_eq!(s.get("/no/such/path").await.unwrap().0, 404);
    assert_eq!(s.post_raw("/v1/completions", "{not json").await.unwrap().0, 400);
    let mut ws = s.websocket().await.unwrap();
    ws.send(&json!({"type": "response.create", "input": "hi", "max_output_tokens": 5, "store": false})).await.unwrap();
    let ws_events = ws.recv_until_done(1).await.unwrap();
    let ws_id = ws_events.last().unwrap()["response"]["id"].as_str().unwrap().to_owned();
    ws.close().await.unwrap();

    // 7 requests (the socket's upgrade is one, its response another), then a throughput line after them.
    let lines = wait_log(&s, |lines| {
        let parsed: Vec<Value> = lines.iter().filter_map(|l| serde_json::from_str(l).ok()).collect();
        access(&parsed).len() >= 7 && parsed.iter().any(|l| l["target"] == "sparkd::throughput")
    })
    .await;
    assert!(lines.iter().all(|l| !l.contains('\u{1b}')), "no colour codes in a pipe");
    let parsed = json_lines(&lines);
    let logged = access(&parsed);
    let by_endpoint: BTreeMap<String, Vec<&Value>> = logged.iter().fold(BTreeMap::new(), |mut m, l| {
        m.entry(l["endpoint"].as_str().unwrap().to_owned()).or_default().push(*l);
        m
    });
    let count = |e: &str| by_endpoint.get(e).map_or(0, Vec::len);
    let seen: Vec<(String, usize)> = by_endpoint.iter().map(|(k, v)| (k.clone(), v.len())).collect();
    for endpoint in ["chat_completions", "models", "other", "responses_ws", "responses_ws_event"] {
        assert_eq!(count(endpoint), 1, "{endpoint}: {seen:?}");
    }
    assert_eq!(count("completions"), 2, "the stream and the bad body: {seen:?}");
    assert_eq!(logged.len(), 7, "health probes are not info lines: {seen:?}");

    let chat_line = by_endpoint["chat_completions"][0];
    assert_eq!(chat_line["id"], chat_id.as_str());
    assert_eq!(chat_line["status"], 200);
    assert_eq!(chat_line["completion_tokens"], 7);
    assert!(chat_line["prompt_tokens"].as_u64().unwrap() > 0, "{chat_line}");
    assert!(chat_line["ttft_ms"].as_f64().unwrap() > 0.0, "{chat_line}");
    assert!(chat_line["duration_ms"].as_f64().unwrap() >= chat_line["ttft_ms"].as_f64().unwrap(), "{chat_line}");
    assert_eq!(chat_line["finish"], "length");
    assert!(chat_line["peer"].as_str().unwrap().starts_with("127.0.0.1:"), "{chat_line}");
    let streamed = by_endpoint["completions"].iter().find(|l| l["status"] == 200).expect("the stream's line");
    assert_eq!(streamed["completion_tokens"], 40, "a stream's line is written when it ends: {streamed}");
    assert!(streamed["id"].as_str().unwrap().starts_with("cmpl-"), "{streamed}");
    let bad = by_endpoint["completions"].iter().find(|l| l["status"] == 400).expect("the bad body's line");
    assert_eq!(bad["method"], "POST");
    assert_eq!(by_endpoint["other"][0]["status"], 404);
    assert_eq!(by_endpoint["responses_ws"][0]["status"], 101);
    let ws_line = by_endpoint["responses_ws_event"][0];
    assert_eq!(ws_line["id"], ws_id.as_str());
    assert_eq!(ws_line["completion_tokens"], 5);

    let throughput = parsed.iter().find(|l| l["target"] == "sparkd::throughput").unwrap();
    let text = throughput["message"].as_str().unwrap();
    assert!(text.starts_with("prompt ") && text.contains("generation ") && text.contains("finished"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_in_a_pipe_have_no_colour_and_name_the_fields() {
    let s = Server::start(&NULL).await.expect("server starts");
    assert_eq!(s.get("/v1/models").await.unwrap().0, 200);
    let lines = wait_log(&s, |lines| lines.iter().any(|l| l.contains("sparkd::access"))).await;
    assert!(lines.iter().all(|l| !l.contains('\u{1b}')), "colour codes written to a pipe: {lines:?}");
    let line = lines.iter().find(|l| l.contains("sparkd::access")).expect("an access line");
    for field in ["method=\"GET\"", "path=\"/v1/models\"", "endpoint=\"models\"", "status=200", "duration_ms="] {
        assert!(line.contains(field), "{field} missing: {line}");
    }
}

#[test]
fn a_port_in_use_is_reported_before_the_model_loads() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = Command::new(sparkd_bin().unwrap())
        .args(["serve", "--host", "127.0.0.1", "--port", &port])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--host/--port: cannot listen on 127.0.0.1:") && stderr.contains("in use"), "{stderr}");
    // The default CPU model logs its speculation set-up and `model ready` once loaded.
    assert!(!stderr.contains("model ready") && !stderr.contains("sparkd::startup"), "loaded first: {stderr}");
}
