//! The batched attention kernels on a GPU, on long inputs: the chunked KDA form against the CPU's chunked
//! form and the device's recurrent form, and the split MLA attention over a context of thousands of
//! tokens against the CPU. On a machine without a CUDA driver each test says plainly that it skipped.
//!
//! The MLA kernels also run one step over batches of 1, 8 and 64 rows with mixed cache lengths, at
//! k3-tiny's and K3's MLA dims (96 heads, kv_lora 512): against the CPU, and row alone against batched.
//!
//! The KDA forms are also run at K3's dims (96 heads of 128) over a 2,048-token window, and both forms'
//! device times are printed (not asserted: performance numbers go to BENCHMARKS.md).

use sparkd_kernels::cpu::forward::CpuModel;
use sparkd_kernels::cuda::device::driver_present;
use sparkd_kernels::cuda::forward::DeviceModel;
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::ops::Ops;
use sparkd_kernels::cuda::weights::DevWeights;
use sparkd_kernels::harness::attn_check::{kda_forms, kda_snapshots, mla_batch, mla_long_context};
use sparkd_kernels::harness::compare::OpCheck;
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::ModelConfig;

fn gpu() -> Option<Gpu> {
    if !driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this machine; the CUDA attention kernels were NOT checked");
        return None;
    }
    Some(Gpu::new(0).unwrap())
}

fn assert_all_pass(checks: &[OpCheck]) {
    for c in checks {
        eprintln!(
            "{:<90} rel_l2 {:.3e} (max |Δ| {:.3e}, bound {:.1e}) {}",
            c.op, c.rel_l2, c.max_abs, c.tolerance, c.pass
        );
    }
    assert!(checks.iter().all(|c| c.pass), "a check failed; see above");
}

#[test]
fn chunked_kda_matches_the_cpu_and_the_recurrent_form() {
    let Some(gpu) = gpu() else { return };
    // Several chunks and a partial one, from a non-zero state.
    let mut checks = Vec::new();
    for t in [17, 100] {
        checks.extend(kda_forms(&gpu, "k3-tiny", t, 5 + t as u64, true).unwrap().checks);
    }
    assert_all_pass(&checks);
}

#[test]
fn recurrent_kda_snapshots_equal_the_states_of_shorter_windows() {
    let Some(gpu) = gpu() else { return };
    // Both head dims (the recurrent kernel's per-lane tiles differ), snapshots from the window's start and from
    // its middle, as a verify window's rollback reads them.
    let mut checks = Vec::new();
    for (preset, t, from) in [("k3-tiny", 7, 0), ("k3-tiny", 7, 3), ("k3-mini", 5, 0), ("k3-mini", 5, 2)] {
        checks.extend(kda_snapshots(&gpu, preset, t, from, 11).unwrap());
    }
    assert_eq!(checks.len(), 7 + 4 + 5 + 3);
    assert_all_pass(&checks);
}

#[test]
fn chunked_kda_at_k3_dims_matches_the_recurrent_form_and_reports_times() {
    let Some(gpu) = gpu() else { return };
    let mut checks = Vec::new();
    for t in [16, 64, 256, 2048] {
        let forms = kda_forms(&gpu, "k3-mini", t, 9, false).unwrap();
        eprintln!(
            "KDA layer, one row of {t} tokens, {} heads of {}: recurrent {:.3} ms, chunked {:.3} ms",
            forms.heads, forms.head_dim, forms.recurrent_ms, forms.chunked_ms
        );
        checks.extend(forms.checks);
    }
    assert_all_pass(&checks);
}

#[test]
fn split_mla_attention_over_a_long_context_matches_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let cfg = ModelConfig::preset("k3-tiny").unwrap();
    let src = SyntheticWeights::new(cfg.clone(), 7);
    let dev = DeviceModel::new(cfg.clone(), DevWeights::load(&gpu, &cfg, &src).unwrap(), Ops::load(&gpu).unwrap());
    let cpu: CpuModel<f32> = CpuModel::load(cfg, &src).unwrap();
    // Decode and verify windows split over the context finely; a 40-token chunk in about 12 splits.
    for window in [1, 4, 40] {
        assert_all_pass(&mla_long_context(&gpu, &dev, &cpu, 3000, window).unwrap());
    }
}

#[test]
fn mla_over_mixed_batches_matches_the_cpu_and_is_batch_invariant() {
    let Some(gpu) = gpu() else { return };
    let mut checks = Vec::new();
    // Batch 160 is 340 tokens (every eighth row from the fourth a window of 4, from the eighth a window of 7): six
    // blocks of 64 tokens in mla_absorb and mla_out, which the rows run alone must match bit for bit.
    for preset in ["k3-tiny", "k3-mini"] {
        for batch in [1, 8, 64, 160] {
            let run = mla_batch(&gpu, preset, batch, 17 + batch as u64).unwrap();
            eprintln!(
                "MLA {preset}, {} rows / {} tokens: norms + append + attention {:.3} ms in {} launches",
                run.rows, run.tokens, run.ms, run.launches
            );
            checks.extend(run.checks);
        }
    }
    assert_all_pass(&checks);
}
