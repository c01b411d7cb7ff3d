//! Constraints over sparkd's tokenizer: seeded random walks through the allowed tokens always produce text the
//! grammar admits (a JSON Schema, a regex, Kimi's tool-call section), drafts are cut at their first forbidden
//! token, and bad grammars are errors naming what is wrong.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use sparkd_grammar::{Constraint, ConstraintSpec, GrammarEnv, ToolSpec};
use sparkd_tokenizer::{ChatTemplate, ReplyEvent, ReplyParser, Tokenizer};

fn env() -> (GrammarEnv, Tokenizer) {
    let tok = Tokenizer::builtin().unwrap();
    (GrammarEnv::new(&tok).unwrap(), tok)
}

fn allowed_ids(mask: &[u32]) -> Vec<u32> {
    let mut ids = Vec::new();
    for (w, bits) in mask.iter().enumerate() {
        for b in 0..32 {
            if bits >> b & 1 == 1 {
                ids.push(w as u32 * 32 + b);
            }
        }
    }
    ids
}

/// A random walk: each step samples uniformly among the allowed ids (as a model with a flat distribution under
/// the mask would) until the end of turn or `limit` tokens. Returns the tokens before the end of turn, and
/// whether it ended.
fn walk(c: &mut Constraint, seed: u64, end: u32, limit: usize) -> (Vec<u32>, bool) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    for _ in 0..limit {
        let ids = allowed_ids(&c.allowed().unwrap());
        assert!(!ids.is_empty(), "the mask allows nothing after {out:?}");
        let t = ids[rng.gen_range(0..ids.len())];
        c.commit(&[t]).unwrap();
        if t == end {
            return (out, true);
        }
        out.push(t);
    }
    (out, false)
}

/// A ticket: a short title, a priority from an enum, a number of points, nested optional labels.
fn ticket_schema() -> Value {
    json!({"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 5},
        "priority": {"enum": ["low", "high"]},
        "points": {"type": "integer", "minimum": 1, "maximum": 13},
        "labels": {"type": "object", "properties": {"team": {"type": "string", "maxLength": 3}},
                   "additionalProperties": false}},
        "required": ["title", "priority", "points"], "additionalProperties": false})
}

/// Checks `v` against `ticket_schema` by hand.
fn is_ticket(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    let labels_ok = o.get("labels").is_none_or(|l| {
        l.as_object()
            .is_some_and(|m| m.iter().all(|(k, v)| k == "team" && v.as_str().is_some_and(|t| t.chars().count() <= 3)))
    });
    o.keys().all(|k| ["title", "priority", "points", "labels"].contains(&k.as_str()))
        && o["title"].as_str().is_some_and(|s| (1..=5).contains(&s.chars().count()))
        && ["low", "high"].contains(&o["priority"].as_str().unwrap_or(""))
        && o["points"].as_i64().is_some_and(|p| (1..=13).contains(&p))
        && labels_ok
}

