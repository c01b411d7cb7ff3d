//! The one error type of `sparkd-spec`.
//!
//! Invariant: bad configuration or input (a malformed SPS profile, an out-of-range knob, a draft
//! whose confidences do not match its tokens) is a variant here naming what is wrong; nothing in
//! this crate panics on input. `kind()` is a stable string for metric labels and JSON error bodies.

/// Errors raised by proposers, budgets and profiles.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// A knob holds a value the policy cannot use.
    #[error("speculation setting `{field}`: {reason}")]
    Config { field: &'static str, reason: String },

    /// An SPS(B) profile is empty, unordered or holds non-positive rates.
    #[error("SPS profile: {0}")]
    Profile(String),

    /// A profile file could not be read or parsed.
    #[error("SPS profile file {path}: {reason}")]
    ProfileFile { path: String, reason: String },

    /// Per-step input that breaks the contract (confidences out of [0, 1], lengths that disagree).
    #[error("invalid speculation input: {0}")]
    InvalidInput(String),

    /// Forced-acceptance schedules are validated in `sparkd-kernels`.
    #[error(transparent)]
    Kernel(#[from] sparkd_kernels::KernelError),
}

impl SpecError {
    /// A stable, low-cardinality name for the error, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            SpecError::Config { .. } => "config",
            SpecError::Profile(_) => "profile",
            SpecError::ProfileFile { .. } => "profile_file",
            SpecError::InvalidInput(_) => "invalid_input",
            SpecError::Kernel(e) => e.kind(),
        }
    }

    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        SpecError::Config { field, reason: reason.into() }
    }
}

pub type Result<T> = std::result::Result<T, SpecError>;
