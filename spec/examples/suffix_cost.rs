//! What SuffixDecoding costs the engine thread (`cargo run --release -p sparkd-spec --example suffix_cost`): a
//! proposer warmed with 400 finished requests, then ten 10,000-token prompts, each begun (indexed), drafted for
//! over 100 steps and ended, over a 150,000-id vocabulary where half the text repeats earlier spans (as tool
//! outputs and edited files do). Prints the mean of each; docs/perf/decisions.md#d85 records the figures.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparkd_kernels::TokenId;
use sparkd_spec::draft::{Proposer, SeqKey};
use sparkd_spec::suffix::{SuffixConfig, SuffixProposer};

const VOCAB: TokenId = 150_000;

/// `n` tokens, half of them copies of 4..32-token spans of what came before.
fn agent_text(n: usize, rng: &mut ChaCha8Rng) -> Vec<TokenId> {
    let mut text = Vec::with_capacity(n + 32);
    while text.len() < n {
        if text.len() > 64 && rng.gen_bool(0.5) {
            let start = rng.gen_range(0..text.len() - 32);
            let len = rng.gen_range(4..32);
            text.extend_from_within(start..start + len);
        } else {
            text.push(rng.gen_range(0..VOCAB));
        }
    }
    text.truncate(n);
    text
}

fn main() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut proposer = SuffixProposer::new(SuffixConfig::default()).expect("the default config is valid");
    let started = Instant::now();
    for i in 0..400 {
        let text = agent_text(600, &mut rng);
        proposer.begin(SeqKey(i), &text[..300]);
        proposer.end(SeqKey(i), &text, false);
    }
    println!("warm-up: 400 requests of 300 + 300 tokens in {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
    let (requests, steps) = (10, 100);
    let (mut begin, mut propose, mut end) = (0.0, 0.0, 0.0);
    for r in 0..requests {
        let seq = SeqKey(1_000 + r);
        let mut context = agent_text(10_000, &mut rng);
        let t = Instant::now();
        proposer.begin(seq, &context);
        begin += t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..steps {
            let draft = proposer.propose(seq, &context, 7);
            context.push(draft.tokens().first().copied().unwrap_or_else(|| rng.gen_range(0..VOCAB)));
        }
        propose += t.elapsed().as_secs_f64();
        let t = Instant::now();
        proposer.end(seq, &context, false);
        end += t.elapsed().as_secs_f64();
    }
    let per_request = |s: f64| s * 1e3 / requests as f64;
    println!(
        "a 10,000-token request: begin {:.2} ms, propose {:.3} ms a step, end {:.2} ms",
        per_request(begin),
        per_request(propose) / steps as f64,
        per_request(end)
    );
}
