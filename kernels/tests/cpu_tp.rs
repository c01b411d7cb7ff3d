//! The sharded CPU forward (tensor parallelism over in-process ranks, optionally expert parallelism)
//! against the whole model, for TP 2 and 4 and EP 2 and 4, on k3-tiny and on a synthetic config with 64
//! experts; sharded runners decode the whole model's greedy tokens (with and without a token mask, through
//! the distributed argmax); speculation with rollback stays lossless; the sharded runner passes the `Runner`
//! contract suite and moves states to and from the whole runner; group sizes that do not divide the model are
//! refused naming the flag; expert-parallel dispatch is measured.
//!
//! Tolerances (shared/DESIGN.md, "Testing the numbers", as `cpu_forward.rs` applies it to windows):
//! - f64, the checking precision (no bf16 rounding): a sharded forward differs from the whole one only in
//!   the order of the additions of its row-parallel sums, so every logit agrees within [`F64_TOL`] and every
//!   position has the same greedy token.
//! - f32 with bf16 activations, the serving precision: a reordered f32 partial sum can round to the other
//!   bf16 neighbour (measured: 1 of 54 tokens in these windows), and random weights amplify that by the
//!   logits, then through any router near-tie. So every position before the first routing difference agrees
//!   within [`F32_REL_L2`] relative L2 and has the same greedy token unless the whole model's top two are
//!   closer than the difference (an argmax near-tie), and the first routing difference is a near-tie
//!   (selection margin under 0.01). Windows of at most 16 tokens come out bit-identical (asserted).

use std::sync::{Mutex, MutexGuard, OnceLock};

use sparkd_kernels::comm::{local_group, Communicator};
use sparkd_kernels::cpu::forward::{CpuModel, Probe, WindowRow};
use sparkd_kernels::cpu::shard::Reduce;
use sparkd_kernels::cpu::{CpuRunner, ParallelConfig, ShardedCpuRunner};
use sparkd_kernels::float::Real;
use sparkd_kernels::routing::Routing;
use sparkd_kernels::runner::{RowInput, SampleRequest, SamplingParams, TokenMask};
use sparkd_kernels::shard_rule::Shard;
use sparkd_kernels::state::SeqState;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{KernelError, ModelConfig, Runner, TokenId};

mod contract;
use contract::*;

/// The largest absolute logit difference between a sharded f64 forward and the whole one.
const F64_TOL: f64 = 1e-9;
/// The largest relative L2 difference of an f32 position's logits before the first routing difference.
const F32_REL_L2: f64 = 0.05;
/// Groups checked: (ranks, expert parallel).
const SHARDINGS: [(usize, bool); 4] = [(2, false), (4, false), (2, true), (4, true)];

/// A synthetic config with many small experts (64 experts, top 6), tiny widths and a small vocabulary.
fn many_experts() -> ModelConfig {
    let mut cfg = ModelConfig::preset("k3-tiny").unwrap();
    cfg.vocab_size = 4096;
    cfg.hidden_size = 64;
    cfg.moe.num_experts = 64;
    cfg.moe.top_k = 6;
    cfg.moe.expert_dim = 32;
    cfg.moe.latent_dim = 32;
    cfg.dense_intermediate = 128;
    cfg
}

/// One forward over `prompts` (one window each, from empty states): each row's logits at every position
/// (`[positions, V]`) and the router decisions (`[moe layer][token]`, rows in order).
struct Forward<F> {
    logits: Vec<Vec<F>>,
    routing: Vec<Vec<Routing<F>>>,
}

