//! Fuzz target: `config.json` parsing in `sparkd-kernels`, the target model's (`ModelConfig::from_json`) and the
//! DSpark drafter's (`DrafterConfig::from_json`, checked against the k3-tiny target), then what loading does next
//! with an accepted config: the list of tensors it implies (`schema::model_tensors`, `dspark::schema::
//! drafter_tensors`) and their sizes.
//!
//! The input is used twice: as the raw file, and as a list of edits (set a node anywhere in the tree to a fuzzed
//! value, or remove it) applied to a built-in preset's config and its drafter's, which reaches the checks past the
//! first fields.
//!
//! Checks, for any input:
//! - nothing panics (integer overflow included: fuzz builds keep debug assertions), and nothing runs out of memory;
//! - an accepted config round-trips: `from_json(to_json(c)) == c`;
//! - every tensor it implies has a byte size that fits in `usize`.

#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};
use sparkd_kernels::dspark::config::DrafterConfig;
use sparkd_kernels::dspark::schema::drafter_tensors;
use sparkd_kernels::schema::model_tensors;
use sparkd_kernels::tensor::ExpectedTensor;
use sparkd_kernels::ModelConfig;

/// The presets edits start from: K3's scaled versions (K3 itself has ten times their layers, and nothing else).
const SCALED_PRESETS: [&str; 3] = ["k3-tiny", "k3-mini", "k3-mini-wide"];

/// A value an edit writes.
#[derive(Arbitrary, Debug)]
enum Fuzzed {
    Null,
    Bool(bool),
    Small(u8),
    Int(u64),
    Negative(i64),
    Float(f64),
    Text(String),
    Layers(Vec<u8>),
    Remove,
}

#[derive(Arbitrary, Debug)]
struct Edit {
    at: u16,
    value: Fuzzed,
}

/// The path of every node of `v` (object keys and array indices), parents before children.
fn paths(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    out.push(at.clone());
    let children: Vec<(String, &Value)> = match v {
        Value::Object(map) => map.iter().map(|(k, c)| (k.clone(), c)).collect(),
        Value::Array(items) => items.iter().enumerate().map(|(i, c)| (i.to_string(), c)).collect(),
        _ => Vec::new(),
    };
    for (key, child) in children {
        at.push(key);
        paths(child, at, out);
        at.pop();
    }
}

fn apply(root: &mut Value, edits: &[Edit]) {
    for edit in edits {
        let mut all = Vec::new();
        paths(root, &mut Vec::new(), &mut all);
        let path = &all[usize::from(edit.at) % all.len()];
        let Some((last, parent_path)) = path.split_last() else { continue };
        let mut parent = &mut *root;
        for key in parent_path {
            parent = match parent {
                Value::Object(map) => &mut map[key.as_str()],
                Value::Array(items) => &mut items[key.parse::<usize>().expect("an index")],
                _ => unreachable!("paths lead through objects and arrays"),
            };
        }
        let value = match &edit.value {
            Fuzzed::Null => Value::Null,
            Fuzzed::Bool(b) => json!(b),
            Fuzzed::Small(n) => json!(n),
            Fuzzed::Int(n) => json!(n),
            Fuzzed::Negative(n) => json!(n),
            Fuzzed::Float(x) => json!(x),
            Fuzzed::Text(s) => json!(s),
            Fuzzed::Layers(ls) => json!(ls),
            Fuzzed::Remove => {
                match parent {
                    Value::Object(map) => drop(map.shift_remove(last.as_str())),
                    Value::Array(items) => drop(items.remove(last.parse::<usize>().expect("an index"))),
                    _ => {}
                }
                continue;
            }
        };
        match parent {
            Value::Object(map) => map[last.as_str()] = value,
            Value::Array(items) => items[last.parse::<usize>().expect("an index")] = value,
            _ => {}
        }
    }
}

fn assert_sizes(specs: &[ExpectedTensor]) {
    for spec in specs {
        let elements = spec.shape.canonical().iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let bytes = elements.and_then(|n| n.checked_mul(spec.dtype.size()));
        assert!(bytes.is_some(), "tensor `{}` of {} has no usize byte size", spec.name, spec.shape);
        assert_eq!(Some(spec.canonical_bytes()), bytes);
    }
}

fn check_target(root: &Value) {
    let Ok(cfg) = ModelConfig::from_json(root) else { return };
    assert_eq!(ModelConfig::from_json(&cfg.to_json()).expect("its own JSON parses"), cfg);
    // Routed experts of one layer all have the same shapes: two of them stand for all, so that a K3-sized config
    // lists its tensors in microseconds rather than seconds; the router's own shapes are checked apart.
    let mut few = cfg.clone();
    few.moe.num_experts = few.moe.num_experts.min(2);
    assert_sizes(&model_tensors(&few));
    let router = cfg.moe.num_experts.checked_mul(cfg.hidden_size).and_then(|n| n.checked_mul(2));
    assert!(router.is_some(), "the router of {} experts has no usize byte size", cfg.moe.num_experts);
}

fn check_drafter(text: &str, target: &ModelConfig) {
    let Ok(cfg) = DrafterConfig::from_json(text, target) else { return };
    let again = DrafterConfig::from_json(&cfg.to_json().expect("it serializes"), target).expect("its own JSON parses");
    assert_eq!(again, cfg);
    assert_sizes(&drafter_tensors(&cfg));
    let _ = (cfg.num_params(), cfg.active_bytes());
}

fuzz_target!(|data: &[u8]| {
    let tiny = ModelConfig::preset("k3-tiny").expect("preset");
    if let Ok(root) = serde_json::from_slice::<Value>(data) {
        check_target(&root);
    }
    if let Ok(text) = std::str::from_utf8(data) {
        check_drafter(text, &tiny);
    }

    let mut u = Unstructured::new(data);
    let Ok(preset) = u.choose(&SCALED_PRESETS) else { return };
    let Ok(edits) = Vec::<Edit>::arbitrary(&mut u) else { return };
    let mut root = ModelConfig::preset(preset).expect("preset").to_json();
    apply(&mut root, &edits);
    check_target(&root);
    let mut drafter = serde_json::from_str(&DrafterConfig::preset(preset).expect("preset").to_json().expect("JSON"))
        .expect("its own JSON parses");
    apply(&mut drafter, &edits);
    check_drafter(&drafter.to_string(), &ModelConfig::preset(preset).expect("preset"));
});
