//! Incremental detokenization for streaming: token ids in, complete UTF-8 text out.
//!
//! Invariants:
//! - `push` returns only whole characters. The bytes of a character split across tokens (emoji, CJK in a
//!   byte-level BPE) are held back until the character is complete, as llama.cpp's server does with
//!   `validate_utf8`; so the concatenation of all `push` outputs plus `finish` equals
//!   `decode_lossy` of the same (non-skipped) ids, and contains U+FFFD only where the bytes are truly
//!   invalid.
//! - Bytes that can never become valid (an invalid byte, or a partial character followed by something
//!   that does not continue it) are emitted at once as U+FFFD, exactly as `String::from_utf8_lossy` would.
//! - Special tokens are skipped unless [`IncrementalDecoder::with_special_tokens`] asks for their names.
//!   Ids that name no token (the unused gap of the built-in vocabulary) produce no text and are counted.

use super::bpe::Tokenizer;

/// Streams token ids to text without ever splitting a UTF-8 character.
#[derive(Clone, Debug)]
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    /// Bytes of an incomplete character at the end of the stream so far (at most 3).
    pending: Vec<u8>,
    include_special: bool,
    unknown_ids: usize,
}

impl IncrementalDecoder {
    /// A decoder that skips special tokens.
    pub fn new(tokenizer: Tokenizer) -> Self {
        IncrementalDecoder { tokenizer, pending: Vec::new(), include_special: false, unknown_ids: 0 }
    }

    /// Whether special tokens appear in the text as their names (`<|im_end|>`); off by default.
    pub fn with_special_tokens(mut self, include: bool) -> Self {
        self.include_special = include;
        self
    }

    /// Appends `ids` and returns the text that became complete.
    pub fn push(&mut self, ids: &[u32]) -> String {
        for &id in ids {
            if self.tokenizer.is_special(id) && !self.include_special {
                continue;
            }
            match self.tokenizer.token_bytes(id) {
                Some(bytes) => self.pending.extend_from_slice(bytes),
                None => self.unknown_ids += 1,
            }
        }
        self.take_complete()
    }

    /// Flushes the stream: a held-back incomplete character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let tail = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        tail
    }

    /// How many ids named no token and were dropped.
    pub fn unknown_ids(&self) -> usize {
        self.unknown_ids
    }

    /// Whether bytes of an incomplete character are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(text) => {
                    out.push_str(text);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid_end = start + e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[start..valid_end]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: keep it for the next push.
                        None => {
                            start = valid_end;
                            break;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid_end + bad;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
