//! Responses API items: a request's input items as chat messages ([`responses_request`]), and a response's output
//! items as they stream ([`OutputItems`]).
//!
//! Invariants:
//! - Input: consecutive assistant-side items (`reasoning`, an assistant `message`, `function_call`) in that order
//!   form one assistant turn, as the model wrote them (its thinking, its text, its calls), so a history resent
//!   as items renders as the chat form of the same conversation does; a `function_call_output` is a tool turn
//!   named after the function of a `functions.NAME:IDX` call id.
//! - Output: items open in the order the reply produces them (reasoning, the message, then one `function_call`
//!   per call), each with `response.output_item.added` before its deltas and closed (`…done` events, then
//!   `response.output_item.done`) before the next opens. A reply without calls always has a message item (an
//!   empty one when it produced no text), so a plain reply streams exactly as it did before tools existed:
//!   `output_item.added`, `content_part.added`, `output_text.delta`…, `output_text.done`, `content_part.done`,
//!   `output_item.done`.

use serde_json::{json, Value};
use sparkd_tokenizer::{ChatMessage, ToolCall};

use super::constraint;
use super::error::ApiError;
use super::limits::{chat_chars, RequestLimits};
use super::new_id;
use super::openai::{content_text, generation_params, thinking, Fields, ValidResponsesRequest};
use super::reply::ToolCallDelta;
use super::tools::{self, tool_turn_name};

const TEXT_PARTS: [&str; 3] = ["input_text", "output_text", "text"];

/// `POST /v1/responses` or a WebSocket `response.create` (whose fields may sit at the top level or under
/// `response`).
pub fn responses_request(body: &Value, limits: &RequestLimits) -> Result<ValidResponsesRequest, ApiError> {
    let top = Fields::new(body, "")?;
    let f = match top.get("response") {
        Some(inner) if inner.is_object() => Fields::new(inner, "response")?,
        _ => Fields::new(body, "")?,
    };
    let mut input = Vec::new();
    if let Some(instructions) = f.str("instructions")? {
        input.push(ChatMessage::new("system", instructions));
    }
    match f.get("input") {
        None => return Err(ApiError::field(f.name("input"), format!("`{}` is required", f.name("input")))),
        Some(Value::String(s)) => input.push(ChatMessage::new("user", s.clone())),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                push_item(&mut input, item, &format!("{}[{i}]", f.name("input")))?;
            }
        }
        Some(_) => {
            return Err(ApiError::field(
                f.name("input"),
                format!("`{}` must be a string or an array of items", f.name("input")),
            ))
        }
    }
    if input.is_empty() {
        return Err(ApiError::field(f.name("input"), format!("`{}` must not be empty", f.name("input"))));
    }
    let tools = tools::parse(&f, true)?;
    limits.check_prompt(&f.name("input"), chat_chars(&input, tools.as_ref().and_then(|t| t.prompt_declaration())))?;
    let stream_id = match top.get("stream_id").or_else(|| f.get("stream_id")) {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(_) => return Err(ApiError::field("stream_id", "`stream_id` must be a string or a number")),
    };
    Ok(ValidResponsesRequest {
        model: top.str("model")?.or(f.str("model")?).map(str::to_owned),
        input,
        previous_response_id: f.str("previous_response_id")?.map(str::to_owned),
        store: f.bool("store")?.unwrap_or(true),
        params: generation_params(&f, &["max_output_tokens"], false, limits)?,
        stream: f.bool("stream")?.unwrap_or(false),
        stream_id,
        constraint: constraint::parse(&f, tools.as_ref(), true)?,
        tools,
        thinking: thinking(&f, true)?,
    })
}

/// How far an assistant turn has got: a later part of the same kind, or an earlier kind, starts a new turn.
fn stage(m: &ChatMessage) -> u8 {
    if !m.tool_calls.is_empty() {
        3
    } else if !m.content.is_empty() {
        2
    } else if m.reasoning.is_some() {
        1
    } else {
        0
    }
}

/// The assistant turn an assistant-side item of `stage` joins: the last message if it is an assistant turn not
/// yet past that stage, else a new one.
fn assistant_turn(input: &mut Vec<ChatMessage>, item_stage: u8) -> &mut ChatMessage {
    let joins = input
        .last()
        .is_some_and(|m| m.role == "assistant" && (stage(m) < item_stage || (item_stage == 3 && stage(m) == 3)));
    if !joins {
        input.push(ChatMessage::new("assistant", ""));
    }
    input.last_mut().expect("an assistant turn was just ensured")
}

