//! Engine-level tests: the real engine thread driving a `NullRunner` (wrapped to count what it is
//! asked to compute and how many states are alive), and the CPU k3-tiny where the model's own numbers
//! must not change.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sparkd_kernels::launches::FedRow;
use sparkd_kernels::null_runner::NullRunner;
use sparkd_kernels::runner::{RowInput, RowOutput, SamplingParams};
use sparkd_kernels::state::SeqState;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, Result as KResult, Runner, StateId, TokenId};
use tokio::sync::mpsc;

use super::core::{spawn, Engine};
use super::sessions::KeptSummary;
use super::step_time::{linear_costs, StepTarget, StepTimeLimit};
use super::types::*;
use crate::config::speculation::{SpecMethod, SpeculationConfig};
use crate::metrics::{
    LocalMetrics, PREFIX_CACHE_HITS_TOTAL, PREFIX_CACHE_QUERIES_TOTAL, SESSION_CACHE_HITS_TOTAL,
    SESSION_CACHE_QUERIES_TOTAL,
};
use crate::startup;

/// What the wrapped runner saw.
#[derive(Debug, Default)]
struct Seen {
    /// Tokens fed per step, drafts included.
    step_tokens: Vec<usize>,
    live_states: usize,
    forks: usize,
    imports: usize,
    exports: usize,
    /// Steps launched fed on the device (asynchronous scheduling).
    fed_steps: usize,
    fail_next_step: bool,
}

/// Holds the probe's steps where a test needs the engine to wait for it (no sleeps): with a limit, the step that
/// would be the limit-th waits until the test moves or lifts it. The engine thread parked here delivers nothing (its
/// event backlogs are retried between steps), so a test must not wait on events that would need a held step; a
/// gate held past `GATE_TIMEOUT` opens itself and says so in `timed_out`, failing the test instead of hanging it.
#[derive(Default)]
struct Gate {
    limit: Mutex<GateLimit>,
    moved: Condvar,
}

#[derive(Default)]
struct GateLimit {
    steps: Option<usize>,
    timed_out: bool,
}

/// Far longer than any gated test needs between moving the gate and lifting it.
const GATE_TIMEOUT: Duration = Duration::from_secs(60);

impl Gate {
    /// Waits while `steps` taken have reached the limit.
    fn pass(&self, steps: usize) {
        let limit = self.limit.lock().unwrap();
        let (mut limit, wait) =
            self.moved.wait_timeout_while(limit, GATE_TIMEOUT, |l| l.steps.is_some_and(|l| steps >= l)).unwrap();
        if wait.timed_out() {
            *limit = GateLimit { steps: None, timed_out: true };
        }
    }

    /// Lets steps run until `steps` have been taken (`None`: without a limit).
    fn hold_at(&self, steps: Option<usize>) {
        let mut limit = self.limit.lock().unwrap();
        assert!(!limit.timed_out, "the engine waited at the gate for {GATE_TIMEOUT:?}: the test deadlocked");
        limit.steps = steps;
        self.moved.notify_all();
    }
}

/// A NullRunner that reports to the test (the mutex is test-only bookkeeping, not around a model).
struct Probe {
    inner: NullRunner,
    seen: Arc<Mutex<Seen>>,
    gate: Arc<Gate>,
}

impl Probe {
    /// Waits at the gate before a step is launched.
    fn pass_gate(&self) {
        let steps = self.seen.lock().unwrap().step_tokens.len();
        self.gate.pass(steps);
    }
}

impl Runner for Probe {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn alloc_state(&mut self) -> KResult<StateId> {
        self.seen.lock().unwrap().live_states += 1;
        self.inner.alloc_state()
    }
    fn fork_state(&mut self, src: StateId) -> KResult<StateId> {
        let mut seen = self.seen.lock().unwrap();
        seen.live_states += 1;
        seen.forks += 1;
        self.inner.fork_state(src)
    }
    fn free_state(&mut self, id: StateId) -> KResult<()> {
        self.seen.lock().unwrap().live_states -= 1;
        self.inner.free_state(id)
    }
    fn state_len(&self, id: StateId) -> KResult<usize> {
        self.inner.state_len(id)
    }
    fn state_bytes(&self, id: StateId) -> KResult<usize> {
        self.inner.state_bytes(id)
    }
    fn export_state(&self, id: StateId) -> KResult<SeqState> {
        self.seen.lock().unwrap().exports += 1;
        self.inner.export_state(id)
    }
    fn import_state(&mut self, state: SeqState) -> KResult<StateId> {
        let mut seen = self.seen.lock().unwrap();
        seen.live_states += 1;
        seen.imports += 1;
        self.inner.import_state(state)
    }
    fn step(&mut self, rows: &[RowInput]) -> KResult<Vec<RowOutput>> {
        self.pass_gate();
        let mut seen = self.seen.lock().unwrap();
        if std::mem::take(&mut seen.fail_next_step) {
            return Err(sparkd_kernels::KernelError::Device("injected failure".into()));
        }
        seen.step_tokens.push(rows.iter().map(|r| r.tokens.len()).sum());
        self.inner.step(rows)
    }
    fn launches_ahead(&self) -> bool {
        self.inner.launches_ahead()
    }
    fn launch(&mut self, rows: &[RowInput]) -> KResult<()> {
        self.pass_gate();
        self.inner.launch(rows)?;
        self.seen.lock().unwrap().step_tokens.push(rows.iter().map(|r| r.tokens.len()).sum());
        Ok(())
    }
    fn launch_fed(&mut self, rows: &[FedRow]) -> KResult<()> {
        self.pass_gate();
        self.inner.launch_fed(rows)?;
        let mut seen = self.seen.lock().unwrap();
        seen.step_tokens.push(rows.len());
        seen.fed_steps += 1;
        Ok(())
    }
    /// An injected failure fails the step collected next (its outputs are lost, as a device fault loses them).
    fn collect(&mut self) -> KResult<Vec<RowOutput>> {
        let outputs = self.inner.collect()?;
        match std::mem::take(&mut self.seen.lock().unwrap().fail_next_step) {
            true => Err(sparkd_kernels::KernelError::Device("injected failure".into())),
            false => Ok(outputs),
        }
    }
}

