//! Closed-loop replay of session trees, as AgentX runs it (agentx.md §1.4–§1.6).
//!
//! Invariants:
//! - Concurrency counts lanes, i.e. live session trees, not HTTP requests: a lane plays one tree
//!   (main chain plus every subagent, background ones included) to the end, then recycles at once
//!   with the next session in order (wrapping around). Subagents run inside their parent's lane, so
//!   in-flight requests can exceed the concurrency during fan-out.
//! - A main turn starts only after the previous turn ended, every branch joined before it has
//!   drained, and its end-to-start delay has elapsed. Delays are `recorded × time_scale`, capped by
//!   the per-tree idle cap; the whole-system idle cap shifts every pending timer forward whenever no
//!   request is in flight, so the next one starts within the cap.
//! - Every play has its own cache-busting marker; the first play of each lane starts at the turn
//!   its sampled t* gives, after a one-token primer of the turn before (warmup, never recorded). All
//!   primers finish ([`warm_up`]) before the profiling clock starts ([`profile`]); a failed primer aborts
//!   the run.
//! - After the duration or the request budget no request starts; requests in flight finish and
//!   count. A context overflow ends its chain; any other error advances to the next turn.
//! - All time is `tokio::time`, so tests run the whole engine under a paused (fake) clock.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::dag::{Chain, Session};
use crate::error::{ReplayError, Result};
use crate::metrics::RequestRecord;
use crate::synth::{play_key, Conversation, HistoryMode, Synth, TurnInput};
use crate::transport::{Connection, Transport, TurnOutcome, TurnRequest};

/// How a run replays its sessions.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Live session trees (lanes).
    pub concurrency: usize,
    /// Profiling time; no request starts after it.
    pub duration: Option<Duration>,
    /// Profiled requests to start at most.
    pub max_requests: Option<usize>,
    /// Factor on every recorded delay (`--time-scale`; 0 replays back to back).
    pub time_scale: f64,
    /// Whole-system idle cap (AIPerf: 10 s), applied to scaled time.
    pub system_idle_cap: Option<Duration>,
    /// Cap on each single delay of a tree (InferenceX: 300 s).
    pub tree_idle_cap: Option<Duration>,
    /// t* range as fractions of each first-population trace's duration; `None` starts at turn 0.
    pub start_ratio: Option<(f64, f64)>,
    pub seed: u64,
    pub model: String,
    pub history: HistoryMode,
    /// How long requests in flight may take to finish after the stop.
    pub grace: Duration,
    /// Print a progress line to stderr every this often.
    pub progress_every: Option<Duration>,
}

impl ReplayOptions {
    pub fn validate(&self) -> Result<()> {
        if self.concurrency == 0 {
            return Err(ReplayError::option("--concurrency", "must be >= 1"));
        }
        if self.duration.is_none() && self.max_requests.is_none() {
            return Err(ReplayError::option("--duration", "give --duration or --max-requests (or both)"));
        }
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return Err(ReplayError::option("--time-scale", format!("must be >= 0, found {}", self.time_scale)));
        }
        if let Some((lo, hi)) = self.start_ratio {
            if !(0.0..=1.0).contains(&lo) || !(0.0..=1.0).contains(&hi) || lo > hi {
                return Err(ReplayError::option(
                    "--start-ratio",
                    format!("need 0 <= min <= max <= 1, found {lo},{hi}"),
                ));
            }
        }
        Ok(())
    }
}

/// What a run produced.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub records: Vec<RequestRecord>,
    pub warmup_requests: usize,
    pub plays: u64,
    /// Profiling wall time, from the start barrier to the last lane's end.
    pub wall_s: f64,
    /// Total time the system idle cap skipped.
    pub idle_skipped_s: f64,
}

/// How long the system must stay without requests in flight before the idle cap shifts timers.
const IDLE_SETTLE: Duration = Duration::from_millis(1);

