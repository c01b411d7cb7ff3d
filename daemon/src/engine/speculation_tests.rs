//! Speculative decoding through the real engine thread: greedy output with speculation equals
//! output without it (every method, ℓ = 1..8, batches of 1..16 mixed-length prompts, every budget),
//! an oracle draft is accepted at rate 1, a forced acceptance length is met and flagged, the
//! per-request override caps drafts, a drafter whose drafts do not pay stops being called (and one
//! whose drafts are all accepted never does, however low its stated confidence). The wide sweep runs on the NullRunner (its greedy tokens are a
//! known function of the history); DSpark, the hybrid and the forced AL run on the CPU k3-tiny with
//! its synthetic drafter, with every window at most 16 tokens (where a window's forward equals
//! token-by-token decoding bit for bit, so spec-off and spec-on runs are comparable exactly).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use sparkd_kernels::launches::FedRow;
use sparkd_kernels::null_runner::NullRunner;
use sparkd_kernels::runner::{DraftProposal, DraftRequest, Drafter, RowInput, RowOutput, SamplingParams, TokenMask};
use sparkd_kernels::state::SeqState;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, Runner, StateId, TokenId};
use sparkd_spec::sps::SpsPoint;
use sparkd_spec::{DraftPoint, ForcedAcceptance, SpsProfile};
use tokio::sync::mpsc;

use super::core::{spawn, Engine};
use super::types::*;
use crate::config::speculation::{SpecBudget, SpecMethod, SpeculationConfig};
use crate::metrics::{
    LocalMetrics, SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL, SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POS_TOTAL,
};
use crate::startup;

mod trained;

/// What one request received.
#[derive(Debug, Default)]
struct Outcome {
    tokens: Vec<TokenId>,
    /// `(drafted, accepted)` of every round that verified drafts.
    rounds: Vec<(usize, usize)>,
    usage: Option<Usage>,
    failed: Option<EngineError>,
}

impl Outcome {
    fn drafted(&self) -> usize {
        self.rounds.iter().map(|r| r.0).sum()
    }

    fn accepted(&self) -> usize {
        self.rounds.iter().map(|r| r.1).sum()
    }

    /// Mean acceptance length, `1 + accepted / rounds` (vLLM's definition).
    fn acceptance_length(&self) -> f64 {
        1.0 + self.accepted() as f64 / self.rounds.len().max(1) as f64
    }
}

fn collect(mut rx: mpsc::Receiver<EngineEvent>) -> Outcome {
    let mut o = Outcome::default();
    while let Some(event) = rx.blocking_recv() {
        match event {
            EngineEvent::Started { .. } => {}
            EngineEvent::Tokens { tokens, drafted, accepted, .. } => {
                o.tokens.extend(tokens);
                if drafted > 0 {
                    o.rounds.push((drafted, accepted));
                }
            }
            EngineEvent::Finished { usage, .. } => o.usage = Some(usage),
            EngineEvent::Failed(e) => o.failed = Some(e),
        }
    }
    o
}

struct Harness {
    engine: Option<Engine>,
    next_id: u64,
}

impl Harness {
    /// The engine on `runner`, speculating as start-up composes `spec`.
    fn new(mut runner: Box<dyn Runner>, spec: SpeculationConfig, max_num_batched_tokens: usize) -> Self {
        let speculation =
            startup::speculation(&spec, runner.as_mut(), max_num_batched_tokens).expect("speculation composes");
        let config = EngineConfig { max_num_batched_tokens, max_num_seqs: 16, ..EngineConfig::default() };
        Harness { engine: Some(spawn(runner, speculation, config).expect("engine starts")), next_id: 1 }
    }

    /// Runs `requests` (prompt, max_tokens, per-request ℓ) concurrently, greedy.
    fn run(&mut self, requests: &[(Vec<TokenId>, usize, Option<usize>)]) -> Vec<Outcome> {
        self.run_with(requests, &SamplingParams::greedy())
    }

