//! The replay engine on tiny fixture traces, under tokio's paused clock: DAG order, joins, think
//! times and their caps, warmup, bounds, errors, and what each transport mode sends.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{req, session, subagent, toy_synth, trace, FakeTransport};
use sparkd_workloads::dag::Session;
use sparkd_workloads::error::ReplayError;
use sparkd_workloads::replay::{replay, ReplayOptions, RunOutcome};
use sparkd_workloads::synth::HistoryMode;

fn options() -> ReplayOptions {
    ReplayOptions {
        concurrency: 1,
        duration: None,
        max_requests: Some(1000),
        time_scale: 1.0,
        system_idle_cap: None,
        tree_idle_cap: None,
        start_ratio: None,
        seed: 7,
        model: "m".into(),
        history: HistoryMode::Resend,
        grace: Duration::from_secs(600),
        progress_every: None,
    }
}

async fn run(t: &FakeTransport, sessions: Vec<Session>, opts: ReplayOptions, token_scale: f64) -> RunOutcome {
    replay(Arc::new(t.clone()), toy_synth(token_scale), Arc::new(sessions), opts).await.expect("replay runs")
}

/// main0 → {sa1 (2 turns), sa2} → main1 → main2 → background sa3.
fn dag_trace(main1_think: f64) -> Session {
    session(&trace(
        "dag",
        64,
        64,
        vec![
            req(0.0, 640, 4, &(1..=10).collect::<Vec<_>>(), 0.0),
            subagent(
                1.0,
                "a1",
                vec![req(0.0, 256, 4, &[100, 101, 102, 103], 0.0), req(5.0, 320, 4, &[100, 101, 102, 103, 104], 3.0)],
            ),
            subagent(1.0, "a2", vec![req(0.0, 256, 4, &[200, 201, 202, 203], 0.0)]),
            req(50.0, 768, 4, &(1..=12).collect::<Vec<_>>(), main1_think),
            req(80.0, 832, 4, &(1..=13).collect::<Vec<_>>(), 10.0),
            subagent(81.0, "a3", vec![req(0.0, 256, 4, &[300, 301, 302, 303], 0.0)]),
        ],
    ))
}

fn starts(t: &FakeTransport) -> Vec<(String, f64)> {
    t.seen().iter().map(|s| (s.stream_id.clone(), t.secs(s.at))).collect()
}

