//! The engine thread: the one owner of the runner, every sequence state, the scheduler, the kept
//! responses and the prefix cache.
//!
//! Loop (each turn): take commands (block only when there is no work) → admit waiting requests and
//! give each a state (fork of a kept response, prefix-cache import, or a fresh one) → with
//! speculation on, draft for every decode row and attach the drafts to verify ([`Speculator`]) →
//! plan a step → `runner.step` → apply the outputs → snapshots, finishes, events → memory budget →
//! metrics. Each phase of a turn is timed into `sparkd:engine_phase_seconds` ([`PhaseClock`]).
//!
//! Asynchronous scheduling (`EngineConfig::async_scheduling`, a runner that launches ahead): the step is launched,
//! and while the decode is steady the next one is launched fed on the device (`Scheduler::schedule_ahead`; with
//! speculation on, only when its drafting round is taken now and skips: `Speculator::skip_ahead`) before the one
//! in flight is collected; applying, events, commands, backlogs
//! and the memory budget then run on the host while the device computes the next step. The `step` phase is
//! then only the time the host waits for the device.
//!
//! Invariants:
//! - Only this thread touches the runner and `StateId`s; no lock is held anywhere around the model.
//! - Every state handed out is freed exactly once: on finish (unless kept), on cancel, on failure. A state
//!   in a step launched and not yet collected is never freed, kept, forked or exported: a request that
//!   leaves meanwhile (a stop token, a cancel, a failure) has its state settled once that step is collected,
//!   and a finished one is then kept holding its whole history (the fed step fed its last token).
//! - Events go out over each request's bounded channel with `try_send`; when the channel is full they
//!   wait in a per-request backlog (order preserved) and the engine keeps stepping the others. A
//!   closed channel (client gone) cancels the request and frees its state, one it asked to keep
//!   included; past `max_event_backlog` unread events the request is cancelled as a slow reader. A
//!   waiting request whose client left is dropped before it is admitted. (`delivery`.)
//! - With a session journal, a turn commits when its record is attached, and removals from the store are
//!   forgotten in the journal (`commits`).
//! - A runner error fails every request of that step (their states are freed, never kept) and the
//!   engine goes on with the rest. A broken invariant of the engine's own fails the requests it
//!   touches with `EngineError::Internal` (a server fault, never blamed on the request).
//! - Kept responses live only in the session store, within its byte budgets (enforced after every
//!   step and after every command that adds to what it holds). The API reads them through the
//!   store's view, which only this thread writes, so no read of a kept response waits on a step.
//! - Every request that got a state began on the speculator and ends on it exactly once (finish,
//!   cancel, client gone, failure), so per-request proposer memory never leaks.
//! - Prefix-cache snapshots are taken where they pay: at the last block boundary of each prompt
//!   (prefill chunks are planned to end exactly there) and at the last block boundary passed while
//!   decoding, stored when the request finishes; never for a later turn of a kept chain (a request
//!   that continues a kept response and is kept itself): its prefix is its chain's own and its kept
//!   state carries the chain on. A snapshot is a device fork while the cache's device tier has a budget, else
//!   a whole-state export on the engine thread. A pending decode snapshot that is not stored (the request
//!   failed, a later boundary replaced it) is given back to the cache, so its fork is freed exactly once.

use std::collections::{HashMap, VecDeque};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use metrics::{counter, gauge, histogram};
use sparkd_kernels::launches::FedRow;
use sparkd_kernels::runner::{RowInput, RowOutput};
use sparkd_kernels::state::MLA_BLOCK_TOKENS;
use sparkd_kernels::{KernelError, Runner, StateId};
use tokio::sync::mpsc::{self, error::TryRecvError};

use super::constraints::{Constraints, MasksOnAsk, StepMasks};
use super::journal::{Journal, OpenJournal};
use super::phases::{Phase, PhaseClock};
use super::prefix_cache::{PrefixBudgets, PrefixCache, Taken};
use super::reuse::{Lookup, ReuseCounters};
use super::scheduler::{AheadPlan, FinishedSeq, Scheduler, SchedulerLimits, StepOutcome, StepPlan};
use super::sessions::{EvictionPolicy, LruPolicy, SessionStore, StoreBudgets};
use super::speculator::{DraftSlot, Speculation, Speculator};
use super::types::{
    EngineCommand, EngineConfig, EngineError, EngineEvent, EngineHandle, FinishReason, GenerateRequest, RequestId,
    ResponseId,
};
use crate::metrics as names;

mod commits;
mod delivery;

/// How long a stopping engine waits for clients to take their last events.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How long an idle engine with undelivered events waits before retrying them.
const BACKLOG_RETRY: Duration = Duration::from_millis(1);

/// The running engine thread.
#[derive(Debug)]
pub struct Engine {
    handle: EngineHandle,
    thread: JoinHandle<()>,
}

impl Engine {
    /// A handle for submitting work (clone it freely).
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stops the engine: every request still in it finishes with `FinishReason::Cancelled`, then the
    /// thread exits and is joined. Call it from a plain thread, not inside an async runtime.
    pub fn shutdown(self) {
        // An engine that is already gone has nothing left to stop.
        let _ = self.handle.blocking_send(EngineCommand::Shutdown);
        if self.thread.join().is_err() {
            tracing::error!("the engine thread panicked");
        }
    }
}

