//! The grouped routed-expert kernels of the latent MoE (`kernels/cuda/moe.cu`, `moe_route.cu`:
//! `MoeKernels::moe_group`, `MoeKernels::moe_gate_up`, `MoeKernels::moe_down`) on a GPU, at the k3-mini expert shapes (latent 3584, expert width 3072)
//! and at a small shape whose rows do not fill a warp's lanes: against an f64 host reference built from
//! `mxfp4::dequant_row` (every E2M1 code; real checkpoints' scales, below 1, and scales up to 2^3, which take the
//! kernels' wide dequantisation), over batches of 1, 3, 8, 16 and 64 tokens
//! with one expert shared by every token, others by a few, and one expert that no token chose; and every token's
//! outputs bit-identical across those batches (a token's arithmetic may not depend on who shares its experts), and
//! across the two forms of the expert kernels (token rows read by each warp, or staged per block).
//! On a machine without a CUDA driver every test says plainly that it skipped.
//!
//! The grouping by expert against a host grouping, with the choices staged in shared memory and read from global,
//! and as both router forms write it for a step of one token.
//!
//! `routed_expert_bandwidth` (ignored by default; `--ignored`) prints the achieved GB/s of the gate/up and down
//! kernels for the bytes of the active experts' MXFP4 weights, at 1, 8 and 64 tokens with the k3-mini routing
//! (64 experts, top 16, real checkpoints' scale bytes), then with K3's (896 experts: k3-mini's repeated, 16 GB).
//! It asserts nothing about speed.

use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::CudaSlice;
use half::bf16;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparkd_kernels::cpu::ops::situ;
use sparkd_kernels::cuda::device::driver_present;
use sparkd_kernels::cuda::expert_layout::{tile_codes, tile_scales};
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::launch::{DPtr, NULL};
use sparkd_kernels::cuda::moe::{
    moe_group_len, CombineArgs, DownArgs, ExpertForm, GateUpArgs, MoeKernels, Pairs, RouteArgs,
};
use sparkd_kernels::mxfp4::dequant_row;
use sparkd_kernels::ModelConfig;

/// The GPU with its MoE kernels.
struct Dev {
    gpu: Gpu,
    moe: MoeKernels,
}

