//! The hyper 1 server: accept loop with graceful shutdown, routing, and the chat/completions handlers.
//!
//! Invariants:
//! - One port serves HTTP/1.1 (keep-alive, no idle timeout: AIPerf keeps pooled connections for 300 s), h2 with
//!   prior knowledge, and the WebSocket upgrade at `GET /v1/responses` (rust-stack.md §2.2, §2.3).
//! - Shutdown is a drain: the listener closes first; in-flight HTTP requests and WebSocket streams get the drain
//!   time (`--shutdown-timeout`) to finish; what still runs then is cancelled in the engine, so every stream still
//!   ends with its final chunk or event (`finish_reason: abort`, `response.incomplete`) and every WebSocket with a
//!   final event and a normal close ([`super::ws`]); [`DRAIN_GRACE`] later, connections still open are dropped.
//! - Connections are bounded in number, head time and idle time ([`super::conn`]); a request body that stalls is
//!   a 408.
//! - Every answer is counted in `sparkd:http_requests_total{endpoint,status}`; every error answer also in
//!   `sparkd:errors_total{kind}` and carries OpenAI's error JSON.
//! - Every route but `GET /health` passes `auth::Access::check` first (key and origin), and the Responses routes
//!   see the kept responses of the request's owner only.
//! - Every successful generation response carries the session-affinity header ([`super::affinity`]); a
//!   malformed one is refused with a 400 before the body is read.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use sparkd_kernels::TokenId;
use sparkd_tokenizer::RenderSpec;
use tokio::net::TcpListener;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use super::access::{AccessEntry, AccessStart};
use super::affinity::SessionKey;
use super::conn::{Activity, ConnLimits, InFlight, TrackedBody, WatchedIo};
use super::constraint;
use super::error::ApiError;
use super::generate::{Generation, GenerationOrder, Progress};
use super::openai::{self, Prompt, StreamOptions, ValidRequest};
use super::reply::ReplyForm;
use super::sse::{SseBody, SseWriter, QUEUED_HEARTBEAT};
use super::stop::StopStrings;
use super::wire::{self, Chunk, ChunkChoice, ChunkHeader, ChunkKind, FullReply, UsageJson};
use super::{info, new_id, responses, unix_now, ws, AppState};
use crate::metrics as m;

/// After the drain time, how long cancelled streams get to write their last events.
pub const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// The response body type of every route.
pub type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// The connection slot a request came in on (a request extension): a WebSocket holds it for the socket's life.
#[derive(Clone, Debug)]
pub struct ConnSlot(pub Arc<OwnedSemaphorePermit>);

