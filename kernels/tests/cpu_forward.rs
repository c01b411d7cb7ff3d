//! Whole-model checks of the CPU reference on a synthetic k3-tiny: windows against token-by-token
//! decoding, verify-then-commit against a shorter run, batching against single rows, finiteness and
//! entropy of the next-token distributions.

use std::sync::OnceLock;

use sparkd_kernels::cpu::{CpuModel, Probe, WindowRow};
use sparkd_kernels::float::Real;
use sparkd_kernels::routing::Routing;
use sparkd_kernels::state::SeqState;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, TokenId};

const SEED: u64 = 7;

fn model_f32() -> &'static CpuModel<f32> {
    static M: OnceLock<CpuModel<f32>> = OnceLock::new();
    M.get_or_init(load)
}

fn model_f64() -> &'static CpuModel<f64> {
    static M: OnceLock<CpuModel<f64>> = OnceLock::new();
    M.get_or_init(load)
}

fn load<F: Real>() -> CpuModel<F> {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), SEED);
    CpuModel::load(cfg, &src).unwrap()
}

fn prompt(len: usize, salt: u64) -> Vec<TokenId> {
    (0..len as u64).map(|i| ((i * 7919 + salt * 104_729 + 13) % 100_000) as TokenId).collect()
}

/// Logits for every position of `tokens`, fed as windows of the given sizes.
fn run_windows<F: Real>(m: &CpuModel<F>, state: &mut SeqState<F>, tokens: &[TokenId], sizes: &[usize]) -> Vec<F> {
    let mut out = Vec::new();
    let mut at = 0;
    for &s in sizes {
        let mut rows =
            [WindowRow { state: &mut *state, tokens: &tokens[at..at + s], logits_from: 0, snapshots_from: None }];
        out.extend(m.forward(&mut rows).unwrap().remove(0).logits);
        at += s;
    }
    assert_eq!(at, tokens.len());
    out
}

fn argmaxes<F: Real>(logits: &[F], vocab: usize) -> Vec<usize> {
    logits
        .chunks_exact(vocab)
        .map(|row| (0..vocab).fold(0, |best, i| if row[i] > row[best] { i } else { best }))
        .collect()
}

fn max_abs_diff<F: Real>(a: &[F], b: &[F]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x.to_f64() - y.to_f64()).abs()).fold(0.0, f64::max)
}

#[test]
fn window_equals_token_by_token_in_f64() {
    let m = model_f64();
    let tokens = prompt(40, 1);
    let mut s1 = SeqState::new(&m.cfg);
    let one_window = run_windows(m, &mut s1, &tokens, &[40]);
    let mut s2 = SeqState::new(&m.cfg);
    let singles = run_windows(m, &mut s2, &tokens, &[1; 40]);
    let d = max_abs_diff(&one_window, &singles);
    assert!(d < 1e-9, "f64 logits differ by {d}");
    assert_eq!(s1.len, 40);
    assert!(max_abs_diff(&s1.kda[0].s, &s2.kda[0].s) < 1e-11);
}

/// Teacher-forced comparison in the serving precision. The chunked (prefill) and recurrent (decode)
/// KDA forms round differently in fp32; with bf16 activations that is invisible until a router top-k
/// decision sits on a near-tie and flips, after which the sequence states differ for good
/// (shared/DESIGN.md, "Testing the numbers"). Random weights also amplify a one-ulp bf16 difference
/// ~50x by the logits (measured: a 2^-7 change of one embedding element moves that position's logits
/// by 2-4% relative L2). So: every position before the first routing difference must agree within 5%
/// relative L2 with the same argmax, and the first difference must be a genuine
/// near-tie (a selection margin under 0.01 in one of the runs). The exact equivalence of the two
/// forms is proven in f64 above.
#[test]
fn window_equals_token_by_token_in_bf16_serving_precision() {
    let m = model_f32();
    let vocab = m.cfg.vocab_size;
    let len = 48;
    let tokens = prompt(len, 2);

    let mut s1 = SeqState::new(&m.cfg);
    let mut window_trace = Probe { record_routing: true, ..Probe::default() };
    let mut rows = [WindowRow { state: &mut s1, tokens: &tokens, logits_from: 0, snapshots_from: None }];
    let window = m.forward_probed(&mut rows, &mut window_trace).unwrap().remove(0).logits;

    let mut s2 = SeqState::new(&m.cfg);
    let mut singles = Vec::new();
    let mut single_routing: Vec<Vec<Routing<f32>>> = Vec::new(); // [position][moe layer]
    for t in &tokens {
        let mut trace = Probe { record_routing: true, ..Probe::default() };
        let mut rows =
            [WindowRow { state: &mut s2, tokens: std::slice::from_ref(t), logits_from: 0, snapshots_from: None }];
        singles.extend(m.forward_probed(&mut rows, &mut trace).unwrap().remove(0).logits);
        single_routing.push(trace.routing.into_iter().map(|mut layer| layer.remove(0)).collect());
    }

    let moe_layers = window_trace.routing.len();
    let differs =
        |pos: usize| (0..moe_layers).find(|l| window_trace.routing[*l][pos].experts != single_routing[pos][*l].experts);
    let first_flip = (0..len).find(|p| differs(*p).is_some());
    let flips = (0..len)
        .map(|p| {
            (0..moe_layers).filter(|l| window_trace.routing[*l][p].experts != single_routing[p][*l].experts).count()
        })
        .sum::<usize>();
    eprintln!(
        "first routing difference at position {first_flip:?}; {flips} of {} (position, layer) decisions differ",
        len * moe_layers
    );

    let agree_until = first_flip.unwrap_or(len);
    assert!(agree_until >= 4, "routing differs already at position {agree_until}");
    for (pos, (a, b)) in window.chunks_exact(vocab).zip(singles.chunks_exact(vocab)).enumerate().take(agree_until) {
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
        let rel = (num / den).sqrt();
        assert!(rel < 0.05, "position {pos}: relative L2 {rel}");
        assert_eq!(argmaxes(a, vocab), argmaxes(b, vocab), "position {pos}");
    }
    if let Some(pos) = first_flip {
        let layer = differs(pos).unwrap();
        let margins = (window_trace.routing[layer][pos].margin, single_routing[pos][layer].margin);
        eprintln!("flip at position {pos}, MoE layer {layer}: margins {margins:?}");
        assert!(margins.0.min(margins.1) < 0.01, "a routing difference without a near-tie: margins {margins:?}");
    }
}

