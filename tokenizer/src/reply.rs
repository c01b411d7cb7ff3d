//! A Kimi reply, streamed as token ids, split into reasoning, content and tool calls ([`ReplyParser`]).
//!
//! The format (docs/agent-formats.md): an optional `<think>…</think>` at the start of the reply (plain text),
//! then the content, then at most one tool-call section of special-token markers:
//! `<|tool_calls_section_begin|>`, per call `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
//! {json}<|tool_call_end|>`, then `<|tool_calls_section_end|>`.
//!
//! Invariants:
//! - Any split of the same ids into `push` calls gives the same events once adjacent text events of one kind are
//!   joined: markers are recognised by id, and text that may still become a think tag is held back (at most
//!   the tag's length minus one byte), so a step of any number of tokens (speculation emits several) is parsed
//!   exactly as the same tokens one by one.
//! - Text never contains a marker's name (special ids are not decoded) and every character is whole
//!   ([`IncrementalDecoder`]); a marker flushes the decoder, so the text before it is complete.
//! - A call is reported when its `<|tool_call_argument_begin|>` arrives (its id and the function name parsed
//!   out of it: the last `.`-separated part before the first `:`), then its arguments as they stream, then its
//!   end. A header that never reaches its arguments is dropped; text between calls is dropped. Nothing here
//!   validates names or arguments against the request's tools (the API layer does).
//! - `<think>` opens reasoning only at the start of the reply (after whitespace); later, it is content. With
//!   thinking off ([`ReplyParser::without_thinking`]: the prompt closed an empty think block) it is always content.

use super::bpe::Tokenizer;
use super::chat::{ToolMarkers, THINK_BEGIN, THINK_END};
use super::detok::IncrementalDecoder;
use super::error::Result;

/// One piece of a parsed reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyEvent {
    Reasoning(String),
    Content(String),
    /// A tool call's header is complete: its index in the reply, the id the model wrote and the function name.
    ToolCallBegin {
        index: usize,
        id: String,
        name: String,
    },
    /// A fragment of a call's JSON arguments.
    ToolCallArguments {
        index: usize,
        text: String,
    },
    ToolCallEnd {
        index: usize,
    },
}

/// Where the parser is in the reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace yet: `<think>` may still come.
    Start,
    Reasoning,
    Content,
    /// Inside the tool-call section, between calls.
    Section,
    /// A call's id, before its arguments.
    Header,
    Arguments,
}

/// Parses one reply; see the module docs.
#[derive(Clone, Debug)]
pub struct ReplyParser {
    markers: ToolMarkers,
    decoder: IncrementalDecoder,
    phase: Phase,
    /// Text held back: the reply's start while `<think>` may still come, or reasoning that may end in `</think>`.
    held: String,
    /// The id text of the call whose header is open.
    header: String,
    /// Calls begun so far.
    calls: usize,
}