#[tokio::test(start_paused = true)]
async fn subagents_spawn_after_their_turn_and_join_before_the_next() {
    let t = FakeTransport::new(Duration::from_secs(2));
    let mut opts = options();
    opts.max_requests = Some(7);
    let out = run(&t, vec![dag_trace(20.0)], opts, 1.0).await;
    let s = starts(&t);
    let expect = [
        ("dag#0", 0.0),
        ("dag::sa:a1#0", 2.0),
        ("dag::sa:a2#0", 2.0),
        ("dag::sa:a1#0", 7.0), // 2 s service + 3 s think
        ("dag#0", 22.0),       // 20 s think from main0's end (2 s); the join (9 s) is earlier
        ("dag#0", 34.0),
        ("dag::sa:a3#0", 36.0), // background branch after the last turn
    ];
    let mut got = s.clone();
    got.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    let mut want: Vec<(String, f64)> = expect.iter().map(|(a, b)| (a.to_string(), *b)).collect();
    want.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    assert_eq!(got, want);
    assert_eq!(out.records.len(), 7);
    assert!(out.records.iter().all(|r| r.ok()));
    assert_eq!(out.records.iter().filter(|r| r.depth == 1).count(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_join_holds_the_next_turn_past_its_think_time() {
    let t = FakeTransport::new(Duration::from_secs(2));
    let mut opts = options();
    opts.max_requests = Some(5);
    run(&t, vec![dag_trace(1.0)], opts, 1.0).await;
    let main: Vec<f64> = starts(&t).into_iter().filter(|(id, _)| id == "dag#0").map(|(_, at)| at).collect();
    // main1 would be due at 3 s, but sa1 ends at 9 s.
    assert_eq!(main, vec![0.0, 9.0]);
}

#[tokio::test(start_paused = true)]
async fn the_background_branch_holds_the_lane_before_recycling() {
    let t = FakeTransport::new(Duration::from_secs(2));
    let mut opts = options();
    opts.max_requests = Some(8);
    let out = run(&t, vec![dag_trace(20.0)], opts, 1.0).await;
    let s = starts(&t);
    // The second play (marker and stream ids `#1`) starts when sa3 ends at 38 s.
    assert_eq!(s.last(), Some(&("dag#1".to_string(), 38.0)));
    assert_eq!(out.plays, 2);
}

fn two_turns(think: f64) -> Session {
    session(&trace(
        "gap",
        64,
        0,
        vec![req(0.0, 256, 2, &[1, 2, 3, 4], 0.0), req(9999.0, 320, 2, &[1, 2, 3, 4, 5], think)],
    ))
}

#[tokio::test(start_paused = true)]
async fn think_times_scale_and_obey_the_idle_caps() {
    let cases: [(f64, Option<u64>, Option<u64>, f64); 4] = [
        (1.0, None, None, 1002.0),     // recorded 1000 s
        (0.01, None, None, 12.0),      // time scale
        (1.0, Some(10), None, 12.0),   // whole-system idle cap
        (1.0, Some(10), Some(5), 7.0), // per-tree cap below the system cap
    ];
    for (scale, system, tree, want) in cases {
        let t = FakeTransport::new(Duration::from_secs(2));
        let mut opts = options();
        opts.max_requests = Some(2);
        opts.time_scale = scale;
        opts.system_idle_cap = system.map(Duration::from_secs);
        opts.tree_idle_cap = tree.map(Duration::from_secs);
        run(&t, vec![two_turns(1000.0)], opts, 1.0).await;
        let s = starts(&t);
        assert_eq!(s.len(), 2);
        assert!((s[1].1 - want).abs() < 1e-6, "scale {scale} system {system:?} tree {tree:?}: {}", s[1].1);
    }
}

#[tokio::test(start_paused = true)]
async fn the_system_idle_cap_does_not_shorten_gaps_while_requests_are_in_flight() {
    // Lane 0 plays `gap` (30 s think); lane 1 plays `busy` back to back, so the system is never
    // idle and the 30 s are kept.
    let busy: Vec<serde_json::Value> =
        (0..40).map(|i| req(i as f64, 64 + 64 * i, 1, &(1..=(1 + i as u64)).collect::<Vec<_>>(), 0.0)).collect();
    let sessions = vec![two_turns(30.0), session(&trace("busy", 0, 0, busy))];
    let t = FakeTransport::new(Duration::from_secs(2));
    let mut opts = options();
    opts.concurrency = 2;
    opts.max_requests = None;
    opts.duration = Some(Duration::from_secs(40));
    opts.system_idle_cap = Some(Duration::from_secs(10));
    run(&t, sessions, opts, 1.0).await;
    let gap: Vec<f64> = starts(&t).into_iter().filter(|(id, _)| id == "gap#0").map(|(_, at)| at).collect();
    assert_eq!(gap, vec![0.0, 32.0]);
}

#[tokio::test(start_paused = true)]
async fn warmup_primes_the_turn_before_t_star_and_is_not_recorded() {
    let turns: Vec<serde_json::Value> =
        (0..5).map(|i| req(10.0 * i as f64, 256 + 64 * i, 8, &(1..=(4 + i as u64)).collect::<Vec<_>>(), 5.0)).collect();
    let s = session(&trace("warm", 64, 0, turns));
    let t = FakeTransport::new(Duration::from_secs(1));
    let mut opts = options();
    opts.start_ratio = Some((0.5, 0.5)); // t* = 20 s → turn 2
    opts.max_requests = Some(3);
    let out = run(&t, vec![s], opts, 1.0).await;
    let seen = t.seen();
    assert_eq!(seen[0].max_tokens, 1, "the primer asks for one token");
    assert_eq!(seen[0].words, 256 + 64, "the primer carries turn 1's whole prompt");
    assert_eq!(out.warmup_requests, 1);
    assert_eq!(out.records.iter().map(|r| r.turn).collect::<Vec<_>>(), vec![2, 3, 4]);
    // Profiling starts right after the primer, with no think time before the first turn.
    assert_eq!(t.secs(seen[1].at), 1.0);
}

#[tokio::test(start_paused = true)]
async fn request_budget_and_duration_bound_the_run() {
    let turns: Vec<serde_json::Value> =
        (0..50).map(|i| req(i as f64, 64 + 64 * i, 2, &(1..=(1 + i as u64)).collect::<Vec<_>>(), 1.0)).collect();
    let s = session(&trace("long", 0, 0, turns));

    let t = FakeTransport::new(Duration::from_secs(1));
    let mut opts = options();
    opts.concurrency = 3;
    opts.max_requests = Some(10);
    let out = run(&t, vec![s.clone()], opts, 1.0).await;
    assert_eq!((t.seen().len(), out.records.len()), (10, 10));

    let t = FakeTransport::new(Duration::from_secs(1));
    let mut opts = options();
    opts.concurrency = 2;
    opts.max_requests = None;
    opts.duration = Some(Duration::from_secs(11));
    let out = run(&t, vec![s], opts, 1.0).await;
    // Each lane: a request every 2 s (1 s service + 1 s think) → starts at 0, 2, ..., 10; the one
    // started at 10 s ends after the stop and still counts.
    assert_eq!(out.records.len(), 12);
    assert!(out.records.iter().all(|r| r.start_s <= 10.0));
    assert_eq!(out.records.iter().map(|r| r.end_s).fold(0.0, f64::max), 11.0);
    assert!(out.records.iter().all(|r| r.ok()), "requests in flight at the stop finish and count");
}

#[tokio::test(start_paused = true)]
async fn errors_advance_the_session_but_a_context_overflow_ends_it() {
    let turns: Vec<serde_json::Value> =
        (0..4).map(|i| req(i as f64, 64 + 64 * i, 2, &(1..=(1 + i as u64)).collect::<Vec<_>>(), 0.0)).collect();
    let s = session(&trace("err", 0, 0, turns));

    let mut t = FakeTransport::new(Duration::from_secs(1));
    t.fail = Arc::new(|i, _| (i == 1).then(|| ReplayError::Server { status: 500, body: "boom".into() }));
    let mut opts = options();
    opts.max_requests = Some(4);
    let out = run(&t, vec![s.clone()], opts.clone(), 1.0).await;
    assert_eq!(
        out.records.iter().map(|r| (r.turn, r.ok())).collect::<Vec<_>>(),
        vec![(0, true), (1, false), (2, true), (3, true)]
    );
    assert_eq!(out.records[1].error.as_deref(), Some("server"));

    let mut t = FakeTransport::new(Duration::from_secs(1));
    t.fail = Arc::new(|i, _| {
        (i == 1).then(|| ReplayError::Server { status: 400, body: "This model's maximum context length is 8".into() })
    });
    let out = run(&t, vec![s], opts, 1.0).await;
    // Turn 1 overflows: the play ends and the lane recycles the trace from turn 0.
    assert_eq!(out.records.iter().map(|r| r.turn).collect::<Vec<_>>(), vec![0, 1, 0, 1]);
    assert_eq!(out.records[1].error.as_deref(), Some("context_overflow"));
    assert_eq!(out.plays, 2);
}

#[tokio::test(start_paused = true)]
async fn chat_resends_history_and_ws_sends_only_the_delta_on_the_previous_response() {
    let s = dag_trace(1.0);
    // Chat: turn 1 = system + user + assistant (recorded output) + user, exactly `in` tokens.
    let t = FakeTransport::new(Duration::from_secs(1));
    let mut opts = options();
    opts.max_requests = Some(5);
    run(&t, vec![s.clone()], opts.clone(), 1.0).await;
    let main: Vec<_> = t.seen().into_iter().filter(|x| x.stream_id == "dag#0").collect();
    assert_eq!((main[0].messages, main[0].words), (2, 640));
    assert_eq!((main[1].messages, main[1].words, main[1].previous.clone()), (4, 768, None));

    // ws: the server kept turn 0 (640 in + 4 generated), so turn 1 sends 768 − 644 new tokens.
    let t = FakeTransport::new(Duration::from_secs(1));
    opts.history = HistoryMode::ServerKept;
    run(&t, vec![s], opts, 1.0).await;
    let main: Vec<_> = t.seen().into_iter().filter(|x| x.stream_id == "dag#0").collect();
    assert_eq!((main[0].messages, main[0].words, main[0].previous.clone()), (2, 640, None));
    assert_eq!(main[1].messages, 1);
    assert_eq!(main[1].words, 768 - 644);
    assert_eq!(main[1].previous.as_deref(), Some("resp_0"));
}

#[tokio::test(start_paused = true)]
async fn token_scale_shrinks_prompts_and_outputs() {
    let t = FakeTransport::new(Duration::from_secs(1));
    let mut opts = options();
    opts.max_requests = Some(1);
    run(&t, vec![dag_trace(1.0)], opts, 0.1).await;
    let first = &t.seen()[0];
    assert_eq!((first.words, first.max_tokens), (64, 1)); // 640 → 64 tokens, 4 → max(0.4 → 0, 1)
}