struct Harness {
    handle: EngineHandle,
    seen: Arc<Mutex<Seen>>,
    gate: Arc<Gate>,
    engine: Option<Engine>,
}

impl Harness {
    fn new(config: EngineConfig) -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let inner = NullRunner::new(ModelConfig::preset("k3-tiny").unwrap());
        let gate = Arc::new(Gate::default());
        let engine = spawn(Box::new(Probe { inner, seen: seen.clone(), gate: gate.clone() }), None, config).unwrap();
        Harness { handle: engine.handle(), seen, gate, engine: Some(engine) }
    }

    fn submit(&self, request: GenerateRequest) -> mpsc::Receiver<EngineEvent> {
        self.submit_with_room(request, 4)
    }

    /// Submits with room for `events` unread events on the request's channel before they wait in its backlog.
    fn submit_with_room(&self, request: GenerateRequest, events: usize) -> mpsc::Receiver<EngineEvent> {
        let (tx, rx) = mpsc::channel(events);
        self.handle.blocking_send(EngineCommand::Generate { request, events: tx }).unwrap();
        rx
    }

    /// Steps the runner has taken (launched ones included).
    fn steps(&self) -> usize {
        self.seen.lock().unwrap().step_tokens.len()
    }

    fn tokens_computed(&self) -> usize {
        self.seen.lock().unwrap().step_tokens.iter().sum()
    }

    fn live_states(&self) -> usize {
        self.seen.lock().unwrap().live_states
    }

    /// What the API reads of a kept response, once the engine has taken every command sent so far.
    fn lookup(&self, id: &str) -> Option<KeptSummary> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.handle.blocking_send(EngineCommand::Barrier { reply }).unwrap();
        answer.blocking_recv().unwrap();
        self.handle.kept_response(&ResponseId(id.into())).unwrap()
    }

    fn drop_response(&self, id: &str) -> bool {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.handle.blocking_send(EngineCommand::DropResponse { id: ResponseId(id.into()), reply }).unwrap();
        answer.blocking_recv().unwrap()
    }

    fn record(&self, id: &str, record: &'static [u8]) {
        let (reply, committed) = tokio::sync::oneshot::channel();
        let command = EngineCommand::RecordResponse {
            id: ResponseId(id.into()),
            record: bytes::Bytes::from_static(record),
            reply,
        };
        self.handle.blocking_send(command).unwrap();
        assert!(committed.blocking_recv().unwrap(), "committed");
    }

    /// Waits until the engine has handled everything sent so far (a no-op command round trip).
    fn settle(&self) {
        let done = collect(self.submit(request(u64::MAX, vec![1], 1)));
        assert!(matches!(done.finish, Some((FinishReason::Length, _))));
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(engine) = self.engine.take() {
            engine.shutdown();
        }
    }
}

fn config() -> EngineConfig {
    EngineConfig { max_num_batched_tokens: 64, max_num_seqs: 8, ..EngineConfig::default() }
}

fn request(id: u64, prompt: Vec<TokenId>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        id: RequestId(id),
        prompt,
        continue_from: None,
        keep_as: None,
        sampling: SamplingParams::greedy(),
        max_tokens,
        ignore_eos: false,
        stop_token_ids: Vec::new(),
        arrival: Instant::now(),
        num_spec_tokens: None,
        constraint: None,
    }
}

fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32).map(|i| 100 + (seed * 31 + i * 7) % 5000).collect()
}

/// Everything one request received.
#[derive(Debug, Default)]
struct Collected {
    started: Option<(usize, usize)>,
    tokens: Vec<TokenId>,
    finish: Option<(FinishReason, Usage)>,
    failed: Option<EngineError>,
}

