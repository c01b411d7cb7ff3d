//! The `Runner` contract checks, shared by every backend's test file (`runner_contract.rs` for the CPU,
//! `cuda_runner.rs` for CUDA): each takes `&mut dyn Runner`, so the same checks run on every backend.
//! Windows stay at or under 16 tokens, where prefill uses the same recurrent KDA form as decode, so
//! greedy outputs must match exactly.

use sparkd_kernels::launches::FedRow;
use std::sync::Arc;

use sparkd_kernels::runner::{MaskSource, RowInput, RowOutput, SampleRequest, SamplingParams};
use sparkd_kernels::{Runner, StateId, TokenId};

fn prompt(len: usize, salt: u32) -> Vec<TokenId> {
    (0..len as u32).map(|i| (i * 7919 + salt * 104_729 + 13) % 100_000).collect()
}

pub fn prefill(r: &mut dyn Runner, state: StateId, tokens: &[TokenId]) {
    let out = r.step(&[RowInput { state, tokens: tokens.to_vec(), sample: None }]).unwrap();
    assert_eq!(out, vec![RowOutput::default()]);
}

fn sample_row(state: StateId, tokens: Vec<TokenId>, params: &SamplingParams, draft_len: usize) -> RowInput {
    RowInput { state, tokens, sample: Some(SampleRequest::new(params.clone(), draft_len)) }
}

/// Generates `n` tokens one step at a time after `last` (which is not yet in the state).
pub fn decode(
    r: &mut dyn Runner,
    state: StateId,
    mut last: TokenId,
    n: usize,
    params: &SamplingParams,
) -> Vec<TokenId> {
    let mut out = Vec::new();
    while out.len() < n {
        let step = r.step(&[sample_row(state, vec![last], params, 0)]).unwrap().remove(0);
        assert_eq!(step.tokens.len(), 1);
        last = step.tokens[0];
        out.push(last);
    }
    out
}

pub fn contract_prefill_chunks_equal_one_window(r: &mut dyn Runner) {
    let p = prompt(15, 1);
    let greedy = SamplingParams::greedy();
    let a = r.alloc_state().unwrap();
    prefill(r, a, &p[..14]);
    let whole = decode(r, a, p[14], 6, &greedy);
    let b = r.alloc_state().unwrap();
    prefill(r, b, &p[..5]);
    prefill(r, b, &p[5..9]);
    prefill(r, b, &p[9..14]);
    assert_eq!(r.state_len(b).unwrap(), 14);
    let chunked = decode(r, b, p[14], 6, &greedy);
    assert_eq!(whole, chunked);
    assert_eq!(r.state_len(a).unwrap(), 14 + 6);
    r.free_state(a).unwrap();
    r.free_state(b).unwrap();
}

pub fn contract_greedy_speculation_is_lossless(r: &mut dyn Runner) {
    let p = prompt(12, 2);
    let greedy = SamplingParams::greedy();
    let base = r.alloc_state().unwrap();
    prefill(r, base, &p[..11]);
    let plain_state = r.fork_state(base).unwrap();
    let reference = decode(r, plain_state, p[11], 9, &greedy);

    // An oracle drafter proposes the target's own tokens: everything is accepted.
    let oracle = r.fork_state(base).unwrap();
    let mut tokens = vec![p[11]];
    tokens.extend_from_slice(&reference[..4]);
    let out = r.step(&[sample_row(oracle, tokens, &greedy, 4)]).unwrap().remove(0);
    assert_eq!(out.num_accepted, 4);
    assert_eq!(out.tokens, reference[..5].to_vec());
    assert_eq!(r.state_len(oracle).unwrap(), 11 + 5);

    // Wrong drafts: the first mismatch is corrected and the state rolls back past it.
    let wrong = r.fork_state(base).unwrap();
    let mut tokens = vec![p[11], reference[0], reference[1]];
    tokens.push((reference[2] + 1) % 100_000);
    tokens.push(reference[3]);
    let out = r.step(&[sample_row(wrong, tokens, &greedy, 4)]).unwrap().remove(0);
    assert_eq!(out.num_accepted, 2);
    assert_eq!(out.tokens, reference[..3].to_vec());
    assert_eq!(r.state_len(wrong).unwrap(), 11 + 3);
    // Decoding on from the rolled-back state continues the reference exactly.
    let rest = decode(r, wrong, reference[2], 6, &greedy);
    assert_eq!(rest, reference[3..9].to_vec());
    for s in [base, plain_state, oracle, wrong] {
        r.free_state(s).unwrap();
    }
}

