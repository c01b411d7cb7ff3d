//! Trace readers: strict parsing of fixtures, the DAG model, and the whole shared workloads folder
//! against its MANIFEST.csv (skipped, saying so, when the folder is absent).

mod common;

use std::path::{Path, PathBuf};

use common::{req, session, subagent, trace};
use sparkd_workloads::dag::{sessions, SetupSource};
use sparkd_workloads::trace::{parse_mooncake, parse_weka, read_all, read_file, trace_paths, TraceFile};

fn parse_err(v: serde_json::Value) -> String {
    let bytes = serde_json::to_vec(&v).expect("json");
    parse_weka(Path::new("bad.json"), &bytes).expect_err("must be rejected").to_string()
}

#[test]
fn strict_parsing_names_the_file_and_the_field() {
    let good = trace("t", 0, 0, vec![req(0.0, 64, 1, &[1], 0.0)]);

    let mut unknown = good.clone();
    unknown["extra"] = 1.into();
    let e = parse_err(unknown);
    assert!(e.contains("bad.json") && e.contains("extra"), "{e}");

    let mut missing = good.clone();
    missing["requests"][0].as_object_mut().expect("object").remove("in");
    let e = parse_err(missing);
    assert!(e.contains("bad.json") && e.contains("`in`"), "{e}");

    let mut ttft_on_n = good.clone();
    ttft_on_n["requests"][0]["ttft"] = 0.5.into();
    assert!(parse_err(ttft_on_n).contains("ttft"));

    let mut ttft_on_s = good.clone();
    ttft_on_s["requests"][0]["type"] = "s".into();
    ttft_on_s["requests"][0]["ttft"] = 0.5.into();
    parse_weka(Path::new("ok.json"), &serde_json::to_vec(&ttft_on_s).expect("json")).expect("ttft is allowed on s");

    let mut scope = good.clone();
    scope["hash_id_scope"] = "global".into();
    assert!(parse_err(scope).contains("hash_id_scope"));

    let mut block = good.clone();
    block["block_size"] = 0.into();
    assert!(parse_err(block).contains("block_size"));

    let nested =
        trace("t", 0, 0, vec![req(0.0, 64, 1, &[1], 0.0), subagent(1.0, "a", vec![subagent(1.0, "b", vec![])])]);
    assert!(parse_err(nested).contains("bad.json"));

    let mut negative = good;
    negative["requests"][0]["think_time"] = (-1.0).into();
    assert!(parse_err(negative).contains("requests[0].think_time"));

    let e = parse_mooncake(Path::new("m.jsonl"), b"{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1}\n")
        .expect_err("hash_ids missing")
        .to_string();
    assert!(e.contains("m.jsonl") && e.contains("line 1") && e.contains("hash_ids"), "{e}");
}

#[test]
fn subagents_become_branches_anchored_on_their_neighbours() {
    let s = session(&trace(
        "t",
        0,
        0,
        vec![
            subagent(0.0, "early", vec![req(0.0, 64, 1, &[9], 0.0)]),
            req(0.0, 128, 1, &[1, 2], 0.0),
            subagent(2.0, "a", vec![req(0.0, 64, 1, &[5], 0.0)]),
            subagent(2.0, "b", vec![req(0.0, 64, 1, &[6], 0.0)]),
            req(10.0, 192, 1, &[1, 2, 3], 4.0),
            subagent(12.0, "c", vec![req(0.0, 64, 1, &[7], 0.0)]),
            req(20.0, 256, 1, &[1, 2, 3, 4], 4.0),
            subagent(21.0, "bg", vec![req(0.0, 64, 1, &[8], 0.0)]),
        ],
    ));
    assert_eq!(s.dropped_subagents, 1, "a subagent before the first turn is dropped");
    let shape: Vec<(usize, Option<usize>, Vec<&str>)> = s
        .branches
        .iter()
        .map(|b| (b.after_turn, b.join_before, b.children.iter().map(|c| c.agent_id.as_str()).collect()))
        .collect();
    assert_eq!(
        shape,
        vec![(0, Some(1), vec!["a", "b"]), (1, Some(2), vec!["c"]), (2, None, vec!["bg"])],
        "adjacent subagents collapse; one after the last turn is background"
    );
    assert_eq!(s.main.turns.iter().map(|t| t.delay_s).collect::<Vec<_>>(), vec![0.0, 4.0, 4.0]);
    // async_launched: the entry time is the launch; parent turn 1 ended at t=10+1 (api_time).
    assert_eq!(s.branches[1].children[0].spawn_delay_s, 1.0);
    assert_eq!(s.branches[0].children[0].chain.id, "t::sa:a");
    assert_eq!(s.request_count(), 3 + 4);
}

