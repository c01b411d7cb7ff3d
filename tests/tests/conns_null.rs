//! Connection bounds, black-box on the null device: a head trickled slower than `--header-timeout` is cut off
//! (500 slowloris connections used to be held for as long as they liked), a body that stalls is a 408, an idle
//! keep-alive connection and an idle WebSocket are closed after `--idle-timeout`, and past `--max-connections`
//! a new connection waits until one closes, and past `--max-ws-streams` a WebSocket's next `response.create` is
//! refused until one of its streams ends; after each, the next request is served.

use std::time::{Duration, Instant};

use serde_json::json;
use sparkd_tests::{Server, WsIncoming};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n";

/// Reads until the server closes the connection (or `limit` passes); returns what was read, or `None` when
/// the connection was still open at the limit.
async fn read_to_close(conn: &mut TcpStream, limit: Duration) -> Option<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        loop {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(limit, read).await.ok().map(|()| String::from_utf8_lossy(&got).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_stalled_bodies_and_idle_connections_are_closed() {
    let s = Server::start(&["--device", "null", "--header-timeout", "1", "--idle-timeout", "3"])
        .await
        .expect("server starts");
    let addr = ("127.0.0.1", s.port);

    // Fifty slowloris connections: a partial head, then nothing.
    let mut slow = Vec::new();
    for _ in 0..50 {
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n").await.unwrap();
        slow.push(conn);
    }
    let started = Instant::now();
    for conn in &mut slow {
        let answer = read_to_close(conn, Duration::from_secs(5)).await;
        assert!(answer.is_some(), "a trickled head is cut off");
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "cut after the header timeout, not the idle one ({took:?})");
    assert_eq!(s.get("/health").await.unwrap().0, 200);

    // A body that stops half-way is a 408 after the header timeout.
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\":")
        .await
        .unwrap();
    let answer = read_to_close(&mut conn, Duration::from_secs(5)).await.expect("answered and closed");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout") && answer.contains("--header-timeout"), "{answer}");

    // A keep-alive connection that served a request, then idles, is closed after the idle timeout.
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(HEALTH).await.unwrap();
    let started = Instant::now();
    let answer = read_to_close(&mut conn, Duration::from_secs(8)).await.expect("closed when idle");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let idle = started.elapsed();
    assert!(idle >= Duration::from_millis(2500), "not closed before the idle timeout ({idle:?})");

    // An idle WebSocket gets an event and a normal close.
    let mut ws = s.websocket().await.unwrap();
    let event = match ws.recv_or_close().await.unwrap() {
        WsIncoming::Event(e) => e,
        closed => panic!("an event comes before the close: {closed:?}"),
    };
    assert_eq!(event["code"], "request_timeout", "{event}");
    assert!(matches!(ws.recv_or_close().await.unwrap(), WsIncoming::Closed(Some(1000))));

    let (status, done) = s.post("/v1/completions", &json!({"prompt": "after", "max_tokens": 2})).await.unwrap();
    assert_eq!(status, 200, "{done}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_connections_a_new_connection_waits_for_a_free_slot() {
    const MAX: usize = 4;
    let s = Server::start(&["--device", "null", "--max-connections", "4"]).await.expect("server starts");
    let addr = ("127.0.0.1", s.port);
    // Keep-alive connections that were each served once, until one is not served: the test client's pooled
    // connections hold slots too, so the bound shows as at most MAX served.
    let mut held = Vec::new();
    let waiting = loop {
        let mut conn = TcpStream::connect(addr).await.expect("the kernel's backlog takes the connection");
        conn.write_all(HEALTH).await.unwrap();
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(700), conn.read(&mut buf)).await {
            Ok(read) => {
                assert!(String::from_utf8_lossy(&buf[..read.unwrap()]).starts_with("HTTP/1.1 200"));
                held.push(conn);
                assert!(held.len() <= MAX, "{} connections were served at once", held.len());
            }
            Err(_) => break conn,
        }
    };
    assert!(!held.is_empty(), "at least one connection is served");
    let mut waiting = waiting;
    drop(held.pop());
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), waiting.read(&mut buf))
        .await
        .expect("served once a slot frees")
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_ws_streams_a_response_create_is_refused_until_one_ends() {
    // On the CPU k3-tiny: the null device makes tokens faster than any reader takes them, and cuts it off.
    let s = Server::start(&["--device", "cpu", "--max-ws-streams", "2"]).await.expect("server starts");
    let mut ws = s.websocket().await.unwrap();
    let create = |id: &str| {
        json!({"type": "response.create", "stream_id": id, "input": "hi", "max_output_tokens": 100_000,
               "ignore_eos": true, "store": false})
    };
    for id in ["s1", "s2", "s3"] {
        ws.send(&create(id)).await.unwrap();
    }
    // s3 is refused; s1 and s2 run. Then s1 is cancelled, and a new one is taken.
    let mut refused = false;
    let mut cancelled = false;
    loop {
        let WsIncoming::Event(e) = ws.recv_or_close().await.unwrap() else { panic!("the socket closed") };
        match (e["type"].as_str().unwrap_or_default(), e["stream_id"].as_str().unwrap_or_default()) {
            ("error", "s3") => {
                assert_eq!(e["code"], "too_many_streams", "{e}");
                refused = true;
                ws.send(&json!({"type": "response.cancel", "stream_id": "s1"})).await.unwrap();
            }
            ("response.incomplete", "s1") => {
                cancelled = true;
                ws.send(&create("s4")).await.unwrap();
            }
            ("response.created", "s4") => break,
            ("error", other) => panic!("unexpected error on {other}: {e}"),
            _ => {}
        }
    }
    assert!(refused && cancelled);
}
