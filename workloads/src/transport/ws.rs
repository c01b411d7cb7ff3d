//! The Responses WebSocket (`GET /v1/responses`, upgraded): one socket per lane, many streams.
//!
//! Invariants:
//! - A lane opens one socket; every chain of its session tree (the main agent and each subagent)
//!   is a separate `stream_id` on it, so subagents run as parallel streams of one socket.
//! - A turn that continues its chain sends only the new messages with `previous_response_id`;
//!   the server keeps the context (and its real output) between turns.
//! - One reader task routes server events to the waiting turn by `stream_id` (sparkd tags every
//!   event of a stream with it at the top level; `response.stream_id` is also read); an event for
//!   no waiting stream is ignored. A closed socket fails every waiting turn with a connection error.
//! - A turn ends at `response.completed` (stopped) or `response.incomplete` (length limit; every
//!   replayed turn ends there, since it sends `ignore_eos` with `max_output_tokens`), both carrying
//!   `response.usage` (`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`); an
//!   incomplete response cut short by a cancel is an error. `error` ends the turn with its `message`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

use futures_util::{SinkExt, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use super::{bearer, parse_spec, parse_usage, Connection, Transport, TurnOutcome, TurnRequest};
use crate::error::{ReplayError, Result};

type Routes = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<serde_json::Value>>>>;
type Sink = futures_util::stream::SplitSink<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    WsMessage,
>;

/// The ws transport: knows the URL; each lane connects its own socket.
#[derive(Clone, Debug)]
pub struct WsTransport {
    url: String,
    /// `Authorization` header value (`Bearer KEY`) for a daemon with API keys.
    authorization: Option<hyper::header::HeaderValue>,
}

impl WsTransport {
    /// `base_url` is `http://host:port`; the socket goes to `ws://host:port/v1/responses`; `api_key` is sent as a
    /// bearer token in the handshake.
    pub fn new(base_url: &str, api_key: Option<&str>) -> Result<Self> {
        let base: hyper::Uri =
            base_url.parse().map_err(|e| ReplayError::option("--url", format!("{base_url:?}: {e}")))?;
        let authority = base.authority().ok_or_else(|| ReplayError::option("--url", "needs host:port"))?;
        Ok(WsTransport { url: format!("ws://{authority}/v1/responses"), authorization: bearer(api_key)? })
    }
}

/// One lane's socket.
pub struct WsConnection {
    sink: tokio::sync::Mutex<Sink>,
    routes: Routes,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for WsConnection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Transport for WsTransport {
    type Conn = WsConnection;

    async fn connect(&self) -> Result<WsConnection> {
        let mut handshake = self
            .url
            .as_str()
            .into_client_request()
            .map_err(|e| ReplayError::Connection(format!("{}: {e}", self.url)))?;
        if let Some(auth) = &self.authorization {
            handshake.headers_mut().insert("authorization", auth.clone());
        }
        let (socket, _) = tokio_tungstenite::connect_async(handshake)
            .await
            .map_err(|e| ReplayError::Connection(format!("{}: {e}", self.url)))?;
        let (sink, mut stream) = socket.split();
        let routes: Routes = Arc::default();
        let reader_routes = routes.clone();
        let reader = tokio::spawn(async move {
            while let Some(msg) = stream.next().await {
                let Ok(WsMessage::Text(text)) = msg else {
                    if msg.is_err() {
                        break;
                    }
                    continue;
                };
                let Ok(event) = serde_json::from_str::<serde_json::Value>(text.as_str()) else { continue };
                let Some(id) = stream_id_of(&event) else { continue };
                if let Ok(routes) = reader_routes.lock() {
                    if let Some(tx) = routes.get(&id) {
                        // A turn that stopped waiting has dropped its receiver; nothing to do.
                        let _ = tx.send(event);
                    }
                }
            }
            // The socket closed: dropping the senders wakes every waiting turn with an error.
            if let Ok(mut routes) = reader_routes.lock() {
                routes.clear();
            }
        });
        Ok(WsConnection { sink: tokio::sync::Mutex::new(sink), routes, reader })
    }
}

fn stream_id_of(event: &serde_json::Value) -> Option<String> {
    event
        .get("stream_id")
        .or_else(|| event.get("response").and_then(|r| r.get("stream_id")))
        .and_then(|s| s.as_str())
        .map(str::to_owned)
}

/// The `response.create` event of one turn.
pub fn create_event(request: &TurnRequest) -> serde_json::Value {
    let input: Vec<serde_json::Value> = request
        .messages
        .iter()
        .map(|(role, text)| serde_json::json!({"type": "message", "role": role, "content": text}))
        .collect();
    let mut event = serde_json::json!({
        "type": "response.create",
        "model": request.model,
        "input": input,
        "max_output_tokens": request.max_tokens,
        "stream_id": request.stream_id,
        "ignore_eos": true,
    });
    if let Some(prev) = &request.previous_response_id {
        event["previous_response_id"] = serde_json::Value::String(prev.clone());
    }
    event
}

impl Connection for WsConnection {
    async fn send(&self, request: TurnRequest) -> Result<TurnOutcome> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        {
            let mut routes = self.routes.lock().map_err(|_| ReplayError::Connection("route table poisoned".into()))?;
            routes.insert(request.stream_id.clone(), tx);
        }
        let result = self.exchange(&request, &mut rx).await;
        if let Ok(mut routes) = self.routes.lock() {
            routes.remove(&request.stream_id);
        }
        result
    }
}

impl WsConnection {
    async fn exchange(
        &self,
        request: &TurnRequest,
        rx: &mut mpsc::UnboundedReceiver<serde_json::Value>,
    ) -> Result<TurnOutcome> {
        let text = create_event(request).to_string();
        self.sink.lock().await.send(WsMessage::text(text)).await.map_err(|e| ReplayError::Connection(e.to_string()))?;
        let mut outcome = TurnOutcome::default();
        loop {
            let event = rx.recv().await.ok_or_else(|| ReplayError::Connection("socket closed mid-response".into()))?;
            let now = Instant::now();
            match event.get("type").and_then(|t| t.as_str()).unwrap_or("") {
                "response.created" => {
                    outcome.response_id = response_id(&event);
                }
                "response.output_text.delta"
                    if event.get("delta").and_then(|d| d.as_str()).is_some_and(|d| !d.is_empty()) =>
                {
                    outcome.first_content.get_or_insert(now);
                    outcome.last_content = Some(now);
                    outcome.content_chunks += 1;
                }
                kind @ ("response.completed" | "response.incomplete") => {
                    let response = event.get("response").cloned().unwrap_or_default();
                    let reason = response.get("incomplete_details").and_then(|d| d.get("reason"));
                    if kind == "response.incomplete" && reason.and_then(|r| r.as_str()) != Some("max_output_tokens") {
                        let reason = reason.map_or_else(|| "none given".to_owned(), |r| r.to_string());
                        return Err(ReplayError::Protocol(format!("response incomplete: {reason}")));
                    }
                    outcome.response_id = response_id(&event).or(outcome.response_id);
                    let usage = response
                        .get("usage")
                        .filter(|u| !u.is_null())
                        .ok_or_else(|| ReplayError::Protocol(format!("{kind} without usage")))?;
                    let (prompt, completion, cached) = parse_usage(usage);
                    outcome.prompt_tokens = prompt;
                    outcome.completion_tokens = completion.unwrap_or(0);
                    outcome.cached_tokens = cached;
                    outcome.spec = parse_spec(&response).or_else(|| parse_spec(&event));
                    return Ok(outcome);
                }
                "error" => {
                    let body = event.get("error").map_or_else(|| event.to_string(), |e| e.to_string());
                    let status = error_status(&event);
                    return Err(ReplayError::Server { status, body });
                }
                _ => {}
            }
        }
    }
}

/// sparkd's `error` event names no HTTP status; its `code` tells a bad request (400, which is
/// how a context overflow is recognised) from a server fault (500).
fn error_status(event: &serde_json::Value) -> u16 {
    if let Some(status) = event.get("status").and_then(serde_json::Value::as_u64) {
        return status as u16;
    }
    let error = event.get("error").unwrap_or(event);
    let code = error.get("code").and_then(|c| c.as_str()).unwrap_or("");
    let kind = error.get("type").and_then(|c| c.as_str()).unwrap_or("");
    if kind == "invalid_request_error" || code == "context_length_exceeded" {
        400
    } else {
        500
    }
}

fn response_id(event: &serde_json::Value) -> Option<String> {
    event.get("response").and_then(|r| r.get("id")).and_then(|i| i.as_str()).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_events_map_to_a_status_that_keeps_context_overflows_recognisable() {
        let overflow = serde_json::json!({"type": "error", "code": "context_length_exceeded", "stream_id": "a",
            "error": {"type": "invalid_request_error", "code": "context_length_exceeded",
                      "message": "This model's maximum context length is 8 tokens"}});
        assert_eq!(error_status(&overflow), 400);
        assert_eq!(stream_id_of(&overflow).as_deref(), Some("a"));
        let engine =
            serde_json::json!({"type": "error", "error": {"type": "server_error", "code": "engine_unavailable"}});
        assert_eq!(error_status(&engine), 500);
        assert_eq!(stream_id_of(&engine), None);
    }
}