/// Whole-system idle cap: a shared time shift applied to every pending delay.
struct IdleGate {
    cap: Option<Duration>,
    state: Mutex<GateState>,
    shift: watch::Sender<Duration>,
}

struct GateState {
    inflight: usize,
    next_id: u64,
    /// Sleeper id → virtual deadline (real deadline + the shift at registration).
    sleepers: std::collections::BTreeMap<u64, Instant>,
}

impl IdleGate {
    fn new(cap: Option<Duration>) -> Self {
        IdleGate {
            cap,
            state: Mutex::new(GateState { inflight: 0, next_id: 0, sleepers: Default::default() }),
            shift: watch::Sender::new(Duration::ZERO),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        // A poisoned lock only means another task panicked; the counters are still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// With nothing in flight, moves time forward so the earliest sleeper wakes within the cap.
    fn rebalance(&self, state: &GateState) {
        let Some(cap) = self.cap else { return };
        if state.inflight > 0 {
            return;
        }
        let Some(earliest) = state.sleepers.values().min() else { return };
        let shift = *self.shift.borrow();
        let wake = *earliest - shift;
        let latest_allowed = Instant::now() + cap;
        if wake > latest_allowed {
            self.shift.send_replace(shift + (wake - latest_allowed));
        }
    }

    fn request_started(&self) {
        self.lock().inflight += 1;
    }

    /// Returns true when nothing is in flight any more.
    fn request_ended(&self) -> bool {
        let mut s = self.lock();
        s.inflight -= 1;
        s.inflight == 0
    }

    fn rebalance_now(&self) {
        let s = self.lock();
        self.rebalance(&s);
    }

    /// Sleeps `delay` (shortened by idle-cap shifts); false when `stop` fired first.
    async fn sleep(&self, delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
        if *stop.borrow() {
            return false;
        }
        if delay.is_zero() {
            return true;
        }
        let mut shift_rx = self.shift.subscribe();
        let id = {
            let mut s = self.lock();
            let id = s.next_id;
            s.next_id += 1;
            s.sleepers.insert(id, Instant::now() + delay + *shift_rx.borrow());
            self.rebalance(&s);
            id
        };
        let woke = loop {
            let target = {
                let shift = *shift_rx.borrow_and_update();
                let virtual_deadline = self.lock().sleepers.get(&id).copied().unwrap_or_else(Instant::now);
                virtual_deadline.checked_sub(shift).unwrap_or_else(Instant::now)
            };
            tokio::select! {
                _ = tokio::time::sleep_until(target) => break true,
                changed = shift_rx.changed() => if changed.is_err() { break true },
                _ = stop.changed() => if *stop.borrow() { break false },
            }
        };
        let mut s = self.lock();
        s.sleepers.remove(&id);
        self.rebalance(&s);
        woke
    }
}

/// State shared by every lane of a run.
struct Shared {
    opts: ReplayOptions,
    synth: Arc<Synth>,
    sessions: Arc<Vec<Session>>,
    gate: IdleGate,
    stop_tx: watch::Sender<bool>,
    started: AtomicUsize,
    next_play: AtomicU64,
    records: Mutex<Vec<RequestRecord>>,
    inflight: AtomicUsize,
    run_start: Mutex<Option<Instant>>,
}

impl Shared {
    fn stop(&self) {
        self.stop_tx.send_replace(true);
    }

    fn stopped(&self) -> bool {
        *self.stop_tx.borrow()
    }

    /// Claims a profiled request slot; false once stopped or the budget is spent.
    fn try_start(&self) -> bool {
        if self.stopped() {
            return false;
        }
        let n = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(max) = self.opts.max_requests {
            if n > max {
                self.stop();
                return false;
            }
            if n == max {
                self.stop();
            }
        }
        true
    }

    fn scaled_delay(&self, recorded_s: f64) -> Duration {
        let d = Duration::from_secs_f64((recorded_s * self.opts.time_scale).max(0.0));
        match self.opts.tree_idle_cap {
            Some(cap) => d.min(cap),
            None => d,
        }
    }

    fn since_start(&self, t: Instant) -> f64 {
        let start = self.run_start.lock().unwrap_or_else(|e| e.into_inner()).unwrap_or(t);
        t.saturating_duration_since(start).as_secs_f64()
    }

    fn push(&self, record: RequestRecord) {
        self.records.lock().unwrap_or_else(|e| e.into_inner()).push(record);
    }
}

/// Where a lane's first play starts.
struct FirstPlay {
    session: usize,
    play: u64,
    start_turn: usize,
}

/// Replays `sessions` over `transport` until the duration or request budget is spent: [`warm_up`], then
/// [`profile`].
pub async fn replay<T: Transport>(
    transport: Arc<T>,
    synth: Arc<Synth>,
    sessions: Arc<Vec<Session>>,
    opts: ReplayOptions,
) -> Result<RunOutcome> {
    profile(warm_up(transport, synth, sessions, opts).await?).await
}

/// Lanes connected and primed, waiting for the profiling clock.
pub struct Warm<C> {
    shared: Arc<Shared>,
    conns: Vec<Arc<C>>,
    firsts: Vec<FirstPlay>,
    /// Each lane's conversation after its primer, and the primer's response id.
    primed: Vec<(Conversation, Option<String>)>,
    warmup_requests: usize,
}

/// Connects every lane and runs the warmup primers; nothing of it is recorded.
pub async fn warm_up<T: Transport>(
    transport: Arc<T>,
    synth: Arc<Synth>,
    sessions: Arc<Vec<Session>>,
    opts: ReplayOptions,
) -> Result<Warm<T::Conn>> {
    opts.validate()?;
    if sessions.is_empty() {
        return Err(ReplayError::option("--traces", "no sessions to replay"));
    }
    let shared = Arc::new(Shared {
        gate: IdleGate::new(opts.system_idle_cap),
        stop_tx: watch::Sender::new(false),
        started: AtomicUsize::new(0),
        next_play: AtomicU64::new(0),
        records: Mutex::new(Vec::new()),
        inflight: AtomicUsize::new(0),
        run_start: Mutex::new(None),
        synth,
        sessions,
        opts,
    });

    // Connect every lane and run the warmup primers before the profiling clock starts.
    let mut conns = Vec::new();
    for _ in 0..shared.opts.concurrency {
        conns.push(Arc::new(transport.connect().await?));
    }
    let mut firsts = Vec::new();
    let mut primers = Vec::new();
    for (lane, conn) in conns.iter().enumerate() {
        let play = shared.next_play.fetch_add(1, Ordering::SeqCst);
        let session = (play % shared.sessions.len() as u64) as usize;
        let start_turn = sample_start_turn(&shared.sessions[session], shared.opts.start_ratio, shared.opts.seed, lane);
        let mut conv = new_conversation(&shared, session, play);
        let (shared2, conn2) = (shared.clone(), conn.clone());
        primers.push(tokio::spawn(async move {
            if start_turn == 0 {
                return Ok((conv, None, 0));
            }
            let s = &shared2.sessions[session];
            let input = conv.plan(&shared2.synth, s.scope, s.block_size, &s.main, start_turn - 1);
            let request = turn_request(&shared2, &s.main, play, input, None, Some(1))?;
            let outcome = conn2.send(request).await?;
            conv.complete(&shared2.synth, s.scope, &s.main, start_turn - 1, outcome.completion_tokens as usize);
            Ok::<_, ReplayError>((conv, outcome.response_id, 1))
        }));
        firsts.push(FirstPlay { session, play, start_turn });
    }
    let mut warmup_requests = 0;
    let mut primed = Vec::new();
    for p in primers {
        let (conv, id, n) = p.await.map_err(|e| ReplayError::Connection(format!("warmup task: {e}")))??;
        warmup_requests += n;
        primed.push((conv, id));
    }
    Ok(Warm { shared, conns, firsts, primed, warmup_requests })
}

/// Starts the profiling clock and plays the primed lanes until the duration or request budget is spent.
pub async fn profile<C: Connection>(warm: Warm<C>) -> Result<RunOutcome> {
    let Warm { shared, conns, firsts, primed, warmup_requests } = warm;
    let start = Instant::now();
    *shared.run_start.lock().unwrap_or_else(|e| e.into_inner()) = Some(start);
    if let Some(d) = shared.opts.duration {
        let s = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(d).await;
            s.stop();
        });
    }
    let progress = shared.opts.progress_every.map(|every| {
        let s = shared.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                eprintln!("{}", progress_line(&s));
            }
        })
    });

    let mut lanes = Vec::new();
    for (lane, ((conn, first), (conv, prev))) in conns.into_iter().zip(firsts).zip(primed).enumerate() {
        let s = shared.clone();
        lanes.push(tokio::spawn(async move { run_lane(s, conn, lane, first, conv, prev).await }));
    }
    // Wait for the lanes: unbounded until the stop, then at most the grace period.
    let mut stop_rx = shared.stop_tx.subscribe();
    let all = futures_util::future::join_all(lanes);
    tokio::pin!(all);
    let finished = tokio::select! {
        r = &mut all => Some(r),
        _ = stop_rx.wait_for(|s| *s) => None,
    };
    let results = match finished {
        Some(r) => r,
        None => tokio::time::timeout(shared.opts.grace, &mut all).await.unwrap_or_default(),
    };
    if let Some(p) = progress {
        p.abort();
    }
    for r in results {
        r.map_err(|e| ReplayError::Connection(format!("lane task: {e}")))?;
    }
    let wall_s = start.elapsed().as_secs_f64();
    let mut records = std::mem::take(&mut *shared.records.lock().unwrap_or_else(|e| e.into_inner()));
    records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    let idle_skipped_s = shared.gate.shift.borrow().as_secs_f64();
    Ok(RunOutcome { records, warmup_requests, plays: shared.next_play.load(Ordering::SeqCst), wall_s, idle_skipped_s })
}

