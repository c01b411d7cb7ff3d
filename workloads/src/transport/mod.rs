//! Transports: how one planned turn reaches the server and what comes back.
//!
//! Invariants:
//! - A [`Connection`] belongs to one lane (one session tree) and may carry several turns at once
//!   (subagents run in parallel); each turn is timed from just before its bytes are written.
//! - TTFT and the last-token time are taken at the first and last *non-empty content* chunk, as
//!   AIPerf does (agentx.md §2.1); usage-only chunks do not count.
//! - A failed turn is an `Err`; the replay decides whether it ends the session.

pub mod chat;
pub mod ws;

use std::future::Future;
use tokio::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{ReplayError, Result};
use crate::synth::Role;

/// One turn as sent.
#[derive(Clone, Debug)]
pub struct TurnRequest {
    /// Stable per chain play: `X-Correlation-ID` (chat), `stream_id` (ws).
    pub stream_id: String,
    pub model: String,
    /// Messages as text: the whole history (chat) or the new ones (ws continuation).
    pub messages: Vec<(Role, String)>,
    /// ws: the response this turn continues.
    pub previous_response_id: Option<String>,
    pub max_tokens: usize,
}

/// Speculation statistics as AIPerf reads them (`metrics.speculative_decoding`, agentx.md §2.4).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecStats {
    pub num_spec_steps: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_draft_tokens: u64,
    pub mean_acceptance_length: f64,
}

/// What came back for one turn.
#[derive(Clone, Debug, Default)]
pub struct TurnOutcome {
    pub response_id: Option<String>,
    pub first_content: Option<Instant>,
    pub last_content: Option<Instant>,
    /// Content chunks (SSE chunks or ws deltas) with non-empty text.
    pub content_chunks: usize,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: u64,
    pub cached_tokens: Option<u64>,
    pub spec: Option<SpecStats>,
}

/// Opens a connection per lane.
pub trait Transport: Send + Sync + 'static {
    type Conn: Connection;
    fn connect(&self) -> impl Future<Output = Result<Self::Conn>> + Send;
}

/// A lane's connection.
pub trait Connection: Send + Sync + 'static {
    /// Sends one turn and waits for its end. `started` is set by the caller just before.
    fn send(&self, request: TurnRequest) -> impl Future<Output = Result<TurnOutcome>> + Send;
}

/// Parses the `usage` object of either API: chat (`prompt_tokens`, `completion_tokens`,
/// `prompt_tokens_details.cached_tokens`) or Responses (`input_tokens`, `output_tokens`,
/// `input_tokens_details.cached_tokens`). Returns (prompt, completion, cached).
pub(crate) fn parse_usage(usage: &serde_json::Value) -> (Option<u64>, Option<u64>, Option<u64>) {
    let get = |a: &str, b: &str| usage.get(a).or_else(|| usage.get(b)).and_then(serde_json::Value::as_u64);
    let prompt = get("prompt_tokens", "input_tokens");
    let completion = get("completion_tokens", "output_tokens");
    let cached = usage
        .get("prompt_tokens_details")
        .or_else(|| usage.get("input_tokens_details"))
        .and_then(|d| d.get("cached_tokens"))
        .and_then(serde_json::Value::as_u64);
    (prompt, completion, cached)
}

/// Parses `metrics.speculative_decoding` from a response root, when present.
pub(crate) fn parse_spec(root: &serde_json::Value) -> Option<SpecStats> {
    let s = root.get("metrics")?.get("speculative_decoding")?;
    let u = |k: &str| s.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
    Some(SpecStats {
        num_spec_steps: u("num_spec_steps"),
        num_draft_tokens: u("num_draft_tokens"),
        num_accepted_draft_tokens: u("num_accepted_draft_tokens"),
        mean_acceptance_length: s.get("mean_acceptance_length").and_then(serde_json::Value::as_f64).unwrap_or(0.0),
    })
}

/// `host:port` of `--url` (`http://host:port`; a trailing path is ignored); another scheme is refused.
pub fn http_authority(base_url: &str) -> Result<String> {
    let base: hyper::Uri = base_url.parse().map_err(|e| ReplayError::option("--url", format!("{base_url:?}: {e}")))?;
    let authority = base.authority().ok_or_else(|| ReplayError::option("--url", "needs host:port"))?;
    if base.scheme_str() != Some("http") {
        return Err(ReplayError::option("--url", "only http:// is supported"));
    }
    Ok(authority.to_string())
}

/// The `Authorization` header of a daemon started with `--api-key` (`Bearer KEY`), checked once here.
pub fn bearer(api_key: Option<&str>) -> Result<Option<hyper::header::HeaderValue>> {
    api_key
        .map(|k| {
            format!("Bearer {k}").parse().map_err(|_| ReplayError::option("--api-key", "not a valid header value"))
        })
        .transpose()
}
