//! The engine contract: what the API layer sends to the engine thread and what comes back.
//!
//! Invariants:
//! - The engine thread owns the runner, every sequence state, the scheduler, the session store and
//!   the prefix cache; other threads reach it only through [`EngineHandle`] (a bounded channel).
//! - Each request gets its own bounded event channel. Events for one request arrive in this order:
//!   at most one `Started`, then zero or more `Tokens`, then exactly one terminal event
//!   (`Finished` or `Failed`); nothing follows the terminal event.
//! - A failed send on a request's event channel (the receiver was dropped: the client left) cancels
//!   the request and frees what it held, a state it was to keep (`keep_as`) included: nobody received the
//!   response it would be kept under. An explicit `Cancel` ends the request with `Finished` and keeps it.
//! - `Tokens.tokens` includes a stop token id that ended the request (it counts as a completion
//!   token); the API's detokenizer decides whether to print it.
//! - A kept response `R` holds the state after its prompt and all its output tokens. Continuing `R`
//!   (`continue_from`) prefills only the new prompt tokens; two requests continuing `R` each get
//!   their own fork of `R`'s state, and `R` itself stays kept until dropped or evicted.
//! - The engine's session store is the only owner of kept responses. The API reads them through the
//!   store's [`KeptView`] without waiting on the engine thread; it attaches a rendering
//!   (`RecordResponse`) and deletes one (`DropResponse`) through the bounded command channel, where
//!   a command sees every command sent before it (`Barrier` waits for exactly that).

use std::time::{Duration, Instant};

use bytes::Bytes;
use sparkd_kernels::runner::{SamplingParams, TokenLogprob};
use sparkd_kernels::{KernelError, TokenId};
use tokio::sync::{mpsc, oneshot};

use super::sessions::{KeptSummary, KeptView};
use super::step_time::StepTimeLimit;

/// Unique id of one generation request (assigned by the API layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req#{}", self.0)
    }
}

/// Id of a kept response ("resp_…"): a session turn whose final state the engine keeps.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResponseId(pub String);

impl std::fmt::Display for ResponseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One validated generation request.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub id: RequestId,
    /// Chat/completions: the full prompt. A request continuing a kept response: only the NEW tokens
    /// after that response's prompt and output.
    pub prompt: Vec<TokenId>,
    /// `previous_response_id`: start from that kept response's state.
    pub continue_from: Option<ResponseId>,
    /// Keep the final state (prompt + output) under this id; an existing entry of the same id is replaced.
    pub keep_as: Option<ResponseId>,
    pub sampling: SamplingParams,
    /// At least 1.
    pub max_tokens: usize,
    /// Do not finish on `stop_token_ids`.
    pub ignore_eos: bool,
    /// Token ids that end the request (eos, end-of-turn). Stop STRINGS are checked by the API layer,
    /// which then sends `EngineCommand::Cancel`.
    pub stop_token_ids: Vec<TokenId>,
    /// When the request arrived at the API (queue time and TTFT are measured from here).
    pub arrival: Instant,
    /// Most draft tokens to verify per step for this request (the request's `speculation.num_tokens`);
    /// capped by the server's `--num-spec-tokens`; `None`: the server's value; `Some(0)`: no drafts.
    pub num_spec_tokens: Option<usize>,
    /// The grammar the output must follow (`response_format`, a grammar, required tool calls), its matcher
    /// fresh; `None`: unconstrained.
    pub constraint: Option<Box<sparkd_grammar::Constraint>>,
}

impl GenerateRequest {
    /// A greedy request of exactly `max_tokens` (EOS ignored), arriving now: what benchmarks and tests send.
    pub fn greedy(id: RequestId, prompt: Vec<TokenId>, max_tokens: usize) -> Self {
        GenerateRequest {
            id,
            prompt,
            continue_from: None,
            keep_as: None,
            sampling: SamplingParams::greedy(),
            max_tokens,
            ignore_eos: true,
            stop_token_ids: Vec::new(),
            arrival: Instant::now(),
            num_spec_tokens: None,
            constraint: None,
        }
    }
}

