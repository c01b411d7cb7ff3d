//! Property tests of the trace readers (`trace::parse_weka`, `trace::parse_mooncake`) and of the session trees built
//! from what they accept (`dag::weka_session`):
//! - round trip: a generated well-formed trace parses back to exactly the values it was written from, blank lines
//!   of a Mooncake file skipped;
//! - corruption: removing a required key, adding an unknown one, or writing a value out of range is refused as a
//!   `TraceField` error naming the file and that key (with its place, for range errors); any bytes, and any cut or
//!   flipped byte of a good trace, are parsed or refused without a panic, a refusal naming the file;
//! - sessions: every request is in the tree (none dropped when a main turn comes first and no subagent is empty),
//!   no delay is negative, and a chain's setup prefix stays inside its first turn, whatever the declared setup
//!   token counts.

use std::path::Path;

use proptest::prelude::*;
use serde_json::{json, Value};
use sparkd_workloads::dag::{weka_session, Chain};
use sparkd_workloads::error::ReplayError;
use sparkd_workloads::trace::{parse_mooncake, parse_weka, RecordedRequest, TraceFile, WekaEntry};

const FILE: &str = "trace.json";

/// A request as written: its recorded fields, whether it is streamed (`"s"`, with a `ttft`).
#[derive(Clone, Debug)]
struct Req {
    recorded: RecordedRequest,
    streamed: bool,
}

/// A top-level entry: a main request or a subagent with its own requests.
#[derive(Clone, Debug)]
enum Entry {
    Main(Req),
    Subagent { agent_id: String, duration_ms: Option<u64>, tool_tokens: u32, system_tokens: u32, requests: Vec<Req> },
}

/// Times exactly representable in binary, so that writing and reading them loses nothing.
fn time() -> impl Strategy<Value = f64> {
    (0u32..4_000_000).prop_map(|n| f64::from(n) / 64.0)
}

fn req() -> impl Strategy<Value = Req> {
    (
        time(),
        "[a-z]{1,8}",
        1u32..,
        any::<u32>(),
        prop::collection::vec(any::<u64>(), 0..6),
        prop::option::of(time()),
        prop::option::of(time()),
        any::<bool>(),
    )
        .prop_map(|(t, model, input_tokens, output_tokens, hash_ids, api_time, think_time, streamed)| Req {
            recorded: RecordedRequest { t, model, input_tokens, output_tokens, hash_ids, api_time, think_time },
            streamed,
        })
}

fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        3 => req().prop_map(Entry::Main),
        1 => ("[a-z0-9]{1,6}", prop::option::of(0u64..1_000_000), any::<u32>(), any::<u32>(), prop::collection::vec(req(), 1..4))
            .prop_map(|(agent_id, duration_ms, tool_tokens, system_tokens, requests)| Entry::Subagent {
                agent_id,
                duration_ms,
                tool_tokens,
                system_tokens,
                requests,
            }),
    ]
}

/// A trace whose first entry is a main request; with its declared tool and system tokens and block size.
fn trace() -> impl Strategy<Value = (Vec<Entry>, u32, u32, u32)> {
    (req(), prop::collection::vec(entry(), 0..6), any::<u32>(), any::<u32>(), 1u32..512).prop_map(
        |(first, rest, tool, system, block)| {
            (std::iter::once(Entry::Main(first)).chain(rest).collect(), tool, system, block)
        },
    )
}

fn req_json(r: &Req) -> Value {
    let x = &r.recorded;
    let mut v = json!({"t": x.t, "type": if r.streamed { "s" } else { "n" }, "model": x.model, "in": x.input_tokens,
        "out": x.output_tokens, "hash_ids": x.hash_ids, "api_time": x.api_time, "think_time": x.think_time});
    if r.streamed {
        v["ttft"] = json!(0.25);
    }
    v
}

fn trace_json(entries: &[Entry], tool: u32, system: u32, block: u32) -> Value {
    let requests: Vec<Value> = entries
        .iter()
        .map(|e| match e {
            Entry::Main(r) => req_json(r),
            Entry::Subagent { agent_id, duration_ms, tool_tokens, system_tokens, requests } => json!({
                "t": 1.5, "type": "subagent", "agent_id": agent_id, "duration_ms": duration_ms,
                "tool_tokens": tool_tokens, "system_tokens": system_tokens,
                "requests": requests.iter().map(req_json).collect::<Vec<_>>(),
            }),
        })
        .collect();
    json!({"id": "session", "models": ["m"], "block_size": block, "hash_id_scope": "local", "tool_tokens": tool,
        "system_tokens": system, "requests": requests})
}

fn parse(v: &Value) -> sparkd_workloads::Result<sparkd_workloads::trace::WekaTrace> {
    parse_weka(Path::new(FILE), &serde_json::to_vec(v).expect("JSON"))
}

/// The field a refusal names, after checking that it is a field error naming the file.
fn refused_field(v: &Value) -> String {
    match parse(v) {
        Err(ReplayError::TraceField { path, field, .. }) => {
            assert_eq!(path, Path::new(FILE));
            field
        }
        other => panic!("expected a field error, got {other:?}"),
    }
}