    fn run_with(
        &mut self,
        requests: &[(Vec<TokenId>, usize, Option<usize>)],
        sampling: &SamplingParams,
    ) -> Vec<Outcome> {
        let requests: Vec<GenerateRequest> = requests
            .iter()
            .map(|(prompt, max_tokens, num_spec_tokens)| {
                let mut request = self.request(prompt.clone(), *max_tokens);
                request.sampling = sampling.clone();
                request.num_spec_tokens = *num_spec_tokens;
                request
            })
            .collect();
        self.submit(requests)
    }

    /// A greedy request with the next id.
    fn request(&mut self, prompt: Vec<TokenId>, max_tokens: usize) -> GenerateRequest {
        self.next_id += 1;
        GenerateRequest::greedy(RequestId(self.next_id), prompt, max_tokens)
    }

    /// Runs `requests` concurrently.
    fn submit(&mut self, requests: Vec<GenerateRequest>) -> Vec<Outcome> {
        let handle = self.engine.as_ref().expect("running").handle();
        let receivers: Vec<_> = requests
            .into_iter()
            .map(|request| {
                let (tx, rx) = mpsc::channel(4);
                handle.blocking_send(EngineCommand::Generate { request, events: tx }).expect("engine alive");
                rx
            })
            .collect();
        receivers.into_iter().map(collect).collect()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(engine) = self.engine.take() {
            engine.shutdown();
        }
    }
}

fn spec(method: SpecMethod, num_spec_tokens: usize) -> SpeculationConfig {
    SpeculationConfig { method, num_spec_tokens, ..SpeculationConfig::default() }
}

fn null_runner() -> Box<dyn Runner> {
    Box::new(NullRunner::new(ModelConfig::preset("k3-tiny").expect("preset")))
}

/// A prompt of `len` tokens that repeats a short phrase (agent traffic is repetitive).
fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32).map(|i| 200 + (seed * 13 + i % (3 + seed % 5)) % 3000).collect()
}

fn profile() -> SpsProfile {
    let points = [(1, 100.0), (8, 95.0), (32, 60.0), (128, 20.0)];
    SpsProfile::from_points(points.iter().map(|&(b, s)| SpsPoint { batch_tokens: b, steps_per_second: s }).collect())
        .expect("profile")
}

/// A batch of `n` requests with mixed prompt lengths and output lengths.
fn batch(n: usize, salt: u32) -> Vec<(Vec<TokenId>, usize, Option<usize>)> {
    (0..n as u32).map(|i| (prompt(i + salt, 3 + (i as usize * 17) % 60), 5 + (i as usize * 7) % 30, None)).collect()
}

#[test]
fn greedy_output_is_unchanged_by_model_free_speculation_at_every_length_and_batch() {
    let batches = [1, 5, 16];
    for method in [SpecMethod::Suffix, SpecMethod::Ngram] {
        for len in 1..=8 {
            let n = batches[len % batches.len()];
            let mut h = Harness::new(null_runner(), spec(method, len), 64);
            let requests = batch(n, len as u32);
            // Twice: the second time the suffix proposer's global tree knows every output.
            for round in 0..2 {
                let outcomes = h.run(&requests);
                for ((p, max_tokens, _), o) in requests.iter().zip(&outcomes) {
                    assert!(o.failed.is_none(), "{method:?} ℓ={len}: {:?}", o.failed);
                    assert_eq!(o.tokens, NullRunner::greedy_continuation(p, *max_tokens), "{method:?} ℓ={len}");
                    assert!(o.rounds.iter().all(|&(d, a)| d <= len && a <= d));
                    let usage = o.usage.expect("finished");
                    assert_eq!((usage.draft_tokens, usage.accepted_draft_tokens), (o.drafted(), o.accepted()));
                    assert!(!usage.forced_acceptance);
                }
                if method == SpecMethod::Suffix && round == 1 {
                    let accepted: usize = outcomes.iter().map(Outcome::accepted).sum();
                    assert!(accepted > 0, "ℓ={len}: the second pass drafts the outputs of the first");
                }
            }
        }
    }
}

