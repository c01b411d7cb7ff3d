//! Device sampling, log-probabilities, the token mask and the acceptance rules (`cuda::sample`) against
//! the CPU reference (`sampling`, `acceptance::verify`) on the same bf16 logits, at K3's vocabulary
//! (163,840). On a machine without a CUDA driver every test says plainly that it skipped.
//!
//! Agreement rule: tokens must be identical, except where the CPU's cumulative mass lies within
//! `CDF_EPS` of the uniform that decided it (the device sums in another order), or, with a device `q`
//! (f32 where the CPU's is f64), where the accept test `u q(x) < p(x)` is within `Q_REL` of equality.
//! Those near-boundary cases are counted and must be rare; any other difference fails.

use std::sync::{Mutex, OnceLock};

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparkd_kernels::acceptance::{self, AcceptanceMode, SyntheticSchedule, VerifyWindow};
use sparkd_kernels::cuda::device::driver_present;
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::sample::{self, DeviceDraw, DeviceTokenMask, DrawPlan, LogitsRows, SampleKernels, VerifyRow};
use sparkd_kernels::dspark::model::{draft_uniform, DRAFT_STREAM};
use sparkd_kernels::runner::{RowInput, SampleRequest, SamplingParams, TokenMask};
use sparkd_kernels::sampling::{self, hash3, uniform, Distribution, RngStream};
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::{ModelConfig, Runner, TokenId};

const VOCAB: usize = 163_840;
const ROWS: usize = 64;
/// The device's sums differ from the CPU's in order only (~1e-16 relative); this is generous.
const CDF_EPS: f64 = 1e-9;
/// f32 draft probabilities against the CPU's f64 ones.
const Q_REL: f64 = 1e-5;

/// The GPU with its sampling kernels.
struct Dev {
    gpu: Gpu,
    sample: SampleKernels,
}

fn gpu() -> Option<std::sync::MutexGuard<'static, Dev>> {
    if !driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine; device sampling was NOT checked");
        return None;
    }
    static G: OnceLock<Mutex<Dev>> = OnceLock::new();
    let g = G.get_or_init(|| {
        let gpu = Gpu::new(0).unwrap();
        let sample = SampleKernels::load(&gpu).unwrap();
        Mutex::new(Dev { gpu, sample })
    });
    Some(g.lock().unwrap_or_else(|e| e.into_inner()))
}

/// `ROWS` logits rows of four shapes: flat, peaked on a few ids, heavy exact ties, one dominant id.
fn logit_rows(seed: u64) -> Vec<bf16> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(ROWS * VOCAB);
    for r in 0..ROWS {
        let kind = r % 4;
        let hot: Vec<usize> = (0..8).map(|_| rng.gen_range(0..VOCAB)).collect();
        for id in 0..VOCAB {
            let base: f32 = rng.gen_range(-3.0f32..3.0) + rng.gen_range(-3.0f32..3.0);
            let v = match kind {
                0 => base,
                1 => base + if hot.contains(&id) { 14.0 } else { 0.0 },
                2 => base.round(),
                _ => base + if id == hot[0] { 40.0 } else { 0.0 },
            };
            out.push(bf16::from_f32(v));
        }
    }
    out
}

