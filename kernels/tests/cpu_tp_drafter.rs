//! The DSpark drafter replicated beside a sharded CPU runner (k3-tiny, synthetic target and drafter): its drafts
//! and confidences equal the unsharded runner's, decoding with model drafts is lossless (greedy output equals
//! plain decoding), seeded sampling with model drafts (verified against `q`) gives exactly the unsharded
//! runner's tokens, and the sampled-drafting checks of the unsharded runner hold. Windows stay at or under 16
//! tokens.

mod drafting;

use sparkd_kernels::cpu::{CpuRunner, ParallelConfig, ShardedCpuRunner};
use sparkd_kernels::dspark::{DrafterConfig, DrafterSource};
use sparkd_kernels::runner::SamplingParams;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, Runner, TokenId};

use drafting::{
    check_seeded_drafting_ignores_batching, check_verification_uses_q, decode, decode_with_model_drafts, draft_req,
    prefill, prompt, sampled,
};

/// What a runner gives for [`script`].
#[derive(Debug, PartialEq)]
struct Outputs {
    /// A greedy and a sampled draft from the same state: tokens and confidences.
    drafts: Vec<(Vec<TokenId>, Vec<f32>)>,
    plain: Vec<TokenId>,
    greedy_drafted: Vec<Vec<TokenId>>,
    sampled_drafted: Vec<Vec<TokenId>>,
}

/// Both runners' outputs of the same script: drafts from a prefilled state, greedy decoding with and without
/// model drafts, and seeded sampling with model drafts.
fn script(r: &mut dyn Runner) -> Outputs {
    let greedy = SamplingParams::greedy();
    let p = prompt(12, 4);
    let a = r.alloc_state().unwrap();
    prefill(r, a, &p[..11]);
    let plain_state = r.fork_state(a).unwrap();
    let plain = decode(r, plain_state, p[11], 10, &greedy);
    let drafts: Vec<(Vec<TokenId>, Vec<f32>)> = [&greedy, &sampled(7)]
        .iter()
        .map(|params| {
            let proposal = r.model_drafter().unwrap().draft(&[draft_req(a, p[11], 6, params)]).unwrap().remove(0);
            (proposal.tokens, proposal.confidences)
        })
        .collect();
    let b = r.fork_state(a).unwrap();
    let greedy_drafted = decode_with_model_drafts(r, &[(a, p[11])], 5, 10, &greedy);
    let sampled_drafted = decode_with_model_drafts(r, &[(b, p[11])], 4, 10, &sampled(3));
    for s in [a, b, plain_state] {
        r.free_state(s).unwrap();
    }
    assert_eq!(greedy_drafted[0][..10], plain[..], "greedy decoding with model drafts is lossless");
    Outputs { drafts, plain, greedy_drafted, sampled_drafted }
}

#[test]
fn a_replicated_drafter_drafts_and_verifies_as_the_unsharded_runner_does() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 11);
    let drafter = || DrafterSource::synthetic(DrafterConfig::preset("k3-tiny").unwrap(), 3);
    let mut whole = CpuRunner::new(cfg.clone(), &src).unwrap();
    whole.attach_drafter(drafter()).unwrap();
    let want = script(&mut whole);
    let parallel = ParallelConfig { tensor_parallel: 2, expert_parallel: false };
    let mut sharded = ShardedCpuRunner::new(cfg, &src, parallel).unwrap();
    sharded.attach_drafter(drafter()).unwrap();
    assert_eq!(script(&mut sharded), want);
    // The checks the unsharded runner passes (`dspark_runner.rs`): seeded drafting whatever the batch, and
    // verification with `q` for selected proposals.
    check_seeded_drafting_ignores_batching(&mut sharded, 4);
    let p = prompt(8, 20);
    let base = sharded.alloc_state().unwrap();
    prefill(&mut sharded, base, &p[..7]);
    check_verification_uses_q(&mut sharded, base, p[7], 4);
}
