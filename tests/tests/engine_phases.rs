//! The engine's phase times at /metrics: after a request completes, the phases every step goes through
//! (schedule, step, apply, emit) have samples, and the draft phase has samples exactly when speculation is on.

use serde_json::json;
use sparkd_tests::{PromText, Server};

fn phase_count(m: &PromText, phase: &str) -> f64 {
    m.value("sparkd:engine_phase_seconds_count", &[("phase", phase)]).unwrap_or_else(|| panic!("no {phase} series"))
}

async fn phases_after_one_request(args: &[&str]) -> PromText {
    let s = Server::start(args).await.unwrap();
    let body = json!({"prompt": [791, 4062, 14198, 39935, 927, 279, 16053, 5679], "max_tokens": 24,
        "temperature": 0, "ignore_eos": true});
    let (status, answer) = s.post("/v1/completions", &body).await.unwrap();
    assert_eq!(status, 200, "{answer}");
    let m = s.metrics().await.unwrap();
    s.terminate().unwrap();
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_phase_is_timed_and_drafting_only_with_speculation_on() {
    for (args, speculating) in [
        (&["--device", "null"][..], false),
        (&["--device", "null", "--spec", "suffix", "--num-spec-tokens", "4"][..], true),
    ] {
        let m = phases_after_one_request(args).await;
        let steps = phase_count(&m, "step");
        // 24 tokens: one step per token without drafts, fewer with drafts accepted, never none.
        assert!(steps >= if speculating { 1.0 } else { 24.0 }, "{args:?}: {steps} steps");
        for phase in ["idle", "commands", "admit", "schedule", "apply", "emit", "memory"] {
            assert!(phase_count(&m, phase) >= 1.0, "{args:?}: no {phase} samples");
        }
        assert!(phase_count(&m, "apply") >= steps, "{args:?}: every step is applied");
        assert_eq!(phase_count(&m, "draft") > 0.0, speculating, "{args:?}: draft samples only when speculating");
        let step_seconds = m.value("sparkd:engine_phase_seconds_sum", &[("phase", "step")]).unwrap();
        assert!(step_seconds > 0.0 && step_seconds.is_finite(), "{args:?}: {step_seconds}");
        assert_eq!(m.value("sparkd:request_admit_seconds_count", &[("how", "fresh")]), Some(1.0), "{args:?}");
    }
}
