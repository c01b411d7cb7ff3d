//! The chat template's expected output, built by string concatenation from its documentation
//! (`tokenizer/src/chat.rs`): the text a render decodes to (special tokens as their names) and how many markers
//! (special ids) it holds. Shared by the property tests (`tests/prop_parsers.rs`) and the fuzz target
//! (`fuzz/fuzz_targets/chat_template.rs`, which includes this file by path), so both check the same contract.

use sparkd_tokenizer::specials::{
    IM_ASSISTANT, IM_END, IM_MIDDLE, IM_SYSTEM, IM_USER, TOOL_CALLS_SECTION_BEGIN, TOOL_CALLS_SECTION_END,
    TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_BEGIN, TOOL_CALL_END,
};
use sparkd_tokenizer::{ChatMessage, ChatRole, KIMI_DEFAULT_SYSTEM_PROMPT};

/// The text a render decodes to, and how many markers it holds.
#[derive(Debug, Default)]
pub struct Expected {
    pub text: String,
    pub markers: usize,
}

impl Expected {
    fn marker(&mut self, name: &str) {
        self.text.push_str(name);
        self.markers += 1;
    }

    /// One turn: header, optional thinking, content, tool calls, and `<|im_end|>` when `close`.
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

    /// The assistant turn's opening the model writes after.
    fn reply_opening(&mut self, thinking: bool) {
        self.marker(IM_ASSISTANT);
        self.text.push_str("assistant");
        self.marker(IM_MIDDLE);
        if !thinking {
            self.text.push_str("<think></think>");
        }
    }

    /// `render_spec` of `messages` (every role known): the tools' declaration, the default system prompt when
    /// the first message is not a system one, each turn, and the reply's opening.
    pub fn render(messages: &[ChatMessage], tools: Option<&str>, add_generation_prompt: bool, thinking: bool) -> Self {
        let mut e = Expected::default();
        if let Some(tools) = tools.filter(|t| !t.trim().is_empty() && t.trim() != "[]") {
            let declare = ChatMessage::new("system", tools).with_name(Some("tool_declare".into()));
            e.turn(&declare, ChatRole::System, true, thinking);
        }
        for (i, m) in messages.iter().enumerate() {
            let role = ChatRole::parse(&m.role).expect("a known role");
            if i == 0 && role != ChatRole::System {
                e.turn(&ChatMessage::new("system", KIMI_DEFAULT_SYSTEM_PROMPT), ChatRole::System, true, thinking);
            }
            e.turn(m, role, add_generation_prompt || i + 1 < messages.len(), thinking);
        }
        if add_generation_prompt {
            e.reply_opening(thinking);
        }
        e
    }

    /// `render_continuation` of a kept turn whose ids end with `<|im_end|>` or not: that marker first when they
    /// do not, then each new turn closed, then the reply's opening.
    pub fn continuation(messages: &[ChatMessage], kept_ends_turn: bool, thinking: bool) -> Self {
        let mut e = Expected::default();
        if !kept_ends_turn {
            e.marker(IM_END);
        }
        for m in messages {
            e.turn(m, ChatRole::parse(&m.role).expect("a known role"), true, thinking);
        }
        e.reply_opening(thinking);
        e
    }
}
