//! The prefix cache: host snapshots of sequence states at token-block boundaries, keyed by a hash
//! chain over the blocks, so a request that resends a known prefix restores it instead of recomputing.
//!
//! Follows vLLM v1's block hashing (`vllm/v1/core/kv_cache_utils.py`: a block's key is
//! `hash(parent key, block tokens)`), but an entry is a whole-state snapshot (KDA states plus MLA
//! blocks, `Runner::export_state`), because a hybrid model's recurrent state exists only at the
//! position where it was taken: it cannot be rebuilt from per-block pieces nor rewound.
//!
//! Invariants:
//! - An entry at key `chain[i]` holds the state after exactly `(i + 1) * block_tokens` tokens, and
//!   those tokens themselves: a lookup compares them, so a hash collision can never restore a wrong
//!   state.
//! - Total snapshot bytes (`SeqState::bytes`) stay within the byte budget; the least recently used
//!   entry is evicted first. A snapshot larger than the whole budget is not stored.
//! - Complexity: computing a chain is O(tokens); a lookup is O(blocks) hash probes plus one token
//!   comparison; eviction is O(log entries).

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use sparkd_kernels::state::SeqState;
use sparkd_kernels::TokenId;

/// The key of one block: a hash of the parent block's key and this block's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// Keys of every full block of `tokens`: `chain[i]` covers `tokens[..(i + 1) * block_tokens]`.
pub fn hash_chain(tokens: &[TokenId], block_tokens: usize) -> Vec<BlockHash> {
    let mut parent = 0u64;
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            parent.hash(&mut h);
            block.hash(&mut h);
            parent = h.finish();
            BlockHash(parent)
        })
        .collect()
}

#[derive(Debug)]
struct Snapshot {
    tokens: Vec<TokenId>,
    state: SeqState,
    bytes: usize,
    last_used: u64,
}

/// Byte-bounded LRU store of block-boundary state snapshots.
#[derive(Debug)]
pub struct PrefixCache {
    block_tokens: usize,
    budget_bytes: usize,
    bytes: usize,
    clock: u64,
    entries: HashMap<BlockHash, Snapshot>,
    /// `last_used` tick → key, for LRU eviction.
    lru: BTreeMap<u64, BlockHash>,
}