#[test]
fn load_aware_budgets_stay_lossless() {
    for budget in [SpecBudget::Dspark, SpecBudget::Production] {
        let cfg = SpeculationConfig { budget, sps_profile: Some(profile()), ..spec(SpecMethod::Suffix, 6) };
        let mut h = Harness::new(null_runner(), cfg, 48);
        let requests = batch(12, 40);
        for _ in 0..2 {
            for ((p, max_tokens, _), o) in requests.iter().zip(h.run(&requests)) {
                assert_eq!(o.tokens, NullRunner::greedy_continuation(p, *max_tokens), "{budget:?}");
            }
        }
    }
    // A static threshold of 1 verifies only drafts the proposer is certain of.
    let cfg = SpeculationConfig { threshold: 1.0, ..spec(SpecMethod::Ngram, 4) };
    let mut h = Harness::new(null_runner(), cfg, 64);
    let requests = batch(4, 50);
    for ((p, max_tokens, _), o) in requests.iter().zip(h.run(&requests)) {
        assert_eq!(o.tokens, NullRunner::greedy_continuation(p, *max_tokens));
        assert!(o.rounds.is_empty(), "n-gram confidence 0.7 never reaches survival 1");
    }
}

#[test]
fn an_oracle_draft_is_accepted_at_rate_one() {
    // The second request repeats the first: its suffix drafts come from the first's output, which
    // is exactly what the target emits again.
    let mut h = Harness::new(null_runner(), spec(SpecMethod::Suffix, 8), 64);
    let request = vec![(prompt(7, 40), 120, None)];
    let first = h.run(&request).remove(0);
    let second = h.run(&request).remove(0);
    assert_eq!(first.tokens, second.tokens);
    assert!(second.rounds.len() >= 10, "{:?}", second.rounds);
    assert_eq!(second.accepted(), second.drafted(), "every oracle draft is accepted");
    assert!(second.acceptance_length() > 5.0, "AL {}", second.acceptance_length());
    // Fewer target steps: every round emits accepted + 1 tokens.
    let rounds_without_drafts = 120 - second.rounds.iter().map(|r| r.1 + 1).sum::<usize>();
    assert!(second.rounds.len() + rounds_without_drafts < 40);
}

#[test]
fn the_per_request_override_lowers_the_draft_length() {
    let mut h = Harness::new(null_runner(), spec(SpecMethod::Suffix, 8), 64);
    let p = prompt(3, 30);
    h.run(&[(p.clone(), 60, None)]);
    let outcomes = h.run(&[(p.clone(), 60, Some(2)), (p.clone(), 60, Some(0)), (p.clone(), 60, Some(100))]);
    let expected = NullRunner::greedy_continuation(&p, 60);
    assert!(outcomes.iter().all(|o| o.tokens == expected));
    assert!(!outcomes[0].rounds.is_empty() && outcomes[0].rounds.iter().all(|r| r.0 <= 2));
    assert!(outcomes[1].rounds.is_empty(), "num_tokens 0 turns speculation off");
    assert!(outcomes[2].rounds.iter().any(|r| r.0 > 2) && outcomes[2].rounds.iter().all(|r| r.0 <= 8));
}

