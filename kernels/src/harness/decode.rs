//! Decode benchmark over any [`Runner`]: batch-`B` greedy decoding after a prefill, optionally with
//! speculative verify windows of `draft_len` tokens (drafts are the last emitted token repeated, so
//! with the lossless rule almost nothing is accepted; with forced acceptance the runner's schedule
//! decides, which is how speculation speed is measured on synthetic weights).
//!
//! Invariant: timing covers only the decode steps; prefill and state allocation are excluded, and
//! every state is freed before returning.

use std::time::Instant;

use crate::error::Result;
use crate::runner::{RowInput, Runner, SampleRequest, SamplingParams, TokenId};

/// What to measure.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecodeBench {
    pub batch: usize,
    pub prompt_len: usize,
    /// Target steps to time.
    pub steps: usize,
    /// Draft tokens verified per step (0: plain decoding).
    pub draft_len: usize,
}

/// What was measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecodeBenchResult {
    pub config: DecodeBench,
    pub seconds: f64,
    pub generated_tokens: usize,
    pub tokens_per_second: f64,
    pub step_ms: f64,
    /// Target steps per generated token (1 for plain decoding; 1/AL with speculation).
    pub steps_per_token: f64,
    /// CPU time the process spent during the timed steps (all threads; Linux only), and generated
    /// tokens per CPU-second: the figure that stays meaningful on a shared, loaded machine.
    pub cpu_seconds: Option<f64>,
    pub tokens_per_cpu_second: Option<f64>,
}

/// User + system CPU seconds of this process so far, from `/proc/self/stat` (clock ticks of 1/100 s).
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Runs the benchmark; deterministic prompts of ordinary token ids.
pub fn run_decode_bench(runner: &mut dyn Runner, bench: &DecodeBench) -> Result<DecodeBenchResult> {
    let states = (0..bench.batch).map(|_| runner.alloc_state()).collect::<Result<Vec<_>>>()?;
    let result = timed_decode(runner, bench, &states);
    for s in states {
        runner.free_state(s)?;
    }
    result
}

fn timed_decode(runner: &mut dyn Runner, bench: &DecodeBench, states: &[crate::StateId]) -> Result<DecodeBenchResult> {
    let prompt = |row: usize| -> Vec<TokenId> {
        (0..bench.prompt_len.max(1)).map(|i| ((i * 7919 + row * 104_729 + 13) % 100_000) as TokenId).collect()
    };
    let prefill: Vec<RowInput> = states
        .iter()
        .enumerate()
        .map(|(row, s)| {
            let p = prompt(row);
            RowInput { state: *s, tokens: p[..p.len() - 1].to_vec(), sample: None }
        })
        .filter(|r| !r.tokens.is_empty())
        .collect();
    if !prefill.is_empty() {
        runner.step(&prefill)?;
    }
    let mut last: Vec<TokenId> = (0..states.len()).map(|row| *prompt(row).last().unwrap_or(&0)).collect();
    let sample = SampleRequest::new(SamplingParams::greedy(), bench.draft_len);
    let cpu_start = process_cpu_seconds();
    let start = Instant::now();
    let mut generated = 0usize;
    for _ in 0..bench.steps {
        let rows: Vec<RowInput> = states
            .iter()
            .zip(&last)
            .map(|(s, t)| RowInput { state: *s, tokens: vec![*t; bench.draft_len + 1], sample: Some(sample.clone()) })
            .collect();
        let out = runner.step(&rows)?;
        for (l, o) in last.iter_mut().zip(&out) {
            generated += o.tokens.len();
            *l = *o.tokens.last().unwrap_or(l);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu_seconds = cpu_start.zip(process_cpu_seconds()).map(|(a, b)| b - a);
    Ok(DecodeBenchResult {
        config: bench.clone(),
        seconds,
        generated_tokens: generated,
        tokens_per_second: generated as f64 / seconds,
        step_ms: seconds * 1e3 / bench.steps.max(1) as f64,
        steps_per_token: (bench.steps * states.len()) as f64 / generated.max(1) as f64,
        cpu_seconds,
        tokens_per_cpu_second: cpu_seconds.filter(|c| *c > 0.0).map(|c| generated as f64 / c),
    })
}
