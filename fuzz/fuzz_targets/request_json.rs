//! Fuzz target: request bodies of `/v1/chat/completions`, `/v1/completions` and `/v1/responses`, through the
//! daemon's own parsing and validation (`sparkd::api::openai::{parse_body, chat_request, completion_request}`,
//! `sparkd::api::items::responses_request`), then what the daemon does next with an accepted request: render its
//! chat prompt with the built-in model's template and compile its output constraint.
//!
//! Checks, for any bytes:
//! - nothing panics;
//! - `parse_body` refuses only what serde_json refuses, as `InvalidJson`;
//! - every refusal is a 400, and an `InvalidField` names a field;
//! - an accepted request keeps what validation promises under the limits it was checked against (the daemon's
//!   defaults, and tight ones that the fuzzer can reach): at most `max_stop_strings` stop strings, none empty or
//!   longer than `max_stop_chars` characters; at most `max_logprobs` alternatives; temperature in [0, 2], top_p in
//!   (0, 1]; a prompt of at most `max_prompt_chars` characters;
//! - an accepted chat or Responses request renders with the chat template (its roles were checked), and compiling
//!   its constraint either succeeds or is a 400 naming the field.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sparkd::api::constraint;
use sparkd::api::error::ApiError;
use sparkd::api::items::responses_request;
use sparkd::api::limits::{chat_chars, RequestLimits};
use sparkd::api::openai::{chat_request, completion_request, parse_body, GenerationParams, Prompt};
use sparkd_grammar::{ConstraintSpec, GrammarEnv};
use sparkd_tokenizer::{ChatMessage, ChatTemplate, RenderSpec, Tokenizer};

/// The daemon's defaults for a 131,072-token context.
const CONTEXT: usize = 1 << 17;
/// Limits small enough for fuzzed bodies to cross.
const TIGHT: RequestLimits =
    RequestLimits { max_prompt_chars: 64, max_stop_strings: 2, max_stop_chars: 8, max_logprobs: 3 };

/// The template and constraint compiler `sparkd serve` builds for a checkpoint without `tiktoken.model`.
fn served() -> &'static (ChatTemplate, GrammarEnv) {
    static SERVED: OnceLock<(ChatTemplate, GrammarEnv)> = OnceLock::new();
    SERVED.get_or_init(|| {
        let tokenizer = Tokenizer::builtin().expect("the built-in tokenizer builds");
        let grammar = GrammarEnv::new(&tokenizer).expect("the constraint compiler builds");
        (ChatTemplate::new(tokenizer).expect("the built-in tokenizer has the chat markers"), grammar)
    })
}

fn assert_refusal(e: &ApiError) {
    assert_eq!(e.status().as_u16(), 400, "a refused body is a 400: {e:?}");
    if let ApiError::InvalidField { param, message } = e {
        assert!(!param.is_empty() && !message.is_empty(), "a field error names the field: {e:?}");
    }
}

fn assert_params(params: &GenerationParams, limits: &RequestLimits) {
    assert!(params.stop.len() <= limits.max_stop_strings, "{:?}", params.stop);
    for stop in &params.stop {
        assert!(!stop.is_empty() && stop.chars().count() <= limits.max_stop_chars, "{stop:?}");
    }
    for n in [params.logprobs, params.sampling.logprobs].into_iter().flatten() {
        assert!(n <= limits.max_logprobs, "logprobs {n}");
    }
    let s = &params.sampling;
    assert!((0.0..=2.0).contains(&s.temperature), "temperature {}", s.temperature);
    assert!(s.top_p > 0.0 && s.top_p <= 1.0, "top_p {}", s.top_p);
}

fn render_and_compile(
    messages: &[ChatMessage],
    tools: Option<&str>,
    thinking: bool,
    constraint: &Option<(String, ConstraintSpec)>,
) {
    let (template, grammar) = served();
    let spec = RenderSpec { tools, thinking, ..RenderSpec::new(messages) };
    template.render_spec(&spec).expect("a validated prompt renders");
    if let Some((field, spec)) = constraint {
        if let Err(e) = constraint::compile(grammar, field, spec) {
            assert_refusal(&e);
        }
    }
}

fn check(body: &Value, limits: &RequestLimits, render: bool) {
    match chat_request(body, limits) {
        Ok(valid) => {
            assert_params(&valid.params, limits);
            let Prompt::Chat { messages, tools, thinking } = &valid.prompt else {
                panic!("a chat request has messages")
            };
            assert!(!messages.is_empty());
            assert!(chat_chars(messages, tools.as_deref()) <= limits.max_prompt_chars);
            if render {
                render_and_compile(messages, tools.as_deref(), *thinking, &valid.constraint);
            }
        }
        Err(e) => assert_refusal(&e),
    }
    match completion_request(body, limits) {
        Ok(valid) => {
            assert_params(&valid.params, limits);
            match &valid.prompt {
                Prompt::Text(text) => assert!(text.chars().count() <= limits.max_prompt_chars),
                Prompt::Tokens(ids) => assert!(!ids.is_empty()),
                Prompt::Chat { .. } => panic!("a completion request has no messages"),
            }
        }
        Err(e) => assert_refusal(&e),
    }
    match responses_request(body, limits) {
        Ok(valid) => {
            assert_params(&valid.params, limits);
            assert!(!valid.input.is_empty());
            let tools = valid.tools.as_ref().and_then(|t| t.prompt_declaration());
            assert!(chat_chars(&valid.input, tools) <= limits.max_prompt_chars);
            if render {
                render_and_compile(&valid.input, tools, valid.thinking, &valid.constraint);
            }
        }
        Err(e) => assert_refusal(&e),
    }
}

fuzz_target!(|data: &[u8]| {
    let body = match parse_body(data) {
        Ok(body) => body,
        Err(e) => {
            assert!(matches!(e, ApiError::InvalidJson(_)), "{e:?}");
            assert!(serde_json::from_slice::<Value>(data).is_err(), "parse_body refused JSON serde_json accepts");
            return;
        }
    };
    check(&body, &RequestLimits::for_context(CONTEXT), true);
    check(&body, &TIGHT, false);
});