/// Serves until `stop` turns true, then drains for at most `drain` (module invariants).
pub async fn serve(listener: TcpListener, state: Arc<AppState>, mut stop: watch::Receiver<bool>, drain: Duration) {
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let limits = state.conn_limits;
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        if slots.available_permits() == 0 {
            tracing::warn!(
                "{} connections are open (--max-connections): new ones wait until one closes",
                limits.max_connections
            );
        }
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => Arc::new(slot),
                Err(_) => break,
            },
            _ = stop.changed() => break,
        };
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // Token streaming: no Nagle delay.
                let _ = stream.set_nodelay(true);
                let activity = Activity::new();
                let svc = {
                    let (state, activity, slot) = (state.clone(), activity.clone(), slot.clone());
                    service_fn(move |mut req: Request<Incoming>| {
                        let (state, in_flight) = (state.clone(), InFlight::new(&activity));
                        let access = AccessEntry::new(AccessStart {
                            method: req.method().to_string(),
                            path: req.uri().path().to_owned(),
                            peer: Some(peer),
                        });
                        req.extensions_mut().insert(ConnSlot(slot.clone()));
                        req.extensions_mut().insert(access.clone());
                        async move {
                            let response = route(state, req).await?;
                            let guard = (in_flight, access);
                            Ok::<_, Infallible>(response.map(|body| TrackedBody::new(body, guard).boxed()))
                        }
                    })
                };
                let io = TokioIo::new(WatchedIo::new(stream, activity.clone()));
                let conn = graceful.watch(builder.serve_connection_with_upgrades(io, svc).into_owned());
                tokio::spawn(async move {
                    metrics::gauge!(m::HTTP_CONNECTIONS_OPEN).increment(1.0);
                    tokio::select! {
                        ended = conn => if let Err(e) = ended {
                            tracing::debug!("connection ended with an error: {e}");
                        },
                        why = activity.expired(&limits) => tracing::debug!("connection closed: {why}"),
                    }
                    metrics::gauge!(m::HTTP_CONNECTIONS_OPEN).decrement(1.0);
                    drop(slot);
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    tracing::info!("shutting down: no new connections; open requests may finish within {drain:?}");
    let drained = async {
        graceful.shutdown().await;
        state.sockets.all_closed().await;
    };
    tokio::pin!(drained);
    if tokio::time::timeout(drain, &mut drained).await.is_ok() {
        tracing::info!("drained: every request finished");
        return;
    }
    tracing::warn!("the drain time ran out: cancelling what still runs");
    if let Err(e) = state.engine.cancel_all().await {
        tracing::warn!("cancelling the requests still running failed: {e}");
    }
    if tokio::time::timeout(DRAIN_GRACE, &mut drained).await.is_err() {
        tracing::warn!("connections still open {DRAIN_GRACE:?} after the cancel are dropped");
    }
}

/// Dispatches one request.
pub async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let arrival = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    // `/v1/responses/{id}`: one non-empty path segment after the collection.
    let response_id = path.strip_prefix("/v1/responses/").filter(|id| !id.is_empty() && !id.contains('/'));
    // HEAD is answered as GET (hyper sends the head only).
    let method = if method == Method::HEAD { Method::GET } else { method };
    let log = req.extensions().get::<AccessEntry>().cloned();
    let answered = |endpoint: &'static str, response: Response<Body>| {
        if let Some(entry) = &log {
            entry.answered(endpoint, response.status().as_u16());
        }
        counted(endpoint, response)
    };
    if path == "/health" && method == Method::GET {
        return Ok(answered("health", json_response(StatusCode::OK, &json!({"status": "ok"}))));
    }
    let owner = match state.access.check(req.headers()) {
        Ok(owner) => owner,
        Err(e) => return Ok(answered("auth", error_response(&e))),
    };
    let (endpoint, result) = match (&method, path.as_str(), response_id) {
        (&Method::GET, "/metrics", _) => ("metrics", Ok(metrics_response(&state))),
        (&Method::GET, "/v1/models", _) => ("models", Ok(info::models(&state))),
        (&Method::GET, "/version", _) => ("version", Ok(info::version())),
        (&Method::POST, "/tokenize", _) => ("tokenize", info::tokenize(&state, req).await),
        (&Method::POST, "/detokenize", _) => ("detokenize", info::detokenize(&state, req).await),
        (&Method::GET, p, _) if p.starts_with("/v1/models/") => {
            ("model", info::model(&state, &p["/v1/models/".len()..]))
        }
        (&Method::POST, "/v1/chat/completions", _) => {
            ("chat_completions", chat_or_completion(&state, req, arrival, ChunkKind::Chat).await)
        }
        (&Method::POST, "/v1/completions", _) => {
            ("completions", chat_or_completion(&state, req, arrival, ChunkKind::Completion).await)
        }
        (&Method::POST, "/v1/responses", _) => ("responses", responses::http(&state, req, arrival, owner).await),
        (&Method::GET, "/v1/responses", _) => ("responses_ws", ws::upgrade(&state, req, owner)),
        (&Method::GET, _, Some(id)) => ("responses_get", responses::retrieve(&state, id, &owner).await),
        (&Method::DELETE, _, Some(id)) => ("responses_delete", responses::delete(&state, id, &owner).await),
        _ => ("other", Err(ApiError::NotFound { method: method.to_string(), path: path.clone() })),
    };
    Ok(answered(endpoint, result.unwrap_or_else(|e| error_response(&e))))
}

/// `response`, counted in `sparkd:http_requests_total{endpoint, status}`.
fn counted(endpoint: &'static str, response: Response<Body>) -> Response<Body> {
    metrics::counter!(m::HTTP_REQUESTS_TOTAL, "endpoint" => endpoint, "status" => response.status().as_str().to_owned())
        .increment(1);
    response
}

