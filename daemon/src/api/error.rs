//! The API layer's one error type and its one mapping to HTTP statuses and OpenAI error JSON.
//!
//! Invariants:
//! - Every way a client request can fail is a variant that names what is wrong (the field, for validation);
//!   nothing in the API layer panics on input.
//! - [`ApiError::kind`] is a stable, low-cardinality string: the `kind` label of `sparkd:errors_total` and the
//!   `code` of the error JSON. [`ApiError::status`] is the only place that picks an HTTP status.
//! - The body is OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use hyper::StatusCode;
use serde::Serialize;
use sparkd_tokenizer::TokenizerError;

use crate::engine::types::EngineError;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field is missing, has the wrong type or an out-of-range value.
    #[error("{message}")]
    InvalidField { param: String, message: String },
    /// The body is not JSON, or not a JSON object.
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    /// Prompt plus requested output exceed the context length.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested {requested} tokens \
         ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion."
    )]
    ContextLength { max_model_len: usize, requested: usize, prompt_tokens: usize, max_tokens: usize },
    /// The body is larger than `--max-body-bytes`.
    #[error("request body is larger than {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// No such route.
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    /// A `model` (or `/v1/models/{id}`) names another model than the one served.
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// `previous_response_id` names no kept response.
    #[error("previous_response_id `{0}` is not a kept response (never stored, or dropped)")]
    UnknownResponse(String),
    /// `GET` or `DELETE /v1/responses/{id}` names no kept response.
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// No valid `Authorization: Bearer KEY` on a server with API keys.
    #[error("{}", if *missing { "You didn't provide an API key: send `Authorization: Bearer KEY`." } else { "Incorrect API key provided." })]
    Unauthorized { missing: bool },
    /// A browser request from an origin `--allow-origin` does not allow.
    #[error("requests from origin `{0}` are not allowed (see --allow-origin)")]
    OriginNotAllowed(String),
    /// `--max-waiting` requests already wait for the engine.
    #[error("the server is at capacity: {max_waiting} requests are already waiting (--max-waiting); retry later")]
    QueueFull { max_waiting: usize },
    /// A WebSocket already has `--max-ws-streams` responses in progress.
    #[error("this socket already has {limit} responses in progress (--max-ws-streams); wait for one to end")]
    TooManyStreams { limit: usize },
    /// The request (its body) did not arrive in time.
    #[error("{0}")]
    RequestTimeout(String),
    /// The server is draining (SIGTERM): it finishes what runs and starts nothing new.
    #[error("the server is shutting down: it finishes the responses in progress and starts no new ones")]
    ShuttingDown,
    /// The engine thread is gone: the daemon cannot serve.
    #[error("the engine is not running")]
    EngineUnavailable,
    /// The engine failed while serving the request (it counted the error itself).
    #[error("engine error: {0}")]
    Engine(EngineError),
    /// Rendering the prompt or decoding the output failed.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    /// The daemon failed in a way that is not the client's fault.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// A validation error naming `param`.
    pub fn field(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidField { param: param.into(), message: message.into() }
    }

    /// A stable name for the error: metric label and JSON `code`.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidField { .. } => "invalid_field",
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::ContextLength { .. } => "context_length_exceeded",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::NotFound { .. } => "not_found",
            ApiError::UnknownResponse(_) => "unknown_response",
            ApiError::ResponseNotFound(_) => "response_not_found",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::Unauthorized { .. } => "invalid_api_key",
            ApiError::OriginNotAllowed(_) => "origin_not_allowed",
            ApiError::QueueFull { .. } => "queue_full",
            ApiError::ShuttingDown => "server_shutting_down",
            ApiError::RequestTimeout(_) => "request_timeout",
            ApiError::TooManyStreams { .. } => "too_many_streams",
            ApiError::EngineUnavailable => "engine_unavailable",
            ApiError::Engine(e) => e.kind(),
            ApiError::Tokenizer(e) => e.kind(),
            ApiError::Internal(_) => "internal",
        }
    }

    /// Counts the error in `sparkd:errors_total{kind}`, unless the engine already did (errors it raised).
    pub fn count(&self) {
        if !matches!(self, ApiError::Engine(_)) {
            metrics::counter!(crate::metrics::ERRORS_TOTAL, "kind" => self.kind()).increment(1);
        }
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidField { .. } | ApiError::InvalidJson(_) | ApiError::ContextLength { .. } => {
                StatusCode::BAD_REQUEST
            }
            ApiError::UnknownResponse(_) => StatusCode::BAD_REQUEST,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::NotFound { .. } | ApiError::ResponseNotFound(_) | ApiError::ModelNotFound(_) => {
                StatusCode::NOT_FOUND
            }
            ApiError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            ApiError::OriginNotAllowed(_) => StatusCode::FORBIDDEN,
            ApiError::QueueFull { .. } | ApiError::TooManyStreams { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::EngineUnavailable | ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Engine(EngineError::InvalidRequest(_) | EngineError::UnknownResponse(_)) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::Engine(EngineError::Stopped) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Engine(EngineError::SlowReader { .. }) | ApiError::RequestTimeout(_) => {
                StatusCode::REQUEST_TIMEOUT
            }
            ApiError::Engine(EngineError::Runner { .. } | EngineError::Internal(_)) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            ApiError::Tokenizer(TokenizerError::UnknownRole { .. } | TokenizerError::UnknownTokenId(_)) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::Tokenizer(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The field the error is about, when there is one.
    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidField { param, .. } => Some(param),
            ApiError::ContextLength { .. } => Some("messages"),
            ApiError::UnknownResponse(_) | ApiError::Engine(EngineError::UnknownResponse(_)) => {
                Some("previous_response_id")
            }
            ApiError::Tokenizer(TokenizerError::UnknownRole { .. }) => Some("messages"),
            ApiError::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// OpenAI's error `type`.
    pub fn error_type(&self) -> &'static str {
        match self.status() {
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::INTERNAL_SERVER_ERROR => "server_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            _ => "invalid_request_error",
        }
    }

    /// The OpenAI error object, `{"message", "type", "param", "code"}`.
    pub fn body(&self) -> ErrorObject {
        ErrorObject {
            message: self.to_string(),
            kind: self.error_type(),
            param: self.param().map(str::to_owned),
            code: self.kind(),
        }
    }

    /// The full JSON document `{"error": {...}}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string(&ErrorBody { error: self.body() })
            .unwrap_or_else(|_| r#"{"error":{"message":"unserializable error"}}"#.to_string())
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Stopped => ApiError::EngineUnavailable,
            EngineError::UnknownResponse(id) => ApiError::UnknownResponse(id.0),
            other => ApiError::Engine(other),
        }
    }
}

