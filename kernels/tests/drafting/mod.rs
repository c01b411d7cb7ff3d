//! Helpers shared by the drafter test files (`dspark_runner.rs` on the CPU, `cuda_drafter.rs` on CUDA): prompts,
//! prefill in windows of at most 16 tokens (where a window's forward equals token-by-token decoding bit for
//! bit), plain decoding, decoding with model drafts, and the sampled-drafting checks both backends pass, each over
//! `&mut dyn Runner`.

use sparkd_kernels::runner::{DraftRequest, RowInput, RowOutput, SampleRequest, SamplingParams};
use sparkd_kernels::{Runner, StateId, TokenId};

pub fn prompt(len: usize, salt: u32) -> Vec<TokenId> {
    (0..len as u32).map(|i| (i * 7919 + salt * 104_729 + 13) % 100_000).collect()
}

/// Prefills in windows of at most 16 tokens.
pub fn prefill(r: &mut dyn Runner, state: StateId, tokens: &[TokenId]) {
    for chunk in tokens.chunks(16) {
        let out = r.step(&[RowInput { state, tokens: chunk.to_vec(), sample: None }]).unwrap();
        assert_eq!(out, vec![RowOutput::default()]);
    }
}

pub fn row(state: StateId, tokens: Vec<TokenId>, params: &SamplingParams, draft_len: usize) -> RowInput {
    RowInput { state, tokens, sample: Some(SampleRequest::new(params.clone(), draft_len)) }
}

pub fn draft_req(state: StateId, anchor: TokenId, num_drafts: usize, params: &SamplingParams) -> DraftRequest {
    DraftRequest { state, anchor, num_drafts, params: params.clone() }
}

/// Plain decoding (no drafts): `n` tokens after `last`.
pub fn decode(
    r: &mut dyn Runner,
    state: StateId,
    mut last: TokenId,
    n: usize,
    params: &SamplingParams,
) -> Vec<TokenId> {
    let mut out = Vec::new();
    while out.len() < n {
        last = r.step(&[row(state, vec![last], params, 0)]).unwrap()[0].tokens[0];
        out.push(last);
    }
    out
}

/// Decodes every row with model drafts of `gamma` tokens (drafted in one call, selected, verified in one
/// step) until each has emitted at least `n` tokens; returns the emitted tokens per row.
pub fn decode_with_model_drafts(
    r: &mut dyn Runner,
    rows: &[(StateId, TokenId)],
    gamma: usize,
    n: usize,
    params: &SamplingParams,
) -> Vec<Vec<TokenId>> {
    let mut last: Vec<TokenId> = rows.iter().map(|(_, a)| *a).collect();
    let mut out: Vec<Vec<TokenId>> = vec![Vec::new(); rows.len()];
    while out.iter().any(|o| o.len() < n) {
        let live: Vec<usize> = (0..rows.len()).filter(|&i| out[i].len() < n).collect();
        let reqs: Vec<DraftRequest> = live.iter().map(|&i| draft_req(rows[i].0, last[i], gamma, params)).collect();
        let proposals = r.model_drafter().unwrap().draft(&reqs).unwrap();
        let mut step_rows = Vec::new();
        for (&i, p) in live.iter().zip(&proposals) {
            assert_eq!((p.tokens.len(), p.confidences.len()), (gamma, gamma));
            assert!(p.confidences.iter().all(|c| (0.0..=1.0).contains(c)));
            r.model_drafter().unwrap().select_proposal(rows[i].0).unwrap();
            let tokens: Vec<TokenId> = std::iter::once(last[i]).chain(p.tokens.iter().copied()).collect();
            step_rows.push(row(rows[i].0, tokens, params, gamma));
        }
        for (&i, o) in live.iter().zip(r.step(&step_rows).unwrap()) {
            assert_eq!(o.tokens.len(), o.num_accepted + 1);
            last[i] = *o.tokens.last().unwrap();
            out[i].extend(o.tokens);
        }
    }
    out
}

/// Temperature-1 sampling with seed `seed`.
pub fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed, logprobs: None }
}

/// A seeded request decoded with sampled model drafts (γ = 4, at least `n` tokens) after an 8-token prompt gives
/// the same tokens whether or not another row is batched with it, and other tokens for another seed.
pub fn check_seeded_drafting_ignores_batching(r: &mut dyn Runner, n: usize) {
    let p = prompt(8, 20);
    let mut run = |seed: u64, with_neighbour: bool| {
        let s = r.alloc_state().unwrap();
        prefill(r, s, &p[..7]);
        let mut rows = vec![(s, p[7])];
        let other = r.alloc_state().unwrap();
        if with_neighbour {
            prefill(r, other, &prompt(5, 21));
            rows.push((other, 77));
        }
        let out = decode_with_model_drafts(r, &rows, 4, n, &sampled(seed)).remove(0);
        r.free_state(s).unwrap();
        r.free_state(other).unwrap();
        out
    };
    let solo = run(5, false);
    assert_eq!(solo, run(5, true), "a seeded request ignores what else is batched");
    assert_ne!(solo, run(6, false));
}

/// The same sampled drafts of `base` (a prefilled state, next token `anchor`) verified with the drafter's q
/// (proposal selected) and one-hot (not selected) differ for some seed in `0..seeds`: q changes both the accept
/// test and the residual distribution. Verification with q is reproducible.
pub fn check_verification_uses_q(r: &mut dyn Runner, base: StateId, anchor: TokenId, seeds: u64) {
    let mut differs = false;
    for seed in 0..seeds {
        let mut verify = |select: bool| {
            let s = r.fork_state(base).unwrap();
            let proposal =
                r.model_drafter().unwrap().draft(&[draft_req(s, anchor, 4, &sampled(seed))]).unwrap().remove(0);
            if select {
                r.model_drafter().unwrap().select_proposal(s).unwrap();
            }
            let tokens: Vec<TokenId> = std::iter::once(anchor).chain(proposal.tokens).collect();
            let out = r.step(&[row(s, tokens, &sampled(seed), 4)]).unwrap().remove(0);
            r.free_state(s).unwrap();
            out
        };
        let with_q = verify(true);
        assert_eq!(with_q, verify(true), "verification with q is reproducible");
        differs |= with_q != verify(false);
    }
    assert!(differs, "verification never depended on q");
}