pub fn contract_forks_and_exports_are_independent(r: &mut dyn Runner) {
    let p = prompt(10, 3);
    let greedy = SamplingParams::greedy();
    let a = r.alloc_state().unwrap();
    prefill(r, a, &p[..9]);
    let snapshot = r.export_state(a).unwrap();
    let fork = r.fork_state(a).unwrap();
    // Advance the fork with other tokens; the original must not move.
    prefill(r, fork, &prompt(7, 4));
    assert_eq!(r.state_len(a).unwrap(), 9);
    assert_eq!(r.export_state(a).unwrap(), snapshot);
    let imported = r.import_state(snapshot).unwrap();
    let from_a = decode(r, a, p[9], 5, &greedy);
    let from_import = decode(r, imported, p[9], 5, &greedy);
    assert_eq!(from_a, from_import);
    assert!(r.state_bytes(imported).unwrap() > 0);
    for s in [a, fork, imported] {
        r.free_state(s).unwrap();
    }
}

pub fn contract_seeded_sampling_ignores_batching(r: &mut dyn Runner) {
    let params = SamplingParams { temperature: 0.8, top_p: 0.95, top_k: 50, seed: 1234, logprobs: Some(3) };
    let p = prompt(6, 5);
    let alone = r.alloc_state().unwrap();
    prefill(r, alone, &p[..5]);
    let solo = r.step(&[sample_row(alone, vec![p[5]], &params, 0)]).unwrap().remove(0);

    let again = r.alloc_state().unwrap();
    let other = r.alloc_state().unwrap();
    prefill(r, again, &p[..5]);
    let rows =
        [RowInput { state: other, tokens: prompt(9, 6), sample: None }, sample_row(again, vec![p[5]], &params, 0)];
    let batched = r.step(&rows).unwrap().remove(1);
    assert_eq!(solo, batched);
    assert_eq!(solo.logprobs.len(), 1);
    assert_eq!(solo.logprobs[0].token, solo.tokens[0]);
    assert_eq!(solo.logprobs[0].top.len(), 3);
    assert!(solo.logprobs[0].logprob <= 0.0);
    for s in [alone, again, other] {
        r.free_state(s).unwrap();
    }
}

pub fn contract_bad_input_is_rejected_without_side_effects(r: &mut dyn Runner) {
    let a = r.alloc_state().unwrap();
    prefill(r, a, &prompt(4, 7));
    let before = r.export_state(a).unwrap();
    let vocab = r.config().vocab_size as TokenId;
    let greedy = SamplingParams::greedy();
    let bad_steps = [
        vec![RowInput { state: StateId(u64::MAX), tokens: vec![1], sample: None }],
        vec![RowInput { state: a, tokens: vec![], sample: None }],
        vec![RowInput { state: a, tokens: vec![vocab], sample: None }],
        vec![sample_row(a, vec![1, 2], &greedy, 2)],
        vec![
            RowInput { state: a, tokens: vec![1], sample: None },
            RowInput { state: a, tokens: vec![2], sample: None },
        ],
        vec![sample_row(a, vec![1], &SamplingParams { top_p: 0.0, ..SamplingParams::greedy() }, 0)],
        // A valid row before an invalid one: the valid row must not run either.
        vec![
            RowInput { state: a, tokens: vec![5], sample: None },
            RowInput { state: StateId(u64::MAX), tokens: vec![1], sample: None },
        ],
    ];
    for rows in bad_steps {
        assert!(r.step(&rows).is_err(), "{rows:?} should be rejected");
        assert_eq!(r.export_state(a).unwrap(), before);
    }
    assert!(r.fork_state(StateId(u64::MAX)).is_err());
    r.free_state(a).unwrap();
    assert!(r.free_state(a).is_err());
}

/// Decodes `n` tokens after each row's `last` with steps launched ahead: every step after the first is fed
/// on the device, launched before the previous step's outputs are collected (asynchronous scheduling).
pub fn decode_fed(r: &mut dyn Runner, rows: &[(StateId, TokenId, SamplingParams)], n: usize) -> Vec<Vec<TokenId>> {
    let first: Vec<RowInput> = rows.iter().map(|(s, last, p)| sample_row(*s, vec![*last], p, 0)).collect();
    r.launch(&first).unwrap();
    let fed: Vec<FedRow> =
        rows.iter().map(|(state, _, params)| FedRow { state: *state, params: params.clone() }).collect();
    let mut out = vec![Vec::new(); rows.len()];
    for step in 0..n {
        if step + 1 < n {
            r.launch_fed(&fed).unwrap();
        }
        for (tokens, o) in out.iter_mut().zip(r.collect().unwrap()) {
            assert_eq!((o.tokens.len(), o.num_accepted), (1, 0));
            tokens.push(o.tokens[0]);
        }
    }
    out
}