/// [`Forward`] on the whole model (`world` 1, without a group) or on a group of `world` ranks, the logits
/// gathered from the ranks' vocabulary slices.
fn forward<F: Real>(
    cfg: &ModelConfig,
    seed: u64,
    world: usize,
    expert_parallel: bool,
    prompts: &[Vec<TokenId>],
) -> Forward<F>
where
    dyn Communicator: Reduce<F>,
{
    let run = |model: &CpuModel<F>, comm: Option<&(dyn Communicator + 'static)>| -> Forward<F> {
        let mut states: Vec<SeqState<F>> = prompts.iter().map(|_| SeqState::new(&model.cfg)).collect();
        let mut rows: Vec<WindowRow<F>> = states
            .iter_mut()
            .zip(prompts)
            .map(|(state, p)| WindowRow { state, tokens: p, logits_from: 0, snapshots_from: None })
            .collect();
        let mut probe = Probe { record_routing: true, ..Probe::default() };
        let out = match comm {
            None => model.forward_probed(&mut rows, &mut probe).unwrap(),
            Some(c) => model.forward_reduced(&mut rows, &mut probe, c).unwrap(),
        };
        Forward { logits: out.into_iter().map(|o| o.logits).collect(), routing: probe.routing }
    };
    if world == 1 {
        let model = CpuModel::<F>::load(cfg.clone(), &SyntheticWeights::new(cfg.clone(), seed)).unwrap();
        return run(&model, None);
    }
    let comms = local_group(world, None).unwrap();
    let ranks: Vec<Forward<F>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || {
                    let shard = Shard { rank, world, expert_parallel };
                    let model =
                        CpuModel::<F>::load_shard(cfg, &SyntheticWeights::new(cfg.clone(), seed), shard).unwrap();
                    run(&model, Some(&comm))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Rank r holds ids r·V/N.. of every position: interleave the slices back per position.
    let slice = cfg.vocab_size / world;
    let logits = (0..prompts.len())
        .map(|row| {
            let positions = ranks[0].logits[row].len() / slice;
            let mut full = Vec::with_capacity(positions * cfg.vocab_size); // [positions, V]
            for p in 0..positions {
                for rank in &ranks {
                    full.extend_from_slice(&rank.logits[row][p * slice..(p + 1) * slice]);
                }
            }
            full
        })
        .collect();
    let routing = ranks.into_iter().next().map(|r| r.routing).unwrap_or_default();
    Forward { logits, routing }
}

fn argmax<F: Real>(row: &[F]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, v)| if *v > row[best] { i } else { best })
}

fn max_abs_diff<F: Real>(a: &[F], b: &[F]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x.to_f64() - y.to_f64()).abs()).fold(0.0, f64::max)
}

/// Windows of 9, 5 and 40 tokens (the last one runs KDA in its chunked form).
fn prompts(vocab: usize) -> Vec<Vec<TokenId>> {
    let ids = |len: usize, step: TokenId| (0..len as TokenId).map(|i| (i * step + 7) % vocab as TokenId).collect();
    vec![ids(9, 131), vec![3, 1, 4, 1, 5], ids(40, 977)]
}

/// f64: every sharding of `cfg` gives the whole model's logits within [`F64_TOL`] and its greedy tokens.
fn check_f64(cfg: &ModelConfig, seed: u64) {
    let prompts = prompts(cfg.vocab_size);
    let whole = forward::<f64>(cfg, seed, 1, false, &prompts);
    for (world, ep) in SHARDINGS {
        let sharded = forward::<f64>(cfg, seed, world, ep, &prompts);
        for (w, s) in whole.logits.iter().zip(&sharded.logits) {
            let diff = max_abs_diff(w, s);
            eprintln!("f64 tp{world} ep={ep}: {} positions, max |logit diff| {diff:.2e}", w.len() / cfg.vocab_size);
            assert!(diff <= F64_TOL, "f64 tp{world} ep={ep}: max |logit diff| {diff:e} > {F64_TOL:e}");
            for (p, (wr, sr)) in w.chunks(cfg.vocab_size).zip(s.chunks(cfg.vocab_size)).enumerate() {
                assert_eq!(argmax(wr), argmax(sr), "f64 tp{world} ep={ep}: greedy token differs at position {p}");
            }
        }
    }
}

