//! The serving surface: HTTP (OpenAI chat/completions/responses, SSE), the Responses WebSocket, `/metrics`.
//!
//! Layout (aesthetics.md §6 rule 1): [`http`] (hyper server, routes, graceful shutdown), [`openai`] (request
//! parsing and validation), [`wire`] (response JSON), [`sse`] (event-stream bodies), [`responses`] (the
//! Responses API: create, retrieve, delete), [`info`] (models, version, tokenize, detokenize), [`ws`] (Responses WebSocket mode), [`tools`] (the tool fields of a
//! request), [`generate`] (one request's life against the engine: detokenize, split reasoning, content and tool
//! calls, stop strings, usage and timings), [`stop`] (the stop-string matcher), [`limits`] (per-request size
//! limits), [`conn`] (connections: how many, head and idle times), [`prep`] (the bounded pool that prepares
//! requests off the I/O threads), [`access`] (the access log), [`throughput`] (the periodic throughput line),
//! [`error`] (the one error type and its HTTP mapping), [`affinity`] (the session-affinity header a load
//! balancer hashes).
//!
//! Invariants:
//! - The API layer never touches the model: it talks to the engine thread only through [`EngineHandle`]
//!   (bounded channels). It keeps no record of kept responses: the engine's session store owns them, and the
//!   API reads what a continuation or `GET /v1/responses/{id}` needs from the store's view (which only the
//!   engine thread writes), without waiting on the engine thread.
//! - A request whose client goes away is cancelled in the engine (its [`generate::Generation`] is dropped).
//! - Work whose cost grows with a request's size (parsing, templating, tokenizing, matcher and constraint
//!   building, a long reply's log-probabilities) runs in [`prep::PrepPool`], not on the I/O threads.

pub mod access;
pub mod admission;
pub mod affinity;
pub mod auth;
pub mod conn;
pub mod constraint;
pub mod error;
pub mod generate;
pub mod http;
pub mod info;
pub mod items;
pub mod limits;
pub mod openai;
pub mod prep;
pub mod reply;
pub mod responses;
pub mod sse;
pub mod stop;
pub mod throughput;
pub mod tools;
pub mod wire;
pub mod ws;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::PrometheusHandle;
use sparkd_grammar::GrammarEnv;
use sparkd_tokenizer::{ChatTemplate, Tokenizer};
use tokio::sync::watch;

use self::error::ApiError;
use crate::engine::types::{EngineHandle, RequestId};
use crate::metrics::{InteractivityWindow, INTERACTIVITY_P90_TOKENS_PER_SECOND};

/// Finished requests the P90 interactivity gauge looks back over (at most this many ...).
pub const INTERACTIVITY_WINDOW_REQUESTS: usize = 1000;
/// ... and none older than this.
pub const INTERACTIVITY_WINDOW: Duration = Duration::from_secs(300);

/// Connections open at once when the open-file limit allows it (`--max-connections`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;
/// How long a request's head may take from its first byte (`--header-timeout`).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection or WebSocket may sit idle (`--idle-timeout`): longer than AIPerf keeps pooled
/// connections (300 s, agentx.md §3.1), so a benchmark's pool never races a close.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(330);

/// Responses in progress at once on one WebSocket (`--max-ws-streams`): an agent with many parallel subagents
/// fits, one socket cannot hold the whole engine.
pub const DEFAULT_MAX_WS_STREAMS: usize = 64;

/// Everything a connection task needs. Shared as `Arc<AppState>`.
pub struct AppState {
    pub engine: EngineHandle,
    pub template: ChatTemplate,
    pub model_name: String,
    pub max_model_len: usize,
    pub max_body_bytes: usize,
    pub metrics: PrometheusHandle,
    /// Turns to `true` when the server starts draining (WebSockets refuse new responses, then close).
    pub shutdown: watch::Receiver<bool>,
    /// Unix time of start-up (`created` of `/v1/models`).
    pub started_unix: u64,
    /// The API keys and browser origins served (open by default: [`AppState::with_access`]).
    pub access: auth::Access,
    /// The bound on requests waiting for the engine (unbounded by default: [`AppState::with_max_waiting`]).
    pub admission: admission::Admission,
    /// What one request may ask for (the context's defaults unless [`AppState::with_limits`]).
    pub limits: limits::RequestLimits,
    /// Where requests are parsed, rendered and tokenized: never on an I/O thread.
    pub prep: prep::PrepPool,
    /// The open WebSockets, which a drain waits for.
    pub sockets: Arc<ws::Sockets>,
    /// Connections at once, head and idle times ([`AppState::with_conn_limits`]).
    pub conn_limits: conn::ConnLimits,
    /// What the generations did since start-up, for the periodic throughput line.
    pub throughput: Arc<throughput::Throughput>,
    interactivity: Mutex<InteractivityWindow>,
    next_request: AtomicU64,
    /// The tokenizer as the constraint compiler sees it, built by the first constrained request (it walks the
    /// vocabulary once, about 0.3 s).
    grammar: OnceLock<Result<GrammarEnv, String>>,
}