fn gpu() -> Option<std::sync::MutexGuard<'static, Dev>> {
    if !driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine; the routed MoE kernels were NOT checked");
        return None;
    }
    static G: OnceLock<Mutex<Dev>> = OnceLock::new();
    let g = G.get_or_init(|| {
        let gpu = Gpu::new(0).expect("open GPU 0");
        let moe = MoeKernels::load(&gpu).expect("MoE kernels");
        Mutex::new(Dev { gpu, moe })
    });
    Some(g.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A routed batch's shape: `n` tokens each choosing `k` of `experts`, experts of `latent` inputs and outputs and
/// `inter` intermediate rows.
#[derive(Clone, Copy, Debug)]
struct Shape {
    n: usize,
    k: usize,
    experts: usize,
    latent: usize,
    inter: usize,
}

/// One MXFP4 weight tensor of `experts` matrices `[rows, cols]`: on the host as a checkpoint stores it, packed
/// `[experts, rows, cols/2]` and scales `[experts, rows, cols/32]`; on the device each expert tiled as the weight
/// loader uploads it (`expert_layout`).
struct Experts {
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    scales: Vec<u8>,
    dev: (cudarc::driver::CudaSlice<u8>, cudarc::driver::CudaSlice<u8>),
}

impl Experts {
    /// Random codes (all sixteen, -0 included) and scale bytes from `scale_bytes`.
    fn random(
        gpu: &Gpu,
        rng: &mut ChaCha8Rng,
        experts: usize,
        rows: usize,
        cols: usize,
        scale_bytes: (u8, u8),
    ) -> Self {
        let mut packed = vec![0u8; experts * rows * cols / 2];
        rng.fill_bytes(&mut packed);
        let scales: Vec<u8> =
            (0..experts * rows * cols / 32).map(|_| rng.gen_range(scale_bytes.0..=scale_bytes.1)).collect();
        let (pb, sb) = (rows * cols / 2, rows * cols / 32);
        let tiled_codes: Vec<u8> =
            packed.chunks(pb).flat_map(|e| tile_codes(e, rows, cols).unwrap()).collect::<Vec<u8>>();
        let tiled_scales: Vec<u8> =
            scales.chunks(sb).flat_map(|e| tile_scales(e, rows, cols).unwrap()).collect::<Vec<u8>>();
        let dev = (gpu.upload(&tiled_codes).unwrap(), gpu.upload(&tiled_scales).unwrap());
        Experts { rows, cols, packed, scales, dev }
    }

    fn ptrs(&self, gpu: &Gpu) -> (DPtr, DPtr) {
        (gpu.ptr(&self.dev.0), gpu.ptr(&self.dev.1))
    }

    /// Row `r` of expert `e`, dequantised.
    fn row(&self, e: usize, r: usize) -> Vec<f32> {
        let row = e * self.rows + r;
        let (pb, sb) = (self.cols / 2, self.cols / 32);
        let mut out = vec![0.0f32; self.cols];
        dequant_row(&self.packed[row * pb..(row + 1) * pb], &self.scales[row * sb..(row + 1) * sb], &mut out).unwrap();
        out
    }

    /// The MXFP4 bytes of one expert (codes and scales).
    fn expert_bytes(&self) -> usize {
        self.rows * self.cols / 2 + self.rows * self.cols / 32
    }
}

/// One routed-expert run's device buffers: the choices `idx` `[n, k]` (ascending per token) grouped by expert on
/// the device, the inputs `z` `[n, latent]`, and zeroed outputs `act` `[n k, inter]` and `y` `[n k, latent]`.
struct Routed {
    idx: CudaSlice<i32>,
    z: CudaSlice<bf16>,
    group: CudaSlice<i32>,
    pairs: CudaSlice<i32>,
    act: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
}

impl Routed {
    fn new(dev: &Dev, idx: &[i32], z: &[bf16], s: Shape) -> Self {
        let (Dev { gpu, moe }, Shape { n, k, experts, latent, inter }) = (dev, s);
        let routed = Routed {
            idx: gpu.upload(&idx[..n * k]).unwrap(),
            z: gpu.upload(&z[..n * latent]).unwrap(),
            group: gpu.zeros::<i32>(moe_group_len(experts)).unwrap(),
            pairs: gpu.zeros::<i32>(n * k).unwrap(),
            act: gpu.zeros::<bf16>(n * k * inter).unwrap(),
            y: gpu.zeros::<bf16>(n * k * latent).unwrap(),
        };
        moe.moe_group(gpu, gpu.ptr(&routed.idx), &routed.pairs(gpu, s)).unwrap();
        routed
    }

    /// The grouped pairs as the expert kernels take them.
    fn pairs(&self, gpu: &Gpu, s: Shape) -> Pairs {
        Pairs { n: s.n, k: s.k, experts: s.experts, grouping: (gpu.ptr(&self.group), gpu.ptr(&self.pairs)) }
    }
}

/// The routed experts' outputs of `n` tokens (each choosing `k` of `experts`): `act` `[n k, inter]` and `y`
/// `[n k, latent]` (bf16 bits).
fn run(
    dev: &Dev,
    cfg: &ModelConfig,
    w: &[Experts; 3],
    z: &[bf16],
    idx: &[i32],
    (n, k, experts): (usize, usize, usize),
) -> (Vec<u16>, Vec<u16>) {
    let Dev { gpu, moe } = dev;
    let (latent, inter) = (w[0].cols, w[0].rows);
    let s = Shape { n, k, experts, latent, inter };
    let r = Routed::new(dev, idx, z, s);
    let pairs = r.pairs(gpu, s);
    let (beta, lbeta) = (cfg.situ_beta, cfg.situ_linear_beta);
    let (w1, w3, w2) = (w[0].ptrs(gpu), w[1].ptrs(gpu), w[2].ptrs(gpu));
    let (z, act, y) = (gpu.ptr(&r.z), gpu.ptr(&r.act), gpu.ptr(&r.y));
    let (chosen, other) = forms(n, k, experts, latent);
    let gate_up = GateUpArgs { z, w1, w3, a: act, latent, inter, beta, lbeta };
    let down = DownArgs { a: act, w2, y, partial: NULL, latent, inter };
    moe.moe_gate_up(gpu, &pairs, &gate_up, chosen).unwrap();
    moe.moe_down(gpu, &pairs, &down, chosen).unwrap();
    let bits = |v: Vec<bf16>| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
    let act_bits = bits(gpu.download(&r.act, n * k * inter).unwrap());
    let y_bits = bits(gpu.download(&r.y, n * k * latent).unwrap());
    // Both forms give the same bits, whichever the batch takes.
    let act_other = gpu.zeros::<bf16>(n * k * inter).unwrap();
    moe.moe_gate_up(gpu, &pairs, &GateUpArgs { a: gpu.ptr(&act_other), ..gate_up }, other).unwrap();
    let act_other = bits(gpu.download(&act_other, n * k * inter).unwrap());
    assert!(act_other == act_bits, "[{latent}, {inter}] batch {n}: moe_gate_up as {other:?} differs from {chosen:?}");
    let y_other = gpu.zeros::<bf16>(n * k * latent).unwrap();
    moe.moe_down(gpu, &pairs, &DownArgs { y: gpu.ptr(&y_other), ..down }, other).unwrap();
    let y_other = bits(gpu.download(&y_other, n * k * latent).unwrap());
    assert!(y_other == y_bits, "[{latent}, {inter}] batch {n}: moe_down as {other:?} differs from {chosen:?}");
    // The partial epilogue (a rank's share of an expert split by width) writes the same sums unrounded, in both forms.
    for form in [chosen, other] {
        let partial = gpu.zeros::<f32>(n * k * latent).unwrap();
        moe.moe_down(gpu, &pairs, &DownArgs { y: NULL, partial: gpu.ptr(&partial), ..down }, form).unwrap();
        let rounded: Vec<u16> =
            gpu.download(&partial, n * k * latent).unwrap().iter().map(|v| bf16::from_f32(*v).to_bits()).collect();
        assert!(rounded == y_bits, "[{latent}, {inter}] batch {n}: moe_down's partial as {form:?} rounds differently");
    }
    (act_bits, y_bits)
}

/// The form of the expert kernels that the model takes for the batch (`ExpertForm::for_batch`), and the other one.
fn forms(n: usize, k: usize, experts: usize, latent: usize) -> (ExpertForm, ExpertForm) {
    match ExpertForm::for_batch(n, k, experts, latent) {
        ExpertForm::Rows => (ExpertForm::Rows, ExpertForm::Staged),
        ExpertForm::Staged => (ExpertForm::Staged, ExpertForm::Rows),
    }
}

/// `sum_i a[i] b[i]` in f64 and the sum of the magnitudes of its terms.
fn dot(a: &[f32], b: &[f32]) -> (f64, f64) {
    a.iter().zip(b).fold((0.0, 0.0), |(s, m), (x, y)| {
        let p = f64::from(*x) * f64::from(*y);
        (s + p, m + p.abs())
    })
}

fn f(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

/// Token `t` chooses expert 0 (shared by every token) and one of experts 1..=6 (a few tokens each); the last
/// expert is never chosen. Ascending per token, as the router writes them.
fn routing(n: usize) -> Vec<i32> {
    (0..n).flat_map(|t| [0, 1 + (t * 5 % 6) as i32]).collect()
}

/// Scale bytes of real checkpoints (2^-17 .. 2^-1): the kernels' one-multiply dequantisation.
const NARROW_SCALES: (u8, u8) = (110, 126);
/// Scale bytes 118..=130 (2^-9 .. 2^3): some scales exceed 2, which takes the kernels' two-multiply
/// dequantisation (no shortcut may overflow on them).
const WIDE_SCALES: (u8, u8) = (118, 130);

fn check_shape(dev: &Dev, latent: usize, inter: usize, scales: (u8, u8)) {
    let gpu = &dev.gpu;
    let cfg = ModelConfig::preset("k3-mini").unwrap();
    let (experts, k, most) = (8usize, 2usize, 64usize);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let w = [
        Experts::random(gpu, &mut rng, experts, inter, latent, scales),
        Experts::random(gpu, &mut rng, experts, inter, latent, scales),
        Experts::random(gpu, &mut rng, experts, latent, inter, scales),
    ];
    let z: Vec<bf16> = (0..most * latent).map(|_| bf16::from_f32(rng.gen_range(-1.0f32..1.0))).collect();
    let idx = routing(most);

    // Gate/up + SiTU in f64 (the gate and up dots rounded to bf16 as the kernels do).
    let z_f32: Vec<f32> = z.iter().map(|v| v.to_f32()).collect();
    let mut want_act = vec![0.0f64; most * k * inter];
    for e in 0..experts {
        let mine: Vec<usize> = (0..most * k).filter(|&p| idx[p] as usize == e).collect();
        for r in 0..inter {
            let (g_row, u_row) = (w[0].row(e, r), w[1].row(e, r));
            for &p in &mine {
                let zt = &z_f32[(p / k) * latent..(p / k + 1) * latent];
                let g = f64::from(bf16::from_f64(dot(&g_row, zt).0).to_f32());
                let u = f64::from(bf16::from_f64(dot(&u_row, zt).0).to_f32());
                want_act[p * inter + r] = situ(g, u, f64::from(cfg.situ_beta), f64::from(cfg.situ_linear_beta));
            }
        }
    }
    let rms = (want_act.iter().map(|v| v * v).sum::<f64>() / want_act.len() as f64).sqrt();

    let (act, y) = run(dev, &cfg, &w, &z, &idx, (most, k, experts));
    let (mut err2, mut ref2) = (0.0f64, 0.0f64);
    for (i, want) in want_act.iter().enumerate() {
        let got = f64::from(f(act[i]));
        // A bf16 step of the gate or up dot (fp32 summation order differs) moves SiTU by about that much.
        let tol = want.abs() / 32.0 + rms / 64.0;
        assert!(
            (got - want).abs() <= tol,
            "[{latent}, {inter}] act[pair {}, row {}] = {got}, reference {want} (tolerance {tol})",
            i / inter,
            i % inter
        );
        err2 += (got - want).powi(2);
        ref2 += want * want;
    }
    let act_rel = (err2 / ref2).sqrt();
    assert!(act_rel < 1e-2, "[{latent}, {inter}] gate/up relative L2 {act_rel}");

    // Down in f64 over the kernel's own activations.
    let act_f32: Vec<f32> = act.iter().map(|v| f(*v)).collect();
    let mut worst = 0.0f64;
    for e in 0..experts {
        let mine: Vec<usize> = (0..most * k).filter(|&p| idx[p] as usize == e).collect();
        for c in 0..latent {
            let row = w[2].row(e, c);
            for &p in &mine {
                let (want, mag) = dot(&row, &act_f32[p * inter..(p + 1) * inter]);
                let got = f64::from(f(y[p * latent + c]));
                let tol = want.abs() / 128.0 + mag * 1e-5;
                assert!(
                    (got - want).abs() <= tol,
                    "[{latent}, {inter}] y[pair {p}, channel {c}] = {got}, reference {want} \
                     (tolerance {tol})"
                );
                worst = worst.max((got - want).abs() / (want.abs() + mag * 1e-5));
            }
        }
    }
    println!(
        "[latent {latent}, expert {inter}], scale bytes {scales:?}: gate/up relative L2 \
         {act_rel:.3e}; down worst scaled error {worst:.3e}"
    );

    // Batch invariance: each prefix batch gives every token exactly its outputs in the batch of 64.
    for n in [1usize, 3, 8, 16] {
        let (act_n, y_n) = run(dev, &cfg, &w, &z, &idx, (n, k, experts));
        let same = act_n == act[..n * k * inter] && y_n == y[..n * k * latent];
        assert!(same, "[{latent}, {inter}]: a token's outputs in batch {n} differ from batch {most}");
    }
}

#[test]
fn routed_experts_match_the_host_reference_and_are_batch_invariant_bit_for_bit() {
    let Some(dev) = gpu() else { return };
    // k3-mini's expert shapes with real checkpoints' scales, then ones whose rows leave most lanes of a warp without
    // a group and whose K is not a multiple of the tensor-core path's K steps (256 and 512 inputs) or whose rows fill
    // only part of a block, with both scale ranges.
    check_shape(&dev, 3584, 3072, NARROW_SCALES);
    for scales in [NARROW_SCALES, WIDE_SCALES] {
        check_shape(&dev, 96, 160, scales);
        check_shape(&dev, 224, 32, scales);
    }
}

/// Runs the router over `h` `[n, d]` with router weights `w` `[experts, d]` and `bias` `[experts]`, one-launch (when
/// the device and expert count allow it) or two-launch; returns `(idx, weight bits, margin bits)`.
fn route(dev: &Dev, h: &[bf16], w: &[bf16], bias: &[f32], k: usize, two_launches: bool) -> RouterRun {
    let Dev { gpu, moe } = dev;
    let (experts, n) = (bias.len(), h.len() / (w.len() / bias.len()));
    let d = w.len() / experts;
    let (hd, wd, bd) = (gpu.upload(h).unwrap(), gpu.upload(w).unwrap(), gpu.upload(bias).unwrap());
    let idx = gpu.zeros::<i32>(n * k).unwrap();
    let wts = gpu.zeros::<f32>(n * k).unwrap();
    let margin = gpu.zeros::<f32>(n).unwrap();
    let group = gpu.zeros::<i32>(moe_group_len(experts)).unwrap();
    let pairs = gpu.zeros::<i32>(n * k).unwrap();
    let args = RouteArgs {
        h: gpu.ptr(&hd),
        w: gpu.ptr(&wd),
        bias: gpu.ptr(&bd),
        idx: gpu.ptr(&idx),
        wts: gpu.ptr(&wts),
        margin: gpu.ptr(&margin),
        n,
        d,
        experts,
        k,
        renormalize: true,
        scale: 2.5,
        grouping: (gpu.ptr(&group), gpu.ptr(&pairs)),
    };
    let run = if two_launches { MoeKernels::moe_route_in_two_launches } else { MoeKernels::moe_route };
    let grouped = run(moe, gpu, &args).unwrap();
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
    let grouping =
        grouped.then(|| (gpu.download(&group, moe_group_len(experts)).unwrap(), gpu.download(&pairs, n * k).unwrap()));
    RouterRun {
        outputs: (
            gpu.download(&idx, n * k).unwrap(),
            bits(gpu.download(&wts, n * k).unwrap()),
            bits(gpu.download(&margin, n).unwrap()),
        ),
        grouping,
    }
}

/// A router's outputs, `(idx, weight bits, margin bits)`, and the grouping (group, pairs) when it wrote one.
struct RouterRun {
    outputs: (Vec<i32>, Vec<u32>, Vec<u32>),
    grouping: Option<(Vec<i32>, Vec<i32>)>,
}

/// `got` (group, pairs) against the host's grouping of `idx`, over the layout's live entries.
fn assert_grouping(got: &(Vec<i32>, Vec<i32>), idx: &[i32], n: usize, k: usize, experts: usize, what: &str) {
    let (want_group, want_pairs) = host_grouping(idx, n, k, experts);
    let active = want_group[0] as usize;
    // Entries past the active experts are not part of the layout.
    assert_eq!(got.0[0], want_group[0], "{what}: active experts");
    assert_eq!(got.0[1..1 + active], want_group[1..1 + active], "{what}: active experts' ids");
    let bounds = 1 + experts..2 + experts + active;
    assert_eq!(got.0[bounds.clone()], want_group[bounds], "{what}: pair bounds");
    // Slots without an expert (-1) are not grouped: the pairs past the grouped ones are not part of it either.
    assert_eq!(got.1[..want_pairs.len()], want_pairs[..], "{what}: pairs");
}

#[test]
fn the_router_forms_agree_bit_for_bit_and_a_token_routes_alone_as_in_a_batch() {
    let Some(dev) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    // k3-mini's router (64 experts, top 16, hidden 7,168), K3's (896 experts: two launches only) and a small one; 1,
    // 5, 29 and 64 tokens. k3-mini's batches of 29 and 64 tokens and K3's of 5 and more take the forms for batches
    // (several tokens per warp, 29 with a partial last tile); each token is routed alone too, by the one-token forms.
    for (experts, k, d) in [(64usize, 16usize, 7168usize), (896, 16, 7168), (24, 4, 256)] {
        let w: Vec<bf16> = (0..experts * d).map(|_| bf16::from_f32(rng.gen_range(-0.05f32..0.05))).collect();
        let bias: Vec<f32> = (0..experts).map(|_| rng.gen_range(-0.01f32..0.01)).collect();
        for n in [1usize, 5, 29, 64] {
            let h: Vec<bf16> = (0..n * d).map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0))).collect();
            let one = route(&dev, &h, &w, &bias, k, false);
            let two = route(&dev, &h, &w, &bias, k, true);
            let what = format!("{experts} experts, top {k}, {n} tokens");
            assert_eq!(one.outputs, two.outputs, "{what}: the two router forms disagree");
            assert!(one.outputs.0.chunks(k).all(|t| t.windows(2).all(|p| p[0] < p[1])), "experts ascending per token");
            // A step of one token takes its grouping from the router (no moe_group launch): moe_group's layout.
            assert_eq!(one.grouping.is_some(), n == 1, "{what}: the one-launch router's grouping");
            assert_eq!(two.grouping.is_some(), n == 1, "{what}: the two-launch router's grouping");
            for grouping in [&one.grouping, &two.grouping].into_iter().flatten() {
                assert_grouping(grouping, &one.outputs.0, n, k, experts, &what);
            }
            for t in 0..n {
                let alone = route(&dev, &h[t * d..(t + 1) * d], &w, &bias, k, false).outputs;
                let in_batch = (
                    one.outputs.0[t * k..(t + 1) * k].to_vec(),
                    one.outputs.1[t * k..(t + 1) * k].to_vec(),
                    one.outputs.2[t..t + 1].to_vec(),
                );
                assert_eq!(alone, in_batch, "{what}: token {t} alone");
            }
        }
    }
}