/// A command to the engine thread.
#[derive(Debug)]
pub enum EngineCommand {
    /// Start a request; its events go to `events` (bounded; a failed send = client gone).
    Generate { request: GenerateRequest, events: mpsc::Sender<EngineEvent> },
    /// Stop a request: it finishes with `FinishReason::Cancelled` (and is kept if it asked to be).
    Cancel(RequestId),
    /// Forget a kept response (state, history and record) and free its state; `reply` says whether
    /// it was kept.
    DropResponse { id: ResponseId, reply: oneshot::Sender<bool> },
    /// Answered once every command sent before it has been handled (so the [`KeptView`] shows
    /// what they did).
    Barrier { reply: oneshot::Sender<()> },
    /// Attach the API's rendering of a kept response (what `GET /v1/responses/{id}` returns): the turn
    /// commits. Its bytes count against the kept-responses budget; with a session journal it is written
    /// and synced before `reply` (whether it is on disk, or needs not be). Ignored when `id` is no longer
    /// kept.
    RecordResponse { id: ResponseId, record: Bytes, reply: oneshot::Sender<bool> },
    /// Stop every request in the engine, each as `Cancel` would (the end of a drain whose time ran out).
    CancelAll,
    /// Cancel every request and stop the engine thread (what `Engine::shutdown` sends).
    Shutdown,
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token id was produced (it is the last emitted token).
    Stop,
    /// `max_tokens` was reached.
    Length,
    /// Cancelled by `EngineCommand::Cancel` or because the client left.
    Cancelled,
}

impl FinishReason {
    /// The OpenAI / vLLM label: "stop", "length", "abort".
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "abort",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// All prompt tokens the request covers: for a continuation, the kept history plus the new tokens.
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens not computed by this request (restored from a kept response or the prefix cache).
    pub cached_tokens: usize,
    /// Draft tokens proposed for verification.
    pub draft_tokens: usize,
    /// Draft tokens accepted (bonus tokens excluded).
    pub accepted_draft_tokens: usize,
    /// The drafts' acceptance was forced (`--spec-synthetic-al`): the text is not the model's.
    pub forced_acceptance: bool,
}

/// What the engine tells the API about one request.
#[derive(Debug)]
pub enum EngineEvent {
    /// The request was first scheduled.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
        queue_time: Duration,
    },
    /// Tokens committed by one engine step (one or more with speculation).
    Tokens {
        tokens: Vec<TokenId>,
        /// One per token when log-probabilities were asked for, else empty.
        logprobs: Vec<TokenLogprob>,
        /// Draft tokens verified in this step.
        drafted: usize,
        /// Of those, accepted.
        accepted: usize,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed(EngineError),
}

/// Errors of the engine layer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// `continue_from` names a response the engine does not keep (never kept, dropped, or replaced).
    #[error("unknown previous_response_id `{0}`: no kept response has this id")]
    UnknownResponse(ResponseId),
    /// The request cannot be served as given (empty prompt, zero max_tokens, over the context length...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The runner failed; every request in the failing step gets this. `kind` is the runner
    /// error's own `kind()`.
    #[error("runner ({kind}): {message}")]
    Runner { kind: &'static str, message: String },
    /// The daemon broke one of its own invariants (not the client's fault).
    #[error("internal error: {0}")]
    Internal(String),
    /// The engine thread is gone (its command channel is closed).
    #[error("the engine thread has stopped")]
    Stopped,
    /// The client read its events so slowly that `max_event_backlog` of them piled up: the request was
    /// cancelled and its state freed.
    #[error("the client read too slowly: {backlog} events were waiting for it (--max-event-backlog); the request was cancelled")]
    SlowReader { backlog: usize },
}

impl EngineError {
    /// A stable, low-cardinality name, used as a metric label and in JSON error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::UnknownResponse(_) => "unknown_response",
            EngineError::InvalidRequest(_) => "invalid_request",
            EngineError::Runner { .. } => "runner",
            EngineError::Internal(_) => "internal",
            EngineError::Stopped => "engine_stopped",
            EngineError::SlowReader { .. } => "slow_reader",
        }
    }
}

