//! Cancellation everywhere, black-box on the default CPU k3-tiny with one running slot (`--max-num-seqs 1`):
//! - a non-streaming request that waits for the engine and whose client closes its connection is dropped from
//!   the waiting queue before it is scheduled;
//! - a stored Responses stream whose client leaves before the end is freed, not kept under an id nobody has
//!   the object of (no orphan: `sparkd:sessions_kept` stays 0), while a stored response that ends is kept and
//!   can be retrieved and continued;
//! - after each, the next request is served.

use std::time::Duration;

use serde_json::{json, Value};
use sparkd_tests::{PromText, Server};
use tokio::io::AsyncWriteExt;

/// Long enough that the running request is still decoding for the whole test.
const LONG: usize = 60_000;
const LIMIT: Duration = Duration::from_secs(20);

fn completion(max_tokens: usize, stream: bool) -> Value {
    json!({"prompt": "The tests", "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0, "stream": stream})
}

fn gauge(m: &PromText, name: &str) -> f64 {
    m.value(name, &[]).unwrap_or(-1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_non_streaming_request_whose_client_closed_is_dropped() {
    let s = Server::start(&["--max-num-seqs", "1"]).await.expect("server starts");
    let mut running = s.sse("/v1/completions", &completion(LONG, true)).await.expect("the long request streams");
    assert!(running.next().await.unwrap().is_some(), "the long request produces output");

    // A raw client: sends a whole non-streaming request, then closes the connection while it waits.
    let body = completion(4, false).to_string();
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", s.port)).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    s.wait_metrics(LIMIT, |m| gauge(m, "vllm:num_requests_waiting") == 1.0).await.expect("the request waits");
    drop(conn);
    let m = s
        .wait_metrics(LIMIT, |m| gauge(m, "vllm:num_requests_waiting") == 0.0)
        .await
        .expect("the closed client's request leaves the waiting queue");
    assert_eq!(gauge(&m, "vllm:num_requests_running"), 1.0, "the long request is still running");
    assert!(m.value("sparkd:client_disconnects_total", &[]).unwrap_or(0.0) >= 1.0, "counted as a client gone");
    drop(running);
    let (status, done) = s.post("/v1/completions", &completion(4, false)).await.unwrap();
    assert_eq!(status, 200, "{done}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_whose_client_left_is_freed_and_one_that_ended_is_kept() {
    let s = Server::start(&[]).await.expect("server starts");
    let stored = json!({"input": "hello", "max_output_tokens": LONG, "store": true, "stream": true});
    let mut left = s.sse("/v1/responses", &stored).await.expect("the stored response streams");
    let created = left.next().await.unwrap().expect("response.created");
    let id = created.data["response"]["id"].as_str().expect("an id").to_owned();
    // Some output, then the client leaves.
    left.next().await.unwrap().expect("more events");
    drop(left);
    s.wait_metrics(LIMIT, |m| m.value("sparkd:client_disconnects_total", &[]).unwrap_or(0.0) >= 1.0)
        .await
        .expect("the engine notices the client left");
    let (status, err) = s.get_json(&format!("/v1/responses/{id}")).await.unwrap();
    assert_eq!(status, 404, "{err}");

    let ended = json!({"input": "hello", "max_output_tokens": 4, "store": true});
    let (status, done) = s.post("/v1/responses", &ended).await.unwrap();
    assert_eq!(status, 200, "{done}");
    // The left one was released before the ended one ran: only the ended one was ever kept.
    let m = s.metrics().await.unwrap();
    assert_eq!(m.value("sparkd:sessions_kept_total", &[]), Some(1.0), "nothing is kept for a response nobody received");
    let next = json!({"input": "again", "max_output_tokens": 2, "previous_response_id": done["id"]});
    let (status, cont) = s.post("/v1/responses", &next).await.unwrap();
    assert_eq!(status, 200, "{cont}");
}