/// `f(0..n)` on all cores, in order (the CPU reference is the slow side of these tests).
fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get()).min(n.max(1));
    let chunk = n.div_ceil(threads);
    std::thread::scope(|sc| {
        let f = &f;
        let handles: Vec<_> = (0..threads)
            .map(|t| sc.spawn(move || (t * chunk..((t + 1) * chunk).min(n)).map(f).collect::<Vec<T>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

fn host_row(rows: &[bf16], r: usize, mask: Option<&TokenMask>) -> Vec<f32> {
    let mut row: Vec<f32> = rows[r * VOCAB..(r + 1) * VOCAB].iter().map(|x| x.to_f32()).collect();
    if let Some(m) = mask {
        m.apply(&mut row);
    }
    row
}

/// Logits row `r` as the verifier sees it: the launch's `mask`, then, with `own`, the row's own mask `own[r]`.
fn target_row(rows: &[bf16], r: usize, mask: Option<&TokenMask>, own: Option<&Vec<TokenMask>>) -> Vec<f32> {
    let mut row = host_row(rows, r, mask);
    if let Some(own) = own {
        own[r].apply(&mut row);
    }
    row
}

fn test_mask() -> TokenMask {
    // About a third of the ids disallowed, in runs and singles (as a tokenizer's holes).
    TokenMask::from_fn(VOCAB, |id| !(100_256..140_000).contains(&id) && hash3(1, id as u64, 9) % 5 != 0)
}

fn param_grid() -> Vec<SamplingParams> {
    let mut grid = Vec::new();
    for &temperature in &[0.0f32, 0.6, 1.0, 1.7] {
        for &(top_k, top_p) in &[(0usize, 1.0f32), (1, 1.0), (50, 1.0), (0, 0.9), (0, 0.3), (40, 0.8), (5000, 0.95)] {
            if temperature == 0.0 && (top_k, top_p) != (0, 1.0) {
                continue;
            }
            grid.push(SamplingParams { temperature, top_p, top_k, seed: 0, logprobs: None });
        }
    }
    grid
}

/// True when the CPU's inverse CDF of `d` at `u` sits within `eps` of the boundary between `a` and `b`.
fn near_boundary(d: &Distribution, u: f64, a: TokenId, b: TokenId, eps: f64) -> bool {
    let cum: f64 = d.probs()[..=a.min(b) as usize].iter().filter(|p| **p > 0.0).sum();
    (cum - u).abs() < eps
}

#[derive(Default, Debug)]
struct Tally {
    rows: usize,
    identical: usize,
    near_boundary: usize,
    unexplained: Vec<String>,
}

impl Tally {
    fn check(&self, what: &str) {
        eprintln!(
            "{what}: {} rows, {} identical, {} near a boundary, {} unexplained",
            self.rows,
            self.identical,
            self.near_boundary,
            self.unexplained.len()
        );
        for u in self.unexplained.iter().take(10) {
            eprintln!("  {u}");
        }
        assert!(self.unexplained.is_empty(), "{what}: tokens differ away from any boundary");
        assert!(self.near_boundary * 100 <= self.rows, "{what}: near-boundary cases are not rare");
    }
}

#[test]
fn the_rng_port_matches_bit_for_bit() {
    let Some(held) = gpu() else { return };
    let Dev { gpu: g, sample: k } = &*held;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut inputs: Vec<(u64, u64, u64)> =
        (0..20_000).map(|i| (rng.gen(), rng.gen::<u64>() >> (i % 64), [0, 1, 2, DRAFT_STREAM][i % 4])).collect();
    inputs.extend([(0, 0, 0), (u64::MAX, u64::MAX, u64::MAX), (42, 7, DRAFT_STREAM)]);
    let device = k.hash3_on_device(g, &inputs).unwrap();
    let wrong = inputs.iter().zip(&device).filter(|((s, p, st), d)| hash3(*s, *p, *st) != **d).count();
    eprintln!("hash3: {} triples, {wrong} differ", inputs.len());
    assert_eq!(wrong, 0);
}

#[test]
fn sampling_and_processed_probabilities_match_the_cpu() {
    let Some(held) = gpu() else { return };
    let Dev { gpu: g, sample: k } = &*held;
    let rows = logit_rows(7);
    let dev = g.upload(&rows).unwrap();
    let mask = test_mask();
    let dmask = DeviceTokenMask::upload(g, &mask).unwrap();
    let probs = g.zeros::<f32>(ROWS * VOCAB).unwrap();
    let mut tally = Tally::default();
    let (mut worst_rel, mut support_diff, mut compared) = (0.0f64, 0usize, 0usize);
    for (ci, base) in param_grid().into_iter().enumerate() {
        for masked in [false, true] {
            let m = masked.then_some(&mask);
            let params: Vec<SamplingParams> =
                (0..ROWS).map(|r| SamplingParams { seed: (ci * 1000 + r) as u64, ..base.clone() }).collect();
            let positions: Vec<u64> = (0..ROWS).map(|r| 100 + (r * 37 + ci) as u64).collect();
            let tokens = k
                .sample_rows(
                    g,
                    &LogitsRows { logits: g.ptr(&dev), rows: ROWS, vocab: VOCAB, params: &params },
                    &positions,
                    RngStream::Token as u64,
                    masked.then_some(&dmask),
                    Some(g.ptr(&probs)),
                )
                .unwrap();
            let host_probs = g.download(&probs, ROWS * VOCAB).unwrap();
            // Per row: (cpu token, near a boundary, (worst relative error, support differences) when compared).
            let cpu_rows = par_map(ROWS, |r| {
                let logits = host_row(&rows, r, m);
                let cpu = sampling::sample(&logits, &params[r], positions[r]).unwrap();
                let d = Distribution::from_logits(&logits, &params[r]).unwrap();
                let u = uniform(params[r].seed, positions[r], RngStream::Token);
                let near = !params[r].is_greedy() && near_boundary(&d, u, tokens[r], cpu, CDF_EPS);
                let probs_check = (ci % 3 == 0).then(|| {
                    let (mut worst, mut diff) = (0.0f64, 0usize);
                    for (p_dev, p_cpu) in host_probs[r * VOCAB..(r + 1) * VOCAB].iter().zip(d.probs()) {
                        if (*p_dev > 0.0) != (*p_cpu > 0.0) {
                            diff += 1;
                        } else if *p_cpu > 1e-30 {
                            worst = worst.max((*p_dev as f64 - p_cpu).abs() / p_cpu);
                        }
                    }
                    (worst, diff)
                });
                (cpu, near, probs_check)
            });
            for (r, (cpu, near, probs_check)) in cpu_rows.into_iter().enumerate() {
                let got = tokens[r];
                if masked {
                    assert!(mask.is_allowed(got), "masked id {got} emitted");
                }
                tally.rows += 1;
                if got == cpu {
                    tally.identical += 1;
                } else if near {
                    tally.near_boundary += 1;
                } else {
                    tally.unexplained.push(format!("{base:?} masked {masked} row {r}: device {got}, cpu {cpu}"));
                }
                if let Some((worst, diff)) = probs_check {
                    worst_rel = worst_rel.max(worst);
                    support_diff += diff;
                    compared += 1;
                }
            }
        }
    }
    eprintln!("processed probabilities: {compared} rows, worst relative error {worst_rel:.3e}, {support_diff} ids in one support only");
    tally.check("sample_rows vs sampling::sample");
    assert!(worst_rel < 1e-6, "f32 probabilities off by {worst_rel}");
    assert_eq!(support_diff, 0);
}

#[test]
fn draft_sampling_uses_the_drafter_stream() {
    let Some(held) = gpu() else { return };
    let Dev { gpu: g, sample: k } = &*held;
    let rows = logit_rows(8);
    let dev = g.upload(&rows).unwrap();
    let params: Vec<SamplingParams> = (0..ROWS)
        .map(|r| SamplingParams { temperature: 0.8, top_p: 0.95, top_k: 0, seed: r as u64 * 3, logprobs: None })
        .collect();
    let positions: Vec<u64> = (0..ROWS as u64).map(|r| 5000 + r).collect();
    let tokens = k
        .sample_rows(
            g,
            &LogitsRows { logits: g.ptr(&dev), rows: ROWS, vocab: VOCAB, params: &params },
            &positions,
            DRAFT_STREAM,
            None,
            None,
        )
        .unwrap();
    let mut tally = Tally::default();
    for r in 0..ROWS {
        let d = Distribution::from_logits(&host_row(&rows, r, None), &params[r]).unwrap();
        let u = draft_uniform(params[r].seed, positions[r]);
        let cpu = d.sample_with(u);
        tally.rows += 1;
        if cpu == tokens[r] {
            tally.identical += 1;
        } else if near_boundary(&d, u, cpu, tokens[r], CDF_EPS) {
            tally.near_boundary += 1;
        } else {
            tally.unexplained.push(format!("row {r}: device {}, cpu {cpu}", tokens[r]));
        }
    }
    tally.check("sample_rows(DRAFT_STREAM) vs the CPU drafter's draw");
}

/// `ROWS` f32 logits rows (the drafter's Markov logits are f32) of four shapes, most values not
/// representable in bf16: full-precision noise; clusters of distinct values inside one bf16 step (so
/// rounding to bf16 would change top-k, top-p and the probabilities); exact ties with -0, +0 and -inf;
/// a few dominant ids.
fn f32_logit_rows(seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(ROWS * VOCAB);
    for r in 0..ROWS {
        let hot: Vec<usize> = (0..8).map(|_| rng.gen_range(0..VOCAB)).collect();
        for id in 0..VOCAB {
            let base: f32 = rng.gen_range(-3.0f32..3.0) + rng.gen_range(-3.0f32..3.0);
            let v = match r % 4 {
                0 => base,
                1 => base.round() + rng.gen_range(0..64) as f32 * 1e-5,
                2 => match id % 11 {
                    0 => -0.0,
                    1 => 0.0,
                    3 => f32::NEG_INFINITY,
                    _ => base.round(),
                },
                _ => base + if hot.contains(&id) { 14.0 + rng.gen_range(0.0f32..1e-3) } else { 0.0 },
            };
            out.push(v);
        }
    }
    out
}

/// f32 rows drawn by `DrawPlan` (the drafter's path): the token written to device memory must be the
/// CPU drafter's draw (`Distribution::from_logits` of the f32 row at `draft_uniform`), the written
/// distribution the CPU's, with the same support, for every parameter set.
#[test]
fn f32_rows_draw_like_the_cpu_drafter() {
    let Some(held) = gpu() else { return };
    let Dev { gpu: g, sample: k } = &*held;
    let rows = f32_logit_rows(12);
    let dev = g.upload(&rows).unwrap();
    let probs = g.zeros::<f32>(ROWS * VOCAB).unwrap(); // [ROWS, VOCAB]
    let mut tally = Tally::default();
    let (mut worst_rel, mut support_diff, mut compared) = (0.0f64, 0usize, 0usize);
    for (ci, base) in param_grid().into_iter().enumerate() {
        let params: Vec<SamplingParams> = (0..ROWS)
            .map(|r| SamplingParams { seed: (ci * 1000 + r) as u64, logprobs: Some(2), ..base.clone() })
            .collect();
        let positions: Vec<u64> = (0..ROWS).map(|r| 100 + (r * 37 + ci) as u64).collect();
        // [2, ROWS]: one token slot per row and group. Group 0 is never launched: its slots stay 0.
        let tokens = g.zeros::<u32>(2 * ROWS).unwrap();
        let group = |slot: usize| -> Vec<DeviceDraw<'_>> {
            (0..ROWS)
                .map(|r| DeviceDraw {
                    logits: g.ptr(&dev) + (r * VOCAB * 4) as u64,
                    probs_out: g.ptr(&probs) + (r * VOCAB * 4) as u64,
                    token_out: g.ptr(&tokens) + ((slot * ROWS + r) * 4) as u64,
                    params: &params[r],
                    position: positions[r],
                })
                .collect()
        };
        let plan = DrawPlan::new(g, VOCAB, &[group(0), group(1)], DRAFT_STREAM).unwrap();
        plan.launch(g, k, 1).unwrap();
        plan.finish(g).unwrap();
        let slots = g.download(&tokens, 2 * ROWS).unwrap();
        assert!(slots[..ROWS].iter().all(|t| *t == 0), "an unlaunched group wrote tokens");
        let got = &slots[ROWS..];
        let host_probs = g.download(&probs, ROWS * VOCAB).unwrap();
        let cpu_rows = par_map(ROWS, |r| {
            let logits = &rows[r * VOCAB..(r + 1) * VOCAB];
            let d = Distribution::from_logits(logits, &params[r]).unwrap();
            let u = draft_uniform(params[r].seed, positions[r]);
            let cpu = d.sample_with(u);
            let near = !params[r].is_greedy() && near_boundary(&d, u, got[r], cpu, CDF_EPS);
            let (mut worst, mut diff) = (0.0f64, 0usize);
            for (p_dev, p_cpu) in host_probs[r * VOCAB..(r + 1) * VOCAB].iter().zip(d.probs()) {
                if (*p_dev > 0.0) != (*p_cpu > 0.0) {
                    diff += 1;
                } else if *p_cpu > 1e-30 {
                    worst = worst.max((*p_dev as f64 - p_cpu).abs() / p_cpu);
                }
            }
            (cpu, near, worst, diff)
        });
        for (r, (cpu, near, worst, diff)) in cpu_rows.into_iter().enumerate() {
            tally.rows += 1;
            if got[r] == cpu {
                tally.identical += 1;
            } else if near {
                tally.near_boundary += 1;
            } else {
                tally.unexplained.push(format!("{base:?} row {r} (kind {}): device {}, cpu {cpu}", r % 4, got[r]));
            }
            if diff > 0 {
                eprintln!("{base:?} row {r} (kind {}): {diff} ids in one support only", r % 4);
            }
            worst_rel = worst_rel.max(worst);
            support_diff += diff;
            compared += 1;
        }
    }
    eprintln!(
        "f32 draws: {compared} rows, worst relative error of q {worst_rel:.3e}, {support_diff} ids in one support only"
    );
    tally.check("DrawPlan (f32 rows) vs the CPU drafter's draw");
    assert!(worst_rel < 1e-6, "f32 probabilities off by {worst_rel}");
    assert_eq!(support_diff, 0, "the kept sets differ (f32 values keyed at bf16 precision?)");
}

/// A NaN or +inf f32 logit, or a row of only -inf, is an error of `finish`, naming the row.
#[test]
fn bad_f32_rows_are_errors() {
    let Some(held) = gpu() else { return };
    let Dev { gpu: g, sample: k } = &*held;
    let params = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 1, logprobs: None };
    let token = g.zeros::<u32>(1).unwrap();
    let probs = g.zeros::<f32>(VOCAB).unwrap();
    let mut nan = vec![0.5f32; VOCAB];
    nan[70_000] = f32::NAN;
    let mut inf = vec![0.5f32; VOCAB];
    inf[9] = f32::INFINITY;
    for (name, row, want) in [
        ("NaN", nan, "NaN or +inf"),
        ("+inf", inf, "NaN or +inf"),
        ("all -inf", vec![f32::NEG_INFINITY; VOCAB], "all masked"),
    ] {
        let dev = g.upload(&row).unwrap();
        let draw = DeviceDraw {
            logits: g.ptr(&dev),
            probs_out: g.ptr(&probs),
            token_out: g.ptr(&token),
            params: &params,
            position: 3,
        };
        let plan = DrawPlan::new(g, VOCAB, &[vec![draw]], DRAFT_STREAM).unwrap();
        plan.launch(g, k, 0).unwrap();
        let err = plan.finish(g).expect_err(name).to_string();
        assert!(err.contains(want), "{name}: {err}");
        assert!(plan.launch(g, k, 1).is_err(), "a group that does not exist");
    }
    let bad = SamplingParams { temperature: -1.0, ..params };
    let draw = DeviceDraw { logits: 0, probs_out: 0, token_out: 0, params: &bad, position: 0 };
    assert!(DrawPlan::new(g, VOCAB, &[vec![draw]], DRAFT_STREAM).is_err(), "bad parameters");
}

/// Why a device verdict may differ from the CPU's: the first differing position decides.
fn explain(
    target: &[f32],
    q_logits: Option<&[f32]>,
    drafts: &[TokenId],
    params: &SamplingParams,
    first_position: u64,
    cpu: &[TokenId],
    dev: &[TokenId],
) -> bool {
    if params.is_greedy() {
        return false;
    }
    let i = cpu.iter().zip(dev).position(|(a, b)| a != b).unwrap_or(cpu.len().min(dev.len()));
    if i >= cpu.len() || i >= dev.len() {
        return false;
    }
    let position = first_position + i as u64;
    let p = Distribution::from_logits(&target[i * VOCAB..(i + 1) * VOCAB], params).unwrap();
    let u_token = uniform(params.seed, position, RngStream::Token);
    if i == drafts.len() {
        return near_boundary(&p, u_token, cpu[i], dev[i], CDF_EPS);
    }
    let q = match q_logits {
        Some(q) => Distribution::from_logits(&q[i * VOCAB..(i + 1) * VOCAB], params).unwrap(),
        None => Distribution::one_hot(VOCAB, drafts[i]).unwrap(),
    };
    let (px, qx) = (p.prob(drafts[i]), q.prob(drafts[i]));
    let u_accept = uniform(params.seed, position, RngStream::Accept);
    let rel = if q_logits.is_some() { Q_REL } else { 1e-12 };
    if (u_accept * qx - px).abs() <= rel * px.max(1e-300) {
        return true;
    }
    let residual = p.residual(&q).unwrap_or(p);
    let eps = if q_logits.is_some() { Q_REL } else { CDF_EPS };
    near_boundary(&residual, u_token, cpu[i], dev[i], eps)
}

#[test]
fn verify_matches_acceptance_verify() {
    let Some(held) = gpu() else { return };
    let Dev { gpu: g, sample: k } = &*held;
    let rows = logit_rows(9);
    let dev = g.upload(&rows).unwrap();
    let mask = test_mask();
    let dmask = DeviceTokenMask::upload(g, &mask).unwrap();
    let l = 3; // drafts per window: rows [4w, 4w + 4) are a window's target, rows of window w + 8 its q
    let windows = ROWS / (l + 1);
    let q_buf = g.zeros::<f32>(ROWS * VOCAB).unwrap();
    let schedule = SyntheticSchedule::from_rates(vec![0.9, 0.6, 0.3]).unwrap();
    // A constrained row's own masks, one per logits row (window w's position i: row w * (l + 1) + i), each allowing
    // about two thirds of the ids, a different two thirds per row.
    let row_masks: Vec<TokenMask> =
        (0..ROWS).map(|r| TokenMask::from_fn(VOCAB, |id| hash3(r as u64, id as u64, 21) % 3 != 0)).collect();
    let row_mask_words: Vec<u32> = row_masks.iter().flat_map(sample::mask_words).collect();
    let drow_masks = g.upload(&row_mask_words).unwrap(); // [ROWS, VOCAB / 32]
    let mut tally = Tally::default();
    let mut lp_worst = 0.0f64;
    let mut accepted_total = 0usize;
    // Every other parameter set of the grid (the CPU reference is the slow part), greedy included.
    let grid: Vec<SamplingParams> = param_grid().into_iter().step_by(2).collect();
    for (ci, base) in grid.iter().enumerate() {
        for variant in 0..5 {
            // 0: one-hot drafts, 1: device q, 2: one-hot + mask + logprobs, 3: forced acceptance, 4: one-hot + mask +
            // each row's own masks + logprobs
            let masked = variant == 2 || variant == 4;
            let own_masks = variant == 4;
            let m = masked.then_some(&mask);
            let with_q = variant == 1 && !base.is_greedy();
            let mode =
                if variant == 3 { AcceptanceMode::Synthetic(schedule.clone()) } else { AcceptanceMode::Standard };
            let params: Vec<SamplingParams> = (0..windows)
                .map(|w| SamplingParams {
                    seed: (ci * 100 + w * 7 + variant) as u64,
                    logprobs: (masked || w % 5 == 0).then_some(w % 4),
                    ..base.clone()
                })
                .collect();
            let q_rows = |w: usize| ((w + 8) % windows) * (l + 1);
            if with_q {
                // q for window w: the processed rows q_rows(w)..+l, written at row w * (l + 1).
                for (w, p) in params.iter().enumerate() {
                    let src = g.ptr(&dev) + (q_rows(w) * VOCAB * 2) as u64;
                    let dst = g.ptr(&q_buf) + (w * (l + 1) * VOCAB * 4) as u64;
                    k.probs_from_logits(
                        g,
                        &LogitsRows { logits: src, rows: l, vocab: VOCAB, params: &vec![p.clone(); l] },
                        None,
                        dst,
                    )
                    .unwrap();
                }
            }
            let mut rng = ChaCha8Rng::seed_from_u64((ci * 10 + variant) as u64);
            let mut drafts_of = Vec::new();
            for (w, p) in params.iter().enumerate() {
                let drafts: Vec<TokenId> = (0..l)
                    .map(|i| {
                        let row = || target_row(&rows, w * (l + 1) + i, m, own_masks.then_some(&row_masks));
                        match rng.gen_range(0..4) {
                            0 => sampling::argmax(&row()).unwrap(),
                            1 if with_q => {
                                let q = host_row(&rows, q_rows(w) + i, None);
                                sampling::sample(&q, p, rng.gen()).unwrap()
                            }
                            1 => sampling::sample(&row(), p, rng.gen()).unwrap(),
                            2 => rng.gen_range(100_256..140_000),
                            _ => rng.gen_range(0..VOCAB as TokenId),
                        }
                    })
                    .collect();
                drafts_of.push(drafts);
            }
            let first_positions: Vec<u64> = (0..windows).map(|w| (w * 13 + ci) as u64 + 50).collect();
            let verify: Vec<VerifyRow> = (0..windows)
                .map(|w| VerifyRow {
                    logits: g.ptr(&dev) + (w * (l + 1) * VOCAB * 2) as u64,
                    drafts: &drafts_of[w],
                    params: &params[w],
                    first_position: first_positions[w],
                    q: with_q.then(|| g.ptr(&q_buf) + (w * (l + 1) * VOCAB * 4) as u64),
                    token_out: None,
                    masks: own_masks.then(|| g.ptr(&drow_masks) + (w * (l + 1) * VOCAB.div_ceil(32) * 4) as u64),
                })
                .collect();
            let verdicts = k.verify_rows(g, VOCAB, &verify, masked.then_some(&dmask), &mode).unwrap();
            // Batch invariance: the last window alone gives the same verdict.
            let alone = k.verify_rows(g, VOCAB, &verify[windows - 1..], masked.then_some(&dmask), &mode).unwrap();
            assert_eq!(alone[0], verdicts[windows - 1], "a verdict depends on the batch");
            // Per window: the CPU verdict, and whether a difference from the device's is near a boundary.
            let cpu_windows = par_map(windows, |w| {
                let target: Vec<f32> = (0..=l)
                    .flat_map(|i| target_row(&rows, w * (l + 1) + i, m, own_masks.then_some(&row_masks)))
                    .collect();
                let q_logits: Option<Vec<f32>> =
                    with_q.then(|| (0..l).flat_map(|i| host_row(&rows, q_rows(w) + i, None)).collect());
                let window = VerifyWindow {
                    target_logits: &target,
                    vocab: VOCAB,
                    drafts: &drafts_of[w],
                    draft_logits: q_logits.as_deref(),
                    first_position: first_positions[w],
                };
                let cpu = acceptance::verify(&window, &params[w], &mode).unwrap();
                let got = &verdicts[w];
                let near = cpu.tokens != got.tokens
                    && explain(
                        &target,
                        q_logits.as_deref(),
                        &drafts_of[w],
                        &params[w],
                        first_positions[w],
                        &cpu.tokens,
                        &got.tokens,
                    );
                (cpu, near)
            });
            for (w, (cpu, near)) in cpu_windows.into_iter().enumerate() {
                let got = &verdicts[w];
                if masked {
                    assert!(got.tokens[got.num_accepted..].iter().all(|t| mask.is_allowed(*t)), "masked id emitted");
                }
                if own_masks {
                    let allowed = |(i, t): (usize, &TokenId)| row_masks[w * (l + 1) + i].is_allowed(*t);
                    assert!(got.tokens.iter().enumerate().all(allowed), "an id the row's own mask forbids was emitted");
                }
                accepted_total += got.num_accepted;
                tally.rows += 1;
                if cpu.tokens == got.tokens && cpu.num_accepted == got.num_accepted {
                    tally.identical += 1;
                    assert_eq!(cpu.logprobs.len(), got.logprobs.len());
                    for (a, b) in cpu.logprobs.iter().zip(&got.logprobs) {
                        assert_eq!(a.token, b.token);
                        let ids = |t: &[(TokenId, f32)]| t.iter().map(|x| x.0).collect::<Vec<_>>();
                        assert_eq!(ids(&a.top), ids(&b.top), "top alternatives differ");
                        let pairs = std::iter::once((a.logprob, b.logprob))
                            .chain(a.top.iter().zip(&b.top).map(|(x, y)| (x.1, y.1)));
                        for (x, y) in pairs {
                            if x.is_finite() || y.is_finite() {
                                lp_worst = lp_worst.max((x as f64 - y as f64).abs());
                            }
                        }
                    }
                } else if near {
                    tally.near_boundary += 1;
                } else {
                    tally.unexplained.push(format!(
                        "{base:?} variant {variant} window {w}: drafts {:?}, device {:?}, cpu {:?}",
                        drafts_of[w], got.tokens, cpu.tokens
                    ));
                }
            }
        }
    }
    eprintln!("verify: {accepted_total} drafts accepted in all; worst log-probability difference {lp_worst:.3e}");
    tally.check("verify_rows vs acceptance::verify");
    assert!(lp_worst < 1e-5, "log-probabilities differ by {lp_worst}");
}

#[test]
fn bad_rows_and_parameters_are_errors() {
    let Some(held) = gpu() else { return };
    let Dev { gpu: g, sample: k } = &*held;
    let mut rows = vec![bf16::from_f32(0.5); 2 * VOCAB];
    rows[VOCAB + 77] = bf16::NAN;
    let dev = g.upload(&rows).unwrap();
    let greedy = vec![SamplingParams::greedy(); 2];
    let err = k
        .sample_rows(
            g,
            &LogitsRows { logits: g.ptr(&dev), rows: 2, vocab: VOCAB, params: &greedy },
            &[0, 0],
            0,
            None,
            None,
        )
        .unwrap_err();
    assert_eq!(err.kind(), "invalid_input");
    assert!(err.to_string().contains("77"), "{err}");
    let many = SamplingParams { logprobs: Some(sample::MAX_TOP_N + 1), ..SamplingParams::greedy() };
    assert!(k
        .sample_rows(
            g,
            &LogitsRows { logits: g.ptr(&dev), rows: 1, vocab: VOCAB, params: &[many] },
            &[0],
            0,
            None,
            None
        )
        .is_err());
    assert!(k
        .sample_rows(
            g,
            &LogitsRows { logits: g.ptr(&dev), rows: 2, vocab: VOCAB, params: &greedy[..1] },
            &[0],
            0,
            None,
            None
        )
        .is_err());
    let bad_t = SamplingParams { temperature: f32::NAN, ..SamplingParams::greedy() };
    assert!(k
        .sample_rows(
            g,
            &LogitsRows { logits: g.ptr(&dev), rows: 1, vocab: VOCAB, params: &[bad_t] },
            &[0],
            0,
            None,
            None
        )
        .is_err());
    assert!(DeviceTokenMask::upload(g, &TokenMask::from_fn(VOCAB, |_| false)).is_err());
    let small = DeviceTokenMask::upload(g, &TokenMask::from_fn(10, |_| true)).unwrap();
    assert!(k
        .sample_rows(
            g,
            &LogitsRows { logits: g.ptr(&dev), rows: 1, vocab: VOCAB, params: &greedy[..1] },
            &[0],
            0,
            Some(&small),
            None
        )
        .is_err());
}

/// A measurement, not a check (`-- --ignored --nocapture sampling_step_time`): the sampling launch
/// (descriptor upload, kernel, result download) per step at batch 1 and 64, for four parameter sets; f32
/// draft draws; verify windows.
#[test]
#[ignore = "a measurement: prints µs per sampling step; run with --ignored on a GPU"]
fn sampling_step_time() {
    let Some(held) = gpu() else { return };
    let Dev { gpu: g, sample: k } = &*held;
    let rows = logit_rows(10);
    let dev = g.upload(&rows).unwrap();
    let sets = [
        ("greedy", SamplingParams::greedy()),
        ("t1", SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 1, logprobs: None }),
        ("t0.7 k50 p0.9 lp5", SamplingParams { temperature: 0.7, top_p: 0.9, top_k: 50, seed: 1, logprobs: Some(5) }),
        ("t0.7 p0.9", SamplingParams { temperature: 0.7, top_p: 0.9, top_k: 0, seed: 1, logprobs: None }),
    ];
    for (name, p) in sets {
        for batch in [1usize, 64] {
            let params = vec![p.clone(); batch];
            let positions: Vec<u64> = (0..batch as u64).collect();
            let run = || {
                k.sample_rows(
                    g,
                    &LogitsRows { logits: g.ptr(&dev), rows: batch, vocab: VOCAB, params: &params },
                    &positions,
                    0,
                    None,
                    None,
                )
                .unwrap()
            };
            run();
            let iters = 20;
            let t0 = std::time::Instant::now();
            for _ in 0..iters {
                run();
            }
            let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
            eprintln!("sampling step {name:>18} batch {batch:>2}: {us:8.1} us");
        }
    }
    // f32 draws as the drafter issues them (plan upload, one launch, status download), batch 1 and 8.
    let f32_rows = g.upload(&f32_logit_rows(11)[..8 * VOCAB]).unwrap();
    let probs = g.zeros::<f32>(8 * VOCAB).unwrap();
    let tokens = g.zeros::<u32>(8).unwrap();
    for (name, p) in [
        ("t1", SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 1, logprobs: None }),
        ("t0.7 p0.9", SamplingParams { temperature: 0.7, top_p: 0.9, top_k: 0, seed: 1, logprobs: None }),
    ] {
        for batch in [1usize, 8] {
            let draws: Vec<DeviceDraw> = (0..batch)
                .map(|r| DeviceDraw {
                    logits: g.ptr(&f32_rows) + (r * VOCAB * 4) as u64,
                    probs_out: g.ptr(&probs) + (r * VOCAB * 4) as u64,
                    token_out: g.ptr(&tokens) + (r * 4) as u64,
                    params: &p,
                    position: r as u64,
                })
                .collect();
            let run = || {
                let plan = DrawPlan::new(g, VOCAB, std::slice::from_ref(&draws), DRAFT_STREAM).unwrap();
                plan.launch(g, k, 0).unwrap();
                plan.finish(g).unwrap();
            };
            run();
            let t0 = std::time::Instant::now();
            for _ in 0..20 {
                run();
            }
            let us = t0.elapsed().as_secs_f64() * 1e6 / 20.0;
            eprintln!("f32 draft draw {name:>10} batch {batch}: {us:8.1} us");
        }
    }
    // Verify windows of 3 one-hot drafts (4 logits rows each): 1 window and 16 windows (64 rows).
    let p = SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 1, logprobs: None };
    let drafts: Vec<TokenId> = vec![5, 6, 7];
    for windows in [1usize, 16] {
        let rows: Vec<VerifyRow> = (0..windows)
            .map(|w| VerifyRow {
                logits: g.ptr(&dev) + (w * 4 * VOCAB * 2) as u64,
                drafts: &drafts,
                params: &p,
                first_position: 10,
                q: None,
                token_out: None,
                masks: None,
            })
            .collect();
        let run = || k.verify_rows(g, VOCAB, &rows, None, &AcceptanceMode::Standard).unwrap();
        run();
        let t0 = std::time::Instant::now();
        for _ in 0..20 {
            run();
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / 20.0;
        eprintln!("verify step t1, {windows:>2} windows of 3 drafts: {us:8.1} us");
    }
}

