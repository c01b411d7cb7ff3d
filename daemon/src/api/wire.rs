//! OpenAI wire format, response side: the JSON of chat/completion chunks and bodies, usage, log-probabilities,
//! and Responses API objects and events.
//!
//! Invariants:
//! - Shapes follow OpenAI (and vLLM where OpenAI is silent): `usage.prompt_tokens_details.cached_tokens`,
//!   chat logprobs `{"content": [{token, logprob, bytes, top_logprobs}]}`, legacy completion logprobs
//!   `{tokens, token_logprobs, top_logprobs, text_offset}`, Responses usage `{input_tokens,
//!   input_tokens_details.cached_tokens, output_tokens, total_tokens}`.
//! - Per-token chunks are serde structs over borrowed data (the hot path); rare frames use `json!`.
//! - The final frame of every response carries `timings` (aesthetics.md §6 rule 7), and
//!   `metrics.speculative_decoding` when drafts were verified (agentx.md §2.4).

use serde::Serialize;
use serde_json::{json, Map, Value};
use sparkd_kernels::runner::TokenLogprob;
use sparkd_kernels::TokenId;
use sparkd_tokenizer::{Tokenizer, ToolCall};

use super::generate::{Outcome, SpecDecodeStats, Timings};
use super::reply::ToolCallDelta;
use crate::engine::types::Usage;

/// `usage` of chat and completions.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct UsageJson {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: CachedTokens,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct CachedTokens {
    pub cached_tokens: usize,
}

impl UsageJson {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        UsageJson {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: CachedTokens { cached_tokens },
        }
    }

    pub fn from_usage(u: &Usage) -> Self {
        Self::new(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    }
}

/// `metrics` on a final frame.
#[derive(Clone, Debug, Serialize)]
pub struct MetricsJson<'a> {
    pub speculative_decoding: &'a SpecDecodeStats,
}

