//! The batch-invariant GEMM on a GPU: the skinny mma.sync kernels (`kernels/cuda/gemm.cu`) and, on Hopper, the
//! warpgroup-MMA kernels (`kernels/cuda/gemm_tc.cu`) that `GemmKernels::linear` takes there. Each against a host reference
//! over token counts 1..512 and shapes that are not multiples of its tiles, with bit-exact batch invariance (a
//! token's outputs do not change with what else is in the call, nor with the token chunk the call runs); the
//! segment-major output of merged projections, a tall weight over many token chunks, every launch layout of a K
//! split giving the same bits (split or serial blocks; for gemm.cu also 4 or 8 warps per block and one or two row
//! tiles per warp), the add epilogue (`GemmKernels::linear_add`, bit-identical to `linear` then `add`), and the rejection
//! of bad arguments. On a machine without a CUDA driver every test says plainly that it skipped, and the
//! warpgroup-MMA tests say so on a GPU that is not Hopper.
//!
//! `gemm_bandwidth` (ignored by default; `--ignored`) prints the achieved GB/s of the skinny GEMM at each K split
//! and block size, of the warpgroup-MMA GEMM at each K split (Hopper) and of cuBLAS for the k3-mini shapes at 1,
//! 8, 16, 32 and 64 tokens. It asserts nothing about speed.

use std::sync::{Mutex, OnceLock};

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sparkd_kernels::cuda::device::driver_present;
use sparkd_kernels::cuda::gemm::{skinny_split, tc_split, GemmKernels, LinearArgs, PartsArgs, SkinnyLayout};
use sparkd_kernels::cuda::gpu::{Gemm, Gpu};
use sparkd_kernels::cuda::launch::{DPtr, NULL};
use sparkd_kernels::cuda::rows::RowKernels;
use sparkd_kernels::ModelConfig;

/// The GPU with its GEMM kernels (and the row kernels, for the add the epilogue is checked against).
struct Dev {
    gpu: Gpu,
    gemm: GemmKernels,
    rows: RowKernels,
}

fn gpu() -> Option<std::sync::MutexGuard<'static, Dev>> {
    if !driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine; the skinny GEMM was NOT checked");
        return None;
    }
    static G: OnceLock<Mutex<Dev>> = OnceLock::new();
    let g = G.get_or_init(|| {
        let gpu = Gpu::new(0).expect("open GPU 0");
        let (gemm, rows) = (GemmKernels::load(&gpu).expect("GEMM kernels"), RowKernels::load(&gpu).expect("rows"));
        Mutex::new(Dev { gpu, gemm, rows })
    });
    Some(g.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The GEMM of `w` `[out_dim, in_dim]` on `x` `[n, in_dim]` into `y` `[n, out_dim]`.
fn args(w: DPtr, out_dim: usize, in_dim: usize, x: DPtr, n: usize, y: DPtr) -> LinearArgs {
    LinearArgs { w, out_dim, in_dim, x, n, y }
}

fn random_bf16(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(rng.gen_range(-scale..scale))).collect()
}

/// `[n, out]` outputs of the GEMM (bf16 bits), run with `split`.
fn run(dev: &Dev, w: &[bf16], out_dim: usize, x: &[bf16], n: usize, split: usize) -> Vec<u16> {
    let Dev { gpu, gemm, .. } = dev;
    let k = w.len() / out_dim;
    let (wd, xd) = (gpu.upload(w).unwrap(), gpu.upload(&x[..n * k]).unwrap());
    let y = gpu.zeros::<bf16>(n * out_dim).unwrap();
    gemm.linear_skinny(gpu, &args(gpu.ptr(&wd), out_dim, k, gpu.ptr(&xd), n, gpu.ptr(&y)), None, split).unwrap();
    gpu.download(&y, n * out_dim).unwrap().iter().map(|v| v.to_bits()).collect()
}

/// `[tokens, out]` products of `x` and `w` in f64, each with the magnitude sum that bounds fp32 summation error.
fn host_reference(w: &[bf16], x: &[bf16], out_dim: usize, tokens: usize) -> Vec<(f64, f64)> {
    let in_dim = w.len() / out_dim;
    (0..tokens)
        .flat_map(|m| (0..out_dim).map(move |o| (m, o)))
        .map(|(m, o)| {
            (0..in_dim).fold((0.0, 0.0), |(sum, mag), c| {
                let p = f64::from(w[o * in_dim + c].to_f32()) * f64::from(x[m * in_dim + c].to_f32());
                (sum + p, mag + p.abs())
            })
        })
        .collect()
}

