//! `POST /v1/chat/completions` with SSE streaming, the way AIPerf sends it (agentx.md §3.1).
//!
//! Invariants:
//! - Every request carries the full message history, `stream: true`, `max_completion_tokens`,
//!   `ignore_eos: true` and `stream_options.include_usage`; `X-Correlation-ID` and
//!   `X-Session-Affinity` hold the chain play's id, constant across its turns.
//! - A non-2xx status is a [`ReplayError::Server`] carrying the body, so context overflows are
//!   recognised; a stream that ends without `usage` is a protocol error.

use tokio::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

use super::{bearer, http_authority, parse_spec, parse_usage, Connection, Transport, TurnOutcome, TurnRequest};
use crate::error::{ReplayError, Result};

/// The chat transport: one pooled HTTP/1.1 client shared by every lane.
#[derive(Clone)]
pub struct ChatTransport {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: hyper::Uri,
    /// `Authorization` header value (`Bearer KEY`) for a daemon with API keys.
    authorization: Option<hyper::header::HeaderValue>,
}

impl ChatTransport {
    /// `base_url` is `http://host:port` (a trailing path is ignored); `api_key` is sent as a bearer token.
    pub fn new(base_url: &str, api_key: Option<&str>) -> Result<Self> {
        let authority = http_authority(base_url)?;
        let uri = format!("http://{authority}/v1/chat/completions")
            .parse()
            .map_err(|e| ReplayError::option("--url", format!("{e}")))?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).pool_idle_timeout(None).build(connector);
        Ok(ChatTransport { client, uri, authorization: bearer(api_key)? })
    }
}

impl Transport for ChatTransport {
    type Conn = ChatTransport;
    async fn connect(&self) -> Result<ChatTransport> {
        Ok(self.clone())
    }
}

/// The JSON body of one turn.
pub fn request_body(request: &TurnRequest) -> serde_json::Value {
    let messages: Vec<serde_json::Value> =
        request.messages.iter().map(|(role, text)| serde_json::json!({"role": role, "content": text})).collect();
    serde_json::json!({
        "model": request.model,
        "messages": messages,
        "stream": true,
        "max_completion_tokens": request.max_tokens,
        "ignore_eos": true,
        "stream_options": {"include_usage": true},
    })
}

impl Connection for ChatTransport {
    async fn send(&self, request: TurnRequest) -> Result<TurnOutcome> {
        let body = serde_json::to_vec(&request_body(&request)).map_err(|e| ReplayError::Protocol(e.to_string()))?;
        let mut req = hyper::Request::post(self.uri.clone())
            .header("content-type", "application/json")
            .header("accept", "text/event-stream")
            .header("x-correlation-id", &request.stream_id)
            .header("x-session-affinity", &request.stream_id);
        if let Some(auth) = &self.authorization {
            req = req.header("authorization", auth);
        }
        let req = req.body(Full::new(Bytes::from(body))).map_err(|e| ReplayError::Protocol(e.to_string()))?;
        let response = self.client.request(req).await.map_err(|e| ReplayError::Connection(e.to_string()))?;
        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            let bytes = body.collect().await.map_err(|e| ReplayError::Connection(e.to_string()))?.to_bytes();
            return Err(ReplayError::Server {
                status: status.as_u16(),
                body: String::from_utf8_lossy(&bytes).into_owned(),
            });
        }
        let mut parser = SseParser::default();
        let mut outcome = TurnOutcome::default();
        let mut saw_usage = false;
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ReplayError::Connection(e.to_string()))?;
            let Ok(data) = frame.into_data() else { continue };
            let now = Instant::now();
            for event in parser.push(&data) {
                if event == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(&event)
                    .map_err(|e| ReplayError::Protocol(format!("SSE data is not JSON ({e}): {event:.200}")))?;
                if let Some(err) = v.get("error") {
                    return Err(ReplayError::Server { status: status.as_u16(), body: err.to_string() });
                }
                if outcome.response_id.is_none() {
                    outcome.response_id = v.get("id").and_then(|i| i.as_str()).map(str::to_owned);
                }
                let content = v
                    .get("choices")
                    .and_then(|c| c.get(0))
                    .and_then(|c| c.get("delta"))
                    .and_then(|d| d.get("content").or_else(|| d.get("reasoning_content")))
                    .and_then(|c| c.as_str())
                    .unwrap_or("");
                if !content.is_empty() {
                    outcome.first_content.get_or_insert(now);
                    outcome.last_content = Some(now);
                    outcome.content_chunks += 1;
                }
                if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
                    let (prompt, completion, cached) = parse_usage(usage);
                    outcome.prompt_tokens = prompt;
                    outcome.completion_tokens = completion.unwrap_or(0);
                    outcome.cached_tokens = cached;
                    saw_usage = true;
                }
                if let Some(spec) = parse_spec(&v) {
                    outcome.spec = Some(spec);
                }
            }
        }
        if !saw_usage {
            return Err(ReplayError::Protocol("stream ended without a usage chunk".into()));
        }
        if !done {
            return Err(ReplayError::Protocol("stream ended without `data: [DONE]`".into()));
        }
        Ok(outcome)
    }
}

/// Splits an SSE byte stream into the `data:` payloads of its events.
#[derive(Default)]
pub struct SseParser {
    buffer: Vec<u8>,
}

impl SseParser {
    /// Adds bytes; returns the data of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buffer.extend_from_slice(bytes);
        let mut events = Vec::new();
        loop {
            let end = find_event_end(&self.buffer);
            let Some((end, sep)) = end else { break };
            let raw: Vec<u8> = self.buffer.drain(..end + sep).take(end).collect();
            let text = String::from_utf8_lossy(&raw);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_parser_joins_split_events() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DONE]\n\n"), vec!["{\"a\":1}".to_string(), "[DONE]".to_string()]);
        assert_eq!(p.push(b": comment\r\n\r\n"), Vec::<String>::new());
    }
}
