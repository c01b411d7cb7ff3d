//! The one error type of `sparkd-workloads`.
//!
//! Invariant: every failure that bad input can cause (a trace file, a field in it, a CLI value, a
//! server response) is a variant here that names what is wrong and where; nothing in this crate
//! panics on input. `kind()` is a stable string used in reports and error counts.

use std::path::PathBuf;

/// Errors raised by trace readers, prompt synthesis, transports and reports.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// A trace file could not be read, or it is not valid JSON / JSONL.
    #[error("trace file {path}: {reason}")]
    TraceFile { path: PathBuf, reason: String },

    /// A trace field is missing, has the wrong type, or holds a value the replayer cannot use.
    #[error("trace file {path}: field `{field}`: {reason}")]
    TraceField { path: PathBuf, field: String, reason: String },

    /// A command-line value or run option is invalid.
    #[error("option `{option}`: {reason}")]
    Option { option: String, reason: String },

    /// The tokenizer cannot provide what prompt synthesis needs.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The server could not be reached, or the connection broke.
    #[error("connection: {0}")]
    Connection(String),

    /// The server answered with an error status or an `error` event.
    #[error("server error {status}: {body}")]
    Server { status: u16, body: String },

    /// The server's answer does not follow the wire protocol (bad SSE, bad JSON, missing usage).
    #[error("protocol: {0}")]
    Protocol(String),

    /// A report file could not be read or written, or it is malformed.
    #[error("report {path}: {reason}")]
    Report { path: PathBuf, reason: String },

    /// A chart could not be drawn (the plotting library refused the data or the drawing).
    #[error("plot {chart}: {reason}")]
    Plot { chart: String, reason: String },
}

impl ReplayError {
    /// A stable, low-cardinality name for the error.
    pub fn kind(&self) -> &'static str {
        match self {
            ReplayError::TraceFile { .. } => "trace_file",
            ReplayError::TraceField { .. } => "trace_field",
            ReplayError::Option { .. } => "option",
            ReplayError::Tokenizer(_) => "tokenizer",
            ReplayError::Connection(_) => "connection",
            ReplayError::Server { .. } => "server",
            ReplayError::Protocol(_) => "protocol",
            ReplayError::Report { .. } => "report",
            ReplayError::Plot { .. } => "plot",
        }
    }

    /// True for a server error that AIPerf counts as a context overflow (agentx.md §1.6.7): it
    /// ends the session instead of advancing it.
    pub fn is_context_overflow(&self) -> bool {
        const MARKERS: [&str; 4] =
            ["context length", "maximum context", "context_length_exceeded", "prompt is too long"];
        match self {
            ReplayError::Server { body, .. } => {
                let lower = body.to_lowercase();
                MARKERS.iter().any(|m| lower.contains(m))
            }
            _ => false,
        }
    }

    pub fn option(option: impl Into<String>, reason: impl Into<String>) -> Self {
        ReplayError::Option { option: option.into(), reason: reason.into() }
    }

    pub(crate) fn field(path: &std::path::Path, field: impl Into<String>, reason: impl Into<String>) -> Self {
        ReplayError::TraceField { path: path.to_path_buf(), field: field.into(), reason: reason.into() }
    }
}

pub type Result<T> = std::result::Result<T, ReplayError>;
