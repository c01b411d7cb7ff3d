//! The served BPE tokenizer: Kimi's `tiktoken.model` when the checkpoint has one, else cl100k_base inside
//! K3's vocabulary.
//!
//! Invariants of a built [`Tokenizer`]:
//! - Base tokens are ids `0..n_base` with dense, unique ranks (checked before `CoreBPE::new`, which panics
//!   on collisions). Special tokens are the 256 ids `special_base .. special_base + 256`, each with a
//!   unique name; `vocab_size() == special_base + 256`. For Kimi's file `special_base == n_base`; for the
//!   built-in vocabulary `n_base == 100_256` and `special_base == 163_584` (K3's real ids), so the ids
//!   `100_256 .. 163_584` name no token and every id produced is `< 163_840`.
//! - `encode` never yields a special id (special-token strings in user text are plain text);
//!   `encode_with_special` turns every special-token string into its id.
//! - Encoding follows Kimi's `tokenization_kimi.py`: the text is cut into pieces of at most 400,000
//!   characters, and those into runs of at most 25,000 consecutive whitespace or non-whitespace characters
//!   (Python's `str.isspace`), before the regex split (tiktoken issue #195: regex blow-up).
//! - All 256 one-byte tokens exist (tiktoken's merge would panic on a missing one; checked at build).
//! - Cheap to share: a `Tokenizer` is an `Arc` around immutable data.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use base64::Engine as _;
use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;

use super::error::{Result, TokenizerError};
use super::specials::{self, K3_SPECIAL_BASE};

/// Kimi's pre-tokenization regex (`pat_str` of `tokenization_kimi.py`, Kimi K2/K2.5/K3): Han runs are
/// their own pieces; letter runs use character-class intersection to exclude Han.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// cl100k_base's pre-tokenization regex as tiktoken defines it, except that its `\p{N}{1,3}+` is written
/// `\p{N}{1,3}`: the same matches (nothing follows it in its alternative), but Oniguruma, which Hugging Face
/// `tokenizers` uses, reads `{1,3}+` as "one or more runs of 1-3 digits", so the export needs this form.
pub const CL100K_PATTERN: &str = concat!(
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*+",
    r"|\s++$|\s*[\r\n]|\s+(?!\S)|\s",
);

/// The number of base (mergeable) tokens in cl100k_base.
pub const CL100K_BASE_TOKENS: u32 = 100_256;

/// Kimi's cut: at most this many characters go to one tiktoken call.
const MAX_ENCODE_CHARS: usize = 400_000;
/// Kimi's cut: at most this many consecutive whitespace or non-whitespace characters in one piece.
const MAX_RUN_CHARS: usize = 25_000;

/// Where the base vocabulary came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabSource {
    /// A checkpoint's `tiktoken.model` with Kimi's regex.
    KimiTiktoken,
    /// tiktoken-rs's bundled cl100k_base ranks with cl100k's regex, specials at K3's ids.
    BuiltinCl100k,
}

