//! The pure scheduler: which tokens of which sequences the next step computes.
//!
//! Follows vLLM v1's two-counter model (`vllm/v1/core/sched/scheduler.py`): a sequence has no
//! prefill or decode mode, only `tokens` (prompt plus output so far, plus attached drafts) and
//! `computed` (tokens committed to its state). Each step assigns tokens so that `computed` catches
//! up with `tokens.len()`; a row that reaches the end samples. Prefill, chunked prefill, restored
//! prefixes (`computed` starts above zero) and draft verification are all the same subtraction.
//!
//! Invariants:
//! - Pure: no runner, no channel, no clock. Time enters as the `now` argument; everything else is a
//!   deterministic function of the calls made.
//! - A running sequence always has `computed < tokens.len()`: the last emitted token is never in the
//!   state (the runner contract), so every sequence has at least one token to feed.
//! - A step never plans more than `max_num_batched_tokens` tokens (drafts included) nor more than
//!   `max_num_seqs` rows; at most `max_num_seqs` sequences are running.
//! - Order: rows that will sample (decode rows, including ones carrying drafts) are planned first,
//!   in admission order, so inter-token latency does not wait on long prompts; the remaining budget
//!   goes to prefill chunks: first the prompts with at most [`LONG_PREFILL_TOKENS`] left to compute, then the
//!   longer ones, each group in admission order. So an agent's next turn (a tool result, a user message over a
//!   restored conversation) is not queued behind another conversation's uncached history (follows vLLM V0's
//!   partial prefills, where prompts under `long_prefill_token_threshold` jump ahead of long ones). Admission from
//!   the waiting queue is FCFS.
//! - Preemption-free: a running sequence keeps its state until it finishes, is cancelled or fails.
//!   A shortage of memory is handled by evicting idle kept states (see `sessions`), never by
//!   evicting a running one.
//! - A prefill chunk never runs past the sequence's next `chunk_stop` (a block boundary where the
//!   engine wants a prefix-cache snapshot: a KDA state cannot be rewound, so the snapshot must be
//!   taken exactly when passing the boundary).
//! - Drafts are capped so that accepted drafts plus the bonus token never exceed `max_tokens`.
//! - A step planned ahead ([`Scheduler::schedule_ahead`]) repeats the steady decode of the step in flight and
//!   never lets a sequence pass `max_tokens`; only a stop token (or a cancel) can end a sequence whose next
//!   step is already in flight.
//! - With a step-time limit ([`StepTimeLimit`]), each prefill row of a step that has decode rows takes at most the
//!   limit's allowance beside the rows planned before it (the predicted step time stays within the target, and
//!   the first prompt in the order above still advances by at least the limit's minimum chunk); a step without
//!   decode rows gives prefill the whole `max_num_batched_tokens`. Decode rows are never cut by the limit.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use sparkd_kernels::runner::{RowOutput, SampleRequest, SamplingParams, TokenLogprob};
use sparkd_kernels::TokenId;

use super::step_time::{NextPrefill, StepShape, StepTimeLimit};
use super::types::{EngineEvent, FinishReason, GenerateRequest, RequestId, Usage};

/// A prompt with more than this many tokens left to compute is long: prompts with fewer are planned before it.
/// An agent turn's new tokens over a restored conversation are tens to hundreds; an uncached history is thousands.
pub const LONG_PREFILL_TOKENS: usize = 512;

/// Limits the scheduler plans under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerLimits {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
}

/// One sequence as the scheduler sees it.
#[derive(Clone, Debug)]
struct Sequence {
    id: RequestId,
    /// Prompt (for a continuation: the kept history plus the new tokens), then output tokens.
    tokens: Vec<TokenId>,
    prompt_len: usize,
    /// Tokens committed to the state.
    computed: usize,
    /// `computed` when the sequence was admitted (restored from a kept response or the prefix cache).
    cached: usize,
    /// Draft tokens to verify after the last token, attached by a proposer.
    drafts: Vec<TokenId>,
    /// Ascending positions at which a prefill chunk must end.
    chunk_stops: Vec<usize>,
    sampling: SamplingParams,
    max_tokens: usize,
    ignore_eos: bool,
    stop_token_ids: Vec<TokenId>,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    started_sent: bool,
    draft_tokens: usize,
    accepted_draft_tokens: usize,
}

