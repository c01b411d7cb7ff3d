//! The `Runner` contract, checked on the CPU backend (the same checks run on every backend: they
//! take `&mut dyn Runner`). Windows here stay at or under 16 tokens, where prefill uses the same
//! recurrent KDA form as decode, so greedy outputs must match exactly.

use std::sync::Mutex;
use std::sync::OnceLock;

use sparkd_kernels::cpu::CpuRunner;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::ModelConfig;

mod contract;
use contract::*;

fn runner() -> std::sync::MutexGuard<'static, CpuRunner> {
    static R: OnceLock<Mutex<CpuRunner>> = OnceLock::new();
    R.get_or_init(|| {
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let src = SyntheticWeights::new(cfg.clone(), 11);
        Mutex::new(CpuRunner::new(cfg, &src).unwrap())
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

#[test]
fn cpu_prefill_chunks_equal_one_window() {
    contract_prefill_chunks_equal_one_window(&mut *runner());
}

#[test]
fn cpu_greedy_speculation_is_lossless() {
    contract_greedy_speculation_is_lossless(&mut *runner());
}

#[test]
fn cpu_forks_and_exports_are_independent() {
    contract_forks_and_exports_are_independent(&mut *runner());
}

#[test]
fn cpu_seeded_sampling_ignores_batching() {
    contract_seeded_sampling_ignores_batching(&mut *runner());
}

#[test]
fn cpu_bad_input_is_rejected_without_side_effects() {
    contract_bad_input_is_rejected_without_side_effects(&mut *runner());
}

#[test]
fn cpu_row_masks_hold_at_every_position() {
    contract_row_masks_hold_at_every_position(&mut *runner());
}

#[test]
fn cpu_token_mask_keeps_masked_ids_out_of_every_emitted_token() {
    use sparkd_kernels::runner::{RowInput, SampleRequest, SamplingParams, TokenMask};
    use sparkd_kernels::{Runner, TokenId};
    let mut guard = runner();
    let r: &mut dyn Runner = &mut *guard;
    let vocab = r.config().vocab_size;
    let p: Vec<TokenId> = (0..8).map(|i| 17 + i * 1000).collect();
    let greedy = SamplingParams::greedy();
    let unmasked_state = r.alloc_state().unwrap();
    prefill(r, unmasked_state, &p[..7]);
    let unmasked = decode(r, unmasked_state, p[7], 4, &greedy);

    // Forbid the unmasked greedy choice and everything above 100,256 (the built-in tokenizer's holes).
    let banned = unmasked[0];
    r.set_token_mask(TokenMask::from_fn(vocab, |id| id < 100_256 && id != banned)).unwrap();
    let state = r.alloc_state().unwrap();
    prefill(r, state, &p[..7]);
    let sampled = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 5, logprobs: Some(2) };
    let out = r
        .step(&[RowInput { state, tokens: vec![p[7]], sample: Some(SampleRequest::new(greedy.clone(), 0)) }])
        .unwrap()
        .remove(0);
    assert_ne!(out.tokens[0], banned);
    assert!(out.tokens[0] < 100_256);
    let more = decode(r, state, out.tokens[0], 16, &sampled);
    assert!(more.iter().all(|t| *t < 100_256 && *t != banned), "{more:?}");
    // A draft of a masked id is always rejected.
    let verify = r
        .step(&[RowInput {
            state,
            tokens: vec![more[15], banned],
            sample: Some(SampleRequest::new(greedy.clone(), 1)),
        }])
        .unwrap()
        .remove(0);
    assert_eq!(verify.num_accepted, 0);
    // Masks that do not fit are refused.
    assert!(r.set_token_mask(TokenMask::from_fn(vocab - 1, |_| true)).is_err());
    assert!(r.set_token_mask(TokenMask::from_fn(vocab, |_| false)).is_err());
    // Leave the shared runner unrestricted for the other tests.
    r.set_token_mask(TokenMask::from_fn(vocab, |_| true)).unwrap();
    r.free_state(state).unwrap();
    r.free_state(unmasked_state).unwrap();
}

#[test]
fn cpu_fed_steps_equal_steps() {
    contract_fed_steps_equal_steps(&mut *runner());
}

#[test]
fn cpu_launches_are_checked() {
    contract_launches_are_checked(&mut *runner());
}

#[test]
fn null_row_masks_hold_at_every_position() {
    let mut null = sparkd_kernels::null_runner::NullRunner::new(ModelConfig::preset("k3-tiny").unwrap());
    contract_row_masks_hold_at_every_position(&mut null);
}
