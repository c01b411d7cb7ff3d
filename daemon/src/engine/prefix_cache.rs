//! The prefix cache: snapshots of sequence states at token-block boundaries, keyed by a hash chain
//! over the blocks, so a request that resends a known prefix restores it instead of recomputing.
//!
//! Follows vLLM v1's block hashing (`vllm/v1/core/kv_cache_utils.py`: a block's key is
//! `hash(parent key, block tokens)`), but an entry is a whole-state snapshot (KDA states plus MLA
//! blocks), because a hybrid model's recurrent state exists only at the position where it was taken:
//! it cannot be rebuilt from per-block pieces nor rewound.
//!
//! Two tiers, as kept responses have:
//! - `Device`: a runner state forked at the boundary (`Runner::fork_state`, a copy that stays on the device;
//!   with a drafter, its context is forked too). A lookup forks it again.
//! - `Host`: an exported copy (`Runner::export_state`); a lookup imports it.
//!
//! A snapshot is taken into the device tier when it has a budget: on the GPU a fork is a device-to-device copy
//! queued on the stream, while an export downloads and widens the whole state on the engine thread (~94 MB of
//! f32 for k3-mini at 12k tokens), a stall every non-continuing turn paid twice (docs/perf/decisions.md, D80).
//! The device tier's least recently used entries move to the host tier (exported) when it is over budget;
//! the host tier's least recently used are dropped.
//!
//! Invariants:
//! - An entry at key `chain[i]` holds the state after exactly `(i + 1) * block_tokens` tokens, and
//!   those tokens themselves: a lookup compares them, so a hash collision can never restore a wrong
//!   state.
//! - Each tier's bytes stay within its budget (a device entry counts `Runner::state_bytes`, a host entry
//!   `SeqState::bytes`); the least recently used entry of a tier leaves it first. A snapshot larger than a tier's
//!   whole budget is not stored there.
//! - Every device entry's state is the cache's own: it is freed exactly once, when the entry is demoted,
//!   evicted or replaced, or when a [`Taken`] snapshot is not stored ([`PrefixCache::discard`]). No other
//!   code frees it, and a lookup hands out a fork, never the entry's state.
//! - A budget of 0 for the host tier disables the cache, the device tier included.
//! - Complexity: computing a chain is O(tokens); a lookup is O(blocks) hash probes plus one token
//!   comparison; eviction is O(log entries) per entry moved.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use sparkd_kernels::state::SeqState;
use sparkd_kernels::{Result, Runner, StateId, TokenId};

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

/// The byte budgets of the two tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixBudgets {
    /// Device bytes of forked snapshots (0: every snapshot is exported to the host).
    pub device_bytes: usize,
    /// Host bytes of exported snapshots (0 disables the cache).
    pub host_bytes: usize,
}

/// A snapshot taken at a boundary and not stored yet: the caller stores it ([`PrefixCache::insert`]) or
/// gives it back ([`PrefixCache::discard`]).
#[derive(Debug)]
pub enum Taken {
    /// A forked runner state and its bytes.
    Device { state: StateId, bytes: usize },
    /// An exported copy.
    Host(SeqState),
}

impl Taken {
    /// The number of tokens the snapshot holds.
    fn len(&self, runner: &dyn Runner) -> Result<usize> {
        match self {
            Taken::Device { state, .. } => runner.state_len(*state),
            Taken::Host(s) => Ok(s.len),
        }
    }

