//! The CUDA backend on a GPU: the runner contract (the same checks as the CPU's, from `contract/`),
//! the validation matrix against the CPU reference, and a decode timing. On a machine without a CUDA
//! driver every test but the probe check says plainly that it skipped.
//!
//! `SPARKD_VALIDATE_OUT=path` writes the validation report there as JSON.

mod contract;

use std::sync::{Mutex, OnceLock};

use contract::*;
use sparkd_kernels::cuda::device::driver_present;
use sparkd_kernels::cuda::{probe, CudaRunner};
use sparkd_kernels::harness::validate::{self, ValidationOptions};
use sparkd_kernels::runner::{RowInput, RowOutput, SampleRequest, SamplingParams};
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, Runner};

fn runner() -> Option<std::sync::MutexGuard<'static, CudaRunner>> {
    if !driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine; the CUDA runner contract was NOT checked");
        return None;
    }
    static R: OnceLock<Mutex<CudaRunner>> = OnceLock::new();
    let r = R.get_or_init(|| {
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let src = SyntheticWeights::new(cfg.clone(), 11);
        Mutex::new(CudaRunner::new(0, cfg, &src).unwrap())
    });
    Some(r.lock().unwrap_or_else(|e| e.into_inner()))
}

#[test]
fn cuda_probe_is_an_error_or_a_device_never_a_panic() {
    match probe(0) {
        Ok(info) => {
            eprintln!("found {info:?}, compiling for {}", info.arch());
            assert!(info.compute_capability.0 >= 7);
            assert!(!info.name.is_empty());
        }
        Err(e) => {
            eprintln!("no device: {e}");
            assert_eq!(e.kind(), "device");
            assert!(!driver_present() || e.to_string().contains("device"), "{e}");
        }
    }
}

#[test]
fn cuda_prefill_chunks_equal_one_window() {
    if let Some(mut r) = runner() {
        contract_prefill_chunks_equal_one_window(&mut *r);
    }
}

#[test]
fn cuda_greedy_speculation_is_lossless() {
    if let Some(mut r) = runner() {
        contract_greedy_speculation_is_lossless(&mut *r);
    }
}

#[test]
fn cuda_forks_and_exports_are_independent() {
    if let Some(mut r) = runner() {
        contract_forks_and_exports_are_independent(&mut *r);
    }
}

#[test]
fn cuda_seeded_sampling_ignores_batching() {
    if let Some(mut r) = runner() {
        contract_seeded_sampling_ignores_batching(&mut *r);
    }
}

#[test]
fn cuda_bad_input_is_rejected_without_side_effects() {
    if let Some(mut r) = runner() {
        contract_bad_input_is_rejected_without_side_effects(&mut *r);
    }
}

#[test]
fn cuda_fed_steps_equal_steps() {
    if let Some(mut r) = runner() {
        contract_fed_steps_equal_steps(&mut *r);
    }
}

#[test]
fn cuda_launches_are_checked() {
    if let Some(mut r) = runner() {
        contract_launches_are_checked(&mut *r);
    }
}

#[test]
fn cuda_matches_the_cpu_reference() {
    if !driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine; the CUDA backend was NOT validated");
        return;
    }
    let report = validate::run(&ValidationOptions::default()).unwrap();
    let json = serde_json::to_string_pretty(&report).unwrap();
    eprintln!("{json}");
    if let Some(path) = std::env::var_os("SPARKD_VALIDATE_OUT") {
        std::fs::write(path, &json).unwrap();
    }
    assert!(report.pass, "validation failed; see the report above");
}

/// Greedy decode steps after a short prefill; returns milliseconds per step.
fn time_decode(r: &mut dyn Runner, steps: usize) -> f64 {
    let s = r.alloc_state().unwrap();
    prefill(r, s, &[1, 2, 3, 4, 5, 6, 7, 8]);
    // One untimed step warms the allocator and the caches.
    decode(r, s, 9, 1, &SamplingParams::greedy());
    let started = std::time::Instant::now();
    let out = decode(r, s, 9, steps, &SamplingParams::greedy());
    let per_step = started.elapsed().as_secs_f64() * 1e3 / steps as f64;
    assert_eq!(out.len(), steps);
    assert_eq!(r.state_len(s).unwrap(), 9 + steps);
    r.free_state(s).unwrap();
    per_step
}

/// Not a benchmark of record (eager launches, per-op allocations); it shows the decode path runs end
/// to end and how long one step takes. `SPARKD_CUDA_TIMING_PRESET=k3-mini` also times that preset.
#[test]
fn cuda_decode_runs_and_reports_its_step_time() {
    let Some(mut r) = runner() else { return };
    let ms = time_decode(&mut *r, 64);
    eprintln!("k3-tiny greedy decode on {}: {ms:.3} ms per step (batch 1)", r.device_name());
    drop(r);
    if let Ok(preset) = std::env::var("SPARKD_CUDA_TIMING_PRESET") {
        let cfg = ModelConfig::preset(&preset).unwrap();
        let started = std::time::Instant::now();
        let src = SyntheticWeights::new(cfg.clone(), 11);
        let mut big = CudaRunner::new(0, cfg, &src).unwrap();
        let load_s = started.elapsed().as_secs_f64();
        let bytes = big.model().weights.bytes;
        let ms = time_decode(&mut big, 16);
        eprintln!(
            "{preset} greedy decode on {}: {ms:.3} ms per step (batch 1); {:.2} GB of weights uploaded in {load_s:.1} s",
            big.device_name(),
            bytes as f64 / 1e9
        );
    }
}

