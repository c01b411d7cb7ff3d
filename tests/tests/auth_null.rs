//! API keys, browser origins and owner isolation, black-box on the null device: `/health` is open; every other
//! route is a 401 without a valid key; a kept response is invisible to another key (404, as an unknown id), over
//! HTTP and WebSocket; a browser origin not allowed is a 403; response ids are 128 random bits.

use serde_json::{json, Value};
use sparkd_tests::Server;

const ALPHA: &[(&str, &str)] = &[("authorization", "Bearer alpha")];
const BETA: &[(&str, &str)] = &[("authorization", "Bearer beta")];

fn turn(previous: Option<&str>) -> Value {
    let mut body = json!({"input": "hello", "max_output_tokens": 3, "temperature": 0});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    body
}

#[tokio::test]
async fn keys_guard_every_route_but_health_and_a_kept_response_is_its_keys_alone() {
    let file = std::env::temp_dir().join(format!("sparkd-auth-keys-{}", std::process::id()));
    std::fs::write(&file, "# one per line\nbeta\n\n").unwrap();
    let args = ["--device", "null", "--api-key", "alpha", "--api-key-file", file.to_str().unwrap()];
    let s = Server::start(&[&args[..], &["--allow-origin", "https://ok.example"]].concat()).await.expect("starts");
    let (status, _) = s.get("/health").await.unwrap();
    assert_eq!(status, 200, "/health needs no key");
    let (status, err) = s.get_json("/v1/models").await.unwrap();
    assert_eq!((status, err["error"]["code"].as_str()), (401, Some("invalid_api_key")), "{err}");
    let (status, _) = s.send("GET", "/v1/models", None, &[("authorization", "Bearer gamma")]).await.unwrap();
    assert_eq!(status, 401, "a wrong key");
    let (status, _) = s.send("GET", "/metrics", None, &[]).await.unwrap();
    assert_eq!(status, 401, "metrics need a key too");
    for key in [ALPHA, BETA] {
        let (status, models) = s.send("GET", "/v1/models", None, key).await.unwrap();
        assert_eq!(status, 200, "{models}");
    }

    // A response kept under alpha: continued and read by alpha, unknown to beta.
    let (status, first) = s.send("POST", "/v1/responses", Some(&turn(None)), ALPHA).await.unwrap();
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap().to_owned();
    let hex = id.strip_prefix("resp_").unwrap();
    assert!(hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "128 random bits: {id}");
    let (status, second) = s.send("POST", "/v1/responses", Some(&turn(Some(&id))), ALPHA).await.unwrap();
    assert_eq!(status, 200, "{second}");
    let (status, err) = s.send("POST", "/v1/responses", Some(&turn(Some(&id))), BETA).await.unwrap();
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("previous_response_id")), "{err}");
    let path = format!("/v1/responses/{id}");
    assert_eq!(s.send("GET", &path, None, BETA).await.unwrap().0, 404);
    assert_eq!(s.send("DELETE", &path, None, BETA).await.unwrap().0, 404, "beta cannot delete it");
    assert_eq!(s.send("GET", &path, None, ALPHA).await.unwrap().0, 200, "still alpha's");

    // Over WebSocket: the handshake needs a key, and the socket sees its key's responses only.
    assert!(s.websocket().await.is_err(), "a socket without a key is refused");
    let mut ws = s.websocket_with(&[("authorization", "Bearer beta")]).await.unwrap();
    let mut create = turn(Some(&id));
    create["type"] = json!("response.create");
    ws.send(&create).await.unwrap();
    let event = ws.recv().await.unwrap().unwrap();
    assert_eq!(event["type"], "error", "{event}");
    let mut ws = s.websocket_with(&[("authorization", "Bearer alpha")]).await.unwrap();
    ws.send(&create).await.unwrap();
    let events = ws.recv_until_done(1).await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.incomplete", "the continuation ran to max_output_tokens: {last}");
    assert!(last["response"]["usage"]["input_tokens_details"]["cached_tokens"].as_u64() > Some(0), "{last}");

    // Browsers: only the allowed origin.
    let evil = [("authorization", "Bearer alpha"), ("origin", "https://evil.example")];
    let (status, err) = s.send("POST", "/v1/chat/completions", Some(&json!({"messages": []})), &evil).await.unwrap();
    assert_eq!((status, err["error"]["code"].as_str()), (403, Some("origin_not_allowed")), "{err}");
    let ok = [("authorization", "Bearer alpha"), ("origin", "https://ok.example")];
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    assert_eq!(s.send("POST", "/v1/chat/completions", Some(&body), &ok).await.unwrap().0, 200);
    std::fs::remove_file(&file).unwrap();
}

#[tokio::test]
async fn without_keys_every_client_is_served_but_browsers_from_other_sites_are_not() {
    let s = Server::start(&["--device", "null"]).await.expect("starts");
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    assert_eq!(s.post("/v1/chat/completions", &body).await.unwrap().0, 200);
    let page = [("origin", "https://evil.example"), ("content-type", "text/plain")];
    assert_eq!(s.send("POST", "/v1/chat/completions", Some(&body), &page).await.unwrap().0, 403);
}