    /// Device bytes it holds (0 for a host copy).
    pub fn device_bytes(&self) -> usize {
        match self {
            Taken::Device { bytes, .. } => *bytes,
            Taken::Host(_) => 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Tier {
    Device,
    Host,
}

#[derive(Debug)]
struct Snapshot {
    tokens: Vec<TokenId>,
    held: Taken,
    last_used: u64,
}

impl Snapshot {
    fn tier(&self) -> Tier {
        match self.held {
            Taken::Device { .. } => Tier::Device,
            Taken::Host(_) => Tier::Host,
        }
    }

    fn bytes(&self) -> usize {
        match &self.held {
            Taken::Device { bytes, .. } => *bytes,
            Taken::Host(s) => s.bytes(),
        }
    }
}

/// What inserting a snapshot moved between tiers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    /// Device entries exported to the host tier.
    pub to_host: usize,
    /// Entries dropped (from either tier).
    pub dropped: usize,
}

/// Byte-bounded two-tier LRU store of block-boundary state snapshots.
#[derive(Debug)]
pub struct PrefixCache {
    block_tokens: usize,
    budgets: PrefixBudgets,
    device_bytes: usize,
    host_bytes: usize,
    clock: u64,
    entries: HashMap<BlockHash, Snapshot>,
    /// Per tier, `last_used` tick → key, for LRU eviction.
    lru: BTreeMap<(Tier, u64), BlockHash>,
}

impl PrefixCache {
    pub fn new(block_tokens: usize, budgets: PrefixBudgets) -> Self {
        let device_bytes = if budgets.host_bytes == 0 { 0 } else { budgets.device_bytes };
        PrefixCache {
            block_tokens: block_tokens.max(1),
            budgets: PrefixBudgets { device_bytes, ..budgets },
            device_bytes: 0,
            host_bytes: 0,
            clock: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn is_enabled(&self) -> bool {
        self.budgets.host_bytes > 0
    }

    /// Device bytes the cache's own states hold.
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }

    /// Host bytes of the exported snapshots.
    pub fn host_bytes(&self) -> usize {
        self.host_bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn touch(&mut self, key: BlockHash) {
        let Some(entry) = self.entries.get_mut(&key) else { return };
        self.lru.remove(&(entry.tier(), entry.last_used));
        self.clock += 1;
        entry.last_used = self.clock;
        self.lru.insert((entry.tier(), self.clock), key);
    }

    /// Whether a snapshot of exactly `tokens` (a whole number of blocks) is stored.
    pub fn contains(&self, tokens: &[TokenId]) -> bool {
        if tokens.is_empty() || tokens.len() % self.block_tokens != 0 {
            return false;
        }
        let chain = hash_chain(tokens, self.block_tokens);
        chain.last().and_then(|k| self.entries.get(k)).is_some_and(|e| e.tokens == tokens)
    }

    /// Takes a snapshot of `state` (settled, not in a step in flight): a fork when the device tier has a budget,
    /// else an export.
    pub fn take(&self, runner: &mut dyn Runner, state: StateId) -> Result<Taken> {
        if self.budgets.device_bytes == 0 {
            return Ok(Taken::Host(runner.export_state(state)?));
        }
        let fork = runner.fork_state(state)?;
        match runner.state_bytes(fork) {
            Ok(bytes) => Ok(Taken::Device { state: fork, bytes }),
            Err(e) => {
                runner.free_state(fork)?;
                Err(e)
            }
        }
    }

    /// Gives back a snapshot that is not stored (a device one is freed).
    pub fn discard(runner: &mut dyn Runner, taken: Taken) -> Result<()> {
        match taken {
            Taken::Device { state, .. } => runner.free_state(state),
            Taken::Host(_) => Ok(()),
        }
    }

    /// The longest stored prefix of `tokens` that is at most `max_len` tokens long: its length and a new
    /// state restored from it (a fork of a device entry, an import of a host one).
    pub fn lookup(
        &mut self,
        runner: &mut dyn Runner,
        tokens: &[TokenId],
        max_len: usize,
    ) -> Result<Option<(usize, StateId)>> {
        let usable = &tokens[..max_len.min(tokens.len())];
        let chain = hash_chain(usable, self.block_tokens);
        let Some((index, key)) = chain.iter().enumerate().rev().find(|(i, key)| {
            let len = (i + 1) * self.block_tokens;
            self.entries.get(*key).is_some_and(|e| e.tokens[..] == usable[..len])
        }) else {
            return Ok(None);
        };
        let (len, key) = ((index + 1) * self.block_tokens, *key);
        self.touch(key);
        let restored = match self.entries.get(&key).map(|e| &e.held) {
            Some(Taken::Device { state, .. }) => runner.fork_state(*state)?,
            Some(Taken::Host(s)) => runner.import_state(s.clone())?,
            None => return Ok(None),
        };
        Ok(Some((len, restored)))
    }

    /// Stores the snapshot of the state after `tokens` (a whole number of blocks), moving least recently used
    /// entries down a tier to stay in budget. A snapshot that is not stored (not on a boundary, not matching
    /// `tokens`, already stored, larger than its tier) is given back. Returns whether it is now stored and what
    /// moved.
    pub fn insert(&mut self, runner: &mut dyn Runner, tokens: &[TokenId], taken: Taken) -> Result<(bool, Moved)> {
        let mut moved = Moved::default();
        let on_boundary = !tokens.is_empty() && tokens.len() % self.block_tokens == 0;
        let key = hash_chain(tokens, self.block_tokens).last().copied().filter(|_| on_boundary);
        let fits = match &taken {
            Taken::Device { bytes, .. } => *bytes <= self.budgets.device_bytes,
            Taken::Host(s) => s.bytes() <= self.budgets.host_bytes,
        };
        let Some(key) = key.filter(|_| fits && self.is_enabled() && taken.len(runner).ok() == Some(tokens.len()))
        else {
            Self::discard(runner, taken)?;
            return Ok((false, moved));
        };
        if self.entries.get(&key).is_some_and(|e| e.tokens == tokens) {
            self.touch(key);
            Self::discard(runner, taken)?;
            return Ok((true, moved));
        }
        if let Some(old) = self.remove(key) {
            Self::discard(runner, old.held)?;
        }
        self.clock += 1;
        self.add(key, Snapshot { tokens: tokens.to_vec(), held: taken, last_used: self.clock });
        self.demote(runner, &mut moved)?;
        self.evict_host(&mut moved);
        Ok((self.entries.contains_key(&key), moved))
    }

    /// Moves least recently used device entries to the host tier until the device tier is within budget. The
    /// entry just stored is the most recently used and fits on its own, so it is never the one moved.
    fn demote(&mut self, runner: &mut dyn Runner, moved: &mut Moved) -> Result<()> {
        while self.device_bytes > self.budgets.device_bytes {
            let Some(&victim) = self.lru.range((Tier::Device, 0)..(Tier::Host, 0)).map(|(_, k)| k).next() else {
                break;
            };
            let Some(entry) = self.remove(victim) else { break };
            let Taken::Device { state, .. } = entry.held else { continue };
            let exported = runner.export_state(state);
            runner.free_state(state)?;
            match exported {
                Ok(host) if host.bytes() <= self.budgets.host_bytes => {
                    self.add(victim, Snapshot { held: Taken::Host(host), ..entry });
                    moved.to_host += 1;
                }
                Ok(_) => moved.dropped += 1,
                Err(e) => {
                    moved.dropped += 1;
                    tracing::warn!(error = %e, "exporting a prefix snapshot to the host tier failed; it was dropped");
                }
            }
        }
        Ok(())
    }

    /// Drops least recently used host entries until the host tier is within budget (one just stored there is the
    /// most recently used and fits on its own; entries moved down keep their older ticks).
    fn evict_host(&mut self, moved: &mut Moved) {
        while self.host_bytes > self.budgets.host_bytes {
            let Some(&victim) = self.lru.range((Tier::Host, 0)..).map(|(_, k)| k).next() else { break };
            if self.remove(victim).is_none() {
                break;
            }
            moved.dropped += 1;
        }
    }

    /// Puts an entry into the index and the byte counts (the inverse of [`PrefixCache::remove`]).
    fn add(&mut self, key: BlockHash, entry: Snapshot) {
        match entry.tier() {
            Tier::Device => self.device_bytes += entry.bytes(),
            Tier::Host => self.host_bytes += entry.bytes(),
        }
        self.lru.insert((entry.tier(), entry.last_used), key);
        self.entries.insert(key, entry);
    }

    /// Takes an entry out of the index and the byte counts; the caller owns what it holds.
    fn remove(&mut self, key: BlockHash) -> Option<Snapshot> {
        let e = self.entries.remove(&key)?;
        self.lru.remove(&(e.tier(), e.last_used));
        match e.tier() {
            Tier::Device => self.device_bytes -= e.bytes(),
            Tier::Host => self.host_bytes -= e.bytes(),
        }
        Some(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparkd_kernels::null_runner::NullRunner;
    use sparkd_kernels::state::MlaCache;
    use sparkd_kernels::ModelConfig;

    const B: usize = 4;

    fn runner() -> NullRunner {
        NullRunner::new(ModelConfig::preset("k3-tiny").unwrap())
    }

    /// A NullRunner-shaped snapshot: the history in a width-1 MLA cache.
    fn snap(tokens: &[TokenId]) -> SeqState {
        let mut history = MlaCache::new(1);
        tokens.iter().for_each(|&t| history.push(&[t as f32]));
        SeqState { len: tokens.len(), kda: Vec::new(), mla: vec![history] }
    }

    /// A snapshot taken by `cache` of a runner state holding `tokens` (which is freed: the snapshot is its own).
    fn taken(cache: &PrefixCache, r: &mut NullRunner, tokens: &[TokenId]) -> Taken {
        let live = r.import_state(snap(tokens)).unwrap();
        let t = cache.take(r, live).unwrap();
        r.free_state(live).unwrap();
        t
    }

    fn host_only(bytes: usize) -> PrefixBudgets {
        PrefixBudgets { device_bytes: 0, host_bytes: bytes }
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
        let mut r = runner();
        let mut cache = PrefixCache::new(B, host_only(1 << 20));
        let tokens: Vec<TokenId> = (0..20).collect();
        for len in [4, 12] {
            let t = taken(&cache, &mut r, &tokens[..len]);
            assert!(cache.insert(&mut r, &tokens[..len], t).unwrap().0);
        }
        let t = taken(&cache, &mut r, &tokens[..6]);
        assert!(!cache.insert(&mut r, &tokens[..6], t).unwrap().0, "not a block boundary");
        let (len, state) = cache.lookup(&mut r, &tokens, 19).unwrap().unwrap();
        assert_eq!((len, r.state_len(state).unwrap()), (12, 12));
        assert_eq!(cache.lookup(&mut r, &tokens, 11).unwrap().unwrap().0, 4);
        assert!(cache.lookup(&mut r, &tokens, 3).unwrap().is_none());
        // A different second block shares only the first.
        let mut other = tokens.clone();
        other[5] = 99;
        assert_eq!(cache.lookup(&mut r, &other, 19).unwrap().unwrap().0, 4);
        assert!(cache.contains(&tokens[..12]) && !cache.contains(&other[..12]));
    }

    #[test]
    fn byte_budget_evicts_least_recently_used() {
        let mut r = runner();
        let one = snap(&[0; 4]).bytes();
        let mut cache = PrefixCache::new(B, host_only(2 * one));
        let [a, b, c]: [Vec<TokenId>; 3] = [vec![1; 4], vec![2; 4], vec![3; 4]];
        for t in [&a, &b] {
            let s = taken(&cache, &mut r, t);
            cache.insert(&mut r, t, s).unwrap();
        }
        assert!(cache.lookup(&mut r, &a, 4).unwrap().is_some(), "touch a: b is now the oldest");
        let s = taken(&cache, &mut r, &c);
        assert_eq!(cache.insert(&mut r, &c, s).unwrap(), (true, Moved { to_host: 0, dropped: 1 }));
        assert_eq!(cache.len(), 2);
        assert!(cache.contains(&a) && cache.contains(&c) && !cache.contains(&b));
        assert_eq!((cache.host_bytes(), cache.device_bytes()), (2 * one, 0));
        let big: Vec<TokenId> = vec![4; 4 * 64];
        let s = taken(&cache, &mut r, &big);
        assert!(!cache.insert(&mut r, &big, s).unwrap().0, "larger than the whole budget");
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn the_device_tier_forks_and_moves_its_oldest_to_the_host_when_full() {
        let mut r = runner();
        let per_token = {
            let s = r.import_state(snap(&[0; 4])).unwrap();
            r.state_bytes(s).unwrap() / 4
        };
        let host_one = snap(&[0; 4]).bytes();
        // Room for two 4-token states on the device and one exported one on the host.
        let budgets = PrefixBudgets { device_bytes: 2 * 4 * per_token, host_bytes: host_one };
        let mut cache = PrefixCache::new(B, budgets);
        let before = r.num_states();
        let [a, b, c, d]: [Vec<TokenId>; 4] = [vec![1; 4], vec![2; 4], vec![3; 4], vec![4; 4]];
        for t in [&a, &b] {
            let s = taken(&cache, &mut r, t);
            assert!(matches!(s, Taken::Device { .. }), "a snapshot is a fork while the device tier has a budget");
            assert_eq!(cache.insert(&mut r, t, s).unwrap(), (true, Moved::default()));
        }
        assert_eq!((cache.device_bytes(), cache.host_bytes()), (2 * 4 * per_token, 0));
        assert_eq!(r.num_states(), before + 2, "the cache's own states are the two forks");
        let s = taken(&cache, &mut r, &c);
        assert_eq!(cache.insert(&mut r, &c, s).unwrap(), (true, Moved { to_host: 1, dropped: 0 }), "a moves down");
        assert_eq!((cache.device_bytes(), cache.host_bytes()), (2 * 4 * per_token, host_one));
        assert_eq!(r.num_states(), before + 2, "a's device state was freed once exported");
        // A lookup of the host entry imports it; of a device entry forks it. Either way the entry stays.
        let (len, from_host) = cache.lookup(&mut r, &a, 4).unwrap().unwrap();
        assert_eq!((len, r.export_state(from_host).unwrap()), (4, snap(&a)));
        let (_, from_device) = cache.lookup(&mut r, &c, 4).unwrap().unwrap();
        assert_eq!(r.export_state(from_device).unwrap(), snap(&c));
        assert_eq!((cache.len(), r.num_states()), (3, before + 4));
        // d moves b (the least recently used device entry) down, and the full host tier then drops b itself:
        // a was used after b.
        let s = taken(&cache, &mut r, &d);
        assert_eq!(cache.insert(&mut r, &d, s).unwrap(), (true, Moved { to_host: 1, dropped: 1 }));
        assert!(cache.contains(&a) && !cache.contains(&b) && cache.contains(&c) && cache.contains(&d));
        assert_eq!(r.num_states(), before + 4, "the two lookups' states and the device entries c and d");
    }

    #[test]
    fn snapshots_not_stored_are_given_back() {
        let mut r = runner();
        let mut cache = PrefixCache::new(B, PrefixBudgets { device_bytes: 1 << 20, host_bytes: 1 << 20 });
        let tokens: Vec<TokenId> = (0..8).collect();
        let base = r.num_states();
        let s = taken(&cache, &mut r, &tokens);
        assert!(!cache.insert(&mut r, &tokens[..4], s).unwrap().0, "it holds 8 tokens, not 4");
        assert_eq!(r.num_states(), base, "freed");
        let s = taken(&cache, &mut r, &tokens);
        assert!(cache.insert(&mut r, &tokens, s).unwrap().0);
        let again = taken(&cache, &mut r, &tokens);
        assert!(cache.insert(&mut r, &tokens, again).unwrap().0, "already stored");
        assert_eq!(r.num_states(), base + 1, "the duplicate was freed, the stored one kept");
        let s = taken(&cache, &mut r, &tokens);
        PrefixCache::discard(&mut r, s).unwrap();
        assert_eq!(r.num_states(), base + 1);
    }

    #[test]
    fn a_zero_host_budget_disables_both_tiers() {
        let mut r = runner();
        let mut cache = PrefixCache::new(B, PrefixBudgets { device_bytes: 1 << 20, host_bytes: 0 });
        assert!(!cache.is_enabled());
        let tokens: Vec<TokenId> = (0..4).collect();
        let s = taken(&cache, &mut r, &tokens);
        assert!(matches!(s, Taken::Host(_)), "no device tier");
        assert!(!cache.insert(&mut r, &tokens, s).unwrap().0);
        assert!(cache.is_empty());
    }
}