/// One fixed sequence of steps on fresh states: a prefill, sampled decode steps with log-probabilities
/// (one row, then a batch of two with a fork), and verify windows that roll back. Returns every output
/// and the final states, exported.
fn scripted_steps(r: &mut CudaRunner) -> (Vec<RowOutput>, Vec<sparkd_kernels::state::SeqState>) {
    let params = SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 0, seed: 5, logprobs: Some(3) };
    let row = |state, tokens: Vec<u32>, draft_len| RowInput {
        state,
        tokens,
        sample: Some(SampleRequest::new(params.clone(), draft_len)),
    };
    let a = r.alloc_state().unwrap();
    let prompt: Vec<u32> = (0..12u32).map(|i| (i * 7919 + 31) % 100_000).collect();
    r.step(&[RowInput { state: a, tokens: prompt, sample: None }]).unwrap();
    let mut outputs = Vec::new();
    let mut last = 17;
    for _ in 0..5 {
        let out = r.step(&[row(a, vec![last], 0)]).unwrap().remove(0);
        last = out.tokens[0];
        outputs.push(out);
    }
    let b = r.fork_state(a).unwrap();
    let mut lasts = [last, (last + 1) % 1000];
    for _ in 0..4 {
        let outs = r.step(&[row(a, vec![lasts[0]], 0), row(b, vec![lasts[1]], 0)]).unwrap();
        lasts = [outs[0].tokens[0], outs[1].tokens[0]];
        outputs.extend(outs);
    }
    // Verify windows of 3 drafts (mostly rejected, so the states roll back) at the same shape each time.
    for i in 0..4u32 {
        let outs = r.step(&[row(a, vec![lasts[0], 5 + i, 6, 7], 3), row(b, vec![lasts[1], 9, 10 + i, 11], 3)]).unwrap();
        lasts = [*outs[0].tokens.last().unwrap(), *outs[1].tokens.last().unwrap()];
        outputs.extend(outs);
    }
    let states = vec![r.export_state(a).unwrap(), r.export_state(b).unwrap()];
    r.free_state(a).unwrap();
    r.free_state(b).unwrap();
    (outputs, states)
}

#[test]
fn cuda_graph_replays_equal_eager_steps_bit_for_bit() {
    let Some(mut r) = runner() else { return };
    r.set_graphs(false);
    let (eager, eager_states) = scripted_steps(&mut r);
    r.set_graphs(true);
    let before = r.model().graph_stats();
    let (graphed, graphed_states) = scripted_steps(&mut r);
    let after = r.model().graph_stats();
    // Decode at one row, decode at two rows and the verify windows each repeat: three shapes captured,
    // every later repeat replayed.
    assert_eq!(after.capture_failures, 0, "{:?}", after.last_capture_error);
    assert!(after.captured - before.captured >= 3, "{after:?}");
    assert!(after.replayed - before.replayed >= 8, "{after:?}");
    assert!(after.last_capture_nodes > 0);
    assert_eq!(eager, graphed, "a replayed step must give the eager step's tokens and log-probabilities exactly");
    assert_states_equal(&eager_states, &graphed_states);
}

fn assert_states_equal(a: &[sparkd_kernels::state::SeqState], b: &[sparkd_kernels::state::SeqState]) {
    assert_eq!(a.len(), b.len());
    for (e, g) in a.iter().zip(b) {
        assert_eq!(e.len, g.len);
        for (x, y) in e.kda.iter().zip(&g.kda) {
            assert!(x.s.iter().zip(&y.s).all(|(p, q)| p.to_bits() == q.to_bits()), "KDA state differs");
            assert_eq!(x.conv, y.conv);
        }
        for (x, y) in e.mla.iter().zip(&g.mla) {
            assert_eq!(x.len(), y.len());
            for t in 0..x.len() {
                assert_eq!(x.entry(t), y.entry(t), "MLA entry {t} differs");
            }
        }
    }
}

#[test]
fn cuda_dependent_launch_equals_serialized_launch_bit_for_bit() {
    let Some(mut r) = runner() else { return };
    let dependent = r.gpu().dependent_launch();
    if !dependent {
        eprintln!("dependent launch is off on this device (before Hopper, or SPARKD_PDL=off): both runs serialise");
    }
    // Eager and graphed steps alike: the scripted steps capture their repeated shapes and replay them.
    let (overlapped, overlapped_states) = scripted_steps(&mut r);
    r.set_dependent_launch(false);
    assert!(!r.gpu().dependent_launch());
    let (serialized, serialized_states) = scripted_steps(&mut r);
    r.set_dependent_launch(dependent);
    assert_eq!(
        overlapped, serialized,
        "kernels that may start before their predecessor ends must give the serialised launch's tokens exactly"
    );
    assert_states_equal(&overlapped_states, &serialized_states);
}

#[test]
fn cuda_row_masks_hold_at_every_position() {
    if let Some(mut r) = runner() {
        contract_row_masks_hold_at_every_position(&mut *r);
    }
}
