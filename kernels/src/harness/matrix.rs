//! The batch × window validation matrix of the CUDA forward (part of `validate::run`).
//!
//! One case is `(batch B, window W, fresh or reused state)`. Every row of the batch gets a distinct
//! window of `W` tokens, after a distinct prefix of 8–12 tokens when the state is reused (a session's
//! next turn), or on a fresh state. The batch runs the windows in one forward with snapshots (as a
//! verify step does), cuts each row back to `m_r = 1 + r mod W` tokens, and runs one more token per row.
//! For the first, middle and last row the case checks:
//! - exactness on the device: the window logits equal those of the same row run alone over
//!   `prefix + window` in one fresh window, and the logits after the cut equal those of the row run
//!   alone over `prefix + window[..m] + next` (batch invariance, state reuse and rollback, bit for bit);
//! - against the CPU reference (recurrent KDA form) over `prefix + window`: the largest logits
//!   relative L2 over the window positions before the row's first router flip, and greedy agreement.
//!   A flip must be a near-tie (selection margin < 0.01), as in the teacher-forced check.
//!
//! Invariant: the device's own checks are exact (max |Δ| = 0); the CPU bound is the teacher-forced one
//! (5% relative L2 before the first flip).

use crate::cpu::forward::{CpuModel, RoutingTrace, WindowRow};
use crate::cuda::forward::DeviceModel;
use crate::cuda::gpu::Gpu;
use crate::cuda::state::{DeviceRow, DeviceState};
use crate::error::{KernelError, Result};
use crate::harness::compare::{argmax, rel_l2};
use crate::routing::Routing;
use crate::runner::TokenId;
use crate::state::SeqState;

/// One case of the matrix.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MatrixCase {
    pub batch: usize,
    pub window: usize,
    pub reused_state: bool,
    pub rows_checked: usize,
    /// Largest |Δ| between the batched window logits and the row run alone (must be 0).
    pub batch_max_abs: f64,
    /// Largest |Δ| between the logits after the cut and the row's cut sequence run alone (must be 0).
    pub rollback_max_abs: f64,
    /// Largest logits relative L2 vs the CPU over window positions before each row's first flip.
    pub cpu_max_rel_l2_before_flip: f64,
    /// Checked rows with a router flip somewhere in `prefix + window`.
    pub rows_with_flip: usize,
    /// The smallest selection margin at a first flip (None: no flip).
    pub worst_flip_margin: Option<f64>,
    /// Window positions whose greedy token agrees with the CPU's, over those checked.
    pub argmax_agree: usize,
    pub positions_checked: usize,
    pub pass: bool,
}

/// Row `r`'s tokens of one case: a prefix (reused state only), the window, and the token after the cut.
struct RowTokens {
    prefix: Vec<TokenId>,
    window: Vec<TokenId>,
    keep: usize,
    next: TokenId,
}

fn tokens(len: usize, salt: usize) -> Vec<TokenId> {
    (0..len).map(|i| ((i * 7919 + salt * 104_729 + 13) % 100_000) as TokenId).collect()
}

fn row_tokens(r: usize, window: usize, reused: bool) -> RowTokens {
    RowTokens {
        prefix: if reused { tokens(8 + r % 5, 1000 + r) } else { Vec::new() },
        window: tokens(window, 2000 + r),
        keep: 1 + r % window,
        next: tokens(1, 3000 + r)[0],
    }
}

fn max_abs(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) })
}

fn download(gpu: &Gpu, logits: &cudarc::driver::CudaSlice<half::bf16>, n: usize) -> Result<Vec<f32>> {
    Ok(gpu.download(logits, n)?.into_iter().map(f32::from).collect())
}

/// One row alone over `toks` in one fresh window: logits from `from`, and the routing trace.
/// Routing of every token at every MoE layer, `[layer][token]`.
type Trace = Vec<Vec<Routing<f32>>>;

fn alone(gpu: &Gpu, dev: &DeviceModel, toks: &[TokenId], from: usize) -> Result<(Vec<f32>, Trace)> {
    let mut st = DeviceState::new(gpu, &dev.cfg)?;
    let mut trace = Vec::new();
    let mut rows = [DeviceRow { state: &mut st, tokens: toks, logits_from: from, snapshots_from: None }];
    let out = dev.forward(gpu, &mut rows, Some(&mut trace))?;
    Ok((download(gpu, &out.logits, (toks.len() - from) * dev.cfg.vocab_size)?, trace))
}