/// Parses one input item into `input`: a message (`type` "message" or absent), a `reasoning` or `function_call`
/// item (joining the assistant turn they belong to), or a `function_call_output`.
fn push_item(input: &mut Vec<ChatMessage>, item: &Value, path: &str) -> Result<(), ApiError> {
    let f = Fields::new(item, path)?;
    let required = |key: &str| -> Result<&str, ApiError> {
        f.str(key)?.ok_or_else(|| ApiError::field(f.name(key), format!("`{}` is required", f.name(key))))
    };
    match f.str("type")?.unwrap_or("message") {
        "message" => {
            let role = required("role")?;
            if sparkd_tokenizer::ChatRole::parse(role).is_none() {
                return Err(ApiError::field(f.name("role"), format!("`{}`: unknown role `{role}`", f.name("role"))));
            }
            let content = content_text(f.get("content"), &f.name("content"), &TEXT_PARTS)?;
            if role == "assistant" {
                assistant_turn(input, 2).content = content;
            } else {
                input.push(ChatMessage::new(role, content));
            }
        }
        "reasoning" => {
            let mut text = content_text(f.get("content"), &f.name("content"), &["reasoning_text", "text"])?;
            if text.is_empty() {
                text = content_text(f.get("summary"), &f.name("summary"), &["summary_text", "text"])?;
            }
            assistant_turn(input, 1).reasoning = Some(text);
        }
        "function_call" => {
            let call = ToolCall {
                id: required("call_id")?.to_string(),
                name: required("name")?.to_string(),
                arguments: f.str("arguments")?.unwrap_or_default().to_string(),
            };
            assistant_turn(input, 3).tool_calls.push(call);
        }
        "function_call_output" => {
            let call_id = required("call_id")?;
            let output = match f.get("output") {
                Some(Value::String(s)) => s.clone(),
                other => content_text(other, &f.name("output"), &TEXT_PARTS)?,
            };
            input.push(ChatMessage::tool_result(call_id, &output).with_name(tool_turn_name(call_id)));
        }
        other => {
            return Err(ApiError::field(
                f.name("type"),
                format!("`{}`: input item type `{other}` is not supported", f.name("type")),
            ))
        }
    }
    Ok(())
}

/// One output item.
#[derive(Clone, Debug)]
enum Item {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call { id: String, call_id: String, name: String, arguments: String },
}

impl Item {
    fn json(&self, status: &str) -> Value {
        match self {
            Item::Reasoning { id, text } => json!({"type": "reasoning", "id": id, "status": status, "summary": [],
                                                   "content": [{"type": "reasoning_text", "text": text}]}),
            Item::Message { id, text } => json!({"type": "message", "id": id, "status": status, "role": "assistant",
                                                 "content": [{"type": "output_text", "text": text, "annotations": []}]}),
            Item::Call { id, call_id, name, arguments } => json!({"type": "function_call", "id": id,
                "call_id": call_id, "name": name, "arguments": arguments, "status": status}),
        }
    }

    /// The item as `response.output_item.added` shows it (nothing streamed yet).
    fn opened(&self) -> Value {
        match self {
            Item::Reasoning { id, .. } => {
                json!({"type": "reasoning", "id": id, "status": "in_progress", "summary": [], "content": []})
            }
            Item::Message { id, .. } => {
                json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant",
                                               "content": []})
            }
            Item::Call { id, call_id, name, .. } => json!({"type": "function_call", "id": id, "call_id": call_id,
                "name": name, "arguments": "", "status": "in_progress"}),
        }
    }
}

/// A response's output items as they stream (see the module docs). Events are returned without a
/// `sequence_number` (the stream numbers them).
#[derive(Clone, Debug)]
pub struct OutputItems {
    items: Vec<Item>,
    /// The message item's id (the response header's `item_id`).
    message_id: String,
    /// Whether the last item is still open.
    open: bool,
}

impl OutputItems {
    pub fn new(message_id: String) -> Self {
        OutputItems { items: Vec::new(), message_id, open: false }
    }

