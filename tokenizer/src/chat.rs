//! K2/K3's chat template, rendered straight to token ids.
//!
//! Follows the `chat_template.jinja` of Kimi K2-Instruct(-0905) for text messages:
//! - If the first message is not `system`, Kimi's default system turn comes first:
//!   `<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>`.
//! - Each message is `MARKER{role_name}<|im_middle|>{content}<|im_end|>`, where `role_name` is the
//!   message's `name` when non-empty, else its role, and MARKER is `<|im_user|>` for `user`,
//!   `<|im_assistant|>` for `assistant` and `<|im_system|>` for `system`, `developer` and `tool`. A tool
//!   result's content is `## Return of {tool_call_id}\n{content}` ([`ChatMessage::tool_result`] builds it).
//! - With the generation prompt, every message is closed with `<|im_end|>` and
//!   `<|im_assistant|>assistant<|im_middle|>` follows; without it the last message is left open (Kimi's
//!   template omits its `<|im_end|>`), so the model continues it.
//!
//! Left out: the `tool_declare` turn for `tools`, assistant `tool_calls` sections, and media parts (the API
//! layer flattens content to text). Unknown roles are an error naming the role, where Kimi's template would
//! render them as system turns.
//!
//! Invariants: markers are emitted as their special ids and content is encoded with
//! [`Tokenizer::encode`], so special-token strings inside content stay plain text (no prompt injection of
//! markers). For content without special-token strings this equals Hugging Face's
//! `apply_chat_template(..., tokenize=True)` with [`ChatTemplate::JINJA`], which is what the export ships.
//! A continuation ([`ChatTemplate::render_continuation`]) appended to a kept turn yields exactly the tokens
//! of resending the whole history, as long as the kept assistant tokens are the canonical encoding of the
//! assistant text that is resent.

use super::bpe::Tokenizer;
use super::error::{Result, TokenizerError};
use super::specials::{IM_ASSISTANT, IM_END, IM_MIDDLE, IM_SYSTEM, IM_USER};

/// The system prompt Kimi's template inserts when a conversation does not start with a system message.
pub const KIMI_DEFAULT_SYSTEM_PROMPT: &str = "You are Kimi, an AI assistant created by Moonshot AI.";

/// The roles the template knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatRole {
    System,
    /// OpenAI's newer name for a system message; rendered as a system turn named `developer`.
    Developer,
    User,
    Assistant,
    Tool,
}

impl ChatRole {
    /// Parses an OpenAI role string (exact, lowercase).
    pub fn parse(role: &str) -> Option<Self> {
        Some(match role {
            "system" => ChatRole::System,
            "developer" => ChatRole::Developer,
            "user" => ChatRole::User,
            "assistant" => ChatRole::Assistant,
            "tool" => ChatRole::Tool,
            _ => return None,
        })
    }

    /// The role string, as rendered between the marker and `<|im_middle|>`.
    pub fn as_str(self) -> &'static str {
        match self {
            ChatRole::System => "system",
            ChatRole::Developer => "developer",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
            ChatRole::Tool => "tool",
        }
    }
}

/// One chat message with its text content already flattened to a single string.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Replaces the role name in the rendered turn header, as Kimi's template does.
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with no name.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), name: None }
    }

    /// A tool result in Kimi's form: content `## Return of {call_id}\n{output}`.
    pub fn tool_result(call_id: &str, output: &str) -> Self {
        ChatMessage::new("tool", format!("## Return of {call_id}\n{output}"))
    }
}

/// The chat template bound to a tokenizer's marker ids. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    tokenizer: Tokenizer,
    im_system: u32,
    im_user: u32,
    im_assistant: u32,
    im_middle: u32,
    im_end: u32,
}

