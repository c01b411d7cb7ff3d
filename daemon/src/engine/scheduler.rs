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
//!   goes to prefill chunks in admission order (FCFS). Admission from the waiting queue is FCFS.
//! - Preemption-free: a running sequence keeps its state until it finishes, is cancelled or fails.
//!   A shortage of memory is handled by evicting idle kept states (see `sessions`), never by
//!   evicting a running one.
//! - A prefill chunk never runs past the sequence's next `chunk_stop` (a block boundary where the
//!   engine wants a prefix-cache snapshot: a KDA state cannot be rewound, so the snapshot must be
//!   taken exactly when passing the boundary).
//! - Drafts are capped so that accepted drafts plus the bonus token never exceed `max_tokens`.
//! - With a step-time limit ([`StepTimeLimit`]), a step that has decode rows adds at most the limit's
//!   prefill allowance for those rows' tokens (the predicted step time stays within the target, and
//!   the oldest prompt still advances by at least the limit's minimum chunk); a step without decode
//!   rows gives prefill the whole `max_num_batched_tokens`. Decode rows are never cut by the limit.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use sparkd_kernels::runner::{RowOutput, SampleRequest, SamplingParams, TokenLogprob};
use sparkd_kernels::TokenId;

use super::step_time::StepTimeLimit;
use super::types::{EngineEvent, FinishReason, GenerateRequest, RequestId, Usage};

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
    /// Tokens committed to the state. Equal to `tokens.len() - 1` unless accepted drafts ran past a
    /// stop token (then the state holds tokens the history does not, and must not be kept).
    pub computed: usize,
    pub usage: Usage,
}

impl FinishedSeq {
    /// Whether the state holds exactly the history minus its last (unfed) token.
    pub fn state_matches_history(&self) -> bool {
        self.computed + 1 == self.tokens.len()
    }
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
            let sample = Some(SampleRequest { params: seq.sampling.clone(), draft_len });
            rows.push((index, PlannedRow { id: seq.id, start: seq.computed, tokens, sample }));
        }
        // With decode rows planned, prefill gets what the step-time limit allows of the budget left.
        if let (Some(limit), false) = (&self.step_time, rows.is_empty()) {
            budget = limit.prefill_allowance(self.limits.max_num_batched_tokens - budget, budget);
        }
        // Pass 2: prompt chunks, FCFS, with what is left of the budget.
        for (index, seq) in self.running.iter().enumerate() {
            if rows.len() == max_rows || budget == 0 {
                break;
            }
            if seq.output_len() > 0 {
                continue;
            }
            let unfed = seq.tokens.len() - seq.computed;
            let to_stop = seq.chunk_stops.first().map_or(usize::MAX, |s| s - seq.computed);
            let chunk = unfed.min(to_stop).min(budget);
            budget -= chunk;
            let end = seq.computed + chunk;
            let sample =
                (end == seq.tokens.len()).then(|| SampleRequest { params: seq.sampling.clone(), draft_len: 0 });
            let tokens = seq.tokens[seq.computed..end].to_vec();
            rows.push((index, PlannedRow { id: seq.id, start: seq.computed, tokens, sample }));
        }
        rows.sort_by_key(|(index, _)| *index);
        for (index, _) in &rows {
            self.running[*index].first_scheduled.get_or_insert(now);
        }
        StepPlan { rows: rows.into_iter().map(|(_, row)| row).collect() }
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
mod tests {
    use super::super::step_time::{linear_costs, StepTarget};
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const BLOCK: usize = 8;

