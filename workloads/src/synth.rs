//! Prompt synthesis from hash ids (follows AIPerf's `weka_prompt_compose`, agentx.md §1.6.2).
//!
//! Invariants:
//! - Every hash id maps to a fixed block of tokens derived only from (scope, hash id, position in
//!   the block), so turns that share a hash-id prefix get identical token prefixes, and different
//!   scopes (traces) never alias.
//! - A turn's prompt has exactly its (scaled) input token count: the hash blocks are cut to it,
//!   and positions past the last hash block get tail tokens keyed by (scope, chain, turn, position).
//! - Tokens come from a [`TokenPool`] of single-word tokens with a leading space whose
//!   decode→encode round trip is the identity one by one; since the tokenizer splits text before
//!   every space-led word, any sequence of them round-trips to the same ids (checked in tests).
//! - Token scaling keeps the block structure: the block size is scaled (at least 1 token), the
//!   hash ids are kept, so which turns share which prefixes does not change.
//! - A play's cache-busting marker replaces the first [`MARKER_TOKENS`] tokens of each chain's first
//!   user message, so the setup (system) prefix stays shareable and the token count stays exact.

use crate::dag::{Chain, Scope};
use crate::error::{ReplayError, Result};

/// What prompt synthesis needs from a tokenizer. Implemented for the daemon's tokenizer; tests may
/// use others.
pub trait TokenCodec {
    /// Number of token ids to scan for the pool (ids `0..vocab_size()`).
    fn vocab_size(&self) -> u32;
    /// The text of one token id, `None` when the id is special or not valid UTF-8 on its own.
    fn token_text(&self, id: u32) -> Option<String>;
    /// Encodes ordinary text (no special tokens).
    fn encode(&self, text: &str) -> Vec<u32>;
}

/// Tokens per cache-busting marker.
pub const MARKER_TOKENS: usize = 6;
/// Pool size used when the vocabulary offers that many words.
pub const POOL_SIZE: usize = 8192;
/// Fewest words a pool may have.
pub const MIN_POOL_SIZE: usize = 256;

/// A vetted pool of single-word token ids (`" word"`, lowercase ASCII letters, 2..=12 letters).
#[derive(Clone, Debug)]
pub struct TokenPool {
    ids: Vec<u32>,
    texts: Vec<String>,
}

impl TokenPool {
    /// Scans the vocabulary in id order and keeps the first [`POOL_SIZE`] words whose text
    /// re-encodes to exactly that id.
    pub fn build(codec: &dyn TokenCodec) -> Result<Self> {
        let mut ids = Vec::new();
        let mut texts = Vec::new();
        for id in 0..codec.vocab_size() {
            let Some(text) = codec.token_text(id) else { continue };
            let Some(word) = text.strip_prefix(' ') else { continue };
            if !(2..=12).contains(&word.len()) || !word.bytes().all(|b| b.is_ascii_lowercase()) {
                continue;
            }
            if codec.encode(&text) != [id] {
                continue;
            }
            ids.push(id);
            texts.push(text);
            if ids.len() == POOL_SIZE {
                break;
            }
        }
        if ids.len() < MIN_POOL_SIZE {
            return Err(ReplayError::Tokenizer(format!(
                "only {} round-trip-stable word tokens found, need at least {MIN_POOL_SIZE}",
                ids.len()
            )));
        }
        Ok(TokenPool { ids, texts })
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    fn pick(&self, key: u64) -> u32 {
        self.ids[(key % self.ids.len() as u64) as usize]
    }

    /// The text of pool tokens, concatenated (each starts with a space).
    pub fn text(&self, tokens: &[u32]) -> Result<String> {
        let mut out = String::with_capacity(tokens.len() * 7);
        for &t in tokens {
            let i = self
                .ids
                .binary_search(&t)
                .map_err(|_| ReplayError::Tokenizer(format!("token {t} is not in the synthesis pool")))?;
            out.push_str(&self.texts[i]);
        }
        Ok(out)
    }
}

/// SplitMix64 finaliser: a fixed, well-mixed 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn mix_all(parts: &[u64]) -> u64 {
    parts.iter().fold(0x5eed_u64, |h, &p| mix(h ^ mix(p)))
}

