//! `sparkd-tokenizer`: the tokenizer the daemon serves with, its chat template, incremental detokenizer and
//! Hugging Face export, in a crate of its own so that tools (`sparkd-replay`) tokenize exactly as the daemon
//! does without linking the engine or the kernels.
//!
//! - [`Tokenizer`] (`bpe`): Kimi's tiktoken BPE (`tiktoken.model` + Kimi's regex and 256 reserved special
//!   ids), or the built-in cl100k_base ranks with K3's special tokens at their real ids. Every id it
//!   produces is below [`Tokenizer::vocab_size`] (163,840 for K3).
//! - [`ChatTemplate`] (`chat`): K2/K3's role-marker chat format rendered straight to token ids, and the
//!   Responses-API continuation of a kept turn, token-identical to resending the whole history.
//! - [`IncrementalDecoder`] (`detok`): streaming ids to text that never splits a UTF-8 character.
//! - [`ReplyParser`] (`reply`): a reply's ids split into reasoning, content and tool calls as they stream.
//! - [`export_hf`] (`export`): the same tokenizer as a Hugging Face tokenizer folder, so client-side
//!   tokenizers (AIPerf) count tokens exactly as the daemon does.
//!
//! Invariant shared by all parts: nothing here panics on input; failures are [`TokenizerError`]s.

mod bpe;
mod chat;
mod detok;
mod error;
mod export;
mod reply;
pub mod specials;

pub use bpe::{Tokenizer, VocabSource, CL100K_BASE_TOKENS, CL100K_PATTERN, KIMI_PATTERN};
pub use chat::{
    ChatMessage, ChatRole, ChatTemplate, RenderSpec, ToolCall, ToolMarkers, KIMI_DEFAULT_SYSTEM_PROMPT, THINK_BEGIN,
    THINK_END,
};
pub use detok::IncrementalDecoder;
pub use error::{Result, TokenizerError};
pub use export::export_hf;
pub use reply::{call_name, ReplyEvent, ReplyParser};