fn collect(mut rx: mpsc::Receiver<EngineEvent>) -> Collected {
    let mut c = Collected::default();
    while let Some(event) = rx.blocking_recv() {
        match event {
            EngineEvent::Started { prompt_tokens, cached_tokens, .. } => {
                c.started = Some((prompt_tokens, cached_tokens))
            }
            EngineEvent::Tokens { tokens, .. } => c.tokens.extend(tokens),
            EngineEvent::Finished { reason, usage } => c.finish = Some((reason, usage)),
            EngineEvent::Failed(e) => c.failed = Some(e),
        }
    }
    c
}

#[test]
fn thirty_two_concurrent_requests_finish_with_the_right_tokens() {
    let h = Harness::new(config());
    let specs: Vec<(Vec<TokenId>, usize)> =
        (0..32).map(|i| (prompt(i, 5 + (i as usize * 13) % 90), 1 + i as usize % 9)).collect();
    let receivers: Vec<_> =
        specs.iter().enumerate().map(|(i, (p, n))| h.submit(request(i as u64, p.clone(), *n))).collect();
    for ((p, n), rx) in specs.iter().zip(receivers) {
        let c = collect(rx);
        assert_eq!(c.tokens, NullRunner::greedy_continuation(p, *n), "batching does not change tokens");
        let (reason, usage) = c.finish.unwrap();
        assert_eq!((reason, usage.prompt_tokens, usage.completion_tokens), (FinishReason::Length, p.len(), *n));
        assert_eq!(c.started, Some((p.len(), 0)));
    }
    let seen = h.seen.lock().unwrap();
    assert!(seen.step_tokens.iter().all(|&t| t <= 64), "every step within the token budget");
    let prompts: usize = specs.iter().map(|(p, _)| p.len()).sum();
    let decodes: usize = specs.iter().map(|(_, n)| n - 1).sum();
    assert_eq!(seen.step_tokens.iter().sum::<usize>(), prompts + decodes, "each token computed once");
    assert_eq!(seen.live_states, 0, "every state freed");
}

#[test]
fn stop_ids_end_a_request_unless_ignore_eos() {
    let h = Harness::new(config());
    let p = prompt(1, 10);
    let expected = NullRunner::greedy_continuation(&p, 6);
    let mut r = request(1, p.clone(), 6);
    r.stop_token_ids = vec![expected[2]];
    let c = collect(h.submit(r.clone()));
    assert_eq!(c.tokens, expected[..3].to_vec());
    assert_eq!(c.finish.unwrap().0, FinishReason::Stop);
    r.id = RequestId(2);
    r.ignore_eos = true;
    assert_eq!(collect(h.submit(r)).tokens, expected);
}

#[test]
fn cancel_and_client_gone_free_the_state() {
    let h = Harness::new(EngineConfig { max_num_batched_tokens: 4, ..config() });
    let mut rx = h.submit(request(1, prompt(1, 3), 500_000));
    // Wait for the first tokens, then cancel.
    loop {
        match rx.blocking_recv() {
            Some(EngineEvent::Tokens { .. }) => break,
            Some(_) => {}
            None => panic!("the events channel closed before any token"),
        }
    }
    h.handle.blocking_send(EngineCommand::Cancel(RequestId(1))).unwrap();
    let rest = collect(rx);
    let (reason, usage) = rest.finish.unwrap();
    assert_eq!(reason, FinishReason::Cancelled);
    assert!(usage.completion_tokens < 500_000);
    let rx = h.submit(request(2, prompt(2, 3), 500_000));
    drop(rx);
    h.settle();
    assert_eq!(h.live_states(), 0);
    // Shutdown cancels what is still running, and waits for the client to take its last events.
    let rx = h.submit(request(3, prompt(3, 3), 500_000));
    h.settle();
    let reader = std::thread::spawn(move || collect(rx));
    let handle = h.handle.clone();
    drop(h);
    let c = reader.join().unwrap();
    assert_eq!(c.finish.map(|(reason, _)| reason), Some(FinishReason::Cancelled));
    assert_eq!(handle.try_send(EngineCommand::Cancel(RequestId(3))), Err(EngineError::Stopped));
}

#[test]
fn a_client_that_does_not_read_is_cut_off_at_the_backlog_bound_and_its_state_freed() {
    let h = Harness::new(EngineConfig { max_event_backlog: 8, max_num_batched_tokens: 4, ..config() });
    let mut kept = request(1, prompt(1, 3), 500_000);
    kept.keep_as = Some(ResponseId("resp_slow".into()));
    let mut rx = h.submit(kept);
    assert!(matches!(rx.blocking_recv(), Some(EngineEvent::Started { .. })), "it runs (and holds a state)");
    // Nobody reads now: the engine fills the channel (4), then the backlog, then cancels the request and frees
    // its state while others are served.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while h.live_states() > 0 {
        assert!(std::time::Instant::now() < deadline, "the request that nobody reads was never cut off");
        h.settle();
    }
    let c = collect(rx);
    assert!(matches!(c.failed, Some(EngineError::SlowReader { backlog: 9 })), "{:?}", c.failed);
    assert!(c.finish.is_none());
    // What was delivered before the cut is at most the channel's worth of events.
    assert!(c.tokens.len() <= 4 * 4, "{} tokens", c.tokens.len());
    assert!(h.lookup("resp_slow").is_none(), "a response nobody read is not kept");
}

