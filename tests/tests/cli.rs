//! Black-box tests of the `sparkd` command line: clear errors and non-zero exits for bad arguments (never a
//! panic), `synth` and `tokenizer --export` write what they say, `--model DIR` serves a written checkpoint, and
//! SIGTERM shuts the server down cleanly.

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
        (&["synth", "--config", "k9", "--out", "/tmp/x"], "unknown config `k9`"),
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