pub fn contract_fed_steps_equal_steps(r: &mut dyn Runner) {
    assert!(r.launches_ahead());
    let p = prompt(9, 8);
    let greedy = SamplingParams::greedy();
    let sampled = SamplingParams { temperature: 1.0, top_p: 0.9, top_k: 0, seed: 77, logprobs: None };
    let base = r.alloc_state().unwrap();
    prefill(r, base, &p[..8]);
    let (a, b, c, d) = (
        r.fork_state(base).unwrap(),
        r.fork_state(base).unwrap(),
        r.fork_state(base).unwrap(),
        r.fork_state(base).unwrap(),
    );
    let want_greedy = decode(r, a, p[8], 7, &greedy);
    let want_sampled = decode(r, b, p[8], 7, &sampled);
    let got = decode_fed(r, &[(c, p[8], greedy.clone()), (d, p[8], sampled.clone())], 7);
    assert_eq!(got, vec![want_greedy, want_sampled]);
    assert_eq!(r.state_len(c).unwrap(), 8 + 7);
    assert_eq!(r.export_state(c).unwrap(), r.export_state(a).unwrap(), "a fed state equals a stepped one");
    for s in [base, a, b, c, d] {
        r.free_state(s).unwrap();
    }
}

pub fn contract_launches_are_checked(r: &mut dyn Runner) {
    let p = prompt(5, 9);
    let greedy = SamplingParams::greedy();
    let fed = |s: StateId| [FedRow { state: s, params: SamplingParams::greedy() }];
    let a = r.alloc_state().unwrap();
    let b = r.alloc_state().unwrap();
    prefill(r, a, &p[..4]);
    prefill(r, b, &p[..4]);
    assert!(r.collect().is_err(), "nothing to collect");
    assert!(r.launch_fed(&fed(a)).is_err(), "nothing in flight to feed");
    // A prefill row emits nothing, so nothing can be fed from it.
    r.launch(&[RowInput { state: a, tokens: vec![p[4]], sample: None }]).unwrap();
    assert!(r.launch_fed(&fed(a)).is_err(), "a prefill row feeds nothing");
    assert_eq!(r.collect().unwrap(), vec![RowOutput::default()]);

    r.launch(&[sample_row(b, vec![p[4]], &greedy, 0)]).unwrap();
    assert!(r.launch_fed(&fed(a)).is_err(), "fed rows must be the rows in flight");
    assert!(r.step(&[sample_row(a, vec![1], &greedy, 0)]).is_err(), "step waits for nothing in flight");
    assert!(r.launch(&[sample_row(b, vec![1], &greedy, 0)]).is_err(), "b is in flight: only a fed step may step it");
    for refused in [r.free_state(b).err(), r.fork_state(b).err(), r.export_state(b).err()] {
        assert!(refused.as_ref().is_some_and(|e| e.to_string().contains("not yet collected")), "{refused:?}");
    }
    r.launch_fed(&fed(b)).unwrap();
    assert!(r.launch_fed(&fed(b)).is_err(), "two steps already in flight");
    assert!(r.launch(&[sample_row(a, vec![1], &greedy, 0)]).is_err(), "two steps already in flight");
    let first = r.collect().unwrap().remove(0);
    let second = r.collect().unwrap().remove(0);
    assert!(r.collect().is_err());
    assert_eq!(r.state_len(b).unwrap(), 4 + 2, "b holds its prompt, its first token and the fed one");
    let c = r.alloc_state().unwrap();
    prefill(r, c, &p[..4]);
    assert_eq!(decode(r, c, p[4], 2, &greedy), vec![first.tokens[0], second.tokens[0]]);
    for s in [a, b, c] {
        r.free_state(s).unwrap();
    }
}

