//! Fuzz target: the trace readers of `sparkd-workloads` on arbitrary file bytes, read both as an AgentX/Weka JSON
//! session (`trace::parse_weka`) and as Mooncake JSONL (`trace::parse_mooncake`), then what `sparkd-replay` does
//! with an accepted trace: its session trees (`dag::weka_session`, `dag::mooncake_sessions`) and the prompt of every
//! turn (`synth::Conversation::plan`, over a toy vocabulary).
//!
//! Checks, for any bytes:
//! - nothing panics; a refusal names the file;
//! - the session invariants of `dag.rs`: no negative or non-finite delay; a branch spawns after an existing main
//!   turn and joins before a later one; a chain's setup prefix holds at most the first turn's hash blocks and
//!   leaves at least one of its tokens outside;
//! - every planned turn sends exactly its scaled input length of content tokens.

#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use sparkd_workloads::dag::{mooncake_sessions, weka_session, Chain, Session};
use sparkd_workloads::synth::{Conversation, HistoryMode, Synth, TokenCodec, TokenPool};
use sparkd_workloads::trace::{parse_mooncake, parse_weka};

/// Scales recorded token counts down so a fuzzed `in` of u32::MAX still plans in a few megabytes.
const TOKEN_SCALE: f64 = 1e-4;
/// Most scaled tokens planned per input.
const PLAN_BUDGET: usize = 1 << 18;

/// A toy vocabulary: id `i` is the word `" q"` plus three base-26 letters; `encode` inverts it.
struct ToyCodec;

impl TokenCodec for ToyCodec {
    fn vocab_size(&self) -> u32 {
        1024
    }

    fn token_text(&self, id: u32) -> Option<String> {
        let letters = [2u32, 1, 0].map(|shift| char::from(b'a' + ((id / 26u32.pow(shift)) % 26) as u8));
        Some(format!(" q{}", String::from_iter(letters)))
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        text.split(' ')
            .filter(|w| !w.is_empty())
            .map(|w| w.bytes().skip(1).fold(0u32, |acc, b| acc * 26 + u32::from(b - b'a')))
            .collect()
    }
}

fn synth() -> &'static Synth {
    static SYNTH: OnceLock<Synth> = OnceLock::new();
    SYNTH.get_or_init(|| Synth::new(TokenPool::build(&ToyCodec).expect("toy pool"), TOKEN_SCALE).expect("scale"))
}

fn check_chain(chain: &Chain, block_size: u32) {
    for turn in &chain.turns {
        assert!(turn.delay_s.is_finite() && turn.delay_s >= 0.0, "{}: delay {}", chain.id, turn.delay_s);
    }
    if let Some(first) = chain.turns.first() {
        assert!(chain.setup_blocks <= first.hash_ids.len(), "{}: setup past the hash blocks", chain.id);
        let setup_tokens = chain.setup_blocks as u128 * u128::from(block_size);
        assert!(setup_tokens < u128::from(first.input_tokens), "{}: setup takes the whole first turn", chain.id);
    }
}

fn check_session(session: &Session) {
    check_chain(&session.main, session.block_size);
    let turns = session.main.turns.len();
    for branch in &session.branches {
        assert!(branch.after_turn < turns, "{}: branch after turn {}", session.id, branch.after_turn);
        if let Some(join) = branch.join_before {
            assert!(branch.after_turn < join && join < turns, "{}: branch joins before {join}", session.id);
        }
        for child in &branch.children {
            assert!(child.spawn_delay_s.is_finite() && child.spawn_delay_s >= 0.0, "{}", child.spawn_delay_s);
            check_chain(&child.chain, session.block_size);
        }
    }
}

fn plan(session: &Session) {
    let synth = synth();
    let chains =
        std::iter::once(&session.main).chain(session.branches.iter().flat_map(|b| &b.children).map(|c| &c.chain));
    let mut budget = PLAN_BUDGET;
    for chain in chains {
        let mut conversation = Conversation::new(HistoryMode::Resend, synth.marker(7));
        for (k, turn) in chain.turns.iter().enumerate() {
            let cost = synth.scaled(turn.input_tokens) + synth.scaled(turn.output_tokens);
            let Some(left) = budget.checked_sub(cost) else { return };
            budget = left;
            let input = conversation.plan(synth, session.scope, session.block_size, chain, k);
            assert_eq!(input.context_tokens, synth.scaled(turn.input_tokens));
            let sent: usize = input.messages.iter().map(|m| m.tokens.len()).sum();
            assert_eq!(sent, input.context_tokens, "{} turn {k}", chain.id);
            conversation.complete(synth, session.scope, chain, k, 0);
        }
    }
}

fuzz_target!(|bytes: &[u8]| {
    let path = Path::new("fuzz.json");
    match parse_weka(path, bytes) {
        Ok(trace) => {
            let session = weka_session(&trace);
            check_session(&session);
            plan(&session);
        }
        Err(e) => assert!(e.to_string().contains("fuzz.json"), "{e}"),
    }
    match parse_mooncake(Path::new("fuzz.jsonl"), bytes) {
        Ok(trace) => {
            for session in mooncake_sessions(&trace) {
                check_session(&session);
                plan(&session);
            }
        }
        Err(e) => assert!(e.to_string().contains("fuzz.jsonl"), "{e}"),
    }
});
