//! Helpers shared by the drafter test files (`dspark_runner.rs` on the CPU, `cuda_drafter.rs` on CUDA): prompts,
//! prefill in windows of at most 16 tokens (where a window's forward equals token-by-token decoding bit for
//! bit), plain decoding, and decoding with model drafts, each over `&mut dyn Runner`.

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
    RowInput { state, tokens, sample: Some(SampleRequest { params: params.clone(), draft_len }) }
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
        let proposals = r.draft(&reqs).unwrap();
        let mut step_rows = Vec::new();
        for (&i, p) in live.iter().zip(&proposals) {
            assert_eq!((p.tokens.len(), p.confidences.len()), (gamma, gamma));
            assert!(p.confidences.iter().all(|c| (0.0..=1.0).contains(c)));
            r.select_proposal(rows[i].0).unwrap();
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
