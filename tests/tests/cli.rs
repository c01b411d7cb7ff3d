//! Black-box tests of the `sparkd` command line: clear errors and non-zero exits for bad arguments (never a
//! panic), `synth` and `tokenizer --export` write what they say, `--model DIR` serves and benchmarks a written
//! checkpoint, and SIGTERM shuts the server down cleanly.

use std::process::Command;

use serde_json::json;
use sparkd_tests::{sparkd_bin, Server};

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(sparkd_bin().unwrap()).args(args).output().expect("sparkd runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_arguments_exit_non_zero_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["serve", "--port", "notaport"], "--port"),
        (&["serve", "--device", "tpu"], "--device"),
        (&["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
        (&["serve", "--model", "/no/such/dir"], "--model"),
        (&["serve", "--host", "example dot com"], "--host"),
        // A petabyte of host copies fits no machine: refused at start-up, naming the flag and the memory found.
        (
            &["serve", "--device", "null", "--port", "0", "--host-offload-bytes", "1125899906842624"],
            "--host-offload-bytes",
        ),
        (&["synth", "--config", "k9", "--out", "/tmp/x"], "unknown config `k9`"),
        (&["bench", "--model", "/no/such/dir"], "/no/such/dir"),
        (&["bench", "--model", "/no/such/dir", "--config", "k3-mini"], "--config"),
        (&["frobnicate"], "frobnicate"),
    ];
    for (args, needle) in cases {
        let (code, _, stderr) = run(args);
        assert_ne!(code, 0, "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    }
    let (code, stdout, _) = run(&["--help"]);
    assert_eq!(code, 0);
    assert!(stdout.contains("serve"));
}

#[test]
fn tokenizer_export_writes_a_hugging_face_folder() {
    let dir = std::env::temp_dir().join(format!("sparkd-tok-{}", std::process::id()));
    let (code, stdout, stderr) = run(&["tokenizer", "--export", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("163840"), "{stdout}");
    let tj: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    assert!(tj["model"]["vocab"].as_object().is_some_and(|v| v.len() > 100_000));
    assert!(dir.join("tokenizer_config.json").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synth_writes_a_checkpoint_that_serve_loads_and_sigterm_stops_it() {
    let dir = std::env::temp_dir().join(format!("sparkd-synth-{}", std::process::id()));
    let (code, stdout, stderr) = run(&["synth", "--config", "k3-tiny", "--seed", "3", "--out", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("k3-tiny") && stdout.contains("tensors"), "{stdout}");
    assert!(dir.join("config.json").is_file());

    let s =
        Server::start(&["--model", dir.to_str().unwrap(), "--served-model-name", "synth3"]).await.expect("serves it");
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": true}),
        )
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "synth3");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    let status = s.terminate().unwrap();
    assert!(status.success(), "graceful shutdown exits 0: {status}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_runs_on_a_written_checkpoint() {
    let dir = std::env::temp_dir().join(format!("sparkd-bench-ckpt-{}", std::process::id()));
    let report = dir.join("report.json");
    let (code, _, stderr) = run(&["synth", "--config", "k3-tiny", "--seed", "5", "--out", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    let args = ["bench", "--model", dir.to_str().unwrap(), "--batch", "1,2", "--steps", "2", "--prompt-len", "4"];
    let (code, _, stderr) = run(&[&args[..], &["--out", report.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains(dir.to_str().unwrap()), "the table names the checkpoint: {stderr}");
    let results: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let results = results.as_array().expect("one result per batch");
    let batches: Vec<u64> = results.iter().map(|r| r["config"]["batch"].as_u64().unwrap()).collect();
    assert_eq!(batches, [1, 2]);
    for r in results {
        assert!(r["generated_tokens"].as_u64().unwrap() >= 2 * r["config"]["batch"].as_u64().unwrap(), "{r}");
        assert!(r["step_ms"].as_f64().unwrap() > 0.0, "{r}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
