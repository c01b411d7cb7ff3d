//! The engine's speculator: before each step it drafts for every decode row, decides how many of the
//! drafts to verify, and hands them to the scheduler; after each step it records what was accepted.
//!
//! Follows dspark.md §4.2 (vLLM's proposer/speculator split) and §7 (the daemon's wiring). What it drafts
//! with is composed at start-up and handed over as a [`Speculation`]: one `sparkd_spec::Proposer` (suffix,
//! n-gram, DSpark's `ModelDrafts` or the `HybridProposer` of the two) and one verify budget.
//! 1. Gate: with model drafts and a load-aware budget, the drafting gate (`sparkd_spec::gate`) decides from
//!    earlier rounds whether a drafter round can pay at this step's row count; when it cannot, the drafter is
//!    not called (model-free drafts of the hybrid are still made), except for a probe now and then.
//! 2. Draft: the proposer prepares the round for every row at once (model drafts come from the runner's
//!    `Drafter` in one batch), then proposes per row from the row's committed context (prompt, tool
//!    outputs, output).
//! 3. Budget: every row's cap is `request_cap` (ℓ of the request, and accepted drafts plus the bonus
//!    must fit in `max_tokens`); a load-aware policy sees each draft with its survivals calibrated by what
//!    earlier rounds of its source showed (`sparkd_spec::calibration`), and trims each draft to a prefix; a
//!    probe verifies at least the first token of each model draft, so the calibration sees it.
//! 4. Select: a model draft that will be verified is selected on the runner's drafter, so it is verified
//!    against its own `q` (lossless speculative sampling); every other draft is verified one-hot.
//! 5. Record: each verified draft's outcome joins its source's calibration; the calibration's sums decay
//!    once per round, when the next round is proposed.
//!
//! Invariants:
//! - Drafts depend only on committed tokens and the drafter's own state; budgets are
//!   non-anticipating (`sparkd_spec::budget`), and the gate, the probes and the calibration depend only on
//!   earlier rounds, so greedy output is token-identical to decoding without speculation and sampled
//!   output keeps the target's distribution.
//! - A skipped drafter round leaves the drafter's contexts right: the runners append the taps of every
//!   committed token at every step, drafted or not.
//! - Under forced acceptance every round verifies its whole cap and is never gated: model-free drafts that
//!   stop short are padded with the row's last token (as the kernels' decode benchmark does), so every round
//!   is a full `ℓ` window and the forced schedule yields the asked mean length.
//! - Per-request memory lives under `SeqKey(request id)` and is released by [`Speculator::end`]
//!   exactly once per request that began.
//! - A verify round of `d` drafts with `a` accepted adds one to the drafted counter of positions `0..d` and to the
//!   accepted counter of positions `0..a`; those handles are taken once, in [`Speculator::new`], so recording a
//!   round never looks a label up in the registry.

use std::collections::HashMap;
use std::time::Instant;

use metrics::{counter, gauge, Counter};
use sparkd_kernels::runner::SamplingParams;
use sparkd_kernels::{KernelError, Runner, StateId, TokenId};
use sparkd_spec::budget::request_cap;
use sparkd_spec::{
    BudgetPolicy, BudgetRow, Calibrations, Draft, DraftGate, DraftSource, GateDecision, GateInput, Proposer, RoundRow,
    SeqKey, SpecCounters, SpecError, SyntheticSchedule,
};

use super::types::RequestId;
use crate::metrics as names;

/// What the engine speculates with, composed at start-up.
pub struct Speculation {
    pub proposer: Box<dyn Proposer>,
    pub budget: BudgetPolicy,
    /// ℓ, the server's maximum draft tokens per request per step.
    pub num_spec_tokens: usize,
    /// The forced-acceptance schedule the runner was set to, if any: every round is then flagged synthetic.
    pub synthetic: Option<SyntheticSchedule>,
    /// The drafting gate of model drafts (with a load-aware budget and real acceptance), if any.
    pub gate: Option<DraftGate>,
}

/// One decode row that may carry drafts at the next step.
#[derive(Clone, Copy, Debug)]
pub struct DraftSlot<'a> {
    pub id: RequestId,
    pub state: StateId,
    /// Prompt plus output so far; its last token is the one the next step feeds.
    pub context: &'a [TokenId],
    /// Output tokens the request may still produce (`max_tokens − output so far`).
    pub new_tokens_left: usize,
    pub sampling: &'a SamplingParams,
}