/// The daemon's tokenizer. Clone it freely: clones share one immutable vocabulary.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    bpe: CoreBPE,
    /// Token bytes by rank: `ranks[id]` for `id < n_base`.
    ranks: Vec<Vec<u8>>,
    pattern: &'static str,
    source: VocabSource,
    special_base: u32,
    /// `special_names[i]` names id `special_base + i`; `NUM_RESERVED_SPECIAL_TOKENS` entries.
    special_names: Vec<String>,
    special_ids: FxHashMap<String, u32>,
    eos_ids: Vec<u32>,
    /// `byte_ids[b]` is the id of the one-byte token `[b]`.
    byte_ids: [u32; 256],
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.inner.source)
            .field("n_base", &self.inner.ranks.len())
            .field("special_base", &self.inner.special_base)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tiktoken.model` and, when present, the special-token names of
    /// `dir/tokenizer_config.json` (`added_tokens_decoder`). Ids in the reserved range without a name there
    /// are `<|reserved_token_{id}|>`. A folder without `tokenizer_config.json` gets K3's published names at
    /// their offsets in the reserved range (so a synthetic checkpoint still has its chat markers).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let model_path = dir.join("tiktoken.model");
        let text = std::fs::read_to_string(&model_path)
            .map_err(|e| TokenizerError::file(&model_path, format!("cannot read: {e}")))?;
        let ranks = parse_tiktoken_model(&text).map_err(|reason| TokenizerError::file(&model_path, reason))?;
        let special_base =
            u32::try_from(ranks.len()).map_err(|_| TokenizerError::file(&model_path, "more than u32::MAX tokens"))?;

        let config_path = dir.join("tokenizer_config.json");
        let special_names = if config_path.exists() {
            let config = std::fs::read_to_string(&config_path)
                .map_err(|e| TokenizerError::file(&config_path, format!("cannot read: {e}")))?;
            specials::names_from_config(&config, special_base)
                .map_err(|reason| TokenizerError::file(&config_path, reason))?
        } else {
            specials::k3_names(special_base)
        };
        Self::build(ranks, special_base, special_names, KIMI_PATTERN, VocabSource::KimiTiktoken)
    }

    /// The built-in tokenizer for checkpoints without `tiktoken.model`: cl100k_base's 100,256 ranks (ids
    /// as they are) with cl100k's regex, plus K3's special tokens at their real ids `163_584..163_840`.
    /// cl100k's own special tokens are not used. Built once per process; later calls clone it.
    pub fn builtin() -> Result<Self> {
        static BUILTIN: OnceLock<std::result::Result<Tokenizer, String>> = OnceLock::new();
        BUILTIN.get_or_init(|| Self::build_builtin().map_err(|e| e.to_string())).clone().map_err(TokenizerError::Build)
    }

    fn build_builtin() -> Result<Self> {
        let cl100k = tiktoken_rs::cl100k_base().map_err(|e| TokenizerError::Build(format!("cl100k_base: {e}")))?;
        let ranks = (0..CL100K_BASE_TOKENS)
            .map(|rank| cl100k.decode_bytes(&[rank]))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| TokenizerError::Build(format!("cl100k_base ranks are not dense: {e}")))?;
        drop(cl100k);
        let names = specials::k3_names(K3_SPECIAL_BASE);
        Self::build(ranks, K3_SPECIAL_BASE, names, CL100K_PATTERN, VocabSource::BuiltinCl100k)
    }

    fn build(
        ranks: Vec<Vec<u8>>,
        special_base: u32,
        special_names: Vec<String>,
        pattern: &'static str,
        source: VocabSource,
    ) -> Result<Self> {
        let mut special_ids = FxHashMap::default();
        for (i, name) in special_names.iter().enumerate() {
            let id = special_base + i as u32;
            if special_ids.insert(name.clone(), id).is_some() {
                return Err(TokenizerError::Build(format!("special token name `{name}` is used twice")));
            }
        }
        let mut encoder: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        encoder.reserve(ranks.len());
        for (rank, bytes) in ranks.iter().enumerate() {
            if encoder.insert(bytes.clone(), rank as u32).is_some() {
                return Err(TokenizerError::Build(format!("token bytes of rank {rank} appear twice")));
            }
        }
        // tiktoken's byte-pair merge indexes the encoder with single bytes: a missing one would panic.
        let mut byte_ids = [0u32; 256];
        for (byte, slot) in byte_ids.iter_mut().enumerate() {
            *slot = *encoder
                .get([byte as u8].as_slice())
                .ok_or_else(|| TokenizerError::Build(format!("the one-byte token 0x{byte:02x} is missing")))?;
        }
        let bpe = CoreBPE::new(encoder, special_ids.clone(), pattern)
            .map_err(|e| TokenizerError::Build(format!("split regex: {e}")))?;
        let eos_ids = [specials::IM_END, specials::EOS].iter().filter_map(|n| special_ids.get(*n).copied()).collect();
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                bpe,
                ranks,
                pattern,
                source,
                special_base,
                special_names,
                special_ids,
                eos_ids,
                byte_ids,
            }),
        })
    }

    /// Text to token ids. Special-token strings in `text` are encoded as plain text, never as special ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let none = HashSet::new();
        self.encode_allowing(text, &none)
    }

    /// Text to token ids, turning every special-token string (`<|im_end|>`, ...) into its id. For trusted
    /// text such as the chat template's markers, never for user content.
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        let all: HashSet<&str> = self.inner.special_names.iter().map(String::as_str).collect();
        self.encode_allowing(text, &all)
    }

    fn encode_allowing(&self, text: &str, allowed: &HashSet<&str>) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        for chunk in split_chars(text, MAX_ENCODE_CHARS) {
            for piece in split_runs(chunk, MAX_RUN_CHARS) {
                self.encode_piece(piece, allowed, &mut out);
            }
        }
        out
    }

    /// Encodes one piece. A regex runtime error (fancy-regex's backtrack limit; not reachable with
    /// 25,000-character runs in practice) halves the piece at a character boundary and retries, so encoding
    /// never fails and never panics.
    fn encode_piece(&self, piece: &str, allowed: &HashSet<&str>, out: &mut Vec<u32>) {
        match self.inner.bpe.encode(piece, allowed) {
            Ok((ids, _)) => out.extend(ids),
            Err(_) => {
                let mid = piece.char_indices().map(|(i, _)| i).nth(piece.chars().count() / 2).unwrap_or(0);
                if mid == 0 {
                    out.extend(piece.bytes().map(|b| self.inner.byte_ids[b as usize]));
                } else {
                    self.encode_piece(&piece[..mid], allowed, out);
                    self.encode_piece(&piece[mid..], allowed, out);
                }
            }
        }
    }

    /// Token ids to text. Special tokens decode to their names. Errors on an id outside the vocabulary and
    /// on bytes that are not valid UTF-8 (see [`Tokenizer::decode_lossy`] for model output).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let bytes = self.decode_bytes(ids)?;
        String::from_utf8(bytes).map_err(|e| TokenizerError::InvalidUtf8(e.utf8_error().valid_up_to()))
    }

    /// Like [`Tokenizer::decode`], but invalid UTF-8 becomes U+FFFD; an unknown id is still an error.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// Token ids to raw bytes (special tokens as their names). Errors on an id outside the vocabulary.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id).ok_or(TokenizerError::UnknownTokenId(id))?);
        }
        Ok(out)
    }

    /// The bytes of one token (a special token's name), or `None` for an id that names no token.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        if let Some(bytes) = self.inner.ranks.get(id as usize) {
            return Some(bytes);
        }
        self.special_name(id).map(str::as_bytes)
    }

    /// The id of a special token by name (`"<|im_end|>"`, `"[BOS]"`, `"<|reserved_token_163600|>"`).
    pub fn token_id(&self, name: &str) -> Option<u32> {
        self.inner.special_ids.get(name).copied()
    }

    /// The name of special token `id`, or `None` if `id` is not special.
    pub fn special_name(&self, id: u32) -> Option<&str> {
        let offset = id.checked_sub(self.inner.special_base)?;
        self.inner.special_names.get(offset as usize).map(String::as_str)
    }

    /// All special tokens as `(id, name)`, in id order.
    pub fn special_tokens(&self) -> impl Iterator<Item = (u32, &str)> {
        let base = self.inner.special_base;
        self.inner.special_names.iter().enumerate().map(move |(i, n)| (base + i as u32, n.as_str()))
    }

    /// One past the largest id: the model's vocabulary size (163,840 for K3).
    pub fn vocab_size(&self) -> usize {
        self.inner.special_base as usize + self.inner.special_names.len()
    }

    /// The number of base (mergeable) tokens, ids `0..n_base`.
    pub fn n_base(&self) -> usize {
        self.inner.ranks.len()
    }

    /// The ids that end generation: `<|im_end|>` and `[EOS]` (those of them the vocabulary has).
    pub fn eos_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }

    /// Whether `id` is one of the special (reserved-range) tokens.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_name(id).is_some()
    }

    /// The pre-tokenization regex this tokenizer splits text with.
    pub fn pattern(&self) -> &'static str {
        self.inner.pattern
    }

    /// Where the base vocabulary came from.
    pub fn source(&self) -> VocabSource {
        self.inner.source
    }

    /// Base token bytes by rank (`ranks()[id]`), for the Hugging Face export.
    pub fn ranks(&self) -> &[Vec<u8>] {
        &self.inner.ranks
    }
}

/// Parses a `tiktoken.model`: one `base64(token) rank` pair per line (blank lines ignored). Ranks must be
/// unique and dense (`0..n` in any order); token bytes must be unique. Returns token bytes by rank.
pub(crate) fn parse_tiktoken_model(text: &str) -> std::result::Result<Vec<Vec<u8>>, String> {
    let mut by_rank: Vec<Option<Vec<u8>>> = Vec::new();
    let mut seen_bytes: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
    let mut count = 0usize;
    for (line_no, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_ascii_whitespace();
        let (Some(b64), Some(rank_text), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(format!("line {line_no}: expected `base64 rank`, found {line:?}"));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| format!("line {line_no}: bad base64 {b64:?}: {e}"))?;
        if bytes.is_empty() {
            return Err(format!("line {line_no}: empty token"));
        }
        let rank: u32 = rank_text.parse().map_err(|_| format!("line {line_no}: bad rank {rank_text:?}"))?;
        let slot = rank as usize;
        if slot >= by_rank.len() {
            by_rank.resize(slot + 1, None);
        }
        if by_rank[slot].is_some() {
            return Err(format!("line {line_no}: rank {rank} appears twice"));
        }
        if let Some(other) = seen_bytes.insert(bytes.clone(), rank) {
            return Err(format!("line {line_no}: token of rank {rank} repeats the bytes of rank {other}"));
        }
        by_rank[slot] = Some(bytes);
        count += 1;
    }
    if count == 0 {
        return Err("no tokens".to_string());
    }
    if count != by_rank.len() {
        let missing = by_rank.iter().position(Option::is_none).unwrap_or(0);
        return Err(format!(
            "ranks are not dense: {count} tokens, largest rank {}, rank {missing} missing",
            by_rank.len() - 1
        ));
    }
    Ok(by_rank.into_iter().flatten().collect())
}

/// Python's `str.isspace`: Unicode White_Space plus the separators U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Cuts `text` into pieces of at most `max_chars` characters.
fn split_chars(text: &str, max_chars: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = rest.char_indices().nth(max_chars).map_or(rest.len(), |(i, _)| i);
        let (head, tail) = rest.split_at(cut);
        rest = tail;
        Some(head)
    })
}

/// Cuts `text` so that no piece holds more than `max_run` consecutive whitespace or non-whitespace
/// characters (Kimi's `_split_whitespaces_or_nonwhitespaces`).
fn split_runs(text: &str, max_run: usize) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut run_len = 0;
    let mut run_is_space = text.chars().next().is_some_and(is_python_space);
    for (i, c) in text.char_indices() {
        let is_space = is_python_space(c);
        if is_space != run_is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > max_run {
                pieces.push(&text[start..i]);
                start = i;
                run_len = 1;
            }
        }
    }
    pieces.push(&text[start..]);
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_splitting_caps_runs_and_keeps_every_character() {
        let text = format!("{}{}ab", "x".repeat(7), " ".repeat(5));
        let pieces = split_runs(&text, 3);
        assert_eq!(pieces.concat(), text);
        assert_eq!(pieces, vec!["xxx", "xxx", "x   ", "  ab"]);
        assert_eq!(split_runs("", 3), vec![""]);
    }

    #[test]
    fn char_splitting_counts_characters_not_bytes() {
        let text = "你好世界!";
        let pieces: Vec<&str> = split_chars(text, 2).collect();
        assert_eq!(pieces, vec!["你好", "世界", "!"]);
    }

    #[test]
    fn python_space_includes_information_separators() {
        assert!(is_python_space('\u{1f}'));
        assert!(is_python_space('\u{3000}'));
        assert!(!is_python_space('a'));
    }

    #[test]
    fn tiktoken_model_parser_rejects_gaps_and_duplicates() {
        assert_eq!(parse_tiktoken_model("YQ== 1\nYg== 0\n").unwrap(), vec![b"b".to_vec(), b"a".to_vec()]);
        assert!(parse_tiktoken_model("YQ== 0\nYg== 2\n").unwrap_err().contains("not dense"));
        assert!(parse_tiktoken_model("YQ== 0\nYg== 0\n").unwrap_err().contains("appears twice"));
        assert!(parse_tiktoken_model("YQ== 0\nYQ== 1\n").unwrap_err().contains("repeats the bytes"));
        assert!(parse_tiktoken_model("!!! 0\n").unwrap_err().contains("bad base64"));
        assert!(parse_tiktoken_model("YQ== x\n").unwrap_err().contains("bad rank"));
        assert!(parse_tiktoken_model("YQ==\n").unwrap_err().contains("expected"));
        assert!(parse_tiktoken_model("\n").unwrap_err().contains("no tokens"));
    }
}
