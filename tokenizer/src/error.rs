//! The one error type of `sparkd-tokenizer`.
//!
//! Invariant: every failure bad input can cause (a malformed `tiktoken.model`, a token id outside the
//! vocabulary, a chat message with an unknown role, an export folder that cannot be written) is a variant
//! here that names what is wrong; nothing in the tokenizer panics on input. `kind()` is a stable string
//! used as a metric label and in JSON error bodies.

use std::path::PathBuf;

/// Errors raised while loading, using or exporting the tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file (`tiktoken.model`, `tokenizer_config.json`) could not be read or is malformed.
    #[error("tokenizer file {path}: {reason}")]
    File { path: PathBuf, reason: String },

    /// The BPE could not be built (the split regex did not compile, the built-in ranks are not dense).
    #[error("building the tokenizer: {0}")]
    Build(String),

    /// A token id that names no token of this vocabulary.
    #[error("token id {0} is outside the vocabulary")]
    UnknownTokenId(u32),

    /// Decoded bytes that are not valid UTF-8 (strict decoding only).
    #[error("decoded bytes are not valid UTF-8 (first bad byte at offset {0})")]
    InvalidUtf8(usize),

    /// A special token the chat template needs is not in this vocabulary.
    #[error("special token `{0}` is not in the vocabulary")]
    MissingSpecialToken(String),

    /// A chat message whose role the template does not know.
    #[error("message {index}: unknown role `{role}` (expected system, developer, user, assistant or tool)")]
    UnknownRole { index: usize, role: String },

    /// Writing the Hugging Face export failed.
    #[error("exporting the tokenizer to {path}: {reason}")]
    Export { path: PathBuf, reason: String },
}

impl TokenizerError {
    /// A stable, low-cardinality name for the error, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenizerError::File { .. } => "tokenizer_file",
            TokenizerError::Build(_) => "tokenizer_build",
            TokenizerError::UnknownTokenId(_) => "unknown_token_id",
            TokenizerError::InvalidUtf8(_) => "invalid_utf8",
            TokenizerError::MissingSpecialToken(_) => "missing_special_token",
            TokenizerError::UnknownRole { .. } => "unknown_role",
            TokenizerError::Export { .. } => "tokenizer_export",
        }
    }

    pub(crate) fn file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        TokenizerError::File { path: path.into(), reason: reason.into() }
    }
}

pub type Result<T> = std::result::Result<T, TokenizerError>;
