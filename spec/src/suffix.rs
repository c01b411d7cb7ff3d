//! SuffixDecoding (Oliaro et al., NeurIPS 2025; ArcticInference `suffix_decoding`, dspark.md §5):
//! model-free drafts from depth-limited suffix trees with frequency counts.
//!
//! Invariants:
//! - A [`SuffixTree`] indexes every substring of length <= `max_depth` of the sequences inserted into
//!   it; a node's `count` is the number of indexed occurrences of the substring it spells, so a
//!   child's count never exceeds its parent's. Removing a sequence undoes exactly its insertion and
//!   frees nodes whose count reaches 0.
//! - One per-sequence tree covers the last `max_indexed_tokens` tokens of a sequence's context (prompt,
//!   tool outputs, generated tokens: every substring starting there), indexed incrementally as the
//!   context grows, the substrings of older starts removed as it slides; one global tree covers the
//!   outputs of the last `max_cached_requests` finished requests, within `max_cached_tokens` tokens,
//!   evicted first in, first out. So a tree holds at most `max_tree_depth` nodes per token it covers,
//!   whatever a client sends.
//! - Speculation is the paper's path mode: for each match length m (1..=max_depth) of the context's
//!   tail, follow the most frequent child (lowest token on ties) while the path probability
//!   `Π child.count / parent.count` stays >= `min_token_prob`, for at most
//!   `min(max_len, ⌊factor·m + offset⌋)` tokens; score = Σ path probabilities (the expected number
//!   of accepted tokens). The best score wins (ties: the longer match), across both trees.

use std::collections::{HashMap, VecDeque};

use sparkd_kernels::TokenId;

use crate::draft::{Draft, Proposer, SeqKey};
use crate::error::{Result, SpecError};

/// Knobs, with vLLM's defaults (`suffix_decoding_*`).
#[derive(Clone, Debug, PartialEq)]
pub struct SuffixConfig {
    /// Longest indexed substring and longest matched pattern (vLLM 24).
    pub max_tree_depth: usize,
    /// Finished responses kept in the global tree (vLLM 10,000).
    pub max_cached_requests: usize,
    /// Tokens of finished responses kept in the global tree (a response longer than this is not kept).
    pub max_cached_tokens: usize,
    /// The most recent context tokens a per-sequence tree covers.
    pub max_indexed_tokens: usize,
    /// α of the adaptive length `⌊α·m + offset⌋` (vLLM 1.0).
    pub max_spec_factor: f64,
    /// The offset of the adaptive length (vLLM 0).
    pub max_spec_offset: f64,
    /// Stop drafting once the path probability falls below this (vLLM 0.1).
    pub min_token_prob: f64,
}

impl Default for SuffixConfig {
    fn default() -> Self {
        SuffixConfig {
            max_tree_depth: 24,
            max_cached_requests: 10_000,
            // 24 nodes of 48 bytes a token at most: the global tree within ~300 MB, each sequence's within ~38 MB.
            max_cached_tokens: 262_144,
            max_indexed_tokens: 32_768,
            max_spec_factor: 1.0,
            max_spec_offset: 0.0,
            min_token_prob: 0.1,
        }
    }
}

impl SuffixConfig {
    pub fn validate(&self) -> Result<()> {
        if self.max_tree_depth == 0 {
            return Err(SpecError::config("max_tree_depth", "must be at least 1"));
        }
        if self.max_indexed_tokens < self.max_tree_depth {
            return Err(SpecError::config(
                "max_indexed_tokens",
                format!("{} is below max_tree_depth ({})", self.max_indexed_tokens, self.max_tree_depth),
            ));
        }
        if !(self.max_spec_factor.is_finite() && self.max_spec_factor >= 0.0) {
            return Err(SpecError::config(
                "max_spec_factor",
                format!("{} is not a finite value >= 0", self.max_spec_factor),
            ));
        }
        if !self.max_spec_offset.is_finite() {
            return Err(SpecError::config("max_spec_offset", "must be finite"));
        }
        if !(0.0..=1.0).contains(&self.min_token_prob) {
            return Err(SpecError::config("min_token_prob", format!("{} is not in [0, 1]", self.min_token_prob)));
        }
        Ok(())
    }
}

