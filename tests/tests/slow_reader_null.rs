//! A client that stops reading cannot make the daemon hold memory without bound (null device, so the engine
//! outruns any reader): ten streams with 20 log-probability alternatives per token that are never read are each
//! cancelled once `--max-event-backlog` events wait for them (`sparkd:slow_reader_cancels_total`), the
//! daemon's resident memory grows by less than [`RSS_BOUND_MB`] (before the bound, ten such streams took
//! +357 MB and kept growing), a reader that comes back finds a `slow_reader` error at the end of what was
//! buffered (then `[DONE]`), and the next request is served.

use std::time::Duration;

use serde_json::json;
use sparkd_tests::Server;

const STREAMS: usize = 10;
/// How much the daemon's resident memory may grow while the streams are held unread.
const RSS_BOUND_MB: u64 = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_nobody_reads_are_cut_off_and_memory_stays_bounded() {
    let s = Server::start(&["--device", "null", "--max-event-backlog", "1024"]).await.expect("server starts");
    let body = json!({
        "messages": [{"role": "user", "content": "never read"}], "max_tokens": 100_000, "ignore_eos": true,
        "logprobs": true, "top_logprobs": 20, "stream": true,
    });
    let warm = json!({"messages": [{"role": "user", "content": "warm"}], "max_tokens": 64, "logprobs": true, "top_logprobs": 20});
    assert_eq!(s.post("/v1/chat/completions", &warm).await.unwrap().0, 200);
    let before = s.rss_mb().unwrap();

    let mut unread = Vec::new();
    for _ in 0..STREAMS {
        unread.push(s.sse("/v1/chat/completions", &body).await.expect("a stream opens"));
    }
    let cut = |m: &sparkd_tests::PromText| m.value("sparkd:slow_reader_cancels_total", &[]).unwrap_or(0.0);
    let m = s
        .wait_metrics(Duration::from_secs(60), |m| cut(m) >= STREAMS as f64)
        .await
        .expect("every unread stream is cut off");
    assert_eq!(m.value("vllm:num_requests_running", &[]), Some(0.0), "nothing runs for the unread streams");
    let after = s.rss_mb().unwrap();
    assert!(after <= before + RSS_BOUND_MB, "resident memory grew from {before} MB to {after} MB");

    // A reader that comes back gets what was buffered, then the error.
    let mut stream = unread.pop().unwrap();
    let mut last = None;
    while let Some(event) = stream.next().await.expect("the buffered events read") {
        if !event.is_done() {
            last = Some(event);
        }
    }
    let last = last.expect("events were buffered");
    assert_eq!(last.data["error"]["code"], "slow_reader", "{}", last.data);
    assert!(last.data["error"]["message"].as_str().unwrap().contains("--max-event-backlog"), "{}", last.data);

    drop(unread);
    assert_eq!(s.post("/v1/chat/completions", &warm).await.unwrap().0, 200, "the next request is served");
}
