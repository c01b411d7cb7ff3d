//! The DSpark draft's cost beside the target step it drafts for, in `sparkd bench --device cuda`: per
//! batch size the target step with the drafter attached, one draft round greedy and sampled, and a
//! forced-acceptance speculative round that pays for its own draft.
//!
//! Invariants:
//! - Every time is host wall-clock around one call that ends with a device synchronisation (a draft
//!   downloads its tokens; a step its verdicts), the median of the timed calls after two warm-ups.
//! - A drafted step is timed with the drafter attached, so it includes the taps the target step commits
//!   into the drafter's contexts: the whole price of speculating, not the plain decode step.
//! - The speculative figure ([`ForcedRound::tokens_per_second`]) divides the tokens emitted by the time
//!   of draft plus verify step, round by round: the bench's speculative throughput includes the draft.
//! - Sampled drafting is timed at temperature 1 with top-p 1 and top-k off (the agent default).

use std::time::Instant;

use crate::acceptance::{AcceptanceMode, SyntheticSchedule};
use crate::cuda::drafter::SPAN_CONTEXT;
use crate::cuda::runner::CudaRunner;
use crate::error::{KernelError, Result};
use crate::harness::cuda_bench::{by_op, median, time_steps, Batch, OpCost};
use crate::runner::{DraftRequest, Runner, SamplingParams};

/// The draft's cost at one batch size.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DraftCost {
    pub batch: usize,
    /// γ: drafts per row per round.
    pub block_size: usize,
    /// The plain decode step with the drafter attached (its taps committed).
    pub step_ms_median: f64,
    pub greedy_ms_median: f64,
    pub sampled_ms_median: f64,
    /// The draft's cost over the step's.
    pub greedy_relative_to_step: f64,
    pub sampled_relative_to_step: f64,
    /// One profiled greedy draft, span by span (`cuda::drafter::SPAN_*`, device events).
    pub greedy_by_op: Vec<OpCost>,
    /// The drafter's share of one profiled target step: the context append from the step's taps.
    pub step_context_ms: f64,
}

/// A forced-acceptance speculative round at batch 1 that drafts with the model: draft, then verify.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ForcedRound {
    pub draft_len: usize,
    pub acceptance_length: f64,
    /// Tokens emitted per round, measured.
    pub measured_acceptance_length: f64,
    pub draft_ms_median: f64,
    pub step_ms_median: f64,
    pub round_ms_median: f64,
    /// Emitted tokens over the summed round times (draft included).
    pub tokens_per_second: f64,
}

/// Temperature 1, no truncation: the sampled drafting the bench times.
fn sampled() -> SamplingParams {
    SamplingParams { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 1, logprobs: None }
}

/// One draft round of γ for every row of `b`, anchored at each row's last token; returns its wall time in ms.
fn draft_once(runner: &mut CudaRunner, b: &Batch, gamma: usize, params: &SamplingParams) -> Result<f64> {
    let rows: Vec<DraftRequest> = b
        .states
        .iter()
        .zip(&b.last)
        .map(|(&state, &anchor)| DraftRequest { state, anchor, num_drafts: gamma, params: params.clone() })
        .collect();
    let mut drafter = runner.model_drafter().ok_or_else(no_drafter)?;
    let t0 = Instant::now();
    drafter.draft(&rows)?;
    Ok(t0.elapsed().as_secs_f64() * 1e3)
}

fn no_drafter() -> KernelError {
    KernelError::InvalidInput("the draft benchmark needs a drafter attached to the runner".into())
}

/// The median of `steps` timed draft rounds after two warm-ups.
fn time_drafts(runner: &mut CudaRunner, b: &Batch, gamma: usize, params: &SamplingParams, steps: usize) -> Result<f64> {
    for _ in 0..2 {
        draft_once(runner, b, gamma, params)?;
    }
    let mut times = (0..steps).map(|_| draft_once(runner, b, gamma, params)).collect::<Result<Vec<f64>>>()?;
    Ok(median(&mut times))
}