#[test]
fn skinny_gemm_matches_the_host_reference_and_is_batch_invariant_bit_for_bit() {
    let Some(dev) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    // (out, in): not multiples of the 16- or 32-row warp tile, the 256-wide K chunk or 8 (the scalar-load path).
    for (out_dim, in_dim) in [(1000, 1000), (77, 999), (300, 1536), (40, 8), (5, 3)] {
        let w = random_bf16(&mut rng, out_dim * in_dim, 1.0);
        let x = random_bf16(&mut rng, 512 * in_dim, 2.0);
        let mut splits = vec![1, 2, 3, 4, 8];
        if !splits.contains(&skinny_split(out_dim, in_dim)) {
            splits.push(skinny_split(out_dim, in_dim));
        }
        let reference = host_reference(&w, &x, out_dim, 512);
        for split in splits {
            let full = run(&dev, &w, out_dim, &x, 512, split);
            for (i, (exact, mag)) in reference.iter().enumerate() {
                let got = f64::from(bf16::from_bits(full[i]).to_f32());
                // One bf16 rounding of the result plus fp32 summation error.
                let tol = exact.abs() / 128.0 + mag * 1e-6;
                assert!(
                    (got - exact).abs() <= tol,
                    "[{out_dim}, {in_dim}] split {split}: y[{}, {}] = {got}, reference {exact} (tolerance {tol})",
                    i / out_dim,
                    i % out_dim
                );
            }
            for n in [1usize, 2, 3, 8, 17, 64, 100] {
                let part = run(&dev, &w, out_dim, &x, n, split);
                assert!(
                    part == full[..n * out_dim],
                    "[{out_dim}, {in_dim}] split {split}: the first {n} tokens alone differ from the same tokens \
                     in a call of 512"
                );
            }
            // A token's outputs do not depend on its neighbours either: token 5 alone vs in the batch.
            let alone = run(&dev, &w, out_dim, &x[5 * in_dim..], 1, split);
            assert!(alone == full[5 * out_dim..6 * out_dim], "[{out_dim}, {in_dim}] split {split}: token 5 alone");
        }
    }
}

#[test]
fn a_tall_weight_over_many_token_chunks_stays_exact_and_batch_invariant() {
    // 9,000 rows: 71 row tiles of 128 per slice, 283 blocks per token chunk at split 4, and 512 tokens are
    // 8 chunks, so blocks of later waves and later chunks are checked too.
    let Some(dev) = gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let (out_dim, in_dim) = (9000, 1100);
    let w = random_bf16(&mut rng, out_dim * in_dim, 1.0);
    let x = random_bf16(&mut rng, 512 * in_dim, 2.0);
    // (token, row, f64 value, magnitude sum) for a few tokens of the first, second and last chunk.
    let reference: Vec<(usize, usize, f64, f64)> = [0usize, 63, 64, 300, 511]
        .iter()
        .flat_map(|&m| (0..out_dim).map(move |o| (m, o)))
        .map(|(m, o)| {
            let (exact, mag) = (0..in_dim).fold((0.0, 0.0), |(sum, mag), c| {
                let p = f64::from(w[o * in_dim + c].to_f32()) * f64::from(x[m * in_dim + c].to_f32());
                (sum + p, mag + p.abs())
            });
            (m, o, exact, mag)
        })
        .collect();
    for split in [1, 2, 4, 8] {
        let full = run(&dev, &w, out_dim, &x, 512, split);
        for &(m, o, exact, mag) in &reference {
            let got = f64::from(bf16::from_bits(full[m * out_dim + o]).to_f32());
            let tol = exact.abs() / 128.0 + mag * 1e-6;
            assert!((got - exact).abs() <= tol, "split {split}: y[{m}, {o}] = {got}, reference {exact}");
        }
        for n in [1usize, 8, 33, 64, 100] {
            let part = run(&dev, &w, out_dim, &x, n, split);
            assert!(part == full[..n * out_dim], "split {split}: the first {n} tokens differ from a call of 512");
        }
    }
}

