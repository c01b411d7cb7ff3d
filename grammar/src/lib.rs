//! `sparkd-grammar`: constraints on generated tokens through llguidance (what vLLM, SGLang and llama.cpp use):
//! `response_format` JSON (any object, or a JSON Schema), a regex, a Lark grammar, and Kimi's tool-call section for
//! `tool_choice: required` or a named function, over sparkd's tokenizer.
//!
//! - [`GrammarEnv`]: the tokenizer as llguidance sees it (every id's bytes; special tokens as `\xFF` + name, so
//!   grammars name them as `<|tool_call_begin|>`) and the parser factory with its limits. Built once per model
//!   (it walks the vocabulary); cheap to clone.
//! - [`Constraint`]: one request's matcher: the mask of allowed ids for the next token, committing sampled
//!   tokens, and how much of a draft the grammar allows (so a draft is cut at its first forbidden token before
//!   verification).
//!
//! Invariants:
//! - Everything a client can make a constraint hold is bounded by llguidance's parser limits (grammar size, lexer
//!   states, per-mask work), set in [`GrammarEnv::new`]; past them the constraint fails with an error naming the
//!   limit, never a hang.
//! - JSON is written with fixed separators (`, `, `: `) and no free whitespace unless a schema asks otherwise
//!   (`x-guidance`), so a constrained reply cannot run on in whitespace.
//! - Masks are bitsets over the model's whole vocabulary: bit `id % 32` of word `id / 32` set means allowed, the
//!   layout of the runners' token masks. When the grammar is complete, only the end-of-turn id (`<|im_end|>`) is
//!   allowed, so a constrained reply ends as a turn.
//! - Errors are [`GrammarError`]s with a stable [`GrammarError::kind`]; nothing here panics on client input
//!   (llguidance turns its own panics into errors).

mod env;
mod tools;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

pub use env::SparkdTokEnv;
pub use tools::{tool_calls_grammar, ToolSpec};

/// What a constraint admits.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// `response_format: {"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `response_format: {"type": "json_schema", ...}`: text that validates against the schema.
    JsonSchema(Value),
    /// A regular expression (an extension field).
    Regex(String),
    /// A Lark grammar in llguidance's dialect (an extension field).
    Lark(String),
    /// Kimi's tool-call section calling one of `tools` (`parallel`: one or more calls), each call's arguments
    /// following its function's schema (`tool_choice: required` or a named function).
    ToolCalls { tools: Vec<ToolSpec>, parallel: bool },
}

/// A constraint that could not be built or followed.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The grammar, schema or regex is not valid (or past a limit when compiled).
    #[error("invalid {what}: {message}")]
    Invalid { what: &'static str, message: String },
    /// The matcher failed while generating (a token it forbids, or a limit hit computing a mask).
    #[error("the output constraint failed: {0}")]
    Matcher(String),
    /// The tokenizer could not be described to llguidance.
    #[error("the tokenizer cannot be used for constraints: {0}")]
    Tokenizer(String),
}

impl GrammarError {
    /// A stable name for the error (metric label, API error code).
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarError::Invalid { .. } => "invalid_grammar",
            GrammarError::Matcher(_) => "constraint_failed",
            GrammarError::Tokenizer(_) => "tokenizer",
        }
    }
}

pub type Result<T> = std::result::Result<T, GrammarError>;

/// Largest grammar (symbols in productions) a request may compile; llguidance's default is 500,000.
pub const MAX_GRAMMAR_SIZE: usize = 200_000;
/// Most lexer states one constraint may build (about 1-2 kB each); llguidance's default is 250,000.
pub const MAX_LEXER_STATES: usize = 50_000;

/// The tokenizer and parser factory constraints are built from (see the crate docs).
#[derive(Clone)]
pub struct GrammarEnv {
    factory: Arc<ParserFactory>,
    vocab: usize,
    end_of_turn: u32,
}

impl std::fmt::Debug for GrammarEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEnv").field("vocab", &self.vocab).field("end_of_turn", &self.end_of_turn).finish()
    }
}