/// Starts the engine thread with an LRU eviction policy for kept responses.
pub fn spawn(
    runner: Box<dyn Runner>,
    speculation: Option<Speculation>,
    config: EngineConfig,
) -> Result<Engine, EngineError> {
    spawn_with_policy(runner, speculation, config, Box::<LruPolicy>::default())
}

/// Starts the engine thread on `runner`, speculating with `speculation` (`None`: speculation off); both are
/// composed at start-up. It stops on [`Engine::shutdown`], or when every [`EngineHandle`] is dropped and its
/// work is done.
pub fn spawn_with_policy(
    runner: Box<dyn Runner>,
    speculation: Option<Speculation>,
    config: EngineConfig,
    policy: Box<dyn EvictionPolicy>,
) -> Result<Engine, EngineError> {
    start(runner, speculation, config, policy, None)
}

/// Starts the engine thread with its kept responses restored from, and committed to, a session journal.
pub fn spawn_journaled(
    runner: Box<dyn Runner>,
    speculation: Option<Speculation>,
    config: EngineConfig,
    journal: OpenJournal,
) -> Result<Engine, EngineError> {
    start(runner, speculation, config, Box::<LruPolicy>::default(), Some(journal))
}

fn start(
    runner: Box<dyn Runner>,
    speculation: Option<Speculation>,
    config: EngineConfig,
    policy: Box<dyn EvictionPolicy>,
    journal: Option<OpenJournal>,
) -> Result<Engine, EngineError> {
    if config.max_num_batched_tokens == 0 || config.max_num_seqs == 0 || config.command_queue == 0 {
        return Err(EngineError::Internal(
            "engine config: max_num_batched_tokens, max_num_seqs and command_queue must be at least 1".into(),
        ));
    }
    let speculator = speculation.map(Speculator::new);
    let (tx, rx) = mpsc::channel(config.command_queue);
    let engine = EngineCore::new(runner, config, policy, speculator, rx, journal);
    let kept = engine.sessions.view();
    let thread = std::thread::Builder::new()
        .name("sparkd-engine".into())
        .spawn(move || engine.run())
        .map_err(|e| EngineError::Internal(format!("spawning the engine thread: {e}")))?;
    Ok(Engine { handle: EngineHandle::new(tx, kept), thread })
}

/// A request the engine knows about, from `Generate` to its terminal event.
#[derive(Debug)]
struct Live {
    events: mpsc::Sender<EngineEvent>,
    /// Events the channel had no room for, oldest first.
    backlog: VecDeque<EngineEvent>,
    state: Option<StateId>,
    keep_as: Option<ResponseId>,
    continue_from: Option<ResponseId>,
    arrival: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// The last block-boundary snapshot passed while decoding, stored in the prefix cache at finish.
    pending_snapshot: Option<(Vec<sparkd_kernels::TokenId>, Taken)>,
    /// The terminal event was queued; the entry goes once the backlog is delivered.
    done: bool,
    /// The request's own cap on draft tokens per step.
    num_spec_tokens: Option<usize>,
}

impl Live {
    /// A later turn of a kept chain: it continues a kept response and will be kept itself.
    fn continues_kept_chain(&self) -> bool {
        self.continue_from.is_some() && self.keep_as.is_some()
    }
}

/// What happens to a request's state once no step in flight holds it.
#[derive(Debug)]
enum Settle {
    /// A request that left the scheduler: its state is kept as `keep_as`'s response, or freed.
    Release { finished: FinishedSeq, keep_as: Option<ResponseId>, state: Option<StateId> },
    /// A failed request's state is freed.
    Free { id: RequestId, state: StateId },
}

impl Settle {
    fn state(&self) -> Option<StateId> {
        match self {
            Settle::Release { state, .. } => *state,
            Settle::Free { state, .. } => Some(*state),
        }
    }
}

/// Keeps the outputs of the rows of `plan` from `outputs`, the runner's outputs for `launched` (a superset of
/// the plan's requests, in the same order: requests that left while their step was in flight are dropped).
fn keep_planned(plan: &StepPlan, launched: &[RequestId], outputs: Vec<RowOutput>) -> Vec<RowOutput> {
    let mut planned = plan.rows.iter().map(|r| r.id).peekable();
    launched.iter().zip(outputs).filter_map(|(id, out)| planned.next_if_eq(id).map(|_| out)).collect()
}

struct EngineCore {
    runner: Box<dyn Runner>,
    config: EngineConfig,
    commands: mpsc::Receiver<EngineCommand>,
    commands_open: bool,
    /// `Shutdown` was received.
    stopping: bool,
    scheduler: Scheduler,
    sessions: SessionStore,
    prefix: PrefixCache,
    live: HashMap<RequestId, Live>,
    /// The matchers of constrained requests.
    constraints: Constraints,
    /// Drafts and their statistics; `None` with speculation off.
    speculator: Option<Speculator>,
    /// Times the phases of each loop turn.
    phases: PhaseClock,
    /// Counts the prompt tokens each admitted request reused, and from where.
    reuse: ReuseCounters,
    /// The states of each step launched and not yet collected, oldest first.
    flying: VecDeque<Vec<StateId>>,
    /// States of requests that left while a step in flight held them (see [`EngineCore::settle_deferred`]).
    deferred: Vec<Settle>,
    /// The session journal's writer (`--session-dir`): committed turns and forgotten responses.
    journal: Option<Journal>,
}

