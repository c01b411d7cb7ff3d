//! The per-request limits of `sparkd serve` (`--max-prompt-chars`, `--max-stop-strings`, `--max-stop-chars`,
//! `--max-logprobs`), the size of the pool that prepares requests (`--prep-threads`), and the connection
//! bounds (`--max-connections`, `--header-timeout`, `--idle-timeout`, `--max-ws-streams`).
//!
//! Invariants:
//! - Every limit is at least 1 ([`LimitArgs::validate`] names the flag otherwise); `--max-logprobs` may be 0
//!   (no alternatives, only the chosen token's log-probability).
//! - Without `--max-prompt-chars` the prompt limit follows the context actually served
//!   ([`RequestLimits::for_context`]).
//! - Connections need file descriptors: without `--max-connections` the bound is what the open-file limit leaves
//!   after [`RESERVED_FILES`] (at most [`DEFAULT_MAX_CONNECTIONS`]); a `--max-connections` the limit cannot
//!   hold is refused at start-up, naming `ulimit -n`.

use std::time::Duration;

use super::ConfigError;
use crate::api::conn::ConnLimits;
use crate::api::limits::{RequestLimits, DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_STOP_CHARS, DEFAULT_MAX_STOP_STRINGS};
use crate::api::prep::PrepPool;
use crate::api::{DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_WS_STREAMS};

/// File descriptors kept for everything but client connections: checkpoint shards, the engine, logs.
pub const RESERVED_FILES: u64 = 256;

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
    /// Connections open at once (WebSockets included); past it new connections wait. Default: what the
    /// open-file limit allows, at most 16384.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Seconds a request's head may take from its first byte (slow clients are disconnected); a request body
    /// that stalls this long is a 408.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_HEADER_TIMEOUT.as_secs())]
    pub header_timeout: u64,
    /// Seconds a connection or WebSocket may sit with no request and no traffic before it is closed (also the
    /// longest a request body may take).
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_IDLE_TIMEOUT.as_secs())]
    pub idle_timeout: u64,
    /// Responses in progress at once on one WebSocket.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_WS_STREAMS)]
    pub max_ws_streams: usize,
}

impl LimitArgs {
    /// Checks the values that clap's types cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("max-prompt-chars", self.max_prompt_chars.unwrap_or(1)),
            ("max-stop-strings", self.max_stop_strings),
            ("max-stop-chars", self.max_stop_chars),
            ("prep-threads", self.prep_threads.unwrap_or(1)),
            ("max-connections", self.max_connections.unwrap_or(1)),
            ("header-timeout", self.header_timeout as usize),
            ("idle-timeout", self.idle_timeout as usize),
            ("max-ws-streams", self.max_ws_streams),
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

    /// The connection bounds under an open-file limit of `open_files`.
    pub fn conn_limits(&self, open_files: u64) -> Result<ConnLimits, ConfigError> {
        let room = usize::try_from(open_files.saturating_sub(RESERVED_FILES)).unwrap_or(usize::MAX);
        let max_connections = match self.max_connections {
            Some(n) if n > room => {
                return Err(ConfigError {
                    flag: "max-connections",
                    reason: format!(
                        "{n} connections need more file descriptors than the open-file limit ({open_files}) leaves \
                         after {RESERVED_FILES} for the daemon itself; raise `ulimit -n` or lower the flag"
                    ),
                })
            }
            Some(n) => n,
            None if room == 0 => {
                return Err(ConfigError {
                    flag: "max-connections",
                    reason: format!(
                        "the open-file limit ({open_files}) leaves no room for connections; raise `ulimit -n`"
                    ),
                })
            }
            None => room.min(DEFAULT_MAX_CONNECTIONS),
        };
        Ok(ConnLimits {
            max_connections,
            header_timeout: Duration::from_secs(self.header_timeout),
            idle_timeout: Duration::from_secs(self.idle_timeout),
            max_ws_streams: self.max_ws_streams,
        })
    }

    /// Threads of the preparation pool.
    pub fn prep_threads(&self) -> usize {
        self.prep_threads.unwrap_or_else(PrepPool::default_threads)
    }
}