/// f32 with bf16 activations: every sharding of `cfg` against the whole model, by the rule of the module doc.
/// Windows of at most 16 tokens must be bit-identical.
fn check_f32(cfg: &ModelConfig, seed: u64) {
    let vocab = cfg.vocab_size;
    let prompts = prompts(vocab);
    let whole = forward::<f32>(cfg, seed, 1, false, &prompts);
    for (world, ep) in SHARDINGS {
        let sharded = forward::<f32>(cfg, seed, world, ep, &prompts);
        let mut first_token = 0; // the row's first token among all rows' (the routing traces' index)
        for ((prompt, w), s) in prompts.iter().zip(&whole.logits).zip(&sharded.logits) {
            let layers = whole.routing.len();
            let at = first_token;
            let flip = |p: usize| {
                (0..layers).find(|l| whole.routing[*l][at + p].experts != sharded.routing[*l][at + p].experts)
            };
            let first_flip = (0..prompt.len()).find(|p| flip(*p).is_some());
            eprintln!(
                "f32 tp{world} ep={ep}: {} tokens, max |logit diff| {:.3e}, first routing difference {first_flip:?}",
                prompt.len(),
                max_abs_diff(w, s)
            );
            if prompt.len() <= 16 {
                assert_eq!(w, s, "f32 tp{world} ep={ep}: a short window is bit-identical");
            }
            let before_flip = first_flip.unwrap_or(prompt.len());
            for (p, (wr, sr)) in w.chunks(vocab).zip(s.chunks(vocab)).enumerate().take(before_flip) {
                let num: f64 = wr.iter().zip(sr).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
                let den: f64 = wr.iter().map(|x| (*x as f64).powi(2)).sum();
                let rel = (num / den).sqrt();
                assert!(rel < F32_REL_L2, "f32 tp{world} ep={ep} position {p}: relative L2 {rel}");
                let (a, b) = (argmax(wr), argmax(sr));
                let gap = (wr[a] - wr[b]) as f64;
                assert!(
                    a == b || gap <= 2.0 * max_abs_diff(wr, sr),
                    "f32 tp{world} ep={ep} position {p}: greedy {a} against {b}, not a near-tie (gap {gap})"
                );
            }
            if let Some(p) = first_flip {
                let l = flip(p).unwrap_or_default();
                let margins = (whole.routing[l][at + p].margin, sharded.routing[l][at + p].margin);
                assert!(
                    margins.0.min(margins.1) < 0.01,
                    "a routing difference without a near-tie: margins {margins:?}"
                );
            }
            first_token += prompt.len();
        }
    }
}

#[test]
fn k3_tiny_sharded_logits_match_the_whole_model_in_f64() {
    check_f64(&ModelConfig::preset("k3-tiny").unwrap(), 11);
}

#[test]
fn many_expert_sharded_logits_match_the_whole_model_in_f64() {
    check_f64(&many_experts(), 5);
}

#[test]
fn k3_tiny_sharded_logits_match_the_whole_model_in_f32() {
    check_f32(&ModelConfig::preset("k3-tiny").unwrap(), 11);
}

#[test]
fn many_expert_sharded_logits_match_the_whole_model_in_f32() {
    check_f32(&many_experts(), 5);
}

#[test]
fn a_group_of_one_is_the_whole_model_bit_for_bit() {
    let cfg = many_experts();
    let prompts = vec![vec![1, 2, 3, 4, 5, 6]];
    let comms = local_group(1, None).unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 3);
    let model = CpuModel::<f32>::load_shard(&cfg, &src, Shard { rank: 0, world: 1, expert_parallel: true }).unwrap();
    let mut state = SeqState::new(&model.cfg);
    let mut rows = [WindowRow { state: &mut state, tokens: &prompts[0], logits_from: 0, snapshots_from: None }];
    let one = model.forward_reduced(&mut rows, &mut Probe::default(), &comms[0] as &dyn Communicator).unwrap();
    assert_eq!(one[0].logits, forward::<f32>(&cfg, 3, 1, false, &prompts).logits[0]);
}

fn prompt(len: usize) -> Vec<TokenId> {
    (0..len as u32).map(|i| (i * 7919 + 13) % 100_000).collect()
}

/// Greedy tokens after `prompt(11)`, one token per step, on any runner.
fn greedy_run(r: &mut dyn Runner, n: usize) -> Vec<TokenId> {
    let p = prompt(11);
    let s = r.alloc_state().unwrap();
    prefill(r, s, &p[..10]);
    let out = decode(r, s, p[10], n, &SamplingParams::greedy());
    r.free_state(s).unwrap();
    out
}

#[test]
fn sharded_runners_decode_the_whole_models_greedy_tokens() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 11);
    let reference = greedy_run(&mut CpuRunner::new(cfg.clone(), &src).unwrap(), 8);
    for (tp, ep) in [(2, false), (4, true)] {
        let parallel = ParallelConfig { tensor_parallel: tp, expert_parallel: ep };
        let mut r = ShardedCpuRunner::new(cfg.clone(), &src, parallel).unwrap();
        assert_eq!(greedy_run(&mut r, 8), reference, "{}", r.device_name());
    }
}

