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
use sparkd_tokenizer::specials::{
    IM_ASSISTANT, IM_END, IM_MIDDLE, IM_SYSTEM, IM_USER, TOOL_CALLS_SECTION_BEGIN, TOOL_CALLS_SECTION_END,
    TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_BEGIN, TOOL_CALL_END,
};
use sparkd_tokenizer::{
    ChatMessage, ChatRole, ChatTemplate, RenderSpec, Tokenizer, TokenizerError, ToolCall, KIMI_DEFAULT_SYSTEM_PROMPT,
};

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

/// The expected text of a render, and how many markers (special ids) it holds.
#[derive(Default)]
struct Expected {
    text: String,
    markers: usize,
}

impl Expected {
    fn marker(&mut self, name: &str) {
        self.text.push_str(name);
        self.markers += 1;
    }

    /// One turn, as the module docs of `tokenizer/src/chat.rs` describe it.
    fn turn(&mut self, m: &ChatMessage, role: ChatRole, close: bool, thinking: bool) {
        self.marker(match role {
            ChatRole::User => IM_USER,
            ChatRole::Assistant => IM_ASSISTANT,
            ChatRole::System | ChatRole::Developer | ChatRole::Tool => IM_SYSTEM,
        });
        self.text.push_str(m.name.as_deref().filter(|n| !n.is_empty()).unwrap_or(role.as_str()));
        self.marker(IM_MIDDLE);
        if role == ChatRole::Assistant {
            match m.reasoning.as_deref().filter(|r| !r.is_empty()) {
                Some(r) => self.text.push_str(&format!("<think>{r}</think>")),
                None if !thinking => self.text.push_str("<think></think>"),
                None => {}
            }
        }
        self.text.push_str(&m.content);
        if role == ChatRole::Assistant && !m.tool_calls.is_empty() {
            self.marker(TOOL_CALLS_SECTION_BEGIN);
            for call in &m.tool_calls {
                self.marker(TOOL_CALL_BEGIN);
                self.text.push_str(&call.id);
                self.marker(TOOL_CALL_ARGUMENT_BEGIN);
                self.text.push_str(&call.arguments);
                self.marker(TOOL_CALL_END);
            }
            self.marker(TOOL_CALLS_SECTION_END);
        }
        if close {
            self.marker(IM_END);
        }
    }

    fn reply_opening(&mut self, thinking: bool) {
        self.marker(IM_ASSISTANT);
        self.text.push_str("assistant");
        self.marker(IM_MIDDLE);
        if !thinking {
            self.text.push_str("<think></think>");
        }
    }
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
    let roles: Vec<ChatRole> = roles.into_iter().flatten().collect();

    let mut expected = Expected::default();
    if let Some(tools) = input.tools.as_deref().filter(|t| !t.trim().is_empty() && t.trim() != "[]") {
        let declare = ChatMessage::new("system", tools).with_name(Some("tool_declare".into()));
        expected.turn(&declare, ChatRole::System, true, input.thinking);
    }
    for (i, (m, role)) in messages.iter().zip(&roles).enumerate() {
        if i == 0 && *role != ChatRole::System {
            expected.turn(
                &ChatMessage::new("system", KIMI_DEFAULT_SYSTEM_PROMPT),
                ChatRole::System,
                true,
                input.thinking,
            );
        }
        let close = input.add_generation_prompt || i + 1 < messages.len();
        expected.turn(m, *role, close, input.thinking);
    }
    if input.add_generation_prompt {
        expected.reply_opening(input.thinking);
    }
    assert_renders(&rendered.expect("known roles render"), &expected);

    let mut expected = Expected::default();
    if !input.kept_ends_turn {
        expected.marker(IM_END);
    }
    for (m, role) in messages.iter().zip(&roles) {
        expected.turn(m, *role, true, input.thinking);
    }
    expected.reply_opening(input.thinking);
    assert_renders(&continued.expect("known roles render"), &expected);
});
