//! Soak on loopback, null device: 200 concurrent clients for 60 s, each looping over streaming chat
//! completions, non-streaming completions and Responses WebSocket streams, cancelling about a third of them at a
//! random point (dropping the SSE stream, or `response.cancel`). Every request that is not cancelled must end
//! properly (a finish reason and `[DONE]`, or its terminal event with the length limit reached), none may fail,
//! the engine must end with nothing running or waiting, and the daemon's resident memory may grow by at most
//! [`RSS_BOUND_MB`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use sparkd_tests::{Server, WsIncoming};

const CLIENTS: usize = 200;
const SOAK: Duration = Duration::from_secs(60);
/// How much the daemon's resident memory may grow over the soak.
const RSS_BOUND_MB: u64 = 256;

/// A small deterministic generator per client (no shared state, reproducible runs).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[derive(Default)]
struct Tally {
    finished: AtomicUsize,
    cancelled: AtomicUsize,
}

async fn client(s: &Server, seed: u64, tally: &Tally, deadline: Instant) {
    let mut rng = Lcg(seed);
    let mut ws = None;
    let mut streams = 0usize;
    while Instant::now() < deadline {
        let tokens = 8 + rng.below(120) as usize;
        let cancel_after = (rng.below(3) == 0).then(|| 1 + rng.below(tokens as u64 / 2) as usize);
        match rng.below(3) {
            0 => {
                let body = json!({"messages": [{"role": "user", "content": format!("client {seed}")}],
                    "max_tokens": tokens, "ignore_eos": true, "stream": true});
                let mut stream = s.sse("/v1/chat/completions", &body).await.expect("a stream opens");
                let mut events = 0;
                let mut finish = None;
                let mut done = false;
                while let Some(event) = stream.next().await.expect("the stream reads") {
                    assert!(event.data.get("error").is_none(), "a stream failed: {}", event.data);
                    if let Some(r) = event.data["choices"][0]["finish_reason"].as_str() {
                        finish = Some(r.to_owned());
                    }
                    done = event.is_done();
                    events += 1;
                    if cancel_after.is_some_and(|n| events >= n) {
                        break;
                    }
                }
                if cancel_after.is_some_and(|n| events >= n) && !done {
                    tally.cancelled.fetch_add(1, Ordering::Relaxed);
                } else {
                    assert_eq!(finish.as_deref(), Some("length"), "the stream ended properly");
                    assert!(done, "the stream ends with [DONE]");
                    tally.finished.fetch_add(1, Ordering::Relaxed);
                }
            }
            1 => {
                let body = json!({"prompt": format!("client {seed}"), "max_tokens": tokens, "ignore_eos": true});
                let (status, answer) = s.post("/v1/completions", &body).await.expect("answered");
                assert_eq!(status, 200, "{answer}");
                assert_eq!(answer["usage"]["completion_tokens"], tokens, "{answer}");
                tally.finished.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                if ws.is_none() {
                    ws = Some(s.websocket().await.expect("a socket opens"));
                }
                let socket = ws.as_mut().unwrap();
                streams += 1;
                let id = format!("s{streams}");
                let create = json!({"type": "response.create", "stream_id": id, "input": "hi",
                    "max_output_tokens": tokens, "ignore_eos": true, "store": false});
                socket.send(&create).await.unwrap();
                let mut events = 0;
                let mut asked_cancel = false;
                loop {
                    let WsIncoming::Event(e) = socket.recv_or_close().await.expect("the socket reads") else {
                        panic!("the socket closed mid-stream")
                    };
                    events += 1;
                    match e["type"].as_str().unwrap_or_default() {
                        // A cancel sent as an earlier stream ended finds nothing to cancel: that is the race's
                        // answer, not a failure.
                        "error" if e["stream_id"] != id.as_str() && e["param"] == "response_id" => {}
                        "error" => panic!("a WebSocket stream failed: {e}"),
                        // Reaching `max_output_tokens` is an incomplete response in the Responses API.
                        "response.completed" | "response.incomplete"
                            if e["response"]["incomplete_details"]["reason"] == "max_output_tokens"
                                || e["type"] == "response.completed" =>
                        {
                            tally.finished.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        "response.incomplete" => {
                            assert!(asked_cancel, "incomplete without a cancel: {e}");
                            tally.cancelled.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        _ => {}
                    }
                    if !asked_cancel && cancel_after.is_some_and(|n| events >= n) {
                        socket.send(&json!({"type": "response.cancel", "stream_id": id})).await.unwrap();
                        asked_cancel = true;
                    }
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_with_random_cancels_for_a_minute() {
    let s = Arc::new(Server::start(&["--device", "null"]).await.expect("server starts"));
    let warm = json!({"prompt": "warm", "max_tokens": 8});
    assert_eq!(s.post("/v1/completions", &warm).await.unwrap().0, 200);
    let before = s.rss_mb().unwrap();
    let tally = Arc::new(Tally::default());
    let deadline = Instant::now() + SOAK;
    let clients: Vec<_> = (0..CLIENTS as u64)
        .map(|seed| {
            let (s, tally) = (s.clone(), tally.clone());
            tokio::spawn(async move { client(&s, seed, &tally, deadline).await })
        })
        .collect();
    for c in clients {
        c.await.expect("no client failed");
    }
    let idle = |m: &sparkd_tests::PromText| {
        m.value("vllm:num_requests_running", &[]) == Some(0.0) && m.value("vllm:num_requests_waiting", &[]) == Some(0.0)
    };
    let m = s.wait_metrics(Duration::from_secs(20), idle).await.expect("the engine ends idle: nothing leaked");
    assert_eq!(m.value("sparkd:slow_reader_cancels_total", &[]).unwrap_or(0.0), 0.0, "no reader was cut off");
    let after = s.rss_mb().unwrap();
    let (finished, cancelled) = (tally.finished.load(Ordering::Relaxed), tally.cancelled.load(Ordering::Relaxed));
    assert!(finished > 1000 && cancelled > 100, "{finished} finished, {cancelled} cancelled: too few to prove much");
    assert!(after <= before + RSS_BOUND_MB, "resident memory grew from {before} MB to {after} MB");
    eprintln!("soak: {finished} finished, {cancelled} cancelled; resident memory {before} MB -> {after} MB");
}