/// Kinds of derived token, so keys of different uses never collide.
const KEY_BLOCK: u64 = 1;
const KEY_TAIL: u64 = 2;
const KEY_OUTPUT: u64 = 3;
const KEY_MARKER: u64 = 4;

/// A cache-busting marker for one play of a session (agentx.md §1.6.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Marker(pub [u32; MARKER_TOKENS]);

/// Deterministic token synthesis for one run.
#[derive(Clone, Debug)]
pub struct Synth {
    pool: TokenPool,
    /// Input/output length factor (`--token-scale`).
    token_scale: f64,
}

impl Synth {
    pub fn new(pool: TokenPool, token_scale: f64) -> Result<Self> {
        if !(token_scale.is_finite() && token_scale > 0.0 && token_scale <= 1.0) {
            return Err(ReplayError::option("--token-scale", format!("must be in (0, 1], found {token_scale}")));
        }
        Ok(Synth { pool, token_scale })
    }

    pub fn pool(&self) -> &TokenPool {
        &self.pool
    }

    pub fn token_scale(&self) -> f64 {
        self.token_scale
    }

    /// A recorded token count after scaling, at least 1.
    pub fn scaled(&self, tokens: u32) -> usize {
        ((tokens as f64 * self.token_scale).round() as usize).max(1)
    }

    /// The block size after scaling, at least 1.
    pub fn block_size(&self, recorded_block: u32) -> usize {
        self.scaled(recorded_block)
    }

    /// Token `position` of a prompt built from `hash_ids` in `scope`; `tail_key` names the turn
    /// for positions past the hash blocks.
    fn prompt_token(&self, scope: Scope, hash_ids: &[u64], block: usize, tail_key: u64, position: usize) -> u32 {
        let (j, i) = (position / block, position % block);
        match hash_ids.get(j) {
            Some(&h) => self.pool.pick(mix_all(&[KEY_BLOCK, scope.0, h, i as u64])),
            None => self.pool.pick(mix_all(&[KEY_TAIL, scope.0, tail_key, position as u64])),
        }
    }

    /// The whole prompt of a turn: `len` tokens built from its hash blocks.
    pub fn prompt(&self, scope: Scope, hash_ids: &[u64], recorded_block: u32, tail_key: u64, len: usize) -> Vec<u32> {
        let block = self.block_size(recorded_block);
        (0..len).map(|p| self.prompt_token(scope, hash_ids, block, tail_key, p)).collect()
    }

    /// Synthesized text of a recorded output (the assistant history AIPerf sends).
    pub fn output(&self, scope: Scope, tail_key: u64, len: usize) -> Vec<u32> {
        (0..len).map(|p| self.pool.pick(mix_all(&[KEY_OUTPUT, scope.0, tail_key, p as u64]))).collect()
    }

    /// The marker for a play key (derived from run seed, play number and trace id by the caller).
    pub fn marker(&self, play_key: u64) -> Marker {
        let mut m = [0u32; MARKER_TOKENS];
        for (i, t) in m.iter_mut().enumerate() {
            *t = self.pool.pick(mix_all(&[KEY_MARKER, play_key, i as u64]));
        }
        Marker(m)
    }
}

/// A stable key for (chain id, turn index), used for tails and outputs.
pub fn turn_key(chain_id: &str, turn: usize) -> u64 {
    mix_all(&[crate::dag::Scope::of(chain_id).0, turn as u64])
}

/// A stable key for a play: run seed, play number, trace id.
pub fn play_key(seed: u64, play: u64, trace_id: &str) -> u64 {
    mix_all(&[seed, play, crate::dag::Scope::of(trace_id).0])
}

/// Chat roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

/// A message as token ids (rendered to text with [`TokenPool::text`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub tokens: Vec<u32>,
}