#[test]
fn continuing_a_kept_response_prefills_only_new_tokens_and_forks_never_recompute() {
    let h = Harness::new(config());
    let p1 = prompt(1, 40);
    let mut turn1 = request(1, p1.clone(), 5);
    turn1.keep_as = Some(ResponseId("resp_1".into()));
    let out1 = collect(h.submit(turn1)).tokens;
    let history: Vec<TokenId> = p1.iter().chain(&out1).copied().collect();
    h.settle();
    let before = h.tokens_computed();
    // Two subagents continue the same response at once.
    let news = [vec![11, 12, 13], vec![21, 22]];
    let receivers: Vec<_> = news
        .iter()
        .enumerate()
        .map(|(i, new)| {
            let mut r = request(10 + i as u64, new.clone(), 4);
            r.continue_from = Some(ResponseId("resp_1".into()));
            h.submit(r)
        })
        .collect();
    for (new, rx) in news.iter().zip(receivers) {
        let c = collect(rx);
        let full: Vec<TokenId> = history.iter().chain(new).copied().collect();
        assert_eq!(c.tokens, NullRunner::greedy_continuation(&full, 4));
        assert_eq!(c.started, Some((full.len(), history.len() - 1)));
    }
    // Each fork fed its last kept token plus its new tokens, then 3 decode tokens.
    assert_eq!(h.tokens_computed() - before, (1 + 3 + 3) + (1 + 2 + 3));
    assert_eq!(h.seen.lock().unwrap().forks, 2);
    assert_eq!(h.live_states(), 1, "only the kept response's state remains");
    let mut unknown = request(20, vec![1], 1);
    unknown.continue_from = Some(ResponseId("resp_nope".into()));
    let c = collect(h.submit(unknown));
    assert!(matches!(c.failed, Some(EngineError::UnknownResponse(ref id)) if id.0 == "resp_nope"));
    assert!(h.drop_response("resp_1"));
    h.settle();
    assert_eq!(h.live_states(), 0);
}

/// Keeps a response, then continues it under `config`; returns the continuation and how many
/// tokens the continuation computed.
fn keep_then_continue(config: EngineConfig) -> (Vec<TokenId>, usize, Seen) {
    let h = Harness::new(config);
    let mut turn1 = request(1, prompt(3, 50), 6);
    turn1.keep_as = Some(ResponseId("resp_a".into()));
    collect(h.submit(turn1));
    // A second kept response puts the first under memory pressure (least recently used).
    let mut other = request(2, prompt(4, 50), 6);
    other.keep_as = Some(ResponseId("resp_b".into()));
    collect(h.submit(other));
    h.settle();
    let before = h.tokens_computed();
    let mut turn2 = request(3, vec![31, 32], 8);
    turn2.continue_from = Some(ResponseId("resp_a".into()));
    let tokens = collect(h.submit(turn2)).tokens;
    let computed = h.tokens_computed() - before;
    let seen = std::mem::take(&mut *h.seen.lock().unwrap());
    (tokens, computed, seen)
}

/// A kept turn that ends on a stop token, a continuation of it, and a request cancelled while decoding, under
/// `async_scheduling`: the tokens, what the continuation computed, and what the runner saw.
fn stop_continue_and_cancel(async_scheduling: bool) -> (Vec<Vec<TokenId>>, usize, Seen) {
    let h = Harness::new(EngineConfig { async_scheduling, prefix_cache_bytes: 0, ..config() });
    let p = prompt(7, 20);
    let greedy = NullRunner::greedy_continuation(&p, 12);
    let stop_at = (4..12).find(|&k| !greedy[..k].contains(&greedy[k])).expect("a fresh token to stop on");
    let mut turn1 = request(1, p, 12);
    turn1.stop_token_ids = vec![greedy[stop_at]];
    turn1.keep_as = Some(ResponseId("resp_s".into()));
    let first = collect(h.submit(turn1));
    assert_eq!(first.finish.map(|f| f.0), Some(FinishReason::Stop));
    h.settle();
    let before = h.tokens_computed();
    let mut turn2 = request(2, vec![41, 42], 6);
    turn2.continue_from = Some(ResponseId("resp_s".into()));
    let second = collect(h.submit(turn2));
    let computed = h.tokens_computed() - before;
    // A continuation that adds no token (generate on from the kept history alone).
    let mut turn2b = request(4, Vec::new(), 4);
    turn2b.continue_from = Some(ResponseId("resp_s".into()));
    let more = collect(h.submit(turn2b));
    assert!(more.failed.is_none(), "{:?}", more.failed);
    // Far more tokens than the engine makes before the cancel arrives: the gate holds it at 20 more steps until the
    // cancel is sent (so neither the length limit nor the slow-reader limit ends the request first). The channel has
    // room for every event of those steps: one left in the backlog would wait for a step the gate holds.
    const HELD_STEPS: usize = 20;
    h.gate.hold_at(Some(h.steps() + HELD_STEPS));
    let mut rx = h.submit_with_room(request(3, prompt(8, 9), 500_000), HELD_STEPS + 2);
    let mut cancelled = Vec::new();
    while cancelled.len() < 5 {
        if let Some(EngineEvent::Tokens { tokens, .. }) = rx.blocking_recv() {
            cancelled.extend(tokens);
        }
    }
    h.handle.blocking_send(EngineCommand::Cancel(RequestId(3))).unwrap();
    h.gate.hold_at(None);
    let rest = collect(rx);
    assert_eq!(rest.finish.map(|f| f.0), Some(FinishReason::Cancelled));
    cancelled.truncate(5);
    h.settle();
    let seen = std::mem::take(&mut *h.seen.lock().unwrap());
    (vec![first.tokens, second.tokens, more.tokens, cancelled], computed, seen)
}