    fn request(id: u64, prompt_len: usize, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            id: RequestId(id),
            prompt: (0..prompt_len as TokenId).map(|t| 100 + t).collect(),
            continue_from: None,
            keep_as: None,
            sampling: SamplingParams::greedy(),
            max_tokens,
            ignore_eos: false,
            stop_token_ids: vec![2],
            arrival: Instant::now(),
            num_spec_tokens: None,
        }
    }

    fn scheduler(budget: usize, seqs: usize) -> Scheduler {
        Scheduler::new(SchedulerLimits { max_num_batched_tokens: budget, max_num_seqs: seqs }, BLOCK)
    }

    /// Adds and admits requests with nothing restored.
    fn start(s: &mut Scheduler, requests: &[GenerateRequest]) {
        for r in requests {
            s.add(r, &[]).unwrap();
        }
        for id in s.admit() {
            s.restore(id, 0, Vec::new()).unwrap();
        }
    }

    /// A fake runner: every sampling row emits `token` (plus its drafts, all accepted if `accept_all`).
    fn outputs(plan: &StepPlan, token: TokenId, accept_all: bool) -> Vec<RowOutput> {
        plan.rows
            .iter()
            .map(|row| match &row.sample {
                None => RowOutput::default(),
                Some(s) => {
                    let accepted = if accept_all { s.draft_len } else { 0 };
                    let mut tokens = row.tokens[row.tokens.len() - s.draft_len..][..accepted].to_vec();
                    tokens.push(token);
                    RowOutput { tokens, num_accepted: accepted, logprobs: Vec::new() }
                }
            })
            .collect()
    }

    fn row_lens(plan: &StepPlan) -> Vec<(u64, usize, bool)> {
        plan.rows.iter().map(|r| (r.id.0, r.tokens.len(), r.sample.is_some())).collect()
    }

    #[test]
    fn prefill_is_chunked_under_the_token_budget_in_fcfs_order() {
        let mut s = scheduler(10, 8);
        start(&mut s, &[request(1, 14, 4), request(2, 5, 4)]);
        let now = Instant::now();
        let plan = s.schedule(now);
        assert_eq!(row_lens(&plan), vec![(1, 10, false)], "the first request takes the whole budget");
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        let plan = s.schedule(now);
        assert_eq!(row_lens(&plan), vec![(1, 4, true), (2, 5, true)]);
        assert_eq!(plan.rows[0].start, 10);
        assert!(plan.num_tokens() <= 10);
    }

    #[test]
    fn decode_rows_come_before_prefill_and_mix_in_one_step() {
        let mut s = scheduler(6, 8);
        let now = Instant::now();
        start(&mut s, &[request(1, 3, 10)]);
        let plan = s.schedule(now);
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        start(&mut s, &[request(2, 20, 10)]);
        let plan = s.schedule(now);
        // Request 1 decodes one token; request 2 gets the remaining 5 tokens of budget.
        assert_eq!(row_lens(&plan), vec![(1, 1, true), (2, 5, false)]);
        assert_eq!(plan.rows[0].tokens, vec![7]);
    }

    #[test]
    fn admission_is_fcfs_and_bounded_by_max_num_seqs() {
        let mut s = scheduler(100, 2);
        for id in 1..=3 {
            s.add(&request(id, 2, 1), &[]).unwrap();
        }
        assert_eq!(s.admit(), vec![RequestId(1), RequestId(2)]);
        assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
        for id in [1, 2] {
            s.restore(RequestId(id), 0, Vec::new()).unwrap();
        }
        let plan = s.schedule(Instant::now());
        let out = s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        assert_eq!(out.finished.len(), 2, "max_tokens 1: both finish after one step");
        assert_eq!(s.admit(), vec![RequestId(3)]);
    }

    #[test]
    fn finishes_on_max_tokens_and_on_stop_ids_unless_ignore_eos() {
        let mut s = scheduler(100, 8);
        let mut ignoring = request(3, 2, 2);
        ignoring.ignore_eos = true;
        start(&mut s, &[request(1, 2, 3), request(2, 2, 3), ignoring]);
        let now = Instant::now();
        let mut finished = Vec::new();
        for step in 0..3 {
            let plan = s.schedule(now);
            // Request 2 is given the stop id 2 at its second token; the others get 7s.
            let mut outs = outputs(&plan, 7, false);
            for (row, out) in plan.rows.iter().zip(outs.iter_mut()) {
                if step == 1 && row.id.0 != 1 {
                    out.tokens = vec![2];
                }
            }
            finished.extend(s.apply(&plan, &outs).unwrap().finished);
        }
        let by_id = |id: u64| finished.iter().find(|f| f.id.0 == id).unwrap();
        assert_eq!((by_id(1).reason, by_id(1).usage.completion_tokens), (FinishReason::Length, 3));
        assert_eq!((by_id(2).reason, by_id(2).tokens.last().copied()), (FinishReason::Stop, Some(2)));
        assert_eq!(by_id(2).usage.completion_tokens, 2);
        assert_eq!((by_id(3).reason, by_id(3).usage.completion_tokens), (FinishReason::Length, 2));
        assert!(finished.iter().all(FinishedSeq::state_matches_history));
        assert!(!s.has_work());
    }

    #[test]
    fn events_come_in_order_started_tokens_finished() {
        let mut s = scheduler(100, 8);
        let mut r = request(1, 4, 2);
        r.arrival = Instant::now();
        start(&mut s, &[r.clone()]);
        let later = r.arrival + Duration::from_millis(5);
        let mut kinds = Vec::new();
        while s.has_work() {
            let plan = s.schedule(later);
            for (_, e) in s.apply(&plan, &outputs(&plan, 7, false)).unwrap().events {
                kinds.push(match e {
                    EngineEvent::Started { queue_time, prompt_tokens, .. } => {
                        assert_eq!((queue_time, prompt_tokens), (Duration::from_millis(5), 4));
                        "started"
                    }
                    EngineEvent::Tokens { .. } => "tokens",
                    EngineEvent::Finished { .. } => "finished",
                    EngineEvent::Failed(_) => "failed",
                });
            }
        }
        assert_eq!(kinds, vec!["started", "tokens", "tokens", "finished"]);
    }

    #[test]
    fn cancel_removes_waiting_and_running_sequences() {
        let mut s = scheduler(100, 1);
        start(&mut s, &[request(1, 3, 5), request(2, 3, 5)]);
        let plan = s.schedule(Instant::now());
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        let running = s.remove(RequestId(1), FinishReason::Cancelled).unwrap();
        assert_eq!((running.usage.completion_tokens, running.computed), (1, 3));
        let waiting = s.remove(RequestId(2), FinishReason::Cancelled).unwrap();
        assert_eq!((waiting.usage.completion_tokens, waiting.computed), (0, 0));
        assert!(s.remove(RequestId(2), FinishReason::Cancelled).is_none());
        assert!(!s.has_work());
        assert!(s.schedule(Instant::now()).is_empty());
    }

    #[test]
    fn restored_prefix_is_not_recomputed_and_chunks_stop_at_boundaries() {
        let mut s = scheduler(100, 4);
        s.add(&request(1, 30, 3), &[]).unwrap();
        s.admit();
        assert!(matches!(s.restore(RequestId(1), 30, Vec::new()), Err(ScheduleError::RestoreTooLong { .. })));
        s.restore(RequestId(1), 8, vec![24, 16]).unwrap();
        let now = Instant::now();
        let mut spans = Vec::new();
        let mut hits = Vec::new();
        while s.has_work() {
            let plan = s.schedule(now);
            spans.push((plan.rows[0].start, plan.rows[0].tokens.len()));
            let out = s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
            hits.extend(out.boundaries.iter().map(|h| (h.tokens.len(), h.planned)));
            for (_, e) in out.events {
                if let EngineEvent::Finished { usage, .. } = e {
                    assert_eq!((usage.cached_tokens, usage.prompt_tokens), (8, 30));
                }
            }
        }
        assert_eq!(spans, vec![(8, 8), (16, 8), (24, 6), (30, 1), (31, 1)]);
        // Passing 32 while decoding is reported too, as unplanned.
        assert_eq!(hits, vec![(16, true), (24, true), (32, false)]);
    }

    #[test]
    fn prompt_chunks_that_end_on_a_block_by_chance_are_not_reported() {
        // Budget 16 from position 0: the chunks end on 16 and 32 (blocks of 8), neither a planned stop,
        // so neither is reported; only rows that sample report the boundaries they end on.
        let mut s = scheduler(16, 4);
        start(&mut s, &[request(1, 40, 30)]);
        let now = Instant::now();
        let mut hits = Vec::new();
        while s.has_work() {
            let plan = s.schedule(now);
            let out = s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
            hits.extend(out.boundaries.iter().map(|h| (h.tokens.len(), h.planned)));
        }
        // 40 is the end of the prompt, reached by the row that samples the first token.
        assert_eq!(hits, vec![(40, false), (48, false), (56, false), (64, false)]);
    }

    #[test]
    fn drafts_are_verified_counted_and_capped_by_max_tokens() {
        let mut s = scheduler(100, 4);
        start(&mut s, &[request(1, 2, 4)]);
        let now = Instant::now();
        let plan = s.schedule(now);
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        s.set_drafts(RequestId(1), vec![8, 9, 10, 11, 12]).unwrap();
        let plan = s.schedule(now);
        // One output so far, max 4: at most 2 drafts (2 accepted + 1 bonus = 3 more).
        assert_eq!(plan.rows[0].tokens, vec![7, 8, 9]);
        assert_eq!(plan.rows[0].sample.as_ref().map(|x| x.draft_len), Some(2));
        let out = s.apply(&plan, &outputs(&plan, 13, true)).unwrap();
        let f = &out.finished[0];
        assert_eq!(f.tokens[2..], [7, 8, 9, 13]);
        assert_eq!((f.reason, f.usage.draft_tokens, f.usage.accepted_draft_tokens), (FinishReason::Length, 2, 2));
        assert!(f.state_matches_history());
    }

    #[test]
    fn drafts_shrink_to_the_budget_and_a_stop_inside_accepted_drafts_is_flagged() {
        let mut s = scheduler(3, 4);
        start(&mut s, &[request(1, 2, 50)]);
        let now = Instant::now();
        let plan = s.schedule(now);
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        s.set_drafts(RequestId(1), vec![2, 9, 10]).unwrap();
        let plan = s.schedule(now);
        assert_eq!(plan.num_tokens(), 3, "1 token + 2 drafts fill the budget");
        let out = s.apply(&plan, &outputs(&plan, 13, true)).unwrap();
        let f = &out.finished[0];
        assert_eq!((f.reason, f.tokens[2..].to_vec()), (FinishReason::Stop, vec![7, 2]));
        assert!(!f.state_matches_history(), "the state committed the draft after the stop token");
    }

    /// A scheduler of `budget` tokens held to `target` over `t(B) = 4 ms + B × 0.05 ms`.
    fn limited(budget: usize, target: StepTarget) -> Scheduler {
        let mut s = scheduler(budget, 8);
        s.set_step_time_limit(Some(StepTimeLimit::new(linear_costs(0.004, 5e-5, 4096), target, BLOCK)));
        s
    }

    /// Request 1 (a 3-token prompt) has produced its first token; request 2 (`prompt` tokens) waits.
    fn decoding_beside_a_prompt(s: &mut Scheduler, prompt: usize) {
        start(s, &[request(1, 3, 500)]);
        let plan = s.schedule(Instant::now());
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        start(s, &[request(2, prompt, 4)]);
    }

    #[test]
    fn decode_rows_hold_the_prefill_chunk_to_the_step_target() {
        let mut s = limited(256, StepTarget::Factor(2.2));
        decoding_beside_a_prompt(&mut s, 200);
        // t(1) = 4.05 ms, T = 8.91 ms: B* = 98 tokens, 97 of them prefill.
        let plan = s.schedule(Instant::now());
        assert_eq!(row_lens(&plan), vec![(1, 1, true), (2, 97, false)]);
        let limit = s.step_time.clone().unwrap();
        assert!(limit.predicted_seconds(plan.num_tokens()) <= limit.target_seconds(1));
        assert!(limit.predicted_seconds(plan.num_tokens() + 1) > limit.target_seconds(1));
        // An absolute target replaces the derived one: 6.02 ms fits B = 40.
        let mut s = limited(256, StepTarget::Seconds(0.00602));
        decoding_beside_a_prompt(&mut s, 200);
        assert_eq!(row_lens(&s.schedule(Instant::now())), vec![(1, 1, true), (2, 39, false)]);
        // Without a limit the prompt takes what the budget leaves.
        let mut s = scheduler(256, 8);
        decoding_beside_a_prompt(&mut s, 200);
        assert_eq!(row_lens(&s.schedule(Instant::now())), vec![(1, 1, true), (2, 200, true)]);
    }

    #[test]
    fn without_decode_rows_prefill_gets_the_whole_budget() {
        let mut s = limited(256, StepTarget::Seconds(0.0));
        start(&mut s, &[request(1, 3, 5), request(2, 300, 5)]);
        let plan = s.schedule(Instant::now());
        assert_eq!(row_lens(&plan), vec![(1, 3, true), (2, 253, false)]);
    }

    #[test]
    fn the_minimum_chunk_keeps_a_prompt_advancing_under_any_target() {
        let mut s = limited(256, StepTarget::Seconds(0.0));
        decoding_beside_a_prompt(&mut s, 50);
        let mut chunks = Vec::new();
        while chunks.last() != Some(&(2, 2, true)) {
            let plan = s.schedule(Instant::now());
            assert_eq!(row_lens(&plan)[0], (1, 1, true), "the decode row runs every step");
            chunks.push(row_lens(&plan)[1]);
            s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        }
        assert_eq!(chunks, [vec![(2, BLOCK, false); 6], vec![(2, 2, true)]].concat());
    }

    #[test]
    fn limited_chunks_still_end_on_the_planned_block_boundary() {
        // T = 5.07 ms fits B = 21: 20 prefill tokens beside one decode token.
        let mut s = limited(256, StepTarget::Seconds(0.00507));
        start(&mut s, &[request(1, 3, 500)]);
        let plan = s.schedule(Instant::now());
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        s.add(&request(2, 60, 4), &[]).unwrap();
        s.admit();
        s.restore(RequestId(2), 0, vec![48]).unwrap();
        let mut chunks: Vec<(u64, usize, bool)> = Vec::new();
        let mut planned_hits = Vec::new();
        while chunks.last().is_none_or(|&(_, _, sampled)| !sampled) {
            let plan = s.schedule(Instant::now());
            chunks.push(row_lens(&plan)[1]);
            let out = s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
            planned_hits.extend(out.boundaries.iter().filter(|h| h.id.0 == 2).map(|h| (h.tokens.len(), h.planned)));
        }
        assert_eq!(chunks, vec![(2, 20, false), (2, 20, false), (2, 8, false), (2, 12, true)]);
        assert_eq!(planned_hits, vec![(48, true)], "the chunk that ended on 40 by chance is not reported");
    }

    #[test]
    fn random_mixes_stay_within_the_target_unless_only_the_minimum_chunk_ran() {
        let mut rng = ChaCha8Rng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
        for case in 0..200 {
            let budget = 16 + rng.gen_range(0..500usize);
            let target = match rng.gen_range(0..3usize) {
                0 => StepTarget::Factor(1.0 + rng.gen_range(0..30usize) as f64 / 10.0),
                1 => StepTarget::Seconds(rng.gen_range(0..20usize) as f64 * 1e-3),
                _ => StepTarget::Factor(1.5),
            };
            let mut s = limited(budget, target);
            let limit = s.step_time.clone().unwrap();
            let requests: Vec<GenerateRequest> = (0..1 + rng.gen_range(0..12usize))
                .map(|i| request(i as u64, 1 + rng.gen_range(0..400usize), 1 + rng.gen_range(0..30usize)))
                .collect();
            for r in &requests {
                s.add(r, &[]).unwrap();
            }
            let mut steps = 0;
            while s.has_work() {
                steps += 1;
                assert!(steps < 10_000, "case {case}: the mix does not finish");
                for id in s.admit() {
                    s.restore(id, 0, Vec::new()).unwrap();
                }
                let slots: Vec<RequestId> = s.decode_slots().iter().map(|d| d.id).collect();
                for id in slots {
                    let drafts = (0..rng.gen_range(0..9usize)).map(|t| 500 + t as TokenId).collect();
                    s.set_drafts(id, drafts).unwrap();
                }
                let decoding: Vec<RequestId> = s.running.iter().filter(|q| q.output_len() > 0).map(|q| q.id).collect();
                let prefilling = s.running.len() - decoding.len();
                let plan = s.schedule(Instant::now());
                let decode: usize = plan.rows.iter().filter(|r| decoding.contains(&r.id)).map(|r| r.tokens.len()).sum();
                let prefill = plan.num_tokens() - decode;
                assert!(plan.num_tokens() <= budget, "case {case}");
                if decode > 0 && prefill > BLOCK {
                    let (t, target) = (limit.predicted_seconds(plan.num_tokens()), limit.target_seconds(decode));
                    assert!(t <= target, "case {case}: predicted {t} over the target {target}");
                }
                if prefilling > 0 && decode < budget && plan.rows.len() < 8 {
                    assert!(prefill > 0, "case {case}: a waiting prompt did not advance");
                }
                s.apply(&plan, &outputs(&plan, 7, rng.gen_bool(0.5))).unwrap();
            }
        }
    }

    #[test]
    fn bad_step_results_are_errors() {
        let mut s = scheduler(10, 4);
        start(&mut s, &[request(1, 2, 2)]);
        let plan = s.schedule(Instant::now());
        assert_eq!(s.apply(&plan, &[]).unwrap_err(), ScheduleError::RowCount { got: 0, want: 1 });
        assert!(s.add(&request(1, 2, 2), &[]).is_err(), "duplicate id");
    }
}