/// Drafts, budgets and speculation statistics for the engine thread.
pub struct Speculator {
    proposer: Box<dyn Proposer>,
    budget: BudgetPolicy,
    num_spec_tokens: usize,
    /// Acceptance is forced: every round is flagged synthetic.
    synthetic: bool,
    /// ℓ of each request that began (the per-request override applied).
    lengths: HashMap<RequestId, usize>,
    totals: SpecCounters,
    gate: Option<DraftGate>,
    calibrations: Calibrations,
    /// Per request, the draft its last proposed round verifies: its source and the raw survivals of the
    /// verified positions (replaced by the next round; matched to the outcome by its length).
    verifying: HashMap<RequestId, (DraftSource, Vec<f64>)>,
    /// A gate decision taken ahead of its round ([`Speculator::skip_ahead`]) that was not to skip: the next
    /// round's own.
    decided: Option<GateDecision>,
    /// The per-position counters of draft positions `0..ℓ`, taken once.
    positions: Vec<PositionCounters>,
}

/// The counters of one draft position: rounds that drafted it, rounds that accepted it.
struct PositionCounters {
    drafted: Counter,
    accepted: Counter,
}

impl PositionCounters {
    fn new(position: usize) -> Self {
        PositionCounters {
            drafted: counter!(names::SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POS_TOTAL, "position" => position.to_string()),
            accepted: counter!(names::SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL, "position" => position.to_string()),
        }
    }
}

impl Speculator {
    /// The speculator of `speculation`; registers the per-position counters (at zero) and sets the
    /// forced-acceptance gauge.
    pub fn new(speculation: Speculation) -> Self {
        let Speculation { proposer, budget, num_spec_tokens, synthetic, gate } = speculation;
        let positions = (0..num_spec_tokens).map(PositionCounters::new).collect();
        let forced = synthetic.as_ref().map_or(0.0, |s| s.mean_acceptance_length());
        gauge!(names::SPEC_DECODE_FORCED_ACCEPTANCE_LENGTH).set(forced);
        Speculator {
            proposer,
            budget,
            num_spec_tokens,
            synthetic: synthetic.is_some(),
            lengths: HashMap::new(),
            totals: SpecCounters::default(),
            gate: gate.filter(|_| synthetic.is_none()),
            calibrations: Calibrations::default(),
            verifying: HashMap::new(),
            decided: None,
            positions,
        }
    }

    /// Whether acceptance is forced (every round this speculator drafts is flagged synthetic).
    pub fn is_synthetic(&self) -> bool {
        self.synthetic
    }

    /// A request starts with `prompt` (its whole context: kept history, tool outputs, new input) and
    /// asked for at most `requested` draft tokens per step (capped by the server's ℓ).
    pub fn begin(&mut self, id: RequestId, prompt: &[TokenId], requested: Option<usize>) {
        let len = requested.map_or(self.num_spec_tokens, |n| n.min(self.num_spec_tokens));
        self.lengths.insert(id, len);
        self.proposer.begin(SeqKey(id.0), prompt);
    }

    /// The request finished (or was cancelled or failed) with `tokens` as its history; its output
    /// joins the suffix proposer's global tree.
    pub fn end(&mut self, id: RequestId, tokens: &[TokenId]) {
        if self.lengths.remove(&id).is_none() {
            return;
        }
        self.verifying.remove(&id);
        self.proposer.end(SeqKey(id.0), tokens, false);
    }