/// The grouping a host computes: the active experts ascending, where each one's pairs start, and the pairs
/// `t k + j` grouped by expert with tokens ascending (`moe_group`'s layout).
fn host_grouping(idx: &[i32], n: usize, k: usize, experts: usize) -> (Vec<i32>, Vec<i32>) {
    let mut group = vec![0i32; moe_group_len(experts)];
    let mut pairs = Vec::with_capacity(n * k);
    let mut active = 0;
    for e in 0..experts as i32 {
        let start = pairs.len() as i32;
        pairs.extend((0..n * k).filter(|p| idx[*p] == e).map(|p| p as i32));
        if pairs.len() as i32 > start {
            group[1 + active] = e;
            group[1 + experts + active] = start;
            active += 1;
        }
    }
    group[0] = active as i32;
    group[1 + experts + active] = pairs.len() as i32;
    (group, pairs)
}

#[test]
fn grouping_matches_the_host_in_one_token_window_and_in_several() {
    let Some(dev) = gpu() else { return };
    let Dev { gpu, moe } = &*dev;
    let k = 16usize;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    // k3-mini's 64 experts hold 6,080 tokens' masks in one window, K3's 896 experts 352: 7,000 and 800 tokens take
    // several windows. Some tokens leave slots without an expert (-1, sorted first), which are not grouped.
    for (experts, n) in [(64usize, 1usize), (64, 3), (64, 64), (64, 7000), (896, 64), (896, 800)] {
        let idx: Vec<i32> = (0..n)
            .flat_map(|t| {
                let mut mine: Vec<i32> = (0..t % 5 / 4).map(|_| -1).collect();
                while mine.len() < k {
                    let e = rng.gen_range(0..experts as i32);
                    if !mine.contains(&e) {
                        mine.push(e);
                    }
                }
                mine.sort_unstable();
                mine
            })
            .collect();
        let idx_d = gpu.upload(&idx).unwrap();
        let group = gpu.zeros::<i32>(moe_group_len(experts)).unwrap();
        let pairs = gpu.zeros::<i32>(n * k).unwrap();
        let grouped = Pairs { n, k, experts, grouping: (gpu.ptr(&group), gpu.ptr(&pairs)) };
        moe.moe_group(gpu, gpu.ptr(&idx_d), &grouped).unwrap();
        let got = (gpu.download(&group, moe_group_len(experts)).unwrap(), gpu.download(&pairs, n * k).unwrap());
        assert_grouping(&got, &idx, n, k, experts, &format!("{n} tokens over {experts} experts"));
    }
}