#[test]
fn async_scheduling_keeps_the_tokens_and_kept_states_of_stepping_one_at_a_time() {
    let (ahead, ahead_computed, ahead_seen) = stop_continue_and_cancel(true);
    let (plain, plain_computed, plain_seen) = stop_continue_and_cancel(false);
    assert!(ahead_seen.fed_steps > 10, "steady decodes ran ahead: {} fed steps", ahead_seen.fed_steps);
    assert_eq!(plain_seen.fed_steps, 0);
    assert_eq!(ahead, plain, "the same tokens, stop, continuation and cancel alike");
    // The stop token was fed by the step launched ahead, so the kept state holds the whole history and
    // the continuation feeds only its 2 new tokens, not the stop token as well.
    assert_eq!(ahead_computed + 1, plain_computed);
    assert_eq!((ahead_seen.forks, plain_seen.forks), (2, 2), "each continuation forked the kept state");
    assert_eq!(ahead_seen.live_states, plain_seen.live_states, "only the kept state is left");
}

#[test]
fn eviction_to_host_and_drop_then_rebuild_continue_identically() {
    let no_prefix = EngineConfig { prefix_cache_bytes: 0, ..config() };
    let (on_device, device_computed, seen) = keep_then_continue(no_prefix.clone());
    assert_eq!((seen.forks, seen.imports), (1, 0));
    // Room for one kept state on the device (55 tokens * 4 bytes): the older one goes to host.
    let (on_host, host_computed, seen) =
        keep_then_continue(EngineConfig { state_budget_bytes: 300, ..no_prefix.clone() });
    assert_eq!((seen.forks, seen.imports), (0, 1));
    // No host room either: dropped, rebuilt by prefill from the history.
    let (rebuilt, rebuilt_computed, seen) =
        keep_then_continue(EngineConfig { state_budget_bytes: 300, host_budget_bytes: 0, ..no_prefix });
    assert_eq!((seen.forks, seen.imports), (0, 0));
    assert_eq!(on_device, on_host);
    assert_eq!(on_device, rebuilt);
    assert_eq!(device_computed, host_computed);
    assert_eq!(rebuilt_computed, device_computed + 55, "the 56-token history minus its fed last token");
}

#[test]
fn chat_resend_restores_the_cached_prefix_and_prefills_only_the_suffix() {
    let h = Harness::new(config());
    let p1 = prompt(5, 100);
    let out1 = collect(h.submit(request(1, p1.clone(), 40))).tokens;
    h.settle();
    // Turn 2 resends the whole conversation plus a new user message (as AIPerf does).
    let mut p2: Vec<TokenId> = p1.iter().chain(&out1).copied().collect();
    p2.extend(prompt(6, 30));
    let before = h.tokens_computed();
    let c = collect(h.submit(request(2, p2.clone(), 3)));
    assert_eq!(c.tokens, NullRunner::greedy_continuation(&p2, 3));
    // Turn 1 left snapshots at 64 (its prompt's last boundary) and 128 (passed while decoding).
    let (_, usage) = c.finish.unwrap();
    assert_eq!((usage.cached_tokens, usage.prompt_tokens), (128, 170));
    assert_eq!(c.started, Some((170, 128)));
    assert_eq!(h.tokens_computed() - before, 170 - 128 + 2);
    assert_eq!(h.seen.lock().unwrap().imports, 1);
}