/// A token's text for logprobs: its bytes as lossy UTF-8, or a special token's name.
pub fn token_text(tokenizer: &Tokenizer, id: TokenId) -> (String, Vec<u8>) {
    if let Some(name) = tokenizer.special_name(id) {
        return (name.to_string(), name.as_bytes().to_vec());
    }
    let bytes = tokenizer.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat-format logprobs: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
pub fn chat_logprobs(tokenizer: &Tokenizer, logprobs: &[TokenLogprob]) -> Value {
    let entry = |id: TokenId, lp: f32| {
        let (token, bytes) = token_text(tokenizer, id);
        json!({"token": token, "logprob": lp, "bytes": bytes})
    };
    let content: Vec<Value> = logprobs
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = Value::Array(l.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
            e
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completions logprobs: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`;
/// `offset` is the text length before the first token.
pub fn completion_logprobs(tokenizer: &Tokenizer, logprobs: &[TokenLogprob], mut offset: usize) -> Value {
    let mut tokens = Vec::with_capacity(logprobs.len());
    let mut token_logprobs = Vec::with_capacity(logprobs.len());
    let mut tops = Vec::with_capacity(logprobs.len());
    let mut offsets = Vec::with_capacity(logprobs.len());
    for l in logprobs {
        let (text, _) = token_text(tokenizer, l.token);
        offsets.push(offset);
        offset += text.len();
        tokens.push(text);
        token_logprobs.push(l.logprob);
        let mut top = Map::new();
        for &(id, lp) in &l.top {
            top.insert(token_text(tokenizer, id).0, json!(lp));
        }
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets})
}

/// The header fields every chat/completion chunk repeats.
#[derive(Clone, Copy, Debug)]
pub struct ChunkHeader<'a> {
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
}

/// One streamed chunk of a chat (`C` = [`ChatChunkChoice`]) or text completion (`C` = [`CompletionChunkChoice`]).
#[derive(Serialize)]
struct StreamChunk<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timings: Option<&'a Timings>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics: Option<MetricsJson<'a>>,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: ChatDelta<'a>,
    logprobs: Option<Value>,
    finish_reason: Option<&'a str>,
}

#[derive(Serialize)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<Value>>,
}

/// A streamed tool-call delta in OpenAI's form: the header (`id`, `type`, `function.name`, empty `arguments`)
/// once, then `function.arguments` fragments, each with the call's `index`.
fn tool_call_delta(c: &ToolCallDelta) -> Value {
    match (&c.id, &c.name) {
        (Some(id), Some(name)) => json!({"index": c.index, "id": id, "type": "function",
                                         "function": {"name": name, "arguments": c.arguments}}),
        _ => json!({"index": c.index, "function": {"arguments": c.arguments}}),
    }
}

/// A finished reply's tool calls in OpenAI's `message.tool_calls` form.
pub fn tool_calls_json(calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect()
}

#[derive(Serialize)]
struct CompletionChunkChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<Value>,
    finish_reason: Option<&'a str>,
}

/// Which endpoint's chunk shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkKind {
    Chat,
    Completion,
}

/// One streamed chunk. `choice` is `None` for the trailing usage-only chunk (`choices: []`).
pub struct Chunk<'a> {
    pub header: ChunkHeader<'a>,
    pub choice: Option<ChunkChoice<'a>>,
    pub usage: Option<UsageJson>,
    pub timings: Option<&'a Timings>,
    pub spec: Option<&'a SpecDecodeStats>,
}

/// The choice of a streamed chunk.
pub struct ChunkChoice<'a> {
    /// The chat role, on the first chunk only.
    pub role: Option<&'static str>,
    pub text: &'a str,
    /// Chat only: thinking and tool-call deltas.
    pub reasoning: &'a str,
    pub tool_calls: &'a [ToolCallDelta],
    pub logprobs: Option<Value>,
    pub finish_reason: Option<&'a str>,
}

/// Serializes a chunk into `out` (JSON only, no SSE framing).
pub fn write_chunk(out: &mut Vec<u8>, kind: ChunkKind, c: Chunk<'_>) -> serde_json::Result<()> {
    let metrics = c.spec.map(|s| MetricsJson { speculative_decoding: s });
    match kind {
        ChunkKind::Chat => {
            let choices = c
                .choice
                .map(|ch| ChatChunkChoice {
                    index: 0,
                    delta: ChatDelta {
                        role: ch.role,
                        content: Some(ch.text).filter(|t| !t.is_empty() || ch.role.is_some()),
                        reasoning_content: Some(ch.reasoning).filter(|r| !r.is_empty()),
                        tool_calls: (!ch.tool_calls.is_empty())
                            .then(|| ch.tool_calls.iter().map(tool_call_delta).collect()),
                    },
                    logprobs: ch.logprobs,
                    finish_reason: ch.finish_reason,
                })
                .into_iter()
                .collect();
            let chunk = StreamChunk {
                id: c.header.id,
                object: "chat.completion.chunk",
                created: c.header.created,
                model: c.header.model,
                choices,
                usage: c.usage,
                timings: c.timings,
                metrics,
            };
            serde_json::to_writer(out, &chunk)
        }
        ChunkKind::Completion => {
            let choices = c
                .choice
                .map(|ch| CompletionChunkChoice {
                    index: 0,
                    text: ch.text,
                    logprobs: ch.logprobs,
                    finish_reason: ch.finish_reason,
                })
                .into_iter()
                .collect();
            let chunk = StreamChunk {
                id: c.header.id,
                object: "text_completion",
                created: c.header.created,
                model: c.header.model,
                choices,
                usage: c.usage,
                timings: c.timings,
                metrics,
            };
            serde_json::to_writer(out, &chunk)
        }
    }
}

/// A whole reply: its text (a chat reply's content), and a chat reply's reasoning and tool calls.
#[derive(Clone, Debug, Default)]
pub struct FullReply {
    pub text: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

impl FullReply {
    /// Adds a step's pieces (tool-call deltas assembled into calls).
    pub fn push(&mut self, text: &str, reasoning: &str, calls: &[ToolCallDelta]) {
        self.text.push_str(text);
        self.reasoning.push_str(reasoning);
        for c in calls {
            match (&c.id, &c.name) {
                (Some(id), Some(name)) => self.tool_calls.push(ToolCall {
                    id: id.clone(),
                    name: name.clone(),
                    arguments: c.arguments.clone(),
                }),
                _ => {
                    if let Some(last) = self.tool_calls.last_mut() {
                        last.arguments.push_str(&c.arguments);
                    }
                }
            }
        }
    }
}

/// A whole (non-streamed) chat or completion body. A chat message's `content` is null when it only calls tools;
/// `reasoning_content` and `tool_calls` appear when there are any.
pub fn full_body(
    kind: ChunkKind,
    header: ChunkHeader<'_>,
    reply: &FullReply,
    logprobs: Option<Value>,
    outcome: &Outcome,
) -> Value {
    let (object, choice) = match kind {
        ChunkKind::Chat => {
            let content =
                if reply.text.is_empty() && !reply.tool_calls.is_empty() { Value::Null } else { json!(reply.text) };
            let mut message = json!({"role": "assistant", "content": content});
            if !reply.reasoning.is_empty() {
                message["reasoning_content"] = json!(reply.reasoning);
            }
            if !reply.tool_calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&reply.tool_calls);
            }
            (
                "chat.completion",
                json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": outcome.finish_reason}),
            )
        }
        ChunkKind::Completion => (
            "text_completion",
            json!({"index": 0, "text": reply.text, "logprobs": logprobs, "finish_reason": outcome.finish_reason}),
        ),
    };
    let mut body = json!({
        "id": header.id, "object": object, "created": header.created, "model": header.model,
        "choices": [choice],
        "usage": UsageJson::from_usage(&outcome.usage),
        "timings": outcome.timings,
    });
    if let Some(spec) = &outcome.spec {
        body["metrics"] = json!({ "speculative_decoding": spec });
    }
    body
}

// ---- Responses API ----

/// Responses `usage`.
pub fn responses_usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The identity of one Responses API response.
#[derive(Clone, Debug)]
pub struct ResponseHeader {
    pub id: String,
    /// Id of the one output message item.
    pub item_id: String,
    pub created_at: u64,
    pub model: String,
    pub previous_response_id: Option<String>,
    pub max_output_tokens: Option<usize>,
    pub store: bool,
    /// Whose response it is (not part of the object): where it is kept.
    pub owner: super::auth::Owner,
    /// The conversation's affinity key (the object's `session`, and the `x-sparkd-session` header).
    pub session: super::affinity::SessionKey,
}

/// A Responses API `response` object. `status`: in_progress, completed, incomplete, failed; `output`: its
/// output items (`items::OutputItems::json`).
pub fn response_object(h: &ResponseHeader, status: &str, output: Value, outcome: Option<&Outcome>) -> Value {
    let incomplete_details = match outcome.map(|o| o.finish_reason) {
        Some("length") => json!({"reason": "max_output_tokens"}),
        Some("abort") => json!({"reason": "cancelled"}),
        _ => Value::Null,
    };
    let mut r = json!({
        "id": h.id, "object": "response", "created_at": h.created_at, "status": status, "model": h.model,
        "output": output, "previous_response_id": h.previous_response_id, "max_output_tokens": h.max_output_tokens,
        "store": h.store, "incomplete_details": incomplete_details, "error": Value::Null,
        "session": h.session.as_str(),
        "usage": outcome.map_or(Value::Null, |o| responses_usage(&o.usage)),
    });
    if let Some(o) = outcome {
        r["timings"] = json!(o.timings);
        if let Some(spec) = &o.spec {
            r["metrics"] = json!({ "speculative_decoding": spec });
        }
    }
    r
}

/// Status and terminal event type for an outcome: `completed` (a stop or tool calls), or `incomplete` (length
/// or cancel).
pub fn terminal_status(outcome: &Outcome) -> (&'static str, &'static str) {
    match outcome.finish_reason {
        "stop" | "tool_calls" => ("completed", "response.completed"),
        _ => ("incomplete", "response.incomplete"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(reason: &'static str) -> Outcome {
        Outcome { finish_reason: reason, usage: Usage::default(), timings: Timings::default(), spec: None }
    }

    const HEADER: ChunkHeader<'static> = ChunkHeader { id: "chatcmpl-1", created: 1, model: "m" };

    #[test]
    fn a_reply_that_calls_tools_has_null_content_its_reasoning_and_its_calls() {
        let mut reply = FullReply::default();
        let begin = |index, id: &str, name: &str, args: &str| ToolCallDelta {
            index,
            id: Some(id.into()),
            name: Some(name.into()),
            arguments: args.into(),
        };
        let more = |index, args: &str| ToolCallDelta { index, id: None, name: None, arguments: args.into() };
        reply.push("", "think", &[begin(0, "functions.f:0", "f", "{\"a\"")]);
        reply.push("", "", &[more(0, ":1}"), begin(1, "functions.g:1", "g", "{}")]);
        let body = full_body(ChunkKind::Chat, HEADER, &reply, None, &outcome("tool_calls"));
        let message = &body["choices"][0]["message"];
        assert_eq!(message["content"], Value::Null);
        assert_eq!(message["reasoning_content"], "think");
        assert_eq!(
            message["tool_calls"],
            json!([{"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
                   {"id": "functions.g:1", "type": "function", "function": {"name": "g", "arguments": "{}"}}])
        );
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
        // A plain reply keeps its content and has neither field.
        let plain = FullReply { text: "hi".into(), ..FullReply::default() };
        let body = full_body(ChunkKind::Chat, HEADER, &plain, None, &outcome("stop"));
        assert_eq!(body["choices"][0]["message"], json!({"role": "assistant", "content": "hi"}));
    }

    #[test]
    fn streamed_tool_calls_send_the_header_once_then_argument_fragments() {
        let calls = [
            ToolCallDelta {
                index: 0,
                id: Some("functions.f:0".into()),
                name: Some("f".into()),
                arguments: String::new(),
            },
            ToolCallDelta { index: 0, id: None, name: None, arguments: "{\"a\":".into() },
        ];
        let choice = ChunkChoice {
            role: None,
            text: "",
            reasoning: "hmm",
            tool_calls: &calls,
            logprobs: None,
            finish_reason: None,
        };
        let mut out = Vec::new();
        let chunk = Chunk { header: HEADER, choice: Some(choice), usage: None, timings: None, spec: None };
        write_chunk(&mut out, ChunkKind::Chat, chunk).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        let delta = &v["choices"][0]["delta"];
        assert!(delta.get("content").is_none(), "{delta}");
        assert_eq!(delta["reasoning_content"], "hmm");
        assert_eq!(
            delta["tool_calls"],
            json!([{"index": 0, "id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": ""}},
                   {"index": 0, "function": {"arguments": "{\"a\":"}}])
        );
    }
}
