//! Step costs against context length over any [`Runner`] (`sparkd bench --context-steps`): what a decode
//! row, a prefill chunk and a mixed step (decode rows beside one chunk, as the engine's step-time limit
//! plans them) cost when the states already hold `context` tokens. The step-cost profile the engine plans
//! with is measured on fresh states; this sweep says how far long contexts move the real step from it.
//!
//! Invariants:
//! - Timing covers one `step` call each: the faster of two timed steps after one warm-up step. A timed
//!   step advances its states (by 1 token a decode row, by `chunk` a chunk row), so the context of a
//!   measurement is `context` plus at most three steps' tokens.
//! - One base state per context is prefilled in chunks of at most `max_batch_tokens` tokens (untimed but
//!   the last chunk, reported as the prefill rate at that context); every timed row runs on a fork of it,
//!   so no measurement sees another's tokens. Every state is freed before returning, on error too.

use std::time::{Duration, Instant};

use crate::error::{KernelError, Result};
use crate::runner::{RowInput, Runner, SampleRequest, SamplingParams, StateId, TokenId};

/// What to measure.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ContextSweep {
    /// Tokens already in the states, ascending or not.
    pub contexts: Vec<usize>,
    /// Decode rows of the batched and the mixed measurement.
    pub batch: usize,
    /// Tokens of the prefill chunk (no sampling: a chunk in the middle of a prompt).
    pub chunk: usize,
    /// Most tokens per prefill step of the base state.
    pub max_batch_tokens: usize,
}

/// What was measured at one context.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ContextPoint {
    pub context: usize,
    /// One decode row.
    pub decode_1_ms: f64,
    /// `batch` decode rows.
    pub decode_batch_ms: f64,
    /// One `chunk`-token prefill row alone.
    pub chunk_ms: f64,
    /// `batch` decode rows beside one `chunk`-token prefill row.
    pub mixed_ms: f64,
    /// Tokens per second of the base state's last prefill step (`None` at context 0).
    pub prefill_tokens_per_second: Option<f64>,
}

impl ContextPoint {
    /// A table row: context, the four step times, the prefill rate.
    pub fn table_row(&self) -> String {
        let rate = self.prefill_tokens_per_second.map_or_else(|| "-".into(), |r| format!("{r:.0}"));
        format!(
            "{:>8}  {:>9.3}  {:>9.3}  {:>9.3}  {:>9.3}  {:>10}",
            self.context, self.decode_1_ms, self.decode_batch_ms, self.chunk_ms, self.mixed_ms, rate
        )
    }
}

/// The table header matching [`ContextPoint::table_row`].
pub fn table_header(sweep: &ContextSweep) -> String {
    format!(
        "{:>8}  {:>9}  {:>9}  {:>9}  {:>9}  {:>10}",
        "context",
        "decode 1",
        format!("decode {}", sweep.batch),
        format!("chunk {}", sweep.chunk),
        format!("{}+{}", sweep.batch, sweep.chunk),
        "prefill/s"
    )
}

/// Runs the sweep; deterministic token ids.
pub fn run_context_sweep(runner: &mut dyn Runner, sweep: &ContextSweep) -> Result<Vec<ContextPoint>> {
    if sweep.batch == 0 || sweep.chunk == 0 || sweep.max_batch_tokens == 0 {
        return Err(KernelError::InvalidInput(
            "context sweep: batch, chunk and max_batch_tokens must be at least 1".into(),
        ));
    }
    sweep.contexts.iter().map(|&context| measure_at(runner, sweep, context)).collect()
}

fn ids(from: usize, n: usize, vocab: usize) -> Vec<TokenId> {
    (from..from + n).map(|i| ((1000 + 37 * i) % vocab) as TokenId).collect()
}

fn measure_at(runner: &mut dyn Runner, sweep: &ContextSweep, context: usize) -> Result<ContextPoint> {
    let base = runner.alloc_state()?;
    let mut held = vec![base];
    let result = prefill(runner, base, context, sweep.max_batch_tokens)
        .and_then(|rate| timed_points(runner, sweep, base, &mut held).map(|times| (rate, times)));
    for s in held {
        runner.free_state(s)?;
    }
    let (rate, [decode_1, decode_batch, chunk, mixed]) = result?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok(ContextPoint {
        context,
        decode_1_ms: ms(decode_1),
        decode_batch_ms: ms(decode_batch),
        chunk_ms: ms(chunk),
        mixed_ms: ms(mixed),
        prefill_tokens_per_second: rate,
    })
}

