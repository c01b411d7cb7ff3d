//! The whole speculation loop without a model: a toy target (logits from the last two tokens), the
//! spec proposers and budgets, the kernels' acceptance rule, and the statistics. Checks that greedy
//! speculation is lossless (the same tokens as decoding without drafts), that seeded sampling is
//! reproducible, and the metric identities of dspark.md §6 (d).

use sparkd_kernels::acceptance::{verify, AcceptanceMode, VerifyWindow};
use sparkd_kernels::runner::SamplingParams;
use sparkd_kernels::sampling::sample;
use sparkd_kernels::TokenId;
use sparkd_spec::budget::request_cap;
use sparkd_spec::hybrid::{HybridProposer, HybridRule, ModelDrafts};
use sparkd_spec::ngram::{NgramConfig, NgramProposer};
use sparkd_spec::sps::SpsPoint;
use sparkd_spec::suffix::{SuffixConfig, SuffixProposer};
use sparkd_spec::{BudgetPolicy, BudgetRow, Proposer, RequestSpecStats, SeqKey, SpecCounters, SpsProfile};

const VOCAB: usize = 64;

/// `[VOCAB]` logits of the token after `context`: a fixed pseudo-random function of its last two
/// tokens, peaked enough that greedy text is repetitive (as agent traffic is).
fn toy_logits(context: &[TokenId]) -> Vec<f32> {
    let a = context.len().checked_sub(2).map_or(0, |i| context[i]) as u64;
    let b = context.last().copied().unwrap_or(0) as u64;
    (0..VOCAB as u64)
        .map(|v| {
            let h = (a * 31 + b * 17 + v * 7919).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (h % 1000) as f32 / 150.0
        })
        .collect()
}

fn decode_without_drafts(prompt: &[TokenId], params: &SamplingParams, n: usize) -> Vec<TokenId> {
    let mut context = prompt.to_vec();
    for _ in 0..n {
        let position = context.len() as u64;
        context.push(sample(&toy_logits(&context), params, position).unwrap());
    }
    context[prompt.len()..].to_vec()
}

/// Runs speculation for `n` output tokens; returns the output and the request's statistics.
fn decode_with_drafts(
    proposer: &mut dyn Proposer,
    policy: &mut BudgetPolicy,
    prompt: &[TokenId],
    params: &SamplingParams,
    n: usize,
) -> (Vec<TokenId>, RequestSpecStats, usize) {
    let seq = SeqKey(1);
    let mut context = prompt.to_vec();
    let mut stats = RequestSpecStats::new(true);
    let mut rounds = 0;
    proposer.begin(seq, prompt);
    while context.len() - prompt.len() < n {
        let left = n - (context.len() - prompt.len());
        let draft = proposer.propose(seq, &context, 6);
        let row = BudgetRow { draft: &draft, cap: request_cap(draft.len(), left, usize::MAX) };
        let verified = policy.plan(&[row])[0];
        let drafts = &draft.tokens()[..verified];
        // [verified + 1, VOCAB]: the target's rows for the anchor and each draft.
        let mut logits = Vec::with_capacity((verified + 1) * VOCAB);
        let mut extended = context.clone();
        logits.extend(toy_logits(&extended));
        for &d in drafts {
            extended.push(d);
            logits.extend(toy_logits(&extended));
        }
        let window = VerifyWindow {
            target_logits: &logits,
            vocab: VOCAB,
            drafts,
            draft_logits: None,
            first_position: context.len() as u64,
        };
        let verdict = verify(&window, params, &AcceptanceMode::Standard).unwrap();
        stats.record(verified, verdict.num_accepted, verdict.synthetic).unwrap();
        context.extend(&verdict.tokens);
        rounds += 1;
    }
    proposer.end(seq, &context, false);
    context.truncate(prompt.len() + n);
    (context[prompt.len()..].to_vec(), stats, rounds)
}

fn sps() -> SpsProfile {
    let points = [(1, 100.0), (8, 97.0), (32, 60.0)];
    SpsProfile::from_points(points.iter().map(|&(b, s)| SpsPoint { batch_tokens: b, steps_per_second: s }).collect())
        .unwrap()
}

fn policies() -> Vec<BudgetPolicy> {
    vec![BudgetPolicy::Full, BudgetPolicy::StaticThreshold(0.3), BudgetPolicy::Dspark(sps())]
}

#[test]
fn greedy_speculation_is_lossless_and_accepts_on_repetitive_text() {
    let prompt: Vec<TokenId> = vec![3, 9, 27, 17, 51, 25];
    let greedy = SamplingParams::greedy();
    let reference = decode_without_drafts(&prompt, &greedy, 300);
    for mut policy in policies() {
        let mut suffix = SuffixProposer::new(SuffixConfig::default()).unwrap();
        let (out, stats, rounds) = decode_with_drafts(&mut suffix, &mut policy, &prompt, &greedy, 300);
        assert_eq!(out, reference, "{policy:?}");
        let c = stats.counters();
        assert!(c.mean_acceptance_length().unwrap() > 1.5, "{policy:?}: {c:?}");
        assert!(rounds < 300, "speculation saved target steps");
    }
    let mut ngram = NgramProposer::new(NgramConfig::default()).unwrap();
    let (out, _, _) = decode_with_drafts(&mut ngram, &mut BudgetPolicy::Full, &prompt, &greedy, 300);
    assert_eq!(out, reference, "ngram");
}

#[test]
fn seeded_sampling_with_drafts_is_reproducible() {
    let prompt: Vec<TokenId> = vec![1, 2, 3, 4];
    let params = SamplingParams { temperature: 0.8, top_p: 0.95, top_k: 20, seed: 1234, logprobs: None };
    let run = || {
        let suffix = SuffixProposer::new(SuffixConfig::default()).unwrap();
        let mut hybrid = HybridProposer::new(suffix, Box::new(ModelDrafts::new("dspark")), HybridRule::ModelExpected);
        decode_with_drafts(&mut hybrid, &mut BudgetPolicy::Dspark(sps()), &prompt, &params, 200).0
    };
    assert_eq!(run(), run());
}

#[test]
fn statistics_satisfy_the_metric_identities() {
    let prompt: Vec<TokenId> = vec![5, 6, 7];
    let mut suffix = SuffixProposer::new(SuffixConfig::default()).unwrap();
    let greedy = SamplingParams::greedy();
    let (_, stats, rounds) = decode_with_drafts(&mut suffix, &mut BudgetPolicy::Full, &prompt, &greedy, 250);
    let c = stats.counters();
    assert_eq!(c.accepted_per_pos.iter().sum::<u64>(), c.num_accepted_tokens);
    let al = c.mean_acceptance_length().unwrap();
    assert!((al - (1.0 + c.num_accepted_tokens as f64 / c.num_drafts as f64)).abs() < 1e-12);
    // Every round emits accepted + 1 tokens (rounds without drafts emit 1 and are not drafts), and
    // the cap keeps the last round inside max_tokens.
    assert_eq!(c.num_accepted_tokens as usize + rounds, 250);
    let aiperf = stats.to_aiperf(Some(6)).unwrap();
    assert_eq!(aiperf.acceptance_histogram.values().sum::<u64>(), aiperf.num_spec_steps);
    assert_eq!(aiperf.per_step_accepted.as_ref().unwrap().iter().sum::<u64>(), aiperf.num_accepted_draft_tokens);
    let mut global = SpecCounters::default();
    global.merge(c);
    global.merge(c);
    assert_eq!(global.num_drafts, 2 * c.num_drafts);
}