/// Index of a node in a tree's arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct NodeId(u32);

const ROOT: NodeId = NodeId(0);

#[derive(Clone, Debug, Default)]
struct Node {
    count: u64,
    depth: u32,
    children: Children,
}

/// A node's children, sorted by token. Most nodes of a deep trie over novel text have none or one: they are held
/// inline, so indexing a token allocates only where a node branches (a prompt of 10k tokens makes ~240k nodes).
#[derive(Clone, Debug, Default)]
enum Children {
    #[default]
    None,
    One((TokenId, NodeId)),
    Many(Vec<(TokenId, NodeId)>),
}

impl Children {
    fn as_slice(&self) -> &[(TokenId, NodeId)] {
        match self {
            Children::None => &[],
            Children::One(c) => std::slice::from_ref(c),
            Children::Many(v) => v,
        }
    }

    fn get(&self, token: TokenId) -> Option<NodeId> {
        let children = self.as_slice();
        children.binary_search_by_key(&token, |c| c.0).ok().map(|i| children[i].1)
    }

    /// Adds a child on a token it does not have yet, keeping the order.
    fn insert(&mut self, token: TokenId, id: NodeId) {
        *self = match std::mem::take(self) {
            Children::None => Children::One((token, id)),
            Children::One(c) if c.0 < token => Children::Many(vec![c, (token, id)]),
            Children::One(c) => Children::Many(vec![(token, id), c]),
            Children::Many(mut v) => {
                let at = v.partition_point(|c| c.0 < token);
                v.insert(at, (token, id));
                Children::Many(v)
            }
        };
    }

    /// Detaches the child on `token`.
    fn remove(&mut self, token: TokenId) -> Option<NodeId> {
        match self {
            Children::One((t, id)) if *t == token => {
                let id = *id;
                *self = Children::None;
                Some(id)
            }
            Children::Many(v) => {
                let i = v.binary_search_by_key(&token, |c| c.0).ok()?;
                Some(v.remove(i).1)
            }
            _ => None,
        }
    }
}

/// A depth-limited suffix trie with occurrence counts.
#[derive(Clone, Debug)]
pub struct SuffixTree {
    nodes: Vec<Node>,
    free: Vec<NodeId>,
    max_depth: usize,
}

/// A draft found in a tree, with its score and the pattern length that produced it.
#[derive(Clone, Debug, PartialEq)]
pub struct TreeDraft {
    pub tokens: Vec<TokenId>,
    /// Unconditional path probability of each token.
    pub path_probs: Vec<f64>,
    pub score: f64,
    pub match_len: usize,
}

impl TreeDraft {
    fn into_draft(self) -> Draft {
        Draft::from_path_probabilities(self.tokens, &self.path_probs)
            .expect("path probabilities of a count trie lie in [0, 1] and match the tokens")
    }
}

impl SuffixTree {
    pub fn new(max_depth: usize) -> Self {
        SuffixTree { nodes: vec![Node::default()], free: Vec::new(), max_depth }
    }