/// OpenAI error JSON with the error's status; counted in `sparkd:errors_total`.
pub fn error_response(e: &ApiError) -> Response<Body> {
    e.count();
    tracing::debug!(kind = e.kind(), "request failed: {e}");
    let mut response = bytes_response(e.status(), "application/json", Bytes::from(e.to_json()));
    if matches!(e, ApiError::QueueFull { .. }) {
        response.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static(QUEUE_FULL_RETRY_AFTER_S));
    }
    response
}

/// Seconds a client refused with 429 (`--max-waiting`) is told to wait: the shortest whole-second delay, since a
/// slot frees as soon as any waiting request starts.
const QUEUE_FULL_RETRY_AFTER_S: &str = "1";

/// A body of `content_type` as it is.
pub fn bytes_response(status: StatusCode, content_type: &'static str, body: Bytes) -> Response<Body> {
    let mut r = Response::new(Full::new(body).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// A JSON body.
pub fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    bytes_response(status, "application/json", Bytes::from(value.to_string()))
}

/// An SSE response around a channel body.
pub fn sse_response(body: SseBody) -> Response<Body> {
    let mut r = Response::new(body.boxed());
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}

fn metrics_response(state: &AppState) -> Response<Body> {
    bytes_response(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", Bytes::from(state.metrics.render()))
}

/// Reads the whole body, at most `--max-body-bytes` (parsing it is the preparation pool's work). A body that
/// stalls for `--header-timeout`, or takes longer than `--idle-timeout` in all, is a 408.
pub async fn read_body(state: &AppState, req: Request<Incoming>) -> Result<Bytes, ApiError> {
    let limit = state.max_body_bytes;
    let ConnLimits { header_timeout, idle_timeout, .. } = state.conn_limits;
    let mut body = Limited::new(req.into_body(), limit);
    let mut collected = Vec::new();
    let deadline = tokio::time::Instant::now() + idle_timeout;
    loop {
        let next = tokio::time::timeout_at(deadline.min(tokio::time::Instant::now() + header_timeout), body.frame());
        let frame = match next.await {
            Err(_) => {
                return Err(ApiError::RequestTimeout(format!(
                    "the request body stalled for {header_timeout:?} (--header-timeout) or took longer than \
                     {idle_timeout:?} (--idle-timeout)"
                )))
            }
            Ok(None) => break,
            Ok(Some(frame)) => frame.map_err(|e| {
                if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                    ApiError::BodyTooLarge { limit }
                } else {
                    ApiError::InvalidJson(format!("reading the body failed: {e}"))
                }
            })?,
        };
        if let Ok(data) = frame.into_data() {
            collected.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(collected))
}

/// The prompt's token ids; token-id prompts are checked against the vocabulary.
pub fn prompt_tokens(state: &AppState, prompt: &Prompt) -> Result<Vec<TokenId>, ApiError> {
    match prompt {
        Prompt::Chat { messages, tools, thinking } => Ok(state.template.render_spec(&RenderSpec {
            tools: tools.as_deref(),
            thinking: *thinking,
            ..RenderSpec::new(messages)
        })?),
        Prompt::Text(text) => Ok(state.tokenizer().encode(text)),
        Prompt::Tokens(ids) => {
            check_known_ids(state, ids, "prompt")?;
            Ok(ids.clone())
        }
    }
}

/// Refuses token ids outside the vocabulary, naming the first (`field[i]`).
pub fn check_known_ids(state: &AppState, ids: &[TokenId], field: &str) -> Result<(), ApiError> {
    let vocab = state.tokenizer().vocab_size();
    match ids.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(ApiError::field(
            format!("{field}[{i}]"),
            format!("`{field}[{i}]` = {} is outside the vocabulary (size {vocab})", ids[i]),
        )),
        None => Ok(()),
    }
}

/// A chat or completion request made ready to submit.
struct Prepared {
    valid: ValidRequest,
    order: GenerationOrder,
    /// The prompt's text, for `echo`.
    echo: Option<String>,
    /// The affinity key the response carries: the client's, or one derived from the conversation's root.
    session: SessionKey,
}

/// Parses, validates, renders and tokenizes a chat or completion body, and builds its stop-string matcher and
/// output constraint: the preparation pool's work.
fn prepare(
    state: &AppState,
    body: &[u8],
    kind: ChunkKind,
    arrival: Instant,
    given: Option<SessionKey>,
) -> Result<Prepared, ApiError> {
    let body = openai::parse_body(body)?;
    let valid = match kind {
        ChunkKind::Chat => openai::chat_request(&body, &state.limits)?,
        ChunkKind::Completion => openai::completion_request(&body, &state.limits)?,
    };
    info::check_model(state, valid.model.as_deref())?;
    let prompt = prompt_tokens(state, &valid.prompt)?;
    let max_tokens = openai::check_context(prompt.len(), valid.params.max_tokens, state.max_model_len)?;
    let echo = match (&valid.prompt, valid.echo) {
        (Prompt::Text(t), true) => Some(t.clone()),
        (Prompt::Tokens(ids), true) => Some(state.tokenizer().decode_lossy(ids)?),
        _ => None,
    };
    let constraint = constraint::compile_request(state, &valid.constraint)?;
    let session = given.unwrap_or_else(|| match &valid.prompt {
        Prompt::Chat { messages, .. } => SessionKey::of_chat(messages),
        Prompt::Text(_) | Prompt::Tokens(_) => SessionKey::of_prompt(&prompt),
    });
    let reply = match kind {
        ChunkKind::Chat => {
            let thinking = matches!(valid.prompt, Prompt::Chat { thinking: true, .. });
            ReplyForm::chat(valid.tools.as_ref(), thinking)
        }
        ChunkKind::Completion => ReplyForm::Text,
    };
    let order = GenerationOrder {
        prompt,
        continue_from: None,
        keep_as: None,
        stop: StopStrings::new(valid.params.stop.clone()),
        params: valid.params.clone(),
        max_tokens,
        arrival,
        reply,
        constraint,
    };
    Ok(Prepared { valid, order, echo, session })
}

async fn chat_or_completion(
    state: &Arc<AppState>,
    req: Request<Incoming>,
    arrival: Instant,
    kind: ChunkKind,
) -> Result<Response<Body>, ApiError> {
    let given = SessionKey::from_headers(req.headers())?;
    let access = req.extensions().get::<AccessEntry>().cloned();
    let body = read_body(state, req).await?;
    let st = state.clone();
    let Prepared { valid, order, echo, session } =
        state.prep.run(move || prepare(&st, &body, kind, arrival, given)).await?;
    let mut generation = Generation::start(state, order).await?;
    let id = new_id(if kind == ChunkKind::Chat { "chatcmpl-" } else { "cmpl-" });
    generation.log_to(access, &id);
    let mut response = if valid.stream.stream {
        let (writer, body) = SseWriter::new();
        let st = state.clone();
        tokio::spawn(async move { stream_chunks(st, generation, kind, id, valid, writer).await });
        sse_response(body)
    } else {
        collect_body(state, generation, kind, id, valid, echo).await?
    };
    session.stamp(&mut response);
    Ok(response)
}

/// Runs a generation to its end and answers with one JSON body (assembled, with its log-probabilities, on the
/// preparation pool: a long reply's alternatives are many detokenizations).
async fn collect_body(
    state: &Arc<AppState>,
    mut generation: Generation,
    kind: ChunkKind,
    id: String,
    valid: ValidRequest,
    echo: Option<String>,
) -> Result<Response<Body>, ApiError> {
    let mut reply = FullReply { text: echo.unwrap_or_default(), ..FullReply::default() };
    let echo_len = reply.text.len();
    let mut logprobs = Vec::new();
    let outcome = loop {
        match generation.next().await? {
            Progress::Delta(d) => {
                reply.push(&d.text, &d.reasoning, &d.tool_calls);
                logprobs.extend(d.logprobs);
            }
            Progress::Done(o) => break o,
        }
    };
    let st = state.clone();
    let body = state
        .prep
        .run(move || {
            let lp = valid.params.logprobs.map(|_| match kind {
                ChunkKind::Chat => wire::chat_logprobs(st.tokenizer(), &logprobs),
                ChunkKind::Completion => wire::completion_logprobs(st.tokenizer(), &logprobs, echo_len),
            });
            let header = ChunkHeader { id: &id, created: unix_now(), model: &st.model_name };
            Ok(Bytes::from(wire::full_body(kind, header, &reply, lp, &outcome).to_string()))
        })
        .await?;
    Ok(bytes_response(StatusCode::OK, "application/json", body))
}

/// Streams a generation as chat/completion chunks; returns when done or when the client leaves (dropping the
/// generation, which cancels it).
async fn stream_chunks(
    state: Arc<AppState>,
    mut generation: Generation,
    kind: ChunkKind,
    id: String,
    valid: ValidRequest,
    mut w: SseWriter,
) {
    let header = ChunkHeader { id: &id, created: unix_now(), model: &state.model_name };
    let StreamOptions { include_usage, continuous_usage, .. } = valid.stream;
    let want_logprobs = valid.params.logprobs.is_some();
    let mut text_len = 0usize;
    if kind == ChunkKind::Chat {
        let first = Chunk {
            header,
            choice: Some(ChunkChoice {
                role: Some("assistant"),
                text: "",
                reasoning: "",
                tool_calls: &[],
                logprobs: None,
                finish_reason: None,
            }),
            usage: None,
            timings: None,
            spec: None,
        };
        if w.data_with(|out| wire::write_chunk(out, kind, first)).await.is_err() {
            return;
        }
    }
    loop {
        let Some(progress) = generation.next_or_queued(QUEUED_HEARTBEAT).await else {
            if w.queued().await.is_err() {
                return;
            }
            continue;
        };
        let progress = match progress {
            Ok(p) => p,
            Err(e) => {
                e.count();
                let _ = w.data(&json!({"error": e.body()})).await;
                let _ = w.done().await;
                return;
            }
        };
        match progress {
            Progress::Delta(d) => {
                let nothing = d.text.is_empty() && d.reasoning.is_empty() && d.tool_calls.is_empty();
                if nothing && (!want_logprobs || d.logprobs.is_empty()) {
                    continue;
                }
                let logprobs = want_logprobs.then(|| match kind {
                    ChunkKind::Chat => wire::chat_logprobs(state.tokenizer(), &d.logprobs),
                    ChunkKind::Completion => wire::completion_logprobs(state.tokenizer(), &d.logprobs, text_len),
                });
                text_len += d.text.len();
                let chunk = Chunk {
                    header,
                    choice: Some(ChunkChoice {
                        role: None,
                        text: &d.text,
                        reasoning: &d.reasoning,
                        tool_calls: &d.tool_calls,
                        logprobs,
                        finish_reason: None,
                    }),
                    usage: continuous_usage.then(|| {
                        UsageJson::new(generation.prompt_tokens(), d.completion_tokens, generation.cached_tokens())
                    }),
                    timings: None,
                    spec: None,
                };
                if w.data_with(|out| wire::write_chunk(out, kind, chunk)).await.is_err() {
                    return;
                }
            }
            Progress::Done(o) => {
                let last = Chunk {
                    header,
                    choice: Some(ChunkChoice {
                        role: None,
                        text: "",
                        reasoning: "",
                        tool_calls: &[],
                        logprobs: None,
                        finish_reason: Some(o.finish_reason),
                    }),
                    usage: continuous_usage.then(|| UsageJson::from_usage(&o.usage)),
                    timings: (!include_usage).then_some(&o.timings),
                    spec: if include_usage { None } else { o.spec.as_ref() },
                };
                if w.data_with(|out| wire::write_chunk(out, kind, last)).await.is_err() {
                    return;
                }
                if include_usage {
                    let usage_chunk = Chunk {
                        header,
                        choice: None,
                        usage: Some(UsageJson::from_usage(&o.usage)),
                        timings: Some(&o.timings),
                        spec: o.spec.as_ref(),
                    };
                    if w.data_with(|out| wire::write_chunk(out, kind, usage_chunk)).await.is_err() {
                        return;
                    }
                }
                let _ = w.done().await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_is_a_429_with_retry_after_and_other_errors_have_none() {
        let full = error_response(&ApiError::QueueFull { max_waiting: 8 });
        assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(full.headers().get(RETRY_AFTER).and_then(|v| v.to_str().ok()), Some(QUEUE_FULL_RETRY_AFTER_S));
        let invalid = error_response(&ApiError::field("n", "`n` must be 1"));
        assert!(invalid.headers().get(RETRY_AFTER).is_none());
    }
}