#[test]
fn a_hundred_seeded_walks_under_a_json_schema_all_validate() {
    let (env, tok) = env();
    let end = tok.eos_ids()[0];
    let spec = ConstraintSpec::JsonSchema(ticket_schema());
    let base = env.constraint(&spec).unwrap();
    for seed in 0..100 {
        let mut c = base.clone();
        let (ids, ended) = walk(&mut c, seed, end, 400);
        let text = tok.decode(&ids).unwrap();
        assert!(ended, "seed {seed}: no end after 400 tokens: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        assert!(is_ticket(&v), "seed {seed}: {text}");
    }
}

#[test]
fn json_objects_and_regexes_hold_too() {
    let (env, tok) = env();
    let end = tok.eos_ids()[0];
    let mut c = env.constraint(&ConstraintSpec::Regex("(yes|no) [0-9]{2}".into())).unwrap();
    let (ids, ended) = walk(&mut c, 7, end, 50);
    let text = tok.decode(&ids).unwrap();
    assert!(ended && (text.starts_with("yes ") || text.starts_with("no ")) && text.len() <= 6, "{text}");
    let obj = env.constraint(&ConstraintSpec::JsonObject).unwrap();
    // Any object: a walk may not end soon, but what it wrote is always the start of an object.
    let mut c = obj.clone();
    let (ids, _) = walk(&mut c, 3, end, 30);
    assert!(tok.decode(&ids).unwrap().trim_start().starts_with('{'));
}

#[test]
fn a_required_tool_call_parses_into_declared_calls_with_valid_arguments() {
    let (env, tok) = env();
    let chat = ChatTemplate::new(tok.clone()).unwrap();
    let end = tok.eos_ids()[0];
    let tools = vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: Some(json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                                    "required": ["city"], "additionalProperties": false})),
        },
        ToolSpec {
            name: "set_alarm".into(),
            parameters: Some(json!({"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                    "maximum": 23}}, "required": ["hour"], "additionalProperties": false})),
        },
    ];
    for parallel in [false, true] {
        let base = env.constraint(&ConstraintSpec::ToolCalls { tools: tools.clone(), parallel }).unwrap();
        for seed in 0..20 {
            let mut c = base.clone();
            let (ids, ended) = walk(&mut c, seed, end, 400);
            assert!(ended, "seed {seed}: {ids:?}");
            let mut parser = ReplyParser::new(&tok).unwrap();
            let mut events = parser.push(&ids);
            events.extend(parser.finish());
            let mut calls: Vec<(String, String)> = Vec::new();
            for e in events {
                match e {
                    ReplyEvent::ToolCallBegin { name, .. } => calls.push((name, String::new())),
                    ReplyEvent::ToolCallArguments { text, .. } => calls.last_mut().unwrap().1.push_str(&text),
                    ReplyEvent::Content(t) | ReplyEvent::Reasoning(t) => panic!("seed {seed}: text {t:?}"),
                    ReplyEvent::ToolCallEnd { .. } => {}
                }
            }
            assert!(!calls.is_empty() && (parallel || calls.len() == 1), "seed {seed}: {calls:?}");
            for (name, args) in &calls {
                let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("seed {seed}: {e}: {args}"));
                match name.as_str() {
                    "get_weather" => assert!(v["city"].as_str().is_some_and(|c| c.chars().count() <= 5), "{args}"),
                    "set_alarm" => assert!(v["hour"].as_i64().is_some_and(|h| (0..24).contains(&h)), "{args}"),
                    other => panic!("seed {seed}: undeclared function {other}"),
                }
            }
            assert_eq!(ids[0], chat.tool_markers().section_begin);
        }
    }
}

#[test]
fn drafts_are_cut_at_their_first_forbidden_token() {
    let (env, tok) = env();
    let end = tok.eos_ids()[0];
    let mut c = env.constraint(&ConstraintSpec::Regex("abc".into())).unwrap();
    let good = tok.encode("abc");
    let mut draft = good.clone();
    draft.push(end);
    assert_eq!(c.allowed_prefix(&draft).unwrap(), draft.len(), "the end of turn may close a complete match");
    let bad = [tok.encode("ab"), tok.encode("x")].concat();
    assert_eq!(c.allowed_prefix(&bad).unwrap(), tok.encode("ab").len());
    assert_eq!(c.committed(), 0, "checking a draft commits nothing");
    c.commit(&good).unwrap();
    assert!(c.is_accepting().unwrap());
    assert_eq!(allowed_ids(&c.allowed().unwrap()), vec![end], "a complete grammar only lets the turn end");
    assert!(c.commit(&tok.encode("z")).is_err(), "a forbidden token is an error");
}

#[test]
fn bad_grammars_are_errors_naming_the_problem() {
    let (env, _) = env();
    let bad = [
        (ConstraintSpec::Regex("(unclosed".into()), "regex"),
        (ConstraintSpec::Lark("start: undefined_rule".into()), "Lark grammar"),
        (ConstraintSpec::JsonSchema(json!({"type": "no-such-type"})), "JSON Schema"),
        (ConstraintSpec::ToolCalls { tools: vec![], parallel: true }, "tool-call grammar"),
        (
            ConstraintSpec::ToolCalls {
                tools: vec![ToolSpec { name: "a b".into(), parameters: None }],
                parallel: false,
            },
            "tool-call grammar",
        ),
    ];
    for (spec, what) in bad {
        let err = env.constraint(&spec).unwrap_err();
        assert_eq!(err.kind(), "invalid_grammar", "{spec:?}: {err}");
        assert!(err.to_string().contains(what), "{spec:?}: {err}");
    }
}