fn progress_line(s: &Shared) -> String {
    let records = s.records.lock().unwrap_or_else(|e| e.into_inner());
    let errors = records.iter().filter(|r| !r.ok()).count();
    let now = s.since_start(Instant::now());
    format!(
        "[{now:8.1}s] requests {} ok, {errors} errors, {} in flight, {} plays, idle skipped {:.1}s",
        records.len() - errors,
        s.inflight.load(Ordering::SeqCst),
        s.next_play.load(Ordering::SeqCst),
        s.gate.shift.borrow().as_secs_f64()
    )
}

/// The first turn of a lane's first play: the turn at the sampled t* (leaving ≥ 1 turn).
pub fn sample_start_turn(session: &Session, ratio: Option<(f64, f64)>, seed: u64, lane: usize) -> usize {
    let Some((lo, hi)) = ratio else { return 0 };
    let turns = &session.main.turns;
    if turns.len() < 2 {
        return 0;
    }
    let u = (play_key(seed, lane as u64, &session.id) >> 11) as f64 / (1u64 << 53) as f64;
    let t_star = (lo + (hi - lo) * u) * session.duration_s();
    turns.iter().position(|t| t.t >= t_star).unwrap_or(turns.len() - 1).min(turns.len() - 1)
}

fn new_conversation(shared: &Shared, session: usize, play: u64) -> Conversation {
    let s = &shared.sessions[session];
    Conversation::new(shared.opts.history, shared.synth.marker(play_key(shared.opts.seed, play, &s.id)))
}

