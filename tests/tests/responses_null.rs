//! Black-box tests of the Responses API against `sparkd serve --device null`: WebSocket mode (multi-turn with
//! `previous_response_id`, forks on one socket, cancel, errors), `POST /v1/responses` over SSE, `GET` and `DELETE
//! /v1/responses/{id}`, the kept-responses byte budget, and continuations sent the moment their response ends.

use std::time::Duration;

use serde_json::{json, Value};
use sparkd_tests::{Server, WsClient};

/// The null runner outruns any reader: streams these tests leave unread for a while must not be cut as slow
/// readers (`--max-event-backlog`, tested in `slow_reader_null.rs`).
async fn null_server() -> Server {
    Server::start(&["--device", "null", "--max-event-backlog", "100000000"]).await.expect("server starts")
}

fn terminal<'a>(events: &'a [Value], stream_id: Option<&str>) -> &'a Value {
    events
        .iter()
        .find(|e| {
            matches!(e["type"].as_str(), Some("response.completed" | "response.incomplete"))
                && stream_id.is_none_or(|id| e["stream_id"] == id)
        })
        .unwrap_or_else(|| panic!("no terminal event for {stream_id:?} in {events:#?}"))
}

fn text_of(events: &[Value], stream_id: &str) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta" && e["stream_id"] == stream_id)
        .map(|e| e["delta"].as_str().unwrap().to_string())
        .collect()
}