#[test]
fn greedy_choices_under_a_token_mask_equal_the_whole_models() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 11);
    let mut whole = CpuRunner::new(cfg.clone(), &src).unwrap();
    let parallel = ParallelConfig { tensor_parallel: 4, expert_parallel: true };
    let mut sharded = ShardedCpuRunner::new(cfg.clone(), &src, parallel).unwrap();
    // Ban the unmasked greedy choices and a block of ids on every rank's slice: the distributed argmax
    // must apply each rank's part of the mask.
    let banned = greedy_run(&mut whole, 4);
    let mask = || TokenMask::from_fn(cfg.vocab_size, |id| !banned.contains(&id) && id % 40_960 >= 8);
    whole.set_token_mask(mask()).unwrap();
    sharded.set_token_mask(mask()).unwrap();
    let want = greedy_run(&mut whole, 6);
    assert!(want.iter().all(|t| !banned.contains(t)));
    assert_eq!(greedy_run(&mut sharded, 6), want);
}

#[test]
fn speculation_under_tp_equals_plain_decoding() {
    let mut guard = tp2();
    let r: &mut dyn Runner = &mut *guard;
    let p = prompt(11);
    let greedy = SamplingParams::greedy();
    let plain = greedy_run(r, 9);
    // Drafts with one wrong token in each window: the output must be exactly the plain decode.
    let s = r.alloc_state().unwrap();
    prefill(r, s, &p[..10]);
    let (mut out, mut last): (Vec<TokenId>, TokenId) = (Vec::new(), p[10]);
    while out.len() < plain.len() {
        let k = out.len();
        let mut tokens = vec![last];
        tokens.extend(plain[k..].iter().take(3).copied());
        if let Some(t) = tokens.get_mut(3) {
            *t = (*t + 1) % 100_000; // the third draft is wrong
        }
        let drafts = tokens.len() - 1;
        let step = r
            .step(&[RowInput { state: s, tokens, sample: Some(SampleRequest::new(greedy.clone(), drafts)) }])
            .unwrap()
            .remove(0);
        out.extend(&step.tokens);
        last = *step.tokens.last().unwrap();
        assert_eq!(r.state_len(s).unwrap(), 10 + out.len());
    }
    out.truncate(plain.len());
    assert_eq!(out, plain);
    r.free_state(s).unwrap();
}

#[test]
fn group_sizes_that_do_not_divide_the_model_name_the_flag() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 11);
    // k3-tiny has 4 heads: 3 ranks do not divide them.
    let err = ShardedCpuRunner::new(cfg.clone(), &src, ParallelConfig { tensor_parallel: 3, expert_parallel: false })
        .err()
        .expect("3 ranks refused");
    assert!(matches!(&err, KernelError::Config { field, .. } if field == "--tensor-parallel-size"), "{err}");
    assert!(err.to_string().contains("KDA heads"), "{err}");
    // 8 ranks divide nothing of k3-tiny's heads either; with 6 experts over 4 ranks, the expert flag is named.
    let mut odd = many_experts();
    odd.moe.num_experts = 6;
    odd.moe.top_k = 2;
    let err = Shard::check(&odd, 4, true).unwrap_err();
    assert!(matches!(&err, KernelError::Config { field, .. } if field == "--expert-parallel"), "{err}");
    assert!(Shard::check(&odd, 4, false).is_ok(), "split by width, 6 experts need not divide");
}

