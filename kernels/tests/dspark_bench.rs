//! The drafter's CPU cost per proposal on k3-tiny (a measurement, not a check: run with
//! `cargo test -p sparkd-kernels --test dspark_bench -- --ignored --nocapture`). It times the
//! backbone pass plus the Markov loop for one row at γ = 7 over a 64-token context, next to one
//! plain target decode step for scale.

use std::time::Instant;

use sparkd_kernels::cpu::CpuRunner;
use sparkd_kernels::dspark::{DrafterConfig, DrafterSource};
use sparkd_kernels::runner::{DraftRequest, RowInput, SampleRequest, SamplingParams};
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, Runner};

#[test]
#[ignore = "a measurement; run explicitly"]
fn drafter_cost_per_proposal_on_k3_tiny() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let mut r = CpuRunner::new(cfg.clone(), &SyntheticWeights::new(cfg.clone(), 11)).unwrap();
    let dcfg = DrafterConfig::preset("k3-tiny").unwrap();
    let gamma = dcfg.block_size;
    r.attach_drafter(DrafterSource::synthetic(dcfg, 3)).unwrap();
    let s = r.alloc_state().unwrap();
    for chunk in (0..64u32).collect::<Vec<_>>().chunks(16) {
        r.step(&[RowInput { state: s, tokens: chunk.to_vec(), sample: None }]).unwrap();
    }
    let greedy = SamplingParams::greedy();
    let sampled = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 1, logprobs: None };
    let reps = 10;
    for (name, params) in [("greedy", &greedy), ("sampled T=1", &sampled)] {
        let req = DraftRequest { state: s, anchor: 5, num_drafts: gamma, params: params.clone() };
        r.model_drafter().unwrap().draft(std::slice::from_ref(&req)).unwrap();
        let t = Instant::now();
        for _ in 0..reps {
            r.model_drafter().unwrap().draft(std::slice::from_ref(&req)).unwrap();
        }
        let per = t.elapsed().as_secs_f64() / reps as f64;
        println!("drafter, {name}: {:.2} ms per proposal of {gamma} drafts", per * 1e3);
    }
    let fork = r.fork_state(s).unwrap();
    let t = Instant::now();
    let mut last = 5;
    for _ in 0..reps {
        let row = RowInput { state: fork, tokens: vec![last], sample: Some(SampleRequest::new(greedy.clone(), 0)) };
        last = r.step(&[row]).unwrap()[0].tokens[0];
    }
    println!("target, one greedy decode step: {:.2} ms", t.elapsed().as_secs_f64() / reps as f64 * 1e3);

    // Acceptance of the random synthetic drafter's greedy drafts, verified with q (expected low).
    let (mut accepted, mut drafted) = (0usize, 0usize);
    for _ in 0..reps {
        let req = DraftRequest { state: fork, anchor: last, num_drafts: gamma, params: greedy.clone() };
        let proposal = r.model_drafter().unwrap().draft(&[req]).unwrap().remove(0);
        r.model_drafter().unwrap().select_proposal(fork).unwrap();
        let row = RowInput {
            state: fork,
            tokens: std::iter::once(last).chain(proposal.tokens).collect(),
            sample: Some(SampleRequest::new(greedy.clone(), gamma)),
        };
        let out = r.step(&[row]).unwrap().remove(0);
        accepted += out.num_accepted;
        drafted += gamma;
        last = *out.tokens.last().unwrap();
    }
    println!("synthetic drafter, greedy: {accepted} of {drafted} drafts accepted over {reps} rounds");
}
