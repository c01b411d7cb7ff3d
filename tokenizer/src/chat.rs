//! K2/K3's chat template, rendered straight to token ids.
//!
//! Follows the `chat_template.jinja` of Kimi K2-Instruct(-0905) (the formats, with their sources, are in
//! docs/agent-formats.md):
//! - With tools, a `tool_declare` turn comes first: `<|im_system|>tool_declare<|im_middle|>{tools}<|im_end|>`,
//!   `{tools}` the request's `tools` array as compact JSON.
//! - If the first message is not `system`, Kimi's default system turn comes next:
//!   `<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>`.
//! - Each message is `MARKER{role_name}<|im_middle|>{body}<|im_end|>`, where `role_name` is the
//!   message's `name` when non-empty, else its role, and MARKER is `<|im_user|>` for `user`,
//!   `<|im_assistant|>` for `assistant` and `<|im_system|>` for `system`, `developer` and `tool`. A tool
//!   result's body is `## Return of {tool_call_id}\n{content}` ([`ChatMessage::tool_result`] builds it).
//! - An assistant body is `<think>{reasoning}</think>` when the message has reasoning, then its content, then
//!   its tool calls as one section: `<|tool_calls_section_begin|>`, per call `<|tool_call_begin|>{id}
//!   <|tool_call_argument_begin|>{arguments}<|tool_call_end|>` (no spaces), `<|tool_calls_section_end|>`. The
//!   reasoning is kept in every turn (Kimi's thinking templates drop it from turns before the last user
//!   message): a reply is rendered back as the model produced it, so resending a history and continuing a kept
//!   turn give the same tokens and the prefix cache still hits.
//! - With the generation prompt, every message is closed with `<|im_end|>` and
//!   `<|im_assistant|>assistant<|im_middle|>` follows; without it the last message is left open (Kimi's
//!   template omits its `<|im_end|>`), so the model continues it.
//! - Thinking off ([`RenderSpec::thinking`] false; Kimi K2.5's `thinking is false`): the generation prompt is
//!   followed by an empty `<think></think>`, so the model answers at once, and an assistant turn without reasoning
//!   opens with the same empty block, as that reply was generated after it. `<think></think>` is encoded apart from
//!   the content after it, as the prompt that preceded the reply was.
//!
//! Left out: media parts (the API layer flattens content to text). Unknown roles are an error naming the role,
//! where Kimi's template would render them as system turns.
//!
//! Invariants: markers are emitted as their special ids and content is encoded with
//! [`Tokenizer::encode`], so special-token strings inside content, reasoning, tool ids and arguments stay plain
//! text (no prompt injection of markers). For content without special-token strings this equals Hugging Face's
//! `apply_chat_template(..., tokenize=True)` with [`ChatTemplate::JINJA`], which is what the export ships; with
//! thinking off the text is the same and the ids differ only where an empty think block meets the word after it.
//! A continuation ([`ChatTemplate::render_continuation`]) appended to a kept turn yields exactly the tokens
//! of resending the whole history, as long as the kept assistant tokens are the canonical encoding of the
//! assistant text that is resent.

use super::bpe::Tokenizer;
use super::error::{Result, TokenizerError};
use super::specials::{
    IM_ASSISTANT, IM_END, IM_MIDDLE, IM_SYSTEM, IM_USER, TOOL_CALLS_SECTION_BEGIN, TOOL_CALLS_SECTION_END,
    TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_BEGIN, TOOL_CALL_END,
};

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

/// One tool call of an assistant message: its id (`functions.{name}:{index}` in Kimi's own calls), the
/// function's name and its arguments as the JSON text the model wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// One chat message with its text content already flattened to a single string.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Replaces the role name in the rendered turn header, as Kimi's template does.
    pub name: Option<String>,
    /// An assistant message's thinking, rendered as `<think>{reasoning}</think>` before its content.
    pub reasoning: Option<String>,
    /// An assistant message's tool calls, rendered after its content.
    pub tool_calls: Vec<ToolCall>,
}

impl ChatMessage {
    /// A message with no name.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into(), ..ChatMessage::default() }
    }

    /// A tool result in Kimi's form: content `## Return of {call_id}\n{output}`.
    pub fn tool_result(call_id: &str, output: &str) -> Self {
        ChatMessage::new("tool", format!("## Return of {call_id}\n{output}"))
    }

    /// The message under `name` (a tool result's turn header is the function's name).
    pub fn with_name(mut self, name: Option<String>) -> Self {
        self.name = name;
        self
    }
}

