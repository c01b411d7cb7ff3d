//! OpenAI wire format, requests side: parsing and validating `/v1/chat/completions`, `/v1/completions` and
//! `/v1/responses` bodies into [`ValidRequest`]s.
//!
//! Invariants:
//! - Parsing goes through [`Fields`], which names the offending field in every error (`messages[2].content`,
//!   `temperature`), so a bad request is a 400 that says what is wrong, never a panic or a serde position.
//! - Unknown fields are ignored (clients such as AIPerf send vendor fields through `--extra-inputs`).
//! - A [`ValidRequest`] holds everything the generation needs and nothing that still has to be checked,
//!   except the context length, which needs the prompt's tokens ([`check_context`]).

use serde_json::{Map, Value};
use sparkd_grammar::ConstraintSpec;
use sparkd_kernels::runner::SamplingParams;
use sparkd_kernels::TokenId;
use sparkd_tokenizer::ChatMessage;

use super::constraint;
use super::error::ApiError;
use super::limits::{chat_chars, RequestLimits};
use super::tools::{self, Tools};

/// Output tokens when the request names no limit (also capped by the context left).
pub const DEFAULT_MAX_TOKENS: usize = 4096;
/// Largest accepted `speculation.num_tokens` (the engine caps it further by `--num-spec-tokens`).
pub const MAX_SPEC_TOKENS_FIELD: usize = 1024;

/// What a request wants back besides text, and how to finish.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationParams {
    pub sampling: SamplingParams,
    /// `max_tokens` / `max_completion_tokens` / `max_output_tokens`; `None`: [`DEFAULT_MAX_TOKENS`] or the context
    /// left, whichever is smaller.
    pub max_tokens: Option<usize>,
    pub ignore_eos: bool,
    /// Extra token ids that end the request (vLLM's `stop_token_ids`), besides the tokenizer's end-of-turn ids.
    pub stop_token_ids: Vec<TokenId>,
    /// Stop strings, checked on the detokenized text; the returned text ends before the first one.
    pub stop: Vec<String>,
    /// Log-probabilities of each output token, with this many alternatives.
    pub logprobs: Option<usize>,
    /// `speculation.num_tokens` (a sparkd field): at most this many draft tokens verified per step for this
    /// request, capped by the server's `--num-spec-tokens`; 0 turns speculation off for the request.
    pub num_spec_tokens: Option<usize>,
}