/// A constrained row's masks hold at every sampling position, greedy and sampled alike: with one id allowed per
/// position the runner emits exactly those ids, a draft its mask forbids is rejected (the correction is the
/// allowed id), masks that do not fit the row are refused without touching the state, and in a step with other
/// rows a row's masks reach that row alone.
pub fn contract_row_masks_hold_at_every_position(r: &mut dyn Runner) {
    let vocab = r.config().vocab_size;
    let only = |id: TokenId| -> std::sync::Arc<[u32]> {
        let mut m = vec![0u32; vocab.div_ceil(32)];
        m[id as usize / 32] |= 1 << (id % 32);
        m.into()
    };
    let p = prompt(8, 5);
    let sampled = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 3, logprobs: None };
    for params in [SamplingParams::greedy(), sampled] {
        let s = r.alloc_state().unwrap();
        prefill(r, s, &p[..7]);
        let mut one = SampleRequest::new(params.clone(), 0);
        one.masks = vec![only(42)];
        let out = r.step(&[RowInput { state: s, tokens: vec![p[7]], sample: Some(one) }]).unwrap().remove(0);
        assert_eq!(out.tokens, vec![42], "{params:?}");
        let mut verify = SampleRequest::new(params.clone(), 2);
        verify.masks = vec![only(7), only(8), only(11)];
        let out = r.step(&[RowInput { state: s, tokens: vec![42, 7, 9], sample: Some(verify) }]).unwrap().remove(0);
        assert_eq!((out.tokens.clone(), out.num_accepted), (vec![7, 8], 1), "{params:?}");
        assert_eq!(r.state_len(s).unwrap(), 10);
        let mut short = SampleRequest::new(params.clone(), 1);
        short.masks = vec![only(1)];
        assert!(r.step(&[RowInput { state: s, tokens: vec![8, 3], sample: Some(short) }]).is_err());
        let mut empty = SampleRequest::new(params.clone(), 0);
        empty.masks = vec![vec![0u32; vocab.div_ceil(32)].into()];
        assert!(r.step(&[RowInput { state: s, tokens: vec![8], sample: Some(empty) }]).is_err());
        assert_eq!(r.state_len(s).unwrap(), 10, "refused steps change nothing");
        r.free_state(s).unwrap();
        // In a step with other rows, each row's masks reach only that row, at its own positions.
        let (free, alone, constrained) = (r.alloc_state().unwrap(), r.alloc_state().unwrap(), r.alloc_state().unwrap());
        for st in [free, alone, constrained] {
            prefill(r, st, &p[..7]);
        }
        let want = r.step(&[sample_row(alone, vec![p[7], 5, 6], &params, 2)]).unwrap().remove(0);
        let mut masked = SampleRequest::new(params.clone(), 1);
        masked.masks = vec![only(31), only(77)];
        let out = r
            .step(&[
                sample_row(free, vec![p[7], 5, 6], &params, 2),
                RowInput { state: constrained, tokens: vec![p[7], 31], sample: Some(masked) },
            ])
            .unwrap();
        assert_eq!(out[0], want, "an unconstrained row beside a constrained one: {params:?}");
        assert_eq!((out[1].tokens.clone(), out[1].num_accepted), (vec![31, 77], 1), "{params:?}");
        for st in [free, alone, constrained] {
            r.free_state(st).unwrap();
        }
    }
    masks_from_a_source_act_as_the_rows_own(r, &only);
}

/// The masks a `MaskSource` hands over, for stepped and launched steps, act exactly as the rows' own; the source
/// is asked once per sampling row, in row order, and never for a prefill chunk.
fn masks_from_a_source_act_as_the_rows_own(r: &mut dyn Runner, only: &dyn Fn(TokenId) -> Arc<[u32]>) {
    struct Given {
        masks: Vec<Vec<Arc<[u32]>>>,
        asked: Vec<usize>,
    }
    impl MaskSource for Given {
        fn masks(&mut self, row: usize) -> sparkd_kernels::Result<Vec<Arc<[u32]>>> {
            self.asked.push(row);
            Ok(self.masks[row].clone())
        }
    }
    let p = prompt(8, 6);
    let sampled = SamplingParams { temperature: 0.8, top_p: 1.0, top_k: 0, seed: 11, logprobs: None };
    let launches = [false, r.launches_ahead()];
    for (params, launch) in
        [SamplingParams::greedy(), sampled].into_iter().flat_map(|p| launches.map(|l| (p.clone(), l)))
    {
        let (chunk, free, constrained) = (r.alloc_state().unwrap(), r.alloc_state().unwrap(), r.alloc_state().unwrap());
        for st in [chunk, free, constrained] {
            prefill(r, st, &p[..6]);
        }
        let rows = [
            RowInput { state: chunk, tokens: vec![p[6]], sample: None },
            sample_row(free, vec![p[6]], &params, 0),
            sample_row(constrained, vec![p[6], 12], &params, 1),
        ];
        let mut source = Given { masks: vec![vec![], vec![], vec![only(12), only(40)]], asked: Vec::new() };
        let out = if launch {
            r.launch_masked(&rows, &mut source).unwrap();
            r.collect().unwrap()
        } else {
            r.step_masked(&rows, &mut source).unwrap()
        };
        assert_eq!(source.asked, vec![1, 2], "asked for the sampling rows alone, in order");
        assert_eq!(out[0], RowOutput::default());
        assert_eq!((out[2].tokens.clone(), out[2].num_accepted), (vec![12, 40], 1), "{params:?}, launch {launch}");
        for st in [chunk, free, constrained] {
            r.free_state(st).unwrap();
        }
    }
}
