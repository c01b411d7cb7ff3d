//! The daemon's tokenizer as the [`TokenCodec`] prompt synthesis uses.
//!
//! Invariant: the pool is vetted against the very tokenizer the daemon serves with
//! (`sparkd_tokenizer::Tokenizer`), so synthesized text re-encodes there to exactly the chosen ids.

use sparkd_tokenizer::Tokenizer;

use crate::error::{ReplayError, Result};
use crate::synth::TokenCodec;

impl TokenCodec for Tokenizer {
    fn vocab_size(&self) -> u32 {
        self.n_base() as u32
    }

    fn token_text(&self, id: u32) -> Option<String> {
        if self.is_special(id) {
            return None;
        }
        self.token_bytes(id).and_then(|b| String::from_utf8(b.to_vec()).ok())
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        Tokenizer::encode(self, text)
    }
}

/// The daemon's tokenizer: the built-in one, or the one of a checkpoint folder (`tiktoken.model`).
pub fn daemon_tokenizer(model_dir: Option<&std::path::Path>) -> Result<Tokenizer> {
    match model_dir {
        Some(dir) => Tokenizer::from_dir(dir),
        None => Tokenizer::builtin(),
    }
    .map_err(|e| ReplayError::Tokenizer(e.to_string()))
}