#[test]
fn device_tier_snapshots_are_forks_restored_by_forking_and_each_freed_once() {
    let h = Harness::new(EngineConfig { prefix_device_bytes: 1 << 20, ..config() });
    let p1 = prompt(5, 100);
    let out1 = collect(h.submit(request(1, p1.clone(), 100))).tokens;
    h.settle();
    {
        let seen = h.seen.lock().unwrap();
        assert_eq!((seen.exports, seen.imports), (0, 0), "no state left the device");
        // The prompt's boundary 64, then 128 and 192 passed while decoding: 192 replaced 128, which was freed.
        assert_eq!(seen.forks, 3);
        assert_eq!(seen.live_states, 2, "only the cache's own snapshots at 64 and 192 are left");
    }
    let mut p2: Vec<TokenId> = p1.iter().chain(&out1).copied().collect();
    p2.extend(prompt(6, 30));
    let c = collect(h.submit(request(2, p2.clone(), 3)));
    assert_eq!(c.tokens, NullRunner::greedy_continuation(&p2, 3), "the same tokens as a recomputed prefix");
    assert_eq!(c.started, Some((230, 192)), "restored from the decode snapshot at 192");
    h.settle();
    let seen = h.seen.lock().unwrap();
    assert_eq!((seen.exports, seen.imports, seen.forks), (0, 0, 4), "the lookup forked the snapshot");
    assert_eq!(seen.live_states, 2, "the restored fork was freed with its request; the entries stay");
}

#[test]
fn a_kept_chain_s_later_turns_take_no_prefix_snapshots() {
    let h = Harness::new(config());
    let exports = || h.seen.lock().unwrap().exports;
    let mut history = prompt(8, 100);
    let mut turn1 = request(1, history.clone(), 40);
    turn1.keep_as = Some(ResponseId("resp_c1".into()));
    history.extend(collect(h.submit(turn1)).tokens);
    h.settle();
    let first = exports();
    assert_eq!(first, 2, "the chain's first turn: its prompt's boundary 64, and 128 passed while decoding");
    // Turn 2 passes the boundaries 192 (prompt) and 256 (decoding), and is kept: no snapshot.
    let new_tokens = prompt(9, 100);
    history.extend(&new_tokens);
    let mut turn2 = request(2, new_tokens, 40);
    (turn2.continue_from, turn2.keep_as) = (Some(ResponseId("resp_c1".into())), Some(ResponseId("resp_c2".into())));
    let c = collect(h.submit(turn2));
    assert_eq!(c.tokens, NullRunner::greedy_continuation(&history, 40));
    assert_eq!(c.started, Some((history.len(), history.len() - 101)), "restored from the kept state");
    h.settle();
    assert_eq!(exports(), first);
    // A continuation that is not kept still leaves its snapshots for a resend of the conversation.
    let mut turn3 = request(3, prompt(10, 100), 40);
    turn3.continue_from = Some(ResponseId("resp_c2".into()));
    collect(h.submit(turn3));
    h.settle();
    assert_eq!(exports(), first + 2);
}

/// The prefix- and session-cache counters of `metrics`: (prefix queries, prefix hits, session queries, session hits).
fn reuse_counts(metrics: &LocalMetrics) -> [f64; 4] {
    [PREFIX_CACHE_QUERIES_TOTAL, PREFIX_CACHE_HITS_TOTAL, SESSION_CACHE_QUERIES_TOTAL, SESSION_CACHE_HITS_TOTAL]
        .map(|name| metrics.value(name, None).unwrap_or_else(|| panic!("no {name} series")))
}

#[test]
fn a_continuation_counts_its_kept_tokens_as_prefix_and_session_cache_hits() {
    let metrics = LocalMetrics::new();
    let h = metrics.capture(|| Harness::new(config()));
    let p1 = prompt(11, 40);
    let mut turn1 = request(1, p1.clone(), 5);
    turn1.keep_as = Some(ResponseId("resp_r".into()));
    let first = collect(h.submit(turn1));
    h.settle();
    // A fresh request looks its prompt up in the prefix cache (all but its last token) and misses.
    assert_eq!(first.started, Some((40, 0)));
    assert_eq!(reuse_counts(&metrics), [39.0, 0.0, 0.0, 0.0]);
    let mut turn2 = request(2, vec![11, 12, 13], 4);
    turn2.continue_from = Some(ResponseId("resp_r".into()));
    let second = collect(h.submit(turn2));
    let (context, cached) = second.started.expect("started");
    assert_eq!((context, cached), (40 + 5 + 3, 40 + 5 - 1), "the kept state holds the history but its last token");
    // The continuation's kept tokens are hits of both counters, as many as the response reports cached.
    let reusable = (context - 1) as f64;
    assert_eq!(reuse_counts(&metrics), [39.0 + reusable, cached as f64, reusable, cached as f64]);
}

#[test]
fn a_continuation_whose_kept_state_was_dropped_is_a_session_miss_looked_up_in_the_prefix_cache() {
    let metrics = LocalMetrics::new();
    // Room for one kept state on the device and none on the host: the older one is dropped (history only).
    let h =
        metrics.capture(|| Harness::new(EngineConfig { state_budget_bytes: 300, host_budget_bytes: 0, ..config() }));
    for (id, seed) in [(1, 3), (2, 4)] {
        let mut turn = request(id, prompt(seed, 50), 6);
        turn.keep_as = Some(ResponseId(format!("resp_{id}")));
        collect(h.submit(turn));
    }
    h.settle();
    assert_eq!(reuse_counts(&metrics), [98.0, 0.0, 0.0, 0.0]);
    let mut turn = request(3, vec![31, 32], 4);
    turn.continue_from = Some(ResponseId("resp_1".into()));
    let (context, cached) = collect(h.submit(turn)).started.expect("started");
    assert_eq!((context, cached), (50 + 6 + 2, 0), "rebuilt by prefill: no 64-token snapshot to restore");
    let reusable = (context - 1) as f64;
    assert_eq!(reuse_counts(&metrics), [98.0 + reusable, 0.0, reusable, 0.0]);
}

