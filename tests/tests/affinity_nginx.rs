//! Replicas behind a session-affine load balancer: two real daemons on loopback behind a real nginx running the
//! README's configuration (taken from README.md, ports substituted), and the `x-sparkd-session` contract.
//!
//! What it shows:
//! - Through the consistent hash, turn 2 of every conversation is served from cache: chat completions that
//!   resend a growing history (`cached_tokens > 0`, the prefix cache), Responses continued by
//!   `previous_response_id` with the client's key, and Responses whose first turn had no key (nginx made one,
//!   the daemon echoed it, the client sent it back); the daemons' `/metrics` count those hits, and the
//!   conversations spread over both replicas.
//! - The negative control: behind plain round-robin and without the header, some turn 2 misses (a chat with no
//!   cached tokens, or a Responses continuation refused as `unknown_response` by the replica that never saw it).
//! - The header itself, straight to a daemon: echoed, derived and stable when absent, refused past its bound.
//!
//! Without nginx the test is skipped and says so, unless `CI` is set: then it fails (scripts/test.sh installs
//! Debian's `nginx`). Everything runs on loopback within [`DEADLINE`].

use std::time::Duration;

use serde_json::{json, Value};
use sparkd_tests::nginx::{free_port, nginx_binary, Nginx};
use sparkd_tests::{http_answer, Answer, Server};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// The header of the contract (`daemon/src/api/affinity.rs`).
const HEADER: &str = "x-sparkd-session";
/// The whole test's bound.
const DEADLINE: Duration = Duration::from_secs(300);
/// Conversations of each kind through the consistent hash: enough that both replicas get some (all on one
/// replica has probability 2^-(n-1) per kind).
const CONVERSATIONS: usize = 10;

async fn daemon() -> Server {
    Server::start(&["--device", "null", "--max-event-backlog", "100000000"]).await.expect("daemon starts")
}

/// The README's nginx block with its ports replaced by these.
fn readme_nginx(listen: u16, replicas: [u16; 2]) -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).expect("README.md");
    let section = readme.split("## Replicas behind a load balancer").nth(1).expect("the README's replicas section");
    let block = section.split("```nginx\n").nth(1).and_then(|b| b.split("```").next()).expect("an nginx block");
    let mut config = block.to_string();
    for (from, to) in [
        ("listen 127.0.0.1:8000;", format!("listen 127.0.0.1:{listen};")),
        ("server 127.0.0.1:8001;", format!("server 127.0.0.1:{};", replicas[0])),
        ("server 127.0.0.1:8002;", format!("server 127.0.0.1:{};", replicas[1])),
    ] {
        assert!(config.contains(from), "the README's nginx block has `{from}`");
        config = config.replace(from, &to);
    }
    config
}

/// A plain round-robin balancer over the same replicas, without any affinity (the negative control).
fn round_robin(listen: u16, replicas: [u16; 2]) -> String {
    format!(
        "upstream sparkd_round_robin {{ server 127.0.0.1:{}; server 127.0.0.1:{}; }}\n\
         server {{ listen 127.0.0.1:{listen}; location / {{ proxy_pass http://sparkd_round_robin; \
         proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off; }} }}\n",
        replicas[0], replicas[1]
    )
}

/// A system prompt spanning several 64-token prefix-cache blocks, unique to conversation `tag` from its first
/// token on (so no conversation can reuse another's cache).
fn system_prompt(tag: &str) -> String {
    let rules: String = (0..30).map(|i| format!("Rule {i}: keep edits small and run the tests. ")).collect();
    format!("[{tag}] {rules}")
}

fn chat_body(messages: &[Value]) -> Value {
    json!({"messages": messages, "max_tokens": 4, "temperature": 0})
}

fn chat_cached(answer: &Answer) -> u64 {
    let body = answer.json().expect("chat JSON");
    body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
}

/// One chat conversation of two turns through `base` (with `key` as the affinity header when given): turn 2's
/// answer, after checking both turns answered 200 and echoed the key.
async fn chat_conversation(base: &str, tag: &str, key: Option<&str>) -> Answer {
    let headers: Vec<(&str, &str)> = key.map(|k| (HEADER, k)).into_iter().collect();
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt(tag)}),
        json!({"role": "user", "content": format!("Fix the failing test of {tag}.")}),
    ];
    let turn1 = http_answer(base, "POST", "/v1/chat/completions", Some(&chat_body(&messages)), &headers).await.unwrap();
    assert_eq!(turn1.status, 200, "{tag} turn 1: {}", turn1.text);
    let reply = turn1.json().unwrap()["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "Now run the tests."}));
    let turn2 = http_answer(base, "POST", "/v1/chat/completions", Some(&chat_body(&messages)), &headers).await.unwrap();
    assert_eq!(turn2.status, 200, "{tag} turn 2: {}", turn2.text);
    if let Some(key) = key {
        assert_eq!((turn1.header(HEADER), turn2.header(HEADER)), (Some(key), Some(key)), "{tag}: the key is echoed");
    }
    turn2
}