#[test]
fn routed_experts_reject_widths_that_are_not_multiples_of_32() {
    let Some(dev) = gpu() else { return };
    let Dev { gpu, moe } = &*dev;
    let cfg = ModelConfig::preset("k3-mini").unwrap();
    let buf = gpu.zeros::<u8>(4096).unwrap();
    let p = gpu.ptr(&buf);
    let (b, lb) = (cfg.situ_beta, cfg.situ_linear_beta);
    for form in [ExpertForm::Rows, ExpertForm::Staged] {
        let pairs = Pairs { n: 1, k: 1, experts: 1, grouping: (p, p) };
        let gate_up = GateUpArgs { z: p, w1: (p, p), w3: (p, p), a: p, latent: 40, inter: 64, beta: b, lbeta: lb };
        assert!(moe.moe_gate_up(gpu, &pairs, &gate_up, form).is_err());
        assert!(moe
            .moe_down(gpu, &pairs, &DownArgs { a: p, w2: (p, p), y: p, partial: NULL, latent: 64, inter: 40 }, form)
            .is_err());
    }
    // The staged down projection needs whole pairs of 16-row tiles.
    let pairs = Pairs { n: 1, k: 1, experts: 1, grouping: (p, p) };
    let down = DownArgs { a: p, w2: (p, p), y: p, partial: NULL, latent: 48, inter: 64 };
    assert!(moe.moe_down(gpu, &pairs, &down, ExpertForm::Staged).is_err());
}

