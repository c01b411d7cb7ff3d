//! Token ids worth testing the detokenizer on, drawn from a raw value. Shared by the property tests
//! (`tests/prop_parsers.rs`) and the detokenizer fuzz target (`fuzz/fuzz_targets/detokenizer.rs`, which includes
//! this file by path).

use sparkd_tokenizer::specials::K3_SPECIAL_BASE;
use sparkd_tokenizer::CL100K_BASE_TOKENS;

/// Spreads a raw value over base tokens (single bytes among them), specials, the unused gap and past the end.
pub fn token_id(raw: u32) -> u32 {
    let v = raw >> 3;
    match raw & 7 {
        0 | 1 => v % 256,
        2 => K3_SPECIAL_BASE + v % 256,
        3 => CL100K_BASE_TOKENS + v % (K3_SPECIAL_BASE - CL100K_BASE_TOKENS),
        4 => K3_SPECIAL_BASE + 256 + v % 1024,
        _ => v % CL100K_BASE_TOKENS,
    }
}