#[test]
fn per_position_counters_count_the_positions_each_round_drafted_and_accepted() {
    let metrics = LocalMetrics::new();
    let mut h = metrics.capture(|| Harness::new(null_runner(), spec(SpecMethod::Suffix, 8), 64));
    let p = prompt(5, 30);
    // The second pass drafts from the first's output; its rounds are cut to 2 tokens for one request.
    let mut outcomes = h.run(&[(p.clone(), 60, None)]);
    outcomes.extend(h.run(&[(p.clone(), 60, Some(2)), (p, 60, None)]));
    let rounds: Vec<(usize, usize)> = outcomes.iter().flat_map(|o| o.rounds.iter().copied()).collect();
    assert!(rounds.iter().any(|r| r.0 <= 2) && rounds.iter().any(|r| r.0 > 2), "drafts of varying lengths: {rounds:?}");
    for position in 0..8 {
        let label = position.to_string();
        let counted = |name| metrics.value(name, Some(("position", &label))).expect("a series per position");
        let drafted = rounds.iter().filter(|r| r.0 > position).count();
        let accepted = rounds.iter().filter(|r| r.1 > position).count();
        assert_eq!(counted(SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POS_TOTAL), drafted as f64, "position {position}");
        assert_eq!(counted(SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL), accepted as f64, "position {position}");
    }
    assert!(metrics.value(SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POS_TOTAL, Some(("position", "8"))).is_none(), "ℓ = 8");
}

#[test]
fn seeded_sampling_is_unchanged_by_speculation_on_the_null_runner() {
    // The null runner's distribution is a point mass at a seeded function of (history, position), so
    // lossless verification must reproduce the spec-off tokens exactly, sampled or not.
    let sampling = SamplingParams { temperature: 1.0, top_p: 0.9, top_k: 50, seed: 42, logprobs: None };
    let requests = batch(6, 70);
    let reference = Harness::new(null_runner(), SpeculationConfig::default(), 64).run_with(&requests, &sampling);
    let mut h = Harness::new(null_runner(), spec(SpecMethod::Suffix, 5), 64);
    for round in 0..2 {
        let outcomes = h.run_with(&requests, &sampling);
        for (o, want) in outcomes.iter().zip(&reference) {
            assert_eq!(o.tokens, want.tokens, "round {round}");
        }
        if round == 1 {
            assert!(outcomes.iter().map(Outcome::accepted).sum::<usize>() > 0);
        }
    }
}

#[test]
fn a_continued_turn_is_lossless_and_its_output_drafts_a_resent_history() {
    let mut h = Harness::new(null_runner(), spec(SpecMethod::Suffix, 6), 64);
    let p1 = prompt(9, 30);
    let mut turn1 = h.request(p1.clone(), 40);
    turn1.keep_as = Some(ResponseId("resp_s".into()));
    let out1 = h.submit(vec![turn1]).remove(0).tokens;
    let new: Vec<TokenId> = out1[..20].to_vec();
    let mut turn2 = h.request(new.clone(), 30);
    turn2.continue_from = Some(ResponseId("resp_s".into()));
    let o = h.submit(vec![turn2]).remove(0);
    let history: Vec<TokenId> = p1.iter().chain(&out1).chain(&new).copied().collect();
    assert!(o.failed.is_none(), "{:?}", o.failed);
    assert_eq!(o.tokens, NullRunner::greedy_continuation(&history, 30));
    // The same conversation resent whole (as AIPerf does): turn 2's output is in the global tree.
    let resent = h.request(history.clone(), 30);
    let again = h.submit(vec![resent]).remove(0);
    assert_eq!(again.tokens, o.tokens);
    assert!(again.accepted() > 0 && again.accepted() == again.drafted(), "{:?}", again.rounds);
}

#[test]
fn dspark_needs_a_runner_with_a_drafter() {
    let spec = spec(SpecMethod::Dspark, 7);
    let err = startup::speculation(&spec, null_runner().as_mut(), 64).err().expect("refused");
    assert!(err.to_string().contains("drafter"), "{err}");
}

/// The CPU k3-tiny runner as start-up prepares it: with the synthetic drafter when the method uses one, and
/// the forced acceptance.
fn cpu_runner(cfg: &SpeculationConfig) -> Box<dyn Runner> {
    let model = ModelConfig::preset("k3-tiny").expect("preset");
    startup::cpu_runner(
        &model,
        &SyntheticWeights::new(model.clone(), 5),
        cfg,
        &startup::DrafterOrigin::Preset("k3-tiny".into()),
    )
    .expect("cpu runner")
}