    /// The events of one step's pieces: reasoning, then text (with the step's log-probabilities, which only a text
    /// delta carries), then call deltas.
    pub fn push(
        &mut self,
        reasoning: &str,
        text: &str,
        logprobs: Option<Value>,
        calls: &[ToolCallDelta],
    ) -> Vec<Value> {
        let mut events = Vec::new();
        if !reasoning.is_empty() {
            self.ensure(
                &mut events,
                |i| matches!(i, Item::Reasoning { .. }),
                || Item::Reasoning { id: new_id("rs_"), text: String::new() },
            );
            let index = self.items.len() - 1;
            if let Some(Item::Reasoning { id, text: all }) = self.items.last_mut() {
                all.push_str(reasoning);
                events.push(json!({"type": "response.reasoning_text.delta", "item_id": id, "output_index": index,
                                   "content_index": 0, "delta": reasoning}));
            }
        }
        if !text.is_empty() {
            self.open_message(&mut events);
            let index = self.items.len() - 1;
            if let Some(Item::Message { id, text: all }) = self.items.last_mut() {
                all.push_str(text);
                let mut e = json!({"type": "response.output_text.delta", "item_id": id, "output_index": index,
                                   "content_index": 0, "delta": text});
                if let Some(lp) = logprobs {
                    e["logprobs"] = lp["content"].clone();
                }
                events.push(e);
            }
        }
        for c in calls {
            if let (Some(call_id), Some(name)) = (&c.id, &c.name) {
                self.close(&mut events);
                self.items.push(Item::Call {
                    id: new_id("fc_"),
                    call_id: call_id.clone(),
                    name: name.clone(),
                    arguments: String::new(),
                });
                self.open = true;
                let item = self.items.last().expect("just pushed").opened();
                events.push(json!({"type": "response.output_item.added", "output_index": self.items.len() - 1,
                                   "item": item}));
            }
            let index = self.items.len().saturating_sub(1);
            if let (true, Some(Item::Call { id, arguments, .. })) = (self.open, self.items.last_mut()) {
                if !c.arguments.is_empty() {
                    arguments.push_str(&c.arguments);
                    events.push(json!({"type": "response.function_call_arguments.delta", "item_id": id,
                                       "output_index": index, "delta": c.arguments}));
                }
            }
        }
        events
    }

    /// Closes the open item; a reply without calls gets its message item (empty if it had no text).
    pub fn finish(&mut self) -> Vec<Value> {
        let mut events = Vec::new();
        let has_calls = self.items.iter().any(|i| matches!(i, Item::Call { .. }));
        let has_message = self.items.iter().any(|i| matches!(i, Item::Message { .. }));
        if !has_calls && !has_message {
            self.open_message(&mut events);
        }
        self.close(&mut events);
        events
    }

    /// The `output` array: every item, `completed` once closed.
    pub fn json(&self) -> Value {
        let last = self.items.len().saturating_sub(1);
        self.items
            .iter()
            .enumerate()
            .map(|(i, item)| item.json(if self.open && i == last { "in_progress" } else { "completed" }))
            .collect()
    }

