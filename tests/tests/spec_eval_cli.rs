//! Black-box test of `sparkd spec-eval` on the random k3-tiny (CPU): two short prompts it writes itself run through
//! every drafting method, the output is lossless, DSpark's per-position counts are consistent, the report and the
//! reliability diagram are written; bad input is a clear error naming the flag, never a panic.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use sparkd_tests::sparkd_bin;

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(sparkd_bin().unwrap()).arg("spec-eval").args(args).output().expect("sparkd runs");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Two Python files and a list naming them, with a missing file between them.
fn write_prompts(dir: &Path) -> String {
    std::fs::write(dir.join("a.py"), "import os\n\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n")
        .unwrap();
    std::fs::write(dir.join("b.py"), "class Point:\n    def __init__(self, x, y):\n        self.x = x\n").unwrap();
    let list = dir.join("list.txt");
    std::fs::write(&list, "a.py\nmissing.py\nb.py\n").unwrap();
    list.display().to_string()
}

#[test]
fn spec_eval_on_the_random_k3_tiny_is_lossless_and_counts_positions_consistently() {
    let dir = tempfile::tempdir().unwrap();
    let list = write_prompts(dir.path());
    let (out, svg) = (dir.path().join("report.json"), dir.path().join("reliability.svg"));
    let (code, stderr) = run(&[
        "--device",
        "cpu",
        "--synthetic",
        "k3-tiny",
        "--files",
        &list,
        "--prompts",
        "2",
        "--prompt-tokens",
        "16",
        "--max-tokens",
        "6",
        "--num-spec-tokens",
        "3",
        "--out",
        out.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stderr.contains("DSpark per draft position") && stderr.contains("lossless"), "{stderr}");
    let report: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(report["lossless"], true, "{report:#}");
    assert_eq!(report["prompts"].as_array().unwrap().len(), 2);
    assert_eq!(report["skipped"].as_array().unwrap().len(), 1, "missing.py is skipped");
    assert_eq!(report["settings"]["num_spec_tokens"], 3);
    let methods: Vec<&str> =
        report["methods"].as_array().unwrap().iter().map(|m| m["method"].as_str().unwrap()).collect();
    assert_eq!(methods, ["off", "dspark", "suffix", "ngram", "hybrid"]);
    for m in report["methods"].as_array().unwrap() {
        assert_eq!(m["lossless"], true, "{m:#}");
        assert_eq!(m["output_tokens"], 12, "{m:#}");
    }
    let dspark = &report["dspark"];
    assert!(dspark["rounds"].as_u64().unwrap() > 0, "DSpark verified drafts: {dspark:#}");
    let count = |p: &Value, key: &str| p[key].as_u64().unwrap();
    let positions = dspark["positions"].as_array().unwrap();
    assert_eq!(positions.len(), 3);
    assert_eq!(count(&positions[0], "reached"), dspark["rounds"].as_u64().unwrap(), "every round reaches position 1");
    for p in positions {
        assert!(count(p, "accepted") <= count(p, "reached"), "{p:#}");
    }
    for w in positions.windows(2) {
        assert!(count(&w[1], "reached") <= count(&w[0], "accepted"), "{positions:#?}");
    }
    let bins = dspark["bins"].as_array().unwrap();
    assert_eq!(bins.iter().map(|b| count(b, "count")).sum::<u64>(), dspark["samples"].as_u64().unwrap());
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>"));
    let non_empty = bins.iter().filter(|b| count(b, "count") > 0).count();
    assert_eq!(svg.matches(r#"class="bin""#).count(), non_empty);
}

#[test]
fn bad_input_is_an_error_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("list.txt");
    std::fs::write(&list, "missing.py\n").unwrap();
    let list = list.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--files", list, "--prompts", "0", "--out", "r.json"], "--prompts"),
        (&["--files", list, "--prompts", "1", "--out", "r.json", "--num-spec-tokens", "0"], "--num-spec-tokens"),
        (&["--files", list, "--prompts", "1", "--out", "r.json", "--device", "null"], "--device"),
        (&["--files", list, "--prompts", "1", "--out", "r.json"], "--files"),
        (&["--files", "/no/such/list.txt", "--prompts", "1", "--out", "r.json"], "/no/such/list.txt"),
        (&["--prompts", "1", "--out", "r.json"], "--files"),
    ];
    for (args, needle) in cases {
        let (code, stderr) = run(args);
        assert_ne!(code, 0, "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    }
}
