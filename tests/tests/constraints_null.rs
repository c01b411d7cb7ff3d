//! Constrained output against `sparkd serve --device null` (its point-mass model follows a constraint's masks):
//! 100 seeded sampled requests under a JSON Schema all validate; `json_object`, a regex and a Lark grammar hold;
//! invalid constraints are 400s naming the field; and greedy output under a schema and under a required tool
//! call is the same with speculation off and on (suffix drafts on the null model, DSpark drafts on the CPU model,
//! cut at the grammar's first forbidden token and verified under its masks), while forced acceptance (on the CPU
//! model), which emits many tokens per step, still follows it; and a grammar that writes a thinking block splits
//! into `reasoning_content` and `content`.

use serde_json::{json, Value};
use sparkd_tests::Server;

fn person_schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"}},
        "required": ["name", "age", "tags", "ok"], "additionalProperties": false})
}

/// `v` against `person_schema`, by hand.
fn is_person(v: &Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    o.len() == 4
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 6)
        && o["age"].as_i64().is_some_and(|a| (0..=120).contains(&a))
        && o["tags"]
            .as_array()
            .is_some_and(|t| t.len() <= 3 && t.iter().all(|x| ["a", "b", "c"].contains(&x.as_str().unwrap_or(""))))
        && o["ok"].is_boolean()
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "describe someone"}], "max_tokens": 150});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn schema_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "person", "schema": person_schema(), "strict": true}})
}

