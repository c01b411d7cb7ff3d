//! Crash-safe sessions, black-box on the default CPU k3-tiny with `--session-dir` and two API keys: the daemon
//! is killed with SIGKILL while a turn is in flight, restarted on the same folder, and every committed turn can
//! still be retrieved (the very object the client received) and continued by its owner only (the same prompt
//! as before the crash, its state rebuilt by prefill), and a response deleted after the restart stays deleted
//! across the next one.

use std::time::Duration;

use serde_json::{json, Value};
use sparkd_tests::Server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const K1: [(&str, &str); 1] = [("authorization", "Bearer k1")];
const K2: [(&str, &str); 1] = [("authorization", "Bearer k2")];

async fn start(dir: &std::path::Path) -> Server {
    let dir = dir.to_str().unwrap();
    Server::start(&["--session-dir", dir, "--api-key", "k1", "--api-key", "k2"]).await.expect("server starts")
}

async fn create(s: &Server, body: Value) -> Value {
    let (status, answer) = s.send("POST", "/v1/responses", Some(&body), &K1).await.unwrap();
    assert_eq!(status, 200, "{answer}");
    answer
}

fn turn(input: &str, previous: Option<&Value>, tokens: usize) -> Value {
    let mut body = json!({"input": input, "max_output_tokens": tokens, "temperature": 0});
    if let Some(prev) = previous {
        body["previous_response_id"] = prev["id"].clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_turns_survive_kill_9_and_continue_by_their_owner_only() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let first = create(&s, turn("hello", None, 4)).await;
    let second = create(&s, turn("and more", Some(&first), 4)).await;
    let mut probe = turn("again", Some(&second), 6);
    probe["store"] = json!(false);
    let before = create(&s, probe.clone()).await;

    // A turn in flight when the daemon dies.
    let mut long = turn("a long one", Some(&second), 100_000);
    long["ignore_eos"] = json!(true);
    let in_flight = tokio::spawn(post_on_own_connection(s.port, long));
    tokio::time::sleep(Duration::from_millis(800)).await;
    drop(s); // SIGKILL
    assert!(in_flight.await.unwrap().is_err(), "the turn in flight died with the daemon");

    let s = start(dir.path()).await;
    for kept in [&first, &second] {
        let path = format!("/v1/responses/{}", kept["id"].as_str().unwrap());
        let (status, object) = s.send("GET", &path, None, &K1).await.unwrap();
        assert_eq!(status, 200, "{object}");
        assert_eq!(&object, kept, "the stored object is the one the client received");
        let (status, _) = s.send("GET", &path, None, &K2).await.unwrap();
        assert_eq!(status, 404, "another key does not see it");
    }
    let after = create(&s, probe).await;
    // The same prompt (history and new input); its state restored from memory before, rebuilt by prefill after.
    assert_eq!(after["usage"]["input_tokens"], before["usage"]["input_tokens"], "{after}");
    let cached = |v: &Value| v["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached(&before) > 0 && cached(&after) == 0, "before {before}, after {after}");
    assert!(after["usage"]["output_tokens"].as_u64().unwrap() > 0, "{after}");
    create(&s, turn("from the first", Some(&first), 2)).await;

    let path = format!("/v1/responses/{}", first["id"].as_str().unwrap());
    assert_eq!(s.send("DELETE", &path, None, &K1).await.unwrap().0, 200);
    drop(s);
    let s = start(dir.path()).await;
    assert_eq!(s.send("GET", &path, None, &K1).await.unwrap().0, 404, "a deleted response stays deleted");
    let second_path = format!("/v1/responses/{}", second["id"].as_str().unwrap());
    assert_eq!(s.send("GET", &second_path, None, &K1).await.unwrap().0, 200);
}

/// POSTs `body` to `/v1/responses` with key k1 on a connection of its own; `Err` when the connection dies first.
async fn post_on_own_connection(port: u16, body: Value) -> anyhow::Result<String> {
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let text = body.to_string();
    let head = format!(
        "POST /v1/responses HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k1\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        text.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(text.as_bytes()).await?;
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await?;
    anyhow::ensure!(!answer.is_empty(), "the connection closed without an answer");
    Ok(String::from_utf8_lossy(&answer).into_owned())
}
