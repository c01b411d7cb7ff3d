//! The Responses API, shared by `POST /v1/responses` (JSON or SSE) and the WebSocket mode ([`super::ws`]), and
//! `GET` / `DELETE /v1/responses/{id}`.
//!
//! Invariants:
//! - A request with `previous_response_id` sends the engine only the new input's tokens (rendered by
//!   [`ChatTemplate::render_continuation`](sparkd_tokenizer::ChatTemplate::render_continuation)) with
//!   `continue_from`; the engine restores (or forks) the kept state, so only the suffix is prefilled.
//! - With `store` (the default), the engine keeps the final state under the response's id, and once the response
//!   ends the API attaches the final response object to it and waits until the turn is committed (written to the
//!   session journal, with `--session-dir`) before the client sees the end; the object is what `GET` returns. The engine's store is the only record: a response is visible (to `GET` and as a
//!   `previous_response_id`) from then until it is deleted or evicted by the kept-responses budget.
//! - Reading a kept response (a continuation, `GET`) reads the store's view and does not wait on the engine
//!   thread, except when the response is kept but its object not attached yet: then the attachment may still be
//!   queued (a client can ask again before the engine takes it), so the read waits until the engine has taken
//!   every command sent before it, and reads again. `DELETE` goes through the engine (it changes the store).
//! - An unknown, evicted or deleted `previous_response_id` is a 400 naming the field; `GET` or `DELETE` of one is
//!   a 404. `store: false` responses are never kept.
//! - Event order of one stream: `response.created`, `response.output_item.added`,
//!   `response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
//!   `response.content_part.done`, `response.output_item.done`, then one terminal event,
//!   `response.completed` (status completed) or `response.incomplete` (length limit or cancel); or `error`.
//!   Every event carries an increasing `sequence_number`.
//! - Every response has an affinity key ([`super::affinity`]): the client's `x-sparkd-session`, else the key
//!   stored with the response it continues (the object's `session` field), else its own id (a conversation's
//!   root). It is stored in the object, so every turn of a chain answers the root's key.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::{json, Value};
use sparkd_tokenizer::RenderSpec;

use super::access::AccessEntry;
use super::affinity::SessionKey;
use super::auth::Owner;
use super::constraint;
use super::error::ApiError;
use super::generate::{Generation, GenerationOrder, Outcome, Progress};
use super::http::{bytes_response, json_response, read_body, sse_response, Body};
use super::info;
use super::items::{self, OutputItems};
use super::openai::{self, ValidResponsesRequest};
use super::reply::ReplyForm;
use super::sse::{Disconnected, SseWriter, QUEUED_HEARTBEAT};
use super::stop::StopStrings;
use super::wire::{self, ResponseHeader};
use super::{new_id, unix_now, AppState};
use crate::engine::sessions::KeptSummary;
use crate::engine::types::ResponseId;

/// Where a stream's events go: an SSE body or a WebSocket (which tags them with the `stream_id`).
pub trait EventSink {
    /// Sends one event object (it has a `type`).
    fn send(&mut self, event: Value) -> impl std::future::Future<Output = Result<(), Disconnected>> + Send;
    /// Shows the client that its request still waits for the engine, where that is how a client that left is
    /// noticed (an SSE comment; a WebSocket notices a close by reading).
    fn queued(&mut self) -> impl std::future::Future<Output = Result<(), Disconnected>> + Send;
}

impl EventSink for SseWriter {
    async fn send(&mut self, event: Value) -> Result<(), Disconnected> {
        let name = event["type"].as_str().unwrap_or("message").to_owned();
        self.event(&name, &event).await
    }

    async fn queued(&mut self) -> Result<(), Disconnected> {
        SseWriter::queued(self).await
    }
}

/// Parses and validates a Responses body (`POST /v1/responses`, or a WebSocket `response.create` event) on the
/// preparation pool.
pub async fn validate(state: &Arc<AppState>, body: Bytes) -> Result<Arc<ValidResponsesRequest>, ApiError> {
    let st = state.clone();
    state.prep.run(move || Ok(Arc::new(items::responses_request(&openai::parse_body(&body)?, &st.limits)?))).await
}