    /// Live nodes, the root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0 as usize]
    }

    fn child(&self, id: NodeId, token: TokenId) -> Option<NodeId> {
        self.node(id).children.get(token)
    }

    fn child_or_insert(&mut self, parent: NodeId, token: TokenId) -> NodeId {
        if let Some(id) = self.child(parent, token) {
            return id;
        }
        let depth = self.node(parent).depth + 1;
        let node = Node { count: 0, depth, children: Children::None };
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id.0 as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                NodeId(self.nodes.len() as u32 - 1)
            }
        };
        self.nodes[parent.0 as usize].children.insert(token, id);
        id
    }

    /// Appends `token` to a growing sequence whose open suffixes (the nodes spelling its last
    /// 1..max_depth-1 tokens, shortest first, so `open[k]` is at depth k + 1) are `open`; updates `open` in place
    /// (each open suffix steps to its child on `token`, one place deeper, and the root's child opens at 0).
    fn extend(&mut self, open: &mut Vec<NodeId>, token: TokenId) {
        self.nodes[ROOT.0 as usize].count += 1;
        open.push(ROOT);
        for k in (0..open.len()).rev() {
            let child = self.child_or_insert(if k == 0 { ROOT } else { open[k - 1] }, token);
            self.nodes[child.0 as usize].count += 1;
            open[k] = child;
        }
        if open.last().is_some_and(|&id| self.node(id).depth as usize >= self.max_depth) {
            open.pop();
        }
    }

    /// Indexes a whole sequence.
    pub fn insert(&mut self, tokens: &[TokenId]) {
        let mut open = Vec::new();
        for &t in tokens {
            self.extend(&mut open, t);
        }
    }

    /// Undoes [`SuffixTree::insert`] of the same `tokens`.
    pub fn remove(&mut self, tokens: &[TokenId]) {
        for start in 0..tokens.len() {
            self.remove_start(&tokens[start..]);
        }
    }

    /// Undoes what indexing one start added: the substrings `tokens[..k]`, k up to `max_depth` (`tokens` runs from
    /// the start to the end of what was indexed).
    fn remove_start(&mut self, tokens: &[TokenId]) {
        let end = self.max_depth.min(tokens.len());
        let mut path = vec![ROOT];
        for &t in &tokens[..end] {
            match self.child(*path.last().unwrap_or(&ROOT), t) {
                Some(c) => path.push(c),
                None => break,
            }
        }
        // Root's count is per token, decremented once per start (= once per token).
        self.nodes[ROOT.0 as usize].count = self.node(ROOT).count.saturating_sub(1);
        for (i, &id) in path.iter().enumerate().skip(1) {
            let node = &mut self.nodes[id.0 as usize];
            node.count = node.count.saturating_sub(1);
            if node.count == 0 {
                self.prune(path[i - 1], tokens[i - 1]);
                break;
            }
        }
    }

    /// Detaches the child of `parent` on `token` and frees its whole subtree.
    fn prune(&mut self, parent: NodeId, token: TokenId) {
        let Some(id) = self.nodes[parent.0 as usize].children.remove(token) else { return };
        let mut stack = vec![id];
        while let Some(id) = stack.pop() {
            let node = std::mem::take(&mut self.nodes[id.0 as usize]);
            stack.extend(node.children.as_slice().iter().map(|c| c.1));
            self.free.push(id);
        }
    }

    /// The node spelling `pattern`, if indexed.
    fn find(&self, pattern: &[TokenId]) -> Option<NodeId> {
        pattern.iter().try_fold(ROOT, |node, &t| self.child(node, t))
    }

    /// Follows the most frequent child from `node` (path mode).
    fn follow(&self, mut node: NodeId, max_tokens: usize, min_prob: f64) -> (Vec<TokenId>, Vec<f64>) {
        let (mut tokens, mut probs) = (Vec::new(), Vec::new());
        let mut prob = 1.0;
        while tokens.len() < max_tokens {
            let parent = self.node(node);
            // Children are sorted by token, so the first maximum is the lowest token.
            let Some(&(token, child)) =
                parent.children.as_slice().iter().fold(None, |best: Option<&(TokenId, NodeId)>, c| match best {
                    Some(b) if self.node(b.1).count >= self.node(c.1).count => Some(b),
                    _ => Some(c),
                })
            else {
                break;
            };
            let next = prob * self.node(child).count as f64 / parent.count as f64;
            if next < min_prob {
                break;
            }
            prob = next;
            tokens.push(token);
            probs.push(prob);
            node = child;
        }
        (tokens, probs)
    }

    /// The best path-mode draft for `context` over this tree (None when nothing matches).
    pub fn speculate(&self, context: &[TokenId], max_len: usize, cfg: &SuffixConfig) -> Option<TreeDraft> {
        let mut best: Option<TreeDraft> = None;
        for m in 1..=self.max_depth.min(context.len()) {
            let Some(node) = self.find(&context[context.len() - m..]) else { break };
            let adaptive = (cfg.max_spec_factor * m as f64 + cfg.max_spec_offset).floor().max(0.0) as usize;
            let (tokens, path_probs) = self.follow(node, max_len.min(adaptive), cfg.min_token_prob);
            if tokens.is_empty() {
                continue;
            }
            let score = path_probs.iter().sum();
            if best.as_ref().is_none_or(|b| score >= b.score) {
                best = Some(TreeDraft { tokens, path_probs, score, match_len: m });
            }
        }
        best
    }
}

