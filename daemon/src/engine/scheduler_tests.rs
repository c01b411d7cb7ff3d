//! The scheduler's tests: plans, budgets, order, finishes, drafts, step-time limits and steps planned ahead.

use super::super::step_time::{linear_costs, StepCosts, StepShape, StepTarget};
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
        constraint: None,
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
    let decode = StepShape::default().with_row(1, 3);
    assert!(limit.predicted_seconds(decode.with_row(97, 0)) <= limit.target_seconds(decode));
    assert!(limit.predicted_seconds(decode.with_row(98, 0)) > limit.target_seconds(decode));
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
fn each_prefill_row_beside_decode_rows_pays_the_per_row_cost() {
    // One decode row: T = 1.5 × 4.05 ms. Without a per-row cost four 10-token prompts fit (t(41) = 6.05 ms); at
    // 1 ms a row the first prompt's row leaves t(1 + p) ≤ 5.075 ms (p ≤ 20) and a second row does not fit at all.
    let plan_with = |per_row: f64| {
        let mut s = scheduler(256, 8);
        let costs = StepCosts::new(linear_costs(0.004, 5e-5, 4096).tokens().clone(), per_row);
        s.set_step_time_limit(Some(StepTimeLimit::new(costs, StepTarget::Factor(1.5), 4)));
        start(&mut s, &[request(1, 3, 500)]);
        let plan = s.schedule(Instant::now());
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        start(&mut s, &[request(2, 10, 4), request(3, 10, 4), request(4, 10, 4), request(5, 10, 4)]);
        row_lens(&s.schedule(Instant::now()))
    };
    let all = vec![(1, 1, true), (2, 10, true), (3, 10, true), (4, 10, true), (5, 10, true)];
    assert_eq!(plan_with(0.0), all);
    assert_eq!(plan_with(0.001), vec![(1, 1, true), (2, 10, true)]);
}