impl ReplyParser {
    /// A parser for a reply in `tokenizer`'s ids; errors if its vocabulary lacks a tool-call marker.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        Ok(ReplyParser {
            markers: ToolMarkers::new(tokenizer)?,
            decoder: IncrementalDecoder::new(tokenizer.clone()),
            phase: Phase::Start,
            held: String::new(),
            header: String::new(),
            calls: 0,
        })
    }

    /// The parser for a reply generated with thinking off: all text before the tool calls is content.
    pub fn without_thinking(mut self) -> Self {
        if self.phase == Phase::Start {
            self.phase = Phase::Content;
        }
        self
    }

    /// Tool calls begun so far.
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// Parses the next ids of the reply.
    pub fn push(&mut self, ids: &[u32]) -> Vec<ReplyEvent> {
        let mut out = Vec::new();
        let mut run = 0;
        for (i, &id) in ids.iter().enumerate() {
            if self.markers.contains(id) {
                let text = self.decoder.push(&ids[run..i]) + &self.decoder.finish();
                self.text(&text, &mut out);
                self.marker(id, &mut out);
                run = i + 1;
            }
        }
        let text = self.decoder.push(&ids[run..]);
        self.text(&text, &mut out);
        out
    }

    /// Ends the reply: held-back text is released, an unterminated call is ended (its arguments as far as they
    /// came), a header without arguments is dropped.
    pub fn finish(&mut self) -> Vec<ReplyEvent> {
        let mut out = Vec::new();
        let tail = self.decoder.finish();
        self.text(&tail, &mut out);
        match self.phase {
            Phase::Start => emit(&mut out, ReplyEvent::Content(std::mem::take(&mut self.held))),
            Phase::Reasoning => emit(&mut out, ReplyEvent::Reasoning(std::mem::take(&mut self.held))),
            Phase::Arguments => out.push(ReplyEvent::ToolCallEnd { index: self.calls - 1 }),
            Phase::Content | Phase::Section | Phase::Header => {}
        }
        self.phase = Phase::Content;
        out
    }

    fn text(&mut self, text: &str, out: &mut Vec<ReplyEvent>) {
        if text.is_empty() {
            return;
        }
        match self.phase {
            Phase::Start => {
                self.held.push_str(text);
                let start = self.held.trim_start();
                if let Some(rest) = start.strip_prefix(THINK_BEGIN) {
                    let rest = rest.to_string();
                    self.held.clear();
                    self.phase = Phase::Reasoning;
                    self.text(&rest, out);
                } else if !THINK_BEGIN.starts_with(start) {
                    self.phase = Phase::Content;
                    emit(out, ReplyEvent::Content(std::mem::take(&mut self.held)));
                }
            }
            Phase::Reasoning => {
                self.held.push_str(text);
                if let Some(at) = self.held.find(THINK_END) {
                    let rest = self.held.split_off(at + THINK_END.len());
                    self.held.truncate(at);
                    emit(out, ReplyEvent::Reasoning(std::mem::take(&mut self.held)));
                    self.phase = Phase::Content;
                    self.text(&rest, out);
                } else {
                    let keep = partial_suffix(&self.held, THINK_END);
                    let tail = self.held.split_off(self.held.len() - keep);
                    emit(out, ReplyEvent::Reasoning(std::mem::replace(&mut self.held, tail)));
                }
            }
            Phase::Content => emit(out, ReplyEvent::Content(text.to_string())),
            Phase::Section => {}
            Phase::Header => self.header.push_str(text),
            Phase::Arguments => emit(out, ReplyEvent::ToolCallArguments { index: self.calls - 1, text: text.into() }),
        }
    }

    fn marker(&mut self, id: u32, out: &mut Vec<ReplyEvent>) {
        let m = self.markers;
        if id == m.section_begin {
            self.release_held(out);
            if matches!(self.phase, Phase::Start | Phase::Reasoning | Phase::Content) {
                self.phase = Phase::Section;
            }
        } else if id == m.call_begin {
            self.release_held(out);
            self.end_call(out);
            self.header.clear();
            self.phase = Phase::Header;
        } else if id == m.argument_begin {
            if self.phase == Phase::Header {
                let id = self.header.trim().to_string();
                let name = call_name(&id).to_string();
                out.push(ReplyEvent::ToolCallBegin { index: self.calls, id, name });
                self.calls += 1;
                self.phase = Phase::Arguments;
            }
        } else if id == m.call_end {
            self.end_call(out);
            if self.phase == Phase::Header {
                self.phase = Phase::Section;
            }
        } else if id == m.section_end {
            self.end_call(out);
            if matches!(self.phase, Phase::Section | Phase::Header) {
                self.phase = Phase::Content;
            }
        }
    }

    /// Releases text held at the start or in reasoning (a marker ends both).
    fn release_held(&mut self, out: &mut Vec<ReplyEvent>) {
        match self.phase {
            Phase::Start => emit(out, ReplyEvent::Content(std::mem::take(&mut self.held))),
            Phase::Reasoning => emit(out, ReplyEvent::Reasoning(std::mem::take(&mut self.held))),
            _ => {}
        }
    }

    /// Ends the call whose arguments are streaming, if any.
    fn end_call(&mut self, out: &mut Vec<ReplyEvent>) {
        if self.phase == Phase::Arguments {
            out.push(ReplyEvent::ToolCallEnd { index: self.calls - 1 });
            self.phase = Phase::Section;
        }
    }
}

/// Pushes a text event unless its text is empty.
fn emit(out: &mut Vec<ReplyEvent>, event: ReplyEvent) {
    let empty = match &event {
        ReplyEvent::Reasoning(t) | ReplyEvent::Content(t) => t.is_empty(),
        _ => false,
    };
    if !empty {
        out.push(event);
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag` (on a character boundary).
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// The function name in a call id `functions.NAME:IDX`: the last `.`-separated part before the first `:` (as
/// vLLM's `kimi_k2` parser takes it); an id without these separators is the name itself.
pub fn call_name(id: &str) -> &str {
    let before_colon = id.split(':').next().unwrap_or(id);
    before_colon.rsplit('.').next().unwrap_or(before_colon)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_names_come_from_kimi_ids() {
        assert_eq!(call_name("functions.get_weather:0"), "get_weather");
        assert_eq!(call_name("functions.a.b:12"), "b");
        assert_eq!(call_name("lookup"), "lookup");
    }

    #[test]
    fn partial_tags_are_held_to_a_character_boundary() {
        assert_eq!(partial_suffix("abc</th", "</think>"), 4);
        assert_eq!(partial_suffix("abc<", "</think>"), 1);
        assert_eq!(partial_suffix("abc", "</think>"), 0);
        assert_eq!(partial_suffix("é", "</think>"), 0);
    }
}