impl ChatTemplate {
    /// The Hugging Face (Jinja) form of exactly this template, shipped in the export's
    /// `tokenizer_config.json`. Whitespace between tags is trimmed, so only the quoted strings are output.
    pub const JINJA: &'static str = r#"{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}
{%- endif -%}
{%- set role_name = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}
{{- '<|im_user|>' + role_name + '<|im_middle|>' -}}
{%- elif message['role'] == 'assistant' -%}
{{- '<|im_assistant|>' + role_name + '<|im_middle|>' -}}
{%- else -%}
{{- '<|im_system|>' + role_name + '<|im_middle|>' -}}
{%- endif -%}
{%- if message['role'] == 'tool' and message.get('tool_call_id') -%}
{{- '## Return of ' + message['tool_call_id'] + '\n' -}}
{%- endif -%}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- if not loop.last or add_generation_prompt -%}
{{- '<|im_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- endif -%}"#;

    /// Binds the template to `tokenizer`; errors if a role marker is not in its vocabulary.
    pub fn new(tokenizer: Tokenizer) -> Result<Self> {
        let id = |name: &str| tokenizer.token_id(name).ok_or_else(|| TokenizerError::MissingSpecialToken(name.into()));
        Ok(ChatTemplate {
            im_system: id(IM_SYSTEM)?,
            im_user: id(IM_USER)?,
            im_assistant: id(IM_ASSISTANT)?,
            im_middle: id(IM_MIDDLE)?,
            im_end: id(IM_END)?,
            tokenizer,
        })
    }

    /// The tokenizer the template encodes with.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Renders `messages` followed by the generation prompt.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.render_with(messages, true)
    }

    /// Renders `messages`; with `add_generation_prompt` every message is closed and the assistant turn
    /// opened, without it the last message is left open for the model to continue.
    pub fn render_with(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>> {
        let roles = parse_roles(messages)?;
        let mut out = Vec::new();
        for (index, (message, role)) in messages.iter().zip(&roles).enumerate() {
            if index == 0 && *role != ChatRole::System {
                self.push_turn(&mut out, ChatRole::System, "system", KIMI_DEFAULT_SYSTEM_PROMPT, true);
            }
            let close = add_generation_prompt || index + 1 < messages.len();
            self.push_turn(&mut out, *role, role_name(message, *role), &message.content, close);
        }
        if add_generation_prompt {
            out.extend(self.generation_prompt());
        }
        Ok(out)
    }

    /// The tokens that continue a kept response (a session turn whose tokens are `kept`: its prompt, then
    /// the generated reply) with new input messages, then the generation prompt. If `kept` does not end
    /// with `<|im_end|>` (a reply cut by a length limit), `<|im_end|>` comes first, as the full history
    /// renders it. No default system turn is added. `kept ++ continuation` equals
    /// `render(history ++ [assistant reply] ++ new_messages)`.
    pub fn render_continuation(&self, kept: &[u32], new_messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let roles = parse_roles(new_messages)?;
        let mut out = Vec::new();
        if kept.last() != Some(&self.im_end) {
            out.push(self.im_end);
        }
        for (message, role) in new_messages.iter().zip(&roles) {
            self.push_turn(&mut out, *role, role_name(message, *role), &message.content, true);
        }
        out.extend(self.generation_prompt());
        Ok(out)
    }

    /// `<|im_assistant|>assistant<|im_middle|>`: the tokens that open the model's reply.
    pub fn generation_prompt(&self) -> Vec<u32> {
        let mut out = vec![self.im_assistant];
        out.extend(self.tokenizer.encode(ChatRole::Assistant.as_str()));
        out.push(self.im_middle);
        out
    }

    /// The id that closes every turn, `<|im_end|>`.
    pub fn im_end(&self) -> u32 {
        self.im_end
    }

    fn push_turn(&self, out: &mut Vec<u32>, role: ChatRole, role_name: &str, content: &str, close: bool) {
        out.push(match role {
            ChatRole::User => self.im_user,
            ChatRole::Assistant => self.im_assistant,
            ChatRole::System | ChatRole::Developer | ChatRole::Tool => self.im_system,
        });
        out.extend(self.tokenizer.encode(role_name));
        out.push(self.im_middle);
        out.extend(self.tokenizer.encode(content));
        if close {
            out.push(self.im_end);
        }
    }
}

fn parse_roles(messages: &[ChatMessage]) -> Result<Vec<ChatRole>> {
    messages
        .iter()
        .enumerate()
        .map(|(index, m)| {
            ChatRole::parse(&m.role).ok_or_else(|| TokenizerError::UnknownRole { index, role: m.role.clone() })
        })
        .collect()
}

/// Kimi's `message.get('name') or message['role']`: an empty name counts as none.
fn role_name(message: &ChatMessage, role: ChatRole) -> &str {
    message.name.as_deref().filter(|n| !n.is_empty()).unwrap_or(role.as_str())
}