/// How the client wants the result delivered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamOptions {
    pub stream: bool,
    /// `stream_options.include_usage`: a final chunk with `choices: []` and `usage`.
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats`: cumulative `usage` on every chunk.
    pub continuous_usage: bool,
}

/// The prompt, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Chat messages, rendered with the chat template after the tools' declaration (compact JSON), if any, with
    /// thinking on or off ([`thinking`]).
    Chat { messages: Vec<ChatMessage>, tools: Option<String>, thinking: bool },
    /// Raw text (`/v1/completions`), encoded without special tokens.
    Text(String),
    /// Token ids as given (`/v1/completions`).
    Tokens(Vec<TokenId>),
}

/// A validated chat or completion request.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidRequest {
    /// The model the client named, if it named one (checked against the served one before any work).
    pub model: Option<String>,
    pub prompt: Prompt,
    /// Chat only: the declared tools (`None`: none declared).
    pub tools: Option<Tools>,
    /// Chat only: the output constraint and the field that asked for it.
    pub constraint: Option<(String, ConstraintSpec)>,
    pub params: GenerationParams,
    pub stream: StreamOptions,
    /// `echo` (`/v1/completions` only): return the prompt text before the completion.
    pub echo: bool,
}

/// A validated `/v1/responses` request (HTTP body or WebSocket `response.create`).
#[derive(Clone, Debug, PartialEq)]
pub struct ValidResponsesRequest {
    /// The model the client named, if it named one (checked against the served one before any work).
    pub model: Option<String>,
    /// The new input: messages and tool outputs, with `instructions` first as a system message.
    pub input: Vec<ChatMessage>,
    pub previous_response_id: Option<String>,
    /// Keep the final state so a later request can continue it (OpenAI's default is true).
    pub store: bool,
    pub params: GenerationParams,
    pub stream: bool,
    /// WebSocket multiplexing tag, echoed on every server event of this stream.
    pub stream_id: Option<String>,
    /// The declared tools (`None`: none declared).
    pub tools: Option<Tools>,
    /// The output constraint and the field that asked for it.
    pub constraint: Option<(String, ConstraintSpec)>,
    /// Whether the model thinks ([`thinking`]).
    pub thinking: bool,
}

/// The request's thinking switch, on unless a field turns it off: Moonshot's `thinking: {"type": "enabled" |
/// "disabled"}`, vLLM's and SGLang's `chat_template_kwargs: {"thinking": bool}` (the variable Kimi K2.5's template
/// reads) and, with `responses`, OpenAI's `reasoning: {"effort": "none"}` (other efforts leave it on: the model has
/// no effort levels). Fields that disagree are a 400.
pub fn thinking(f: &Fields<'_>, responses: bool) -> Result<bool, ApiError> {
    let mut said: Vec<(String, bool)> = Vec::new();
    if let Some(t) = f.get("thinking") {
        let t = Fields::new(t, &f.name("thinking"))?;
        let on = match t.str("type")? {
            Some("enabled") => true,
            Some("disabled") => false,
            _ => return Err(t.bad("type", "\"enabled\" or \"disabled\"")),
        };
        said.push((f.name("thinking"), on));
    }
    if let Some(kwargs) = f.get("chat_template_kwargs") {
        let k = Fields::new(kwargs, &f.name("chat_template_kwargs"))?;
        if let Some(on) = k.bool("thinking")? {
            said.push((k.name("thinking"), on));
        }
    }
    if let Some(reasoning) = f.get("reasoning").filter(|_| responses) {
        let r = Fields::new(reasoning, &f.name("reasoning"))?;
        if let Some(effort) = r.str("effort")? {
            said.push((r.name("effort"), effort != "none"));
        }
    }
    match said.split_first() {
        None => Ok(true),
        Some(((first, on), rest)) => match rest.iter().find(|(_, other)| other != on) {
            Some((other, _)) => Err(ApiError::field(
                other.clone(),
                format!("`{other}` and `{first}` disagree on whether the model thinks"),
            )),
            None => Ok(*on),
        },
    }
}

/// Typed access to a JSON object's fields; every error names the field (prefixed with `path`).
pub struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: String,
}

impl<'a> Fields<'a> {
    /// Views `value` as an object; `path` names it in errors ("" for the body).
    pub fn new(value: &'a Value, path: &str) -> Result<Self, ApiError> {
        match value.as_object() {
            Some(map) => Ok(Fields { map, path: path.to_string() }),
            None if path.is_empty() => Err(ApiError::InvalidJson("the body must be a JSON object".into())),
            None => Err(ApiError::field(path, format!("`{path}` must be an object"))),
        }
    }

    /// The full name of a field, for errors.
    pub fn name(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The raw value, `None` when absent or null.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn bad(&self, key: &str, what: &str) -> ApiError {
        let name = self.name(key);
        ApiError::field(name.clone(), format!("`{name}` must be {what}"))
    }

    pub fn str(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        self.get(key).map(|v| v.as_str().ok_or_else(|| self.bad(key, "a string"))).transpose()
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        self.get(key).map(|v| v.as_bool().ok_or_else(|| self.bad(key, "true or false"))).transpose()
    }

    /// A number within `[lo, hi]`.
    pub fn f64_in(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(key) else { return Ok(None) };
        match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(self.bad(key, &format!("a number between {lo} and {hi}, got {v}"))),
        }
    }

    /// A non-negative integer within `[lo, hi]`.
    pub fn usize_in(&self, key: &str, lo: usize, hi: usize) -> Result<Option<usize>, ApiError> {
        let Some(v) = self.get(key) else { return Ok(None) };
        match v.as_u64().and_then(|x| usize::try_from(x).ok()) {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(self.bad(key, &format!("an integer between {lo} and {hi}, got {v}"))),
        }
    }

    /// Any 64-bit integer seed (negative seeds are reinterpreted, as Python clients send them).
    pub fn seed(&self, key: &str) -> Result<Option<u64>, ApiError> {
        let Some(v) = self.get(key) else { return Ok(None) };
        v.as_u64().or_else(|| v.as_i64().map(|x| x as u64)).map(Some).ok_or_else(|| self.bad(key, "an integer"))
    }
}

