//! The official `openai` Python package as a client against `sparkd serve --device null`: one streaming chat, and
//! tool calls (whole, streamed, a two-turn loop over chat and over Responses).
//! Skips (and says so) when python3 or the package is missing; `scripts/test.sh` installs it.

use std::process::Command;

use sparkd_tests::Server;

fn python_has_openai() -> bool {
    Command::new("python3").args(["-c", "import openai"]).output().map(|o| o.status.success()).unwrap_or(false)
}

/// Runs `tests/python/{script}` against a null server with the `openai` package; its JSON summary, or `None`
/// (saying so) when python3 or the package is missing.
async fn run_client(test: &str, script: &str) -> Option<serde_json::Value> {
    if !python_has_openai() {
        println!("SKIPPED {test}: python3 or its `openai` package is missing (scripts/test.sh installs it)");
        return None;
    }
    let s = Server::start(&["--device", "null", "--served-model-name", "kimi-null"]).await.expect("server starts");
    let script = format!("{}/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let base = s.base.clone();
    let out = tokio::task::spawn_blocking(move || Command::new("python3").args([&script, &base, "kimi-null"]).output())
        .await
        .unwrap()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "openai client failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("a JSON summary"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_streams_a_chat() {
    let Some(summary) = run_client("openai_python_client_streams_a_chat", "openai_stream.py").await else { return };
    assert!(summary["chunks"].as_u64().unwrap() >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_runs_a_tool_loop() {
    let Some(summary) = run_client("openai_python_client_runs_a_tool_loop", "openai_tools.py").await else { return };
    assert_eq!(summary["call"], "get_weather");
    assert_eq!(summary["responses_call"], "get_weather");
}
