//! A reply's tokens turned into what the API returns: plain text (completions), or, for chat and Responses,
//! reasoning, content and tool-call deltas ([`ReplyText`], over `sparkd_tokenizer::ReplyParser`).
//!
//! Invariants:
//! - Each step's tokens (one or many: speculation emits several per step) give the same pieces, once joined,
//!   whatever the steps' sizes (the parser's invariant).
//! - Tool calls are reported only when the request allows them (`tool_choice` other than `none`), and with
//!   `parallel_tool_calls: false` only the reply's first call is.

use sparkd_tokenizer::{IncrementalDecoder, ReplyEvent, ReplyParser, Tokenizer};

use super::error::ApiError;
use super::tools::Tools;

/// One step's part of a tool call: the header (id and name, arguments empty) when the call begins, then
/// fragments of its arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub index: usize,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

/// What one step added to the reply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pieces {
    pub content: String,
    pub reasoning: String,
    pub calls: Vec<ToolCallDelta>,
}

/// How a reply is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyForm {
    /// All of it is text (`/v1/completions`).
    Text,
    /// A chat reply: reasoning (when `thinking`), content and, when `calls`, tool calls (only the first unless
    /// `parallel`).
    Chat { calls: bool, parallel: bool, thinking: bool },
}

impl ReplyForm {
    /// A chat reply under the request's tools: calls reported unless `tool_choice` is `none` (or no tools are
    /// declared), all of them unless `parallel_tool_calls` is false; with `thinking` off, a think tag is content.
    pub fn chat(tools: Option<&Tools>, thinking: bool) -> Self {
        ReplyForm::Chat {
            calls: tools.is_some_and(Tools::reports_calls),
            parallel: tools.is_none_or(|t| t.parallel),
            thinking,
        }
    }
}

/// Reads one reply, step by step.
#[derive(Clone, Debug)]
pub enum ReplyText {
    Text(IncrementalDecoder),
    Chat { parser: Box<ReplyParser>, calls: bool, parallel: bool, ended: usize },
}

impl ReplyText {
    pub fn new(tokenizer: &Tokenizer, form: ReplyForm) -> Result<Self, ApiError> {
        Ok(match form {
            ReplyForm::Text => ReplyText::Text(IncrementalDecoder::new(tokenizer.clone())),
            ReplyForm::Chat { calls, parallel, thinking } => {
                let parser = ReplyParser::new(tokenizer).map_err(|e| ApiError::Internal(e.to_string()))?;
                let parser = if thinking { parser } else { parser.without_thinking() };
                ReplyText::Chat { parser: Box::new(parser), calls, parallel, ended: 0 }
            }
        })
    }

    /// The pieces of the next step's tokens.
    pub fn push(&mut self, tokens: &[u32]) -> Pieces {
        match self {
            ReplyText::Text(decoder) => Pieces { content: decoder.push(tokens), ..Pieces::default() },
            ReplyText::Chat { parser, .. } => {
                let events = parser.push(tokens);
                self.gather(events)
            }
        }
    }

    /// The pieces held back until the end of the reply.
    pub fn finish(&mut self) -> Pieces {
        match self {
            ReplyText::Text(decoder) => Pieces { content: decoder.finish(), ..Pieces::default() },
            ReplyText::Chat { parser, .. } => {
                let events = parser.finish();
                self.gather(events)
            }
        }
    }

    /// Tool calls reported and ended so far.
    pub fn calls_ended(&self) -> usize {
        match self {
            ReplyText::Text(_) => 0,
            ReplyText::Chat { ended, .. } => *ended,
        }
    }

    fn gather(&mut self, events: Vec<ReplyEvent>) -> Pieces {
        let ReplyText::Chat { calls, parallel, ended, .. } = self else { return Pieces::default() };
        let reported = |index: usize| *calls && (*parallel || index == 0);
        let mut p = Pieces::default();
        for event in events {
            match event {
                ReplyEvent::Reasoning(t) => p.reasoning.push_str(&t),
                ReplyEvent::Content(t) => p.content.push_str(&t),
                ReplyEvent::ToolCallBegin { index, id, name } if reported(index) => {
                    p.calls.push(ToolCallDelta { index, id: Some(id), name: Some(name), arguments: String::new() })
                }
                ReplyEvent::ToolCallArguments { index, text } if reported(index) => match p.calls.last_mut() {
                    Some(last) if last.index == index => last.arguments.push_str(&text),
                    _ => p.calls.push(ToolCallDelta { index, id: None, name: None, arguments: text }),
                },
                ReplyEvent::ToolCallEnd { index } if reported(index) => *ended += 1,
                ReplyEvent::ToolCallBegin { .. }
                | ReplyEvent::ToolCallArguments { .. }
                | ReplyEvent::ToolCallEnd { .. } => {}
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use sparkd_tokenizer::ChatTemplate;

    use super::*;

    fn ids(chat: &ChatTemplate) -> Vec<u32> {
        let tok = chat.tokenizer();
        let m = chat.tool_markers();
        [
            tok.encode("<think>r</think>c"),
            vec![m.section_begin, m.call_begin],
            tok.encode("functions.a:0"),
            vec![m.argument_begin],
            tok.encode("{\"x\":1}"),
            vec![m.call_end, m.call_begin],
            tok.encode("functions.b:1"),
            vec![m.argument_begin],
            tok.encode("{}"),
            vec![m.call_end, m.section_end],
        ]
        .concat()
    }

    fn run(form: ReplyForm) -> (Pieces, usize) {
        let chat = ChatTemplate::new(Tokenizer::builtin().unwrap()).unwrap();
        let mut r = ReplyText::new(chat.tokenizer(), form).unwrap();
        let mut all = Pieces::default();
        for step in ids(&chat).chunks(3) {
            let p = r.push(step);
            all.content.push_str(&p.content);
            all.reasoning.push_str(&p.reasoning);
            all.calls.extend(p.calls);
        }
        all.calls.extend(r.finish().calls);
        (all, r.calls_ended())
    }

    fn assembled(calls: &[ToolCallDelta]) -> Vec<(usize, String, String)> {
        let mut out: Vec<(usize, String, String)> = Vec::new();
        for c in calls {
            match &c.name {
                Some(name) => out.push((c.index, name.clone(), c.arguments.clone())),
                None => out.last_mut().unwrap().2.push_str(&c.arguments),
            }
        }
        out
    }

    #[test]
    fn chat_replies_report_calls_as_the_request_allows() {
        let (p, ended) = run(ReplyForm::Chat { calls: true, parallel: true, thinking: true });
        assert_eq!((p.reasoning.as_str(), p.content.as_str(), ended), ("r", "c", 2));
        assert_eq!(assembled(&p.calls), vec![(0, "a".into(), "{\"x\":1}".into()), (1, "b".into(), "{}".into())]);
        let (p, ended) = run(ReplyForm::Chat { calls: true, parallel: false, thinking: true });
        assert_eq!((assembled(&p.calls).len(), ended), (1, 1));
        let (p, ended) = run(ReplyForm::Chat { calls: false, parallel: true, thinking: true });
        assert_eq!((p.calls.len(), ended, p.content.as_str()), (0, 0, "c"));
        // Completions read everything as text (markers are special ids and give none).
        let (p, _) = run(ReplyForm::Text);
        assert_eq!(p.content, "<think>r</think>cfunctions.a:0{\"x\":1}functions.b:1{}");
    }
}