#[test]
fn a_prompt_chunk_at_a_long_context_pays_its_context_reads() {
    // 5 ns a context read (D83). Beside request 1's decode row, T = 2.2 × 4.05 ms: a fresh prompt's chunk takes
    // 97 tokens (as without reads); one restored at 20,000 tokens (a cached prefix) reads 0.1 ms of context a
    // token, so 4.05 + 0.05 p + 0.1 p ≤ 8.91 ms: p = 32.
    let chunk_at = |context: usize| {
        let mut s = scheduler(256, 8);
        let costs = linear_costs(0.004, 5e-5, 4096).with_context_read_seconds(5e-9);
        s.set_step_time_limit(Some(StepTimeLimit::new(costs, StepTarget::Factor(2.2), BLOCK)));
        start(&mut s, &[request(1, 3, 500)]);
        let plan = s.schedule(Instant::now());
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
        s.add(&request(2, context + 200, 4), &[]).unwrap();
        for id in s.admit() {
            s.restore(id, context, Vec::new()).unwrap();
        }
        row_lens(&s.schedule(Instant::now()))
    };
    assert_eq!(chunk_at(0), vec![(1, 1, true), (2, 97, false)]);
    assert_eq!(chunk_at(20_000), vec![(1, 1, true), (2, 32, false)]);
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
fn a_short_prompt_is_not_queued_behind_a_long_one() {
    // T = 5.07 ms fits B = 21: 20 prefill tokens beside one decode token.
    let mut s = limited(4096, StepTarget::Seconds(0.00507));
    decoding_beside_a_prompt(&mut s, LONG_PREFILL_TOKENS + 100);
    start(&mut s, &[request(3, 30, 4)]);
    let mut chunks = Vec::new();
    for _ in 0..3 {
        let plan = s.schedule(Instant::now());
        chunks.push(row_lens(&plan)[1..].to_vec());
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
    }
    // The 30-token prompt takes the allowance before the older 612-token one, which then goes on beside it.
    let expected = vec![vec![(3, 20, false)], vec![(2, 10, false), (3, 10, true)], vec![(2, 19, false), (3, 1, true)]];
    assert_eq!(chunks, expected);
    // Without a limit both fit the budget, the older first.
    let mut s = scheduler(4096, 8);
    start(&mut s, &[request(1, LONG_PREFILL_TOKENS + 100, 4), request(2, 30, 4)]);
    assert_eq!(row_lens(&s.schedule(Instant::now())), vec![(1, 612, true), (2, 30, true)]);
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
        // Up to 1 ms a row past the first (a CPU-like cost model) or none, and up to 10 ns a context read.
        let per_row = rng.gen_range(0..3usize) as f64 * 5e-4;
        let per_read = rng.gen_range(0..3usize) as f64 * 5e-9;
        let mut s = scheduler(budget, 8);
        let costs = StepCosts::new(linear_costs(0.004, 5e-5, 4096).tokens().clone(), per_row)
            .with_context_read_seconds(per_read);
        s.set_step_time_limit(Some(StepTimeLimit::new(costs, target, BLOCK)));
        let limit = s.step_time.clone().unwrap();
        // Some prompts continue a 20,000-token cached prefix (restored), so their chunks read a long context.
        let restored: Vec<usize> =
            (0..1 + rng.gen_range(0..12usize)).map(|_| 20_000 * usize::from(rng.gen_bool(0.3))).collect();
        let requests: Vec<GenerateRequest> = restored
            .iter()
            .enumerate()
            .map(|(i, &r)| request(i as u64, r + 1 + rng.gen_range(0..400usize), 1 + rng.gen_range(0..30usize)))
            .collect();
        for r in &requests {
            s.add(r, &[]).unwrap();
        }
        let mut steps = 0;
        while s.has_work() {
            steps += 1;
            assert!(steps < 10_000, "case {case}: the mix does not finish");
            for id in s.admit() {
                s.restore(id, restored[id.0 as usize], Vec::new()).unwrap();
            }
            let slots: Vec<RequestId> = s.decode_slots().iter().map(|d| d.id).collect();
            for id in slots {
                let drafts = (0..rng.gen_range(0..9usize)).map(|t| 500 + t as TokenId).collect();
                s.set_drafts(id, drafts).unwrap();
            }
            let decoding: Vec<RequestId> = s.running.iter().filter(|q| q.output_len() > 0).map(|q| q.id).collect();
            let prefilling = s.running.len() - decoding.len();
            let plan = s.schedule(Instant::now());
            let shape = |decodes: bool| {
                let rows = plan.rows.iter().filter(|r| decoding.contains(&r.id) == decodes);
                rows.fold(StepShape::default(), |shape, r| shape.with_row(r.tokens.len(), r.start))
            };
            let (decode, prefill) = (shape(true), shape(false).tokens);
            assert!(plan.num_tokens() <= budget, "case {case}");
            if decode.rows > 0 && prefill > BLOCK {
                let whole =
                    plan.rows.iter().fold(StepShape::default(), |shape, r| shape.with_row(r.tokens.len(), r.start));
                let (t, target) = (limit.predicted_seconds(whole), limit.target_seconds(decode));
                assert!(t <= target, "case {case}: predicted {t} over the target {target}");
            }
            if prefilling > 0 && decode.tokens < budget && plan.rows.len() < 8 {
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

/// Steps `s` until every running sequence decodes (its prompt is done); returns the last plan, not applied.
fn decoding_plan(s: &mut Scheduler, now: Instant) -> StepPlan {
    loop {
        let plan = s.schedule(now);
        if plan.rows.iter().all(|r| r.sample.is_some() && r.tokens.len() == 1) {
            return plan;
        }
        s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
    }
}

#[test]
fn a_steady_decode_is_planned_ahead_and_resolves_to_the_plan_it_would_have_made() {
    let mut s = scheduler(100, 4);
    start(&mut s, &[request(1, 3, 10), request(2, 4, 10)]);
    let now = Instant::now();
    let plan = decoding_plan(&mut s, now);
    let ahead = s.schedule_ahead(&plan).expect("a steady decode is planned ahead");
    let starts: Vec<(u64, usize)> = ahead.rows.iter().map(|r| (r.id.0, r.start)).collect();
    assert_eq!(starts, plan.rows.iter().map(|r| (r.id.0, r.start + 1)).collect::<Vec<_>>());
    s.apply(&plan, &outputs(&plan, 9, false)).unwrap();
    let resolved = s.resolve_ahead(&ahead).unwrap();
    assert_eq!(resolved, s.schedule(now), "the fed step is the step the scheduler plans once it knows the tokens");
    assert!(resolved.rows.iter().all(|r| r.tokens == [9]));
}

#[test]
fn nothing_is_planned_ahead_of_admission_prefill_drafts_length_or_a_block_boundary() {
    let now = Instant::now();
    // A request waiting for admission.
    let mut s = scheduler(100, 1);
    start(&mut s, &[request(1, 3, 10)]);
    s.add(&request(2, 3, 10), &[]).unwrap();
    let plan = decoding_plan(&mut s, now);
    assert_eq!(s.schedule_ahead(&plan), None);
    // A sequence still in its prompt (the plan mixes a prefill chunk in).
    let mut s = scheduler(100, 4);
    start(&mut s, &[request(1, 3, 10)]);
    let plan = decoding_plan(&mut s, now);
    s.apply(&plan, &outputs(&plan, 7, false)).unwrap();
    start(&mut s, &[request(2, 20, 10)]);
    let mixed = s.schedule(now);
    assert_eq!(s.schedule_ahead(&mixed), None);
    // Attached drafts, and a sequence one token from max_tokens.
    let mut s = scheduler(100, 4);
    start(&mut s, &[request(1, 3, 10)]);
    let plan = decoding_plan(&mut s, now);
    assert!(s.schedule_ahead(&plan).is_some());
    s.set_drafts(RequestId(1), vec![5]).unwrap();
    assert_eq!(s.schedule_ahead(&plan), None);
    let mut s = scheduler(100, 4);
    start(&mut s, &[request(1, 3, 2)]);
    let last = decoding_plan(&mut s, now);
    assert_eq!(s.schedule_ahead(&last), None, "the step in flight emits the last token max_tokens allows");
    assert_eq!(s.schedule_ahead(&StepPlan::default()), None, "nothing in flight, nothing to feed");
    // The step in flight ends on a snapshot block boundary (BLOCK = 8: the prompt fills 0..7, 7 is fed).
    let mut s = scheduler(100, 4);
    start(&mut s, &[request(1, 7, 20)]);
    let at_boundary = decoding_plan(&mut s, now);
    assert_eq!(at_boundary.rows[0].start + 1, BLOCK);
    assert_eq!(s.schedule_ahead(&at_boundary), None);
    s.apply(&at_boundary, &outputs(&at_boundary, 7, false)).unwrap();
    let next = s.schedule(now);
    assert!(s.schedule_ahead(&next).is_some(), "past the boundary the decode is steady again");
}

#[test]
fn a_sequence_that_stops_in_flight_leaves_the_fed_step_and_keeps_a_whole_history_state() {
    let mut s = scheduler(100, 4);
    start(&mut s, &[request(1, 3, 10), request(2, 3, 10)]);
    let now = Instant::now();
    let plan = decoding_plan(&mut s, now);
    let ahead = s.schedule_ahead(&plan).unwrap();
    // Request 1 emits the stop token 2 in the step in flight; request 2 goes on.
    let outs = vec![
        RowOutput { tokens: vec![2], num_accepted: 0, logprobs: Vec::new() },
        RowOutput { tokens: vec![9], num_accepted: 0, logprobs: Vec::new() },
    ];
    let out = s.apply(&plan, &outs).unwrap();
    let mut stopped = out.finished[0].clone();
    assert_eq!((stopped.id, stopped.reason), (RequestId(1), FinishReason::Stop));
    let resolved = s.resolve_ahead(&ahead).unwrap();
    assert_eq!(resolved.rows.iter().map(|r| r.id).collect::<Vec<_>>(), vec![RequestId(2)]);
    // The fed step committed the stop token too: the state then holds the whole history, which a
    // continuation builds on; one token more would not be the history.
    assert!(stopped.state_matches_history());
    stopped.computed += 1;
    assert!(stopped.state_matches_history());
    stopped.computed += 1;
    assert!(!stopped.state_matches_history());
    // Applying something the plan did not foresee is an error, not a wrong row.
    s.apply(&resolved, &outputs(&resolved, 9, false)).unwrap();
    assert!(matches!(s.resolve_ahead(&ahead), Err(ScheduleError::AheadMismatch { .. })));
}