/// What to render: the messages, the request's tool declarations (its `tools` array as compact JSON; `None` or
/// an empty array declares none), whether the assistant's turn is opened after them, and whether the model thinks
/// (see the module docs for thinking off).
#[derive(Clone, Copy, Debug)]
pub struct RenderSpec<'a> {
    pub messages: &'a [ChatMessage],
    pub tools: Option<&'a str>,
    pub add_generation_prompt: bool,
    pub thinking: bool,
}

impl<'a> RenderSpec<'a> {
    /// `messages` and the generation prompt, no tools, thinking on.
    pub fn new(messages: &'a [ChatMessage]) -> Self {
        RenderSpec { messages, tools: None, add_generation_prompt: true, thinking: true }
    }
}

/// The special ids of the tool-call markers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ToolMarkers {
    pub section_begin: u32,
    pub section_end: u32,
    pub call_begin: u32,
    pub argument_begin: u32,
    pub call_end: u32,
}

impl ToolMarkers {
    /// The markers' ids in `tokenizer`; errors naming the first one it lacks.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let id = |name: &str| tokenizer.token_id(name).ok_or_else(|| TokenizerError::MissingSpecialToken(name.into()));
        Ok(ToolMarkers {
            section_begin: id(TOOL_CALLS_SECTION_BEGIN)?,
            section_end: id(TOOL_CALLS_SECTION_END)?,
            call_begin: id(TOOL_CALL_BEGIN)?,
            argument_begin: id(TOOL_CALL_ARGUMENT_BEGIN)?,
            call_end: id(TOOL_CALL_END)?,
        })
    }

    /// Whether `id` is one of the markers.
    pub fn contains(&self, id: u32) -> bool {
        [self.section_begin, self.section_end, self.call_begin, self.argument_begin, self.call_end].contains(&id)
    }
}

/// The tag that opens a reply's thinking, and the one that closes it (plain text, not special tokens).
pub const THINK_BEGIN: &str = "<think>";
pub const THINK_END: &str = "</think>";

/// The chat template bound to a tokenizer's marker ids. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    tokenizer: Tokenizer,
    im_system: u32,
    im_user: u32,
    im_assistant: u32,
    im_middle: u32,
    im_end: u32,
    tools: ToolMarkers,
}