fn turn_request(
    shared: &Shared,
    chain: &Chain,
    play: u64,
    input: TurnInput,
    previous: Option<String>,
    max_tokens: Option<usize>,
) -> Result<TurnRequest> {
    let pool = shared.synth.pool();
    let messages = input.messages.iter().map(|m| Ok((m.role, pool.text(&m.tokens)?))).collect::<Result<Vec<_>>>()?;
    Ok(TurnRequest {
        stream_id: format!("{}#{play}", chain.id),
        model: shared.opts.model.clone(),
        messages,
        previous_response_id: if input.continues && shared.opts.history == HistoryMode::ServerKept {
            previous
        } else {
            None
        },
        max_tokens: max_tokens.unwrap_or(input.max_output_tokens),
    })
}

async fn run_lane<C: Connection>(
    shared: Arc<Shared>,
    conn: Arc<C>,
    lane: usize,
    first: FirstPlay,
    conv: Conversation,
    prev: Option<String>,
) {
    let first_play =
        Play { shared: shared.clone(), conn: conn.clone(), lane, session: first.session, play: first.play };
    first_play.tree(first.start_turn, conv, prev).await;
    while !shared.stopped() {
        let play = shared.next_play.fetch_add(1, Ordering::SeqCst);
        let session = (play % shared.sessions.len() as u64) as usize;
        let conv = new_conversation(&shared, session, play);
        Play { shared: shared.clone(), conn: conn.clone(), lane, session, play }.tree(0, conv, None).await;
    }
}