/// Renders and submits a validated Responses request (rendering, tokenizing and compiling its constraint on the
/// preparation pool). `given`: the affinity key the client sent, if any.
pub async fn start(
    state: &Arc<AppState>,
    req: &Arc<ValidResponsesRequest>,
    arrival: Instant,
    owner: Owner,
    given: Option<SessionKey>,
) -> Result<(Generation, ResponseHeader), ApiError> {
    info::check_model(state, req.model.as_deref())?;
    let kept = match &req.previous_response_id {
        Some(prev) => {
            Some(recorded(state, &owner.kept_id(prev)).await?.ok_or_else(|| ApiError::UnknownResponse(prev.clone()))?)
        }
        None => None,
    };
    let (st, rq) = (state.clone(), req.clone());
    let (prompt, kept_len, constraint, stop, inherited) = state
        .prep
        .run(move || {
            let inherited = kept.as_ref().and_then(|k| k.record.as_deref()).and_then(stored_session);
            let (prompt, kept_len) = match kept {
                Some(kept) => {
                    (st.template.render_continuation(kept.last_token.as_slice(), &rq.input, rq.thinking)?, kept.len)
                }
                None => {
                    let tools = rq.tools.as_ref().and_then(|t| t.prompt_declaration());
                    let spec = RenderSpec { tools, thinking: rq.thinking, ..RenderSpec::new(&rq.input) };
                    (st.template.render_spec(&spec)?, 0)
                }
            };
            let constraint = constraint::compile_request(&st, &rq.constraint)?;
            Ok((prompt, kept_len, constraint, StopStrings::new(rq.params.stop.clone()), inherited))
        })
        .await?;
    let max_tokens = openai::check_context(kept_len + prompt.len(), req.params.max_tokens, state.max_model_len)?;
    let id = new_id("resp_");
    // A stored object without a key (written before keys were stored) makes its own id the root.
    let session = given
        .or(inherited)
        .unwrap_or_else(|| SessionKey::of_response(req.previous_response_id.as_deref().unwrap_or(id.as_str())));
    let header = ResponseHeader {
        id,
        item_id: new_id("msg_"),
        created_at: unix_now(),
        model: state.model_name.clone(),
        previous_response_id: req.previous_response_id.clone(),
        max_output_tokens: req.params.max_tokens,
        store: req.store,
        owner,
        session,
    };
    let order = GenerationOrder {
        prompt,
        continue_from: req.previous_response_id.as_deref().map(|prev| header.owner.kept_id(prev)),
        keep_as: req.store.then(|| header.owner.kept_id(&header.id)),
        stop,
        params: req.params.clone(),
        max_tokens,
        arrival,
        reply: ReplyForm::chat(req.tools.as_ref(), req.thinking),
        constraint,
    };
    let generation = Generation::start(state, order).await?;
    Ok((generation, header))
}

/// The affinity key stored in a response object (its `session` field), if it has a valid one.
fn stored_session(record: &[u8]) -> Option<SessionKey> {
    #[derive(serde::Deserialize)]
    struct Stored {
        session: Option<String>,
    }
    let stored: Stored = serde_json::from_slice(record).ok()?;
    SessionKey::parse(stored.session?.as_bytes()).ok()
}

/// A kept response whose object is attached (what can be retrieved and continued), from the engine's view.
/// One kept without its object yet waits for the engine to take the commands queued before this read (the
/// attachment, when its response has ended) and is read again; `None` when it is not kept or has no object.
async fn recorded(state: &AppState, id: &ResponseId) -> Result<Option<KeptSummary>, ApiError> {
    match state.engine.kept_response(id)? {
        Some(kept) if kept.record.is_none() => {
            state.engine.barrier().await?;
            Ok(state.engine.kept_response(id)?.filter(|k| k.record.is_some()))
        }
        kept => Ok(kept),
    }
}

/// The final response object as JSON bytes; with `store`, also attached to the kept response (so it can be
/// retrieved and continued from now on).
async fn finish(state: &AppState, header: &ResponseHeader, output: &OutputItems, outcome: &Outcome) -> (Value, Bytes) {
    let (status, _) = wire::terminal_status(outcome);
    let object = wire::response_object(header, status, output.json(), Some(outcome));
    let bytes = Bytes::from(object.to_string());
    if header.store {
        // With the engine gone the next request reports it; this response is complete all the same.
        if let Ok(false) = state.engine.record_response(header.owner.kept_id(&header.id), bytes.clone()).await {
            tracing::warn!(response = %header.id, "kept in memory only: the session journal could not write it");
        }
    }
    (object, bytes)
}