/// OpenAI's error object.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: &'static str,
}

#[derive(Serialize)]
struct ErrorBody {
    error: ErrorObject,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_errors_name_the_field_and_are_400() {
        let e = ApiError::field("temperature", "`temperature` must be between 0 and 2, got 7");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(v["error"]["param"], "temperature");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_field");
        assert!(v["error"]["message"].as_str().unwrap().contains("temperature"));
    }

    #[test]
    fn context_errors_say_maximum_context_length_and_engine_loss_is_503() {
        let e = ApiError::ContextLength { max_model_len: 10, requested: 12, prompt_tokens: 8, max_tokens: 4 };
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(e.to_string().contains("maximum context length"));
        let gone: ApiError = EngineError::Stopped.into();
        assert_eq!(gone.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(gone.kind(), "engine_unavailable");
        let unknown: ApiError = EngineError::UnknownResponse(crate::engine::types::ResponseId("resp_x".into())).into();
        assert_eq!(unknown.param(), Some("previous_response_id"));
    }

    #[test]
    fn internal_engine_faults_are_500_and_a_missing_response_is_404() {
        let internal: ApiError = EngineError::Internal("step results: 0 rows for 1".into()).into();
        assert_eq!(internal.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!((internal.kind(), internal.error_type()), ("internal", "server_error"));
        let invalid: ApiError = EngineError::InvalidRequest("the prompt is empty".into()).into();
        assert_eq!(invalid.status(), StatusCode::BAD_REQUEST);
        let missing = ApiError::ResponseNotFound("resp_x".into());
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        let v: serde_json::Value = serde_json::from_str(&missing.to_json()).unwrap();
        assert_eq!(v["error"]["code"], "response_not_found");
        assert_eq!(v["error"]["message"], "Response with id 'resp_x' not found.");
    }
}