/// Parses a request body as a JSON value.
pub fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::InvalidJson(e.to_string()))
}

/// The sampling and stopping fields shared by every endpoint. `max_keys` are the accepted names of the output
/// limit, in priority order; `legacy_logprobs` selects `/v1/completions`' integer `logprobs`.
pub(super) fn generation_params(
    f: &Fields,
    max_keys: &[&str],
    legacy_logprobs: bool,
    limits: &RequestLimits,
) -> Result<GenerationParams, ApiError> {
    if let Some(n) = f.usize_in("n", 0, usize::MAX)? {
        if n != 1 {
            return Err(ApiError::field("n", format!("`n` must be 1 (one choice per request), got {n}")));
        }
    }
    let temperature = f.f64_in("temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32;
    let top_p = f.f64_in("top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32;
    if top_p <= 0.0 {
        return Err(ApiError::field("top_p", "`top_p` must be greater than 0"));
    }
    let top_k = match f.get("top_k") {
        Some(v) if v.as_i64() == Some(-1) => 0,
        _ => f.usize_in("top_k", 0, 1 << 20)?.unwrap_or(0),
    };
    let seed = f.seed("seed")?.unwrap_or_else(rand_seed);

    let mut max_tokens = None;
    for key in max_keys {
        if let Some(n) = f.usize_in(key, 1, 1 << 24)? {
            max_tokens.get_or_insert(n);
        }
    }

    let logprobs_field = |key: &str| -> Result<Option<usize>, ApiError> {
        let n = f.usize_in(key, 0, usize::MAX)?;
        n.map(|n| limits.check_logprobs(&f.name(key), n).map(|()| n)).transpose()
    };
    let logprobs = if legacy_logprobs {
        logprobs_field("logprobs")?
    } else {
        let top = logprobs_field("top_logprobs")?;
        match f.bool("logprobs")? {
            Some(true) => Some(top.unwrap_or(0)),
            _ if top.is_some_and(|t| t > 0) => {
                return Err(ApiError::field("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
            }
            _ => None,
        }
    };

    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| ApiError::field(format!("stop[{i}]"), format!("`stop[{i}]` must be a string")))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::field("stop", "`stop` must be a string or an array of strings")),
    };
    limits.check_stop(&stop)?;
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::field("stop", "`stop` strings must not be empty"));
    }

    let stop_token_ids = match f.get("stop_token_ids") {
        None => Vec::new(),
        Some(v) => token_array(v, "stop_token_ids")?,
    };

    let num_spec_tokens = match f.get("speculation") {
        None => None,
        Some(v) => Fields::new(v, &f.name("speculation"))?.usize_in("num_tokens", 0, MAX_SPEC_TOKENS_FIELD)?,
    };

    Ok(GenerationParams {
        sampling: SamplingParams { temperature, top_p, top_k, seed, logprobs },
        max_tokens,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        stop_token_ids,
        stop,
        logprobs,
        num_spec_tokens,
    })
}

/// A seed for requests that name none: different per request, so sampled requests differ.
fn rand_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
}

pub(super) fn token_array(v: &Value, name: &str) -> Result<Vec<TokenId>, ApiError> {
    let items = v.as_array().ok_or_else(|| ApiError::field(name, format!("`{name}` must be an array of token ids")))?;
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64().and_then(|x| TokenId::try_from(x).ok()).ok_or_else(|| {
                ApiError::field(
                    format!("{name}[{i}]"),
                    format!("`{name}[{i}]` must be a token id (a non-negative integer), got {t}"),
                )
            })
        })
        .collect()
}

fn stream_options(f: &Fields) -> Result<StreamOptions, ApiError> {
    let stream = f.bool("stream")?.unwrap_or(false);
    let (include_usage, continuous_usage) = match f.get("stream_options") {
        None => (false, false),
        Some(v) => {
            let o = Fields::new(v, "stream_options")?;
            (o.bool("include_usage")?.unwrap_or(false), o.bool("continuous_usage_stats")?.unwrap_or(false))
        }
    };
    Ok(StreamOptions { stream, include_usage, continuous_usage })
}