/// Token ids spread over the vocabulary (the synthetic model's embeddings are random).
fn cpu_prompt(len: usize, salt: u32) -> Vec<TokenId> {
    (0..len as u32).map(|i| (i * 7919 + salt * 104_729 + 13) % 100_000).collect()
}

#[test]
fn cpu_greedy_output_is_unchanged_by_dspark_hybrid_and_suffix() {
    let requests: Vec<_> = [(5, 7), (12, 6)]
        .iter()
        .enumerate()
        .map(|(i, &(len, max_tokens))| (cpu_prompt(len, i as u32), max_tokens, None))
        .collect();
    let off = SpeculationConfig::default();
    let reference: Vec<Vec<TokenId>> =
        Harness::new(cpu_runner(&off), off, 16).run(&requests).into_iter().map(|o| o.tokens).collect();
    let runs = [
        (SpecMethod::Dspark, 8, SpecBudget::Static),
        (SpecMethod::Hybrid, 3, SpecBudget::Static),
        (SpecMethod::Dspark, 7, SpecBudget::Production),
        (SpecMethod::Hybrid, 7, SpecBudget::Production),
    ];
    for (method, len, budget) in runs {
        let cfg = SpeculationConfig { budget, ..spec(method, len) };
        let outcomes = Harness::new(cpu_runner(&cfg), cfg, 16).run(&requests);
        for (o, want) in outcomes.iter().zip(&reference) {
            assert!(o.failed.is_none(), "{method:?} {budget:?}: {:?}", o.failed);
            assert_eq!(&o.tokens, want, "{method:?} ℓ={len} {budget:?}");
        }
        if (method, budget) == (SpecMethod::Dspark, SpecBudget::Static) {
            assert!(outcomes.iter().all(|o| !o.rounds.is_empty()), "DSpark drafts every decode step");
        }
    }
}

#[test]
fn dspark_drafts_after_a_prefix_cache_restore() {
    // The second request restores the first's prompt snapshot at 64 tokens: its drafter context starts
    // empty there, and drafting must still work and stay lossless.
    let cfg = spec(SpecMethod::Dspark, 4);
    let mut h = Harness::new(cpu_runner(&cfg), cfg, 16);
    let request = vec![(cpu_prompt(70, 3), 4, None)];
    let first = h.run(&request).remove(0);
    let second = h.run(&request).remove(0);
    assert!(first.failed.is_none() && second.failed.is_none(), "{:?} {:?}", first.failed, second.failed);
    assert_eq!(second.usage.expect("finished").cached_tokens, 64);
    assert_eq!(first.tokens, second.tokens);
    assert!(!second.rounds.is_empty());
}

#[test]
fn a_forced_acceptance_length_is_met_and_flagged() {
    // ℓ = 7, AL = 6: the minimum-variance schedule accepts exactly 5 drafts in every full round; only
    // the last round of each request can be cut by max_tokens. Tolerance: 0.25.
    for method in [SpecMethod::Dspark, SpecMethod::Suffix] {
        let synthetic = ForcedAcceptance::Length(6.0).schedule(7).expect("schedule");
        let cfg = SpeculationConfig { synthetic: Some(synthetic), ..spec(method, 7) };
        let requests = vec![(cpu_prompt(6, 1), 31, None)];
        let outcomes = Harness::new(cpu_runner(&cfg), cfg, 32).run(&requests);
        for o in &outcomes {
            assert!(o.failed.is_none(), "{method:?}: {:?}", o.failed);
            assert_eq!(o.tokens.len(), 31);
            let al = o.acceptance_length();
            assert!((al - 6.0).abs() <= 0.25, "{method:?}: AL {al} from {:?}", o.rounds);
            assert!(o.usage.expect("finished").forced_acceptance, "flagged synthetic");
        }
    }
}