    /// Drafts for `slots` and returns, per slot, the draft tokens to verify at the next step.
    /// A drafter failure is returned as is (the engine fails the slots' requests).
    pub fn propose(
        &mut self,
        runner: &mut dyn Runner,
        slots: &[DraftSlot<'_>],
    ) -> Result<Vec<Vec<TokenId>>, KernelError> {
        let rows: Vec<RoundRow<'_>> = slots
            .iter()
            .map(|s| {
                let request_len = self.lengths.get(&s.id).copied().unwrap_or(0);
                RoundRow {
                    seq: SeqKey(s.id.0),
                    state: s.state,
                    context: s.context,
                    request_len,
                    cap: request_cap(request_len, s.new_tokens_left, usize::MAX),
                    sampling: s.sampling,
                }
            })
            .collect();
        let caps: Vec<usize> = rows.iter().map(|r| r.cap).collect();
        let decision = self.round_decision(&caps);
        let mut drafter = runner.model_drafter();
        if decision == GateDecision::Skip {
            counter!(names::SPEC_DECODE_GATED_STEPS_TOTAL).increment(1);
            self.proposer.prepare_round(None, &[]).map_err(kernel_error)?;
        } else {
            let started = Instant::now();
            self.proposer.prepare_round(drafter.as_deref_mut(), &rows).map_err(kernel_error)?;
            // The round ends with the drafts on the host, so its wall time is the drafter's cost at this load.
            if let Some(gate) = &mut self.gate {
                let drafting = rows.iter().filter(|r| r.cap > 0).count();
                gate.record_draft_cost(drafting, started.elapsed().as_secs_f64());
            }
        }
        if decision == GateDecision::Probe {
            counter!(names::SPEC_DECODE_PROBES_TOTAL).increment(1);
        }
        let drafts: Vec<Draft> = rows.iter().map(|r| self.proposer.propose(r.seq, r.context, r.cap)).collect();
        if let Some(gate) = &mut self.gate {
            let model = drafts.iter().filter(|d| d.source() == DraftSource::Model && !d.is_empty());
            model.for_each(|d| gate.record_draft(&d.survival()));
        }
        let verified = self.plan(&rows, &drafts, decision == GateDecision::Probe);
        let mut out = Vec::with_capacity(slots.len());
        for (((slot, row), draft), &len) in slots.iter().zip(&rows).zip(drafts).zip(&verified) {
            if len > 0 && !self.is_synthetic() {
                let survival = draft.survival()[..len].to_vec();
                self.verifying.insert(slot.id, (draft.source(), survival));
            } else {
                self.verifying.remove(&slot.id);
            }
            let mut tokens = draft.tokens().to_vec();
            if draft.source() == DraftSource::Model {
                tokens.truncate(len);
                if !tokens.is_empty() {
                    drafter.as_mut().ok_or_else(no_drafter)?.select_proposal(row.state)?;
                }
            } else if self.is_synthetic() {
                let pad = row.context.last().copied().unwrap_or_default();
                tokens.resize(len, pad);
            } else {
                tokens.truncate(len);
            }
            out.push(tokens);
        }
        Ok(out)
    }

    /// Takes now the drafting round of a step planned ahead of the outputs of the one in flight
    /// (`Scheduler::schedule_ahead`; `rows` holds each row's request and the output tokens it may still produce at
    /// that step) and returns whether it drafts nothing, so that the step can be launched fed on the device. It
    /// does when acceptance is real, every draft comes from the drafter's round (a model-free proposer reads the
    /// committed tokens the step in flight has not returned) and the gate skips the drafter at these rows; the
    /// round is then taken as `propose` would take a skipped one. A decision to draft or probe is kept for the next
    /// `propose`. Deciding a step early stays non-anticipating: the step in flight carries no drafts, so its
    /// outcome would not have informed the gate.
    pub fn skip_ahead(&mut self, rows: &[(RequestId, usize)]) -> bool {
        if self.synthetic || self.gate.is_none() || self.proposer.drafts_from_context() || self.decided.is_some() {
            return false;
        }
        let caps: Vec<usize> = rows
            .iter()
            .map(|(id, left)| request_cap(self.lengths.get(id).copied().unwrap_or(0), *left, usize::MAX))
            .collect();
        let decision = self.round_decision(&caps);
        if decision != GateDecision::Skip {
            self.decided = Some(decision);
            return false;
        }
        counter!(names::SPEC_DECODE_GATED_STEPS_TOTAL).increment(1);
        if let Err(e) = self.proposer.prepare_round(None, &[]) {
            // Nothing was drafted; the round is taken as skipped all the same, in the step's ordinary path.
            tracing::warn!(error = %e, "clearing a skipped round ahead failed");
            self.decided = Some(GateDecision::Skip);
            return false;
        }
        for (id, _) in rows {
            self.verifying.remove(id);
        }
        true
    }

    /// The decision of the round whose rows have `caps`: one taken ahead for it, else the calibration's sums
    /// decay and the gate decides now.
    fn round_decision(&mut self, caps: &[usize]) -> GateDecision {
        if let Some(decision) = self.decided.take() {
            return decision;
        }
        self.calibrations.next_round();
        self.gate_decision(caps)
    }

    /// What the gate says of a round whose rows have `caps` (always [`GateDecision::Draft`] without a gate), and
    /// the gauge of the calibrated acceptance length it judges by.
    fn gate_decision(&mut self, caps: &[usize]) -> GateDecision {
        let Some(gate) = &mut self.gate else { return GateDecision::Draft };
        let rows = caps.len();
        let caps: Vec<usize> = caps.iter().copied().filter(|&cap| cap > 0).collect();
        let calibration = &self.calibrations.model;
        let expected: f64 = gate.expected_survival(calibration).iter().take(self.num_spec_tokens).sum();
        gauge!(names::SPEC_DECODE_CALIBRATED_ACCEPTANCE_LENGTH).set(1.0 + expected);
        gate.decide(&GateInput { rows, caps: &caps, calibration })
    }

    /// Verify lengths per row: every cap under forced acceptance, else the budget's over the drafts
    /// (calibrated for a load-aware budget); a probe verifies at least one token of each model draft. A
    /// round without any draft (a skipped drafter round) does not reach the budget, so the production
    /// budget's stale capacity comes from the last rounds that drafted.
    fn plan(&mut self, rows: &[RoundRow<'_>], drafts: &[Draft], probe: bool) -> Vec<usize> {
        if self.is_synthetic() {
            return rows.iter().map(|r| r.cap).collect();
        }
        if drafts.iter().all(Draft::is_empty) {
            return vec![0; rows.len()];
        }
        let calibrated: Vec<Draft> = if self.budget.is_load_aware() {
            drafts.iter().map(|d| self.calibrations.of(d.source()).apply(d)).collect()
        } else {
            drafts.to_vec()
        };
        let budget_rows: Vec<BudgetRow<'_>> =
            calibrated.iter().zip(rows).map(|(draft, r)| BudgetRow { draft, cap: r.cap }).collect();
        let mut verified = self.budget.plan(&budget_rows);
        if probe {
            for (len, draft) in verified.iter_mut().zip(drafts) {
                if draft.source() == DraftSource::Model && !draft.is_empty() {
                    *len = (*len).max(1);
                }
            }
        }
        verified
    }

    /// Records one verify round of request `id`: `drafted` draft tokens of which `accepted` were accepted
    /// (rounds without drafts are not drafts, vLLM's definition); the outcome joins the calibration of the
    /// draft's source.
    pub fn record(&mut self, id: RequestId, drafted: usize, accepted: usize) {
        if drafted == 0 || self.totals.record(drafted, accepted, self.is_synthetic()).is_err() {
            return;
        }
        if let Some((source, survival)) = self.verifying.remove(&id) {
            if survival.len() == drafted {
                self.calibrations.of_mut(source).observe(&survival, accepted);
            }
        }
        counter!(names::SPEC_DECODE_NUM_DRAFTS_TOTAL).increment(1);
        counter!(names::SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL).increment(drafted as u64);
        counter!(names::SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL).increment(accepted as u64);
        // A round drafts at most ℓ tokens (`request_cap`), so every position it drafted has its counters.
        for (position, counters) in self.positions.iter().enumerate().take(drafted) {
            counters.drafted.increment(1);
            if position < accepted {
                counters.accepted.increment(1);
            }
        }
        if self.is_synthetic() {
            counter!(names::SPEC_DECODE_NUM_SYNTHETIC_DRAFTS_TOTAL).increment(1);
        }
        if let Some(al) = self.totals.mean_acceptance_length() {
            gauge!(names::SPEC_DECODE_MEAN_ACCEPTANCE_LENGTH).set(al);
        }
    }
}

/// A proposer's failure as the runner error the engine reports: the drafter's own error as it is, anything
/// else (a malformed model draft) as invalid input.
fn kernel_error(e: SpecError) -> KernelError {
    match e {
        SpecError::Kernel(e) => e,
        other => KernelError::InvalidInput(other.to_string()),
    }
}

/// A model draft without a drafter to verify it on.
fn no_drafter() -> KernelError {
    KernelError::InvalidInput("a model draft needs the runner's drafter".into())
}
