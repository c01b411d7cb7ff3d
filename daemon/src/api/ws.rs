//! The Responses API in WebSocket mode at `GET /v1/responses` (upgraded on the HTTP port).
//!
//! Client events: `response.create` (the Responses request, at the top level or under `response`, plus an
//! optional `stream_id`), `response.cancel` (`response_id` or `stream_id`). Server events: those of
//! [`super::responses::stream`], each tagged with the `stream_id` of its stream, and `error`.
//!
//! Invariants:
//! - One socket carries up to `--max-ws-streams` concurrent streams (past it a `response.create` gets a
//!   `too_many_streams` error event); each runs in its own task and writes through one bounded
//!   outgoing queue, so a slow socket slows only its own streams.
//! - When the client closes the socket every stream task on it is aborted, which drops its generation and
//!   cancels it in the engine.
//! - When the server drains, a socket refuses new `response.create` events (`server_shutting_down`) and lets its
//!   streams finish (the server cancels those still running when the drain time runs out, so each still gets its
//!   terminal event); then it sends a final `error` event (`server_shutting_down`) and closes with code 1000.
//!   [`Sockets`] counts open sockets so that the drain waits for them.
//! - A socket with no stream and no client message for `--idle-timeout` gets an `error` event
//!   (`request_timeout`) and a normal close. A socket keeps its connection's `--max-connections` slot.
//! - A bad client event gets an `error` event; the socket stays open. A message larger than `--max-body-bytes`
//!   gets an `error` event and closes the socket (code 1009): it was not read whole.
//! - Events are parsed and validated on the preparation pool, never on the socket's I/O task.
//! - The upgrade answers the session-affinity header ([`super::affinity`]): the client's, or a fresh key for the
//!   socket. Responses created on the socket take the client's key when it sent one, else their chain's root.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use dashmap::DashMap;
use futures_util::{SinkExt, StreamExt};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONNECTION, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_VERSION, UPGRADE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use super::access::{AccessEntry, AccessStart};
use super::affinity::SessionKey;
use super::auth::Owner;
use super::error::ApiError;
use super::http::{Body, ConnSlot};
use super::limits::RequestLimits;
use super::openai::ValidResponsesRequest;
use super::responses::{self, EventSink};
use super::sse::Disconnected;
use super::AppState;
use super::{items, openai};
use crate::engine::types::RequestId;
use crate::metrics as m;

/// Outgoing messages queued per socket.
pub const WS_OUTGOING: usize = 256;

/// Answers the upgrade request with 101 and serves the socket in a task.
pub fn upgrade(state: &Arc<AppState>, mut req: Request<Incoming>, owner: Owner) -> Result<Response<Body>, ApiError> {
    let headers = req.headers();
    let is_upgrade =
        headers.get(UPGRADE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if !is_upgrade {
        return Err(ApiError::field("upgrade", "GET /v1/responses needs `Upgrade: websocket` (use POST for HTTP)"));
    }
    if headers.get(SEC_WEBSOCKET_VERSION).and_then(|v| v.to_str().ok()) != Some("13") {
        return Err(ApiError::field("sec-websocket-version", "only WebSocket version 13 is supported"));
    }
    let key = headers
        .get(SEC_WEBSOCKET_KEY)
        .ok_or_else(|| ApiError::field("sec-websocket-key", "the `Sec-WebSocket-Key` header is required"))?;
    let accept = derive_accept_key(key.as_bytes());
    let given = SessionKey::from_headers(headers)?;
    let answered = given.clone().unwrap_or_else(|| SessionKey::fresh("ws-"));
    let on_upgrade = hyper::upgrade::on(&mut req);
    // The socket keeps its connection's slot (`--max-connections`) until it closes.
    let slot = req.extensions().get::<ConnSlot>().cloned();
    let peer = req.extensions().get::<AccessEntry>().and_then(AccessEntry::peer);
    let st = state.clone();
    tokio::spawn(async move {
        let _slot = slot;
        match on_upgrade.await {
            Ok(upgraded) => {
                // A message is held whole before it is parsed: no larger than an HTTP body may be.
                let config = WebSocketConfig::default()
                    .max_message_size(Some(st.max_body_bytes))
                    .max_frame_size(Some(st.max_body_bytes));
                let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, Some(config)).await;
                serve_socket(st, ws, SocketWho { owner, peer, session: given }).await;
            }
            Err(e) => tracing::debug!("websocket upgrade failed: {e}"),
        }
    });
    let mut r = Response::new(http_body_util::BodyExt::boxed(http_body_util::Empty::new()));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(SEC_WEBSOCKET_ACCEPT, HeaderValue::from_str(&accept).map_err(|e| ApiError::Internal(e.to_string()))?);
    answered.stamp(&mut r);
    Ok(r)
}

