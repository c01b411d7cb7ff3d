//! Black-box speculative decoding: `sparkd serve --spec ...` on the null runner (suffix drafts) and on the
//! CPU k3-tiny (DSpark with a forced acceptance length). Checks the per-response
//! `metrics.speculative_decoding` object AIPerf reads (body and final stream chunk), the vLLM counters and
//! sparkd gauges at /metrics, the per-request `speculation.num_tokens` override, and flag errors.

use serde_json::{json, Value};
use sparkd_tests::Server;

fn completion(max_tokens: usize, extra: Value) -> Value {
    let mut body = json!({"prompt": [791, 4062, 14198, 39935, 927, 279, 16053, 5679], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suffix_speculation_reports_per_response_stats_and_vllm_counters() {
    let s = Server::start(&["--device", "null", "--spec", "suffix", "--num-spec-tokens", "6"]).await.unwrap();
    let (status, first) = s.post("/v1/completions", &completion(60, json!({}))).await.unwrap();
    assert_eq!(status, 200, "{first}");
    // The same request again: the suffix tree of finished outputs drafts exactly what the target emits.
    let (status, second) = s.post("/v1/completions", &completion(60, json!({}))).await.unwrap();
    assert_eq!(status, 200, "{second}");
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"], "speculation does not change output");
    let spec = &second["metrics"]["speculative_decoding"];
    let drafted = spec["num_draft_tokens"].as_u64().expect("num_draft_tokens");
    let accepted = spec["num_accepted_draft_tokens"].as_u64().unwrap();
    let steps = spec["num_spec_steps"].as_u64().unwrap();
    assert!(drafted > 0 && accepted == drafted, "{spec}");
    assert!((spec["mean_acceptance_length"].as_f64().unwrap() - (1.0 + accepted as f64 / steps as f64)).abs() < 1e-9);
    assert_eq!(spec["draft_acceptance_rate"], 1.0);
    let histogram: u64 = spec["acceptance_histogram"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(histogram, steps);
    assert!(spec.get("synthetic_acceptance").is_none(), "not forced");

    // `speculation.num_tokens: 0` turns speculation off for one request: no spec object.
    let (status, off) =
        s.post("/v1/completions", &completion(60, json!({"speculation": {"num_tokens": 0}}))).await.unwrap();
    assert_eq!(status, 200, "{off}");
    assert!(off.get("metrics").is_none(), "{off}");
    assert_eq!(off["choices"][0]["text"], first["choices"][0]["text"]);
    let (status, bad) =
        s.post("/v1/completions", &completion(5, json!({"speculation": {"num_tokens": -1}}))).await.unwrap();
    assert_eq!(status, 400, "{bad}");
    assert!(bad.to_string().contains("speculation.num_tokens"), "{bad}");

    // Streaming with include_usage: the trailing usage chunk carries the object.
    let events = s
        .sse_all("/v1/completions", &completion(60, json!({"stream": true, "stream_options": {"include_usage": true}})))
        .await
        .unwrap();
    let usage_chunk = events
        .iter()
        .filter(|e| !e.is_done())
        .map(|e| &e.data)
        .find(|c| c["choices"].as_array().is_some_and(|a| a.is_empty()))
        .cloned()
        .expect("a usage chunk");
    assert!(usage_chunk["metrics"]["speculative_decoding"]["num_spec_steps"].as_u64().unwrap() > 0, "{usage_chunk}");

    let m = s.metrics().await.unwrap();
    let drafts = m.value("vllm:spec_decode_num_drafts_total", &[]).unwrap();
    let draft_tokens = m.value("vllm:spec_decode_num_draft_tokens_total", &[]).unwrap();
    let accepted_total = m.value("vllm:spec_decode_num_accepted_tokens_total", &[]).unwrap();
    assert!(drafts >= steps as f64 && draft_tokens >= drafted as f64 && accepted_total >= accepted as f64);
    assert_eq!(m.types.get("vllm:spec_decode_num_accepted_tokens_per_pos_total").map(String::as_str), Some("counter"));
    let per_pos: f64 = (0..6)
        .map(|i| {
            m.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", &[("position", &i.to_string())]).unwrap()
        })
        .sum();
    assert_eq!(per_pos, accepted_total, "Σ per-position = accepted");
    let al = m.value("sparkd:spec_decode_mean_acceptance_length", &[]).unwrap();
    assert!((al - (1.0 + accepted_total / drafts)).abs() < 1e-9, "AL gauge {al}");
    assert_eq!(m.value("sparkd:spec_decode_num_synthetic_drafts_total", &[]), Some(0.0));
    assert_eq!(m.value("sparkd:spec_decode_forced_acceptance_length", &[]), Some(0.0));
    s.terminate().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_acceptance_length_on_the_cpu_model_is_flagged_in_responses_and_metrics() {
    let args = ["--device", "cpu", "--spec", "dspark", "--num-spec-tokens", "7", "--spec-synthetic-al", "6"];
    let s = Server::start(&args).await.unwrap();
    let (status, body) = s.post("/v1/completions", &completion(31, json!({}))).await.unwrap();
    assert_eq!(status, 200, "{body}");
    let spec = &body["metrics"]["speculative_decoding"];
    assert_eq!(spec["synthetic_acceptance"], true, "{spec}");
    // ℓ = 7, AL 6: five drafts accepted in every round (the first token comes from the prefill).
    assert_eq!(spec["mean_acceptance_length"], 6.0, "{spec}");
    assert_eq!(spec["acceptance_histogram"]["5"], spec["num_spec_steps"]);
    let m = s.metrics().await.unwrap();
    assert_eq!(m.value("sparkd:spec_decode_forced_acceptance_length", &[]), Some(6.0));
    let synthetic = m.value("sparkd:spec_decode_num_synthetic_drafts_total", &[]).unwrap();
    assert_eq!(Some(synthetic), m.value("vllm:spec_decode_num_drafts_total", &[]));
    assert!(synthetic >= 5.0);
    s.terminate().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_speculation_flags_are_clear_errors() {
    for (args, flag) in [
        (&["--device", "null", "--spec", "dspark"][..], "--spec:"),
        (&["--device", "null", "--spec", "suffix", "--num-spec-tokens", "0"][..], "--num-spec-tokens:"),
        (&["--device", "null", "--num-spec-tokens", "4"][..], "--num-spec-tokens:"),
        (&["--device", "null", "--spec", "suffix", "--spec-synthetic-al", "3"][..], "--spec-synthetic-al:"),
        (&["--device", "cpu", "--spec", "dspark", "--spec-synthetic-al", "9"][..], "--spec-synthetic-al:"),
    ] {
        let err = Server::start(args).await.err().expect("refused").to_string();
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