#[test]
fn verify_then_commit_equals_running_the_accepted_prefix() {
    let m = model_f32();
    let tokens = prompt(30, 3);
    let (ctx, window) = tokens.split_at(20);
    for accepted in [1usize, 3, 6, 10] {
        // Verify a window of 10, keep `accepted` of it.
        let mut verified = SeqState::new(&m.cfg);
        run_windows(m, &mut verified, ctx, &[20]);
        let mut rows = [WindowRow { state: &mut verified, tokens: window, logits_from: 0, snapshots_from: Some(1) }];
        let out = m.forward(&mut rows).unwrap().remove(0);
        out.undo.unwrap().commit(&mut verified, accepted).unwrap();
        assert_eq!(verified.len, 20 + accepted);
        // Run only the accepted prefix.
        let mut plain = SeqState::new(&m.cfg);
        run_windows(m, &mut plain, ctx, &[20]);
        run_windows(m, &mut plain, &window[..accepted], &[accepted]);
        assert_eq!(verified, plain, "state after committing {accepted}");
        // And the next step gives bit-identical logits.
        let next = [tokens[29]];
        let a = run_windows(m, &mut verified, &next, &[1]);
        let b = run_windows(m, &mut plain, &next, &[1]);
        assert_eq!(a, b);
    }
}

#[test]
fn batched_rows_equal_single_rows() {
    let m = model_f32();
    let prompts = [prompt(3, 4), prompt(17, 5), prompt(1, 6), prompt(9, 7)];
    let mut states: Vec<SeqState<f32>> = prompts.iter().map(|_| SeqState::new(&m.cfg)).collect();
    let mut rows: Vec<WindowRow<f32>> = states
        .iter_mut()
        .zip(&prompts)
        .map(|(state, p)| WindowRow { state, tokens: p, logits_from: p.len() - 1, snapshots_from: None })
        .collect();
    let batched = m.forward(&mut rows).unwrap();
    for (p, out) in prompts.iter().zip(&batched) {
        let mut s = SeqState::new(&m.cfg);
        let mut row = [WindowRow { state: &mut s, tokens: p, logits_from: p.len() - 1, snapshots_from: None }];
        let single = m.forward(&mut row).unwrap().remove(0);
        assert_eq!(out.logits, single.logits);
    }
}

#[test]
fn activations_stay_finite_and_distributions_are_neither_one_hot_nor_uniform() {
    let m = model_f32();
    let vocab = m.cfg.vocab_size;
    let tokens = prompt(32, 8);
    let mut s = SeqState::new(&m.cfg);
    let logits = run_windows(m, &mut s, &tokens, &[32]);
    assert!(logits.iter().all(|x| x.is_finite()));
    let uniform = (vocab as f64).ln();
    for (pos, row) in logits.chunks_exact(vocab).enumerate() {
        let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
        let z: f64 = row.iter().map(|l| (*l as f64 - max).exp()).sum();
        let entropy: f64 =
            row.iter().map(|l| (*l as f64 - max).exp() / z).filter(|p| *p > 0.0).map(|p| -p * p.ln()).sum();
        eprintln!("position {pos}: entropy {entropy:.3} nats (uniform {uniform:.3})");
        assert!(entropy > 1.0 && entropy < uniform - 1.0, "entropy {entropy} at position {pos}");
    }
}

#[test]
fn out_of_vocabulary_tokens_are_an_error() {
    let m = model_f32();
    let mut s = SeqState::new(&m.cfg);
    let bad = [m.cfg.vocab_size as TokenId];
    let mut rows = [WindowRow { state: &mut s, tokens: &bad, logits_from: 0, snapshots_from: None }];
    let err = m.forward(&mut rows).err().expect("an error");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    assert_eq!(s.len, 0);
}

#[test]
fn the_last_layer_tap_is_what_the_head_reads() {
    let m = model_f64();
    let tokens = prompt(5, 9);
    let mut s = SeqState::new(&m.cfg);
    let last = m.cfg.num_layers() - 1;
    let mut probe = Probe { tap_layers: vec![1, last], ..Probe::default() };
    let mut rows = [WindowRow { state: &mut s, tokens: &tokens, logits_from: 0, snapshots_from: None }];
    let logits = m.forward_probed(&mut rows, &mut probe).unwrap().remove(0).logits;
    let d = m.cfg.hidden_size;
    assert_eq!(probe.taps.len(), 2);
    assert_eq!(probe.taps[0].len(), tokens.len() * d);
    let from_tap = m.weights.lm_head.forward(&m.weights.norm.forward(&probe.taps[1]));
    assert!(max_abs_diff(&from_tap, &logits) < 1e-12);
    // An out-of-range tap layer is an error.
    let mut bad = Probe { tap_layers: vec![m.cfg.num_layers()], ..Probe::default() };
    let mut s2 = SeqState::new(&m.cfg);
    let mut rows = [WindowRow { state: &mut s2, tokens: &tokens, logits_from: 0, snapshots_from: None }];
    assert!(m.forward_probed(&mut rows, &mut bad).is_err());
}
