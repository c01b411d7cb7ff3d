//! One request's life against the engine, shared by every endpoint: submit, turn engine events into deltas
//! (incremental detokenization; for chat replies reasoning, content and tool calls, `reply`; stop strings), and
//! finish with usage, timings and the API's metrics.
//!
//! Invariants:
//! - A [`Generation`] that is dropped before its terminal event closes its event channel, so the engine cancels
//!   the request and frees its state (a client that went away); it counts as finished with reason `abort`.
//! - Stop strings are matched on the detokenized text (a chat reply's content). Text that could still be the start of a stop string is
//!   held back (at most the longest stop string minus one byte), so returned text never contains a stop
//!   string and always ends before the first one; on a match the engine request is cancelled and the finish
//!   reason is `stop`, with `completion_tokens` counting the tokens up to the one that completed the match.
//! - Deltas carry the tokens and log-probabilities of the step even when their text is held back.
//! - A reply that ends normally after a reported tool call finishes with reason `tool_calls`.
//! - Timings (aesthetics.md §6 rule 7) are measured here, from the request's arrival at the API.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sparkd_grammar::Constraint;
use sparkd_kernels::runner::TokenLogprob;
use sparkd_kernels::TokenId;
use tokio::sync::mpsc;

use super::access::AccessEntry;
use super::admission::QueueTicket;
use super::error::ApiError;
use super::openai::GenerationParams;
use super::reply::{ReplyForm, ReplyText, ToolCallDelta};
use super::stop::StopStrings;
use super::throughput::Running;
use super::AppState;
use crate::engine::types::{EngineError, EngineEvent, FinishReason, GenerateRequest, RequestId, ResponseId, Usage};
use crate::metrics as m;

/// Capacity of a request's event channel (engine → API).
pub const EVENT_CHANNEL: usize = 64;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerationOrder {
    pub prompt: Vec<TokenId>,
    pub continue_from: Option<ResponseId>,
    pub keep_as: Option<ResponseId>,
    pub params: GenerationParams,
    /// The resolved output limit.
    pub max_tokens: usize,
    pub arrival: Instant,
    /// How the reply is read: plain text, or a chat reply with reasoning and tool calls.
    pub reply: ReplyForm,
    /// The compiled output constraint, if any.
    pub constraint: Option<Box<Constraint>>,
    /// The matcher of `params.stop`, built with the rest of the request's preparation.
    pub stop: StopStrings,
}

/// Text and tokens of one engine step.
#[derive(Clone, Debug, Default)]
pub struct Delta {
    /// Text that became final (may be empty while a stop string might be forming or a character is split); a
    /// chat reply's content.
    pub text: String,
    /// A chat reply's thinking that became final.
    pub reasoning: String,
    /// A chat reply's tool calls: headers as they complete, then argument fragments.
    pub tool_calls: Vec<ToolCallDelta>,
    pub tokens: Vec<TokenId>,
    /// One per token when log-probabilities were asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Completion tokens so far, this step included.
    pub completion_tokens: usize,
}

/// Per-request timings and counts, sent as `timings` on the final frame.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Prompt tokens this request computed (prompt − cached).
    pub prefill_tokens: usize,
    pub completion_tokens: usize,
    pub draft_proposed: usize,
    pub draft_accepted: usize,
    pub queue_ms: f64,
    pub ttft_ms: f64,
    /// First to last token.
    pub decode_ms: f64,
    /// (completion tokens − 1) / decode time.
    pub decode_tps: f64,
    pub e2e_ms: f64,
}

/// Speculative-decoding stats in the form AIPerf reads (`metrics.speculative_decoding`, agentx.md §2.4).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct SpecDecodeStats {
    /// Verify steps by number of accepted drafts (string keys, bonus token excluded).
    pub acceptance_histogram: BTreeMap<String, usize>,
    pub num_spec_steps: usize,
    pub mean_acceptance_length: f64,
    pub draft_acceptance_rate: f64,
    pub num_accepted_draft_tokens: usize,
    pub num_draft_tokens: usize,
    /// Present (true) only when acceptance was forced (`--spec-synthetic-al`): the text is not the model's.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub synthetic_acceptance: bool,
}