/// A per-sequence tree and how far the context has been indexed.
#[derive(Debug)]
struct SeqIndex {
    tree: SuffixTree,
    open: Vec<NodeId>,
    /// The context seen so far (4 bytes a token; comparing it is a memcmp per proposal).
    indexed: Vec<TokenId>,
    /// The first position whose substrings the tree holds: `indexed.len() - start <= window`.
    start: usize,
    window: usize,
    /// Context length when the current request began; later tokens are its output.
    prompt_len: usize,
}

impl SeqIndex {
    fn new(max_depth: usize, window: usize) -> Self {
        SeqIndex {
            tree: SuffixTree::new(max_depth),
            open: Vec::new(),
            indexed: Vec::new(),
            start: 0,
            window,
            prompt_len: 0,
        }
    }

    /// Indexes the part of `context` not yet seen, then drops the starts that fell out of the window; rebuilds
    /// when `context` does not extend what was indexed (an edited history) or when the new part alone fills the
    /// window (then only its last `window` tokens are indexed: the same tree the slide would leave).
    fn catch_up(&mut self, context: &[TokenId]) {
        let new_len = context.len().saturating_sub(self.indexed.len());
        if !context.starts_with(&self.indexed) || new_len >= self.window {
            let prompt_len = self.prompt_len.min(context.len());
            *self = SeqIndex::new(self.tree.max_depth, self.window);
            self.prompt_len = prompt_len;
            self.start = context.len().saturating_sub(self.window);
            self.indexed.extend_from_slice(&context[..self.start]);
        }
        let new = &context[self.indexed.len()..];
        // Novel text makes up to max_depth nodes a token; reserved at once, the arena is not copied as it grows.
        self.tree.nodes.reserve(new.len() * self.tree.max_depth);
        for &t in new {
            self.tree.extend(&mut self.open, t);
        }
        self.indexed.extend_from_slice(new);
        while self.indexed.len() - self.start > self.window {
            self.tree.remove_start(&self.indexed[self.start..]);
            self.start += 1;
        }
    }
}

/// The SuffixDecoding proposer: per-sequence trees plus one global tree of recent outputs.
#[derive(Debug)]
pub struct SuffixProposer {
    cfg: SuffixConfig,
    sequences: HashMap<SeqKey, SeqIndex>,
    global: SuffixTree,
    cached: VecDeque<Vec<TokenId>>,
    /// Tokens in `cached`.
    cached_tokens: usize,
}

impl SuffixProposer {
    pub fn new(cfg: SuffixConfig) -> Result<Self> {
        cfg.validate()?;
        let global = SuffixTree::new(cfg.max_tree_depth);
        Ok(SuffixProposer { cfg, sequences: HashMap::new(), global, cached: VecDeque::new(), cached_tokens: 0 })
    }

    /// The best draft and its score (the expected accepted tokens), used by the hybrid rule.
    pub fn propose_scored(&mut self, seq: SeqKey, context: &[TokenId], max_len: usize) -> (Draft, f64) {
        let depth = self.cfg.max_tree_depth;
        let window = self.cfg.max_indexed_tokens;
        let index = self.sequences.entry(seq).or_insert_with(|| SeqIndex::new(depth, window));
        index.catch_up(context);
        let local = index.tree.speculate(context, max_len, &self.cfg);
        let global = self.global.speculate(context, max_len, &self.cfg);
        let best = match (local, global) {
            (Some(l), Some(g)) => Some(if g.score > l.score { g } else { l }),
            (l, g) => l.or(g),
        };
        match best {
            Some(d) => {
                let score = d.score;
                (d.into_draft(), score)
            }
            None => (Draft::empty(), 0.0),
        }
    }

    /// Finished responses held in the global tree.
    pub fn cached_responses(&self) -> usize {
        self.cached.len()
    }

    /// Sequences with a live per-sequence tree.
    pub fn live_sequences(&self) -> usize {
        self.sequences.len()
    }

    /// Tokens of the finished responses held in the global tree.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    fn cache_response(&mut self, output: &[TokenId]) {
        if output.is_empty() || self.cfg.max_cached_requests == 0 || output.len() > self.cfg.max_cached_tokens {
            return;
        }
        self.global.insert(output);
        self.cached.push_back(output.to_vec());
        self.cached_tokens += output.len();
        while self.cached.len() > self.cfg.max_cached_requests || self.cached_tokens > self.cfg.max_cached_tokens {
            if let Some(old) = self.cached.pop_front() {
                self.cached_tokens -= old.len();
                self.global.remove(&old);
            }
        }
    }
}

