//! The one error type of `sparkd-kernels`.
//!
//! Invariant: every failure that bad input can cause (a config field, a checkpoint file, a tensor,
//! a state handle) is a variant here that names what is wrong; nothing in this crate panics on
//! input. `kind()` is a stable string used as a metric label and in JSON error bodies.

use std::path::PathBuf;

/// Errors raised by configs, checkpoints, states and runners.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A `config.json` field is missing, has the wrong type, or holds a value sparkd does not support.
    #[error("config field `{field}`: {reason}")]
    Config { field: String, reason: String },

    /// A checkpoint file could not be read or parsed (I/O, JSON, safetensors header).
    #[error("checkpoint file {path}: {reason}")]
    CheckpointFile { path: PathBuf, reason: String },

    /// A tensor the model needs is absent from the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor { name: String },

    /// A tensor is present but its shape or dtype is not what the config implies.
    #[error("tensor `{name}`: expected {expected}, found {found}")]
    TensorMismatch { name: String, expected: String, found: String },

    /// A per-sequence state handle that does not exist (freed, never allocated).
    #[error("unknown sequence state {0}")]
    UnknownState(u64),

    /// A request the runner cannot serve (a window too long, a token id outside the vocabulary, ...).
    #[error("invalid step input: {0}")]
    InvalidInput(String),

    /// The device backend is not available or failed.
    #[error("device: {0}")]
    Device(String),

    /// Plain I/O not tied to a checkpoint file.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

impl KernelError {
    /// A stable, low-cardinality name for the error, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            KernelError::Config { .. } => "config",
            KernelError::CheckpointFile { .. } => "checkpoint_file",
            KernelError::MissingTensor { .. } => "missing_tensor",
            KernelError::TensorMismatch { .. } => "tensor_mismatch",
            KernelError::UnknownState(_) => "unknown_state",
            KernelError::InvalidInput(_) => "invalid_input",
            KernelError::Device(_) => "device",
            KernelError::Io(_) => "io",
        }
    }

    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        KernelError::Config { field: field.into(), reason: reason.into() }
    }
}

pub type Result<T> = std::result::Result<T, KernelError>;