/// How a request ended.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// "stop", "length", "abort" or "tool_calls".
    pub finish_reason: &'static str,
    pub usage: Usage,
    pub timings: Timings,
    /// `None` when no drafts were verified.
    pub spec: Option<SpecDecodeStats>,
}

/// A step of progress.
#[derive(Clone, Debug)]
pub enum Progress {
    Delta(Delta),
    Done(Outcome),
}

/// One request in flight.
pub struct Generation {
    state: Arc<AppState>,
    id: RequestId,
    /// The request's waiting slot (`--max-waiting`), held until the engine starts it.
    queued: Option<QueueTicket>,
    events: mpsc::Receiver<EngineEvent>,
    reply: ReplyText,
    stop: StopStrings,
    arrival: Instant,
    started: Option<(usize, usize, Duration)>,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    completion_tokens: usize,
    /// Completion tokens when a stop string matched.
    stop_at_tokens: Option<usize>,
    acceptance: BTreeMap<String, usize>,
    spec_steps: usize,
    /// The outcome, once the terminal event arrived but a last delta was still to be returned.
    finished: Option<Outcome>,
    done: bool,
    /// Counted as running (the throughput line) from the engine's start until the generation ends.
    running: Option<Running>,
    /// The request's access-log line, told how the generation ended.
    access: Option<AccessEntry>,
}

impl Generation {
    /// Submits the request to the engine.
    pub async fn start(state: &Arc<AppState>, order: GenerationOrder) -> Result<Generation, ApiError> {
        let id = state.next_request_id();
        let (tx, rx) = mpsc::channel(EVENT_CHANNEL);
        let mut stop_token_ids = state.tokenizer().eos_ids().to_vec();
        stop_token_ids.extend_from_slice(&order.params.stop_token_ids);
        let request = GenerateRequest {
            id,
            prompt: order.prompt,
            continue_from: order.continue_from,
            keep_as: order.keep_as,
            sampling: order.params.sampling.clone(),
            max_tokens: order.max_tokens,
            ignore_eos: order.params.ignore_eos,
            stop_token_ids,
            arrival: order.arrival,
            num_spec_tokens: order.params.num_spec_tokens,
            constraint: order.constraint,
        };
        let reply = ReplyText::new(state.tokenizer(), order.reply)?;
        let queued = state.admission.enter()?;
        state.engine.submit(request, tx).await?;
        Ok(Generation {
            state: state.clone(),
            id,
            queued: Some(queued),
            events: rx,
            reply,
            stop: order.stop,
            arrival: order.arrival,
            started: None,
            first_token_at: None,
            last_token_at: None,
            completion_tokens: 0,
            stop_at_tokens: None,
            acceptance: BTreeMap::new(),
            spec_steps: 0,
            finished: None,
            done: false,
            running: None,
            access: None,
        })
    }

    /// Tells `entry` (the request's access-log line) the response's id and, at the end, how it went.
    pub fn log_to(&mut self, entry: Option<AccessEntry>, response_id: &str) {
        if let Some(entry) = &entry {
            entry.name(response_id);
        }
        self.access = entry;
    }

    /// The engine's id of this request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Prompt tokens as the engine reported them when the request started (0 before that).
    pub fn prompt_tokens(&self) -> usize {
        self.started.map_or(0, |(prompt, _, _)| prompt)
    }

    /// Cached prompt tokens as the engine reported them when the request started (0 before that).
    pub fn cached_tokens(&self) -> usize {
        self.started.map_or(0, |(_, cached, _)| cached)
    }