#[test]
fn the_cuda_runner_never_emits_a_masked_id() {
    if !driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine; the CUDA runner's token mask was NOT checked");
        return;
    }
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let mut r = sparkd_kernels::cuda::CudaRunner::new(0, cfg.clone(), &SyntheticWeights::new(cfg.clone(), 11)).unwrap();
    let allowed = |id: TokenId| id % 7 == 3;
    r.set_token_mask(TokenMask::from_fn(cfg.vocab_size, allowed)).unwrap();
    assert!(r.set_token_mask(TokenMask::from_fn(10, |_| true)).is_err());
    for (i, params) in [
        SamplingParams::greedy(),
        SamplingParams { temperature: 1.5, top_p: 1.0, top_k: 0, seed: 4, logprobs: Some(3) },
        SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 20, seed: 5, logprobs: None },
    ]
    .into_iter()
    .enumerate()
    {
        let s = r.alloc_state().unwrap();
        let mut last: TokenId = 1 + i as TokenId;
        for step in 0..12 {
            let out = r
                .step(&[RowInput {
                    state: s,
                    tokens: vec![last, 10, 17],
                    sample: Some(SampleRequest::new(params.clone(), 2)),
                }])
                .unwrap();
            let o = &out[0];
            assert!(o.tokens[o.num_accepted..].iter().all(|t| allowed(*t)), "step {step}: {:?}", o.tokens);
            for lp in &o.logprobs {
                assert!(lp.logprob <= 0.0 && lp.top.iter().all(|(id, _)| allowed(*id)), "{lp:?}");
            }
            last = *o.tokens.last().unwrap();
        }
        r.free_state(s).unwrap();
    }
}