impl Proposer for SuffixProposer {
    fn name(&self) -> &'static str {
        "suffix"
    }

    fn begin(&mut self, seq: SeqKey, prompt: &[TokenId]) {
        let (depth, window) = (self.cfg.max_tree_depth, self.cfg.max_indexed_tokens);
        let index = self.sequences.entry(seq).or_insert_with(|| SeqIndex::new(depth, window));
        index.catch_up(prompt);
        index.prompt_len = prompt.len();
    }

    fn propose(&mut self, seq: SeqKey, context: &[TokenId], max_len: usize) -> Draft {
        self.propose_scored(seq, context, max_len).0
    }

    fn end(&mut self, seq: SeqKey, context: &[TokenId], keep: bool) {
        let prompt_len = match self.sequences.get_mut(&seq) {
            Some(index) => {
                index.catch_up(context);
                index.prompt_len
            }
            None => context.len(),
        };
        self.cache_response(&context[prompt_len.min(context.len())..]);
        if !keep {
            self.sequences.remove(&seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SuffixConfig {
        SuffixConfig { max_tree_depth: 8, ..SuffixConfig::default() }
    }

    #[test]
    fn counts_are_occurrences_of_each_substring() {
        let mut t = SuffixTree::new(3);
        t.insert(&[1, 2, 1, 2, 3]);
        let count = |p: &[TokenId]| t.find(p).map(|n| t.node(n).count).unwrap_or(0);
        assert_eq!(count(&[1]), 2);
        assert_eq!(count(&[1, 2]), 2);
        assert_eq!(count(&[2, 1, 2]), 1);
        assert_eq!(count(&[1, 2, 3]), 1);
        assert_eq!(count(&[2, 3]), 1);
        assert_eq!(t.find(&[1, 2, 1, 2]), None, "deeper than max_depth is not indexed");
    }

    #[test]
    fn remove_undoes_insert_and_frees_nodes() {
        let mut t = SuffixTree::new(4);
        t.insert(&[5, 6, 7]);
        let before = t.node_count();
        t.insert(&[5, 6, 9, 9, 9]);
        t.remove(&[5, 6, 9, 9, 9]);
        assert_eq!(t.node_count(), before);
        assert_eq!(t.find(&[5, 6]).map(|n| t.node(n).count), Some(1));
        assert_eq!(t.find(&[9]), None);
        t.remove(&[5, 6, 7]);
        assert_eq!(t.node_count(), 1);
    }

    /// Every substring's count, by brute force: its occurrences (of length at most `depth`) in `seqs`.
    fn brute_counts(seqs: &[Vec<TokenId>], depth: usize) -> HashMap<Vec<TokenId>, u64> {
        let mut counts = HashMap::new();
        for s in seqs {
            for i in 0..s.len() {
                for j in i + 1..=(i + depth).min(s.len()) {
                    *counts.entry(s[i..j].to_vec()).or_insert(0) += 1;
                }
            }
        }
        counts
    }

    #[test]
    fn inserts_and_removes_keep_every_count_and_free_every_node() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let depth = 5;
        let mut t = SuffixTree::new(depth);
        let mut live: Vec<Vec<TokenId>> = Vec::new();
        for round in 0..300 {
            // A small alphabet, so nodes gain and lose children (none, one, many) as sequences come and go.
            if live.len() > 6 || (round % 3 == 2 && !live.is_empty()) {
                let gone = live.remove(rng.gen_range(0..live.len()));
                t.remove(&gone);
            } else {
                let seq: Vec<TokenId> = (0..rng.gen_range(1..30)).map(|_| rng.gen_range(0..4)).collect();
                t.insert(&seq);
                live.push(seq);
            }
            let want = brute_counts(&live, depth);
            for (pattern, count) in &want {
                assert_eq!(t.find(pattern).map(|n| t.node(n).count), Some(*count), "{pattern:?} in round {round}");
            }
            // Nodes are exactly the distinct substrings, plus the root; each node's children are sorted.
            assert_eq!(t.node_count(), want.len() + 1, "round {round}");
            for (i, node) in t.nodes.iter().enumerate() {
                if !t.free.contains(&NodeId(i as u32)) {
                    assert!(node.children.as_slice().windows(2).all(|w| w[0].0 < w[1].0));
                }
            }
        }
    }

    #[test]
    fn path_mode_follows_the_most_frequent_continuation() {
        let mut t = SuffixTree::new(8);
        // After [1, 2]: 3 follows twice, 4 once.
        t.insert(&[1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4]);
        let d = t.speculate(&[0, 1, 2], 8, &cfg()).unwrap();
        assert_eq!(d.tokens[0], 3);
        assert_eq!(d.tokens[1], 5);
        assert!((d.path_probs[0] - 2.0 / 3.0).abs() < 1e-12);
        assert!((d.score - d.path_probs.iter().sum::<f64>()).abs() < 1e-12);
        assert!(d.path_probs.windows(2).all(|w| w[1] <= w[0]));
    }

    #[test]
    fn speculation_length_scales_with_the_match_length() {
        let mut t = SuffixTree::new(16);
        let seq: Vec<TokenId> = (0..12).collect();
        t.insert(&seq);
        // A one-token match may draft one token, a three-token match three.
        let one = t.speculate(&[99, 3], 10, &cfg()).unwrap();
        assert_eq!((one.match_len, one.tokens.clone()), (1, vec![4]));
        let three = t.speculate(&[1, 2, 3], 10, &cfg()).unwrap();
        assert_eq!((three.match_len, three.tokens.clone()), (3, vec![4, 5, 6]));
        let offset = SuffixConfig { max_spec_offset: 2.0, ..cfg() };
        assert_eq!(t.speculate(&[99, 3], 10, &offset).unwrap().tokens, vec![4, 5, 6]);
        assert_eq!(t.speculate(&[1, 2, 3], 2, &cfg()).unwrap().tokens.len(), 2, "max_len caps the draft");
    }

    #[test]
    fn min_token_prob_stops_the_path() {
        let mut t = SuffixTree::new(8);
        t.insert(&[1, 2, 1, 3, 1, 4, 1, 5]);
        let strict = SuffixConfig { min_token_prob: 0.3, ..cfg() };
        assert_eq!(t.speculate(&[1], 4, &strict), None, "each continuation of 1 has probability 1/4");
        let loose = SuffixConfig { min_token_prob: 0.2, ..cfg() };
        assert_eq!(t.speculate(&[1], 4, &loose).unwrap().tokens[0], 2, "ties go to the lowest token");
    }

    #[test]
    fn proposer_drafts_from_the_sequence_and_from_finished_outputs() {
        let mut p = SuffixProposer::new(cfg()).unwrap();
        let (a, b) = (SeqKey(1), SeqKey(2));
        // The prompt (with a tool output) repeats a pattern: the per-sequence tree finds it.
        let prompt = [10, 11, 12, 13, 14, 50, 51, 10, 11];
        p.begin(a, &prompt);
        let d = p.propose(a, &prompt, 5);
        assert_eq!(&d.tokens()[..2], &[12, 13]);
        // Request a generates [30, 31, 32, 33] and ends; b starts fresh and meets 30, 31.
        let mut done = prompt.to_vec();
        done.extend([30, 31, 32, 33]);
        p.end(a, &done, false);
        assert_eq!(p.live_sequences(), 0);
        assert_eq!(p.cached_responses(), 1);
        p.begin(b, &[7, 8]);
        let d = p.propose(b, &[7, 8, 30, 31], 4);
        assert_eq!(d.tokens(), &[32, 33]);
        // The prompt of a is not in the global tree.
        assert!(p.propose(b, &[7, 8, 10, 11], 4).is_empty());
    }

    #[test]
    fn the_global_tree_evicts_first_in_first_out() {
        let mut p = SuffixProposer::new(SuffixConfig { max_cached_requests: 2, ..cfg() }).unwrap();
        for (i, out) in [[1, 2, 3], [4, 5, 6], [7, 8, 9]].iter().enumerate() {
            let seq = SeqKey(i as u64);
            p.begin(seq, &[100]);
            p.end(seq, &[100, out[0], out[1], out[2]], false);
        }
        assert_eq!(p.cached_responses(), 2);
        assert!(p.propose(SeqKey(9), &[1, 2], 2).is_empty(), "the oldest output was evicted");
        assert_eq!(p.propose(SeqKey(9), &[4, 5], 2).tokens(), &[6]);
    }

    #[test]
    fn a_sequence_tree_covers_the_last_max_indexed_tokens_of_the_context() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let (depth, window) = (4, 40);
        let context: Vec<TokenId> = (0..300).map(|_| rng.gen_range(0..5)).collect();
        // Grown token by token, in uneven pieces, and in one piece longer than the window: each time the tree holds
        // exactly the substrings starting in the last `window` tokens, with no node beyond them.
        for pieces in [vec![1; 300], vec![7, 1, 50, 13, 100, 29, 100], vec![300]] {
            let mut index = SeqIndex::new(depth, window);
            let mut len = 0;
            for piece in pieces {
                len += piece;
                index.catch_up(&context[..len]);
                let covered = context[len.saturating_sub(window)..len].to_vec();
                let want = brute_counts(&[covered], depth);
                for (pattern, count) in &want {
                    assert_eq!(index.tree.find(pattern).map(|n| index.tree.node(n).count), Some(*count), "{len}");
                }
                assert_eq!(index.tree.node_count(), want.len() + 1, "at {len} tokens");
            }
        }
        // A pattern seen only before the window is no longer drafted; one inside it still is.
        let mut p = SuffixProposer::new(SuffixConfig { max_tree_depth: 4, max_indexed_tokens: 8, ..cfg() }).unwrap();
        let s = SeqKey(4);
        let old = [90, 91, 92, 93];
        let mut ctx: Vec<TokenId> = old.to_vec();
        ctx.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 90, 91]);
        p.begin(s, &ctx);
        assert!(p.propose(s, &ctx, 2).is_empty(), "90, 91 -> 92 fell out of the window");
        ctx.extend([92, 50, 90, 91]);
        assert_eq!(p.propose(s, &ctx, 1).tokens(), &[92]);
    }

    #[test]
    fn the_global_tree_keeps_at_most_max_cached_tokens() {
        let mut p = SuffixProposer::new(SuffixConfig { max_cached_tokens: 7, ..cfg() }).unwrap();
        for (i, out) in [vec![1, 2, 3], vec![4, 5, 6], vec![7, 8], vec![9; 8]].iter().enumerate() {
            let seq = SeqKey(i as u64);
            p.begin(seq, &[100]);
            let mut done = vec![100];
            done.extend(out);
            p.end(seq, &done, false);
        }
        // 3 + 3 + 2 tokens passed the bound: the oldest response went; the 8-token one was never kept.
        assert_eq!((p.cached_responses(), p.cached_tokens()), (2, 5));
        assert!(p.propose(SeqKey(9), &[1, 2], 2).is_empty());
        assert_eq!(p.propose(SeqKey(9), &[4, 5], 2).tokens(), &[6]);
        assert!(p.propose(SeqKey(10), &[7, 9], 2).is_empty(), "the 8-token response was never kept");
    }

    #[test]
    fn a_context_that_does_not_extend_the_index_is_reindexed() {
        let mut p = SuffixProposer::new(cfg()).unwrap();
        let s = SeqKey(3);
        p.begin(s, &[1, 2, 3, 1, 2]);
        assert_eq!(p.propose(s, &[1, 2, 3, 1, 2], 1).tokens(), &[3]);
        // The session's history was edited: 3 never followed 1, 2 in the new context.
        assert_eq!(p.propose(s, &[1, 2, 4, 1, 2], 1).tokens(), &[4]);
    }

    #[test]
    fn bad_config_is_an_error() {
        let bad = SuffixConfig { min_token_prob: 1.5, ..SuffixConfig::default() };
        assert_eq!(SuffixProposer::new(bad).unwrap_err().kind(), "config");
        let narrow = SuffixConfig { max_indexed_tokens: 10, ..SuffixConfig::default() };
        let err = SuffixProposer::new(narrow).unwrap_err().to_string();
        assert!(err.contains("max_indexed_tokens") && err.contains("max_tree_depth"), "{err}");
    }
}