fn check_chain(chain: &Chain, block: u32) {
    for turn in &chain.turns {
        assert!(turn.delay_s.is_finite() && turn.delay_s >= 0.0, "{}: delay {}", chain.id, turn.delay_s);
    }
    let first = &chain.turns[0];
    assert!(chain.setup_blocks <= first.hash_ids.len());
    assert!((chain.setup_blocks as u64) * u64::from(block) < u64::from(first.input_tokens), "{}", chain.id);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn weka_traces_round_trip_and_build_whole_sessions((entries, tool, system, block) in trace()) {
        let parsed = parse(&trace_json(&entries, tool, system, block)).expect("a well-formed trace parses");
        prop_assert_eq!((parsed.block_size, parsed.tool_tokens, parsed.system_tokens), (block, tool, system));
        prop_assert_eq!(parsed.requests.len(), entries.len());
        for (got, want) in parsed.requests.iter().zip(&entries) {
            match (got, want) {
                (WekaEntry::Normal(r), Entry::Main(w)) => prop_assert_eq!(&RecordedRequest::from(r), &w.recorded),
                (WekaEntry::Streaming(r), Entry::Main(w)) => prop_assert_eq!(&RecordedRequest::from(r), &w.recorded),
                (WekaEntry::Subagent(s), Entry::Subagent { agent_id, requests, .. }) => {
                    prop_assert_eq!(&s.agent_id, agent_id);
                    let got: Vec<RecordedRequest> = s.requests.iter().map(|r| r.recorded()).collect();
                    let want: Vec<RecordedRequest> = requests.iter().map(|r| r.recorded.clone()).collect();
                    prop_assert_eq!(got, want);
                }
                (got, want) => prop_assert!(false, "parsed {:?} from {:?}", got, want),
            }
        }

        let session = weka_session(&parsed);
        prop_assert_eq!(session.dropped_subagents, 0);
        prop_assert_eq!(session.request_count(), TraceFile::Weka(Box::new(parsed)).request_count());
        check_chain(&session.main, block);
        for branch in &session.branches {
            prop_assert!(branch.join_before.is_none_or(|j| branch.after_turn < j && j < session.main.turns.len()));
            for child in &branch.children {
                prop_assert!(child.spawn_delay_s >= 0.0);
                check_chain(&child.chain, block);
            }
        }
    }

    #[test]
    fn a_missing_or_unknown_key_is_refused_naming_it(
        (entries, tool, system, block) in trace(),
        pick in any::<prop::sample::Index>(),
        unknown in "[a-z]{1,6}_x",
    ) {
        let good = trace_json(&entries, tool, system, block);
        let top = ["id", "models", "block_size", "hash_id_scope", "requests"];
        let request = ["t", "model", "in", "out", "hash_ids"];
        let mut missing = good.clone();
        let key = if pick.index(2) == 0 {
            let key = pick.get(&top);
            missing.as_object_mut().expect("object").remove(*key);
            key
        } else {
            let key = pick.get(&request);
            missing["requests"][0].as_object_mut().expect("object").remove(*key);
            key
        };
        prop_assert_eq!(refused_field(&missing), *key);

        let mut extra = good;
        extra["requests"][0][unknown.as_str()] = json!(1);
        prop_assert_eq!(refused_field(&extra), unknown);
    }

    #[test]
    fn values_out_of_range_are_refused_naming_the_place(
        (entries, tool, system, block) in trace(),
        negative in -1e9f64..-1e-9,
        which in 0usize..4,
    ) {
        let mut v = trace_json(&entries, tool, system, block);
        let (key, value, field) = match which {
            0 => ("t", json!(negative), "requests[0].t"),
            1 => ("think_time", json!(negative), "requests[0].think_time"),
            2 => ("api_time", json!(negative), "requests[0].api_time"),
            _ => ("in", json!(0), "requests[0].in"),
        };
        v["requests"][0][key] = value;
        prop_assert_eq!(refused_field(&v), field);
        let mut zero_block = trace_json(&entries, tool, system, block);
        zero_block["block_size"] = json!(0);
        prop_assert_eq!(refused_field(&zero_block), "block_size");
    }

    #[test]
    fn cut_or_flipped_traces_never_panic(
        (entries, tool, system, block) in trace(),
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        let mut bytes = serde_json::to_vec(&trace_json(&entries, tool, system, block)).expect("JSON");
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        for result in [parse_weka(Path::new(FILE), &bytes).map(|_| ()), parse_mooncake(Path::new(FILE), &bytes).map(|_| ())] {
            if let Err(e) = result {
                prop_assert!(e.to_string().contains(FILE), "{}", e);
            }
        }
    }

    #[test]
    fn mooncake_lines_round_trip(
        lines in prop::collection::vec((any::<u64>(), 1u32.., any::<u32>(), prop::collection::vec(any::<u64>(), 0..4), any::<bool>()), 0..12),
    ) {
        let mut text = String::new();
        for (timestamp, input, output, hash_ids, blank_after) in &lines {
            let line = json!({"timestamp": timestamp, "input_length": input, "output_length": output, "hash_ids": hash_ids});
            text.push_str(&format!("{line}\n"));
            if *blank_after {
                text.push_str("  \n");
            }
        }
        let trace = parse_mooncake(Path::new("m.jsonl"), text.as_bytes()).expect("well-formed lines parse");
        prop_assert_eq!(trace.id, "m");
        prop_assert_eq!(trace.requests.len(), lines.len());
        for (got, (timestamp, input, output, hash_ids, _)) in trace.requests.iter().zip(&lines) {
            prop_assert_eq!((got.timestamp, got.input_length, got.output_length), (*timestamp, *input, *output));
            prop_assert_eq!(&got.hash_ids, hash_ids);
        }
    }

    #[test]
    fn a_zero_mooncake_input_names_its_line(before in 0usize..5) {
        let good = "{\"timestamp\": 1, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1]}\n";
        let text = format!("{}{}", good.repeat(before), good.replace("\"input_length\": 3", "\"input_length\": 0"));
        match parse_mooncake(Path::new("m.jsonl"), text.as_bytes()) {
            Err(ReplayError::TraceField { field, .. }) => prop_assert_eq!(field, format!("line {}: input_length", before + 1)),
            other => prop_assert!(false, "expected a field error, got {:?}", other),
        }
    }
}