/// `[n, out]` outputs (bf16 bits) of the warpgroup-MMA GEMM with `split` slices, serially in one block per row tile
/// or as clusters of slices; the tokens are `tokens` of `x`.
fn run_tc(
    dev: &Dev,
    w: &[bf16],
    out_dim: usize,
    x: &[bf16],
    tokens: std::ops::Range<usize>,
    split: usize,
    serial: bool,
) -> Vec<u16> {
    let Dev { gpu, gemm, .. } = dev;
    let (first, n) = (tokens.start, tokens.len());
    let k = w.len() / out_dim;
    let (wd, xd) = (gpu.upload(w).unwrap(), gpu.upload(&x[first * k..(first + n) * k]).unwrap());
    let y = gpu.zeros::<bf16>(n * out_dim).unwrap();
    gemm.linear_tc(gpu, &args(gpu.ptr(&wd), out_dim, k, gpu.ptr(&xd), n, gpu.ptr(&y)), split, serial).unwrap();
    gpu.download(&y, n * out_dim).unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Whether the device runs the warpgroup-MMA GEMM (Hopper), saying so when it does not.
fn has_tc(gpu: &Gpu, gemm: &GemmKernels) -> bool {
    let probe = gpu.zeros::<bf16>(64).unwrap();
    let takes = gemm.tc_gemm_takes(gpu.ptr(&probe), gpu.ptr(&probe), 64);
    if !takes {
        eprintln!("SKIPPED: not a Hopper GPU; the warpgroup-MMA GEMM was NOT checked");
    }
    takes
}

#[test]
fn tc_gemm_matches_the_host_reference_and_is_batch_invariant_bit_for_bit() {
    // Calls of 1 to 512 tokens run chunks of 8, 16, 32 and 64 tokens (wgmma n8 to n64): a token's bits must not
    // depend on which, nor on serial blocks or clusters of slices (2 to 8, 6 for [2000, 4104] at split 8), nor on
    // its neighbours.
    let Some(dev) = gpu() else { return };
    let Dev { gpu, gemm, .. } = &*dev;
    if !has_tc(gpu, gemm) {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    // (out, in): rows not a multiple of the 128-row block, K not a multiple of the 64-column stage or of a slice.
    for (out_dim, in_dim) in [(1000, 1000), (77, 1048), (300, 1536), (40, 8), (2000, 4104)] {
        let w = random_bf16(&mut rng, out_dim * in_dim, 1.0);
        let x = random_bf16(&mut rng, 512 * in_dim, 2.0);
        let reference = host_reference(&w, &x, out_dim, 512);
        let mut splits = vec![1, 2, 3, 4, 8];
        if !splits.contains(&tc_split(out_dim, in_dim)) {
            splits.push(tc_split(out_dim, in_dim));
        }
        for split in splits {
            let full = run_tc(&dev, &w, out_dim, &x, 0..512, split, false);
            for (i, (exact, mag)) in reference.iter().enumerate() {
                let got = f64::from(bf16::from_bits(full[i]).to_f32());
                let tol = exact.abs() / 128.0 + mag * 1e-6;
                assert!(
                    (got - exact).abs() <= tol,
                    "[{out_dim}, {in_dim}] split {split}: y[{}, {}] = {got}, reference {exact} (tolerance {tol})",
                    i / out_dim,
                    i % out_dim
                );
            }
            let serial = run_tc(&dev, &w, out_dim, &x, 0..512, split, true);
            assert!(serial == full, "[{out_dim}, {in_dim}] split {split}: serial blocks differ from split blocks");
            for n in [1usize, 2, 3, 8, 9, 16, 17, 32, 33, 64, 65, 100] {
                for serial in [false, true] {
                    let part = run_tc(&dev, &w, out_dim, &x, 0..n, split, serial);
                    assert!(
                        part == full[..n * out_dim],
                        "[{out_dim}, {in_dim}] split {split}: the first {n} tokens alone (serial {serial}) differ \
                         from the same tokens in a call of 512"
                    );
                }
            }
            let alone = run_tc(&dev, &w, out_dim, &x, 5..6, split, false);
            assert!(alone == full[5 * out_dim..6 * out_dim], "[{out_dim}, {in_dim}] split {split}: token 5 alone");
        }
        // The routed GEMM is this one at the shape's split.
        let (wd, xd) = (gpu.upload(&w).unwrap(), gpu.upload(&x[..17 * in_dim]).unwrap());
        let y = gpu.zeros::<bf16>(17 * out_dim).unwrap();
        gemm.linear(gpu, &args(gpu.ptr(&wd), out_dim, in_dim, gpu.ptr(&xd), 17, gpu.ptr(&y))).unwrap();
        let routed: Vec<u16> = gpu.download(&y, 17 * out_dim).unwrap().iter().map(|v| v.to_bits()).collect();
        let want = run_tc(&dev, &w, out_dim, &x, 0..17, tc_split(out_dim, in_dim), false);
        assert!(
            routed == want,
            "[{out_dim}, {in_dim}]: GemmKernels::linear is not the warpgroup-MMA GEMM at its split"
        );
    }
}

#[test]
fn tc_gemm_rejects_bad_arguments() {
    let Some(dev) = gpu() else { return };
    let Dev { gpu, gemm, .. } = &*dev;
    let w = gpu.zeros::<bf16>(64 * 64).unwrap();
    let y = gpu.zeros::<bf16>(64).unwrap();
    if has_tc(gpu, gemm) {
        for split in [0, 9] {
            let err =
                gemm.linear_tc(gpu, &args(gpu.ptr(&w), 64, 64, gpu.ptr(&w), 1, gpu.ptr(&y)), split, false).unwrap_err();
            assert_eq!(err.kind(), "invalid_input", "{err}");
            assert!(err.to_string().contains(&format!("split {split}")), "{err}");
        }
    }
    // Rows that are not 16-byte aligned (K = 60) cannot be read by tensor map, on any device.
    let err = gemm.linear_tc(gpu, &args(gpu.ptr(&w), 64, 60, gpu.ptr(&w), 1, gpu.ptr(&y)), 1, false).unwrap_err();
    assert!(err.to_string().contains("16-byte aligned rows (in_dim 60)"), "{err}");
}

#[test]
fn every_layout_of_a_k_split_gives_the_same_bits() {
    // The split fixes the summation order; one block per slice (partials folded by the tile's last block)
    // and one block running every slice, at 4 or 8 warps per block, with one or (above 16 tokens) two row
    // tiles per warp, must agree bit for bit.
    let Some(dev) = gpu() else { return };
    let Dev { gpu, gemm, .. } = &*dev;
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for (out_dim, in_dim) in [(3000, 2304), (129, 1000), (1000, 4100)] {
        let w = gpu.upload(&random_bf16(&mut rng, out_dim * in_dim, 1.0)).unwrap();
        let x = gpu.upload(&random_bf16(&mut rng, 200 * in_dim, 2.0)).unwrap();
        for split in [2, 5, 9] {
            for n in [1usize, 8, 40, 64, 200] {
                let mut first: Option<Vec<u16>> = None;
                let mut layouts = vec![(4, false, false), (8, false, false), (4, true, false), (8, true, false)];
                if n > 16 {
                    layouts.extend([(4, false, true), (8, false, true)]);
                }
                for (warps, serial, wide) in layouts {
                    let y = gpu.upload(&random_bf16(&mut rng, n * out_dim, 1.0)).unwrap();
                    let layout = SkinnyLayout { split, warps, serial, wide };
                    gemm.linear_skinny_layout(
                        gpu,
                        &args(gpu.ptr(&w), out_dim, in_dim, gpu.ptr(&x), n, gpu.ptr(&y)),
                        layout,
                    )
                    .unwrap();
                    let bits: Vec<u16> = gpu.download(&y, n * out_dim).unwrap().iter().map(|v| v.to_bits()).collect();
                    match &first {
                        None => first = Some(bits),
                        Some(want) => assert!(
                            &bits == want,
                            "[{out_dim}, {in_dim}] split {split}, {n} tokens: {layout:?} differs from 4 warps split"
                        ),
                    }
                }
            }
        }
    }
}

#[test]
fn linear_add_equals_linear_then_add_bit_for_bit() {
    let Some(mut dev) = gpu() else { return };
    let Dev { gpu, gemm, rows } = &mut *dev;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (out_dim, in_dim) in [(1000, 1000), (77, 999), (4096, 2048)] {
        let w = random_bf16(&mut rng, out_dim * in_dim, 1.0);
        let wd = gpu.upload(&w).unwrap();
        for n in [1usize, 3, 17, 64, 100] {
            let x = gpu.upload(&random_bf16(&mut rng, n * in_dim, 1.0)).unwrap();
            let addend_host = random_bf16(&mut rng, n * out_dim, 30.0);
            for choice in [Gemm::BatchInvariant, Gemm::Cublas] {
                gpu.gemm = choice;
                let addend = gpu.upload(&addend_host).unwrap();
                let expected = gpu.zeros::<bf16>(n * out_dim).unwrap();
                gemm.linear(gpu, &args(gpu.ptr(&wd), out_dim, in_dim, gpu.ptr(&x), n, gpu.ptr(&expected))).unwrap();
                rows.add(gpu, gpu.ptr(&expected), gpu.ptr(&addend), n * out_dim).unwrap();
                let expected = gpu.download(&expected, n * out_dim).unwrap();
                // Into a separate output, then in place (the addend is the output).
                let y = gpu.upload(&random_bf16(&mut rng, n * out_dim, 1.0)).unwrap();
                gemm.linear_add(
                    gpu,
                    &args(gpu.ptr(&wd), out_dim, in_dim, gpu.ptr(&x), n, gpu.ptr(&y)),
                    gpu.ptr(&addend),
                )
                .unwrap();
                let separate = gpu.download(&y, n * out_dim).unwrap();
                gemm.linear_add(
                    gpu,
                    &args(gpu.ptr(&wd), out_dim, in_dim, gpu.ptr(&x), n, gpu.ptr(&addend)),
                    gpu.ptr(&addend),
                )
                .unwrap();
                let in_place = gpu.download(&addend, n * out_dim).unwrap();
                let bits = |v: &[bf16]| v.iter().map(|e| e.to_bits()).collect::<Vec<_>>();
                assert!(bits(&separate) == bits(&expected), "{choice:?} [{out_dim}, {in_dim}] n {n}: linear_add");
                assert!(bits(&in_place) == bits(&expected), "{choice:?} [{out_dim}, {in_dim}] n {n}: in place");
                assert!(
                    expected.iter().zip(&addend_host).filter(|(e, a)| e != a).count() > n * out_dim / 2,
                    "{choice:?}: the product barely changed the addend, so the check proves little"
                );
            }
        }
    }
    gpu.gemm = Gemm::BatchInvariant;
}

#[test]
fn linear_partial_writes_the_sums_that_linear_rounds() {
    let Some(mut dev) = gpu() else { return };
    let Dev { gpu, gemm, .. } = &mut *dev;
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    // Aligned shapes take the warpgroup-MMA GEMM on Hopper (split and serial), 999 columns the skinny one.
    for (out_dim, in_dim) in [(1000, 1000), (77, 999), (4096, 2048), (256, 7168)] {
        let wd = gpu.upload(&random_bf16(&mut rng, out_dim * in_dim, 1.0)).unwrap();
        for n in [1usize, 3, 17, 64, 100] {
            let x = gpu.upload(&random_bf16(&mut rng, n * in_dim, 1.0)).unwrap();
            for choice in [Gemm::BatchInvariant, Gemm::Cublas] {
                gpu.gemm = choice;
                let y = gpu.zeros::<bf16>(n * out_dim).unwrap();
                let a = args(gpu.ptr(&wd), out_dim, in_dim, gpu.ptr(&x), n, gpu.ptr(&y));
                gemm.linear(gpu, &a).unwrap();
                let rounded = gpu.download(&y, n * out_dim).unwrap();
                let partial = gpu.zeros::<f32>(n * out_dim).unwrap();
                let untouched = gpu.zeros::<bf16>(n * out_dim).unwrap();
                gemm.linear_partial(gpu, &LinearArgs { y: gpu.ptr(&untouched), ..a }, gpu.ptr(&partial)).unwrap();
                let partial = gpu.download(&partial, n * out_dim).unwrap();
                let what = format!("{choice:?} [{out_dim}, {in_dim}] n {n}");
                assert!(gpu.download(&untouched, n * out_dim).unwrap().iter().all(|v| v.to_bits() == 0), "{what}: y");
                match choice {
                    // The same sums, so the same bits once rounded (a group of one is the whole model).
                    Gemm::BatchInvariant => {
                        let differ = partial.iter().zip(&rounded).filter(|(p, r)| bf16::from_f32(**p) != **r).count();
                        assert_eq!(differ, 0, "{what}: the partial rounds differently");
                        let exact = partial.iter().filter(|p| bf16::from_f32(**p).to_f32() == **p).count();
                        assert!(exact < n * out_dim / 2, "{what}: the partial is not the unrounded sums");
                    }
                    // cuBLAS may pick another algorithm for an fp32 output: the same values to bf16 precision.
                    Gemm::Cublas => {
                        for (p, r) in partial.iter().zip(&rounded) {
                            let r = r.to_f32();
                            assert!((p - r).abs() <= 1e-2 * r.abs().max(1.0), "{what}: {p} against {r}");
                        }
                    }
                }
            }
        }
    }
    gpu.gemm = Gemm::BatchInvariant;
}

#[test]
fn merged_projection_parts_equal_each_part_run_alone() {
    let Some(mut dev) = gpu() else { return };
    let Dev { gpu, gemm, .. } = &mut *dev;
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let (in_dim, n) = (520, 13);
    let bounds = [0usize, 100, 133, 300, 301];
    let w = random_bf16(&mut rng, bounds[4] * in_dim, 1.0);
    let x = random_bf16(&mut rng, n * in_dim, 1.0);
    let (wd, xd) = (gpu.upload(&w).unwrap(), gpu.upload(&x).unwrap());
    let table: Vec<i32> = bounds.iter().map(|b| *b as i32).collect();
    let table_dev = gpu.upload(&table).unwrap();
    for choice in [Gemm::BatchInvariant, Gemm::Cublas] {
        gpu.gemm = choice;
        let merged = gpu.zeros::<bf16>(n * bounds[4]).unwrap();
        gemm.linear_parts(
            gpu,
            &PartsArgs {
                w: gpu.ptr(&wd),
                bounds: &bounds,
                bounds_dev: gpu.ptr(&table_dev),
                in_dim,
                x: gpu.ptr(&xd),
                n,
                y: gpu.ptr(&merged),
            },
        )
        .unwrap();
        let merged = gpu.download(&merged, n * bounds[4]).unwrap();
        for p in bounds.windows(2) {
            let rows = p[1] - p[0];
            let part_w = gpu.upload(&w[p[0] * in_dim..p[1] * in_dim]).unwrap();
            let y = gpu.zeros::<bf16>(n * rows).unwrap();
            gemm.linear(gpu, &args(gpu.ptr(&part_w), rows, in_dim, gpu.ptr(&xd), n, gpu.ptr(&y))).unwrap();
            let alone = gpu.download(&y, n * rows).unwrap();
            let got = &merged[n * p[0]..n * p[1]];
            if choice == Gemm::Cublas {
                assert_eq!(got, alone.as_slice(), "{choice:?}: part {p:?}");
            } else {
                // The skinny GEMM's split follows the merged shape, so compare values, not bits.
                for (a, b) in got.iter().zip(&alone) {
                    assert!(
                        (a.to_f32() - b.to_f32()).abs() <= b.to_f32().abs() / 64.0 + 1e-2,
                        "part {p:?}: {a} vs {b}"
                    );
                }
            }
        }
    }
    gpu.gemm = Gemm::BatchInvariant;
}

#[test]
fn bad_gemm_arguments_are_errors() {
    let Some(dev) = gpu() else { return };
    let Dev { gpu, gemm, .. } = &*dev;
    let w = gpu.zeros::<bf16>(64 * 64).unwrap();
    let y = gpu.zeros::<bf16>(64).unwrap();
    for split in [0, 65] {
        let err =
            gemm.linear_skinny(gpu, &args(gpu.ptr(&w), 64, 64, gpu.ptr(&w), 1, gpu.ptr(&y)), None, split).unwrap_err();
        assert_eq!(err.kind(), "invalid_input", "{err}");
        assert!(err.to_string().contains(&format!("split {split}")), "{err}");
    }
    let layout = SkinnyLayout { split: 2, warps: 6, serial: false, wide: false };
    let err =
        gemm.linear_skinny_layout(gpu, &args(gpu.ptr(&w), 64, 64, gpu.ptr(&w), 1, gpu.ptr(&y)), layout).unwrap_err();
    assert!(err.to_string().contains("6 warps"), "{err}");
    let layout = SkinnyLayout { split: 2, warps: 4, serial: false, wide: true };
    let err =
        gemm.linear_skinny_layout(gpu, &args(gpu.ptr(&w), 64, 64, gpu.ptr(&w), 1, gpu.ptr(&y)), layout).unwrap_err();
    assert!(err.to_string().contains("wide skinny GEMM layout for 1 tokens"), "{err}");
    let err = gemm
        .linear_parts(
            gpu,
            &PartsArgs {
                w: gpu.ptr(&w),
                bounds: &[0, 40, 30],
                bounds_dev: NULL,
                in_dim: 64,
                x: gpu.ptr(&w),
                n: 1,
                y: gpu.ptr(&y),
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("not ascending"), "{err}");
}

/// Fills `n` bf16 elements at `dst` with a repeated random block (timing needs real bit patterns).
fn fill(gpu: &Gpu, dst: u64, n: usize, rng: &mut ChaCha8Rng) {
    let block = random_bf16(rng, 1 << 22, 0.05);
    let src = gpu.upload(&block).unwrap();
    let mut at = 0;
    while at < n {
        let len = block.len().min(n - at);
        gpu.copy::<bf16>(dst + (at * 2) as u64, gpu.ptr(&src), len).unwrap();
        at += len;
    }
}

/// Device milliseconds per call of `f`, over `reps` calls after one warm-up.
fn time(gpu: &Gpu, reps: usize, f: impl Fn()) -> f64 {
    f();
    gpu.start_profile();
    gpu.mark("start").unwrap();
    for _ in 0..reps {
        f();
    }
    gpu.mark("end").unwrap();
    gpu.finish_profile().unwrap()[0].ms / reps as f64
}

#[test]
#[ignore = "a benchmark: prints GB/s, run with --ignored on a GPU"]
fn gemm_bandwidth() {
    let Some(mut dev) = gpu() else { return };
    let Dev { gpu, gemm, .. } = &mut *dev;
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let cfg = ModelConfig::preset("k3-mini").unwrap();
    let d = cfg.hidden_size;
    let (k, m) = (&cfg.kda, &cfg.mla);
    let kda_in = 4 * k.proj_dim() + k.head_dim + k.num_heads;
    let mla_in = m.q_lora_rank + m.latent_dim() + m.num_heads * m.v_head_dim;
    let shapes = [
        ("lm_head", cfg.vocab_size, d),
        ("dense gate/up", cfg.dense_intermediate, d),
        ("dense down", d, cfg.dense_intermediate),
        ("kda merged in", kda_in, d),
        ("kda/mla o_proj", d, k.proj_dim()),
        ("mla merged in", mla_in, d),
        ("mla q_b", m.num_heads * m.q_head_dim(), m.q_lora_rank),
        ("moe latent down", cfg.moe.latent_dim, d),
        ("moe up", d, cfg.moe.latent_dim),
        ("shared gate/up", 2 * cfg.moe.shared_dim(), d),
        ("shared down", d, cfg.moe.shared_dim()),
    ];
    let copy_elems = 1usize << 29; // 1 GiB of bf16
    let (a, b) = (gpu.zeros::<bf16>(copy_elems).unwrap(), gpu.zeros::<bf16>(copy_elems).unwrap());
    let ms = time(gpu, 5, || gpu.copy::<bf16>(gpu.ptr(&b), gpu.ptr(&a), copy_elems).unwrap());
    println!("copy bandwidth (read + write): {:.0} GB/s", 2.0 * (copy_elems * 2) as f64 / ms / 1e6);
    drop((a, b));
    let tc = has_tc(gpu, gemm);
    println!("shape | out x in | tokens | split x warps per block (row tiles per warp) | ms | GB/s");
    for (name, out_dim, in_dim) in shapes {
        let w = gpu.zeros::<bf16>(out_dim * in_dim).unwrap();
        fill(gpu, gpu.ptr(&w), out_dim * in_dim, &mut rng);
        let x = gpu.upload(&random_bf16(&mut rng, 64 * in_dim, 1.0)).unwrap();
        let y = gpu.zeros::<bf16>(64 * out_dim).unwrap();
        for n in [1usize, 8, 16, 32, 64] {
            let bytes = ((out_dim * in_dim + n * in_dim + n * out_dim) * 2) as f64;
            let reps = (4e9 / bytes).clamp(5.0, 200.0) as usize;
            let default = gemm.skinny_layout(out_dim, in_dim, n, skinny_split(out_dim, in_dim));
            let wide_too: &[bool] = if n > 16 { &[false, true] } else { &[false] };
            for split in [1usize, 2, 4, 8, 16, 32] {
                for (warps, &wide) in [4, 8].into_iter().flat_map(|w| wide_too.iter().map(move |x| (w, x))) {
                    let layout = SkinnyLayout { split, warps, serial: false, wide };
                    let ms = time(gpu, reps, || {
                        gemm.linear_skinny_layout(
                            gpu,
                            &args(gpu.ptr(&w), out_dim, in_dim, gpu.ptr(&x), n, gpu.ptr(&y)),
                            layout,
                        )
                        .unwrap()
                    });
                    let mark = if layout == default { " (default)" } else { "" };
                    let tiles = if wide { ", 2 row tiles" } else { "" };
                    println!(
                        "{name} | {out_dim} x {in_dim} | {n} | {split} x {warps} warps{tiles}{mark} | {ms:.4} | {:.0}",
                        bytes / ms / 1e6
                    );
                }
            }
            let tc_splits = [1usize, 2, 4, 8].into_iter().filter(|_| tc);
            for (split, serial) in tc_splits.flat_map(|s| [(s, false), (s, true)]) {
                let ms = time(gpu, reps, || {
                    let (w, x, y) = (gpu.ptr(&w), gpu.ptr(&x), gpu.ptr(&y));
                    gemm.linear_tc(gpu, &args(w, out_dim, in_dim, x, n, y), split, serial).unwrap()
                });
                let default = split == tc_split(out_dim, in_dim) && !serial;
                let mark = if default { " (default)" } else { "" };
                let form = if serial { "serial" } else { "split" };
                println!(
                    "{name} | {out_dim} x {in_dim} | {n} | wgmma {split} {form}{mark} | {ms:.4} | {:.0}",
                    bytes / ms / 1e6
                );
            }
            gpu.gemm = Gemm::Cublas;
            let ms = time(gpu, reps, || {
                gemm.linear(gpu, &args(gpu.ptr(&w), out_dim, in_dim, gpu.ptr(&x), n, gpu.ptr(&y))).unwrap()
            });
            gpu.gemm = Gemm::BatchInvariant;
            println!("{name} | {out_dim} x {in_dim} | {n} | cublas | {ms:.4} | {:.0}", bytes / ms / 1e6);
        }
    }
}

#[test]
fn only_launches_of_many_waves_take_two_row_tiles_per_warp() {
    let Some(dev) = gpu() else { return };
    let Dev { gemm, .. } = &*dev;
    for n in [17, 32, 64] {
        assert!(gemm.skinny_layout(163_840, 7168, n, 1).wide, "lm_head at {n} tokens");
    }
    // A prefill of 200 tokens would need a 131 MB workspace: it runs its slices serially, which takes two row tiles
    // per warp in its own entry point, so the split launch's wide form is not chosen.
    let prefill = gemm.skinny_layout(163_840, 7168, 200, 1);
    assert!(prefill.serial && !prefill.wide, "lm_head at 200 tokens: {prefill:?}");
    for n in [1, 8, 16] {
        assert!(!gemm.skinny_layout(163_840, 7168, n, 1).wide, "lm_head at {n} tokens: no wide entry point");
    }
    for (out_dim, in_dim) in [(49_376, 7168), (7168, 12_288), (7168, 3584)] {
        let split = skinny_split(out_dim, in_dim);
        assert!(!gemm.skinny_layout(out_dim, in_dim, 64, split).wide, "[{out_dim}, {in_dim}] at 64 tokens");
    }
}

#[test]
fn the_tc_k_split_fills_the_gpu_from_the_weight_shape_alone() {
    // No GPU needed: the warpgroup-MMA GEMM's split is a pure function of (out, in): none past 66 row tiles of 128
    // (half the SMs of an H200), else the most slices (at most 8, a cluster) that keep the blocks within 264 (two
    // per SM), none narrower than 768 columns.
    assert_eq!(tc_split(163_840, 7168), 1, "lm_head: 1,280 blocks");
    assert_eq!(tc_split(49_376, 7168), 1, "KDA merged input projection: 386 blocks");
    assert_eq!(tc_split(33_792, 7168), 1, "dense gate / up: 264 blocks");
    assert_eq!(tc_split(7168, 33_792), 4, "dense down: 56 row tiles");
    assert_eq!(tc_split(14_400, 7168), 1, "MLA merged input projection: 113 row tiles");
    assert_eq!(tc_split(7168, 12_288), 4, "o_proj");
    assert_eq!(tc_split(18_432, 1536), 1, "MLA q_b: 144 row tiles");
    assert_eq!(tc_split(3584, 7168), 8, "MoE latent down: 28 row tiles");
    assert_eq!(tc_split(7168, 3584), 4, "MoE up");
    assert_eq!(tc_split(12_288, 7168), 1, "shared expert gate / up: 96 row tiles");
    assert_eq!(tc_split(7168, 6144), 4, "shared expert down");
    assert_eq!(tc_split(8960, 7168), 1, "70 row tiles: more than half the SMs");
    assert_eq!(tc_split(1000, 4096), 4, "8 row tiles: slices of 1024, as 8 of 512 would be too narrow");
    assert_eq!(tc_split(1000, 65_536), 8, "8 row tiles: at most 8 slices, a cluster's portable size");
    assert_eq!(tc_split(7168, 1024), 1, "K below two slices of 768 is never split");
}

#[test]
fn the_k_split_follows_the_weight_shape_as_tuned_on_the_h200() {
    // No GPU needed: the split is a pure function of (out, in), so a token's summation order never
    // depends on the batch. Values from the H200 sweep of `gemm_bandwidth` over the k3-mini shapes
    // (docs/perf/decisions.md#d18).
    assert_eq!(skinny_split(163_840, 7168), 1, "lm_head: 2,560 row tiles already fill the GPU");
    assert_eq!(skinny_split(49_376, 7168), 1, "KDA merged input projection");
    assert_eq!(skinny_split(33_792, 7168), 1, "dense gate / up");
    assert_eq!(skinny_split(7168, 33_792), 2, "dense down: 112 row tiles");
    assert_eq!(skinny_split(14_400, 7168), 1, "MLA merged input projection: 225 row tiles");
    assert_eq!(skinny_split(7168, 12_288), 2, "o_proj");
    assert_eq!(skinny_split(18_432, 1536), 1, "MLA q_b");
    assert_eq!(skinny_split(3584, 7168), 4, "MoE latent down: 56 row tiles");
    assert_eq!(skinny_split(7168, 3584), 2, "MoE up");
    assert_eq!(skinny_split(12_288, 7168), 1, "shared expert gate / up: 192 row tiles");
    assert_eq!(skinny_split(7168, 6144), 2, "shared expert down");
    assert_eq!(skinny_split(1024, 1536), 1, "slices are never cut to 768 columns or fewer");
    assert_eq!(skinny_split(12_288, 128), 1, "f_b: K below one staged chunk is never split");
}
