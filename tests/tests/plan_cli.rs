//! Black-box tests of `sparkd plan`: the documented K3 deployments fit and print every part of the plan, a plan
//! that does not fit exits non-zero naming what does not fit, a `config.json` (or its folder) plans as its preset
//! does, and bad input is a clear error naming the flag.

use std::process::Command;

use serde_json::Value;
use sparkd_tests::sparkd_bin;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(sparkd_bin().unwrap()).arg("plan").args(args).output().expect("sparkd runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_plan(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let (code, stdout, stderr) = run(&all);
    assert_eq!(code, 0, "{args:?}: {stderr}");
    serde_json::from_str(&stdout).expect("--json prints JSON")
}

#[test]
fn the_documented_k3_deployments_fit_and_print_every_part() {
    let gb300 = ["--config", "k3", "--gpus", "16", "--gpu-memory", "288GB", "--expert-parallel"];
    let (code, stdout, stderr) = run(&[&gb300[..], &["--max-num-seqs", "32", "--context", "131072"]].concat());
    assert_eq!(code, 0, "{stderr}");
    for part in [
        "embedding (vocab-parallel)",
        "lm_head (vocab-parallel)",
        "attention (KDA + MLA, by heads)",
        "shared experts",
        "routed experts (MXFP4 codes)",
        "routed expert scales (E8M0)",
        "norms + AttnRes (replicated)",
        "KDA states (fp32 [6, 128, 128] x 69 layers)",
        "MLA latent cache per token (576 bf16 x 24 layers, replicated)",
        "step workspace",
        "CUDA graphs",
        "(fits)",
        "largest batch at --context 131072",
        "largest context at --max-num-seqs 32",
        "--state-budget-bytes",
    ] {
        assert!(stdout.contains(part), "missing {part:?}:\n{stdout}");
    }
    let h200 = ["--config", "k3", "--gpus", "16", "--gpu-memory", "139GiB", "--expert-parallel", "--context", "32768"];
    let (code, stdout, stderr) = run(&[&h200[..], &["--max-num-seqs", "32"]].concat());
    assert_eq!(code, 0, "{stdout}{stderr}");

    let plan = json_plan(&[&gb300[..], &["--max-num-seqs", "32"]].concat());
    assert_eq!(plan["weights"]["params"], 2_779_484_478_208u64);
    assert_eq!((plan["replicas"].as_u64(), plan["weights"]["experts_per_rank"].as_u64()), (Some(1), Some(56)));
    assert_eq!(plan["seq"]["mla_per_token"], 27 * 1024);
}

#[test]
fn a_plan_that_does_not_fit_exits_non_zero_naming_what() {
    // Eight H200s cannot hold K3's experts.
    let (code, stdout, stderr) = run(&["--config", "k3", "--gpus", "8", "--gpu-memory", "141GB", "--expert-parallel"]);
    assert_ne!(code, 0);
    assert!(stdout.contains("does NOT fit"), "{stdout}");
    assert!(stderr.contains("the weights alone need"), "{stderr}");
    // Sixteen hold the weights, but not 64 sequences of 128k tokens each.
    let (code, _, stderr) = run(&["--config", "k3", "--gpus", "16", "--gpu-memory", "139GiB", "--max-num-seqs", "64"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("64 sequences of 131072 tokens") && stderr.contains("the largest batch"), "{stderr}");
}

#[test]
fn a_config_json_or_its_folder_plans_as_its_preset() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = sparkd_kernels::ModelConfig::preset("k3-mini").unwrap();
    std::fs::write(dir.path().join("config.json"), cfg.to_json().to_string()).unwrap();
    let common = ["--gpus", "2", "--gpu-memory", "141GB", "--context", "32768"];
    let preset = json_plan(&[&["--config", "k3-mini"][..], &common].concat());
    let file = dir.path().join("config.json");
    for config in [file.to_str().unwrap(), dir.path().to_str().unwrap()] {
        let plan = json_plan(&[&["--config", config][..], &common].concat());
        assert_eq!(plan["weights"], preset["weights"], "{config}");
    }
    assert_eq!(preset["replicas"], 1);
    let two_replicas = json_plan(&[&["--config", "k3-mini", "--tensor-parallel-size", "1"][..], &common].concat());
    assert_eq!(two_replicas["replicas"], 2);
}

#[test]
fn bad_input_is_a_clear_error_naming_the_flag() {
    let base = ["--config", "k3", "--gpus", "16", "--gpu-memory", "139GiB"];
    let cases: &[(&[&str], &str)] = &[
        (&["--config", "k3", "--gpus", "16", "--gpu-memory", "lots"], "--gpu-memory: `lots` is not a byte size"),
        (&["--config", "k3", "--gpus", "16", "--gpu-memory", "0GB"], "--gpu-memory"),
        (&["--config", "k9", "--gpus", "16", "--gpu-memory", "139GiB"], "--config: `k9`"),
        (&[&base[..], &["--tensor-parallel-size", "3"]].concat(), "--tensor-parallel-size"),
        (&["--config", "k3", "--gpus", "5", "--gpu-memory", "1TB"], "does not split over 5 ranks"),
        (&[&base[..], &["--context", "0"]].concat(), "--context"),
        (&[&base[..], &["--num-spec-tokens", "100"]].concat(), "--num-spec-tokens"),
        (&["--config", "k3", "--gpus", "0", "--gpu-memory", "139GiB"], "--gpus"),
        (&["--config", "k3", "--gpu-memory", "139GiB"], "--gpus"),
    ];
    for (args, needle) in cases {
        let (code, _, stderr) = run(args);
        assert_ne!(code, 0, "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
