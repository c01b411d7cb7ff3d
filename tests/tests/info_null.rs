//! The informational endpoints in vLLM's shapes, black-box on the null device served as `null-k3`:
//! `GET /v1/models/{id}` and every generation endpoint (404 `model_not_found` for another name), `HEAD` wherever `GET` answers, `/version`,
//! `/tokenize` (a prompt, or chat messages counted exactly as a chat request is charged) and `/detokenize`
//! (its inverse; an id outside the vocabulary is a 400 naming it).

use serde_json::json;
use sparkd_tests::Server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn null_server() -> Server {
    Server::start(&["--device", "null", "--served-model-name", "null-k3"]).await.expect("server starts")
}

/// Sends `HEAD path` on a connection of its own; returns the response head.
async fn head(s: &Server, path: &str) -> String {
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", s.port)).await.unwrap();
    conn.write_all(format!("HEAD {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_version_and_head() {
    let s = null_server().await;
    let (status, model) = s.get_json("/v1/models/null-k3").await.unwrap();
    assert_eq!(status, 200, "{model}");
    assert_eq!((model["id"].as_str(), model["object"].as_str()), (Some("null-k3"), Some("model")));
    let (status, err) = s.get_json("/v1/models/gpt-4o").await.unwrap();
    assert_eq!(status, 404, "{err}");
    assert_eq!(
        (err["error"]["code"].as_str(), err["error"]["param"].as_str()),
        (Some("model_not_found"), Some("model"))
    );
    let (status, version) = s.get_json("/version").await.unwrap();
    assert_eq!(status, 200);
    assert!(version["version"].as_str().is_some_and(|v| !v.is_empty()), "{version}");
    for path in ["/metrics", "/health", "/v1/models"] {
        let answer = head(&s, path).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "HEAD {path}: {answer}");
        assert!(answer.ends_with("\r\n\r\n"), "HEAD {path} carries no body: {answer:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_counts_what_generation_charges_and_detokenize_inverts_it() {
    let s = null_server().await;
    let (status, t) = s.post("/tokenize", &json!({"model": "null-k3", "prompt": "Hello, tokens!"})).await.unwrap();
    assert_eq!(status, 200, "{t}");
    let ids = t["tokens"].as_array().unwrap().clone();
    assert_eq!(t["count"], ids.len());
    assert_eq!(t["max_model_len"], 131_072);
    let (status, back) = s.post("/detokenize", &json!({"tokens": ids})).await.unwrap();
    assert_eq!(status, 200, "{back}");
    assert_eq!(back["prompt"], "Hello, tokens!");

    // Messages: the same count a chat request is charged as prompt tokens.
    let messages = json!([{"role": "user", "content": "How many tokens is this?"}]);
    let (status, t) = s.post("/tokenize", &json!({"messages": messages})).await.unwrap();
    assert_eq!(status, 200, "{t}");
    let (status, done) = s.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 1})).await.unwrap();
    assert_eq!(status, 200, "{done}");
    assert_eq!(t["count"], done["usage"]["prompt_tokens"], "tokenize {t} vs chat {done}");

    for (path, body, param) in [
        ("/tokenize", json!({"model": "other", "prompt": "x"}), "model"),
        ("/tokenize", json!({}), "prompt"),
        ("/detokenize", json!({"tokens": [1, 99_999_999]}), "tokens[1]"),
        ("/detokenize", json!({"tokens": [1, -2]}), "tokens[1]"),
    ] {
        let (status, err) = s.post(path, &body).await.unwrap();
        assert!(status == 400 || status == 404, "{path} {body}: {status} {err}");
        assert_eq!(err["error"]["param"], param, "{path} {body}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_naming_another_model_is_a_404_on_every_endpoint_and_the_served_name_is_served() {
    let s = Server::start(&["--device", "null", "--served-model-name", "null-k3"]).await.expect("server starts");
    let chat = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let completion = |model: &str| json!({"model": model, "prompt": "hi", "max_tokens": 2});
    let response = |model: &str| json!({"model": model, "input": "hi", "max_output_tokens": 2, "store": false});
    for (path, body) in [
        ("/v1/chat/completions", chat as fn(&str) -> serde_json::Value),
        ("/v1/completions", completion),
        ("/v1/responses", response),
    ] {
        let (status, err) = s.post(path, &body("k3-tiny")).await.unwrap();
        assert_eq!(status, 404, "{path}: {err}");
        assert_eq!(err["error"]["code"], "model_not_found", "{path}: {err}");
        assert_eq!(err["error"]["param"], "model", "{path}: {err}");
        assert!(err["error"]["message"].as_str().unwrap().contains("k3-tiny"), "{path}: {err}");
        let (status, ok) = s.post(path, &body("null-k3")).await.unwrap();
        assert_eq!(status, 200, "{path}: {ok}");
    }
    let mut ws = s.websocket().await.unwrap();
    let mut create = response("k3-tiny");
    create["type"] = json!("response.create");
    ws.send(&create).await.unwrap();
    let err = ws.recv().await.unwrap().expect("an error event");
    assert_eq!((err["type"].as_str(), err["code"].as_str()), (Some("error"), Some("model_not_found")), "{err}");
    create["model"] = json!("null-k3");
    ws.send(&create).await.unwrap();
    let events = ws.recv_until_done(1).await.unwrap();
    assert_eq!(events.last().unwrap()["response"]["model"], "null-k3", "{events:?}");
}