/// Flattens OpenAI message content (a string, or an array of text parts) to one string.
pub(super) fn content_text(v: Option<&Value>, name: &str, part_types: &[&str]) -> Result<String, ApiError> {
    match v {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let p = Fields::new(part, &format!("{name}[{j}]"))?;
                let ty = p.str("type")?.unwrap_or("text");
                if !part_types.contains(&ty) {
                    return Err(ApiError::field(
                        p.name("type"),
                        format!(
                            "`{}`: part type `{ty}` is not supported (only {})",
                            p.name("type"),
                            part_types.join(", ")
                        ),
                    ));
                }
                text.push_str(
                    p.str("text")?
                        .ok_or_else(|| ApiError::field(p.name("text"), format!("`{}` is required", p.name("text"))))?,
                );
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::field(name, format!("`{name}` must be a string or an array of text parts"))),
    }
}

/// `POST /v1/chat/completions`.
pub fn chat_request(body: &Value, limits: &RequestLimits) -> Result<ValidRequest, ApiError> {
    let f = Fields::new(body, "")?;
    let messages = f
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::field("messages", "`messages` must be a non-empty array"))?;
    if messages.is_empty() {
        return Err(ApiError::field("messages", "`messages` must be a non-empty array"));
    }
    let mut chat = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let path = format!("messages[{i}]");
        let m = Fields::new(m, &path)?;
        let role = m
            .str("role")?
            .ok_or_else(|| ApiError::field(m.name("role"), format!("`{}` is required", m.name("role"))))?;
        if sparkd_tokenizer::ChatRole::parse(role).is_none() {
            return Err(ApiError::field(
                m.name("role"),
                format!(
                    "`{}`: unknown role `{role}` (expected system, developer, user, assistant or tool)",
                    m.name("role")
                ),
            ));
        }
        let content = content_text(m.get("content"), &m.name("content"), &["text", "input_text", "output_text"])?;
        let name = m.str("name")?.map(str::to_owned);
        let message = match (role, m.str("tool_call_id")?) {
            ("tool", Some(call_id)) => {
                let name = name.or_else(|| tools::tool_turn_name(call_id));
                ChatMessage::tool_result(call_id, &content).with_name(name)
            }
            ("assistant", _) => ChatMessage {
                role: role.to_string(),
                content,
                name,
                reasoning: m.str("reasoning_content")?.or(m.str("reasoning")?).map(str::to_owned),
                tool_calls: tools::message_calls(&m)?,
            },
            _ => ChatMessage::new(role, content).with_name(name),
        };
        chat.push(message);
    }
    let tools = tools::parse(&f, false)?;
    let declaration = tools.as_ref().and_then(|t| t.prompt_declaration().map(str::to_owned));
    limits.check_prompt("messages", chat_chars(&chat, declaration.as_deref()))?;
    let constraint = constraint::parse(&f, tools.as_ref(), false)?;
    Ok(ValidRequest {
        model: f.str("model")?.map(str::to_owned),
        prompt: Prompt::Chat { messages: chat, tools: declaration, thinking: thinking(&f, false)? },
        tools,
        constraint,
        params: generation_params(&f, &["max_completion_tokens", "max_tokens"], false, limits)?,
        stream: stream_options(&f)?,
        echo: false,
    })
}

/// `POST /v1/completions`.
pub fn completion_request(body: &Value, limits: &RequestLimits) -> Result<ValidRequest, ApiError> {
    let f = Fields::new(body, "")?;
    let one = |v: &Value| -> Result<Prompt, ApiError> {
        match v {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(items) if items.first().is_some_and(Value::is_number) => {
                Ok(Prompt::Tokens(token_array(v, "prompt")?))
            }
            _ => Err(ApiError::field("prompt", "`prompt` must be a string or an array of token ids")),
        }
    };
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::field("prompt", "`prompt` is required")),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::field("prompt", "`prompt` must not be empty"))
        }
        Some(Value::Array(items)) if items.iter().all(|x| x.is_string() || x.is_array()) => {
            if items.len() != 1 {
                return Err(ApiError::field(
                    "prompt",
                    "`prompt` batches are not supported: send one prompt per request",
                ));
            }
            one(&items[0])?
        }
        Some(v) => one(v)?,
    };
    if let Prompt::Text(text) = &prompt {
        limits.check_prompt("prompt", text.chars().count())?;
    }
    let stream = stream_options(&f)?;
    let echo = f.bool("echo")?.unwrap_or(false);
    if echo && stream.stream {
        return Err(ApiError::field("echo", "`echo` is not supported with `stream`"));
    }
    let params = generation_params(&f, &["max_tokens"], true, limits)?;
    Ok(ValidRequest {
        model: f.str("model")?.map(str::to_owned),
        prompt,
        tools: None,
        constraint: None,
        params,
        stream,
        echo,
    })
}