/// A runner that counts its steps and its drafter's rounds and, in oracle mode, lends a drafter of its own
/// that drafts the null runner's greedy continuation at a low stated confidence (an under-confident head).
struct Counting {
    inner: Box<dyn Runner>,
    counts: Arc<Counts>,
    /// Oracle mode: each state's committed tokens.
    oracle: Option<HashMap<StateId, Vec<TokenId>>>,
    /// Steps launched and not yet collected: the given rows, or the states of a fed step.
    launched: VecDeque<Launched>,
    /// Each state's last emitted token (what a fed step commits).
    emitted: HashMap<StateId, TokenId>,
}

/// A step [`Counting`] launched, as its collect needs it for the oracle's histories.
enum Launched {
    Given(Vec<RowInput>),
    Fed(Vec<StateId>),
}

#[derive(Default)]
struct Counts {
    steps: AtomicUsize,
    drafts: AtomicUsize,
    /// Steps launched fed on the device (asynchronous scheduling).
    fed: AtomicUsize,
}

impl Counts {
    fn get(&self) -> (usize, usize) {
        (self.steps.load(Ordering::SeqCst), self.drafts.load(Ordering::SeqCst))
    }
}

/// The stated confidence of every oracle draft token.
const ORACLE_CONFIDENCE: f32 = 0.3;

impl Counting {
    /// An oracle over a null runner; `wrap` and `oracle` fill in what differs.
    fn empty() -> Self {
        Counting {
            inner: null_runner(),
            counts: Arc::new(Counts::default()),
            oracle: Some(HashMap::new()),
            launched: VecDeque::new(),
            emitted: HashMap::new(),
        }
    }

    /// Extends the oracle's histories with what a collected step committed, and notes each row's last token.
    fn committed(&mut self, launched: &Launched, outputs: &[RowOutput]) {
        if let Some(o) = &mut self.oracle {
            match launched {
                Launched::Given(rows) => {
                    for (row, out) in rows.iter().zip(outputs) {
                        let kept = row.tokens.len() - row.sample.as_ref().map_or(0, |s| s.draft_len - out.num_accepted);
                        o.entry(row.state).or_default().extend_from_slice(&row.tokens[..kept]);
                    }
                }
                Launched::Fed(states) => {
                    for state in states {
                        let fed = self.emitted.get(state).copied();
                        o.entry(*state).or_default().extend(fed);
                    }
                }
            }
        }
        let states: Vec<StateId> = match launched {
            Launched::Given(rows) => rows.iter().map(|r| r.state).collect(),
            Launched::Fed(states) => states.clone(),
        };
        for (state, out) in states.into_iter().zip(outputs) {
            if let Some(&last) = out.tokens.last() {
                self.emitted.insert(state, last);
            }
        }
    }

    fn wrap(inner: Box<dyn Runner>) -> (Box<dyn Runner>, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let runner = Counting { inner, counts: counts.clone(), oracle: None, ..Counting::empty() };
        (Box::new(runner), counts)
    }

    fn oracle() -> (Box<dyn Runner>, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let runner = Counting { inner: null_runner(), counts: counts.clone(), ..Counting::empty() };
        (Box::new(runner), counts)
    }
}

impl Runner for Counting {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn device_name(&self) -> String {
        self.inner.device_name()
    }

    fn alloc_state(&mut self) -> sparkd_kernels::Result<StateId> {
        let id = self.inner.alloc_state()?;
        if let Some(o) = &mut self.oracle {
            o.insert(id, Vec::new());
        }
        Ok(id)
    }

    fn fork_state(&mut self, src: StateId) -> sparkd_kernels::Result<StateId> {
        let id = self.inner.fork_state(src)?;
        if let Some(o) = &mut self.oracle {
            let history = o.get(&src).cloned().unwrap_or_default();
            o.insert(id, history);
        }
        Ok(id)
    }

    fn free_state(&mut self, id: StateId) -> sparkd_kernels::Result<()> {
        if let Some(o) = &mut self.oracle {
            o.remove(&id);
        }
        self.inner.free_state(id)
    }

    fn state_len(&self, id: StateId) -> sparkd_kernels::Result<usize> {
        self.inner.state_len(id)
    }