/// One play of one session tree on one lane: what all its turns (the main chain's and the subagents') share.
struct Play<C> {
    shared: Arc<Shared>,
    conn: Arc<C>,
    lane: usize,
    session: usize,
    play: u64,
}

impl<C> Clone for Play<C> {
    fn clone(&self) -> Self {
        Play { shared: self.shared.clone(), conn: self.conn.clone(), ..*self }
    }
}

impl<C: Connection> Play<C> {
    /// Plays the session tree from main turn `start_turn`.
    async fn tree(&self, start_turn: usize, mut conv: Conversation, mut prev: Option<String>) {
        let shared = &self.shared;
        let s = &shared.sessions[self.session];
        let mut stop = shared.stop_tx.subscribe();
        let mut handles: Vec<Option<JoinHandle<()>>> = s.branches.iter().map(|_| None).collect();
        let mut prev_end = Instant::now();
        for k in start_turn..s.main.turns.len() {
            // The delay runs from the end of the previous turn, concurrently with the subagents.
            let ready_at =
                prev_end + if k > start_turn { shared.scaled_delay(s.main.turns[k].delay_s) } else { Duration::ZERO };
            for b in s.joins_before(k) {
                if let Some(h) = handles[b].take() {
                    // A failed child counts as done for the join (AIPerf's default).
                    let _ = h.await;
                }
            }
            if !shared.gate.sleep(ready_at.saturating_duration_since(Instant::now()), &mut stop).await {
                break;
            }
            match self.turn(&s.main, 0, k, &mut conv, &mut prev).await {
                TurnEnd::Stopped | TurnEnd::ChainEnded => break,
                TurnEnd::Done => prev_end = Instant::now(),
            }
            for (bi, branch) in s.branches.iter().enumerate().filter(|(_, b)| b.after_turn == k) {
                let mut children = Vec::new();
                for ci in 0..branch.children.len() {
                    let play = self.clone();
                    children.push(tokio::spawn(async move {
                        play.child(bi, ci).await;
                    }));
                }
                handles[bi] = Some(tokio::spawn(async move {
                    for c in children {
                        let _ = c.await;
                    }
                }));
            }
        }
        // Background branches (and any left after a stop) still hold the lane until they drain.
        for h in handles.into_iter().flatten() {
            let _ = h.await;
        }
    }