fn responses_body(input: &str, previous: Option<&str>) -> Value {
    let mut body = json!({"input": input, "max_output_tokens": 4, "temperature": 0});
    if let Some(prev) = previous {
        body["previous_response_id"] = json!(prev);
    }
    body
}

fn responses_cached(answer: &Answer) -> u64 {
    let body = answer.json().expect("response JSON");
    body["usage"]["input_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
}

/// A Responses turn 1 through `base`: its answer (200 checked).
async fn responses_turn1(base: &str, tag: &str, headers: &[(&str, &str)]) -> Answer {
    let input = format!("{} Say something about {tag}.", system_prompt(tag));
    let turn1 = http_answer(base, "POST", "/v1/responses", Some(&responses_body(&input, None)), headers).await.unwrap();
    assert_eq!(turn1.status, 200, "{tag} turn 1: {}", turn1.text);
    turn1
}

/// Turn 2 continuing `turn1` by `previous_response_id` (the answer, whatever its status).
async fn responses_turn2(base: &str, turn1: &Answer, headers: &[(&str, &str)]) -> Answer {
    let id = turn1.json().unwrap()["id"].as_str().unwrap().to_string();
    let body = responses_body("And more.", Some(&id));
    http_answer(base, "POST", "/v1/responses", Some(&body), headers).await.unwrap()
}

/// POST a JSON body to `base` and read the whole answer.
async fn post(base: &str, path: &str, body: Value, headers: &[(&str, &str)]) -> Answer {
    http_answer(base, "POST", path, Some(&body), headers).await.unwrap()
}

/// A counter summed over its series on one daemon (0 when absent).
async fn counter(server: &Server, name: &str, labels: &[(&str, &str)]) -> f64 {
    server.metrics().await.unwrap().value(name, labels).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn turn_two_is_served_from_cache_behind_a_session_affine_nginx() {
    let test = "turn_two_is_served_from_cache_behind_a_session_affine_nginx";
    let Some(binary) = nginx_binary() else {
        if std::env::var_os("CI").is_some() {
            panic!("{test}: nginx must be installed in CI (scripts/test.sh installs Debian's nginx)");
        }
        eprintln!("SKIPPED {test}: nginx is not installed (Debian: apt-get install nginx)");
        return;
    };
    tokio::time::timeout(DEADLINE, behind_nginx(&binary)).await.expect("the test ends within its deadline");
}

async fn behind_nginx(binary: &std::path::Path) {
    let (a, b) = tokio::join!(daemon(), daemon());
    let replicas = [a.port, b.port];
    let (affine_port, rr_port) = (free_port().unwrap(), free_port().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let config = format!("{}\n{}", readme_nginx(affine_port, replicas), round_robin(rr_port, replicas));
    let nginx = Nginx::start(binary, &config, dir.path(), &[affine_port, rr_port]).expect("nginx starts");
    let affine = format!("http://127.0.0.1:{affine_port}");
    let rr = format!("http://127.0.0.1:{rr_port}");

    // Chat completions resending a growing history, each conversation with its own key.
    for i in 0..CONVERSATIONS {
        let tag = format!("chat-{i}");
        let turn2 = chat_conversation(&affine, &tag, Some(&format!("conv-chat-{i}"))).await;
        assert!(chat_cached(&turn2) > 0, "{tag}: turn 2 was not served from cache: {}", turn2.text);
    }
    // Responses continued by previous_response_id with the client's key.
    let mut continued_cached = 0;
    for i in 0..CONVERSATIONS {
        let (tag, key) = (format!("resp-{i}"), format!("conv-resp-{i}"));
        let headers = [(HEADER, key.as_str())];
        let turn1 = responses_turn1(&affine, &tag, &headers).await;
        let turn2 = responses_turn2(&affine, &turn1, &headers).await;
        assert_eq!(turn2.status, 200, "{tag} turn 2 reached a replica without turn 1: {}", turn2.text);
        assert_eq!((turn1.header(HEADER), turn2.header(HEADER)), (Some(key.as_str()), Some(key.as_str())));
        assert_eq!(turn2.json().unwrap()["session"], json!(key), "{tag}: the object stores the key");
        let cached = responses_cached(&turn2);
        assert!(cached > 0, "{tag}: turn 2 did not continue the kept state: {}", turn2.text);
        continued_cached += cached;
    }
    // Responses whose first turn carries no key: nginx makes one ($request_id), the daemon echoes it, and the
    // client sends it back with turn 2.
    for i in 0..CONVERSATIONS / 2 {
        let tag = format!("keyless-{i}");
        let turn1 = responses_turn1(&affine, &tag, &[]).await;
        let key = turn1.header(HEADER).expect("turn 1 answers a key").to_string();
        assert_eq!(key.len(), 32, "{tag}: the key nginx made (`$request_id`, 32 hex digits): {key}");
        let turn2 = responses_turn2(&affine, &turn1, &[(HEADER, key.as_str())]).await;
        assert_eq!(turn2.status, 200, "{tag}: turn 2 with the echoed key reached another replica: {}", turn2.text);
        let cached = responses_cached(&turn2);
        assert!(cached > 0, "{tag}: turn 2 did not continue the kept state");
        continued_cached += cached;
    }

    // The daemons' own counters saw the hits, and both replicas served conversations.
    let mut served = Vec::new();
    let mut session_hits = 0.0;
    for server in [&a, &b] {
        let chats = counter(server, "sparkd:http_requests_total", &[("endpoint", "chat_completions")]).await;
        let responses = counter(server, "sparkd:http_requests_total", &[("endpoint", "responses")]).await;
        served.push(chats + responses);
        session_hits += counter(server, "sparkd:session_cache_hits_total", &[]).await;
        let prefix_hits = counter(server, "vllm:prefix_cache_hits_total", &[]).await;
        assert!(chats == 0.0 || prefix_hits > 0.0, "a replica served chats but counted no prefix-cache hit");
    }
    assert!(served.iter().all(|&n| n > 0.0), "the conversations spread over both replicas: {served:?}");
    let total = (2 * CONVERSATIONS + 2 * CONVERSATIONS + 2 * (CONVERSATIONS / 2)) as f64;
    assert_eq!(served.iter().sum::<f64>(), total, "every turn reached a replica once");
    assert_eq!(session_hits, continued_cached as f64, "the kept-state hits are the continuations' cached tokens");

    // Through the balancer: a streamed chat and a WebSocket carry the key too, and a bad key is a 400 naming it.
    let messages = [json!({"role": "user", "content": "stream please"})];
    let mut body = chat_body(&messages);
    body["stream"] = json!(true);
    let streamed = http_answer(&affine, "POST", "/v1/chat/completions", Some(&body), &[(HEADER, "sse-key")]).await;
    let streamed = streamed.unwrap();
    assert_eq!((streamed.status, streamed.header(HEADER)), (200, Some("sse-key")));
    assert!(streamed.text.contains("data: [DONE]"), "{}", streamed.text);
    websocket_keeps_the_key(affine_port).await;
    let long = "k".repeat(129);
    let refused = http_answer(&affine, "POST", "/v1/chat/completions", Some(&body), &[(HEADER, &long)]).await.unwrap();
    assert_eq!(refused.status, 400, "{}", refused.text);
    assert_eq!(refused.json().unwrap()["error"]["param"], HEADER);

    // The negative control: plain round-robin, no header.
    let mut misses = 0;
    for i in 0..CONVERSATIONS / 2 {
        let turn2 = chat_conversation(&rr, &format!("rr-chat-{i}"), None).await;
        misses += usize::from(chat_cached(&turn2) == 0);
    }
    for i in 0..2 {
        let tag = format!("rr-resp-{i}");
        let turn2 = responses_turn2(&rr, &responses_turn1(&rr, &tag, &[]).await, &[]).await;
        match turn2.status {
            200 => assert!(responses_cached(&turn2) > 0, "{tag}: a continuation on its own replica uses its state"),
            400 => {
                assert_eq!(turn2.json().unwrap()["error"]["code"], "unknown_response", "{tag}: {}", turn2.text);
                misses += 1;
            }
            other => panic!("{tag}: turn 2 answered {other}: {}", turn2.text),
        }
    }
    assert!(misses > 0, "behind round-robin without the header some turn 2 misses");
    drop(nginx);
}

/// A WebSocket through the balancer: the upgrade answers the key, and a response runs on the socket.
async fn websocket_keeps_the_key(port: u16) {
    let mut req = format!("ws://127.0.0.1:{port}/v1/responses").into_client_request().unwrap();
    req.headers_mut().insert(HEADER, "ws-conversation".parse().unwrap());
    let (mut ws, upgrade) = tokio_tungstenite::connect_async(req).await.expect("the upgrade passes nginx");
    assert_eq!(upgrade.headers().get(HEADER).and_then(|v| v.to_str().ok()), Some("ws-conversation"));
    use futures_util::{SinkExt, StreamExt};
    let create = json!({"type": "response.create", "input": "hello", "max_output_tokens": 2});
    ws.send(tokio_tungstenite::tungstenite::Message::Text(create.to_string().into())).await.unwrap();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(60), ws.next()).await.unwrap().unwrap().unwrap();
        let Ok(text) = msg.to_text() else { continue };
        let event: Value = serde_json::from_str(text).unwrap();
        // Two tokens end the response by its length limit: `response.incomplete`.
        if matches!(event["type"].as_str(), Some("response.completed" | "response.incomplete")) {
            assert_eq!(event["response"]["session"], "ws-conversation");
            break;
        }
        assert_ne!(event["type"], "error", "{event}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_header_is_echoed_derived_and_bounded() {
    let s = daemon().await;
    let base = s.base.clone();
    // Chat: echoed when given; derived from the conversation's root when not, the same on turn 2.
    let mut messages = vec![json!({"role": "system", "content": "rules"}), json!({"role": "user", "content": "hi"})];
    let given = post(&base, "/v1/chat/completions", chat_body(&messages), &[(HEADER, "c-1")]).await;
    assert_eq!(given.header(HEADER), Some("c-1"));
    let turn1 = post(&base, "/v1/chat/completions", chat_body(&messages), &[]).await;
    let derived = turn1.header(HEADER).expect("a derived key").to_string();
    assert!(derived.starts_with("chat-"), "{derived}");
    messages.push(json!({"role": "assistant", "content": "hello"}));
    messages.push(json!({"role": "user", "content": "more"}));
    let turn2 = post(&base, "/v1/chat/completions", chat_body(&messages), &[]).await;
    assert_eq!(turn2.header(HEADER), Some(derived.as_str()), "a growing history keeps its key");
    let c = post(&base, "/v1/completions", json!({"prompt": "Once upon a time", "max_tokens": 2}), &[]).await;
    assert!(c.header(HEADER).is_some_and(|k| k.starts_with("cmpl-")), "{:?}", c.headers);

    // Responses: the chain's root, on every turn, whatever key the client sends back or not.
    let r1 = post(&base, "/v1/responses", responses_body("hi", None), &[]).await;
    let root = r1.json().unwrap()["id"].as_str().unwrap().to_string();
    assert_eq!(r1.header(HEADER), Some(root.as_str()), "a first turn's key is its own id");
    let r2 = responses_turn2(&base, &r1, &[]).await;
    assert_eq!((r2.status, r2.header(HEADER)), (200, Some(root.as_str())), "{}", r2.text);
    let r3 = responses_turn2(&base, &r2, &[]).await;
    assert_eq!(r3.header(HEADER), Some(root.as_str()), "turn 3 still answers the root's key");
    let stored = s.get_json(&format!("/v1/responses/{}", r3.json().unwrap()["id"].as_str().unwrap())).await.unwrap();
    assert_eq!(stored.1["session"], json!(root));

    // Bounds and charset: a 400 naming the header, before any work.
    for bad in ["k".repeat(129), "two words".into(), "semi;colon".into()] {
        let a = post(&base, "/v1/responses", responses_body("hi", None), &[(HEADER, &bad)]).await;
        assert_eq!(a.status, 400, "{bad}: {}", a.text);
        let error = &a.json().unwrap()["error"];
        assert_eq!(error["param"], HEADER, "{error}");
        assert!(error["message"].as_str().unwrap().contains(HEADER), "{error}");
    }
    let longest = "k".repeat(128);
    let ok = post(&base, "/v1/chat/completions", chat_body(&messages), &[(HEADER, &longest)]).await;
    assert_eq!(ok.header(HEADER), Some(longest.as_str()));

    // The WebSocket upgrade answers a fresh key when it got none.
    let req = format!("ws://127.0.0.1:{}/v1/responses", s.port).into_client_request().unwrap();
    let (_ws, upgrade) = tokio_tungstenite::connect_async(req).await.unwrap();
    let key = upgrade.headers().get(HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default();
    assert!(key.starts_with("ws-"), "{key:?}");
}