    fn state_bytes(&self, id: StateId) -> sparkd_kernels::Result<usize> {
        self.inner.state_bytes(id)
    }

    fn export_state(&self, id: StateId) -> sparkd_kernels::Result<SeqState> {
        self.inner.export_state(id)
    }

    /// An imported state's history is unknown to the oracle: its drafts are then wrong (and still lossless).
    fn import_state(&mut self, state: SeqState) -> sparkd_kernels::Result<StateId> {
        let id = self.inner.import_state(state)?;
        if let Some(o) = &mut self.oracle {
            o.insert(id, Vec::new());
        }
        Ok(id)
    }

    fn step(&mut self, rows: &[RowInput]) -> sparkd_kernels::Result<Vec<RowOutput>> {
        self.counts.steps.fetch_add(1, Ordering::SeqCst);
        let outputs = self.inner.step(rows)?;
        self.committed(&Launched::Given(rows.to_vec()), &outputs);
        Ok(outputs)
    }

    fn launches_ahead(&self) -> bool {
        self.inner.launches_ahead()
    }

    fn launch(&mut self, rows: &[RowInput]) -> sparkd_kernels::Result<()> {
        self.inner.launch(rows)?;
        self.counts.steps.fetch_add(1, Ordering::SeqCst);
        self.launched.push_back(Launched::Given(rows.to_vec()));
        Ok(())
    }

    fn launch_fed(&mut self, rows: &[FedRow]) -> sparkd_kernels::Result<()> {
        self.inner.launch_fed(rows)?;
        self.counts.steps.fetch_add(1, Ordering::SeqCst);
        self.counts.fed.fetch_add(1, Ordering::SeqCst);
        self.launched.push_back(Launched::Fed(rows.iter().map(|r| r.state).collect()));
        Ok(())
    }

    fn collect(&mut self) -> sparkd_kernels::Result<Vec<RowOutput>> {
        let outputs = self.inner.collect()?;
        if let Some(launched) = self.launched.pop_front() {
            self.committed(&launched, &outputs);
        }
        Ok(outputs)
    }

    fn set_token_mask(&mut self, mask: TokenMask) -> sparkd_kernels::Result<()> {
        self.inner.set_token_mask(mask)
    }

    fn model_drafter(&mut self) -> Option<Box<dyn Drafter + '_>> {
        let calls = &self.counts.drafts;
        match &self.oracle {
            Some(histories) => Some(Box::new(OracleDrafter { histories, calls })),
            None => Some(Box::new(CountingDrafter { inner: self.inner.model_drafter()?, calls })),
        }
    }
}

struct CountingDrafter<'a> {
    inner: Box<dyn Drafter + 'a>,
    calls: &'a AtomicUsize,
}

impl Drafter for CountingDrafter<'_> {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    fn draft(&mut self, rows: &[DraftRequest]) -> sparkd_kernels::Result<Vec<DraftProposal>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.draft(rows)
    }

    fn select_proposal(&mut self, state: StateId) -> sparkd_kernels::Result<()> {
        self.inner.select_proposal(state)
    }
}

/// Drafts exactly what the null runner's greedy decoding emits next, at [`ORACLE_CONFIDENCE`] per token.
struct OracleDrafter<'a> {
    histories: &'a HashMap<StateId, Vec<TokenId>>,
    calls: &'a AtomicUsize,
}

impl Drafter for OracleDrafter<'_> {
    fn block_size(&self) -> usize {
        8
    }

    fn draft(&mut self, rows: &[DraftRequest]) -> sparkd_kernels::Result<Vec<DraftProposal>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let draft = |r: &DraftRequest| {
            let mut history = self.histories.get(&r.state).cloned().unwrap_or_default();
            history.push(r.anchor);
            let tokens = NullRunner::greedy_continuation(&history, r.num_drafts);
            DraftProposal { tokens, confidences: vec![ORACLE_CONFIDENCE; r.num_drafts] }
        };
        Ok(rows.iter().map(draft).collect())
    }

    /// The null runner verifies every draft one-hot: there is no `q` to select.
    fn select_proposal(&mut self, _state: StateId) -> sparkd_kernels::Result<()> {
        Ok(())
    }
}