impl GrammarEnv {
    /// Describes `tokenizer` to llguidance, with `<|im_end|>` as the end of a constrained reply.
    pub fn new(tokenizer: &sparkd_tokenizer::Tokenizer) -> Result<Self> {
        let env = SparkdTokEnv::new(tokenizer)?;
        let end_of_turn = env.end_of_turn();
        let vocab = tokenizer.vocab_size();
        let tok_env: toktrie::TokEnv = Arc::new(env);
        let mut factory = ParserFactory::new_simple(&tok_env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        let limits = factory.limits_mut();
        limits.max_grammar_size = MAX_GRAMMAR_SIZE;
        limits.max_lexer_states = MAX_LEXER_STATES;
        Ok(GrammarEnv { factory: Arc::new(factory), vocab, end_of_turn })
    }

    /// The vocabulary the masks cover.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// A fresh constraint admitting what `spec` says; an invalid grammar is an error naming what is wrong.
    pub fn constraint(&self, spec: &ConstraintSpec) -> Result<Constraint> {
        let (what, grammar) = match spec {
            ConstraintSpec::JsonObject => (
                "JSON object",
                TopLevelGrammar::from_json_schema(fixed_whitespace(&serde_json::json!({"type": "object"}))),
            ),
            ConstraintSpec::JsonSchema(schema) => {
                ("JSON Schema", TopLevelGrammar::from_json_schema(fixed_whitespace(schema)))
            }
            ConstraintSpec::Regex(rx) => ("regex", TopLevelGrammar::from_regex(rx)),
            ConstraintSpec::Lark(lark) => ("Lark grammar", TopLevelGrammar::from_lark(lark.clone())),
            ConstraintSpec::ToolCalls { tools, parallel } => {
                ("tool-call grammar", TopLevelGrammar::from_lark(tool_calls_grammar(tools, *parallel)?))
            }
        };
        let parser =
            self.factory.create_parser(grammar).map_err(|e| GrammarError::Invalid { what, message: e.to_string() })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(message) = matcher.get_error() {
            return Err(GrammarError::Invalid { what, message });
        }
        Ok(Constraint { matcher, vocab: self.vocab, end_of_turn: self.end_of_turn, committed: 0 })
    }
}

/// One request's matcher (see the crate docs).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    end_of_turn: u32,
    committed: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("committed", &self.committed).finish()
    }
}

impl Constraint {
    /// The ids allowed next, as `ceil(vocab / 32)` words (bit `id % 32` of word `id / 32`); the end of turn (the
    /// environment's end-of-sequence id) where the grammar may end, and only it once the grammar is complete.
    pub fn allowed(&mut self) -> Result<Vec<u32>> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| GrammarError::Matcher(e.to_string()))?;
        let mut out = vec![0u32; self.vocab.div_ceil(32)];
        let bits = mask.as_slice();
        let n = out.len().min(bits.len());
        out[..n].copy_from_slice(&bits[..n]);
        Ok(out)
    }

    /// Advances past `tokens` (sampled or accepted). A token the grammar forbids is an error (the runner applied
    /// another mask); the end of turn is accepted where the grammar may end, and again after it has.
    pub fn commit(&mut self, tokens: &[u32]) -> Result<()> {
        for &t in tokens {
            if !(t == self.end_of_turn && self.matcher.is_stopped()) {
                self.matcher.consume_token(t).map_err(|e| GrammarError::Matcher(e.to_string()))?;
            }
            self.committed += 1;
        }
        Ok(())
    }

    /// How many leading tokens of `draft` the grammar allows from here (nothing is committed): a draft is cut
    /// there before it is verified.
    pub fn allowed_prefix(&mut self, draft: &[u32]) -> Result<usize> {
        if self.matcher.is_stopped() {
            return Ok(usize::from(draft.first() == Some(&self.end_of_turn)));
        }
        self.matcher.validate_tokens(draft).map_err(|e| GrammarError::Matcher(e.to_string()))
    }

    /// Whether the grammar may end here.
    pub fn is_accepting(&mut self) -> Result<bool> {
        if self.matcher.is_stopped() {
            return Ok(true);
        }
        self.matcher.is_accepting().map_err(|e| GrammarError::Matcher(e.to_string()))
    }

    /// Tokens committed so far.
    pub fn committed(&self) -> usize {
        self.committed
    }
}

/// `schema` with JSON written as Python's `json.dumps` writes it (`, ` and `: `, no other whitespace), unless the
/// schema sets llguidance's options itself (`x-guidance`). llguidance's default lets whitespace run on between
/// tokens, and a model can loop there (the "endless newlines" failure of JSON modes).
pub(crate) fn fixed_whitespace(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(map) = schema.as_object_mut() {
        if !map.contains_key("x-guidance") {
            map.insert(
                "x-guidance".into(),
                serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
            );
        }
    }
    schema
}