async fn content(s: &Server, body: &Value) -> (String, Value) {
    let (status, reply) = s.post("/v1/chat/completions", body).await.unwrap();
    assert_eq!(status, 200, "{reply}");
    (reply["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string(), reply)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_seeded_requests_under_a_json_schema_all_validate() {
    let s = Server::start(&["--device", "null"]).await.expect("server starts");
    for seed in 0..100 {
        let body = chat(json!({"response_format": schema_format(), "temperature": 1.0, "seed": seed}));
        let (text, reply) = content(&s, &body).await;
        assert_eq!(reply["choices"][0]["finish_reason"], "stop", "seed {seed}: {reply}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        assert!(is_person(&v), "seed {seed}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_objects_regexes_and_grammars_hold_and_bad_ones_are_400s() {
    let s = Server::start(&["--device", "null"]).await.expect("server starts");
    let regex = chat(json!({"structured_outputs": {"regex": "(red|green|blue)-[0-9]{3}"}, "temperature": 0}));
    let (text, _) = content(&s, &regex).await;
    let (color, digits) = text.split_once('-').expect("a dash");
    assert!(["red", "green", "blue"].contains(&color) && digits.len() == 3, "{text}");
    let lark = chat(json!({"structured_outputs": {"grammar": "start: \"yes\" | \"no\""}, "temperature": 0}));
    let (text, _) = content(&s, &lark).await;
    assert!(text == "yes" || text == "no", "{text}");
    // Any object: the reply is cut by max_tokens, but whatever came is the start of a JSON object.
    let object = chat(json!({"response_format": {"type": "json_object"}, "max_tokens": 8, "temperature": 0}));
    assert!(content(&s, &object).await.0.starts_with('{'));
    let bad = [
        (json!({"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs.regex"),
        (json!({"structured_outputs": {"grammar": "start: nowhere"}}), "structured_outputs.grammar"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
            "structured_outputs.regex",
        ),
    ];
    for (extra, param) in bad {
        let (status, reply) = s.post("/v1/chat/completions", &chat(extra.clone())).await.unwrap();
        assert_eq!(status, 400, "{extra}: {reply}");
        assert_eq!(reply["error"]["param"], param, "{reply}");
    }
    // Responses: `text.format`.
    let resp = json!({"input": "someone", "text": {"format": {"type": "json_schema", "name": "p", "schema": person_schema()}},
                      "max_output_tokens": 150, "temperature": 0, "store": false});
    let (status, reply) = s.post("/v1/responses", &resp).await.unwrap();
    assert_eq!(status, 200, "{reply}");
    let text = reply["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(is_person(&serde_json::from_str(text).unwrap()), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_constrained_output_is_the_same_with_speculation_on() {
    let tools = json!([{"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object",
        "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "label": {"type": "string",
        "maxLength": 8}}, "required": ["hour", "label"], "additionalProperties": false}}}]);
    let bodies = [
        chat(json!({"response_format": schema_format(), "temperature": 0})),
        chat(json!({"tools": tools, "tool_choice": "required", "temperature": 0})),
    ];
    let mut replies: Vec<Vec<Value>> = Vec::new();
    for args in [
        vec!["--device", "null"],
        vec!["--device", "null", "--spec", "suffix", "--num-spec-tokens", "6"],
        vec!["--device", "cpu", "--spec", "suffix", "--num-spec-tokens", "6", "--spec-synthetic-al", "4"],
        vec!["--device", "cpu"],
        vec!["--device", "cpu", "--spec", "dspark", "--num-spec-tokens", "4"],
    ] {
        let s = Server::start(&args).await.expect("server starts");
        let mut out = Vec::new();
        for body in &bodies {
            // Twice: the second request's suffix drafts come from the first's output, so most are accepted.
            content(&s, body).await;
            let (_, reply) = content(&s, body).await;
            if args.contains(&"suffix") && args.contains(&"null") {
                let accepted = &reply["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"];
                assert!(accepted.as_u64().is_some_and(|n| n > 0), "no draft was accepted: {reply}");
            }
            out.push(reply["choices"][0]["message"].clone());
        }
        replies.push(out);
        s.terminate().unwrap();
    }
    assert_eq!(replies[0], replies[1], "suffix speculation changed constrained greedy output");
    assert_eq!(replies[3], replies[4], "DSpark drafts changed constrained greedy output on the CPU model");
    // Forced acceptance (the CPU model; the null runner has none) emits drafts by a schedule, not the model's
    // choice: the output differs but follows the constraints.
    let forced = &replies[2];
    assert!(is_person(&serde_json::from_str(forced[0]["content"].as_str().unwrap()).unwrap()), "{forced:?}");
    let call = &forced[1]["tool_calls"][0]["function"];
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["hour"].as_i64().is_some_and(|h| (0..24).contains(&h)) && args["label"].is_string(), "{args}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thinking_block_arrives_as_reasoning_content_apart_from_content() {
    let s = Server::start(&["--device", "null"]).await.expect("server starts");
    let grammar = r#"start: "<think>" /[a-z]{3,6}/ "</think>" /[A-Z][a-z]{2,5}/"#;
    let body = chat(json!({"structured_outputs": {"grammar": grammar}, "temperature": 0}));
    let (text, reply) = content(&s, &body).await;
    let reasoning = reply["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or_default().to_string();
    assert!((3..=6).contains(&reasoning.len()) && reasoning.bytes().all(|b| b.is_ascii_lowercase()), "{reply}");
    assert!(text.starts_with(|c: char| c.is_ascii_uppercase()) && !text.contains("think"), "{reply}");
    // Streamed: the same split, as deltas.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.sse_all("/v1/chat/completions", &streamed).await.unwrap();
    let (mut r, mut c) = (String::new(), String::new());
    for e in &events {
        let delta = &e.data["choices"][0]["delta"];
        r += delta["reasoning_content"].as_str().unwrap_or_default();
        c += delta["content"].as_str().unwrap_or_default();
    }
    assert_eq!((r, c), (reasoning, text));
    // Thinking off: the prompt closes an empty think block (a few more prompt tokens), and a think tag the model
    // writes anyway is content.
    let mut off = body.clone();
    off["thinking"] = json!({"type": "disabled"});
    let (all, off_reply) = content(&s, &off).await;
    assert!(off_reply["choices"][0]["message"]["reasoning_content"].is_null(), "{off_reply}");
    let inner = all.strip_prefix("<think>").and_then(|rest| rest.split_once("</think>"));
    assert!(inner.is_some_and(|(r, c)| r.bytes().all(|b| b.is_ascii_lowercase()) && !c.is_empty()), "{off_reply}");
    let prompt_tokens = |r: &Value| r["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens(&off_reply) > prompt_tokens(&reply), "{off_reply}");
    off.as_object_mut().unwrap().remove("thinking");
    off["chat_template_kwargs"] = json!({"thinking": true});
    off["thinking"] = json!({"type": "disabled"});
    let (status, err) = s.post("/v1/chat/completions", &off).await.unwrap();
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("chat_template_kwargs.thinking")), "{err}");
    // Responses: `reasoning.effort: "none"` turns it off the same way.
    let input_tokens = |r: &Value| r["usage"]["input_tokens"].as_u64().unwrap();
    let plain = json!({"input": "describe someone", "max_output_tokens": 4});
    let (_, on) = s.post("/v1/responses", &plain).await.unwrap();
    let mut none = plain.clone();
    none["reasoning"] = json!({"effort": "none"});
    let (status, off) = s.post("/v1/responses", &none).await.unwrap();
    assert_eq!(status, 200, "{off}");
    assert_eq!(input_tokens(&off), input_tokens(&on) + prompt_tokens(&off_reply) - prompt_tokens(&reply), "{off}");
}
