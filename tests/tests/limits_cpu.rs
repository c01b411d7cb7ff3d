//! Bounds a client can hit, black-box on the default CPU k3-tiny with one running slot (`--max-num-seqs 1`) and
//! one waiting slot (`--max-waiting 1`): a request past the waiting bound is refused with 429 `queue_full`
//! before it reaches the engine, and the next request is served once a slot frees; a queued request whose
//! client leaves is dropped from the waiting queue while the running one goes on (nothing is prefilled for
//! nobody), and its slot is reused.

use std::time::Duration;

use serde_json::{json, Value};
use sparkd_tests::Server;

/// Long enough that the running request is still decoding for the whole test.
const LONG: usize = 60_000;

fn completion(max_tokens: usize, stream: bool) -> Value {
    json!({"prompt": "The tests", "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0, "stream": stream})
}

fn gauge(m: &sparkd_tests::PromText, name: &str) -> f64 {
    m.value(name, &[]).unwrap_or(-1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_waiting_a_request_gets_429_and_a_waiter_whose_client_left_is_dropped() {
    let s = Server::start(&["--max-num-seqs", "1", "--max-waiting", "1"]).await.expect("server starts");
    let mut running = s.sse("/v1/completions", &completion(LONG, true)).await.expect("the long request streams");
    assert!(running.next().await.unwrap().is_some(), "the long request produces output");

    let waiter = s.sse("/v1/completions", &completion(4, true)).await.expect("a second request is queued");
    let limit = Duration::from_secs(20);
    s.wait_metrics(limit, |m| gauge(m, "vllm:num_requests_waiting") == 1.0).await.expect("one request waits");

    let (status, err) = s.post("/v1/completions", &completion(4, false)).await.unwrap();
    assert_eq!(status, 429, "{err}");
    assert_eq!(err["error"]["code"], "queue_full", "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("--max-waiting"), "{err}");

    // The waiting client leaves: the engine drops its request while the long one still runs.
    drop(waiter);
    let m = s
        .wait_metrics(limit, |m| gauge(m, "vllm:num_requests_waiting") == 0.0)
        .await
        .expect("the abandoned request leaves the waiting queue");
    assert_eq!(gauge(&m, "vllm:num_requests_running"), 1.0, "the long request is still running");
    assert!(m.value("sparkd:client_disconnects_total", &[]).unwrap_or(0.0) >= 1.0, "counted as a client gone");
    assert!(running.next().await.unwrap().is_some(), "the long request is still streaming");

    // Its slot is free again: a new request queues rather than being refused; then the long one ends and it runs.
    let server = &s;
    let release = async move {
        server.wait_metrics(limit, |m| gauge(m, "vllm:num_requests_waiting") == 1.0).await.expect("the new one waits");
        drop(running);
    };
    let short = completion(4, false);
    let (answer, ()) = tokio::join!(s.post("/v1/completions", &short), release);
    let (status, done) = answer.unwrap();
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["usage"]["completion_tokens"], 4, "{done}");
}