fn tp2() -> MutexGuard<'static, ShardedCpuRunner> {
    static R: OnceLock<Mutex<ShardedCpuRunner>> = OnceLock::new();
    R.get_or_init(|| {
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let src = SyntheticWeights::new(cfg.clone(), 11);
        let parallel = ParallelConfig { tensor_parallel: 2, expert_parallel: true };
        Mutex::new(ShardedCpuRunner::new(cfg, &src, parallel).unwrap())
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

#[test]
fn tp2_prefill_chunks_equal_one_window() {
    contract_prefill_chunks_equal_one_window(&mut *tp2());
}

#[test]
fn tp2_greedy_speculation_is_lossless() {
    contract_greedy_speculation_is_lossless(&mut *tp2());
}

#[test]
fn tp2_forks_and_exports_are_independent() {
    contract_forks_and_exports_are_independent(&mut *tp2());
}

#[test]
fn tp2_seeded_sampling_ignores_batching() {
    contract_seeded_sampling_ignores_batching(&mut *tp2());
}

#[test]
fn tp2_bad_input_is_rejected_without_side_effects() {
    contract_bad_input_is_rejected_without_side_effects(&mut *tp2());
}

#[test]
fn tp2_row_masks_hold_at_every_position() {
    contract_row_masks_hold_at_every_position(&mut *tp2());
}

#[test]
fn tp2_fed_steps_equal_steps() {
    contract_fed_steps_equal_steps(&mut *tp2());
}

#[test]
fn tp2_launches_are_checked() {
    contract_launches_are_checked(&mut *tp2());
}

#[test]
fn exported_states_move_between_sharded_and_whole_runners() {
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 11);
    let mut whole = CpuRunner::new(cfg.clone(), &src).unwrap();
    let mut guard = tp2();
    let sharded: &mut dyn Runner = &mut *guard;
    let p = prompt(11);
    let greedy = SamplingParams::greedy();
    // A state prefilled on the sharded runner continues on the whole one, and back.
    let s = sharded.alloc_state().unwrap();
    prefill(sharded, s, &p[..10]);
    let exported = sharded.export_state(s).unwrap();
    let w = whole.import_state(exported).unwrap();
    let from_whole = decode(&mut whole, w, p[10], 4, &greedy);
    let from_sharded = decode(sharded, s, p[10], 4, &greedy);
    assert_eq!(from_whole, from_sharded);
    let back = sharded.import_state(whole.export_state(w).unwrap()).unwrap();
    assert_eq!(sharded.export_state(back).unwrap(), whole.export_state(w).unwrap());
    for id in [s, back] {
        sharded.free_state(id).unwrap();
    }
}

/// Expert-parallel dispatch, measured on the in-process communicator at k3-tiny's MoE shapes (latent 64, 16
/// experts, top 4): the all-reduce of each rank's partial routed output `[n, latent]` that the forward uses,
/// against an all-to-all dispatch (tokens split over ranks, each token's latent row sent once to every rank
/// owning one of its experts), an all-to-all combine of the weighted outputs back, and the all-gather that
/// replicates the output again. Prints bytes and time per layer; asserts only the byte counts (the timing is
/// this machine's).
#[test]
fn ep_dispatch_by_all_reduce_against_all_to_all() {
    let (latent, experts, top_k, iters) = (64usize, 16usize, 4usize, 50usize);
    for world in [2usize, 4] {
        for n in [1usize, 64] {
            // Token t's experts: top_k distinct ids from a fixed pattern; expert e lives on rank e / (E / N).
            let owners = |t: usize| -> Vec<usize> {
                let mut ranks: Vec<usize> =
                    (0..top_k).map(|k| ((t * 7 + k * 5) % experts) / (experts / world)).collect();
                ranks.sort_unstable();
                ranks.dedup();
                ranks
            };
            let comms = local_group(world, None).unwrap();
            let results: Vec<(f64, f64, usize, usize)> = std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        s.spawn(move || {
                            let rank = c.rank();
                            let started = std::time::Instant::now();
                            for _ in 0..iters {
                                let mut partial = vec![1.0f32; n * latent];
                                c.all_reduce_sum(&mut partial).unwrap();
                            }
                            let reduce = started.elapsed().as_secs_f64() / iters as f64;
                            let mine: Vec<usize> = (0..n).filter(|t| t % world == rank).collect();
                            let mut sent = 0;
                            let started = std::time::Instant::now();
                            for _ in 0..iters {
                                let mut out = vec![Vec::new(); world];
                                for t in &mine {
                                    for r in owners(*t) {
                                        out[r].extend(std::iter::repeat_n(1.0f32, latent));
                                    }
                                }
                                sent = out.iter().map(Vec::len).sum::<usize>();
                                let got = c.all_to_all(&out).unwrap();
                                let back = c.all_to_all(&got).unwrap();
                                let local = vec![0f32; n.div_ceil(world) * latent];
                                let mut all = vec![0f32; local.len() * world];
                                c.all_gather(&local, &mut all).unwrap();
                                assert_eq!(back.iter().map(Vec::len).sum::<usize>(), sent);
                            }
                            let to_all = started.elapsed().as_secs_f64() / iters as f64;
                            let a2a_bytes = 4 * (2 * sent + n.div_ceil(world) * latent);
                            (reduce, to_all, 4 * n * latent, a2a_bytes)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let (reduce, to_all, ar_bytes, a2a_bytes) = results[0];
            eprintln!(
                "ep{world} n={n}: all-reduce {ar_bytes} B/rank {:.1} us; all-to-all dispatch+combine+all-gather \
                 {a2a_bytes} B/rank {:.1} us",
                reduce * 1e6,
                to_all * 1e6
            );
            if n >= world {
                assert!(a2a_bytes > ar_bytes / world, "every token row crosses at least once");
            }
        }
    }
}
