//! No head-of-line stalls and request size limits, black-box on the default CPU k3-tiny.
//!
//! - Two 17 MB prompts, tokenized on the preparation pool, do not delay `/health` past 100 ms (before the pool
//!   they froze it for 13 s: tokenizing ran on the async workers).
//! - Each size limit (`--max-prompt-chars`, `--max-stop-strings`, `--max-stop-chars`, `--max-logprobs`) is a 400
//!   naming the field and the flag, before any work; the next good request succeeds, and sixteen long stop
//!   strings do not hold back the streamed text.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sparkd_tests::{sse_text, Server};

/// The size of each large prompt, in bytes (ASCII: also characters).
const LARGE_PROMPT: usize = 17 << 20;
/// How long `/health` may take while large prompts are prepared.
const HEALTH_BOUND: Duration = Duration::from_millis(100);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_prompts_do_not_delay_health() {
    let s = Server::start(&["--max-prompt-chars", "20000000"]).await.expect("server starts");
    let text = "The daemon keeps serving while it tokenizes. ".repeat(LARGE_PROMPT / 45);
    let body = json!({"prompt": text, "max_tokens": 1});
    let (a, b) = (s.post("/v1/completions", &body), s.post("/v1/completions", &body));
    let large = async { tokio::join!(a, b) };
    tokio::pin!(large);
    let mut polls = 0usize;
    let mut slowest = Duration::ZERO;
    let answers = loop {
        tokio::select! {
            answers = &mut large => break answers,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {
                let asked = Instant::now();
                let (status, _) = s.get("/health").await.expect("/health answers");
                assert_eq!(status, 200);
                slowest = slowest.max(asked.elapsed());
                polls += 1;
            }
        }
    };
    for answer in [answers.0, answers.1] {
        let (status, err) = answer.expect("the large request is answered");
        // Millions of tokens cannot fit the context: refused once tokenized.
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["code"], "context_length_exceeded", "{err}");
    }
    assert!(polls >= 5, "only {polls} health checks ran while the prompts were prepared: the test proves nothing");
    assert!(slowest <= HEALTH_BOUND, "/health took {slowest:?} while large prompts were tokenized ({polls} polls)");
    let (status, done) = s.post("/v1/completions", &json!({"prompt": "after", "max_tokens": 2})).await.unwrap();
    assert_eq!(status, 200, "{done}");
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_limit_is_a_400_naming_its_flag_and_the_next_request_succeeds() {
    let s = Server::start(&["--max-prompt-chars", "1000", "--max-stop-chars", "4096", "--max-logprobs", "5"])
        .await
        .expect("server starts");
    let long_stop = "x".repeat(4 << 20);
    let cases = [
        (chat(json!({"messages": [{"role": "user", "content": "y".repeat(1001)}]})), "messages", "--max-prompt-chars"),
        (json!({"prompt": "z".repeat(1001)}), "prompt", "--max-prompt-chars"),
        (chat(json!({"stop": (0..17).map(|i| format!("s{i}")).collect::<Vec<_>>()})), "stop", "--max-stop-strings"),
        (chat(json!({"stop": ["ok", long_stop]})), "stop[1]", "--max-stop-chars"),
        (chat(json!({"logprobs": true, "top_logprobs": 6})), "top_logprobs", "--max-logprobs"),
    ];
    for (body, param, flag) in cases {
        let path = if body.get("prompt").is_some() { "/v1/completions" } else { "/v1/chat/completions" };
        let (status, err) = s.post(path, &body).await.unwrap();
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"], param, "{err}");
        assert!(err["error"]["message"].as_str().unwrap().contains(flag), "{err}");
        let (status, ok) = s.post("/v1/chat/completions", &chat(json!({}))).await.unwrap();
        assert_eq!(status, 200, "after the {param} error: {ok}");
    }

    // Sixteen stop strings of the longest length that never occur: the text streams as it is made.
    let stops: Vec<String> = (0..16).map(|i| format!("{i}{}", "q".repeat(4000))).collect();
    let plain = json!({"prompt": "Stop strings", "max_tokens": 24, "ignore_eos": true, "temperature": 0});
    let mut streamed = plain.clone();
    streamed["stop"] = json!(stops);
    streamed["stream"] = json!(true);
    let events = s.sse_all("/v1/completions", &streamed).await.expect("streams");
    let text = sse_text(&events);
    let pieces = events.iter().filter(|e| e.data["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(pieces.count() > 1, "the text came in one piece at the end: {text:?}");
    let (status, whole) = s.post("/v1/completions", &plain).await.unwrap();
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["choices"][0]["text"].as_str().unwrap(), text, "the same text with and without the stops");
}