impl EngineCore {
    fn new(
        runner: Box<dyn Runner>,
        config: EngineConfig,
        policy: Box<dyn EvictionPolicy>,
        speculator: Option<Speculator>,
        commands: mpsc::Receiver<EngineCommand>,
        journal: Option<OpenJournal>,
    ) -> Self {
        let limits = SchedulerLimits {
            max_num_batched_tokens: config.max_num_batched_tokens,
            max_num_seqs: config.max_num_seqs,
        };
        let mut scheduler = Scheduler::new(limits, MLA_BLOCK_TOKENS);
        scheduler.set_forced_acceptance(speculator.as_ref().is_some_and(Speculator::is_synthetic));
        scheduler.set_step_time_limit(config.step_time.clone());
        EngineCore {
            runner,
            scheduler,
            sessions: SessionStore::new(
                policy,
                StoreBudgets {
                    host_bytes: config.host_budget_bytes,
                    total_bytes: config.kept_responses_bytes,
                    max_entries: config.max_kept_responses,
                },
            ),
            prefix: PrefixCache::new(
                MLA_BLOCK_TOKENS,
                PrefixBudgets { device_bytes: config.prefix_device_bytes, host_bytes: config.prefix_cache_bytes },
            ),
            config,
            commands,
            commands_open: true,
            stopping: false,
            live: HashMap::new(),
            constraints: Constraints::default(),
            speculator,
            phases: PhaseClock::new(),
            reuse: ReuseCounters::new(),
            flying: VecDeque::new(),
            deferred: Vec::new(),
            journal: None,
        }
        .with_journal(journal)
    }

    fn run(mut self) {
        loop {
            self.take_commands();
            if self.stopping {
                self.stop();
                break;
            }
            self.flush_events();
            self.phases.lap(Phase::Emit);
            if !self.scheduler.has_work() {
                if !self.commands_open && self.live.is_empty() {
                    break;
                }
                // Idle: the gauges must still show the requests that just left (cancelled, client gone).
                self.record_gauges();
                if self.live.values().any(|l| !l.backlog.is_empty()) {
                    std::thread::sleep(BACKLOG_RETRY);
                }
                self.phases.lap(Phase::Idle);
                continue;
            }
            self.drop_abandoned();
            self.admit();
            self.phases.lap(Phase::Admit);
            if self.speculator.is_some() {
                self.attach_drafts();
                self.phases.lap(Phase::Draft);
            }
            let plan = self.scheduler.schedule(Instant::now());
            self.phases.lap(Phase::Schedule);
            if !plan.is_empty() {
                self.step(plan);
            }
            self.enforce_memory();
            self.record_gauges();
            self.phases.lap(Phase::Memory);
        }
    }

    /// Cancels everything still in the engine and delivers the last events (for up to `SHUTDOWN_GRACE`).
    fn stop(&mut self) {
        self.cancel_all();
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        loop {
            self.flush_events();
            if self.live.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(BACKLOG_RETRY);
        }
        self.commands.close();
    }

    /// Drains the command queue; blocks for the next command only when there is nothing to do.
    /// Never waits once `Shutdown` was taken (possibly during a step, by the fed step's command check).
    fn take_commands(&mut self) {
        let idle = !self.stopping && !self.scheduler.has_work() && self.live.values().all(|l| l.backlog.is_empty());
        self.take_commands_waiting(idle);
    }

