//! sparkd's tokenizer as llguidance's `TokenizerEnv`: each id's bytes (special tokens as `\xFF` + their name, the
//! form llguidance's grammars reference them by, `<|tool_call_begin|>`), ids that name no token (the gap of the
//! built-in vocabulary) as empty words that nothing can produce, and sparkd's own BPE for tokenizing text (it is
//! canonical, so llguidance may force tokens).

use sparkd_tokenizer::specials::IM_END;
use sparkd_tokenizer::Tokenizer;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::{GrammarError, Result};

/// See the module docs.
pub struct SparkdTokEnv {
    tokenizer: Tokenizer,
    trie: TokTrie,
    end_of_turn: u32,
}

impl SparkdTokEnv {
    /// Walks `tokenizer`'s vocabulary once.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let end_of_turn = tokenizer
            .token_id(IM_END)
            .ok_or_else(|| GrammarError::Tokenizer(format!("the vocabulary has no {IM_END}")))?;
        let vocab = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.special_name(id) {
                Some(name) => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], name.as_bytes()].concat(),
                None => tokenizer.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default(),
            })
            .collect();
        let info = TokRxInfo { tok_end_of_turn: Some(end_of_turn), ..TokRxInfo::new(vocab as u32, end_of_turn) };
        let trie = TokTrie::from(&info, &words);
        Ok(SparkdTokEnv { tokenizer: tokenizer.clone(), trie, end_of_turn })
    }

    /// The id a constrained reply ends with.
    pub fn end_of_turn(&self) -> u32 {
        self.end_of_turn
    }
}

impl TokenizerEnv for SparkdTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text),
            // Not text (a prefix of a character, say): the trie's greedy split is a valid one.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}
