//! The CPU forward against golden logits from the independent float64 PyTorch reference
//! (`kernels/reference/k3_reference.py`, which reads a checkpoint written by `sparkd synth` and writes
//! the MLA in the unabsorbed form). Both sides compute in f64 without bf16 rounding, where the two
//! implementations agree to rounding error, so the tolerance is tight.

use serde_json::Value;
use sparkd_kernels::cpu::{CpuModel, WindowRow};
use sparkd_kernels::state::SeqState;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, TokenId};

const GOLDEN: &str = include_str!("golden/k3_tiny_seed7.json");
const TOLERANCE: f64 = 1e-9;

fn logsumexp(row: &[f64]) -> f64 {
    let max = row.iter().copied().fold(f64::MIN, f64::max);
    max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln()
}

#[test]
fn cpu_forward_matches_the_pytorch_reference_in_f64() {
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    assert_eq!(golden["config"], "k3-tiny");
    assert_eq!(golden["dtype"], "float64");
    let seed = golden["seed"].as_u64().unwrap();
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let model: CpuModel<f64> = CpuModel::load(cfg.clone(), &SyntheticWeights::new(cfg.clone(), seed)).unwrap();
    let vocab = cfg.vocab_size;
    let probe_ids: Vec<usize> =
        golden["probe_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    let mut checked = 0;
    let mut worst = 0.0f64;
    for prompt in golden["prompts"].as_array().unwrap() {
        let tokens: Vec<TokenId> =
            prompt["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as TokenId).collect();
        let mut state = SeqState::new(&cfg);
        let mut rows = [WindowRow { state: &mut state, tokens: &tokens, logits_from: 0, snapshots_from: None }];
        let logits = model.forward(&mut rows).unwrap().remove(0).logits;
        let positions = prompt["positions"].as_array().unwrap();
        assert_eq!(positions.len(), tokens.len());
        for (pos, want) in positions.iter().enumerate() {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let mut compare = |what: &str, got: f64, expected: f64| {
                let err = (got - expected).abs() / expected.abs().max(1.0);
                worst = worst.max(err);
                assert!(
                    err < TOLERANCE,
                    "prompt of {} tokens, position {pos}, {what}: {got} vs {expected}",
                    tokens.len()
                );
                checked += 1;
            };
            compare("logsumexp", logsumexp(row), want["logsumexp"].as_f64().unwrap());
            for entry in want["top"].as_array().unwrap() {
                let (id, value) = (entry[0].as_u64().unwrap() as usize, entry[1].as_f64().unwrap());
                compare(&format!("logit of top token {id}"), row[id], value);
            }
            for (id, value) in probe_ids.iter().zip(want["probe"].as_array().unwrap()) {
                compare(&format!("logit of probe {id}"), row[*id], value.as_f64().unwrap());
            }
            // The reference's top-8 are our top-8 too (ties to the lowest id).
            let mut order: Vec<usize> = (0..vocab).collect();
            order.select_nth_unstable_by(8, |a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
            let mut ours: Vec<usize> = order[..8].to_vec();
            ours.sort_unstable();
            let mut theirs: Vec<usize> =
                want["top"].as_array().unwrap().iter().map(|e| e[0].as_u64().unwrap() as usize).collect();
            theirs.sort_unstable();
            assert_eq!(ours, theirs, "top-8 at position {pos}");
        }
    }
    eprintln!("{checked} golden values checked; worst relative error {worst:.2e}");
    assert!(checked > 1000);
}