    /// Asks the engine to stop the request; it then finishes with reason "abort".
    pub async fn cancel(&self) {
        // A failed send means the engine is gone; `next` reports that.
        let _ = self.state.engine.cancel(self.id).await;
    }

    /// As [`Generation::next`], but `None` when the request is still waiting for the engine after `every` (the
    /// caller then shows the client it is queued, which is how a client that left is noticed). Before the
    /// request starts, `next` awaits nothing but its event channel, so giving up on it then loses nothing.
    pub async fn next_or_queued(&mut self, every: Duration) -> Option<Result<Progress, ApiError>> {
        if self.queued.is_none() {
            return Some(self.next().await);
        }
        tokio::select! {
            biased;
            progress = self.next() => Some(progress),
            () = tokio::time::sleep(every) => None,
        }
    }

    /// The next delta or the outcome. After `Done` (or an error) the generation is over.
    pub async fn next(&mut self) -> Result<Progress, ApiError> {
        if let Some(outcome) = self.finished.take() {
            self.done = true;
            return Ok(Progress::Done(outcome));
        }
        loop {
            let Some(event) = self.events.recv().await else {
                self.done = true;
                let e = ApiError::EngineUnavailable;
                self.end(|entry| entry.ended(format!("error:{}", e.kind())));
                return Err(e);
            };
            match event {
                EngineEvent::Started { prompt_tokens, cached_tokens, queue_time } => {
                    self.queued = None;
                    self.started = Some((prompt_tokens, cached_tokens, queue_time));
                    self.running = Some(self.state.throughput.started(prompt_tokens, cached_tokens));
                }
                EngineEvent::Tokens { tokens, logprobs, drafted, accepted } => {
                    self.state.throughput.step(tokens.len(), drafted, accepted);
                    if self.stop.matched() {
                        continue;
                    }
                    let now = Instant::now();
                    self.first_token_at.get_or_insert(now);
                    self.last_token_at = Some(now);
                    self.completion_tokens += tokens.len();
                    if drafted > 0 {
                        self.spec_steps += 1;
                        *self.acceptance.entry(accepted.to_string()).or_insert(0) += 1;
                    }
                    let pieces = self.reply.push(&tokens);
                    let text = self.stop.feed(&pieces.content);
                    if self.stop.matched() {
                        self.stop_at_tokens = Some(self.completion_tokens);
                        self.cancel().await;
                    }
                    return Ok(Progress::Delta(Delta {
                        text,
                        reasoning: pieces.reasoning,
                        tool_calls: pieces.calls,
                        tokens,
                        logprobs,
                        completion_tokens: self.completion_tokens,
                    }));
                }
                EngineEvent::Finished { reason, usage } => {
                    let mut tail = String::new();
                    let mut flushed = Default::default();
                    if !self.stop.matched() {
                        flushed = self.reply.finish();
                        tail = self.stop.feed(&std::mem::take(&mut flushed.content));
                        if !self.stop.matched() {
                            tail.push_str(&self.stop.finish());
                        }
                    }
                    let outcome = self.outcome(reason, usage);
                    self.record_metrics(&outcome);
                    self.end(|entry| entry.finished(&outcome));
                    if tail.is_empty() && flushed.reasoning.is_empty() && flushed.calls.is_empty() {
                        self.done = true;
                        return Ok(Progress::Done(outcome));
                    }
                    self.finished = Some(outcome);
                    return Ok(Progress::Delta(Delta {
                        text: tail,
                        reasoning: flushed.reasoning,
                        tool_calls: flushed.calls,
                        tokens: Vec::new(),
                        logprobs: Vec::new(),
                        completion_tokens: self.completion_tokens,
                    }));
                }
                EngineEvent::Failed(e) => {
                    self.done = true;
                    let e = match e {
                        EngineError::Stopped => ApiError::EngineUnavailable,
                        e => ApiError::Engine(e),
                    };
                    self.end(|entry| entry.ended(format!("error:{}", e.kind())));
                    return Err(e);
                }
            }
        }
    }