#[test]
fn a_drafter_whose_drafts_do_not_pay_is_skipped_and_output_is_unchanged() {
    // The synthetic k3-tiny drafter has random weights; the production budget (the default with dspark) over
    // the SPS(B) and draft cost measured at start-up learns that its drafts do not pay and stops drafting,
    // probing now and then. The drafter contexts stay right across the skipped rounds: every probe drafts.
    let cfg = SpeculationConfig { budget: SpecBudget::Production, ..spec(SpecMethod::Dspark, 7) };
    let requests = [vec![(cpu_prompt(9, 4), 40, None)], vec![(cpu_prompt(11, 5), 100, None)]];
    let off = SpeculationConfig::default();
    let mut reference = Harness::new(cpu_runner(&off), off, 16);
    let (runner, counts) = Counting::wrap(cpu_runner(&cfg));
    let mut h = Harness::new(runner, cfg, 16);
    let warm_up = h.run(&requests[0]).remove(0);
    assert_eq!(warm_up.tokens, reference.run(&requests[0]).remove(0).tokens);
    let (steps_before, drafts_before) = counts.get();
    let measured = h.run(&requests[1]).remove(0);
    let (steps, drafts) = counts.get();
    assert!(measured.failed.is_none(), "{:?}", measured.failed);
    assert_eq!(measured.tokens, reference.run(&requests[1]).remove(0).tokens, "greedy output unchanged");
    let (steps, drafts) = (steps - steps_before, drafts - drafts_before);
    assert!(steps >= 80, "{steps} steps for 100 tokens");
    assert!(drafts >= 1, "a probe drafts after skipped rounds");
    assert!(drafts * 10 <= steps, "the drafter ran at {drafts} of {steps} steps");
    assert!(measured.accepted() * 4 <= measured.drafted().max(4), "{:?}", measured.rounds);
    // Skipped rounds are known to draft nothing ahead of time, so their steps were launched ahead.
    let fed = counts.fed.load(Ordering::SeqCst);
    assert!(fed * 2 >= steps, "{fed} of {steps} steps launched ahead");
}

#[test]
fn oracle_drafts_are_never_gated_even_when_their_head_understates_them() {
    // The oracle's head says 0.3 per token (survival 0.3, 0.09, ...), and a draft costs half a step: at face
    // value drafting does not pay. Calibration learns that every verified draft is accepted.
    let profile = profile().with_draft_cost(vec![DraftPoint { rows: 1, seconds: 0.005 }]).expect("draft table");
    let cfg = SpeculationConfig { sps_profile: Some(profile), ..spec(SpecMethod::Dspark, 7) };
    let cfg = SpeculationConfig { budget: SpecBudget::Production, ..cfg };
    let (runner, counts) = Counting::oracle();
    let mut h = Harness::new(runner, cfg, 64);
    let (first, second) = (prompt(21, 12), prompt(22, 12));
    let warm_up = h.run(&[(first.clone(), 40, None)]).remove(0);
    assert_eq!(warm_up.tokens, NullRunner::greedy_continuation(&first, 40));
    let (steps_before, drafts_before) = counts.get();
    let o = h.run(&[(second.clone(), 120, None)]).remove(0);
    let (steps, drafts) = counts.get();
    assert_eq!(o.tokens, NullRunner::greedy_continuation(&second, 120));
    assert_eq!(o.accepted(), o.drafted(), "every oracle draft is accepted");
    assert!(o.acceptance_length() > 5.0, "AL {} from {:?}", o.acceptance_length(), o.rounds);
    // Every decode step drafted (the prompt's prefill step is the one step without a draft), so none ran ahead.
    assert_eq!(drafts - drafts_before, steps - steps_before - 1, "no step was gated");
    assert_eq!(counts.fed.load(Ordering::SeqCst), 0);
}
