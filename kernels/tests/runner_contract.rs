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
