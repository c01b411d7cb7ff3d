//! Black-box HTTP tests against `sparkd serve --device null` (no math, deterministic tokens): the wire format,
//! validation, stop strings, ignore_eos, logprobs, concurrency, cancellation and /metrics.

use std::time::Duration;

use serde_json::{json, Value};
use sparkd_tests::{sse_text, Server};

/// The null runner outruns any reader: streams these tests leave unread for a while must not be cut as slow
/// readers (`--max-event-backlog`, tested in `slow_reader_null.rs`).
async fn null_server() -> Server {
    Server::start(&["--device", "null", "--served-model-name", "null-k3", "--max-event-backlog", "100000000"])
        .await
        .expect("server starts")
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "null-k3", "messages": [{"role": "user", "content": content}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_chat_and_completions_with_text_and_token_prompts() {
    let s = null_server().await;
    let (status, body) =
        s.post("/v1/chat/completions", &chat("hello", json!({"max_tokens": 5, "temperature": 0}))).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "null-k3");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert!(!body["choices"][0]["message"]["content"].as_str().unwrap().is_empty());
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 5);
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 3);
    assert_eq!(body["usage"]["total_tokens"].as_u64().unwrap(), prompt_tokens + 5);
    assert!(body["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(body["timings"]["completion_tokens"], 5);
    assert_eq!(body["timings"]["prompt_tokens"].as_u64().unwrap(), prompt_tokens);

    let (status, text_body) = s
        .post("/v1/completions", &json!({"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}))
        .await
        .unwrap();
    assert_eq!(status, 200, "{text_body}");
    assert_eq!(text_body["object"], "text_completion");
    assert_eq!(text_body["usage"]["completion_tokens"], 4);
    assert!(text_body["choices"][0]["text"].as_str().is_some());

    let ids = json!([791, 4062, 14198, 39935]);
    let (status, ids_body) =
        s.post("/v1/completions", &json!({"prompt": ids, "max_tokens": 4, "temperature": 0})).await.unwrap();
    assert_eq!(status, 200, "{ids_body}");
    assert_eq!(ids_body["usage"]["prompt_tokens"], 4);
    // The same ids as the text prompt (cl100k encodes "The quick brown fox" as these 4 ids): same greedy output.
    assert_eq!(text_body["usage"]["prompt_tokens"], 4);
    assert_eq!(ids_body["choices"][0]["text"], text_body["choices"][0]["text"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_chat_follows_the_openai_chunk_format_with_usage_and_timings() {
    let s = null_server().await;
    let body = chat(
        "stream please",
        json!({"stream": true, "stream_options": {"include_usage": true}, "max_completion_tokens": 12, "ignore_eos": true}),
    );
    let events = s.sse_all("/v1/chat/completions", &body).await.unwrap();
    assert!(events.last().unwrap().is_done(), "ends with [DONE]");
    let chunks: Vec<&Value> = events.iter().filter(|e| !e.is_done()).map(|e| &e.data).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 12);
    assert!(usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(usage_chunk["timings"]["completion_tokens"], 12);
    let finish: Vec<&Value> =
        chunks.iter().filter_map(|c| c["choices"].get(0)?.get("finish_reason")).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, vec![&json!("length")]);
    assert!(!sse_text(&events).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignore_eos_gives_exactly_max_tokens_and_continuous_usage_counts_up() {
    let s = null_server().await;
    for n in [1usize, 7, 64] {
        let body = chat(
            "count",
            json!({"stream": true, "max_tokens": n, "ignore_eos": true,
                   "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
        );
        let events = s.sse_all("/v1/chat/completions", &body).await.unwrap();
        let usages: Vec<u64> =
            events.iter().filter_map(|e| e.data.get("usage")?.get("completion_tokens")?.as_u64()).collect();
        assert_eq!(*usages.last().unwrap(), n as u64);
        assert!(usages.windows(2).all(|w| w[0] <= w[1]), "cumulative usage never decreases: {usages:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_cut_the_text_and_finish_with_stop() {
    let s = null_server().await;
    let base = json!({"max_tokens": 40, "temperature": 0});
    let (_, full) = s.post("/v1/chat/completions", &chat("stop test", base.clone())).await.unwrap();
    let text = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(text.chars().count() > 20, "{text:?}");
    // A stop string from the middle of the deterministic output.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[12..16].iter().collect();
    let expected_prefix = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let body = chat(
            "stop test",
            json!({"max_tokens": 40, "temperature": 0, "stop": [stop], "stream": stream,
                                            "stream_options": {"include_usage": true}}),
        );
        let (cut, reason, completion) = if stream {
            let events = s.sse_all("/v1/chat/completions", &body).await.unwrap();
            let reason = events
                .iter()
                .rev()
                .find_map(|e| e.data["choices"].get(0)?.get("finish_reason")?.as_str().map(str::to_owned));
            let usage = events.iter().rev().find_map(|e| e.data.get("usage")?.get("completion_tokens")?.as_u64());
            (sse_text(&events), reason.unwrap(), usage.unwrap())
        } else {
            let (status, b) = s.post("/v1/chat/completions", &body).await.unwrap();
            assert_eq!(status, 200);
            (
                b["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
                b["choices"][0]["finish_reason"].as_str().unwrap().to_string(),
                b["usage"]["completion_tokens"].as_u64().unwrap(),
            )
        };
        assert_eq!(cut, expected_prefix, "stream={stream}");
        assert_eq!(reason, "stop");
        assert!(completion < 40, "generation stopped early: {completion}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_have_the_openai_shapes() {
    let s = null_server().await;
    let (status, b) = s
        .post("/v1/chat/completions", &chat("lp", json!({"max_tokens": 3, "logprobs": true, "top_logprobs": 2})))
        .await
        .unwrap();
    assert_eq!(status, 200, "{b}");
    let content = b["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    for entry in content {
        assert!(entry["token"].is_string());
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        assert!(entry["bytes"].is_array());
        assert!(entry["top_logprobs"].as_array().unwrap().len() <= 2);
    }
    let (status, b) = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 3, "logprobs": 1})).await.unwrap();
    assert_eq!(status, 200, "{b}");
    let lp = &b["choices"][0]["logprobs"];
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), 3, "{key}: {lp}");
    }
    let (_, b) = s.post("/v1/chat/completions", &chat("lp", json!({"max_tokens": 2}))).await.unwrap();
    assert!(b["choices"][0]["logprobs"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gives_400_naming_the_field_and_the_server_keeps_working() {
    let s = null_server().await;
    let cases = [
        (chat("x", json!({"temperature": 5})), "temperature"),
        (chat("x", json!({"max_tokens": -1})), "max_tokens"),
        (chat("x", json!({"top_p": "high"})), "top_p"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
        (json!({"messages": "not a list"}), "messages"),
        (chat("x", json!({"stop": [1, 2]})), "stop[0]"),
        (chat("x", json!({"max_tokens": 1_000_000})), "messages"),
    ];
    for (body, field) in cases {
        let (status, b) = s.post("/v1/chat/completions", &body).await.unwrap();
        assert_eq!(status, 400, "{body} -> {b}");
        assert_eq!(b["error"]["param"], field, "{b}");
        assert!(b["error"]["message"].as_str().unwrap().contains(field.split('[').next().unwrap()), "{b}");
        assert_eq!(b["error"]["type"], "invalid_request_error");
    }
    let (status, b) = s.post("/v1/completions", &json!({"prompt": [5, 999_999_999]})).await.unwrap();
    assert_eq!(status, 400);
    assert_eq!(b["error"]["param"], "prompt[1]");
    let (status, b) = s.post_raw("/v1/chat/completions", "{not json").await.unwrap();
    assert_eq!(status, 400);
    assert_eq!(b["error"]["code"], "invalid_json");
    let (status, b) = s.post("/v1/chat/completions", &chat("x", json!({"max_tokens": 500_000}))).await.unwrap();
    assert_eq!(status, 400);
    assert!(b["error"]["message"].as_str().unwrap().contains("maximum context length"), "{b}");
    let (status, _) = s.get("/v1/nothing").await.unwrap();
    assert_eq!(status, 404);
    // Still serving.
    let (status, b) = s.post("/v1/chat/completions", &chat("still there?", json!({"max_tokens": 2}))).await.unwrap();
    assert_eq!(status, 200, "{b}");
    let m = s.metrics().await.unwrap();
    assert!(m.value("sparkd:errors_total", &[("kind", "invalid_field")]).unwrap() >= 6.0);
    assert!(
        m.value("sparkd:http_requests_total", &[("endpoint", "chat_completions"), ("status", "400")]).unwrap() >= 8.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_streams_all_complete() {
    let s = std::sync::Arc::new(null_server().await);
    let mut tasks = Vec::new();
    for i in 0..32 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let n = 16 + i;
            let body = chat(
                &format!("stream {i}"),
                json!({"stream": true, "max_tokens": n, "ignore_eos": true,
                                                            "stream_options": {"include_usage": true}}),
            );
            let events = s.sse_all("/v1/chat/completions", &body).await.unwrap();
            assert!(events.last().unwrap().is_done());
            let usage =
                events.iter().rev().find_map(|e| e.data.get("usage")?.get("completion_tokens")?.as_u64()).unwrap();
            assert_eq!(usage, n as u64, "stream {i}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let m = s
        .wait_metrics(Duration::from_secs(10), |m| m.value("vllm:num_requests_running", &[]) == Some(0.0))
        .await
        .unwrap();
    assert!(m.value("vllm:request_success_total", &[("finished_reason", "length")]).unwrap() >= 32.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_cancels_its_request() {
    let s = null_server().await;
    let body = chat("long", json!({"stream": true, "max_tokens": 100_000, "ignore_eos": true}));
    let mut stream = s.sse("/v1/chat/completions", &body).await.unwrap();
    for _ in 0..5 {
        stream.next().await.unwrap().expect("a chunk");
    }
    s.wait_metrics(Duration::from_secs(10), |m| m.value("vllm:num_requests_running", &[]) == Some(1.0)).await.unwrap();
    drop(stream);
    let m = s
        .wait_metrics(Duration::from_secs(10), |m| {
            m.value("vllm:num_requests_running", &[]) == Some(0.0)
                && m.value("vllm:request_success_total", &[("finished_reason", "abort")]).unwrap_or(0.0) >= 1.0
        })
        .await
        .unwrap();
    assert!(m.value("sparkd:client_disconnects_total", &[]).unwrap() >= 1.0);
    assert_eq!(m.value("sparkd:state_memory_bytes", &[("tier", "device")]), Some(0.0), "the state was freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_hold_every_documented_metric_with_sane_values() {
    let s = null_server().await;
    let (status, _) =
        s.post("/v1/chat/completions", &chat("metrics", json!({"max_tokens": 8, "ignore_eos": true}))).await.unwrap();
    assert_eq!(status, 200);
    let (status, models) = s.get("/v1/models").await.unwrap();
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "null-k3");
    let m = s
        .wait_metrics(Duration::from_secs(10), |m| m.value("vllm:generation_tokens_total", &[]).unwrap_or(0.0) >= 8.0)
        .await
        .unwrap();
    for spec in sparkd::metrics::ALL_METRICS {
        let family = spec.name;
        let (label, values) = spec.labels;
        if !label.is_empty() && values.is_empty() {
            // Labelled with values known only when recorded (e.g. a draft position): absent until then.
            continue;
        }
        assert!(m.types.contains_key(family), "{family} is missing from /metrics");
        assert!(m.help.get(family).is_some_and(|h| !h.is_empty()), "{family} has no HELP");
        let expected = match spec.kind {
            sparkd::metrics::MetricKind::Counter => "counter",
            sparkd::metrics::MetricKind::Gauge => "gauge",
            sparkd::metrics::MetricKind::Histogram => "histogram",
        };
        assert_eq!(m.types[family], expected, "{family}");
    }
    for sample in &m.samples {
        assert_eq!(sample.labels.get("model_name").map(String::as_str), Some("null-k3"), "{sample:?}");
        assert!(sample.value.is_finite() && sample.value >= 0.0, "{sample:?}");
        assert!(!sample.labels.keys().any(|k| k.contains("id")), "no id labels: {sample:?}");
    }
    assert_eq!(m.value("vllm:e2e_request_latency_seconds_count", &[]), Some(1.0));
    assert_eq!(m.value("vllm:request_generation_tokens_sum", &[]), Some(8.0));
    assert!(m.value("vllm:time_to_first_token_seconds_count", &[]).unwrap() >= 1.0);
    assert!(m.value("vllm:inter_token_latency_seconds_count", &[]).unwrap() >= 7.0);
    assert!(m.value("sparkd:interactivity_p90_tokens_per_second", &[]).unwrap() > 0.0);
    let buckets: Vec<f64> = m.find("vllm:time_to_first_token_seconds_bucket", &[]).map(|s| s.value).collect();
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "cumulative buckets");
}
