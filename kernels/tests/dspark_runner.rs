//! The DSpark drafter inside the CPU runner (k3-tiny, synthetic target and drafter): deterministic
//! drafts, a drafter context that follows commit and rollback exactly, greedy losslessness with model
//! drafts for γ = 1..8 over batches of mixed lengths, seeded reproducibility of sampling with model
//! drafts and the use of `q`, and the errors of the drafter API. Windows stay at or under 16 tokens,
//! where the forward of a window equals token-by-token decoding bit for bit.

mod drafting;

use std::sync::{Mutex, MutexGuard, OnceLock};

use sparkd_kernels::acceptance::{AcceptanceMode, SyntheticSchedule};
use sparkd_kernels::cpu::CpuRunner;
use sparkd_kernels::dspark::{DrafterConfig, DrafterSource};
use sparkd_kernels::runner::{DraftProposal, RowInput, SamplingParams, TokenMask};
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, Runner, StateId, TokenId};

use drafting::{
    check_seeded_drafting_ignores_batching, check_verification_uses_q, decode, decode_with_model_drafts, draft_req,
    prefill, prompt, row,
};

fn runner() -> MutexGuard<'static, CpuRunner> {
    static R: OnceLock<Mutex<CpuRunner>> = OnceLock::new();
    R.get_or_init(|| {
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let mut r = CpuRunner::new(cfg.clone(), &SyntheticWeights::new(cfg.clone(), 11)).unwrap();
        let dcfg = DrafterConfig::preset("k3-tiny").unwrap();
        r.attach_drafter(DrafterSource::synthetic(dcfg, 3)).unwrap();
        Mutex::new(r)
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

#[test]
fn drafts_are_deterministic_and_need_the_context() {
    let mut r = runner();
    let greedy = SamplingParams::greedy();
    let p = prompt(9, 1);
    let a = r.alloc_state().unwrap();
    prefill(&mut *r, a, &p[..8]);
    assert_eq!(r.drafter().unwrap().context(a).unwrap().len(), 8);
    assert_eq!(r.model_drafter().map(|d| d.block_size()), Some(7));
    let first = r.model_drafter().unwrap().draft(&[draft_req(a, p[8], 7, &greedy)]).unwrap();
    let again = r.model_drafter().unwrap().draft(&[draft_req(a, p[8], 7, &greedy)]).unwrap();
    assert_eq!(first, again);
    // A fork drafts the same; a different context drafts differently.
    let fork = r.fork_state(a).unwrap();
    assert_eq!(r.model_drafter().unwrap().draft(&[draft_req(fork, p[8], 7, &greedy)]).unwrap(), first);
    let other = r.alloc_state().unwrap();
    prefill(&mut *r, other, &prompt(8, 2));
    let different = r.model_drafter().unwrap().draft(&[draft_req(other, p[8], 7, &greedy)]).unwrap();
    assert_ne!(different[0].confidences, first[0].confidences);
    // Sampled drafts depend on the seed only through the draft stream, reproducibly.
    let sampled = |seed| SamplingParams { temperature: 1.5, top_p: 1.0, top_k: 0, seed, logprobs: None };
    let s1 = r.model_drafter().unwrap().draft(&[draft_req(a, p[8], 7, &sampled(1))]).unwrap();
    assert_eq!(s1, r.model_drafter().unwrap().draft(&[draft_req(a, p[8], 7, &sampled(1))]).unwrap());
    let seeds: Vec<Vec<DraftProposal>> =
        (2..6).map(|s| r.model_drafter().unwrap().draft(&[draft_req(a, p[8], 7, &sampled(s))]).unwrap()).collect();
    assert!(seeds.iter().any(|s| s[0].tokens != s1[0].tokens));
    for s in [a, fork, other] {
        r.free_state(s).unwrap();
    }
}

#[test]
fn drafter_context_after_verify_and_rollback_equals_a_fresh_run() {
    let mut r = runner();
    let greedy = SamplingParams::greedy();
    let p = prompt(12, 3);
    let base = r.alloc_state().unwrap();
    prefill(&mut *r, base, &p[..11]);
    let plain = r.fork_state(base).unwrap();
    let reference = decode(&mut *r, plain, p[11], 10, &greedy);

    let a = r.fork_state(base).unwrap();
    // Two of four oracle drafts right: two accepted, the window rolls back past the third.
    let tokens = vec![p[11], reference[0], reference[1], reference[2] + 1, reference[3]];
    let out = r.step(&[row(a, tokens, &greedy, 4)]).unwrap().remove(0);
    assert_eq!((out.num_accepted, out.tokens.clone()), (2, reference[..3].to_vec()));
    // A selected model draft (verified with q), then a fully accepted oracle window.
    let proposal = r.model_drafter().unwrap().draft(&[draft_req(a, reference[2], 5, &greedy)]).unwrap().remove(0);
    r.model_drafter().unwrap().select_proposal(a).unwrap();
    let mut tokens = vec![reference[2]];
    tokens.extend_from_slice(&proposal.tokens[..3]);
    let out = r.step(&[row(a, tokens, &greedy, 3)]).unwrap().remove(0);
    let mut emitted = reference[..3].to_vec();
    emitted.extend(&out.tokens);
    assert_eq!(emitted[..], reference[..emitted.len()]);
    let anchor = *emitted.last().unwrap();
    let k = emitted.len();
    let tokens: Vec<TokenId> = std::iter::once(anchor).chain(reference[k..k + 3].iter().copied()).collect();
    let out = r.step(&[row(a, tokens, &greedy, 3)]).unwrap().remove(0);
    assert_eq!(out.num_accepted, 3);
    emitted.extend(&out.tokens);
    assert_eq!(emitted[..], reference[..emitted.len()]);
    // A selected model draft whose acceptance is forced: its accepted drafts enter the context too.
    let anchor = *emitted.last().unwrap();
    let proposal = r.model_drafter().unwrap().draft(&[draft_req(a, anchor, 4, &greedy)]).unwrap().remove(0);
    r.model_drafter().unwrap().select_proposal(a).unwrap();
    r.set_acceptance(AcceptanceMode::Synthetic(SyntheticSchedule::from_rates(vec![1.0, 1.0, 1.0]).unwrap()));
    let tokens: Vec<TokenId> = std::iter::once(anchor).chain(proposal.tokens[..3].iter().copied()).collect();
    let forced = r.step(&[row(a, tokens, &greedy, 3)]);
    r.set_acceptance(AcceptanceMode::Standard);
    let forced = forced.unwrap().remove(0);
    assert_eq!(forced.tokens[..3], proposal.tokens[..3]);
    emitted.extend(&forced.tokens);

    let len = r.state_len(a).unwrap();
    assert_eq!(len, p.len() + emitted.len() - 1);
    assert_eq!(r.drafter().unwrap().context(a).unwrap().len(), len);
    let fresh = r.alloc_state().unwrap();
    let committed: Vec<TokenId> = p.iter().chain(&emitted[..emitted.len() - 1]).copied().collect();
    prefill(&mut *r, fresh, &committed);
    let d = r.drafter().unwrap();
    assert_eq!(d.context(a).unwrap(), d.context(fresh).unwrap());
    // The same context drafts the same.
    let last = *emitted.last().unwrap();
    let from_a = r.model_drafter().unwrap().draft(&[draft_req(a, last, 7, &greedy)]).unwrap();
    assert_eq!(from_a, r.model_drafter().unwrap().draft(&[draft_req(fresh, last, 7, &greedy)]).unwrap());
    for s in [base, plain, a, fresh] {
        r.free_state(s).unwrap();
    }
}

#[test]
fn greedy_with_model_drafts_is_lossless_for_every_gamma_and_mixed_batches() {
    let mut r = runner();
    let greedy = SamplingParams::greedy();
    let lens = [3usize, 9, 14];
    let n = 3;
    let prompts: Vec<Vec<TokenId>> = lens.iter().enumerate().map(|(i, &l)| prompt(l + 1, 10 + i as u32)).collect();
    let mut reference = Vec::new();
    for p in &prompts {
        let s = r.alloc_state().unwrap();
        prefill(&mut *r, s, &p[..p.len() - 1]);
        reference.push(decode(&mut *r, s, *p.last().unwrap(), n + 3, &greedy));
        r.free_state(s).unwrap();
    }
    for gamma in 1..=8 {
        let rows: Vec<(StateId, TokenId)> = prompts
            .iter()
            .map(|p| {
                let s = r.alloc_state().unwrap();
                prefill(&mut *r, s, &p[..p.len() - 1]);
                (s, *p.last().unwrap())
            })
            .collect();
        let out = decode_with_model_drafts(&mut *r, &rows, gamma, n, &greedy);
        for ((o, want), (s, _)) in out.iter().zip(&reference).zip(&rows) {
            let k = o.len().min(want.len());
            assert_eq!(o[..k], want[..k], "gamma {gamma}");
            assert_eq!(r.drafter().unwrap().context(*s).unwrap().len(), r.state_len(*s).unwrap());
            r.free_state(*s).unwrap();
        }
    }
}

#[test]
fn sampling_with_model_drafts_is_reproducible_and_uses_q() {
    let mut r = runner();
    check_seeded_drafting_ignores_batching(&mut *r, 4);
    let p = prompt(8, 20);
    let base = r.alloc_state().unwrap();
    prefill(&mut *r, base, &p[..7]);
    check_verification_uses_q(&mut *r, base, p[7], 4);
    r.free_state(base).unwrap();
}

#[test]
fn drafter_api_errors_change_nothing() {
    let mut r = runner();
    let greedy = SamplingParams::greedy();
    let p = prompt(6, 30);
    let s = r.alloc_state().unwrap();
    prefill(&mut *r, s, &p[..5]);
    // Nothing to select yet.
    assert_eq!(r.model_drafter().unwrap().select_proposal(s).unwrap_err().kind(), "invalid_input");
    assert!(r.model_drafter().unwrap().draft(&[draft_req(s, p[5], 0, &greedy)]).is_err());
    assert!(r.model_drafter().unwrap().draft(&[draft_req(s, 163_840, 3, &greedy)]).is_err());
    assert!(r
        .model_drafter()
        .unwrap()
        .draft(&[draft_req(s, p[5], 3, &greedy), draft_req(s, p[5], 3, &greedy)])
        .is_err());
    assert_eq!(
        r.model_drafter().unwrap().draft(&[draft_req(StateId(999_999), p[5], 3, &greedy)]).unwrap_err().kind(),
        "unknown_state"
    );
    let proposal = r.model_drafter().unwrap().draft(&[draft_req(s, p[5], 3, &greedy)]).unwrap().remove(0);
    r.model_drafter().unwrap().select_proposal(s).unwrap();
    // A selected proposal only verifies its own drafts after its own anchor.
    let wrong_draft = vec![p[5], proposal.tokens[0], (proposal.tokens[1] + 1) % 1000];
    assert!(r.step(&[row(s, wrong_draft, &greedy, 2)]).is_err());
    let wrong_anchor = vec![p[4], proposal.tokens[0]];
    assert!(r.step(&[row(s, wrong_anchor, &greedy, 1)]).is_err());
    assert!(r.step(&[RowInput { state: s, tokens: vec![p[5]], sample: None }]).is_err());
    let other_params = SamplingParams { temperature: 0.7, ..greedy.clone() };
    assert!(r.step(&[row(s, vec![p[5], proposal.tokens[0]], &other_params, 1)]).is_err());
    assert_eq!(r.state_len(s).unwrap(), 5);
    assert_eq!(r.drafter().unwrap().context(s).unwrap().len(), 5);
    // The proposal is still selected and verifies; the step then drops it.
    let ok = vec![p[5], proposal.tokens[0], proposal.tokens[1]];
    r.step(&[row(s, ok, &greedy, 2)]).unwrap();
    assert_eq!(r.model_drafter().unwrap().select_proposal(s).unwrap_err().kind(), "invalid_input");
    r.free_state(s).unwrap();

    // A runner without a drafter lends none, and one that cannot host a drafter says so.
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let mut plain = CpuRunner::new(cfg.clone(), &SyntheticWeights::new(cfg.clone(), 11)).unwrap();
    assert!(plain.model_drafter().is_none());
    let mut null = sparkd_kernels::null_runner::NullRunner::new(cfg);
    assert!(null.model_drafter().is_none());
    let err = null.attach_drafter(DrafterSource::synthetic(DrafterConfig::preset("k3-tiny").unwrap(), 3)).unwrap_err();
    assert!(err.to_string().contains("cannot host a drafter"), "{err}");
    assert!(null.model_drafter().is_none());
}

#[test]
fn drafts_respect_the_runners_token_mask() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let mut r = CpuRunner::new(cfg.clone(), &SyntheticWeights::new(cfg.clone(), 11)).unwrap();
    let dcfg = DrafterConfig::preset("k3-tiny").unwrap();
    r.attach_drafter(DrafterSource::synthetic(dcfg, 3)).unwrap();
    r.set_token_mask(TokenMask::from_fn(cfg.vocab_size, |id| id % 3 == 0)).unwrap();
    let greedy = SamplingParams::greedy();
    let hot = SamplingParams { temperature: 2.0, top_p: 1.0, top_k: 0, seed: 9, logprobs: None };
    for params in [&greedy, &hot] {
        let s = r.alloc_state().unwrap();
        prefill(&mut r, s, &prompt(6, 40));
        let proposal = r.model_drafter().unwrap().draft(&[draft_req(s, 3, 7, params)]).unwrap().remove(0);
        assert!(proposal.tokens.iter().all(|t| t % 3 == 0), "{:?}", proposal.tokens);
        r.model_drafter().unwrap().select_proposal(s).unwrap();
        let tokens: Vec<TokenId> = std::iter::once(3).chain(proposal.tokens).collect();
        let out = r.step(&[row(s, tokens, params, 7)]).unwrap().remove(0);
        assert!(out.tokens.iter().all(|t| t % 3 == 0), "{:?}", out.tokens);
        r.free_state(s).unwrap();
    }
}
