//! Black-box tests against the default `sparkd serve` (no flags besides the port): the built-in trained
//! k3-tiny-trained on the CPU backend. Streaming chat, and an AIPerf-style multi-turn session over HTTP that resends
//! the full history, where turn 2 must restore turn 1's prefix and prefill only the suffix.

use serde_json::{json, Value};
use sparkd_tests::{sse_text, Server};

/// A system prompt long enough to span several 64-token prefix-cache blocks.
fn system_prompt() -> String {
    (0..40).map(|i| format!("Rule {i}: keep edits small and run the tests. ")).collect()
}

fn usage_of(events: &[sparkd_tests::SseEvent]) -> Value {
    events.iter().rev().find_map(|e| e.data.get("usage").cloned()).expect("a usage chunk")
}

fn timings_of(events: &[sparkd_tests::SseEvent]) -> Value {
    events.iter().rev().find_map(|e| e.data.get("timings").cloned()).expect("timings on the final frame")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_streaming_chat_and_multi_turn_prefix_reuse() {
    let s = Server::start(&[]).await.expect("default server starts");
    let (_, models) = s.get("/v1/models").await.unwrap();
    assert!(models.contains("k3-tiny-trained"), "{models}");

    // Streaming chat, as AIPerf sends it.
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt()}),
        json!({"role": "user", "content": "[rid:8a3f2c1b9e7d]\n\nFix the failing test in parser.rs."}),
    ];
    let body = |messages: &Vec<Value>, n: usize| {
        json!({"model": "k3-tiny-trained", "messages": messages, "stream": true, "max_completion_tokens": n,
               "ignore_eos": true, "stream_options": {"include_usage": true}})
    };
    let turn1 = s.sse_all("/v1/chat/completions", &body(&messages, 8)).await.unwrap();
    assert!(turn1.last().unwrap().is_done());
    assert!(turn1.iter().filter(|e| !e.is_done()).all(|e| e.data["object"] == "chat.completion.chunk"));
    let u1 = usage_of(&turn1);
    assert_eq!(u1["completion_tokens"], 8);
    let p1 = u1["prompt_tokens"].as_u64().unwrap();
    assert!(p1 > 256, "the prompt spans several cache blocks: {p1}");
    let reply = sse_text(&turn1);

    // Turn 2 resends the whole history plus one new user message.
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "Now run the tests."}));
    let turn2 = s.sse_all("/v1/chat/completions", &body(&messages, 4)).await.unwrap();
    let u2 = usage_of(&turn2);
    assert_eq!(u2["completion_tokens"], 4);
    let p2 = u2["prompt_tokens"].as_u64().unwrap();
    let cached = u2["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(p2 > p1);
    assert!(cached > 0, "turn 2 reused turn 1's prefix");
    assert!(cached >= 256, "at least the system prompt's whole blocks were restored: {cached}");
    let t2 = timings_of(&turn2);
    assert_eq!(t2["prompt_tokens"].as_u64().unwrap(), p2);
    assert_eq!(t2["cached_tokens"].as_u64().unwrap(), cached);
    assert_eq!(t2["prefill_tokens"].as_u64().unwrap(), p2 - cached, "only the suffix was computed");
    assert!(t2["ttft_ms"].as_f64().unwrap() > 0.0);

    // Prefix-cache counters saw it.
    let m = s.metrics().await.unwrap();
    assert!(m.value("vllm:prefix_cache_hits_total", &[]).unwrap() >= cached as f64);
    // Each request queries every prompt token but its last, which is always computed.
    assert!(m.value("vllm:prefix_cache_queries_total", &[]).unwrap() >= (p1 + p2) as f64 - 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_websocket_continuation_matches_resending_the_history() {
    let s = Server::start(&[]).await.expect("default server starts");
    let mut ws = s.websocket().await.unwrap();
    ws.send(&json!({"type": "response.create", "input": "Say something.", "max_output_tokens": 5, "temperature": 0}))
        .await
        .unwrap();
    let t1 = ws.recv_until_done(1).await.unwrap();
    let done1 = t1.last().unwrap();
    let id1 = done1["response"]["id"].as_str().unwrap().to_string();
    ws.send(&json!({"type": "response.create", "previous_response_id": id1, "input": "And more.",
                    "max_output_tokens": 5, "temperature": 0}))
        .await
        .unwrap();
    let t2 = ws.recv_until_done(1).await.unwrap();
    let done2 = &t2.last().unwrap()["response"];
    let cached = done2["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let input = done2["usage"]["input_tokens"].as_u64().unwrap();
    assert!(cached > 0);
    assert_eq!(done2["timings"]["prefill_tokens"].as_u64().unwrap(), input - cached);
    assert!(input - cached < 16, "only the new message was prefilled");
}