    /// The message's text (what `output_text` holds).
    pub fn text(&self) -> String {
        self.items
            .iter()
            .filter_map(|i| match i {
                Item::Message { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }

    /// Makes the last item an open one that `is_kind` accepts, opening `make()` after closing another.
    fn ensure(&mut self, events: &mut Vec<Value>, is_kind: impl Fn(&Item) -> bool, make: impl FnOnce() -> Item) {
        if self.open && self.items.last().is_some_and(&is_kind) {
            return;
        }
        self.close(events);
        self.items.push(make());
        self.open = true;
        let item = self.items.last().expect("just pushed").opened();
        events.push(json!({"type": "response.output_item.added", "output_index": self.items.len() - 1, "item": item}));
    }

    fn open_message(&mut self, events: &mut Vec<Value>) {
        let id = self.message_id.clone();
        let was_open = self.open && matches!(self.items.last(), Some(Item::Message { .. }));
        self.ensure(events, |i| matches!(i, Item::Message { .. }), || Item::Message { id, text: String::new() });
        if !was_open {
            events.push(json!({"type": "response.content_part.added", "item_id": self.message_id,
                               "output_index": self.items.len() - 1, "content_index": 0,
                               "part": {"type": "output_text", "text": "", "annotations": []}}));
        }
    }

    /// Closes the open item with its `…done` events.
    fn close(&mut self, events: &mut Vec<Value>) {
        if !self.open {
            return;
        }
        self.open = false;
        let index = self.items.len() - 1;
        let item = &self.items[index];
        match item {
            Item::Reasoning { id, text } => events.push(json!({"type": "response.reasoning_text.done", "item_id": id,
                "output_index": index, "content_index": 0, "text": text})),
            Item::Message { id, text } => {
                events.push(json!({"type": "response.output_text.done", "item_id": id, "output_index": index,
                                   "content_index": 0, "text": text}));
                events.push(json!({"type": "response.content_part.done", "item_id": id, "output_index": index,
                                   "content_index": 0,
                                   "part": {"type": "output_text", "text": text, "annotations": []}}));
            }
            Item::Call { id, arguments, .. } => events.push(json!({"type": "response.function_call_arguments.done",
                "item_id": id, "output_index": index, "arguments": arguments})),
        }
        events.push(json!({"type": "response.output_item.done", "output_index": index,
                           "item": item.json("completed")}));
    }
}

#[cfg(test)]
mod tests {
    use sparkd_tokenizer::call_name;

    use super::*;

    fn request(body: &Value) -> Result<ValidResponsesRequest, ApiError> {
        responses_request(body, &RequestLimits::for_context(1 << 17))
    }

    fn param_of(e: ApiError) -> String {
        e.param().unwrap_or_default().to_string()
    }

    fn types(events: &[Value]) -> Vec<String> {
        events.iter().map(|e| e["type"].as_str().unwrap().to_string()).collect()
    }

    #[test]
    fn a_resent_history_of_items_merges_each_assistant_turn() {
        let r = request(&json!({"input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "use the tool"}], "summary": []},
            {"type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather",
             "arguments": "{\"city\":\"Oslo\"}"},
            {"type": "function_call", "call_id": "functions.get_weather:1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "functions.get_weather:0", "output": "snow"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "It snows."}]},
            {"role": "assistant", "content": "Anything else?"}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}))
        .unwrap();
        let m = &r.input;
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(
            (m[1].reasoning.as_deref(), m[1].content.as_str(), m[1].tool_calls.len()),
            (Some("use the tool"), "", 2)
        );
        assert_eq!(
            m[2],
            ChatMessage::tool_result("functions.get_weather:0", "snow").with_name(Some("get_weather".into()))
        );
        assert_eq!((m[3].content.as_str(), m[4].content.as_str()), ("It snows.", "Anything else?"));
        assert_eq!(r.tools.unwrap().names, vec!["get_weather".to_string()]);
        let err = request(&json!({"input": [{"type": "function_call", "name": "f"}]})).unwrap_err();
        assert_eq!(err.param(), Some("input[0].call_id"));
    }

    #[test]
    fn responses_requests_take_items_tool_outputs_and_stream_ids() {
        let r = request(&json!({
            "type": "response.create", "stream_id": 3,
            "response": {"instructions": "sys", "previous_response_id": "resp_1", "max_output_tokens": 5, "store": false,
                         "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
                                   {"type": "function_call_output", "call_id": "c", "output": "o"}]}
        }))
        .unwrap();
        assert_eq!(
            r.input,
            vec![ChatMessage::new("system", "sys"), ChatMessage::new("user", "q"), ChatMessage::tool_result("c", "o")]
        );
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(r.params.max_tokens, Some(5));
        assert!(!r.store);
        assert_eq!(r.stream_id.as_deref(), Some("3"));
        let r = request(&json!({"input": "hello"})).unwrap();
        assert!(r.store);
        assert_eq!(
            param_of(request(&json!({"input": [{"type": "image_generation_call"}]})).unwrap_err()),
            "input[0].type"
        );
    }

    #[test]
    fn plain_replies_stream_their_message_as_before() {
        let mut out = OutputItems::new("msg_1".into());
        let mut events = out.push("", "Hel", None, &[]);
        events.extend(out.push("", "lo", None, &[]));
        events.extend(out.finish());
        assert_eq!(
            types(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done"
            ]
        );
        assert_eq!(out.text(), "Hello");
        assert_eq!(out.json()[0]["content"][0]["text"], "Hello");
        // An empty reply still has its (empty) message.
        let mut empty = OutputItems::new("msg_2".into());
        assert_eq!(types(&empty.finish()).len(), 5);
        assert_eq!(empty.json()[0]["type"], "message");
    }

    #[test]
    fn reasoning_text_and_calls_become_items_in_reply_order() {
        let mut out = OutputItems::new("msg_1".into());
        let call = |index, id: Option<&str>, args: &str| ToolCallDelta {
            index,
            id: id.map(str::to_owned),
            name: id.map(|i| call_name(i).to_owned()),
            arguments: args.into(),
        };
        let mut events = out.push("think", "Checking.", None, &[call(0, Some("functions.f:0"), "{\"a\"")]);
        events.extend(out.push("", "", None, &[call(0, None, ":1}"), call(1, Some("functions.g:1"), "{}")]));
        events.extend(out.finish());
        assert_eq!(
            types(&events),
            [
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done"
            ]
        );
        let items = out.json();
        assert_eq!(items.as_array().unwrap().len(), 4);
        assert_eq!(
            (items[0]["type"].as_str(), items[0]["content"][0]["text"].as_str()),
            (Some("reasoning"), Some("think"))
        );
        assert_eq!(items[2]["arguments"], "{\"a\":1}");
        assert_eq!((items[3]["call_id"].as_str(), items[3]["name"].as_str()), (Some("functions.g:1"), Some("g")));
        assert!(items.as_array().unwrap().iter().all(|i| i["status"] == "completed"));
        // Every event names its item's place in the output.
        assert_eq!(events[11]["output_index"], 2);
    }
}