/// Default token budget of one step (`--max-num-batched-tokens`).
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;
/// Default maximum number of running sequences (`--max-num-seqs`).
pub const DEFAULT_MAX_NUM_SEQS: usize = 64;
/// Default capacity of the command channel.
pub const DEFAULT_COMMAND_QUEUE: usize = 1024;
/// Default device byte budget for sequence states (live and kept).
pub const DEFAULT_STATE_BUDGET_BYTES: usize = 8 << 30;
/// Default host byte budget for offloaded kept states.
pub const DEFAULT_HOST_BUDGET_BYTES: usize = 16 << 30;
/// Default byte budget for everything kept responses hold (states in every tier, token histories,
/// stored records): the device and host state budgets together, so with the default budgets states
/// alone never reach it and what tips it over is what the tiers never bounded (histories, records).
pub const DEFAULT_KEPT_RESPONSES_BYTES: usize = DEFAULT_STATE_BUDGET_BYTES + DEFAULT_HOST_BUDGET_BYTES;
/// Default host byte budget for prefix-cache snapshots.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 8 << 30;
/// Default device byte budget for prefix-cache snapshots kept as runner states (GPU only; see `prefix_cache`).
pub const DEFAULT_PREFIX_DEVICE_BYTES: usize = 4 << 30;
/// Kept responses at most: the byte budget bounds what they hold, this bounds their number (each costs map
/// and index entries besides its bytes).
pub const DEFAULT_MAX_KEPT_RESPONSES: usize = 100_000;
/// Unread events per request before it is cancelled as a slow reader: about 16 s of steps at 4 ms, some
/// megabytes at most even with 20 log-probability alternatives per token.
pub const DEFAULT_MAX_EVENT_BACKLOG: usize = 4096;

/// Engine limits and budgets.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens computed per step at most (prefill chunks plus decode rows plus drafts).
    pub max_num_batched_tokens: usize,
    /// Sequences running at once at most.
    pub max_num_seqs: usize,
    /// Capacity of the command channel (backpressure on submitters).
    pub command_queue: usize,
    /// Device bytes for all sequence states; idle kept states beyond it are offloaded.
    pub state_budget_bytes: usize,
    /// Host bytes for offloaded kept states; beyond it they are dropped (rebuilt by prefill).
    pub host_budget_bytes: usize,
    /// Bytes for everything kept responses hold (states, histories, records); beyond it the least
    /// recently used are removed entirely.
    pub kept_responses_bytes: usize,
    /// Kept responses at most; beyond it the least recently used are removed entirely.
    pub max_kept_responses: usize,
    /// Host bytes for prefix-cache snapshots (0 disables the prefix cache).
    pub prefix_cache_bytes: usize,
    /// Device bytes for prefix-cache snapshots kept as runner states (0: every snapshot is exported to the host).
    pub prefix_device_bytes: usize,
    /// Holds steps that have decode rows to a predicted step time (`--decode-step-target`); `None`:
    /// prefill chunks take what `max_num_batched_tokens` leaves.
    pub step_time: Option<StepTimeLimit>,
    /// Launches the next decode step before the outputs of the one in flight are collected, when the
    /// runner can and speculation is off (`--async-scheduling`; see `engine::core`).
    pub async_scheduling: bool,
    /// Events a request's client may leave unread beyond its channel before the request is cancelled as a
    /// slow reader (`--max-event-backlog`).
    pub max_event_backlog: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            command_queue: DEFAULT_COMMAND_QUEUE,
            state_budget_bytes: DEFAULT_STATE_BUDGET_BYTES,
            host_budget_bytes: DEFAULT_HOST_BUDGET_BYTES,
            kept_responses_bytes: DEFAULT_KEPT_RESPONSES_BYTES,
            max_kept_responses: DEFAULT_MAX_KEPT_RESPONSES,
            prefix_cache_bytes: DEFAULT_PREFIX_CACHE_BYTES,
            prefix_device_bytes: 0,
            step_time: None,
            async_scheduling: true,
            max_event_backlog: DEFAULT_MAX_EVENT_BACKLOG,
        }
    }
}

