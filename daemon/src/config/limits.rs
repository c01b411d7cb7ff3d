//! The per-request limits of `sparkd serve` (`--max-prompt-chars`, `--max-stop-strings`, `--max-stop-chars`,
//! `--max-logprobs`) and the size of the pool that prepares requests (`--prep-threads`).
//!
//! Invariants:
//! - Every limit is at least 1 ([`LimitArgs::validate`] names the flag otherwise); `--max-logprobs` may be 0
//!   (no alternatives, only the chosen token's log-probability).
//! - Without `--max-prompt-chars` the prompt limit follows the context actually served
//!   ([`RequestLimits::for_context`]).

use super::ConfigError;
use crate::api::limits::{RequestLimits, DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS};
use crate::api::prep::PrepPool;

/// Request limits and request preparation.
#[derive(Clone, Debug, clap::Args)]
pub struct LimitArgs {
    /// Longest prompt, in characters (chat messages with their tools, completion text or Responses input),
    /// refused with 400 before it is tokenized. Default: 32 per token of the context (--max-model-len).
    #[arg(long, value_name = "CHARS")]
    pub max_prompt_chars: Option<usize>,
    /// Most stop strings per request.
    #[arg(long, default_value_t = DEFAULT_MAX_STOP_STRINGS)]
    pub max_stop_strings: usize,
    /// Longest stop string, in characters.
    #[arg(long, default_value_t = DEFAULT_MAX_STOP_CHARS)]
    pub max_stop_chars: usize,
    /// Most alternatives per token a request may ask for (`top_logprobs`, legacy `logprobs`).
    #[arg(long, default_value_t = DEFAULT_MAX_LOGPROBS)]
    pub max_logprobs: usize,
    /// Requests parsed, rendered and tokenized at once, off the I/O threads. Default: half the cores.
    #[arg(long, value_name = "N")]
    pub prep_threads: Option<usize>,
}

impl LimitArgs {
    /// Checks the values that clap's types cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("max-prompt-chars", self.max_prompt_chars.unwrap_or(1)),
            ("max-stop-strings", self.max_stop_strings),
            ("max-stop-chars", self.max_stop_chars),
            ("prep-threads", self.prep_threads.unwrap_or(1)),
        ];
        match positive.iter().find(|(_, v)| *v == 0) {
            Some((flag, _)) => Err(ConfigError { flag, reason: "must be at least 1".into() }),
            None => Ok(()),
        }
    }

    /// The limits for a served context of `max_model_len` tokens.
    pub fn request_limits(&self, max_model_len: usize) -> RequestLimits {
        let defaults = RequestLimits::for_context(max_model_len);
        RequestLimits {
            max_prompt_chars: self.max_prompt_chars.unwrap_or(defaults.max_prompt_chars),
            max_stop_strings: self.max_stop_strings,
            max_stop_chars: self.max_stop_chars,
            max_logprobs: self.max_logprobs,
        }
    }

    /// Threads of the preparation pool.
    pub fn prep_threads(&self) -> usize {
        self.prep_threads.unwrap_or_else(PrepPool::default_threads)
    }
}