/// The combine and routed norm of `n` tokens, `(combined, out)`, in f64 from the bf16 inputs: combined[c] =
/// bf(sum_j wts[j] y[j, c]), out[c] = bf(w[c] * bf(combined[c] / rms(combined))).
fn host_combine_norm(y: &[f32], wts: &[f32], w: &[f32], n: usize, k: usize, d: usize, eps: f64) -> Vec<f64> {
    let mut out = vec![0.0f64; n * d];
    for t in 0..n {
        let combined: Vec<f64> = (0..d)
            .map(|c| {
                let sum: f64 = (0..k).map(|j| f64::from(wts[t * k + j]) * f64::from(y[(t * k + j) * d + c])).sum();
                f64::from(bf16::from_f64(sum).to_f32())
            })
            .collect();
        let r = 1.0 / (combined.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
        for c in 0..d {
            let normed = f64::from(bf16::from_f64(combined[c] * r).to_f32());
            out[t * d + c] = f64::from(w[c]) * normed;
        }
    }
    out
}

#[test]
fn the_combine_and_routed_norm_match_the_host_in_both_forms_and_are_batch_invariant() {
    let Some(dev) = gpu() else { return };
    let Dev { gpu, moe } = &*dev;
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    // k3-mini's latent width and top-k, then widths that leave cluster blocks a ragged or an empty window.
    for (d, k) in [(3584usize, 16usize), (100, 4), (5, 3)] {
        let most = 64;
        let y: Vec<bf16> = (0..most * k * d).map(|_| bf16::from_f32(rng.gen_range(-2.0f32..2.0))).collect();
        let wts: Vec<f32> = (0..most * k).map(|_| rng.gen_range(0.0f32..0.3)).collect();
        let w: Vec<bf16> = (0..d).map(|_| bf16::from_f32(rng.gen_range(0.5f32..1.5))).collect();
        let f32s = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let want = host_combine_norm(&f32s(&y), &wts, &f32s(&w), most, k, d, 1e-5);
        let (yd, wd, nd) = (gpu.upload(&y).unwrap(), gpu.upload(&wts).unwrap(), gpu.upload(&w).unwrap());
        for split in moe.row_splits() {
            let run = |n: usize| {
                let out = gpu.zeros::<bf16>(n * d).unwrap();
                let (y, wts, norm_w, out_at) = (gpu.ptr(&yd), gpu.ptr(&wd), gpu.ptr(&nd), gpu.ptr(&out));
                let combine = CombineArgs { y, wts, norm_w, out: out_at, n, k, latent: d, eps: 1e-5 };
                moe.moe_combine_norm_as(gpu, split, &combine).unwrap();
                gpu.download(&out, n * d).unwrap()
            };
            let got = run(most);
            for (i, (g, want)) in got.iter().zip(&want).enumerate() {
                // One bf16 step (up to 2^-7 relative) of the combined value, the normalised value and the output.
                let tol = want.abs() * 3.0 / 128.0 + 1e-6;
                let g = f64::from(g.to_f32());
                assert!((g - want).abs() <= tol, "{split:?} [d {d}, k {k}] out[{i}] = {g}, reference {want}");
            }
            for n in [1usize, 3, 8] {
                assert!(run(n) == got[..n * d], "{split:?} [d {d}, k {k}]: batch {n} differs from batch {most}");
            }
        }
    }
}

/// One expert weight tensor (w1, w3 or w2) as the timing below needs it: its device (codes, scales) and the MXFP4
/// bytes of one expert.
struct TimedWeights {
    ptrs: (DPtr, DPtr),
    expert_bytes: usize,
}

/// Times the grouped expert kernels for `n` tokens each choosing `k` distinct experts of `experts` at random, and
/// prints the achieved GB/s of the active experts' bytes.
fn time_routing(dev: &Dev, w: &[TimedWeights; 3], s: Shape, (beta, lbeta): (f32, f32), rng: &mut ChaCha8Rng) {
    let (Dev { gpu, moe }, Shape { n, k, experts, latent, inter }) = (dev, s);
    // k distinct experts per token, ascending.
    let idx: Vec<i32> = (0..n)
        .flat_map(|_| {
            let mut all: Vec<i32> = (0..experts as i32).collect();
            for i in 0..k {
                let j = rng.gen_range(i..experts);
                all.swap(i, j);
            }
            let mut mine = all[..k].to_vec();
            mine.sort_unstable();
            mine
        })
        .collect();
    let mut used = idx.clone();
    used.sort_unstable();
    used.dedup();
    let active = used.len();
    let r = Routed::new(dev, &idx, &vec![bf16::from_f32(0.5); n * latent], s);
    let pairs = r.pairs(gpu, s);
    let (w1, w3, w2) = (w[0].ptrs, w[1].ptrs, w[2].ptrs);
    let (z, act, y) = (gpu.ptr(&r.z), gpu.ptr(&r.act), gpu.ptr(&r.y));
    let (chosen, other) = forms(n, k, experts, latent);
    let gate_up_args = GateUpArgs { z, w1, w3, a: act, latent, inter, beta, lbeta };
    let down_args = DownArgs { a: act, w2, y, partial: NULL, latent, inter };
    let gate_up = |form| moe.moe_gate_up(gpu, &pairs, &gate_up_args, form);
    let down = |form| moe.moe_down(gpu, &pairs, &down_args, form);
    let iters = 50;
    let time = |op: &dyn Fn()| {
        op();
        gpu.synchronize().unwrap();
        let t0 = Instant::now();
        for _ in 0..iters {
            op();
        }
        gpu.synchronize().unwrap();
        t0.elapsed().as_secs_f64() / f64::from(iters)
    };
    let (t_gu, t_down) = (time(&|| gate_up(chosen).unwrap()), time(&|| down(chosen).unwrap()));
    let (t_gu_other, t_down_other) = (time(&|| gate_up(other).unwrap()), time(&|| down(other).unwrap()));
    let gu_bytes = (active * (w[0].expert_bytes + w[1].expert_bytes)) as f64;
    let down_bytes = (active * w[2].expert_bytes) as f64;
    println!(
        "batch {n:>2} ({active} active experts of {experts}): gate/up {:.1} us, {:.0} GB/s; \
         down {:.1} us, {:.0} GB/s; both {:.1} us, {:.0} GB/s",
        t_gu * 1e6,
        gu_bytes / t_gu / 1e9,
        t_down * 1e6,
        down_bytes / t_down / 1e9,
        (t_gu + t_down) * 1e6,
        (gu_bytes + down_bytes) / (t_gu + t_down) / 1e9
    );
    println!(
        "    as {chosen:?} (taken): gate/up {:.1} us, down {:.1} us; as {other:?}: gate/up {:.1} us, down {:.1} us",
        t_gu * 1e6,
        t_down * 1e6,
        t_gu_other * 1e6,
        t_down_other * 1e6
    );
}

/// `experts` experts' weights on the device in the tiled layout, made of `w`'s random experts repeated (a timing
/// needs every byte read, not distinct values): (codes, scales).
fn repeated_on_device(gpu: &Gpu, w: &Experts, experts: usize) -> (CudaSlice<u8>, CudaSlice<u8>) {
    let (pb, sb) = (w.rows * w.cols / 2, w.rows * w.cols / 32);
    let distinct = w.packed.len() / pb;
    let codes: Vec<u8> = w.packed.chunks(pb).flat_map(|e| tile_codes(e, w.rows, w.cols).unwrap()).collect();
    let scales: Vec<u8> = w.scales.chunks(sb).flat_map(|e| tile_scales(e, w.rows, w.cols).unwrap()).collect();
    let (code_bytes, scale_bytes) = (codes.len() / distinct, scales.len() / distinct);
    let dev = (gpu.uninit::<u8>(experts * code_bytes).unwrap(), gpu.uninit::<u8>(experts * scale_bytes).unwrap());
    for e0 in (0..experts).step_by(distinct) {
        let count = distinct.min(experts - e0);
        gpu.upload_bytes_at(gpu.ptr(&dev.0) + (e0 * code_bytes) as u64, &codes[..count * code_bytes]).unwrap();
        gpu.upload_bytes_at(gpu.ptr(&dev.1) + (e0 * scale_bytes) as u64, &scales[..count * scale_bytes]).unwrap();
    }
    dev
}

#[test]
#[ignore = "prints GB/s of the routed expert kernels on the k3-mini shapes; asserts nothing about speed"]
fn routed_expert_bandwidth() {
    let Some(dev) = gpu() else { return };
    let Dev { gpu, .. } = &*dev;
    let cfg = ModelConfig::preset("k3-mini").unwrap();
    let (experts, k) = (cfg.moe.num_experts, cfg.moe.top_k);
    let (latent, inter) = (cfg.moe.latent_dim, cfg.moe.expert_dim);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let w = [
        Experts::random(gpu, &mut rng, experts, inter, latent, NARROW_SCALES),
        Experts::random(gpu, &mut rng, experts, inter, latent, NARROW_SCALES),
        Experts::random(gpu, &mut rng, experts, latent, inter, NARROW_SCALES),
    ];
    let situ = (cfg.situ_beta, cfg.situ_linear_beta);
    let timed = |x: &Experts, ptrs: (DPtr, DPtr)| TimedWeights { ptrs, expert_bytes: x.expert_bytes() };
    let mini = [timed(&w[0], w[0].ptrs(gpu)), timed(&w[1], w[1].ptrs(gpu)), timed(&w[2], w[2].ptrs(gpu))];
    for n in [1usize, 8, 64] {
        time_routing(&dev, &mini, Shape { n, k, experts, latent, inter }, situ, &mut rng);
    }
    // K3's routing (top 16 of 896 experts) spreads a batch over many more experts: about 1.1 tokens per active
    // expert at 8 and 1.7 at 64 tokens, against k3-mini's 2.2 and 16. The same shapes, k3-mini's experts repeated.
    let k3 = ModelConfig::preset("k3").unwrap();
    let k3_experts = k3.moe.num_experts;
    let repeated: Vec<_> = w.iter().map(|x| repeated_on_device(gpu, x, k3_experts)).collect();
    let wide = [0, 1, 2].map(|i| timed(&w[i], (gpu.ptr(&repeated[i].0), gpu.ptr(&repeated[i].1))));
    for n in [1usize, 8, 64] {
        let s = Shape { n, k: k3.moe.top_k, experts: k3_experts, latent, inter };
        time_routing(&dev, &wide, s, situ, &mut rng);
    }
}
