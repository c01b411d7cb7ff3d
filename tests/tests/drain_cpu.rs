//! Graceful drain, black-box on the default CPU k3-tiny with `--shutdown-timeout 3`: on SIGTERM the daemon takes
//! no new connections; a request that can finish within the drain time finishes normally; one that cannot is
//! cancelled when the time runs out and still ends properly (SSE: a final chunk with `finish_reason: abort` and
//! `[DONE]`; WebSocket: `response.incomplete`); a WebSocket refuses new responses while draining, then gets a
//! final `server_shutting_down` event and a normal close (1000); the process exits 0.

use std::time::{Duration, Instant};

use serde_json::json;
use sparkd_tests::{Server, WsIncoming};

/// Far more tokens than the CPU model makes in the drain time.
const LONG: usize = 60_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_streams_and_closes_websockets_normally_then_exits_0() {
    let s = Server::start(&["--shutdown-timeout", "3"]).await.expect("server starts");
    let long = json!({"prompt": "Drain", "max_tokens": LONG, "ignore_eos": true, "stream": true});
    let mut sse = s.sse("/v1/completions", &long).await.expect("a long SSE stream");
    sse.next().await.unwrap().expect("it streams");
    let mut ws = s.websocket().await.expect("socket");
    let create = |id: &str, tokens: usize| json!({"type": "response.create", "stream_id": id, "input": "hi", "max_output_tokens": tokens, "store": false});
    ws.send(&create("long", LONG)).await.unwrap();
    let first = ws.recv().await.unwrap().expect("response.created");
    assert_eq!(first["type"], "response.created", "{first}");
    let short = json!({"prompt": "Short", "max_tokens": 12, "ignore_eos": true, "stream": true});
    let mut short_sse = s.sse("/v1/completions", &short).await.expect("a short SSE stream");

    let port = s.port;
    let sent = Instant::now();
    let exit = tokio::task::spawn_blocking(move || s.terminate());

    // The short stream finishes normally.
    let mut short_events = Vec::new();
    while let Some(event) = short_sse.next().await.expect("the short stream reads") {
        short_events.push(event);
    }
    let reasons: Vec<_> = short_events.iter().filter_map(|e| e.data["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(reasons, ["length"], "the short request finishes within the drain time");
    assert!(short_events.last().unwrap().is_done());

    // No new connections once the drain began.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err(), "the listener is closed");

    // A new response on the open socket is refused; the long one is cancelled when the drain time runs out.
    ws.send(&create("late", 4)).await.unwrap();
    let mut refused = false;
    let mut incomplete = false;
    let close = loop {
        match ws.recv_or_close().await.expect("the socket reads") {
            WsIncoming::Event(e) if e["type"] == "error" && e["stream_id"] == "late" => {
                assert_eq!(e["code"], "server_shutting_down", "{e}");
                refused = true;
            }
            WsIncoming::Event(e) if e["type"] == "response.incomplete" => {
                assert_eq!(e["stream_id"], "long", "{e}");
                incomplete = true;
            }
            WsIncoming::Event(e) if e["type"] == "error" => {
                assert!(incomplete, "the final event comes after the streams ended: {e}");
                assert_eq!(e["code"], "server_shutting_down", "{e}");
                assert!(e.get("stream_id").is_none(), "{e}");
            }
            WsIncoming::Event(_) => {}
            WsIncoming::Closed(code) => break code,
        }
    };
    assert!(refused, "response.create while draining is refused");
    assert!(incomplete, "the long WebSocket stream ends with response.incomplete");
    assert_eq!(close, Some(1000), "a normal close");

    // The long SSE stream ends with its final chunk after the drain time.
    let mut last_reason = None;
    let mut done = false;
    while let Some(event) = sse.next().await.expect("the long stream reads to its end") {
        done = event.is_done();
        if let Some(r) = event.data["choices"][0]["finish_reason"].as_str() {
            last_reason = Some(r.to_owned());
        }
    }
    assert_eq!(last_reason.as_deref(), Some("abort"));
    assert!(done, "the stream ends with [DONE]");
    assert!(sent.elapsed() >= Duration::from_secs(3), "nothing was cut before the drain time");

    let status = exit.await.unwrap().expect("the daemon exits");
    assert!(status.success(), "exit status {status}");
}