    /// Plays subagent `child` of branch `branch`.
    async fn child(&self, branch: usize, child: usize) {
        let shared = &self.shared;
        let s = &shared.sessions[self.session];
        let sub = &s.branches[branch].children[child];
        let mut stop = shared.stop_tx.subscribe();
        if !shared.gate.sleep(shared.scaled_delay(sub.spawn_delay_s), &mut stop).await {
            return;
        }
        let mut conv = new_conversation(shared, self.session, self.play);
        let mut prev = None;
        for k in 0..sub.chain.turns.len() {
            if k > 0 && !shared.gate.sleep(shared.scaled_delay(sub.chain.turns[k].delay_s), &mut stop).await {
                return;
            }
            match self.turn(&sub.chain, 1, k, &mut conv, &mut prev).await {
                TurnEnd::Stopped | TurnEnd::ChainEnded => return,
                TurnEnd::Done => {}
            }
        }
    }

    /// Sends turn `k` of `chain` (at subagent depth `depth`) and records it.
    async fn turn(
        &self,
        chain: &Chain,
        depth: u8,
        k: usize,
        conv: &mut Conversation,
        prev: &mut Option<String>,
    ) -> TurnEnd {
        let shared = &self.shared;
        if !shared.try_start() {
            return TurnEnd::Stopped;
        }
        let s = &shared.sessions[self.session];
        let input = conv.plan(&shared.synth, s.scope, s.block_size, chain, k);
        let (planned_in, planned_out, continues) = (input.context_tokens, input.max_output_tokens, input.continues);
        shared.gate.request_started();
        shared.inflight.fetch_add(1, Ordering::SeqCst);
        let start = Instant::now();
        let result = match turn_request(shared, chain, self.play, input, prev.clone(), None) {
            Ok(request) => self.conn.send(request).await,
            Err(e) => Err(e),
        };
        let end = Instant::now();
        shared.inflight.fetch_sub(1, Ordering::SeqCst);
        if shared.gate.request_ended() {
            // Idle only if no lane starts a ready request right away: look again a moment later.
            let s = shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(IDLE_SETTLE).await;
                s.gate.rebalance_now();
            });
        }
        let mut record = RequestRecord {
            session: s.id.clone(),
            chain: chain.id.clone(),
            turn: k,
            depth,
            lane: self.lane,
            continues,
            start_s: shared.since_start(start),
            end_s: shared.since_start(end),
            ttft_s: None,
            itl_s: None,
            e2e_s: None,
            planned_input_tokens: planned_in,
            planned_output_tokens: planned_out,
            prompt_tokens: None,
            output_tokens: 0,
            cached_tokens: None,
            content_chunks: 0,
            spec: None,
            error: None,
            error_message: None,
        };
        let end_state = match result {
            Ok(outcome) => {
                fill_timing(&mut record, &outcome, start, end);
                conv.complete(&shared.synth, s.scope, chain, k, outcome.completion_tokens as usize);
                *prev = outcome.response_id;
                TurnEnd::Done
            }
            Err(e) => {
                let overflow = e.is_context_overflow();
                record.error = Some(if overflow { "context_overflow".into() } else { e.kind().into() });
                record.error_message = Some(e.to_string());
                conv.reset();
                *prev = None;
                if overflow {
                    TurnEnd::ChainEnded
                } else {
                    TurnEnd::Done
                }
            }
        };
        shared.push(record);
        end_state
    }
}

enum TurnEnd {
    Done,
    Stopped,
    ChainEnded,
}

fn fill_timing(record: &mut RequestRecord, o: &TurnOutcome, start: Instant, end: Instant) {
    record.ttft_s = o.first_content.map(|t| (t - start).as_secs_f64());
    record.e2e_s = Some((o.last_content.unwrap_or(end) - start).as_secs_f64());
    if let (Some(first), Some(last)) = (o.first_content, o.last_content) {
        if o.completion_tokens >= 2 {
            record.itl_s = Some((last - first).as_secs_f64() / (o.completion_tokens - 1) as f64);
        }
    }
    record.prompt_tokens = o.prompt_tokens;
    record.output_tokens = o.completion_tokens;
    record.cached_tokens = o.cached_tokens;
    record.content_chunks = o.content_chunks;
    record.spec = o.spec.clone();
}
