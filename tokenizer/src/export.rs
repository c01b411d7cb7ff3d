//! The served tokenizer as a Hugging Face tokenizer folder, so client-side tokenizers (AIPerf loads one with
//! `transformers`/`tokenizers`) count tokens exactly as the daemon does.
//!
//! Written files: `tokenizer.json`, `tokenizer_config.json` (with the chat template of
//! [`ChatTemplate::JINJA`](super::ChatTemplate::JINJA)), `special_tokens_map.json`.
//!
//! The conversion is the standard tiktoken-to-HF one: tokens become strings through GPT-2's byte-to-unicode
//! map; the pre-tokenizer is the same regex (`Split`, isolated) followed by a byte-level map without its own
//! regex; the model is a byte-level BPE whose merges are recovered by running BPE over each token's bytes
//! with only the lower ranks, ordered by the rank of the merged token; `ignore_merges` makes a piece that is
//! a whole token map to it directly, as tiktoken does. Special tokens are added tokens at their ids (and in
//! the model vocabulary, so that the ids survive loading).
//!
//! Special-token text: the daemon never reads a special token out of text (a literal `<|im_end|>` in a message
//! is seven ordinary tokens; markers come from the chat template, as ids). `tokenizer_config.json` sets
//! `split_special_tokens: true`, so `transformers` clients (AIPerf counts prompt and output text this way) count
//! text as the daemon does. Rendering the chat template to text and tokenizing it needs the markers read back:
//! `apply_chat_template(..., tokenizer_kwargs={"split_special_tokens": False})`. `tokenizer.json` has no such
//! switch: the `tokenizers` package alone reads markers unless `encode_special_tokens = True` is set.
//!
//! Invariants: every base token has a vocabulary entry at its rank; every merge `(a, b)` has `a`, `b` and
//! `a + b` in the vocabulary and sits at the position of `rank(a + b)` in rank order.
//! Known difference: the daemon cuts texts into 25,000-character whitespace/non-whitespace runs before the
//! regex (Kimi's rule); Hugging Face does not, so texts with longer runs may tokenize differently.

use std::path::Path;

use rustc_hash::FxHashMap;
use serde_json::{json, Map, Value};

use super::bpe::Tokenizer;
use super::chat::ChatTemplate;
use super::error::{Result, TokenizerError};
use super::specials::{BOS, EOS, PAD, UNK};

/// Writes `tokenizer` as a Hugging Face tokenizer folder into `dir` (created if missing).
pub fn export_hf(tokenizer: &Tokenizer, dir: &Path) -> Result<()> {
    let fail = |reason: String| TokenizerError::Export { path: dir.to_path_buf(), reason };
    std::fs::create_dir_all(dir).map_err(|e| fail(format!("cannot create the folder: {e}")))?;

    let tokenizer_json = tokenizer_json(tokenizer).map_err(fail)?;
    let present = |name: &str| tokenizer.token_id(name).map(|_| Value::from(name)).unwrap_or(Value::Null);
    let mut added_decoder = Map::new();
    for (id, name) in tokenizer.special_tokens() {
        added_decoder.insert(id.to_string(), added_token_fields(name));
    }
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_decoder,
        "bos_token": present(BOS),
        "eos_token": present(EOS),
        "unk_token": present(UNK),
        "pad_token": present(PAD),
        "add_bos_token": false,
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "split_special_tokens": true,
        "model_max_length": 1_048_576,
        "chat_template": ChatTemplate::JINJA,
    });
    let mut special_map = Map::new();
    for (key, name) in [("bos_token", BOS), ("eos_token", EOS), ("unk_token", UNK), ("pad_token", PAD)] {
        if tokenizer.token_id(name).is_some() {
            special_map.insert(key.into(), Value::from(name));
        }
    }

    let write = |file: &str, value: &Value| -> Result<()> {
        let text = serde_json::to_string(value).map_err(|e| fail(format!("{file}: {e}")))?;
        std::fs::write(dir.join(file), text).map_err(|e| fail(format!("{file}: {e}")))
    };
    write("tokenizer.json", &tokenizer_json)?;
    write("tokenizer_config.json", &config)?;
    write("special_tokens_map.json", &Value::Object(special_map))
}