impl Sequence {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// `forced`: the runner forces acceptance, so a request that verified drafts is flagged.
    fn usage(&self, forced: bool) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.output_len(),
            cached_tokens: self.cached,
            draft_tokens: self.draft_tokens,
            accepted_draft_tokens: self.accepted_draft_tokens,
            forced_acceptance: forced && self.draft_tokens > 0,
        }
    }
}

/// One row of a step plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedRow {
    pub id: RequestId,
    /// The sequence's `computed` when planned (the position of `tokens[0]`).
    pub start: usize,
    /// Tokens fed this step: a prefill chunk, or the unfed tail followed by `draft_len` drafts.
    pub tokens: Vec<TokenId>,
    /// `Some` when the row reaches the end of the sequence and produces tokens.
    pub sample: Option<SampleRequest>,
}

/// What one step computes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPlan {
    pub rows: Vec<PlannedRow>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Tokens the step computes, drafts included.
    pub fn num_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens.len()).sum()
    }
}

/// A sequence that left the scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct FinishedSeq {
    pub id: RequestId,
    pub reason: FinishReason,
    /// Prompt plus output (truncated at a stop token or `max_tokens`).
    pub tokens: Vec<TokenId>,
    /// Tokens committed to the state. Equal to `tokens.len() - 1`, or `tokens.len()` once a step launched
    /// ahead has fed the last token, unless accepted drafts ran past a stop token (then the state holds
    /// tokens the history does not, and must not be kept).
    pub computed: usize,
    pub usage: Usage,
}

impl FinishedSeq {
    /// Whether the state holds exactly a prefix of the history that a continuation can build on: the
    /// history minus its last (unfed) token, or the whole history (a step launched ahead fed that last
    /// token before the sequence was seen to finish).
    pub fn state_matches_history(&self) -> bool {
        self.computed + 1 == self.tokens.len() || self.computed == self.tokens.len()
    }
}

/// A step planned before the outputs of the step in flight are known (asynchronous scheduling): exactly
/// that step's rows, each a decode row fed the one token the step in flight emits for it.
#[derive(Clone, Debug, PartialEq)]
pub struct AheadPlan {
    pub rows: Vec<AheadRow>,
}

/// One row of an [`AheadPlan`].
#[derive(Clone, Debug, PartialEq)]
pub struct AheadRow {
    pub id: RequestId,
    /// The position of the fed token: the row's `start` in the step in flight, plus one.
    pub start: usize,
    pub params: SamplingParams,
    /// Output tokens the sequence may still produce at this step (at least one).
    pub new_tokens_left: usize,
}

/// A row that ended exactly on a multiple of the snapshot block after a step: on a planned prefill stop,
/// or after a decoding (sampling) row; a prompt chunk that ends on a multiple by chance is not one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BoundaryHit {
    pub id: RequestId,
    /// The tokens in the state; their count is a multiple of the block size.
    pub tokens: Vec<TokenId>,
    /// Whether the boundary is one of the sequence's prefill `chunk_stops` (else it was passed while decoding).
    pub planned: bool,
}

/// The result of applying a step's outputs.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Events in order, for each request.
    pub events: Vec<(RequestId, EngineEvent)>,
    /// Sequences that finished in this step.
    pub finished: Vec<FinishedSeq>,
    /// Rows whose state now ends on a snapshot block boundary (see [`BoundaryHit`]).
    pub boundaries: Vec<BoundaryHit>,
    /// Tokens emitted by this step, per row that sampled: `(request, count)` (for ITL samples).
    pub emitted: Vec<(RequestId, usize)>,
}

/// A request the scheduler cannot take.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("request {0} is already scheduled")]
    Duplicate(RequestId),
    #[error("request {0} is not running")]
    NotRunning(RequestId),
    #[error("request {id}: restored length {computed} must be below the sequence length {len}")]
    RestoreTooLong { id: RequestId, computed: usize, len: usize },
    #[error("step results have {got} rows, the plan has {want}")]
    RowCount { got: usize, want: usize },
    #[error("request {id}: a step launched ahead feeds position {start}, but {computed} tokens are committed")]
    AheadMismatch { id: RequestId, start: usize, computed: usize },
}