impl PrefixCache {
    pub fn new(block_tokens: usize, budget_bytes: usize) -> Self {
        PrefixCache {
            block_tokens: block_tokens.max(1),
            budget_bytes,
            bytes: 0,
            clock: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn is_enabled(&self) -> bool {
        self.budget_bytes > 0
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn touch(&mut self, key: BlockHash) {
        if let Some(entry) = self.entries.get_mut(&key) {
            self.lru.remove(&entry.last_used);
            self.clock += 1;
            entry.last_used = self.clock;
            self.lru.insert(self.clock, key);
        }
    }

    /// Whether a snapshot of exactly `tokens` (a whole number of blocks) is stored.
    pub fn contains(&self, tokens: &[TokenId]) -> bool {
        if tokens.is_empty() || tokens.len() % self.block_tokens != 0 {
            return false;
        }
        let chain = hash_chain(tokens, self.block_tokens);
        chain.last().and_then(|k| self.entries.get(k)).is_some_and(|e| e.tokens == tokens)
    }

    /// The longest stored prefix of `tokens` that is at most `max_len` tokens long: its length and a
    /// copy of its state (MLA blocks are shared, not copied).
    pub fn lookup(&mut self, tokens: &[TokenId], max_len: usize) -> Option<(usize, SeqState)> {
        let usable = &tokens[..max_len.min(tokens.len())];
        let chain = hash_chain(usable, self.block_tokens);
        let (index, key) = chain.iter().enumerate().rev().find(|(i, key)| {
            let len = (i + 1) * self.block_tokens;
            self.entries.get(*key).is_some_and(|e| e.tokens[..] == usable[..len])
        })?;
        let (len, key) = ((index + 1) * self.block_tokens, *key);
        self.touch(key);
        self.entries.get(&key).map(|e| (len, e.state.clone()))
    }

    /// Stores the snapshot of the state after `tokens` (a whole number of blocks; otherwise ignored),
    /// evicting least recently used entries to stay in budget. Returns whether it is now stored.
    pub fn insert(&mut self, tokens: &[TokenId], state: SeqState) -> bool {
        if tokens.is_empty() || tokens.len() % self.block_tokens != 0 || state.len != tokens.len() {
            return false;
        }
        let Some(&key) = hash_chain(tokens, self.block_tokens).last() else { return false };
        if self.entries.get(&key).is_some_and(|e| e.tokens == tokens) {
            self.touch(key);
            return true;
        }
        let bytes = state.bytes();
        if bytes > self.budget_bytes {
            return false;
        }
        self.remove(key);
        while self.bytes + bytes > self.budget_bytes {
            let Some((_, victim)) = self.lru.pop_first() else { break };
            if let Some(e) = self.entries.remove(&victim) {
                self.bytes -= e.bytes;
            }
        }
        self.clock += 1;
        self.lru.insert(self.clock, key);
        self.bytes += bytes;
        self.entries.insert(key, Snapshot { tokens: tokens.to_vec(), state, bytes, last_used: self.clock });
        true
    }

    fn remove(&mut self, key: BlockHash) {
        if let Some(e) = self.entries.remove(&key) {
            self.lru.remove(&e.last_used);
            self.bytes -= e.bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparkd_kernels::state::MlaCache;

    const B: usize = 4;

    /// A NullRunner-shaped snapshot: the history in a width-1 MLA cache.
    fn snap(tokens: &[TokenId]) -> SeqState {
        let mut history = MlaCache::new(1);
        tokens.iter().for_each(|&t| history.push(&[t as f32]));
        SeqState { len: tokens.len(), kda: Vec::new(), mla: vec![history] }
    }

    #[test]
    fn chain_keys_depend_on_every_earlier_block() {
        let a = hash_chain(&[1, 2, 3, 4, 5, 6, 7, 8, 9], B);
        let b = hash_chain(&[0, 2, 3, 4, 5, 6, 7, 8], B);
        assert_eq!(a.len(), 2);
        assert_ne!(a[1], b[1], "a different first block changes the second key");
        assert_eq!(a, hash_chain(&[1, 2, 3, 4, 5, 6, 7, 8], B));
    }

    #[test]
    fn lookup_finds_the_longest_stored_prefix_within_max_len() {
        let mut cache = PrefixCache::new(B, 1 << 20);
        let tokens: Vec<TokenId> = (0..20).collect();
        assert!(cache.insert(&tokens[..4], snap(&tokens[..4])));
        assert!(cache.insert(&tokens[..12], snap(&tokens[..12])));
        assert!(!cache.insert(&tokens[..6], snap(&tokens[..6])), "not a block boundary");
        let (len, state) = cache.lookup(&tokens, 19).unwrap();
        assert_eq!((len, state.len), (12, 12));
        assert_eq!(cache.lookup(&tokens, 11).unwrap().0, 4);
        assert!(cache.lookup(&tokens, 3).is_none());
        // A different second block shares only the first.
        let mut other = tokens.clone();
        other[5] = 99;
        assert_eq!(cache.lookup(&other, 19).unwrap().0, 4);
        assert!(cache.contains(&tokens[..12]) && !cache.contains(&other[..12]));
    }

    #[test]
    fn byte_budget_evicts_least_recently_used() {
        let one = snap(&[0; 4]).bytes();
        let mut cache = PrefixCache::new(B, 2 * one);
        let a: Vec<TokenId> = vec![1; 4];
        let b: Vec<TokenId> = vec![2; 4];
        let c: Vec<TokenId> = vec![3; 4];
        cache.insert(&a, snap(&a));
        cache.insert(&b, snap(&b));
        assert!(cache.lookup(&a, 4).is_some(), "touch a: b is now the oldest");
        cache.insert(&c, snap(&c));
        assert_eq!(cache.len(), 2);
        assert!(cache.contains(&a) && cache.contains(&c) && !cache.contains(&b));
        assert_eq!(cache.bytes(), 2 * one);
        let big: Vec<TokenId> = vec![4; 4 * 64];
        assert!(!cache.insert(&big, snap(&big)), "larger than the whole budget");
        assert_eq!(cache.len(), 2);
    }
}