#[test]
fn a_runner_failure_fails_that_step_and_the_engine_goes_on() {
    let h = Harness::new(config());
    h.seen.lock().unwrap().fail_next_step = true;
    let c = collect(h.submit(request(1, prompt(1, 5), 3)));
    assert!(matches!(c.failed, Some(EngineError::Runner { kind: "device", .. })));
    assert!(c.finish.is_none());
    let p = prompt(2, 5);
    assert_eq!(collect(h.submit(request(2, p.clone(), 3))).tokens, NullRunner::greedy_continuation(&p, 3));
    h.settle();
    assert_eq!(h.live_states(), 0);
}

#[test]
fn invalid_requests_fail_with_a_clear_error() {
    let h = Harness::new(config());
    let c = collect(h.submit(request(1, Vec::new(), 3)));
    assert!(matches!(c.failed, Some(EngineError::InvalidRequest(ref m)) if m.contains("empty")));
    let c = collect(h.submit(request(2, vec![1], 0)));
    assert!(matches!(c.failed, Some(EngineError::InvalidRequest(ref m)) if m.contains("max_tokens")));
    let c = collect(h.submit(request(3, vec![999_999], 1)));
    assert!(matches!(c.failed, Some(EngineError::InvalidRequest(ref m)) if m.contains("vocabulary")));
}

#[test]
fn the_engine_alone_keeps_responses_and_its_view_shows_them_with_records_until_deleted() {
    let h = Harness::new(config());
    let p = prompt(7, 20);
    let mut turn1 = request(1, p.clone(), 4);
    turn1.keep_as = Some(ResponseId("resp_k".into()));
    let out = collect(h.submit(turn1)).tokens;
    let kept = h.lookup("resp_k").expect("kept once finished");
    assert_eq!((kept.last_token, kept.len, kept.record), (out.last().copied(), 24, None));
    h.record("resp_k", b"{\"id\":\"resp_k\"}");
    h.record("resp_gone", b"{}");
    assert_eq!(h.lookup("resp_k").unwrap().record.as_deref(), Some(&b"{\"id\":\"resp_k\"}"[..]));
    assert_eq!(h.lookup("resp_gone"), None, "a record for an id that is not kept is dropped");
    assert!(h.drop_response("resp_k"));
    assert!(!h.drop_response("resp_k"), "deleting twice finds nothing");
    assert_eq!(h.lookup("resp_k"), None);
    let mut continued = request(2, vec![5], 1);
    continued.continue_from = Some(ResponseId("resp_k".into()));
    let c = collect(h.submit(continued));
    assert!(matches!(c.failed, Some(EngineError::UnknownResponse(ref id)) if id.0 == "resp_k"));
    h.settle();
    assert_eq!(h.live_states(), 0, "the deleted response's state was freed");
}

#[test]
fn the_kept_responses_budget_removes_the_least_recently_used_with_its_history() {
    // One kept 30-token response holds 29 * 4 state + 30 * 4 history + 6 id bytes twice (store and
    // view) + the view's 48-byte summary = 296 bytes: two fit, three do not.
    let h = Harness::new(EngineConfig { kept_responses_bytes: 700, prefix_cache_bytes: 0, ..config() });
    for (i, id) in ["resp_a", "resp_b", "resp_c"].into_iter().enumerate() {
        let mut r = request(i as u64 + 1, prompt(i as u32, 26), 4);
        r.keep_as = Some(ResponseId(id.into()));
        collect(h.submit(r));
        if id == "resp_b" {
            // Continuing resp_a makes resp_b the least recently used.
            let mut cont = request(10, vec![9], 1);
            cont.continue_from = Some(ResponseId("resp_a".into()));
            assert!(collect(h.submit(cont)).failed.is_none());
        }
    }
    h.settle();
    assert_eq!(h.lookup("resp_b"), None, "evicted entirely, history included");
    assert!(h.lookup("resp_a").is_some() && h.lookup("resp_c").is_some());
    let mut cont = request(20, vec![9], 1);
    cont.continue_from = Some(ResponseId("resp_b".into()));
    assert!(matches!(collect(h.submit(cont)).failed, Some(EngineError::UnknownResponse(_))));
    // Two kept device states remain, nothing else.
    assert_eq!(h.live_states(), 2);
}

