//! Stop strings matched on streamed text in time linear in the text, whatever their number and length.
//!
//! The matcher is an Aho-Corasick automaton over the stop strings' bytes (Aho and Corasick, "Efficient string
//! matching", 1975): one state per distinct prefix, failure links to the longest proper suffix that is also a
//! prefix, and for each state the longest stop string that ends there. Text is fed in chunks as it is
//! detokenized.
//!
//! Invariants:
//! - The text released is the text cut before the stop string that completes first (the one whose end comes
//!   earliest; of those ending at the same byte, the longest), however the text is split into chunks: a
//!   token-by-token generator would have stopped there.
//! - Only the text that could still be the start of a stop string is held back: the longest suffix of the text
//!   that is a prefix of a stop string (the automaton state's depth), never the longest stop string's length.
//!   Such a suffix begins on a character boundary (it equals the start of a stop string, which is UTF-8).
//! - Feeding costs O(bytes fed) amortized; building costs O(total bytes of the stop strings) states, each with
//!   a sorted list of its transitions.

/// A state of the automaton.
#[derive(Clone, Debug, Default)]
struct Node {
    /// Transitions by byte, sorted by byte.
    next: Vec<(u8, u32)>,
    /// The state of the longest proper suffix of this state's prefix that is also a prefix.
    fail: u32,
    /// Bytes of the prefix this state stands for.
    depth: u32,
    /// Length of the longest stop string that ends at this state (itself or through its failure chain); 0: none.
    longest_match: u32,
}

impl Node {
    fn child(&self, byte: u8) -> Option<u32> {
        self.next.binary_search_by_key(&byte, |&(b, _)| b).ok().map(|i| self.next[i].1)
    }
}

const ROOT: u32 = 0;

/// Holds back text that may be the start of a stop string, and finds the first one completed.
#[derive(Clone, Debug)]
pub struct StopStrings {
    nodes: Vec<Node>,
    /// The automaton's state after the text fed so far.
    state: u32,
    /// Text fed but not released: exactly the last `nodes[state].depth` bytes.
    pending: String,
    matched: bool,
}

impl Default for StopStrings {
    fn default() -> Self {
        StopStrings::new(Vec::new())
    }
}

impl StopStrings {
    /// The matcher of `stops` (empty strings are ignored; requests refuse them before this).
    pub fn new(stops: Vec<String>) -> Self {
        let mut nodes = vec![Node::default()];
        for stop in stops.iter().filter(|s| !s.is_empty()) {
            let mut at = ROOT;
            for &byte in stop.as_bytes() {
                at = match nodes[at as usize].child(byte) {
                    Some(next) => next,
                    None => {
                        let next = nodes.len() as u32;
                        let depth = nodes[at as usize].depth + 1;
                        nodes.push(Node { depth, ..Node::default() });
                        let list = &mut nodes[at as usize].next;
                        let slot = list.partition_point(|&(b, _)| b < byte);
                        list.insert(slot, (byte, next));
                        next
                    }
                };
            }
            let node = &mut nodes[at as usize];
            node.longest_match = node.longest_match.max(stop.len() as u32);
        }
        // Failure links breadth first: a state's link is found from its parent's, which is shallower.
        let mut queue = std::collections::VecDeque::from([ROOT]);
        while let Some(parent) = queue.pop_front() {
            for i in 0..nodes[parent as usize].next.len() {
                let (byte, child) = nodes[parent as usize].next[i];
                let fail = if parent == ROOT { ROOT } else { Self::advance(&nodes, nodes[parent as usize].fail, byte) };
                let inherited = nodes[fail as usize].longest_match;
                let node = &mut nodes[child as usize];
                node.fail = fail;
                node.longest_match = node.longest_match.max(inherited);
                queue.push_back(child);
            }
        }
        StopStrings { nodes, state: ROOT, pending: String::new(), matched: false }
    }

    /// The state after `byte` from `state`, following failure links where `state` has no transition for it.
    fn advance(nodes: &[Node], mut state: u32, byte: u8) -> u32 {
        loop {
            if let Some(next) = nodes[state as usize].child(byte) {
                return next;
            }
            if state == ROOT {
                return ROOT;
            }
            state = nodes[state as usize].fail;
        }
    }

    /// Whether a stop string was found (later text is discarded).
    pub fn matched(&self) -> bool {
        self.matched
    }

    /// Adds text; returns what can be released.
    pub fn feed(&mut self, text: &str) -> String {
        if self.matched {
            return String::new();
        }
        if self.nodes.len() == 1 {
            return text.to_string();
        }
        let held = self.pending.len();
        for (i, &byte) in text.as_bytes().iter().enumerate() {
            self.state = Self::advance(&self.nodes, self.state, byte);
            let found = self.nodes[self.state as usize].longest_match as usize;
            if found > 0 {
                // The match ends after `text[i]` and began within the held text or `text` (the state before
                // this byte was at least `found - 1` deep, and the held text is exactly that deep), on a
                // character boundary (its first byte is a stop string's first byte).
                self.matched = true;
                let start = (held + i + 1) - found;
                let mut out = std::mem::take(&mut self.pending);
                if start <= held {
                    out.truncate(start);
                } else {
                    out.push_str(&text[..start - held]);
                }
                return out;
            }
        }
        self.pending.push_str(text);
        let keep_from = self.pending.len() - self.nodes[self.state as usize].depth as usize;
        let tail = self.pending.split_off(keep_from);
        std::mem::replace(&mut self.pending, tail)
    }