    /// The generation is over: no longer running; its access-log line told by `tell`.
    fn end(&mut self, tell: impl FnOnce(&AccessEntry)) {
        self.running = None;
        if let Some(entry) = &self.access {
            tell(entry);
        }
    }

    fn outcome(&self, reason: FinishReason, mut usage: Usage) -> Outcome {
        let finish_reason = match (self.stop_at_tokens, reason) {
            (Some(n), _) => {
                usage.completion_tokens = n;
                "stop"
            }
            (None, FinishReason::Stop) if self.reply.calls_ended() > 0 => "tool_calls",
            (None, r) => r.as_str(),
        };
        let end = self.last_token_at.unwrap_or_else(Instant::now);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let decode = match (self.first_token_at, self.last_token_at) {
            (Some(a), Some(b)) => b - a,
            _ => Duration::ZERO,
        };
        let decode_tps = if usage.completion_tokens > 1 && !decode.is_zero() {
            (usage.completion_tokens - 1) as f64 / decode.as_secs_f64()
        } else {
            0.0
        };
        let timings = Timings {
            prompt_tokens: usage.prompt_tokens,
            cached_tokens: usage.cached_tokens,
            prefill_tokens: usage.prompt_tokens.saturating_sub(usage.cached_tokens),
            completion_tokens: usage.completion_tokens,
            draft_proposed: usage.draft_tokens,
            draft_accepted: usage.accepted_draft_tokens,
            queue_ms: self.started.map_or(0.0, |(_, _, q)| ms(q)),
            ttft_ms: self.first_token_at.map_or(0.0, |t| ms(t - self.arrival)),
            decode_ms: ms(decode),
            decode_tps,
            e2e_ms: ms(end - self.arrival),
        };
        let spec = (self.spec_steps > 0).then(|| SpecDecodeStats {
            acceptance_histogram: self.acceptance.clone(),
            num_spec_steps: self.spec_steps,
            mean_acceptance_length: 1.0 + usage.accepted_draft_tokens as f64 / self.spec_steps as f64,
            draft_acceptance_rate: if usage.draft_tokens == 0 {
                0.0
            } else {
                usage.accepted_draft_tokens as f64 / usage.draft_tokens as f64
            },
            num_accepted_draft_tokens: usage.accepted_draft_tokens,
            num_draft_tokens: usage.draft_tokens,
            synthetic_acceptance: usage.forced_acceptance,
        });
        Outcome { finish_reason, usage, timings, spec }
    }

    /// The metrics the API layer owns (see `metrics.rs`): e2e, per-request TPOT, success, lengths, interactivity.
    fn record_metrics(&self, o: &Outcome) {
        let t = &o.timings;
        metrics::counter!(m::REQUEST_SUCCESS_TOTAL, "finished_reason" => o.finish_reason).increment(1);
        metrics::histogram!(m::E2E_REQUEST_LATENCY_SECONDS).record(t.e2e_ms / 1e3);
        metrics::histogram!(m::REQUEST_PROMPT_TOKENS).record(o.usage.prompt_tokens as f64);
        metrics::histogram!(m::REQUEST_GENERATION_TOKENS).record(o.usage.completion_tokens as f64);
        if o.usage.completion_tokens > 1 {
            let itl = t.decode_ms / 1e3 / (o.usage.completion_tokens - 1) as f64;
            metrics::histogram!(m::REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS).record(itl);
            self.state.record_request_itl(itl);
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.done {
            // Dropping `events` closes the request's channel: the engine's next send fails, and it cancels the
            // request, frees its state and counts the disconnect.
            metrics::counter!(m::REQUEST_SUCCESS_TOTAL, "finished_reason" => FinishReason::Cancelled.as_str())
                .increment(1);
            self.end(|entry| entry.ended(FinishReason::Cancelled.as_str().to_owned()));
        }
    }
}