async fn turn(ws: &mut WsClient, create: Value) -> Vec<Value> {
    ws.send(&create).await.unwrap();
    ws.recv_until_done(1).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_multi_turn_continues_the_kept_state_and_prefills_only_the_new_input() {
    let s = null_server().await;
    let mut ws = s.websocket().await.unwrap();
    let t1 = turn(
        &mut ws,
        json!({"type": "response.create", "stream_id": "main", "instructions": "You are a coding agent.",
               "input": "List the files.", "max_output_tokens": 6, "temperature": 0}),
    )
    .await;
    let types: Vec<&str> = t1.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types.first(), Some(&"response.created"));
    assert!(types.contains(&"response.output_text.delta"));
    assert!(t1.iter().all(|e| e["stream_id"] == "main"), "every event is tagged");
    let seqs: Vec<u64> = t1.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    let done1 = &terminal(&t1, None)["response"];
    assert_eq!(done1["usage"]["output_tokens"], 6);
    assert_eq!(done1["output"][0]["content"][0]["text"].as_str().unwrap(), text_of(&t1, "main"));
    let id1 = done1["id"].as_str().unwrap().to_string();
    let input1 = done1["usage"]["input_tokens"].as_u64().unwrap();

    let t2 = turn(
        &mut ws,
        json!({"type": "response.create", "stream_id": "main", "previous_response_id": id1,
               "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Now read main.rs."}]}],
               "max_output_tokens": 4, "temperature": 0}),
    )
    .await;
    let done2 = &terminal(&t2, None)["response"];
    assert_eq!(done2["previous_response_id"], id1.as_str());
    let usage = &done2["usage"];
    let input2 = usage["input_tokens"].as_u64().unwrap();
    let cached = usage["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= input1 + 5, "turn 2 restored turn 1's prompt and output: cached {cached}, turn 1 input {input1}");
    let prefill = done2["timings"]["prefill_tokens"].as_u64().unwrap();
    assert_eq!(prefill, input2 - cached);
    assert!(prefill < 20, "only the new message was prefilled: {prefill}");

    // A tool output continues the conversation too.
    let id2 = done2["id"].as_str().unwrap();
    let t3 = turn(
        &mut ws,
        json!({"type": "response.create", "stream_id": "main", "previous_response_id": id2, "max_output_tokens": 3,
               "input": [{"type": "function_call_output", "call_id": "call_1", "output": "fn main() {}"}]}),
    )
    .await;
    assert!(
        terminal(&t3, None)["response"]["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > cached
    );
    ws.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_streams_continuing_one_response_on_one_socket_fork_it() {
    let s = null_server().await;
    let mut ws = s.websocket().await.unwrap();
    let t1 = turn(
        &mut ws,
        json!({"type": "response.create", "input": "Plan the work.", "max_output_tokens": 5, "temperature": 0}),
    )
    .await;
    let parent = terminal(&t1, None)["response"]["id"].as_str().unwrap().to_string();
    for (sid, text) in [("sub-a", "Subagent A: search."), ("sub-b", "Subagent B: test.")] {
        ws.send(&json!({"type": "response.create", "stream_id": sid, "previous_response_id": parent,
                        "input": text, "max_output_tokens": 24, "ignore_eos": true, "temperature": 0}))
            .await
            .unwrap();
    }
    let events = ws.recv_until_done(2).await.unwrap();
    let mut outputs = Vec::new();
    for sid in ["sub-a", "sub-b"] {
        let done = &terminal(&events, Some(sid))["response"];
        assert_eq!(done["usage"]["output_tokens"], 24, "{sid}");
        assert!(
            done["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0,
            "{sid} restored the parent"
        );
        outputs.push(text_of(&events, sid));
    }
    assert_ne!(outputs[0], outputs[1], "different inputs give different continuations");
    // The parent is still kept: the same continuation again gives the same (greedy) text.
    let again = turn(
        &mut ws,
        json!({"type": "response.create", "stream_id": "sub-a", "previous_response_id": parent,
               "input": "Subagent A: search.", "max_output_tokens": 24, "ignore_eos": true, "temperature": 0}),
    )
    .await;
    assert_eq!(text_of(&again, "sub-a"), outputs[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_cancel_stops_a_stream_and_frees_its_request() {
    let s = null_server().await;
    let mut ws = s.websocket().await.unwrap();
    ws.send(&json!({"type": "response.create", "stream_id": "long", "input": "go", "max_output_tokens": 100_000,
                    "ignore_eos": true, "store": false}))
        .await
        .unwrap();
    let mut deltas = 0;
    while deltas < 3 {
        let ev = ws.recv().await.unwrap().unwrap();
        assert_ne!(ev["type"], "error", "{ev}");
        if ev["type"] == "response.output_text.delta" {
            deltas += 1;
        }
    }
    ws.send(&json!({"type": "response.cancel", "stream_id": "long"})).await.unwrap();
    let events = ws.recv_until_done(1).await.unwrap();
    let done = terminal(&events, Some("long"));
    assert_eq!(done["type"], "response.incomplete");
    assert_eq!(done["response"]["incomplete_details"]["reason"], "cancelled");
    s.wait_metrics(Duration::from_secs(10), |m| m.value("vllm:num_requests_running", &[]) == Some(0.0)).await.unwrap();

    // Errors are events; the socket keeps working.
    ws.send(&json!({"type": "response.create", "stream_id": "bad", "previous_response_id": "resp_nope", "input": "x"}))
        .await
        .unwrap();
    let err = ws.recv().await.unwrap().unwrap();
    assert_eq!(err["type"], "error");
    assert_eq!(err["stream_id"], "bad");
    assert_eq!(err["param"], "previous_response_id");
    ws.send(&json!({"type": "response.dance"})).await.unwrap();
    assert_eq!(ws.recv().await.unwrap().unwrap()["param"], "type");
    let ok = turn(&mut ws, json!({"type": "response.create", "input": "fine", "max_output_tokens": 2})).await;
    assert_eq!(terminal(&ok, None)["type"], "response.incomplete", "length-limited responses are incomplete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_the_socket_cancels_its_streams() {
    let s = null_server().await;
    let mut ws = s.websocket().await.unwrap();
    for sid in ["x", "y"] {
        ws.send(&json!({"type": "response.create", "stream_id": sid, "input": "go", "max_output_tokens": 100_000,
                        "ignore_eos": true}))
            .await
            .unwrap();
    }
    s.wait_metrics(Duration::from_secs(10), |m| m.value("vllm:num_requests_running", &[]) == Some(2.0)).await.unwrap();
    drop(ws);
    // A scrape is not one snapshot: the running gauge can reach 0 before the abort counter is bumped, so the
    // wait covers all three.
    let aborted = |m: &sparkd_tests::PromText| m.value("vllm:request_success_total", &[("finished_reason", "abort")]);
    let m = s
        .wait_metrics(Duration::from_secs(10), |m| {
            m.value("vllm:num_requests_running", &[]) == Some(0.0)
                && m.value("sparkd:websockets_open", &[]) == Some(0.0)
                && aborted(m).is_some_and(|n| n >= 2.0)
        })
        .await
        .unwrap_or_else(|e| panic!("the two streams were not cancelled as aborts after the socket closed: {e}"));
    assert!(aborted(&m).unwrap() >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_responses_streams_named_events_and_answers_plain_json() {
    let s = null_server().await;
    let events =
        s.sse_all("/v1/responses", &json!({"input": "hello", "stream": true, "max_output_tokens": 5})).await.unwrap();
    let names: Vec<&str> = events.iter().map(|e| e.event.as_deref().unwrap()).collect();
    assert_eq!(names.first(), Some(&"response.created"));
    assert_eq!(names.last(), Some(&"response.incomplete"));
    assert!(events.iter().all(|e| e.data["type"] == e.event.as_deref().unwrap()));
    let delta = events.iter().find(|e| e.data["type"] == "response.output_text.delta").unwrap();
    for key in ["item_id", "output_index", "content_index", "delta"] {
        assert!(!delta.data[key].is_null(), "{key}");
    }
    let (status, body) = s.post("/v1/responses", &json!({"input": "hello", "max_output_tokens": 3})).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "response");
    assert_eq!(body["usage"]["output_tokens"], 3);
    assert_eq!(body["usage"]["total_tokens"], body["usage"]["input_tokens"].as_u64().unwrap() + 3);
    let (status, body) =
        s.post("/v1/responses", &json!({"input": "x", "previous_response_id": "resp_missing"})).await.unwrap();
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "previous_response_id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_returns_the_stored_response_and_delete_forgets_it() {
    let s = null_server().await;
    let (status, created) = s.post("/v1/responses", &json!({"input": "hello", "max_output_tokens": 3})).await.unwrap();
    assert_eq!(status, 200, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let (status, got) = s.get_json(&format!("/v1/responses/{id}")).await.unwrap();
    assert_eq!(status, 200, "{got}");
    assert_eq!(got, created, "GET returns the response object as it was answered");

    // A streamed response is stored as its terminal event carried it.
    let events =
        s.sse_all("/v1/responses", &json!({"input": "hi", "stream": true, "max_output_tokens": 4})).await.unwrap();
    let last = &events.last().unwrap().data["response"];
    let (status, got) = s.get_json(&format!("/v1/responses/{}", last["id"].as_str().unwrap())).await.unwrap();
    assert_eq!((status, &got), (200, last));

    let (status, deleted) = s.delete(&format!("/v1/responses/{id}")).await.unwrap();
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted, json!({"id": id, "object": "response.deleted", "deleted": true}));
    for (status, body) in [
        s.get_json(&format!("/v1/responses/{id}")).await.unwrap(),
        s.delete(&format!("/v1/responses/{id}")).await.unwrap(),
    ] {
        assert_eq!(status, 404, "{body}");
        assert_eq!(body["error"]["code"], "response_not_found");
        assert!(body["error"]["message"].as_str().unwrap().contains(&id), "{body}");
    }
    let (status, body) = s
        .post("/v1/responses", &json!({"input": "more", "previous_response_id": id, "max_output_tokens": 2}))
        .await
        .unwrap();
    assert_eq!(status, 400, "continuing a deleted response: {body}");
    assert_eq!(body["error"]["param"], "previous_response_id");

    // `store: false` keeps nothing.
    let (_, unstored) =
        s.post("/v1/responses", &json!({"input": "x", "store": false, "max_output_tokens": 2})).await.unwrap();
    assert_eq!(unstored["store"], false);
    let (status, _) = s.get_json(&format!("/v1/responses/{}", unstored["id"].as_str().unwrap())).await.unwrap();
    assert_eq!(status, 404);
    assert_eq!(s.get_json("/v1/responses/resp_never").await.unwrap().0, 404);

    let m = s
        .wait_metrics(Duration::from_secs(10), |m| m.value("sparkd:sessions_kept", &[]) == Some(1.0))
        .await
        .expect("one response (the streamed one) is still kept");
    assert_eq!(m.value("sparkd:sessions_deleted_total", &[]), Some(1.0));
    assert!(m.value("sparkd:sessions_bytes", &[]).unwrap() > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiny_kept_responses_budget_evicts_the_least_recently_used_response_entirely() {
    // One response below holds about 8.3 kB of state and history (about 1,030 tokens at 4 bytes each, twice) plus
    // its stored object (under 2 kB): two fit in 22 kB, three do not.
    let s = Server::start(&["--device", "null", "--kept-responses-bytes", "22000"]).await.expect("server starts");
    let mut ids = Vec::new();
    for word in ["alpha", "beta", "gamma"] {
        let input = format!("{word} ").repeat(1000);
        let (status, body) = s
            .post("/v1/responses", &json!({"input": input, "max_output_tokens": 4, "ignore_eos": true}))
            .await
            .unwrap();
        assert_eq!(status, 200, "{body}");
        ids.push(body["id"].as_str().unwrap().to_string());
    }
    let m = s
        .wait_metrics(Duration::from_secs(10), |m| m.value("sparkd:sessions_kept", &[]) == Some(2.0))
        .await
        .expect("two responses fit the budget");
    assert_eq!(m.value("sparkd:sessions_evicted_total", &[("tier", "removed")]), Some(1.0));
    let held = m.value("sparkd:sessions_bytes", &[]).unwrap();
    assert!(held > 16_000.0 && held <= 22_000.0, "held {held}");
    assert_eq!(s.get_json(&format!("/v1/responses/{}", ids[0])).await.unwrap().0, 404, "the oldest is gone");
    for id in &ids[1..] {
        assert_eq!(s.get_json(&format!("/v1/responses/{id}")).await.unwrap().0, 200);
    }
    let (status, body) = s
        .post("/v1/responses", &json!({"input": "and?", "previous_response_id": ids[0], "max_output_tokens": 2}))
        .await
        .unwrap();
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "previous_response_id");
    let (status, body) = s
        .post("/v1/responses", &json!({"input": "and?", "previous_response_id": ids[2], "max_output_tokens": 2}))
        .await
        .unwrap();
    assert_eq!(status, 200, "the newest is continued: {body}");
    assert!(body["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_sent_as_its_response_ends_is_accepted_while_the_engine_is_busy() {
    // The response object is attached to the kept response by a command queued as the response ends; a busy
    // engine takes it a step later, so the next turn often reads the response before its object is there.
    let s = null_server().await;
    let mut busy = s.websocket().await.unwrap();
    busy.send(&json!({"type": "response.create", "stream_id": "bg", "input": "go", "max_output_tokens": 100_000,
                      "ignore_eos": true, "store": false}))
        .await
        .unwrap();
    let mut ws = s.websocket().await.unwrap();
    let first = turn(&mut ws, json!({"type": "response.create", "input": "turn 0", "max_output_tokens": 2})).await;
    let mut prev = terminal(&first, None)["response"]["id"].as_str().unwrap().to_string();
    for i in 1..30 {
        let events = turn(
            &mut ws,
            json!({"type": "response.create", "previous_response_id": prev, "input": format!("turn {i}"),
                   "max_output_tokens": 2, "ignore_eos": true}),
        )
        .await;
        assert!(events.iter().all(|e| e["type"] != "error"), "turn {i}: {events:#?}");
        prev = terminal(&events, None)["response"]["id"].as_str().unwrap().to_string();
    }
}
