//! The host time a constraint adds per generated token: `cargo run --release -p sparkd-grammar --example
//! mask_time`. Seeded random walks over K3's 163,840-id vocabulary (the built-in tokenizer) under a JSON Schema and
//! a two-function tool-call grammar; prints the median and p90 of computing one mask (`Constraint::allowed`) and
//! of committing one token, and the start-up cost of the tokenizer's description.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use sparkd_grammar::{ConstraintSpec, GrammarEnv, ToolSpec};
use sparkd_tokenizer::Tokenizer;

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let tok = Tokenizer::builtin().expect("the built-in tokenizer");
    let t0 = Instant::now();
    let env = GrammarEnv::new(&tok).expect("the grammar environment");
    println!("grammar environment: {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    let end = tok.eos_ids()[0];
    let person = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
        "maxItems": 4}}, "required": ["name", "age", "tags"], "additionalProperties": false});
    let tools = vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: Some(json!({"type": "object", "properties":
            {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]})),
        },
        ToolSpec {
            name: "search".into(),
            parameters: Some(json!({"type": "object", "properties":
            {"q": {"type": "string", "maxLength": 24}}, "required": ["q"]})),
        },
    ];
    for (label, spec) in [
        ("JSON Schema", ConstraintSpec::JsonSchema(person)),
        ("tool calls", ConstraintSpec::ToolCalls { tools, parallel: true }),
    ] {
        let t0 = Instant::now();
        let base = env.constraint(&spec).expect("a valid grammar");
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        let (mut mask_us, mut commit_us) = (Vec::new(), Vec::new());
        for seed in 0..20u64 {
            let mut c = base.clone();
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            for _ in 0..300 {
                let t = Instant::now();
                let mask = c.allowed().expect("a mask");
                mask_us.push(t.elapsed().as_secs_f64() * 1e6);
                let ids: Vec<u32> =
                    (0..mask.len() as u32 * 32).filter(|&i| mask[i as usize / 32] >> (i % 32) & 1 == 1).collect();
                let id = ids[rng.gen_range(0..ids.len())];
                let t = Instant::now();
                c.commit(&[id]).expect("an allowed token");
                commit_us.push(t.elapsed().as_secs_f64() * 1e6);
                if id == end {
                    break;
                }
            }
        }
        println!(
            "{label}: compile {compile_ms:.2} ms; {} masks, median {:.1} us, p90 {:.1} us; commit median {:.1} us",
            mask_us.len(),
            percentile(&mut mask_us, 0.5),
            percentile(&mut mask_us, 0.9),
            percentile(&mut commit_us, 0.5)
        );
    }
}