/// The scheduler's state: a FCFS waiting queue and the running sequences in admission order.
#[derive(Debug)]
pub struct Scheduler {
    limits: SchedulerLimits,
    /// Snapshot block size (tokens): rows ending on a multiple of it are reported.
    block_tokens: usize,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// Drafts are accepted by a forced schedule (usage is flagged).
    forced_acceptance: bool,
    /// Limits the prefill of steps that have decode rows; `None`: prefill takes what the budget leaves.
    step_time: Option<StepTimeLimit>,
}

/// A running sequence that decodes at the next step, as a proposer sees it.
#[derive(Clone, Copy, Debug)]
pub struct DecodeSlot<'a> {
    pub id: RequestId,
    /// Prompt plus output; the last token is the one the next step feeds.
    pub tokens: &'a [TokenId],
    /// Output tokens the sequence may still produce.
    pub new_tokens_left: usize,
    pub sampling: &'a SamplingParams,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits, block_tokens: usize) -> Self {
        Scheduler {
            limits,
            block_tokens: block_tokens.max(1),
            waiting: VecDeque::new(),
            running: Vec::new(),
            forced_acceptance: false,
            step_time: None,
        }
    }

    /// Holds steps that have decode rows to `limit` (`None`: no limit).
    pub fn set_step_time_limit(&mut self, limit: Option<StepTimeLimit>) {
        self.step_time = limit;
    }

    /// Declares that the runner forces draft acceptance (`Usage::forced_acceptance`).
    pub fn set_forced_acceptance(&mut self, forced: bool) {
        self.forced_acceptance = forced;
    }

    /// Running sequences whose next row decodes (they have output and exactly one unfed token), in
    /// admission order: the rows that can carry drafts.
    pub fn decode_slots(&self) -> Vec<DecodeSlot<'_>> {
        self.running
            .iter()
            .filter(|s| s.output_len() > 0 && s.computed + 1 == s.tokens.len())
            .map(|s| DecodeSlot {
                id: s.id,
                tokens: &s.tokens,
                new_tokens_left: s.max_tokens.saturating_sub(s.output_len()),
                sampling: &s.sampling,
            })
            .collect()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Ids of the waiting sequences, in admission order.
    pub fn waiting_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.waiting.iter().map(|s| s.id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Ids of the running sequences, in admission order.
    pub fn running_ids(&self) -> Vec<RequestId> {
        self.running.iter().map(|s| s.id).collect()
    }

    /// The full token list (prompt, output) of a waiting or running sequence.
    pub fn tokens(&self, id: RequestId) -> Option<&[TokenId]> {
        self.find(id).map(|s| s.tokens.as_slice())
    }

    /// Prompt length of a waiting or running sequence.
    pub fn prompt_len(&self, id: RequestId) -> Option<usize> {
        self.find(id).map(|s| s.prompt_len)
    }

    fn find(&self, id: RequestId) -> Option<&Sequence> {
        self.running.iter().chain(self.waiting.iter()).find(|s| s.id == id)
    }

    /// Queues a request whose prompt is `history ++ request.prompt` (`history` is a kept response's
    /// tokens when continuing, else empty). The prompt must not be empty and `max_tokens` must be at least 1.
    pub fn add(&mut self, request: &GenerateRequest, history: &[TokenId]) -> Result<(), ScheduleError> {
        if self.find(request.id).is_some() {
            return Err(ScheduleError::Duplicate(request.id));
        }
        let mut tokens = Vec::with_capacity(history.len() + request.prompt.len() + request.max_tokens);
        tokens.extend_from_slice(history);
        tokens.extend_from_slice(&request.prompt);
        self.waiting.push_back(Sequence {
            id: request.id,
            prompt_len: tokens.len(),
            tokens,
            computed: 0,
            cached: 0,
            drafts: Vec::new(),
            chunk_stops: Vec::new(),
            sampling: request.sampling.clone(),
            max_tokens: request.max_tokens.max(1),
            ignore_eos: request.ignore_eos,
            stop_token_ids: request.stop_token_ids.clone(),
            arrival: request.arrival,
            first_scheduled: None,
            started_sent: false,
            draft_tokens: 0,
            accepted_draft_tokens: 0,
        });
        Ok(())
    }

    /// Moves waiting sequences to running, FCFS, up to `max_num_seqs` running. The caller gives each
    /// admitted sequence a state and then calls [`Scheduler::restore`] with its restored length.
    pub fn admit(&mut self) -> Vec<RequestId> {
        let mut admitted = Vec::new();
        while self.running.len() < self.limits.max_num_seqs {
            let Some(seq) = self.waiting.pop_front() else { break };
            admitted.push(seq.id);
            self.running.push(seq);
        }
        admitted
    }

    /// Sets a running sequence's restored length (tokens already in its state) and the block
    /// boundaries at which its prefill chunks must end.
    pub fn restore(&mut self, id: RequestId, computed: usize, chunk_stops: Vec<usize>) -> Result<(), ScheduleError> {
        let seq = self.running.iter_mut().find(|s| s.id == id).ok_or(ScheduleError::NotRunning(id))?;
        if computed >= seq.tokens.len() {
            return Err(ScheduleError::RestoreTooLong { id, computed, len: seq.tokens.len() });
        }
        seq.computed = computed;
        seq.cached = computed;
        let mut stops: Vec<usize> =
            chunk_stops.into_iter().filter(|&p| p > computed && p <= seq.tokens.len()).collect();
        stops.sort_unstable();
        stops.dedup();
        seq.chunk_stops = stops;
        Ok(())
    }

    /// Attaches draft tokens to verify at the next step (replacing earlier ones).
    pub fn set_drafts(&mut self, id: RequestId, drafts: Vec<TokenId>) -> Result<(), ScheduleError> {
        let seq = self.running.iter_mut().find(|s| s.id == id).ok_or(ScheduleError::NotRunning(id))?;
        seq.drafts = drafts;
        Ok(())
    }

    /// Plans the next step. `now` marks first scheduling (queue time).
    pub fn schedule(&mut self, now: Instant) -> StepPlan {
        let mut budget = self.limits.max_num_batched_tokens;
        let max_rows = self.limits.max_num_seqs;
        let mut rows: Vec<(usize, PlannedRow)> = Vec::new();
        // Pass 1: decode rows (sequences that have produced output), with their drafts.
        for (index, seq) in self.running.iter().enumerate() {
            if rows.len() == max_rows || budget == 0 {
                break;
            }
            let unfed = seq.tokens.len() - seq.computed;
            if seq.output_len() == 0 || unfed > budget {
                continue;
            }
            // Accepted drafts plus the bonus token must fit in max_tokens.
            let room = seq.max_tokens.saturating_sub(seq.output_len() + 1);
            let draft_len = seq.drafts.len().min(room).min(budget - unfed);
            let mut tokens = seq.tokens[seq.computed..].to_vec();
            tokens.extend_from_slice(&seq.drafts[..draft_len]);
            budget -= tokens.len();
            let sample = Some(SampleRequest::new(seq.sampling.clone(), draft_len));
            rows.push((index, PlannedRow { id: seq.id, start: seq.computed, tokens, sample }));
        }
        // With decode rows planned, each prefill row gets what the step-time limit allows beside the rows before it.
        let decode =
            rows.iter().fold(StepShape::default(), |shape, (_, row)| shape.with_row(row.tokens.len(), row.start));
        let limit = self.step_time.as_ref().filter(|_| decode.rows > 0).map(|l| (l, l.target_seconds(decode)));
        let mut planned = decode;
        // Pass 2: prompt chunks with what is left of the budget, short prompts first (module invariants).
        let (short, long): (Vec<_>, Vec<_>) = self
            .running
            .iter()
            .enumerate()
            .filter(|(_, seq)| seq.output_len() == 0)
            .partition(|(_, seq)| seq.tokens.len() - seq.computed <= LONG_PREFILL_TOKENS);
        for (index, seq) in short.into_iter().chain(long) {
            let allowance = match limit {
                Some((limit, target)) => {
                    let next = NextPrefill { context: seq.computed, room: budget, first: planned == decode };
                    limit.chunk_allowance(planned, target, next)
                }
                None => budget,
            };
            if rows.len() == max_rows || allowance == 0 {
                break;
            }
            let unfed = seq.tokens.len() - seq.computed;
            let to_stop = seq.chunk_stops.first().map_or(usize::MAX, |s| s - seq.computed);
            let chunk = unfed.min(to_stop).min(allowance);
            budget -= chunk;
            planned = planned.with_row(chunk, seq.computed);
            let end = seq.computed + chunk;
            let sample = (end == seq.tokens.len()).then(|| SampleRequest::new(seq.sampling.clone(), 0));
            let tokens = seq.tokens[seq.computed..end].to_vec();
            rows.push((index, PlannedRow { id: seq.id, start: seq.computed, tokens, sample }));
        }
        rows.sort_by_key(|(index, _)| *index);
        for (index, _) in &rows {
            self.running[*index].first_scheduled.get_or_insert(now);
        }
        StepPlan { rows: rows.into_iter().map(|(_, row)| row).collect() }
    }

    /// Plans the step after `in_flight` before its outputs are known (follows vLLM v1's asynchronous
    /// scheduling), or `None` when that step must wait for them. It is planned only for a steady decode:
    /// nothing waits for admission, `in_flight` holds every running sequence as a one-token sampling row
    /// without drafts, each may emit at least two more tokens (so the step in flight cannot finish it by
    /// length), has no drafts attached, and does not reach a snapshot block boundary in the step in flight
    /// (its state must be exported exactly there). A sequence may still finish in the step in flight (a stop
    /// token), or leave; the engine then drops the fed row's output ([`Scheduler::resolve_ahead`]).
    pub fn schedule_ahead(&self, in_flight: &StepPlan) -> Option<AheadPlan> {
        if !self.waiting.is_empty() || in_flight.is_empty() || in_flight.rows.len() != self.running.len() {
            return None;
        }
        let mut rows = Vec::with_capacity(in_flight.rows.len());
        for (row, seq) in in_flight.rows.iter().zip(&self.running) {
            let decodes = row.tokens.len() == 1 && row.sample.as_ref().is_some_and(|s| s.draft_len == 0);
            let steady = row.id == seq.id && seq.computed == row.start && seq.tokens.len() == row.start + 1;
            let room = seq.output_len() + 2 <= seq.max_tokens;
            if !decodes || !steady || !room || !seq.drafts.is_empty() || (row.start + 1) % self.block_tokens == 0 {
                return None;
            }
            let new_tokens_left = seq.max_tokens - seq.output_len() - 1;
            rows.push(AheadRow { id: seq.id, start: row.start + 1, params: seq.sampling.clone(), new_tokens_left });
        }
        Some(AheadPlan { rows })
    }

    /// The plan of a step launched ahead, once the outputs of the step before it are applied: a row per
    /// sequence of `ahead` that is still running, fed its one unfed token. Rows of sequences that left are
    /// left out (their outputs are dropped). A running sequence that is not exactly one token past the
    /// row's start is an error (the engine applied something the plan did not foresee).
    pub fn resolve_ahead(&self, ahead: &AheadPlan) -> Result<StepPlan, ScheduleError> {
        let mut rows = Vec::with_capacity(ahead.rows.len());
        for row in &ahead.rows {
            let Some(seq) = self.running.iter().find(|s| s.id == row.id) else { continue };
            if seq.computed != row.start || seq.tokens.len() != row.start + 1 {
                return Err(ScheduleError::AheadMismatch { id: row.id, start: row.start, computed: seq.computed });
            }
            let sample = Some(SampleRequest::new(row.params.clone(), 0));
            rows.push(PlannedRow { id: row.id, start: row.start, tokens: vec![seq.tokens[row.start]], sample });
        }
        Ok(StepPlan { rows })
    }

    /// Applies a step's outputs (one per planned row, in order): advances `computed`, appends emitted
    /// tokens, finishes sequences, and returns the events to send.
    pub fn apply(&mut self, plan: &StepPlan, outputs: &[RowOutput]) -> Result<StepOutcome, ScheduleError> {
        if plan.rows.len() != outputs.len() {
            return Err(ScheduleError::RowCount { got: outputs.len(), want: plan.rows.len() });
        }
        let mut outcome = StepOutcome::default();
        for (row, out) in plan.rows.iter().zip(outputs) {
            let Some(index) = self.running.iter().position(|s| s.id == row.id) else {
                return Err(ScheduleError::NotRunning(row.id));
            };
            let block = self.block_tokens;
            let seq = &mut self.running[index];
            if !seq.started_sent {
                seq.started_sent = true;
                let queue_time =
                    seq.first_scheduled.map_or(Duration::ZERO, |t| t.saturating_duration_since(seq.arrival));
                outcome.events.push((
                    seq.id,
                    EngineEvent::Started { prompt_tokens: seq.prompt_len, cached_tokens: seq.cached, queue_time },
                ));
            }
            let finish = match &row.sample {
                None => {
                    seq.computed += row.tokens.len();
                    None
                }
                Some(sample) => {
                    let accepted = out.num_accepted.min(sample.draft_len);
                    seq.computed += row.tokens.len() - sample.draft_len + accepted;
                    seq.drafts.clear();
                    seq.draft_tokens += sample.draft_len;
                    seq.accepted_draft_tokens += accepted;
                    let (emitted, logprobs, reason) = Self::take_emitted(seq, &out.tokens, &out.logprobs);
                    seq.tokens.extend_from_slice(&emitted);
                    outcome.emitted.push((seq.id, emitted.len()));
                    outcome.events.push((
                        seq.id,
                        EngineEvent::Tokens { tokens: emitted, logprobs, drafted: sample.draft_len, accepted },
                    ));
                    reason
                }
            };
            let planned = seq.chunk_stops.first() == Some(&seq.computed);
            while seq.chunk_stops.first().is_some_and(|&s| s <= seq.computed) {
                seq.chunk_stops.remove(0);
            }
            // A prompt chunk that ends on a block by chance is not reported: the planned stop at the
            // prompt's last block boundary covers more, and each report costs the engine a state export.
            let decoded = row.sample.is_some();
            if seq.computed % block == 0 && seq.computed > row.start && (planned || decoded) {
                let tokens = seq.tokens[..seq.computed].to_vec();
                outcome.boundaries.push(BoundaryHit { id: seq.id, tokens, planned });
            }
            if let Some(reason) = finish {
                let seq = self.running.remove(index);
                let usage = seq.usage(self.forced_acceptance);
                outcome.events.push((seq.id, EngineEvent::Finished { reason, usage }));
                outcome.finished.push(FinishedSeq {
                    id: seq.id,
                    reason,
                    computed: seq.computed,
                    usage,
                    tokens: seq.tokens,
                });
            }
        }
        Ok(outcome)
    }

    /// The tokens of one sampled row that join the sequence, their log-probabilities, and the finish
    /// reason if one of them ends it.
    fn take_emitted(
        seq: &Sequence,
        tokens: &[TokenId],
        logprobs: &[TokenLogprob],
    ) -> (Vec<TokenId>, Vec<TokenLogprob>, Option<FinishReason>) {
        let mut kept = Vec::with_capacity(tokens.len());
        let mut reason = None;
        for &t in tokens {
            kept.push(t);
            if !seq.ignore_eos && seq.stop_token_ids.contains(&t) {
                reason = Some(FinishReason::Stop);
                break;
            }
            if seq.output_len() + kept.len() >= seq.max_tokens {
                reason = Some(FinishReason::Length);
                break;
            }
        }
        let lp = logprobs.iter().take(kept.len()).cloned().collect();
        (kept, lp, reason)
    }

    /// Removes a waiting or running sequence (cancel, client gone, failure) and returns it as
    /// finished with `reason`; `None` when the id is unknown.
    pub fn remove(&mut self, id: RequestId, reason: FinishReason) -> Option<FinishedSeq> {
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i)?
        };
        let usage = seq.usage(self.forced_acceptance);
        Some(FinishedSeq { id, reason, computed: seq.computed, usage, tokens: seq.tokens })
    }

    /// Whether the sequence is in the running set (it may hold a state).
    pub fn is_running(&self, id: RequestId) -> bool {
        self.running.iter().any(|s| s.id == id)
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