/// Runs one case.
pub fn run_case(
    gpu: &Gpu,
    dev: &DeviceModel,
    cpu: &CpuModel<f32>,
    batch: usize,
    window: usize,
    reused: bool,
) -> Result<MatrixCase> {
    let cfg = &dev.cfg;
    let vocab = cfg.vocab_size;
    let rows: Vec<RowTokens> = (0..batch).map(|r| row_tokens(r, window, reused)).collect();
    let mut states = (0..batch).map(|_| DeviceState::new(gpu, cfg)).collect::<Result<Vec<_>>>()?;
    if reused {
        let mut prefill: Vec<DeviceRow<'_>> = states
            .iter_mut()
            .zip(&rows)
            .map(|(state, r)| DeviceRow { state, tokens: &r.prefix, logits_from: r.prefix.len(), snapshots_from: None })
            .collect();
        dev.forward(gpu, &mut prefill, None)?;
    }
    let mut windows: Vec<DeviceRow<'_>> = states
        .iter_mut()
        .zip(&rows)
        .map(|(state, r)| DeviceRow { state, tokens: &r.window, logits_from: 0, snapshots_from: Some(1) })
        .collect();
    let out = dev.forward(gpu, &mut windows, None)?;
    drop(windows);
    let batch_logits = download(gpu, &out.logits, batch * window * vocab)?;
    for ((undo, state), r) in out.undo.into_iter().zip(states.iter_mut()).zip(&rows) {
        let undo = undo.ok_or_else(|| KernelError::Device("a verify window kept no undo record".into()))?;
        undo.commit(gpu, cfg, state, r.keep)?;
    }
    let next: Vec<[TokenId; 1]> = rows.iter().map(|r| [r.next]).collect();
    let mut after: Vec<DeviceRow<'_>> = states
        .iter_mut()
        .zip(&next)
        .map(|(state, t)| DeviceRow { state, tokens: t, logits_from: 0, snapshots_from: None })
        .collect();
    let after_out = dev.forward(gpu, &mut after, None)?;
    drop(after);
    let after_logits = download(gpu, &after_out.logits, batch * vocab)?;

    let mut checked: Vec<usize> = vec![0, batch / 2, batch - 1];
    checked.dedup();
    let mut case = MatrixCase {
        batch,
        window,
        reused_state: reused,
        rows_checked: checked.len(),
        batch_max_abs: 0.0,
        rollback_max_abs: 0.0,
        cpu_max_rel_l2_before_flip: 0.0,
        rows_with_flip: 0,
        worst_flip_margin: None,
        argmax_agree: 0,
        positions_checked: 0,
        pass: false,
    };
    for &c in &checked {
        let r = &rows[c];
        let full: Vec<TokenId> = r.prefix.iter().chain(&r.window).copied().collect();
        let p = r.prefix.len();
        let (single, dtrace) = alone(gpu, dev, &full, p)?;
        case.batch_max_abs =
            case.batch_max_abs.max(max_abs(&batch_logits[c * window * vocab..(c + 1) * window * vocab], &single));
        let cut: Vec<TokenId> = full[..p + r.keep].iter().copied().chain([r.next]).collect();
        let (cut_logits, _) = alone(gpu, dev, &cut, cut.len() - 1)?;
        case.rollback_max_abs =
            case.rollback_max_abs.max(max_abs(&after_logits[c * vocab..(c + 1) * vocab], &cut_logits));

        let mut cs = SeqState::<f32>::new(cfg);
        let mut ctrace = RoutingTrace::default();
        let mut crow = [WindowRow { state: &mut cs, tokens: &full, logits_from: p, snapshots_from: Some(full.len()) }];
        let want = cpu.forward_traced(&mut crow, Some(&mut ctrace))?.remove(0).logits;
        let layers = ctrace.routing.len();
        let flip_at = |t: usize, l: usize| ctrace.routing[l][t].experts != dtrace[l][t].experts;
        let first_flip = (0..full.len()).find(|t| (0..layers).any(|l| flip_at(*t, l)));
        if let Some(t) = first_flip {
            case.rows_with_flip += 1;
            let l = (0..layers).find(|l| flip_at(t, *l)).unwrap_or(0);
            let margin = ctrace.routing[l][t].margin.min(dtrace[l][t].margin) as f64;
            case.worst_flip_margin = Some(case.worst_flip_margin.map_or(margin, |m: f64| m.max(margin)));
        }
        for w in 0..window {
            let (g, c_) = (&single[w * vocab..(w + 1) * vocab], &want[w * vocab..(w + 1) * vocab]);
            case.positions_checked += 1;
            case.argmax_agree += usize::from(argmax(g) == argmax(c_));
            if first_flip.is_none_or(|t| p + w < t) {
                case.cpu_max_rel_l2_before_flip = case.cpu_max_rel_l2_before_flip.max(rel_l2(g, c_));
            }
        }
    }
    case.pass = case.batch_max_abs == 0.0
        && case.rollback_max_abs == 0.0
        && case.cpu_max_rel_l2_before_flip < 0.05
        && case.worst_flip_margin.is_none_or(|m| m < 0.01);
    Ok(case)
}