impl ChatTemplate {
    /// The Hugging Face (Jinja) form of exactly this template, shipped in the export's
    /// `tokenizer_config.json`. Whitespace between tags is trimmed, so only the quoted strings are output.
    pub const JINJA: &'static str = r#"{%- if tools -%}
{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson(separators=(',', ':'))) + '<|im_end|>' -}}
{%- endif -%}
{%- for message in messages -%}
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
{%- if message['role'] == 'assistant' and message.get('reasoning_content') -%}
{{- '<think>' + message['reasoning_content'] + '</think>' -}}
{%- elif message['role'] == 'assistant' and thinking is defined and thinking is false -%}
{{- '<think></think>' -}}
{%- endif -%}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{{- '<|tool_calls_section_begin|>' -}}
{%- for call in message['tool_calls'] -%}
{{- '<|tool_call_begin|>' + call['id'] + '<|tool_call_argument_begin|>' + call['function']['arguments'] + '<|tool_call_end|>' -}}
{%- endfor -%}
{{- '<|tool_calls_section_end|>' -}}
{%- endif -%}
{%- if not loop.last or add_generation_prompt -%}
{{- '<|im_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- if thinking is defined and thinking is false -%}
{{- '<think></think>' -}}
{%- endif -%}
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
            tools: ToolMarkers::new(&tokenizer)?,
            tokenizer,
        })
    }

    /// The tokenizer the template encodes with.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Renders `messages` followed by the generation prompt.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.render_spec(&RenderSpec::new(messages))
    }

    /// Renders `messages`; with `add_generation_prompt` every message is closed and the assistant turn
    /// opened, without it the last message is left open for the model to continue.
    pub fn render_with(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<Vec<u32>> {
        self.render_spec(&RenderSpec { add_generation_prompt, ..RenderSpec::new(messages) })
    }

    /// Renders what `spec` says (see the module docs for the order of the turns).
    pub fn render_spec(&self, spec: &RenderSpec<'_>) -> Result<Vec<u32>> {
        let RenderSpec { messages, tools, add_generation_prompt, thinking } = *spec;
        let roles = parse_roles(messages)?;
        let mut out = Vec::new();
        if let Some(tools) = tools.filter(|t| !t.trim().is_empty() && t.trim() != "[]") {
            let declare = ChatMessage::new("system", tools).with_name(Some("tool_declare".into()));
            self.push_turn(&mut out, ChatRole::System, &declare, Turn { close: true, thinking });
        }
        for (index, (message, role)) in messages.iter().zip(&roles).enumerate() {
            if index == 0 && *role != ChatRole::System {
                let system = ChatMessage::new("system", KIMI_DEFAULT_SYSTEM_PROMPT);
                self.push_turn(&mut out, ChatRole::System, &system, Turn { close: true, thinking });
            }
            let close = add_generation_prompt || index + 1 < messages.len();
            self.push_turn(&mut out, *role, message, Turn { close, thinking });
        }
        if add_generation_prompt {
            out.extend(self.reply_opening(thinking));
        }
        Ok(out)
    }

    /// The tokens that continue a kept response (a session turn whose tokens are `kept`: its prompt, then
    /// the generated reply) with new input messages, then the generation prompt. If `kept` does not end
    /// with `<|im_end|>` (a reply cut by a length limit), `<|im_end|>` comes first, as the full history
    /// renders it. No default system turn is added. `kept ++ continuation` equals
    /// `render(history ++ [assistant reply] ++ new_messages)` with the same `thinking`.
    pub fn render_continuation(&self, kept: &[u32], new_messages: &[ChatMessage], thinking: bool) -> Result<Vec<u32>> {
        let roles = parse_roles(new_messages)?;
        let mut out = Vec::new();
        if kept.last() != Some(&self.im_end) {
            out.push(self.im_end);
        }
        for (message, role) in new_messages.iter().zip(&roles) {
            self.push_turn(&mut out, *role, message, Turn { close: true, thinking });
        }
        out.extend(self.reply_opening(thinking));
        Ok(out)
    }

    /// The generation prompt, then, with thinking off, the empty `<think></think>` the reply starts after.
    fn reply_opening(&self, thinking: bool) -> Vec<u32> {
        let mut out = self.generation_prompt();
        if !thinking {
            out.extend(self.tokenizer.encode(&format!("{THINK_BEGIN}{THINK_END}")));
        }
        out
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

    /// The ids of the tool-call markers.
    pub fn tool_markers(&self) -> ToolMarkers {
        self.tools
    }

    fn push_turn(&self, out: &mut Vec<u32>, role: ChatRole, message: &ChatMessage, turn: Turn) {
        out.push(match role {
            ChatRole::User => self.im_user,
            ChatRole::Assistant => self.im_assistant,
            ChatRole::System | ChatRole::Developer | ChatRole::Tool => self.im_system,
        });
        out.extend(self.tokenizer.encode(role_name(message, role)));
        out.push(self.im_middle);
        let mut body = String::new();
        if role == ChatRole::Assistant {
            match message.reasoning.as_deref().filter(|r| !r.is_empty()) {
                Some(reasoning) => body = format!("{THINK_BEGIN}{reasoning}{THINK_END}"),
                None if !turn.thinking => out.extend(self.tokenizer.encode(&format!("{THINK_BEGIN}{THINK_END}"))),
                None => {}
            }
        }
        body.push_str(&message.content);
        out.extend(self.tokenizer.encode(&body));
        if role == ChatRole::Assistant && !message.tool_calls.is_empty() {
            out.push(self.tools.section_begin);
            for call in &message.tool_calls {
                out.push(self.tools.call_begin);
                out.extend(self.tokenizer.encode(&call.id));
                out.push(self.tools.argument_begin);
                out.extend(self.tokenizer.encode(&call.arguments));
                out.push(self.tools.call_end);
            }
            out.push(self.tools.section_end);
        }
        if turn.close {
            out.push(self.im_end);
        }
    }
}

/// How one turn is rendered: closed with `<|im_end|>` or left open, and whether the model thinks.
#[derive(Clone, Copy, Debug)]
struct Turn {
    close: bool,
    thinking: bool,
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