/// Prefills `context` tokens into `state`; the rate of the last step.
fn prefill(runner: &mut dyn Runner, state: StateId, context: usize, max_batch_tokens: usize) -> Result<Option<f64>> {
    let vocab = runner.config().vocab_size;
    let mut rate = None;
    let mut done = 0;
    while done < context {
        let n = (context - done).min(max_batch_tokens);
        let row = RowInput { state, tokens: ids(done, n, vocab), sample: None };
        let start = Instant::now();
        runner.step(std::slice::from_ref(&row))?;
        rate = Some(n as f64 / start.elapsed().as_secs_f64().max(1e-9));
        done += n;
    }
    Ok(rate)
}

/// The four timed steps at one context, on forks of `base` (pushed to `held` as they are made).
fn timed_points(
    runner: &mut dyn Runner,
    sweep: &ContextSweep,
    base: StateId,
    held: &mut Vec<StateId>,
) -> Result<[Duration; 4]> {
    let vocab = runner.config().vocab_size;
    let mut fork = |runner: &mut dyn Runner| -> Result<StateId> {
        let s = runner.fork_state(base)?;
        held.push(s);
        Ok(s)
    };
    let decode = |state: StateId| RowInput {
        state,
        tokens: ids(7, 1, vocab),
        sample: Some(SampleRequest::new(SamplingParams::greedy(), 0)),
    };
    let one = vec![decode(fork(runner)?)];
    let batch: Vec<RowInput> = (0..sweep.batch).map(|_| fork(runner).map(decode)).collect::<Result<_>>()?;
    let chunk = RowInput { state: fork(runner)?, tokens: ids(11, sweep.chunk, vocab), sample: None };
    let mut mixed: Vec<RowInput> = (0..sweep.batch).map(|_| fork(runner).map(decode)).collect::<Result<_>>()?;
    mixed.push(RowInput { state: fork(runner)?, ..chunk.clone() });
    Ok([
        best_of_two(runner, &one)?,
        best_of_two(runner, &batch)?,
        best_of_two(runner, std::slice::from_ref(&chunk))?,
        best_of_two(runner, &mixed)?,
    ])
}

fn best_of_two(runner: &mut dyn Runner, rows: &[RowInput]) -> Result<Duration> {
    let mut timed = || -> Result<Duration> {
        let start = Instant::now();
        runner.step(rows)?;
        Ok(start.elapsed())
    };
    timed()?;
    Ok(timed()?.min(timed()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::cpu::CpuRunner;
    use crate::null_runner::NullRunner;
    use crate::synth::SyntheticWeights;

    #[test]
    fn the_sweep_measures_every_context_on_the_cpu() {
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let mut runner = CpuRunner::new(cfg.clone(), &SyntheticWeights::new(cfg, 1)).unwrap();
        let sweep = ContextSweep { contexts: vec![0, 40], batch: 2, chunk: 8, max_batch_tokens: 16 };
        let points = run_context_sweep(&mut runner, &sweep).unwrap();
        assert_eq!(points.iter().map(|p| p.context).collect::<Vec<_>>(), vec![0, 40]);
        assert_eq!(points[0].prefill_tokens_per_second, None);
        assert!(points[1].prefill_tokens_per_second.is_some_and(|r| r > 0.0));
        for p in &points {
            assert!([p.decode_1_ms, p.decode_batch_ms, p.chunk_ms, p.mixed_ms].iter().all(|&t| t > 0.0), "{p:?}");
        }
    }

    #[test]
    fn the_sweep_frees_every_state_it_makes() {
        let mut runner = NullRunner::new(ModelConfig::preset("k3-tiny").unwrap());
        let sweep = ContextSweep { contexts: vec![0, 100, 5], batch: 3, chunk: 4, max_batch_tokens: 32 };
        assert_eq!(run_context_sweep(&mut runner, &sweep).unwrap().len(), 3);
        assert_eq!(runner.num_states(), 0);
    }

    #[test]
    fn a_zero_sized_sweep_is_refused() {
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let mut runner = CpuRunner::new(cfg.clone(), &SyntheticWeights::new(cfg, 1)).unwrap();
        let sweep = ContextSweep { contexts: vec![8], batch: 0, chunk: 8, max_batch_tokens: 16 };
        assert!(
            matches!(run_context_sweep(&mut runner, &sweep), Err(KernelError::InvalidInput(m)) if m.contains("batch"))
        );
    }
}
