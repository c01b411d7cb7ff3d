//! The informational endpoints, in vLLM's shapes: the served model (`GET /v1/models`, `GET /v1/models/{id}`),
//! `GET /version`, `POST /tokenize` (a prompt, or chat messages through the chat template) and `POST /detokenize`.
//!
//! Invariants:
//! - A `model` that names another model than the one served is a 404 `model_not_found` naming it, as vLLM answers.
//! - `/tokenize` and `/detokenize` parse, tokenize and decode on the preparation pool, under the same size limits
//!   as generation requests (`--max-prompt-chars`, `--max-body-bytes`); their token counts are exactly what a
//!   generation request with the same prompt or messages is charged.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::{json, Value};
use sparkd_tokenizer::RenderSpec;

use super::error::ApiError;
use super::http::{check_known_ids, json_response, prompt_tokens, read_body, Body};
use super::openai::{self, Fields, Prompt};
use super::AppState;

/// The served model's object.
fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.model_name, "object": "model", "created": state.started_unix, "owned_by": "sparkd",
        "root": state.model_name, "max_model_len": state.max_model_len,
    })
}

/// `GET /v1/models`.
pub fn models(state: &AppState) -> Response<Body> {
    json_response(StatusCode::OK, &json!({"object": "list", "data": [model_object(state)]}))
}

/// `GET /v1/models/{id}`.
pub fn model(state: &AppState, id: &str) -> Result<Response<Body>, ApiError> {
    if id != state.model_name {
        return Err(ApiError::ModelNotFound(id.to_owned()));
    }
    Ok(json_response(StatusCode::OK, &model_object(state)))
}

/// `GET /version`.
pub fn version() -> Response<Body> {
    json_response(StatusCode::OK, &json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// Refuses a request whose `model` names another model than the one served (a 404 `model_not_found`, as vLLM
/// answers); a request that names none gets the served one.
pub fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(name) if name != state.model_name => Err(ApiError::ModelNotFound(name.to_owned())),
        _ => Ok(()),
    }
}

/// `POST /tokenize`: `{"prompt": text}` or `{"messages": [...], "add_generation_prompt": bool}` (and the chat
/// request's `tools` and thinking switches) to `{"count", "max_model_len", "tokens", "token_strs"}`.
pub async fn tokenize(state: &Arc<AppState>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = read_body(state, req).await?;
    let st = state.clone();
    let tokens = state
        .prep
        .run(move || {
            let body = openai::parse_body(&body)?;
            let f = Fields::new(&body, "")?;
            check_model(&st, f.str("model")?)?;
            if f.get("messages").is_none() {
                let prompt = f.str("prompt")?.ok_or_else(|| {
                    ApiError::field("prompt", "`/tokenize` needs `prompt` (text) or `messages` (a chat)")
                })?;
                st.limits.check_prompt("prompt", prompt.chars().count())?;
                return Ok(st.tokenizer().encode(prompt));
            }
            let add_generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
            match openai::chat_request(&body, &st.limits)?.prompt {
                Prompt::Chat { messages, tools, thinking } => Ok(st.template.render_spec(&RenderSpec {
                    tools: tools.as_deref(),
                    thinking,
                    add_generation_prompt,
                    ..RenderSpec::new(&messages)
                })?),
                other => prompt_tokens(&st, &other),
            }
        })
        .await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({"count": tokens.len(), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": null}),
    ))
}

/// `POST /detokenize`: `{"tokens": [ids]}` to `{"prompt": text}`; an id outside the vocabulary is a 400 naming it.
pub async fn detokenize(state: &Arc<AppState>, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = read_body(state, req).await?;
    let st = state.clone();
    let text = state
        .prep
        .run(move || {
            let body = openai::parse_body(&body)?;
            let f = Fields::new(&body, "")?;
            check_model(&st, f.str("model")?)?;
            let tokens = f.get("tokens").ok_or_else(|| ApiError::field("tokens", "`tokens` is required"))?;
            let ids = openai::token_array(tokens, "tokens")?;
            check_known_ids(&st, &ids, "tokens")?;
            Ok(st.tokenizer().decode_lossy(&ids)?)
        })
        .await?;
    Ok(json_response(StatusCode::OK, &json!({"prompt": text})))
}