    /// Drains the command queue, first waiting for a command when `wait` is set.
    fn take_commands_waiting(&mut self, wait: bool) {
        if wait && self.commands_open {
            let command = self.commands.blocking_recv();
            self.phases.lap(Phase::Idle);
            match command {
                Some(cmd) => self.handle(cmd),
                None => self.commands_open = false,
            }
        }
        while self.commands_open {
            match self.commands.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => self.commands_open = false,
            }
        }
        self.phases.lap(Phase::Commands);
    }

    fn handle(&mut self, command: EngineCommand) {
        match command {
            EngineCommand::Generate { request, events } => self.accept(request, events),
            EngineCommand::Cancel(id) => self.cancel(id),
            EngineCommand::CancelAll => self.cancel_all(),
            EngineCommand::Shutdown => self.stopping = true,
            EngineCommand::DropResponse { id, reply } => {
                let dropped = self.sessions.remove(self.runner.as_mut(), &id).unwrap_or_else(|e| {
                    // The entry is gone all the same; only its state's release failed.
                    tracing::warn!(response = %id, error = %e, "freeing a dropped response's state failed");
                    true
                });
                if dropped {
                    counter!(names::SESSIONS_DELETED_TOTAL).increment(1);
                }
                // With a journal the answer waits until the delete is on disk; the asker may have left, then
                // nobody needs it.
                match &self.journal {
                    Some(journal) => journal.forget_then(self.sessions.take_removed(), reply, dropped),
                    None => {
                        let _ = reply.send(dropped);
                    }
                }
            }
            EngineCommand::Barrier { reply } => {
                // The asker may have left; then nobody is waiting.
                let _ = reply.send(());
            }
            EngineCommand::RecordResponse { id, record, reply } => self.commit(id, record, reply),
        }
    }

    fn accept(&mut self, mut request: GenerateRequest, events: mpsc::Sender<EngineEvent>) {
        let reject = |events: &mpsc::Sender<EngineEvent>, e: EngineError| {
            counter!(names::ERRORS_TOTAL, "kind" => e.kind()).increment(1);
            // The client may already be gone; then there is nobody to tell.
            let _ = events.try_send(EngineEvent::Failed(e));
        };
        let history = match &request.continue_from {
            Some(from) => match self.sessions.history(from) {
                Some(h) => h.to_vec(),
                None => return reject(&events, EngineError::UnknownResponse(from.clone())),
            },
            None => Vec::new(),
        };
        if let Err(e) = self.validate(&request, history.len()) {
            return reject(&events, e);
        }
        if self.live.contains_key(&request.id) {
            return reject(&events, EngineError::Internal(format!("request id {} is already in use", request.id)));
        }
        if let Err(e) = self.scheduler.add(&request, &history) {
            return reject(&events, EngineError::Internal(e.to_string()));
        }
        if let Some(constraint) = request.constraint.take() {
            self.constraints.insert(request.id, *constraint);
        }
        self.live.insert(
            request.id,
            Live {
                events,
                backlog: VecDeque::new(),
                state: None,
                keep_as: request.keep_as,
                continue_from: request.continue_from,
                arrival: request.arrival,
                first_scheduled: None,
                first_token: None,
                last_token: None,
                pending_snapshot: None,
                done: false,
                num_spec_tokens: request.num_spec_tokens,
            },
        );
    }

    fn validate(&self, request: &GenerateRequest, history_len: usize) -> Result<(), EngineError> {
        let cfg = self.runner.config();
        if history_len + request.prompt.len() == 0 {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        if request.max_tokens == 0 {
            return Err(EngineError::InvalidRequest("max_tokens must be at least 1".into()));
        }
        if let Some(bad) = request.prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary of {}",
                cfg.vocab_size
            )));
        }
        let total = history_len + request.prompt.len() + request.max_tokens;
        if total > cfg.max_position_embeddings {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({} tokens) plus max_tokens ({}) exceeds the context length {}",
                history_len + request.prompt.len(),
                request.max_tokens,
                cfg.max_position_embeddings
            )));
        }
        Ok(())
    }

    /// Gives each newly admitted request a state and tells the scheduler how much of it is restored.
    fn admit(&mut self) {
        for id in self.scheduler.admit() {
            if let Err(e) = self.give_state(id) {
                self.fail(id, e);
            }
        }
    }

    fn give_state(&mut self, id: RequestId) -> Result<(), EngineError> {
        let started = Instant::now();
        let tokens = self.scheduler.tokens(id).map(<[_]>::to_vec).unwrap_or_default();
        let prompt_len = self.scheduler.prompt_len(id).unwrap_or(tokens.len());
        let continue_from = self.live.get(&id).and_then(|l| l.continue_from.clone());
        let snapshots = self.prefix.is_enabled() && !self.live.get(&id).is_some_and(Live::continues_kept_chain);
        let mut restored: Option<(StateId, usize)> = None;
        let mut how = "fresh";
        // The last prompt token is always fed (it produces the first output token).
        let reusable = tokens.len().saturating_sub(1);
        let mut looked_up = false;
        if let Some(from) = &continue_from {
            let (state, tier) = self.sessions.checkout(self.runner.as_mut(), from)?;
            counter!(names::SESSIONS_RESTORED_TOTAL, "tier" => tier.as_str()).increment(1);
            if let Some(state) = state {
                match self.runner.state_len(state)? {
                    // A kept state holding the whole history (`FinishedSeq::state_matches_history`) leaves
                    // nothing to feed when the continuation adds no token: it is rebuilt instead.
                    len if len >= tokens.len() => self.runner.free_state(state)?,
                    len => {
                        restored = Some((state, len));
                        how = "continued";
                    }
                }
            }
            looked_up = true;
            self.reuse.continuation(Lookup { reusable, restored: restored.map_or(0, |(_, len)| len) });
        }
        if restored.is_none() && self.prefix.is_enabled() {
            looked_up = true;
            if let Some((len, state)) = self.prefix.lookup(self.runner.as_mut(), &tokens, reusable)? {
                restored = Some((state, len));
                how = "prefix";
            }
        }
        if looked_up {
            self.reuse.prompt(Lookup { reusable, restored: restored.map_or(0, |(_, len)| len) });
        }
        let (state, computed) = match restored {
            Some(r) => r,
            None => (self.runner.alloc_state()?, 0),
        };
        let mut num_spec_tokens = None;
        if let Some(live) = self.live.get_mut(&id) {
            live.state = Some(state);
            num_spec_tokens = live.num_spec_tokens;
        }
        if let Some(speculator) = &mut self.speculator {
            speculator.begin(id, &tokens, num_spec_tokens);
        }
        let block = self.prefix.block_tokens();
        let prompt_end = prompt_len / block * block;
        let stops = if snapshots && prompt_end > computed && !self.prefix.contains(&tokens[..prompt_end]) {
            vec![prompt_end]
        } else {
            Vec::new()
        };
        counter!(names::PROMPT_TOKENS_TOTAL).increment(tokens.len().saturating_sub(computed) as u64);
        histogram!(names::REQUEST_ADMIT_SECONDS, "how" => how).record(started.elapsed().as_secs_f64());
        self.scheduler.restore(id, computed, stops).map_err(|e| EngineError::Internal(e.to_string()))
    }

    /// Drafts for every decode row and attaches the drafts the budget verifies (speculation on). A
    /// drafter failure fails the requests it drafted for.
    fn attach_drafts(&mut self) {
        let Some(speculator) = &mut self.speculator else { return };
        let slots: Vec<DraftSlot<'_>> = self
            .scheduler
            .decode_slots()
            .into_iter()
            .filter_map(|s| {
                let state = self.live.get(&s.id)?.state?;
                let (context, new_tokens_left, sampling) = (s.tokens, s.new_tokens_left, s.sampling);
                Some(DraftSlot { id: s.id, state, context, new_tokens_left, sampling })
            })
            .collect();
        if slots.is_empty() {
            return;
        }
        let ids: Vec<RequestId> = slots.iter().map(|s| s.id).collect();
        let drafts = speculator.propose(self.runner.as_mut(), &slots);
        drop(slots);
        match drafts {
            Ok(drafts) => {
                for (id, mut draft) in ids.into_iter().zip(drafts) {
                    if let Err(e) = self.constraints.cut(id, &mut draft) {
                        self.fail(id, e);
                        continue;
                    }
                    if let Err(e) = self.scheduler.set_drafts(id, draft) {
                        tracing::warn!(request = %id, error = %e, "attaching drafts failed");
                    }
                }
            }
            Err(e) => {
                let err = EngineError::from(e);
                tracing::error!(error = %err, rows = ids.len(), "drafting failed");
                ids.into_iter().for_each(|id| self.fail(id, err.clone()));
            }
        }
    }

    /// Runs `plan`: as one step, or pipelined ([`Self::step_ahead`]) when the config and the runner allow it
    /// (with speculation on, a step is launched ahead only when its drafting round is known to draft nothing).
    fn step(&mut self, plan: StepPlan) {
        let Some(rows) = self.row_inputs(&plan) else { return };
        let vocab = self.runner.config().vocab_size;
        if StepMasks::needed(&self.constraints, &plan) {
            // Nothing is launched ahead of a constrained step: its next masks need its tokens.
            let mut masks = MasksOnAsk::new(&mut self.constraints, &plan, vocab);
            let outputs = self.runner.step_masked(&rows, &mut masks);
            let masks = masks.finish();
            histogram!(names::CONSTRAINT_MASK_SECONDS).record(masks.spent.as_secs_f64());
            self.phases.lap(Phase::Step);
            let (plan, outputs) = self.drop_failed(plan, outputs, masks.failed);
            return self.land(&plan, outputs);
        }
        if self.config.async_scheduling && self.runner.launches_ahead() {
            return self.step_ahead(plan, &rows);
        }
        let outputs = self.runner.step(&rows);
        self.phases.lap(Phase::Step);
        self.land(&plan, outputs);
    }

    /// Fails the requests whose matcher failed while the runner asked for their masks, and drops their rows (which
    /// sampled unconstrained) from the step before it lands.
    fn drop_failed(
        &mut self,
        mut plan: StepPlan,
        outputs: Result<Vec<RowOutput>, KernelError>,
        failed: Vec<(RequestId, EngineError)>,
    ) -> (StepPlan, Result<Vec<RowOutput>, KernelError>) {
        if failed.is_empty() {
            return (plan, outputs);
        }
        let is_failed = |id: RequestId| failed.iter().any(|(f, _)| *f == id);
        let outputs = outputs
            .map(|outs| plan.rows.iter().zip(outs).filter(|(row, _)| !is_failed(row.id)).map(|(_, out)| out).collect());
        plan.rows.retain(|row| !is_failed(row.id));
        for (id, error) in failed {
            self.fail(id, error);
        }
        (plan, outputs)
    }

    /// The runner's rows of `plan`, marking first scheduling; `None` (the row failed) when a row has no state.
    fn row_inputs(&mut self, plan: &StepPlan) -> Option<Vec<RowInput>> {
        let now = Instant::now();
        let mut rows = Vec::with_capacity(plan.rows.len());
        for row in &plan.rows {
            let live = self.live.get_mut(&row.id);
            let Some(state) = live.as_ref().and_then(|l| l.state) else {
                self.fail(row.id, EngineError::Internal(format!("{} was planned without a state", row.id)));
                return None;
            };
            if let Some(live) = live {
                live.first_scheduled.get_or_insert(now);
            }
            rows.push(RowInput { state, tokens: row.tokens.clone(), sample: row.sample.clone() });
        }
        Some(rows)
    }

    /// Asynchronous scheduling (follows vLLM v1's): launches `plan`, then, while the scheduler can plan the
    /// next step without its outputs ([`Scheduler::schedule_ahead`]), launches that step fed on the device
    /// before collecting the one in flight, and does the host work of the collected step (apply, events,
    /// commands, backlogs, memory) while the fed step runs. A request that leaves while its next step is in
    /// flight has that step's output dropped and its state settled once the step is collected
    /// ([`Self::settle_deferred`]).
    fn step_ahead(&mut self, plan: StepPlan, rows: &[RowInput]) {
        if let Err(e) = self.runner.launch(rows) {
            self.phases.lap(Phase::Step);
            return self.land(&plan, Err(e));
        }
        self.flying.push_back(rows.iter().map(|r| r.state).collect());
        let mut current = plan;
        // The requests the runner returns outputs for when `current` is collected, in order.
        let mut current_ids: Vec<RequestId> = current.rows.iter().map(|r| r.id).collect();
        loop {
            let ahead = self.launch_ahead(&current);
            let outputs = self.runner.collect();
            self.flying.pop_front();
            self.phases.lap(Phase::Step);
            self.settle_deferred();
            let outputs = outputs.map(|outs| keep_planned(&current, &current_ids, outs));
            self.land(&current, outputs);
            let Some(ahead) = ahead else { break };
            // Host work while the fed step runs on the device.
            self.take_commands_waiting(false);
            self.flush_events();
            self.phases.lap(Phase::Emit);
            self.enforce_memory();
            self.record_gauges();
            self.phases.lap(Phase::Memory);
            current_ids = ahead.rows.iter().map(|r| r.id).collect();
            current = match self.scheduler.resolve_ahead(&ahead) {
                Ok(next) => next,
                Err(e) => {
                    // The fed step's requests still running fail (the others have had their terminal event).
                    let err = EngineError::Internal(format!("a step launched ahead: {e}"));
                    let running: Vec<RequestId> =
                        current_ids.iter().copied().filter(|&id| self.scheduler.is_running(id)).collect();
                    running.into_iter().for_each(|id| self.fail(id, err.clone()));
                    StepPlan::default()
                }
            };
            self.phases.lap(Phase::Schedule);
        }
    }

    /// Launches the step after `current` fed on the device, when the scheduler can plan it now and nothing
    /// stops the engine; returns its plan. A launch the runner refuses is logged and not retried this turn.
    fn launch_ahead(&mut self, current: &StepPlan) -> Option<AheadPlan> {
        if self.stopping || !self.constraints.is_empty() {
            return None;
        }
        let ahead = self.scheduler.schedule_ahead(current)?;
        if let Some(speculator) = &mut self.speculator {
            let rows: Vec<(RequestId, usize)> = ahead.rows.iter().map(|r| (r.id, r.new_tokens_left)).collect();
            if !speculator.skip_ahead(&rows) {
                return None;
            }
        }
        let fed: Option<Vec<FedRow>> = ahead
            .rows
            .iter()
            .map(|r| Some(FedRow { state: self.live.get(&r.id)?.state?, params: r.params.clone() }))
            .collect();
        let fed = fed?;
        match self.runner.launch_fed(&fed) {
            Ok(()) => {
                self.flying.push_back(fed.iter().map(|r| r.state).collect());
                Some(ahead)
            }
            Err(e) => {
                tracing::warn!(error = %e, rows = fed.len(), "launching a step ahead failed; stepping without");
                None
            }
        }
    }

    /// Whether `state` is in a step launched and not yet collected.
    fn is_flying(&self, state: StateId) -> bool {
        self.flying.iter().any(|step| step.contains(&state))
    }

    /// Settles the states of requests that left while their next step was in flight, once no step in flight
    /// holds them: each fed step appended one token, so a finished request's state now holds its whole history.
    fn settle_deferred(&mut self) {
        if self.deferred.is_empty() {
            return;
        }
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.deferred).into_iter().partition(|d| !d.state().is_some_and(|s| self.is_flying(s)));
        self.deferred = waiting;
        for mut settle in ready {
            if let Settle::Release { finished, .. } = &mut settle {
                finished.computed += 1;
            }
            self.settle(settle);
        }
    }

    /// Applies a step's outputs to the scheduler and hands out what follows: metrics, snapshots, releases and
    /// events. A runner error fails every row of the step.
    fn land(&mut self, plan: &StepPlan, outputs: Result<Vec<RowOutput>, KernelError>) {
        let outputs = match outputs {
            Ok(outputs) => outputs,
            Err(e) => {
                let err = EngineError::from(e);
                tracing::error!(error = %err, rows = plan.rows.len(), "runner step failed");
                plan.rows.iter().for_each(|row| self.fail(row.id, err.clone()));
                return;
            }
        };
        let outcome = match self.scheduler.apply(plan, &outputs) {
            Ok(outcome) => outcome,
            Err(e) => {
                let err = EngineError::Internal(format!("step results: {e}"));
                plan.rows.iter().for_each(|row| self.fail(row.id, err.clone()));
                return;
            }
        };
        self.record_step(plan, &outcome, Instant::now());
        for (id, event) in &outcome.events {
            if let EngineEvent::Tokens { tokens, .. } = event {
                if let Err(e) = self.constraints.commit(*id, tokens) {
                    self.fail(*id, e);
                }
            }
        }
        for hit in outcome.boundaries {
            self.snapshot(hit.id, hit.tokens, hit.planned);
        }
        // Release before the terminal events: delivering `Finished` retires the request's entry.
        for finished in outcome.finished {
            self.release(finished);
        }
        self.phases.lap(Phase::Apply);
        for (id, event) in outcome.events {
            self.emit(id, event);
        }
        self.phases.lap(Phase::Emit);
    }

    /// Snapshots the state at a block boundary: into the prefix cache now (a planned prompt boundary)
    /// or as the request's pending decode snapshot (replacing, and giving back, the one before).
    fn snapshot(&mut self, id: RequestId, tokens: Vec<sparkd_kernels::TokenId>, planned: bool) {
        if !self.prefix.is_enabled() || (planned && self.prefix.contains(&tokens)) {
            return;
        }
        let Some(state) = self.live.get(&id).and_then(|l| l.state.filter(|_| !l.continues_kept_chain())) else {
            return;
        };
        if self.is_flying(state) {
            // `schedule_ahead` plans nothing ahead of a boundary; a state in flight has moved past it.
            tracing::error!(request = %id, "a block-boundary snapshot of a state in flight was skipped");
            return;
        }
        let taken = match self.prefix.take(self.runner.as_mut(), state) {
            Ok(taken) => taken,
            Err(e) => return tracing::warn!(request = %id, error = %e, "taking a prefix snapshot failed"),
        };
        let replaced = match self.live.get_mut(&id) {
            Some(live) if !planned => live.pending_snapshot.replace((tokens, taken)).map(|(_, old)| old),
            _ => {
                self.store_snapshot(id, &tokens, taken);
                None
            }
        };
        if let Some(old) = replaced {
            self.give_back_snapshot(id, old);
        }
    }

    /// Stores a snapshot in the prefix cache (which gives it back if it does not keep it).
    fn store_snapshot(&mut self, id: RequestId, tokens: &[sparkd_kernels::TokenId], taken: Taken) {
        match self.prefix.insert(self.runner.as_mut(), tokens, taken) {
            Ok((_, moved)) => {
                counter!(names::PREFIX_CACHE_MOVES_TOTAL, "to" => "host").increment(moved.to_host as u64);
                counter!(names::PREFIX_CACHE_MOVES_TOTAL, "to" => "dropped").increment(moved.dropped as u64);
            }
            Err(e) => tracing::warn!(request = %id, error = %e, "storing a prefix snapshot failed"),
        }
    }

    fn give_back_snapshot(&mut self, id: RequestId, taken: Taken) {
        if let Err(e) = PrefixCache::discard(self.runner.as_mut(), taken) {
            tracing::warn!(request = %id, error = %e, "freeing a prefix snapshot failed");
        }
    }

    /// Records per-step metrics: speculation counters, TTFT for first tokens, k ITL samples for k tokens.
    fn record_step(&mut self, plan: &StepPlan, outcome: &StepOutcome, done: Instant) {
        if let Some(speculator) = &mut self.speculator {
            for (id, event) in &outcome.events {
                if let EngineEvent::Tokens { drafted, accepted, .. } = event {
                    speculator.record(*id, *drafted, *accepted);
                }
            }
        }
        debug_assert!(plan.num_tokens() <= self.config.max_num_batched_tokens);
        for &(id, count) in &outcome.emitted {
            let Some(live) = self.live.get_mut(&id) else { continue };
            counter!(names::GENERATION_TOKENS_TOTAL).increment(count as u64);
            match live.last_token {
                None => {
                    histogram!(names::TIME_TO_FIRST_TOKEN_SECONDS)
                        .record(done.saturating_duration_since(live.arrival).as_secs_f64());
                    if let Some(s) = live.first_scheduled {
                        histogram!(names::REQUEST_PREFILL_TIME_SECONDS)
                            .record(done.saturating_duration_since(s).as_secs_f64());
                    }
                    live.first_token = Some(done);
                }
                Some(last) => {
                    let interval = done.saturating_duration_since(last).as_secs_f64();
                    histogram!(names::STEP_INTERVAL_SECONDS).record(interval);
                    let per_token = interval / count.max(1) as f64;
                    for _ in 0..count {
                        histogram!(names::INTER_TOKEN_LATENCY_SECONDS).record(per_token);
                    }
                }
            }
            live.last_token = Some(done);
        }
    }

    fn cancel_all(&mut self) {
        let ids: Vec<RequestId> = self.live.keys().copied().collect();
        for id in ids {
            self.cancel(id);
        }
    }

    fn cancel(&mut self, id: RequestId) {
        let Some(finished) = self.scheduler.remove(id, FinishReason::Cancelled) else { return };
        let usage = finished.usage;
        self.release(finished);
        self.emit(id, EngineEvent::Finished { reason: FinishReason::Cancelled, usage });
    }

    /// Fails a request: frees its state (never kept) and sends `Failed`.
    fn fail(&mut self, id: RequestId, error: EngineError) {
        counter!(names::ERRORS_TOTAL, "kind" => error.kind()).increment(1);
        self.constraints.remove(id);
        if let Some(finished) = self.scheduler.remove(id, FinishReason::Cancelled) {
            if let Some(speculator) = &mut self.speculator {
                speculator.end(id, &finished.tokens);
            }
        }
        if let Some(live) = self.live.get_mut(&id) {
            live.keep_as = None;
            let pending = live.pending_snapshot.take();
            if let Some(state) = live.state.take() {
                self.settle_or_defer(Settle::Free { id, state });
            }
            if let Some((_, taken)) = pending {
                self.give_back_snapshot(id, taken);
            }
        }
        self.emit(id, EngineEvent::Failed(error));
    }

    /// A request left the scheduler: store its decode snapshot, keep or free its state, record its times.
    fn release(&mut self, finished: FinishedSeq) {
        self.constraints.remove(finished.id);
        if let Some(speculator) = &mut self.speculator {
            speculator.end(finished.id, &finished.tokens);
        }
        let Some(pending) = self.live.get_mut(&finished.id).map(|l| l.pending_snapshot.take()) else { return };
        if let Some((tokens, taken)) = pending {
            self.store_snapshot(finished.id, &tokens, taken);
        }
        let Some(live) = self.live.get_mut(&finished.id) else { return };
        let state = live.state.take();
        let keep_as = live.keep_as.take();
        if let (Some(s), Some(last)) = (live.first_scheduled, live.last_token) {
            histogram!(names::REQUEST_INFERENCE_TIME_SECONDS).record(last.saturating_duration_since(s).as_secs_f64());
            histogram!(names::REQUEST_QUEUE_TIME_SECONDS)
                .record(s.saturating_duration_since(live.arrival).as_secs_f64());
        }
        if let (Some(first), Some(last)) = (live.first_token, live.last_token) {
            histogram!(names::REQUEST_DECODE_TIME_SECONDS).record(last.saturating_duration_since(first).as_secs_f64());
        }
        self.settle_or_defer(Settle::Release { finished, keep_as, state });
    }

    /// Settles now, or once no step in flight holds the state.
    fn settle_or_defer(&mut self, settle: Settle) {
        match settle.state().is_some_and(|s| self.is_flying(s)) {
            true => self.deferred.push(settle),
            false => self.settle(settle),
        }
    }

    /// Keeps a released state as its response when asked (unless it ran past the kept history: drafts
    /// accepted beyond a stop token), else frees it.
    fn settle(&mut self, settle: Settle) {
        let runner = self.runner.as_mut();
        let (id, result) = match settle {
            Settle::Release { finished, keep_as: Some(response), state } => {
                let state = match state {
                    Some(s) if finished.state_matches_history() => Some(s),
                    Some(s) => runner.free_state(s).map(|_| None).unwrap_or(None),
                    None => None,
                };
                counter!(names::SESSIONS_KEPT_TOTAL).increment(1);
                (finished.id, self.sessions.keep(runner, response, finished.tokens, state))
            }
            Settle::Release { finished, keep_as: None, state: Some(s) } => (finished.id, runner.free_state(s)),
            Settle::Release { keep_as: None, state: None, .. } => return,
            Settle::Free { id, state } => (id, runner.free_state(state)),
        };
        if let Err(e) = result {
            tracing::warn!(request = %id, error = %e, "releasing a request's state failed");
        }
    }

    /// Keeps kept responses within the device, host and kept-responses budgets (running states are
    /// pinned).
    fn enforce_memory(&mut self) {
        let live_bytes = self.live_bytes();
        match self.sessions.enforce(self.runner.as_mut(), live_bytes, self.config.state_budget_bytes) {
            Ok(done) => {
                counter!(names::SESSIONS_EVICTED_TOTAL, "tier" => "host").increment(done.to_host as u64);
                counter!(names::SESSIONS_EVICTED_TOTAL, "tier" => "dropped").increment(done.dropped as u64);
                counter!(names::SESSIONS_EVICTED_TOTAL, "tier" => "removed").increment(done.removed as u64);
            }
            Err(e) => tracing::warn!(error = %e, "evicting kept responses failed"),
        }
        self.forget_removed();
    }

    /// Device bytes of running requests: their states and their pending decode snapshots.
    fn live_bytes(&self) -> usize {
        let states: usize =
            self.live.values().filter_map(|l| l.state).filter_map(|s| self.runner.state_bytes(s).ok()).sum();
        let pending: usize =
            self.live.values().filter_map(|l| l.pending_snapshot.as_ref()).map(|(_, t)| t.device_bytes()).sum();
        states + pending
    }

    fn record_gauges(&self) {
        gauge!(names::NUM_REQUESTS_RUNNING).set(self.scheduler.num_running() as f64);
        gauge!(names::NUM_REQUESTS_WAITING).set(self.scheduler.num_waiting() as f64);
        let device = self.live_bytes() + self.sessions.device_bytes() + self.prefix.device_bytes();
        let budget = self.config.state_budget_bytes.max(1);
        gauge!(names::KV_CACHE_USAGE_PERC).set((device as f64 / budget as f64).min(1.0));
        gauge!(names::STATE_MEMORY_BYTES, "tier" => "device").set(device as f64);
        gauge!(names::STATE_MEMORY_BYTES, "tier" => "host").set(self.sessions.host_bytes() as f64);
        gauge!(names::PREFIX_CACHE_BYTES, "tier" => "device").set(self.prefix.device_bytes() as f64);
        gauge!(names::PREFIX_CACHE_BYTES, "tier" => "host").set(self.prefix.host_bytes() as f64);
        gauge!(names::SESSIONS_KEPT).set(self.sessions.len() as f64);
        gauge!(names::SESSIONS_BYTES).set(self.sessions.held_bytes() as f64);
    }
}