fn added_token_fields(name: &str) -> Value {
    json!({
        "content": name, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true,
    })
}

/// Builds the `tokenizer.json` document.
fn tokenizer_json(tokenizer: &Tokenizer) -> std::result::Result<Value, String> {
    let byte_chars = byte_to_unicode();
    let ranks = tokenizer.ranks();
    let token_string = |bytes: &[u8]| bytes.iter().map(|&b| byte_chars[b as usize]).collect::<String>();

    let mut vocab = Map::new();
    for (rank, bytes) in ranks.iter().enumerate() {
        vocab.insert(token_string(bytes), Value::from(rank));
    }
    let mut added_tokens = Vec::new();
    for (id, name) in tokenizer.special_tokens() {
        if vocab.insert(name.to_string(), Value::from(id)).is_some() {
            return Err(format!("special token `{name}` has the same string as a base token"));
        }
        let mut fields = added_token_fields(name);
        fields["id"] = Value::from(id);
        added_tokens.push(fields);
    }
    let merges: Vec<Value> = recover_merges(ranks)
        .into_iter()
        .map(|(left, right)| json!([token_string(left), token_string(right)]))
        .collect();

    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": tokenizer.pattern()}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            ],
        },
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": true,
            "vocab": vocab,
            "merges": merges,
        },
    }))
}

/// GPT-2's reversible byte-to-unicode map: printable Latin-1 bytes map to themselves, the others to
/// U+0100 onwards in byte order.
fn byte_to_unicode() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for byte in 0..=255u8 {
        table[byte as usize] = if printable(byte) {
            char::from(byte)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
    }
    table
}

/// For each multi-byte token in rank order, the two parts that BPE restricted to lower ranks merges into
/// it. Tokens that lower-rank BPE cannot build from exactly two parts get no merge (they are still reached
/// whole through `ignore_merges`).
fn recover_merges(ranks: &[Vec<u8>]) -> Vec<(&[u8], &[u8])> {
    let rank_of: FxHashMap<&[u8], usize> = ranks.iter().enumerate().map(|(r, b)| (b.as_slice(), r)).collect();
    let mut merges = Vec::with_capacity(ranks.len());
    // Part boundaries: part i is token[bounds[i]..bounds[i + 1]].
    let mut bounds: Vec<usize> = Vec::new();
    for (rank, token) in ranks.iter().enumerate() {
        if token.len() < 2 {
            continue;
        }
        bounds.clear();
        bounds.extend(0..=token.len());
        while bounds.len() > 3 {
            let best = (0..bounds.len() - 2)
                .filter_map(|i| rank_of.get(&token[bounds[i]..bounds[i + 2]]).map(|&r| (r, i)))
                .filter(|&(r, _)| r < rank)
                .min();
            match best {
                Some((_, i)) => {
                    bounds.remove(i + 1);
                }
                None => break,
            }
        }
        if bounds.len() == 3 {
            merges.push((&token[..bounds[1]], &token[bounds[1]..]));
        }
    }
    merges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_onto_printable_characters() {
        let table = byte_to_unicode();
        let distinct: std::collections::HashSet<char> = table.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(table[b'a' as usize], 'a');
        assert_eq!(table[b' ' as usize], '\u{120}'); // 'Ġ'
        assert_eq!(table[b'\n' as usize], '\u{10a}'); // 'Ċ'
        assert!(table.iter().all(|c| !c.is_whitespace() && !c.is_control()));
    }

    #[test]
    fn merges_follow_lower_rank_bpe() {
        let ranks: Vec<Vec<u8>> =
            [&b"a"[..], b"b", b"c", b"ab", b"bc", b"abc", b"cab"].iter().map(|t| t.to_vec()).collect();
        let merges = recover_merges(&ranks);
        // "abc": lower-rank BPE merges "ab" (rank 3) before "bc" (rank 4), so the merge is ("ab", "c").
        assert_eq!(
            merges,
            vec![(&b"a"[..], &b"b"[..]), (&b"b"[..], &b"c"[..]), (&b"ab"[..], &b"c"[..]), (&b"c"[..], &b"ab"[..])]
        );
    }
}