    /// Releases what was held back (nothing after a match).
    pub fn finish(&mut self) -> String {
        self.state = ROOT;
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Feeds `pieces`; returns everything released and whether a stop string matched.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|x| x.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            out.push_str(&s.feed(p));
        }
        if !s.matched() {
            out.push_str(&s.finish());
        }
        (out, s.matched())
    }

    /// The text before the stop string that completes first (the longest of those ending at the same byte).
    fn oracle(stops: &[&str], text: &str) -> (String, bool) {
        let bytes = text.as_bytes();
        for end in 1..=bytes.len() {
            let start = stops
                .iter()
                .filter(|s| !s.is_empty() && bytes[..end].ends_with(s.as_bytes()))
                .map(|s| end - s.len())
                .min();
            if let Some(start) = start {
                return (text[..start].to_string(), true);
            }
        }
        (text.to_string(), false)
    }

    #[test]
    fn stop_strings_cut_before_the_match_even_across_pieces() {
        assert_eq!(run(&["END"], &["abc E", "N", "Dxyz"]), ("abc ".to_string(), true));
        assert_eq!(run(&["END", "c"], &["ab", "cEND"]), ("ab".to_string(), true));
        assert_eq!(run(&["zz"], &["abc", "def"]), ("abcdef".to_string(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), false));
    }

    #[test]
    fn the_stop_string_that_completes_first_wins_whatever_the_chunking() {
        // "c" completes before "abcd" does, so a token-by-token generator stops after "ab".
        assert_eq!(run(&["abcd", "c"], &["abcd"]), ("ab".to_string(), true));
        assert_eq!(run(&["abcd", "c"], &["a", "b", "c", "d"]), ("ab".to_string(), true));
        // Ending at the same byte, the longer one wins.
        assert_eq!(run(&["d", "bcd"], &["abcd"]), ("a".to_string(), true));
        // A failure link into a shorter stop string: "abx" fails over to "bx".
        assert_eq!(run(&["abc", "bx"], &["ab", "x"]), ("a".to_string(), true));
    }

    #[test]
    fn only_a_possible_start_of_a_stop_string_is_held_back() {
        let mut s = StopStrings::new(vec!["STOP".into()]);
        assert_eq!(s.feed("hello ST"), "hello ");
        assert_eq!(s.feed("ay"), "STay");
        assert_eq!(s.feed("é日本"), "é日本");
        assert_eq!(s.feed("S"), "");
        assert_eq!(s.finish(), "S");
        // A long stop string holds back nothing while the text does not start it.
        let mut long = StopStrings::new(vec!["x".repeat(1 << 20)]);
        assert_eq!(long.feed("streamed text"), "streamed text");
        assert_eq!(long.feed("xx"), "");
        assert_eq!(long.feed("y"), "xxy");
    }

    #[test]
    fn random_texts_stops_and_chunkings_agree_with_the_naive_search() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let alphabet = ['a', 'b', 'c', 'é', '日'];
        let word = |rng: &mut rand_chacha::ChaCha8Rng, max: usize| -> String {
            (0..rng.gen_range(1..=max)).map(|_| alphabet[rng.gen_range(0..alphabet.len())]).collect()
        };
        for _ in 0..3000 {
            let stops: Vec<String> = (0..rng.gen_range(0..4)).map(|_| word(&mut rng, 4)).collect();
            let text = word(&mut rng, 24);
            let mut pieces = Vec::new();
            let mut rest = text.as_str();
            while !rest.is_empty() {
                let mut cut = rng.gen_range(0..=rest.len());
                while !rest.is_char_boundary(cut) {
                    cut -= 1;
                }
                pieces.push(&rest[..cut]);
                rest = &rest[cut..];
            }
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            assert_eq!(run(&stop_refs, &pieces), oracle(&stop_refs, &text), "stops {stops:?}, pieces {pieces:?}");
        }
    }

    #[test]
    fn stop_strings_that_nearly_match_everywhere_are_held_and_released_exactly() {
        // Adversarial for a restart-per-position search: stop strings that almost match everywhere.
        let stops: Vec<String> = (0..16).map(|i| format!("{}{i}", "a".repeat(1 << 16))).collect();
        let mut s = StopStrings::new(stops);
        let mut released = 0;
        for _ in 0..64 {
            released += s.feed(&"a".repeat(1 << 12)).len();
        }
        assert!(!s.matched());
        // Everything fed is a possible start of a stop string until the text outgrows them.
        assert_eq!(released + s.finish().len(), 64 << 12);
    }
}
