//! Fuzz target: the incremental detokenizer (`sparkd_tokenizer::IncrementalDecoder`) over the built-in tokenizer,
//! fed arbitrary token ids in arbitrary chunks: base tokens (single bytes among them, so characters split across
//! tokens), special tokens, ids of the unused gap of the built-in vocabulary and ids past its end.
//!
//! Checks its documented contract, for any ids and chunking, with special tokens skipped or named:
//! - nothing panics;
//! - the concatenation of every `push` output and `finish` equals `Tokenizer::decode_lossy` of the ids the decoder
//!   keeps (special ids only when named, never ids that name no token);
//! - `unknown_ids` counts the ids that name no token, and nothing is pending after `finish`.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use sparkd_tokenizer::{IncrementalDecoder, Tokenizer};

#[derive(Arbitrary, Debug)]
struct Input {
    raw_ids: Vec<u32>,
    chunks: Vec<u8>,
    special_tokens: bool,
}

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::builtin().expect("the built-in tokenizer builds"))
}

#[path = "../../tokenizer/tests/support/token_ids.rs"]
mod token_ids;

fuzz_target!(|input: Input| {
    let tokenizer = tokenizer();
    let ids: Vec<u32> = input.raw_ids.iter().map(|&raw| token_ids::token_id(raw)).collect();
    let mut decoder = IncrementalDecoder::new(tokenizer.clone()).with_special_tokens(input.special_tokens);
    let mut streamed = String::new();
    let mut rest = ids.as_slice();
    let mut sizes = input.chunks.iter().map(|&n| usize::from(n % 8));
    while !rest.is_empty() {
        let n = sizes.next().unwrap_or(rest.len()).min(rest.len());
        streamed.push_str(&decoder.push(&rest[..n]));
        rest = &rest[n..];
    }
    streamed.push_str(&decoder.finish());
    assert!(!decoder.has_pending());

    let skipped = |id: u32| tokenizer.is_special(id) && !input.special_tokens;
    let kept: Vec<u32> =
        ids.iter().copied().filter(|&id| !skipped(id) && tokenizer.token_bytes(id).is_some()).collect();
    let unknown = ids.iter().filter(|&&id| !skipped(id) && tokenizer.token_bytes(id).is_none()).count();
    assert_eq!(streamed, tokenizer.decode_lossy(&kept).expect("kept ids are in the vocabulary"));
    assert_eq!(decoder.unknown_ids(), unknown);
});