/// `GET /v1/responses/{id}`: the stored response object.
pub async fn retrieve(state: &AppState, id: &str, owner: &Owner) -> Result<Response<Body>, ApiError> {
    let record = recorded(state, &owner.kept_id(id))
        .await?
        .and_then(|k| k.record)
        .ok_or_else(|| ApiError::ResponseNotFound(id.to_owned()))?;
    Ok(bytes_response(StatusCode::OK, "application/json", record))
}

/// `DELETE /v1/responses/{id}`: forgets a kept response (its state, history and object).
pub async fn delete(state: &AppState, id: &str, owner: &Owner) -> Result<Response<Body>, ApiError> {
    if !state.engine.drop_response(owner.kept_id(id)).await? {
        return Err(ApiError::ResponseNotFound(id.to_owned()));
    }
    Ok(json_response(StatusCode::OK, &json!({"id": id, "object": "response.deleted", "deleted": true})))
}

/// The `error` event.
pub fn error_event(e: &ApiError) -> Value {
    let body = e.body();
    json!({"type": "error", "code": body.code, "message": body.message, "param": body.param, "error": body})
}

/// Streams one response's events into `sink`. Returns when the response ended or the sink is gone (dropping
/// the generation cancels it).
pub async fn stream<S: EventSink>(
    state: &AppState,
    mut generation: Generation,
    header: ResponseHeader,
    want_logprobs: bool,
    sink: &mut S,
) -> Result<(), Disconnected> {
    let mut seq = 0u64;
    let mut send = |mut event: Value| {
        event["sequence_number"] = json!(seq);
        seq += 1;
        event
    };
    sink.send(send(
        json!({"type": "response.created", "response": wire::response_object(&header, "in_progress", json!([]), None)}),
    ))
    .await?;
    let mut output = OutputItems::new(header.item_id.clone());
    let outcome = loop {
        let Some(progress) = generation.next_or_queued(QUEUED_HEARTBEAT).await else {
            sink.queued().await?;
            continue;
        };
        match progress {
            Ok(Progress::Delta(d)) => {
                let logprobs = (want_logprobs && !d.logprobs.is_empty())
                    .then(|| wire::chat_logprobs(state.tokenizer(), &d.logprobs));
                for event in output.push(&d.reasoning, &d.text, logprobs, &d.tool_calls) {
                    sink.send(send(event)).await?;
                }
            }
            Ok(Progress::Done(o)) => break o,
            Err(e) => {
                e.count();
                sink.send(send(error_event(&e))).await?;
                return Ok(());
            }
        }
    };
    let closing = output.finish();
    // Attached before the client is told the response ended, and whether or not it is still there to read it:
    // the engine has kept the state, so the id must lead to the object.
    let (object, _) = finish(state, &header, &output, &outcome).await;
    for event in closing {
        sink.send(send(event)).await?;
    }
    let (_, event_type) = wire::terminal_status(&outcome);
    sink.send(send(json!({"type": event_type, "response": object}))).await
}

/// `POST /v1/responses`.
pub async fn http(
    state: &Arc<AppState>,
    req: Request<Incoming>,
    arrival: Instant,
    owner: Owner,
) -> Result<Response<Body>, ApiError> {
    let given = SessionKey::from_headers(req.headers())?;
    let access = req.extensions().get::<AccessEntry>().cloned();
    let valid = validate(state, read_body(state, req).await?).await?;
    let (mut generation, header) = start(state, &valid, arrival, owner, given).await?;
    generation.log_to(access, &header.id);
    let want_logprobs = valid.params.logprobs.is_some();
    let session = header.session.clone();
    if valid.stream {
        let (mut writer, body) = SseWriter::new();
        let st = state.clone();
        tokio::spawn(async move {
            let _ = stream(&st, generation, header, want_logprobs, &mut writer).await;
        });
        let mut response = sse_response(body);
        session.stamp(&mut response);
        return Ok(response);
    }
    let mut output = OutputItems::new(header.item_id.clone());
    let outcome = loop {
        match generation.next().await? {
            Progress::Delta(d) => {
                output.push(&d.reasoning, &d.text, None, &d.tool_calls);
            }
            Progress::Done(o) => break o,
        }
    };
    output.finish();
    let (_, body) = finish(state, &header, &output, &outcome).await;
    let mut response = bytes_response(StatusCode::OK, "application/json", body);
    session.stamp(&mut response);
    Ok(response)
}