impl AppState {
    pub fn new(
        engine: EngineHandle,
        template: ChatTemplate,
        model_name: String,
        max_model_len: usize,
        max_body_bytes: usize,
        metrics: PrometheusHandle,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        AppState {
            engine,
            template,
            model_name,
            max_model_len,
            max_body_bytes,
            metrics,
            shutdown,
            started_unix: unix_now(),
            interactivity: Mutex::new(InteractivityWindow::new(INTERACTIVITY_WINDOW_REQUESTS, INTERACTIVITY_WINDOW)),
            next_request: AtomicU64::new(1),
            grammar: OnceLock::new(),
            access: auth::Access::default(),
            admission: admission::Admission::new(usize::MAX),
            limits: limits::RequestLimits::for_context(max_model_len),
            prep: prep::PrepPool::new(prep::PrepPool::default_threads()),
            sockets: Arc::default(),
            throughput: Arc::default(),
            conn_limits: conn::ConnLimits {
                max_connections: DEFAULT_MAX_CONNECTIONS,
                header_timeout: DEFAULT_HEADER_TIMEOUT,
                idle_timeout: DEFAULT_IDLE_TIMEOUT,
                max_ws_streams: DEFAULT_MAX_WS_STREAMS,
            },
        }
    }

    /// The state serving only the keys and origins of `access`.
    pub fn with_access(mut self, access: auth::Access) -> Self {
        self.access = access;
        self
    }

    /// The state refusing a request (429) while `max_waiting` others wait for the engine.
    pub fn with_max_waiting(mut self, max_waiting: usize) -> Self {
        self.admission = admission::Admission::new(max_waiting);
        self
    }

    /// The state refusing requests past `limits` (400 naming the flag).
    pub fn with_limits(mut self, limits: limits::RequestLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The state bounding its connections by `limits`.
    pub fn with_conn_limits(mut self, limits: conn::ConnLimits) -> Self {
        self.conn_limits = limits;
        self
    }

    /// The state preparing at most `threads` requests at once.
    pub fn with_prep_threads(mut self, threads: usize) -> Self {
        self.prep = prep::PrepPool::new(threads);
        self
    }

    /// The constraint compiler over the served tokenizer.
    pub fn grammar(&self) -> Result<&GrammarEnv, ApiError> {
        self.grammar
            .get_or_init(|| GrammarEnv::new(self.tokenizer()).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| ApiError::Internal(format!("output constraints are unavailable: {e}")))
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        self.template.tokenizer()
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.next_request.fetch_add(1, Ordering::Relaxed))
    }

    /// Adds a finished request's mean ITL to the window and refreshes the P90 interactivity gauge.
    pub fn record_request_itl(&self, itl_seconds: f64) {
        let now = Instant::now();
        let value = {
            let mut window = self.interactivity.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            window.record(now, itl_seconds);
            window.p90_interactivity(now)
        };
        metrics::gauge!(INTERACTIVITY_P90_TOKENS_PER_SECOND).set(value.unwrap_or(0.0));
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// An id of 128 random bits from the OS with a prefix (`chatcmpl-…`, `resp_…`): a kept response's id cannot be
/// guessed from another's or from the time.
pub fn new_id(prefix: &str) -> String {
    let mut bytes = [0u8; 16];
    if getrandom::getrandom(&mut bytes).is_err() {
        // The OS generator failed (it does not on Linux after boot): fall back to a counter mixed with the clock,
        // unique but guessable, and say so.
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        tracing::warn!("the OS random generator failed; this id is unique but not secret");
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        bytes = (nanos ^ u128::from(n) << 64).to_le_bytes();
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}{hex}")
}
