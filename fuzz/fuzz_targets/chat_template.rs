//! Fuzz target: the chat template (`sparkd_tokenizer::ChatTemplate::render_spec` and `render_continuation`) on
//! arbitrary messages, bound to the built-in tokenizer as `sparkd serve` builds it for a checkpoint without
//! `tiktoken.model` (`daemon/src/startup.rs`: `ChatTemplate::new(Tokenizer::builtin())`).
//!
//! Checks, for any messages, tools and switches:
//! - nothing panics; rendering fails exactly when a role is unknown, with `UnknownRole` naming the first one;
//! - the ids decode (special tokens as their names) to the text the template's documentation describes, built here
//!   by string concatenation, so every byte of content, names, reasoning and tool calls is kept;
//! - no injection: the special ids in the output are exactly the template's markers, however many special-token
//!   strings the content holds;
//! - a continuation of a kept turn starts with `<|im_end|>` exactly when the kept ids do not end with it, then
//!   renders the new messages as a full history would.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use sparkd_tokenizer::{ChatMessage, ChatRole, ChatTemplate, RenderSpec, Tokenizer, TokenizerError, ToolCall};

#[path = "../../tokenizer/tests/support/template_oracle.rs"]
mod template_oracle;
use template_oracle::Expected;

const ROLES: [&str; 6] = ["system", "developer", "user", "assistant", "tool", "narrator"];

#[derive(Arbitrary, Debug)]
struct Message {
    role: u8,
    content: String,
    name: Option<String>,
    reasoning: Option<String>,
    tool_calls: Vec<(String, String)>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    messages: Vec<Message>,
    tools: Option<String>,
    add_generation_prompt: bool,
    thinking: bool,
    kept_ends_turn: bool,
}

fn template() -> &'static ChatTemplate {
    static TEMPLATE: OnceLock<ChatTemplate> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        ChatTemplate::new(Tokenizer::builtin().expect("the built-in tokenizer builds")).expect("it has the markers")
    })
}

/// Checks rendered `ids` against the expected text and marker count.
fn assert_renders(ids: &[u32], expected: &Expected) {
    let tokenizer = template().tokenizer();
    let text = tokenizer.decode(ids).expect("rendered ids decode");
    assert_eq!(text, expected.text);
    let specials = ids.iter().filter(|&&id| tokenizer.is_special(id)).count();
    assert_eq!(specials, expected.markers, "special ids other than the markers in {text:?}");
}

fuzz_target!(|input: Input| {
    let messages: Vec<ChatMessage> = input
        .messages
        .into_iter()
        .map(|m| ChatMessage {
            role: ROLES[usize::from(m.role) % ROLES.len()].to_string(),
            content: m.content,
            name: m.name,
            reasoning: m.reasoning,
            tool_calls: m
                .tool_calls
                .into_iter()
                .map(|(id, arguments)| ToolCall { name: String::new(), id, arguments })
                .collect(),
        })
        .collect();
    let roles: Vec<Option<ChatRole>> = messages.iter().map(|m| ChatRole::parse(&m.role)).collect();
    let template = template();
    let spec = RenderSpec {
        messages: &messages,
        tools: input.tools.as_deref(),
        add_generation_prompt: input.add_generation_prompt,
        thinking: input.thinking,
    };
    let rendered = template.render_spec(&spec);
    let kept = if input.kept_ends_turn { vec![1, template.im_end()] } else { vec![template.im_end(), 1] };
    let continued = template.render_continuation(&kept, &messages, input.thinking);
    if let Some(unknown) = roles.iter().position(Option::is_none) {
        for result in [rendered, continued] {
            match result {
                Err(TokenizerError::UnknownRole { index, role }) => {
                    assert_eq!((index, role.as_str()), (unknown, messages[unknown].role.as_str()))
                }
                other => panic!("an unknown role must be refused, got {other:?}"),
            }
        }
        return;
    }

    let expected = Expected::render(&messages, input.tools.as_deref(), input.add_generation_prompt, input.thinking);
    assert_renders(&rendered.expect("known roles render"), &expected);
    let expected = Expected::continuation(&messages, input.kept_ends_turn, input.thinking);
    assert_renders(&continued.expect("known roles render"), &expected);
});