/// Resolves the output limit and checks prompt + output against the context length.
pub fn check_context(prompt_tokens: usize, max_tokens: Option<usize>, max_model_len: usize) -> Result<usize, ApiError> {
    let left = max_model_len.saturating_sub(prompt_tokens);
    let max_tokens_value = max_tokens.unwrap_or_else(|| DEFAULT_MAX_TOKENS.min(left));
    if prompt_tokens == 0 {
        return Err(ApiError::field("prompt", "the prompt is empty"));
    }
    if left == 0 || max_tokens_value > left {
        return Err(ApiError::ContextLength {
            max_model_len,
            requested: prompt_tokens + max_tokens_value.max(1),
            prompt_tokens,
            max_tokens: max_tokens_value.max(1),
        });
    }
    Ok(max_tokens_value)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chat(body: &Value) -> Result<ValidRequest, ApiError> {
        chat_request(body, &RequestLimits::for_context(1 << 17))
    }

    fn completion(body: &Value) -> Result<ValidRequest, ApiError> {
        completion_request(body, &RequestLimits::for_context(1 << 17))
    }

    fn param_of(e: ApiError) -> String {
        e.param().unwrap_or_default().to_string()
    }

    #[test]
    fn chat_bodies_parse_with_text_parts_and_unknown_fields() {
        let body = json!({
            "model": "m", "stream": true, "stream_options": {"include_usage": true},
            "max_completion_tokens": 7, "ignore_eos": true, "chat_template_kwargs": {"x": 1},
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
                {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}
            ],
            "temperature": 0, "seed": -1, "stop": "\n\n", "logprobs": true, "top_logprobs": 3
        });
        let r = chat(&body).unwrap();
        let Prompt::Chat { messages: msgs, .. } = &r.prompt else { panic!("not chat") };
        assert_eq!(msgs.len(), 5);
        assert_eq!(msgs[1].content, "hello");
        assert_eq!(msgs[4], ChatMessage::tool_result("c1", "42"));
        assert_eq!(r.params.max_tokens, Some(7));
        assert!(r.params.ignore_eos);
        assert_eq!(r.params.stop, vec!["\n\n".to_string()]);
        assert_eq!(r.params.logprobs, Some(3));
        assert_eq!(r.params.sampling.seed, u64::MAX);
        assert_eq!(r.stream, StreamOptions { stream: true, include_usage: true, continuous_usage: false });
    }

    #[test]
    fn thinking_is_on_unless_a_field_turns_it_off_and_disagreeing_fields_are_400s() {
        let with = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "x"}]});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            body
        };
        let on = |body: Value, responses: bool| thinking(&Fields::new(&body, "").unwrap(), responses);
        assert!(on(with(json!({})), false).unwrap());
        assert!(!on(with(json!({"thinking": {"type": "disabled"}})), false).unwrap());
        assert!(on(with(json!({"thinking": {"type": "enabled"}})), false).unwrap());
        assert!(!on(with(json!({"chat_template_kwargs": {"thinking": false}})), false).unwrap());
        assert!(!on(with(json!({"reasoning": {"effort": "none"}})), true).unwrap());
        assert!(on(with(json!({"reasoning": {"effort": "high"}})), true).unwrap());
        assert!(on(with(json!({"reasoning": {"effort": "none"}})), false).unwrap(), "chat has no `reasoning`");
        let both = with(json!({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": false}}));
        assert_eq!(param_of(on(both, false).unwrap_err()), "chat_template_kwargs.thinking");
        assert_eq!(param_of(on(with(json!({"thinking": {"type": "off"}})), false).unwrap_err()), "thinking.type");
        assert_eq!(param_of(on(with(json!({"thinking": false})), false).unwrap_err()), "thinking");
        let r = chat(&with(json!({"thinking": {"type": "disabled"}}))).unwrap();
        assert!(matches!(r.prompt, Prompt::Chat { thinking: false, .. }));
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let r = chat(&json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9})).unwrap();
        assert_eq!(r.params.max_tokens, Some(9));
        let r =
            chat(&json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 3}))
                .unwrap();
        assert_eq!(r.params.max_tokens, Some(3));
    }

    #[test]
    fn bad_fields_are_named() {
        let m = json!([{"role": "user", "content": "x"}]);
        assert_eq!(param_of(chat(&json!({"messages": m, "temperature": 9})).unwrap_err()), "temperature");
        assert_eq!(param_of(chat(&json!({"messages": m, "max_tokens": 0})).unwrap_err()), "max_tokens");
        assert_eq!(param_of(chat(&json!({"messages": m, "max_tokens": "many"})).unwrap_err()), "max_tokens");
        assert_eq!(param_of(chat(&json!({"messages": []})).unwrap_err()), "messages");
        assert_eq!(
            param_of(chat(&json!({"messages": [{"role": "robot", "content": "x"}]})).unwrap_err()),
            "messages[0].role"
        );
        assert_eq!(
            param_of(chat(&json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})).unwrap_err()),
            "messages[0].content[0].type"
        );
        assert_eq!(param_of(chat(&json!({"messages": m, "stop": [1]})).unwrap_err()), "stop[0]");
        assert_eq!(param_of(chat(&json!({"messages": m, "n": 2})).unwrap_err()), "n");
        assert!(matches!(chat(&json!([1, 2])).unwrap_err(), ApiError::InvalidJson(_)));
    }

    #[test]
    fn request_limits_are_checked_before_any_tokenizing() {
        let limits = RequestLimits { max_prompt_chars: 8, max_stop_strings: 1, max_stop_chars: 4, max_logprobs: 3 };
        let m = json!([{"role": "system", "content": "four"}, {"role": "user", "content": "fiver"}]);
        assert_eq!(param_of(chat_request(&json!({"messages": m}), &limits).unwrap_err()), "messages");
        let m = json!([{"role": "user", "content": "ok"}]);
        let body = json!({"messages": m, "stop": ["a", "b"]});
        assert_eq!(param_of(chat_request(&body, &limits).unwrap_err()), "stop");
        assert_eq!(param_of(chat_request(&json!({"messages": m, "stop": "long!"}), &limits).unwrap_err()), "stop[0]");
        let body = json!({"messages": m, "logprobs": true, "top_logprobs": 4});
        assert_eq!(param_of(chat_request(&body, &limits).unwrap_err()), "top_logprobs");
        assert!(chat_request(&json!({"messages": m, "logprobs": true, "top_logprobs": 3}), &limits).is_ok());
        assert_eq!(param_of(completion_request(&json!({"prompt": "123456789"}), &limits).unwrap_err()), "prompt");
        assert_eq!(
            param_of(completion_request(&json!({"prompt": "x", "logprobs": 4}), &limits).unwrap_err()),
            "logprobs"
        );
    }

    #[test]
    fn completion_prompts_as_text_or_token_ids() {
        let r = completion(&json!({"prompt": "hi", "logprobs": 2})).unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert_eq!(r.params.logprobs, Some(2));
        let r = completion(&json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let r = completion(&json!({"prompt": [[4, 5]]})).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![4, 5]));
        assert_eq!(param_of(completion(&json!({"prompt": [1, -2]})).unwrap_err()), "prompt[1]");
        assert_eq!(param_of(completion(&json!({"prompt": ["a", "b"]})).unwrap_err()), "prompt");
        assert_eq!(param_of(completion(&json!({})).unwrap_err()), "prompt");
    }

    #[test]
    fn context_length_is_checked_with_a_recognisable_message() {
        assert_eq!(check_context(10, Some(5), 100).unwrap(), 5);
        assert_eq!(check_context(10, None, 100).unwrap(), 90);
        let e = check_context(98, Some(5), 100).unwrap_err();
        assert!(e.to_string().contains("maximum context length is 100 tokens"), "{e}");
        assert!(check_context(100, None, 100).is_err());
        assert_eq!(param_of(check_context(0, None, 100).unwrap_err()), "prompt");
    }
}