/// What one turn sends.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnInput {
    /// Messages to send: the whole history (chat), or only the new ones when `continues` (ws).
    pub messages: Vec<Message>,
    /// True when this turn extends the previous one (ws: chain on `previous_response_id`).
    pub continues: bool,
    /// Content tokens in the context the server sees: exactly the turn's scaled input length.
    pub context_tokens: usize,
    /// The turn's scaled output length (sent as the max tokens).
    pub max_output_tokens: usize,
}

/// How the server keeps the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryMode {
    /// The client sends the whole message array every turn; assistant history is the recorded
    /// output, synthesized (as AIPerf does).
    Resend,
    /// The server keeps the context (`previous_response_id`); its real output is in it.
    ServerKept,
}

/// The conversation state of one chain during one play.
#[derive(Clone, Debug)]
pub struct Conversation {
    mode: HistoryMode,
    marker: Marker,
    /// Full message history (Resend) or the content token count the server holds (both).
    history: Vec<Message>,
    context_tokens: usize,
    /// Index of the last turn planned, if any.
    last_turn: Option<usize>,
}

impl Conversation {
    pub fn new(mode: HistoryMode, marker: Marker) -> Self {
        Conversation { mode, marker, history: Vec::new(), context_tokens: 0, last_turn: None }
    }

    /// Plans turn `k` of `chain`. Continues the history when the turn shares hash blocks past the
    /// setup prefix with the previous turn and is longer than the context; otherwise starts fresh
    /// (the agent compacted or restarted its context).
    pub fn plan(&mut self, synth: &Synth, scope: Scope, block: u32, chain: &Chain, k: usize) -> TurnInput {
        let turn = &chain.turns[k];
        let len = synth.scaled(turn.input_tokens);
        let max_output_tokens = synth.scaled(turn.output_tokens);
        let prompt = synth.prompt(scope, &turn.hash_ids, block, turn_key(&chain.id, k), len);
        let continues = self.last_turn == Some(k.wrapping_sub(1)) && k > 0 && {
            let prev = &chain.turns[k - 1];
            let shared = prev.hash_ids.iter().zip(&turn.hash_ids).take_while(|(a, b)| a == b).count();
            shared > chain.setup_blocks && len > self.context_tokens
        };
        self.last_turn = Some(k);
        if continues {
            let user = Message { role: Role::User, tokens: prompt[self.context_tokens..].to_vec() };
            self.context_tokens = len;
            self.history.push(user.clone());
            let messages = match self.mode {
                HistoryMode::Resend => self.history.clone(),
                HistoryMode::ServerKept => vec![user],
            };
            return TurnInput { messages, continues: true, context_tokens: len, max_output_tokens };
        }
        let setup = (chain.setup_blocks * synth.block_size(block)).min(len - 1);
        let mut user = prompt[setup..].to_vec();
        let n = MARKER_TOKENS.min(user.len());
        user[..n].copy_from_slice(&self.marker.0[..n]);
        self.history.clear();
        if setup > 0 {
            self.history.push(Message { role: Role::System, tokens: prompt[..setup].to_vec() });
        }
        self.history.push(Message { role: Role::User, tokens: user });
        self.context_tokens = len;
        TurnInput { messages: self.history.clone(), continues: false, context_tokens: len, max_output_tokens }
    }

    /// Records turn `k`'s answer: Resend appends the recorded output (synthesized) as the assistant
    /// message; ServerKept counts the tokens the server actually generated.
    pub fn complete(&mut self, synth: &Synth, scope: Scope, chain: &Chain, k: usize, generated_tokens: usize) {
        match self.mode {
            HistoryMode::Resend => {
                let n = synth.scaled(chain.turns[k].output_tokens);
                let tokens = synth.output(scope, turn_key(&chain.id, k), n);
                self.context_tokens += n;
                self.history.push(Message { role: Role::Assistant, tokens });
            }
            HistoryMode::ServerKept => self.context_tokens += generated_tokens,
        }
    }

    /// Forgets the history: the next turn starts fresh (after an error, for instance).
    pub fn reset(&mut self) {
        self.history.clear();
        self.context_tokens = 0;
        self.last_turn = None;
    }
}