#[test]
fn a_config_the_cli_would_have_rejected_is_an_internal_fault() {
    let runner = NullRunner::new(ModelConfig::preset("k3-tiny").unwrap());
    let err = spawn(Box::new(runner), None, EngineConfig { max_num_seqs: 0, ..config() }).unwrap_err();
    assert!(matches!(err, EngineError::Internal(ref m) if m.contains("max_num_seqs")), "{err}");
    assert_eq!(err.kind(), "internal");
}

#[test]
fn a_step_time_limit_chunks_prefill_beside_decode_rows_and_keeps_the_tokens() {
    // Beside one decode token (1.1 ms, target 1.65 ms) 5 prompt tokens fit, so the minimum chunk of 8 runs.
    // t(B) = 1 ms + B × 0.1 ms.
    let limit = StepTimeLimit::new(linear_costs(0.001, 1e-4, 64), StepTarget::Factor(1.5), 8);
    let (short, long) = (prompt(1, 3), prompt(2, 200));
    let run = |step_time: Option<StepTimeLimit>| {
        let h = Harness::new(EngineConfig { step_time, ..config() });
        // Both requests are sent before the first step runs, so the prompt is taken while request 1 decodes: its
        // 100 tokens outlive the prompt's prefill (at least 8 tokens a step), whatever the threads' timing.
        h.gate.hold_at(Some(0));
        let decoding = h.submit(request(1, short.clone(), 100));
        let prefilling = h.submit(request(2, long.clone(), 5));
        h.gate.hold_at(None);
        let tokens = (collect(decoding).tokens, collect(prefilling).tokens);
        let big_steps = h.seen.lock().unwrap().step_tokens.iter().filter(|&&n| n > 9).count();
        (tokens, big_steps)
    };
    let (limited, limited_big) = run(Some(limit));
    let (free, free_big) = run(None);
    assert_eq!(limited.0, NullRunner::greedy_continuation(&short, 100));
    assert_eq!(limited.1, NullRunner::greedy_continuation(&long, 5));
    assert_eq!(limited, free, "the limit changes how prompts are chunked, never the tokens");
    assert!(limited_big <= 1, "only a step without decode rows exceeds 1 + 8 tokens ({limited_big})");
    assert!(free_big >= 3, "without a limit the prompt takes 63-token chunks ({free_big})");
}

/// Greedy tokens of `requests` (prompt, max_tokens) run concurrently on the CPU k3-tiny with `spec` and
/// `step_time`, under a budget of 16 tokens (every window at most 16 tokens, where a window's forward
/// equals token-by-token decoding bit for bit).
fn cpu_greedy(
    requests: &[(Vec<TokenId>, usize)],
    spec: &SpeculationConfig,
    step_time: Option<StepTimeLimit>,
) -> Vec<Vec<TokenId>> {
    let model = ModelConfig::preset("k3-tiny").unwrap();
    let mut runner = startup::cpu_runner(
        &model,
        &SyntheticWeights::new(model.clone(), 5),
        spec,
        &startup::DrafterOrigin::Preset("k3-tiny".into()),
    )
    .expect("cpu runner");
    let speculation = startup::speculation(spec, runner.as_mut(), 16).expect("speculation composes");
    let config = EngineConfig { max_num_batched_tokens: 16, max_num_seqs: 4, step_time, ..EngineConfig::default() };
    let engine = spawn(runner, speculation, config).unwrap();
    let handle = engine.handle();
    let receivers: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, (p, n))| {
            let (tx, rx) = mpsc::channel(4);
            let request = GenerateRequest { ignore_eos: true, ..request(i as u64, p.clone(), *n) };
            handle.blocking_send(EngineCommand::Generate { request, events: tx }).unwrap();
            rx
        })
        .collect();
    let tokens = receivers.into_iter().map(|rx| collect(rx).tokens).collect();
    engine.shutdown();
    tokens
}

#[test]
fn cpu_greedy_output_is_unchanged_by_the_step_time_limit_and_dspark() {
    // Request 0 decodes while 1 and 2 prefill in 4-token chunks (the target is the decode rows' own time);
    // the reference is spec off without a limit (16-token chunks).
    let limit = StepTimeLimit::new(linear_costs(0.001, 1e-4, 64), StepTarget::Factor(1.0), 4);
    let cpu_prompt = |len: u32, salt: u32| (0..len).map(|i| (i * 7919 + salt * 104_729 + 13) % 100_000).collect();
    let requests: Vec<(Vec<TokenId>, usize)> =
        vec![(cpu_prompt(5, 0), 12), (cpu_prompt(21, 1), 4), (cpu_prompt(13, 2), 4)];
    let off = SpeculationConfig::default();
    let reference = cpu_greedy(&requests, &off, None);
    assert!(reference.iter().zip(&requests).all(|(t, (_, n))| t.len() == *n));
    let dspark = SpeculationConfig { method: SpecMethod::Dspark, num_spec_tokens: 7, ..SpeculationConfig::default() };
    assert_eq!(cpu_greedy(&requests, &dspark, Some(limit)), reference, "dspark, ℓ = 7");
}