impl From<KernelError> for EngineError {
    fn from(e: KernelError) -> Self {
        EngineError::Runner { kind: e.kind(), message: e.to_string() }
    }
}

/// The API side's handle on the engine thread. Cheap to clone; every method fails with
/// [`EngineError::Stopped`] once the engine thread is gone.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    commands: mpsc::Sender<EngineCommand>,
    kept: KeptView,
}

impl EngineHandle {
    pub(crate) fn new(commands: mpsc::Sender<EngineCommand>, kept: KeptView) -> Self {
        EngineHandle { commands, kept }
    }

    /// A kept response as the engine's store holds it now, read without waiting on the engine
    /// thread; `None` when it is not kept. Commands still queued (a `RecordResponse`, a
    /// `DropResponse`) show once the engine has taken them ([`EngineHandle::barrier`]).
    pub fn kept_response(&self, id: &ResponseId) -> Result<Option<KeptSummary>, EngineError> {
        if self.commands.is_closed() {
            return Err(EngineError::Stopped);
        }
        Ok(self.kept.get(id))
    }

    /// Queues a request; its events arrive on `events`. Waits while the command queue is full.
    pub async fn submit(&self, request: GenerateRequest, events: mpsc::Sender<EngineEvent>) -> Result<(), EngineError> {
        self.send(EngineCommand::Generate { request, events }).await
    }

    /// Asks the engine to stop a request (it finishes with `FinishReason::Cancelled`).
    pub async fn cancel(&self, id: RequestId) -> Result<(), EngineError> {
        self.send(EngineCommand::Cancel(id)).await
    }

    /// Asks the engine to stop every request it holds (each finishes with `FinishReason::Cancelled`).
    pub async fn cancel_all(&self) -> Result<(), EngineError> {
        self.send(EngineCommand::CancelAll).await
    }

    /// Asks the engine to forget a kept response; `false` when it was not kept.
    pub async fn drop_response(&self, id: ResponseId) -> Result<bool, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.send(EngineCommand::DropResponse { id, reply }).await?;
        answer.await.map_err(|_| EngineError::Stopped)
    }

    /// Returns once the engine has handled every command sent before this call.
    pub async fn barrier(&self) -> Result<(), EngineError> {
        let (reply, answer) = oneshot::channel();
        self.send(EngineCommand::Barrier { reply }).await?;
        answer.await.map_err(|_| EngineError::Stopped)
    }

    /// Attaches the API's rendering to a kept response (queued behind every earlier command) and returns once
    /// the turn is committed: `false` when a session journal could not write it (it is kept in memory only).
    pub async fn record_response(&self, id: ResponseId, record: Bytes) -> Result<bool, EngineError> {
        let (reply, committed) = oneshot::channel();
        self.send(EngineCommand::RecordResponse { id, record, reply }).await?;
        committed.await.map_err(|_| EngineError::Stopped)
    }

    /// Sends any command, waiting while the queue is full.
    pub async fn send(&self, command: EngineCommand) -> Result<(), EngineError> {
        self.commands.send(command).await.map_err(|_| EngineError::Stopped)
    }

    /// Sends without waiting (for contexts that cannot await, such as `Drop`); `Ok(false)` when the
    /// queue is full. Dropping a request's event receiver also cancels it, at the engine's next send.
    pub fn try_send(&self, command: EngineCommand) -> Result<bool, EngineError> {
        match self.commands.try_send(command) {
            Ok(()) => Ok(true),
            Err(mpsc::error::TrySendError::Full(_)) => Ok(false),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(EngineError::Stopped),
        }
    }

    /// Sends from a plain (non-async) thread, blocking while the queue is full. Must not be called
    /// from inside an async runtime.
    pub fn blocking_send(&self, command: EngineCommand) -> Result<(), EngineError> {
        self.commands.blocking_send(command).map_err(|_| EngineError::Stopped)
    }
}