#[test]
fn setup_prefix_is_declared_or_derived_from_the_longest_common_prefix() {
    let turns = || {
        vec![
            req(0.0, 640, 1, &(1..=10).collect::<Vec<_>>(), 0.0),
            req(5.0, 700, 1, &[1, 2, 3, 4, 77, 78, 79, 80, 81, 82, 83], 1.0),
        ]
    };
    let declared = session(&trace("d", 128, 64, turns()));
    assert_eq!((declared.main.setup_blocks, declared.main.setup_source), (3, SetupSource::Declared));
    let lcp = session(&trace("l", 0, 0, turns()));
    assert_eq!((lcp.main.setup_blocks, lcp.main.setup_source), (4, SetupSource::Lcp));
    // A single turn has no common prefix to derive from.
    let single = session(&trace("s", 0, 0, vec![req(0.0, 640, 1, &(1..=10).collect::<Vec<_>>(), 0.0)]));
    assert_eq!(single.main.setup_blocks, 0);
    // The prefix never swallows the whole first prompt.
    let tiny = session(&trace("x", 6400, 0, vec![req(0.0, 128, 1, &[1, 2], 0.0)]));
    assert_eq!(tiny.main.setup_blocks, 1);
}

#[test]
fn a_folder_reads_in_name_order_and_rejects_unknown_extensions() {
    let dir = tempfile::tempdir().expect("tempdir");
    for name in ["b.json", "a.json"] {
        let id = name.trim_end_matches(".json");
        let body = trace(id, 0, 0, vec![req(0.0, 64, 1, &[1], 0.0)]);
        std::fs::write(dir.path().join(name), serde_json::to_vec(&body).expect("json")).expect("write");
    }
    std::fs::write(
        dir.path().join("m.jsonl"),
        "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n",
    )
    .expect("write");
    std::fs::write(dir.path().join("notes.txt"), "ignored").expect("write");
    let files = read_all(&[dir.path().to_path_buf()]).expect("folder reads");
    let s = sessions(&files);
    assert_eq!(s.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), vec!["a", "b", "m#0"]);
    assert_eq!(s[2].block_size, 512);
    assert!(read_file(&dir.path().join("notes.txt")).is_err());
    assert!(trace_paths(&dir.path().join("absent")).is_err());
}

fn workloads_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("SPARKD_WORKLOADS") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/workloads"),
    };
    if dir.is_dir() {
        Some(dir)
    } else {
        println!("SKIPPED: workloads folder {} is absent (set SPARKD_WORKLOADS)", dir.display());
        None
    }
}

#[test]
fn every_shared_trace_parses_and_matches_the_manifest() {
    let Some(dir) = workloads_dir() else { return };
    let weka = dir.join("weka-kv-cache-tester");
    let manifest = std::fs::read_to_string(weka.join("MANIFEST.csv")).expect("MANIFEST.csv");
    let mut lines = manifest.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).expect("manifest column");
    let (file_col, req_col, sub_col) = (col("file"), col("requests"), col("subagents"));
    let mut checked = 0;
    for line in lines.filter(|l| !l.is_empty()) {
        let cells: Vec<&str> = line.split(',').collect();
        let path = weka.join(cells[file_col]);
        let file = read_file(&path).unwrap_or_else(|e| panic!("{e}"));
        let TraceFile::Weka(t) = &file else { panic!("{} is not a Weka trace", path.display()) };
        let want_requests: usize = cells[req_col].parse().expect("requests");
        let want_subagents: usize = cells[sub_col].parse().expect("subagents");
        assert_eq!(file.request_count(), want_requests, "{}", path.display());
        let s = sessions(std::slice::from_ref(&file));
        let subagents: usize = s[0].branches.iter().map(|b| b.children.len()).sum::<usize>() + s[0].dropped_subagents;
        assert_eq!(subagents, want_subagents, "{}", path.display());
        assert_eq!(t.block_size, 64);
        assert_eq!(s[0].main.setup_source, SetupSource::Declared);
        checked += 1;
    }
    assert_eq!(checked, 40);
    assert_eq!(trace_paths(&weka).expect("folder").len(), 40);

    for (name, lines) in [("conversation_trace.jsonl", 12_031), ("synthetic_trace.jsonl", 3_993)] {
        let file = read_file(&dir.join("mooncake-fast25").join(name)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(file.request_count(), lines, "{name}");
    }
}
