//! Fuzz target: client events of the Responses WebSocket, through the daemon's parser of one message
//! (`sparkd::api::ws::parse_event`): UTF-8 and JSON first, then `response.create` (validated by
//! `items::responses_request`, its fields at the top level or under `response`) or `response.cancel`.
//!
//! Checks, for any message:
//! - nothing panics; a message is refused outright exactly when it is not UTF-8 JSON, as `InvalidJson`; every
//!   refused event is a 400;
//! - the `stream_id` that tags the answer is the event's own (a string, or a number as written);
//! - a cancel names the event's `response_id`, else its `stream_id`;
//! - the two forms of `response.create` agree: the same fields under `response` validate exactly as at the top
//!   level (the same request, seeds aside when the event names none, or a refusal both ways).

#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};
use sparkd::api::limits::RequestLimits;
use sparkd::api::ws::{parse_event, ClientEvent, ParsedEvent};

/// Limits small enough for fuzzed events to cross.
const LIMITS: RequestLimits =
    RequestLimits { max_prompt_chars: 64, max_stop_strings: 2, max_stop_chars: 8, max_logprobs: 3 };

fn parsed(message: &[u8]) -> Option<ParsedEvent> {
    match parse_event(message, &LIMITS) {
        Ok(parsed) => {
            if let Err(e) = &parsed.event {
                assert_eq!(e.status().as_u16(), 400, "{e:?}");
            }
            Some(parsed)
        }
        Err(e) => {
            assert_eq!(e.kind(), "invalid_json", "{e:?}");
            let json = std::str::from_utf8(message).ok().and_then(|text| serde_json::from_str::<Value>(text).ok());
            assert!(json.is_none(), "UTF-8 JSON refused outright: {e:?}");
            None
        }
    }
}

fuzz_target!(|message: &[u8]| {
    let Some(ParsedEvent { stream_id, event }) = parsed(message) else { return };
    let value: Value = serde_json::from_slice(message).expect("a parsed event is JSON");
    let own_stream_id = match &value["stream_id"] {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    assert_eq!(stream_id, own_stream_id);
    match event {
        Ok(ClientEvent::Cancel(key)) => {
            assert_eq!(Some(key), value["response_id"].as_str().map(str::to_owned).or(own_stream_id));
        }
        Ok(ClientEvent::Create(_)) | Err(_) if value["type"] != "response.create" => {}
        top => {
            if value.get("response").is_some_and(Value::is_object) {
                return;
            }
            let nested = json!({"type": "response.create", "stream_id": value["stream_id"], "response": value});
            let nested = parsed(nested.to_string().as_bytes()).expect("a JSON event parses").event;
            match (top, nested) {
                (Ok(ClientEvent::Create(top)), Ok(ClientEvent::Create(nested))) => {
                    let mut nested = (*nested).clone();
                    nested.params.sampling.seed = top.params.sampling.seed;
                    assert_eq!(*top, nested, "the nested form of {value} validates differently");
                }
                (Err(_), Err(_)) => {}
                (top, nested) => panic!("{value}: top level {top:?}, nested {nested:?}"),
            }
        }
    }
});