/// The WebSockets open on the server (a drain waits until none is).
#[derive(Debug, Default)]
pub struct Sockets {
    open: AtomicUsize,
    changed: Notify,
}

/// One open socket, counted until dropped.
pub struct OpenSocket(Arc<Sockets>);

impl Drop for OpenSocket {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

impl Sockets {
    fn enter(self: &Arc<Self>) -> OpenSocket {
        self.open.fetch_add(1, Ordering::SeqCst);
        OpenSocket(self.clone())
    }

    /// Returns once no socket is open.
    pub async fn all_closed(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.open.load(Ordering::SeqCst) == 0 {
                return;
            }
            changed.await;
        }
    }
}

/// Sends a stream's events to the socket's outgoing queue, tagged with its `stream_id`. The stream counts
/// against `--max-ws-streams` until its terminal event is queued (so a client that saw it end may start another
/// at once) or the sink is dropped.
struct WsSink {
    out: mpsc::Sender<Message>,
    stream_id: Option<String>,
    /// The socket's streams in progress; this one is counted while `counted`.
    open: Arc<AtomicUsize>,
    counted: bool,
}

impl WsSink {
    fn uncount(&mut self) {
        if std::mem::take(&mut self.counted) {
            self.open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for WsSink {
    fn drop(&mut self) {
        self.uncount();
    }
}

impl EventSink for WsSink {
    async fn send(&mut self, mut event: Value) -> Result<(), Disconnected> {
        if let Some(id) = &self.stream_id {
            event["stream_id"] = json!(id);
        }
        let terminal = matches!(
            event["type"].as_str(),
            Some("response.completed" | "response.incomplete" | "response.failed" | "error")
        );
        if terminal {
            self.uncount();
        }
        self.out.send(Message::Text(event.to_string().into())).await.map_err(|_| Disconnected)
    }

    async fn queued(&mut self) -> Result<(), Disconnected> {
        Ok(())
    }
}

/// Requests in flight on one socket, by response id and by stream id (for `response.cancel`).
type Active = Arc<DashMap<String, RequestId>>;

/// What every event of one socket is handled with.
struct Socket {
    state: Arc<AppState>,
    out: mpsc::Sender<Message>,
    /// Responses in progress on this socket, by response id and by stream id.
    active: Active,
    /// The key the socket was opened with: whose kept responses it sees.
    owner: Owner,
    /// Streams in progress (counted until their terminal event is queued), for `--max-ws-streams`.
    open: Arc<AtomicUsize>,
    /// The client's address, for the access log.
    peer: Option<SocketAddr>,
    /// The affinity key the client opened the socket with, if any.
    session: Option<SessionKey>,
}

/// Who opened a socket: the key's owner, the peer address and the affinity key sent with the upgrade.
struct SocketWho {
    owner: Owner,
    peer: Option<SocketAddr>,
    session: Option<SessionKey>,
}

async fn serve_socket<S>(state: Arc<AppState>, ws: WebSocketStream<S>, who: SocketWho)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    metrics::gauge!(m::WEBSOCKETS_OPEN).increment(1.0);
    let socket_count = state.sockets.clone();
    let (mut sink, mut incoming) = ws.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(WS_OUTGOING);
    let writer = tokio::spawn(async move {
        while let Some(msg) = out_rx.recv().await {
            let closing = matches!(msg, Message::Close(_));
            if sink.send(msg).await.is_err() || closing {
                break;
            }
        }
        let _ = sink.close().await;
    });
    let _open = socket_count.enter();
    let SocketWho { owner, peer, session } = who;
    let socket =
        Socket { state, out: out_tx, active: Arc::new(DashMap::new()), owner, open: Arc::default(), peer, session };
    let mut streams = JoinSet::new();
    let mut shutdown = socket.state.shutdown.clone();
    let mut draining = *shutdown.borrow();
    // Idle: no client message and no stream for `--idle-timeout`.
    let idle = socket.state.conn_limits.idle_timeout;
    let mut last_heard = tokio::time::Instant::now();
    loop {
        if draining && streams.is_empty() {
            send_error(&socket.out, None, &ApiError::ShuttingDown).await;
            let close = CloseFrame { code: CloseCode::Normal, reason: "server shutting down".into() };
            let _ = socket.out.send(Message::Close(Some(close))).await;
            break;
        }
        tokio::select! {
            msg = incoming.next() => match msg.inspect(|_| last_heard = tokio::time::Instant::now()) {
                Some(Ok(Message::Text(text))) => handle_event(&socket, &mut streams, text.into(), draining).await,
                Some(Ok(Message::Binary(bytes))) => handle_event(&socket, &mut streams, bytes, draining).await,
                Some(Ok(Message::Ping(payload))) => {
                    let _ = socket.out.send(Message::Pong(payload)).await;
                }
                Some(Err(WsError::Capacity(e))) => {
                    tracing::debug!("websocket message refused: {e}");
                    let e = ApiError::BodyTooLarge { limit: socket.state.max_body_bytes };
                    send_error(&socket.out, None, &e).await;
                    let close = CloseFrame { code: CloseCode::Size, reason: "message too big".into() };
                    let _ = socket.out.send(Message::Close(Some(close))).await;
                    break;
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
            Some(_) = streams.join_next(), if !streams.is_empty() => last_heard = tokio::time::Instant::now(),
            _ = shutdown.changed(), if !draining => draining = true,
            _ = tokio::time::sleep_until(last_heard + idle), if streams.is_empty() => {
                let e = ApiError::RequestTimeout(format!("the socket was idle for {idle:?} (--idle-timeout)"));
                send_error(&socket.out, None, &e).await;
                let close = CloseFrame { code: CloseCode::Normal, reason: "idle".into() };
                let _ = socket.out.send(Message::Close(Some(close))).await;
                break;
            }
        }
    }
    // Aborting the stream tasks drops their generations, which cancels them in the engine.
    streams.abort_all();
    drop(socket);
    let _ = writer.await;
    metrics::gauge!(m::WEBSOCKETS_OPEN).decrement(1.0);
}

async fn send_error(out: &mpsc::Sender<Message>, stream_id: Option<&str>, e: &ApiError) {
    e.count();
    let mut event = responses::error_event(e);
    if let Some(id) = stream_id {
        event["stream_id"] = json!(id);
    }
    let _ = out.send(Message::Text(event.to_string().into())).await;
}

/// One client event, parsed and validated.
#[derive(Debug)]
pub enum ClientEvent {
    /// `response.create`.
    Create(Arc<ValidResponsesRequest>),
    /// `response.cancel` of this response id or stream id.
    Cancel(String),
}

/// A client event and the `stream_id` it carried (which tags the errors answering it).
#[derive(Debug)]
pub struct ParsedEvent {
    pub stream_id: Option<String>,
    pub event: Result<ClientEvent, ApiError>,
}

/// Parses one client event. Bytes that are not a JSON object are an error of their own (no stream to tag it
/// with); an event that is JSON but not valid is a [`ParsedEvent`] with its error.
pub fn parse_event(body: &[u8], limits: &RequestLimits) -> Result<ParsedEvent, ApiError> {
    if std::str::from_utf8(body).is_err() {
        return Err(ApiError::InvalidJson("the message is not UTF-8".into()));
    }
    let value = openai::parse_body(body)?;
    let stream_id = match &value["stream_id"] {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    let event = match value["type"].as_str() {
        Some("response.create") => items::responses_request(&value, limits).map(|v| ClientEvent::Create(Arc::new(v))),
        Some("response.cancel") => value["response_id"]
            .as_str()
            .map(str::to_owned)
            .or(stream_id.clone())
            .map(ClientEvent::Cancel)
            .ok_or_else(|| ApiError::field("response_id", "`response.cancel` needs `response_id` or `stream_id`")),
        other => Err(ApiError::field(
            "type",
            format!(
                "unknown client event type {:?} (expected response.create or response.cancel)",
                other.unwrap_or("")
            ),
        )),
    };
    Ok(ParsedEvent { stream_id, event })
}

/// Handles one client event; while the server drains, a `response.create` is refused.
async fn handle_event(socket: &Socket, streams: &mut JoinSet<()>, body: Bytes, draining: bool) {
    let Socket { state, out, active, owner, open, peer, session } = socket;
    let arrival = Instant::now();
    // Every event but a cancel is a request of its own in the access log.
    let log = || AccessEntry::new(AccessStart { method: "WS".into(), path: "/v1/responses".into(), peer: *peer });
    let refuse = |stream_id: Option<String>, e: ApiError| {
        log().answered(WS_ENDPOINT, e.status().as_u16());
        async move { send_error(out, stream_id.as_deref(), &e).await }
    };
    let st = state.clone();
    let ParsedEvent { stream_id, event } = match state.prep.run(move || parse_event(&body, &st.limits)).await {
        Ok(parsed) => parsed,
        Err(e) => return refuse(None, e).await,
    };
    match event {
        Ok(ClientEvent::Create(_)) if draining => refuse(stream_id, ApiError::ShuttingDown).await,
        Ok(ClientEvent::Create(_)) if open.load(Ordering::SeqCst) >= state.conn_limits.max_ws_streams => {
            refuse(stream_id, ApiError::TooManyStreams { limit: state.conn_limits.max_ws_streams }).await
        }
        Ok(ClientEvent::Create(valid)) => {
            let (mut generation, header) =
                match responses::start(state, &valid, arrival, owner.clone(), session.clone()).await {
                    Ok(started) => started,
                    Err(e) => return refuse(stream_id, e).await,
                };
            let entry = log();
            entry.answered(WS_ENDPOINT, StatusCode::OK.as_u16());
            generation.log_to(Some(entry), &header.id);
            let request = generation.id();
            active.insert(header.id.clone(), request);
            if let Some(sid) = &valid.stream_id {
                active.insert(sid.clone(), request);
            }
            open.fetch_add(1, Ordering::SeqCst);
            let mut sink =
                WsSink { out: out.clone(), stream_id: valid.stream_id.clone(), open: open.clone(), counted: true };
            let st = state.clone();
            let act = active.clone();
            let want_logprobs = valid.params.logprobs.is_some();
            streams.spawn(async move {
                let response_id = header.id.clone();
                let _ = responses::stream(&st, generation, header, want_logprobs, &mut sink).await;
                act.remove(&response_id);
                if let Some(sid) = &sink.stream_id {
                    act.remove_if(sid, |_, r| *r == request);
                }
            });
        }
        Ok(ClientEvent::Cancel(key)) => match active.get(&key).map(|r| *r) {
            Some(id) => {
                if let Err(e) = state.engine.cancel(id).await {
                    send_error(out, stream_id.as_deref(), &e.into()).await;
                }
            }
            None => {
                let e = ApiError::field("response_id", format!("no response `{key}` is in progress on this socket"));
                send_error(out, stream_id.as_deref(), &e).await;
            }
        },
        Err(e) => refuse(stream_id, e).await,
    }
}

/// The endpoint name of a WebSocket event in the access log.
const WS_ENDPOINT: &str = "responses_ws_event";