/// The draft's cost at each of `batches` (sequences prefilled with `prompt_len` tokens), on a runner with a
/// drafter attached.
pub fn draft_costs(
    runner: &mut CudaRunner,
    batches: &[usize],
    prompt_len: usize,
    steps: usize,
) -> Result<Vec<DraftCost>> {
    let gamma = runner.model_drafter().ok_or_else(no_drafter)?.block_size();
    let mut out = Vec::with_capacity(batches.len());
    for &batch in batches {
        let mut b = Batch::new(runner, batch, prompt_len)?;
        let measured = (|| -> Result<DraftCost> {
            let step = time_steps(runner, &mut b, steps, 0)?.median_ms;
            let greedy = time_drafts(runner, &b, gamma, &SamplingParams::greedy(), steps)?;
            let sampled = time_drafts(runner, &b, gamma, &sampled(), steps)?;
            runner.gpu().start_profile();
            let drafted = draft_once(runner, &b, gamma, &SamplingParams::greedy());
            let greedy_spans = runner.gpu().finish_profile()?;
            drafted?;
            runner.gpu().start_profile();
            let stepped = b.step_drafted(runner, &vec![Vec::new(); b.states.len()]);
            let step_spans = runner.gpu().finish_profile()?;
            stepped?;
            Ok(DraftCost {
                batch,
                block_size: gamma,
                step_ms_median: step,
                greedy_ms_median: greedy,
                sampled_ms_median: sampled,
                greedy_relative_to_step: greedy / step,
                sampled_relative_to_step: sampled / step,
                greedy_by_op: by_op(&greedy_spans),
                step_context_ms: step_spans.iter().filter(|s| s.label == SPAN_CONTEXT).map(|s| s.ms).sum(),
            })
        })();
        b.free(runner)?;
        out.push(measured?);
    }
    Ok(out)
}

/// Forced acceptance `acceptance_length` at ℓ = `draft_len`, batch 1, greedy: every round drafts ℓ tokens with
/// the model, selects them and verifies them; `steps` timed rounds after two warm-ups.
pub fn forced_round(
    runner: &mut CudaRunner,
    draft_len: usize,
    acceptance_length: f64,
    prompt_len: usize,
    steps: usize,
) -> Result<ForcedRound> {
    runner.set_acceptance(AcceptanceMode::Synthetic(SyntheticSchedule::from_acceptance_length(
        acceptance_length,
        draft_len,
    )?));
    let mut b = Batch::new(runner, 1, prompt_len)?;
    let timed = (|| -> Result<ForcedRound> {
        let (mut drafts, mut verifies, mut rounds) = (Vec::new(), Vec::new(), Vec::new());
        let mut emitted = 0usize;
        for i in 0..steps + 2 {
            let anchor = b.last[0];
            let request =
                DraftRequest { state: b.states[0], anchor, num_drafts: draft_len, params: SamplingParams::greedy() };
            let t0 = Instant::now();
            let proposal = {
                let mut drafter = runner.model_drafter().ok_or_else(no_drafter)?;
                let proposal = drafter.draft(std::slice::from_ref(&request))?.remove(0);
                drafter.select_proposal(b.states[0])?;
                proposal
            };
            let t1 = Instant::now();
            let generated = b.step_drafted(runner, &[proposal.tokens])?;
            let t2 = Instant::now();
            if i >= 2 {
                drafts.push((t1 - t0).as_secs_f64() * 1e3);
                verifies.push((t2 - t1).as_secs_f64() * 1e3);
                rounds.push((t2 - t0).as_secs_f64() * 1e3);
                emitted += generated;
            }
        }
        let total_s = rounds.iter().sum::<f64>() * 1e-3;
        Ok(ForcedRound {
            draft_len,
            acceptance_length,
            measured_acceptance_length: emitted as f64 / steps as f64,
            draft_ms_median: median(&mut drafts),
            step_ms_median: median(&mut verifies),
            round_ms_median: median(&mut rounds),
            tokens_per_second: emitted as f64 / total_s,
        })
    })();
    runner.set_acceptance(AcceptanceMode::Standard);
    b.free(runner)?;
    timed
}
