//! The CUDA decode benchmark behind `sparkd bench --device cuda`: load time, decode step time and
//! tokens/s per batch, device time and launches per layer type, the distance to the HBM floor, the
//! cost of verify windows, and forced-acceptance speculation, as one serde report plus a table.
//!
//! Invariants:
//! - Step times are host wall-clock around `CudaRunner::step`, which ends with a device
//!   synchronisation, so they include launch overhead and the token copy-back (the served path).
//!   Prefill, warm-up, the profiled step and the traced step are never inside a timed step.
//! - Per-layer-type times come from one extra profiled step (device events at the span marks of
//!   `cuda::forward`); launch counts are exact counts of the launches issued in each span.
//! - The HBM floor of a step is the bytes that step must move once: every non-expert weight, the
//!   experts the step's tokens actually routed to (from a traced step of the same batch), the embedding
//!   rows, the KDA states and conv windows (read and written), the MLA latents read and appended.
//!   It is divided by the device-to-device copy bandwidth measured in the same run (bytes read plus
//!   bytes written), so `floor_fraction = floor_ms / step_ms` is the share of the copy speed reached.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;

use crate::acceptance::{AcceptanceMode, SyntheticSchedule};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::cuda::device::{device_err, DeviceInfo};
use crate::cuda::forward::{SPAN_DENSE, SPAN_HEAD, SPAN_KDA, SPAN_MLA, SPAN_MOE};
use crate::cuda::gpu::{Gemm, Gpu, Span};
use crate::cuda::runner::{CudaRunner, LoadStats};
use crate::cuda::weights::{DevFfn, DevLinear, DevMixer, DevMlp, DevNorm, DevWeights};
use crate::dspark::config::DrafterConfig;
use crate::dspark::DrafterSource;
use crate::error::{KernelError, Result};
use crate::harness::draft_bench::{self, DraftCost, ForcedRound};
use crate::harness::state_bench::{self, StateMoves};
use crate::launches::FedRow;
use crate::routing::Routing;
use crate::runner::{RowInput, RowOutput, Runner, SampleRequest, SamplingParams, StateId, TokenId};
use crate::synth::SyntheticWeights;
use crate::tensor::WeightSource;

/// What to measure.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CudaBenchOptions {
    pub ordinal: usize,
    /// A preset name (`k3-tiny`, `k3-mini`, `k3-mini-wide`), run on synthetic weights of `weights_seed`.
    pub preset: String,
    pub weights_seed: u64,
    /// A checkpoint folder (`config.json` + safetensors) to load instead; `preset` and `weights_seed` are then
    /// unused. A synthetic checkpoint written by `sparkd synth` gives the same weights as its preset and seed.
    pub model: Option<PathBuf>,
    pub gemm: Gemm,
    /// Whether repeated step shapes run as CUDA graphs (the served default).
    pub graphs: bool,
    /// With graphs on, also time every batch of the sweep with graphs off, in the same process.
    pub compare_eager: bool,
    /// Also time every batch of the sweep with programmatic dependent launch off, in the same process.
    pub compare_serialized: bool,
    /// Batch sizes of the decode sweep.
    pub batches: Vec<usize>,
    /// Timed steps per measurement (after two warm-up steps).
    pub steps: usize,
    /// Tokens prefilled into every sequence before decoding.
    pub prompt_len: usize,
    /// Temperature of the decode sweep's rows (0: greedy; above 0 a seeded sample, as served requests draw).
    pub temperature: f32,
    /// Draft tokens per row in the decode sweep (0: plain decoding).
    pub draft_len: usize,
    /// Forced acceptance length for the decode sweep (needs `draft_len > 0`); None: the lossless rule.
    pub synthetic_al: Option<f64>,
    /// Verify windows `ℓ` timed at batch 1 (plus `ℓ = 0`), under the lossless greedy rule.
    pub verify_lens: Vec<usize>,
    /// Forced acceptance at batch 1: `(ℓ, acceptance length)`; with a drafter, also as rounds that draft.
    pub forced: Option<(usize, f64)>,
    /// Batch sizes at which the DSpark draft is timed beside the step (empty: no drafter is attached). The
    /// drafter is the checkpoint's `drafter/` folder with `model`, else the preset's synthetic drafter.
    pub draft_batches: Vec<usize>,
}

impl CudaBenchOptions {
    /// The defaults for a preset: batches 1..64, ℓ = 1..8, AL 6 at ℓ = 7.
    pub fn for_preset(preset: &str) -> Self {
        CudaBenchOptions {
            ordinal: 0,
            preset: preset.into(),
            weights_seed: 0,
            model: None,
            gemm: Gemm::BatchInvariant,
            graphs: true,
            compare_eager: false,
            compare_serialized: false,
            batches: vec![1, 2, 4, 8, 16, 32, 64],
            steps: 16,
            prompt_len: 128,
            temperature: 0.0,
            draft_len: 0,
            synthetic_al: None,
            verify_lens: (1..=8).collect(),
            forced: Some((7, 6.0)),
            draft_batches: vec![1, 16],
        }
    }
}

/// Device time and launches of one layer type in a profiled step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TypeCost {
    /// `kda`, `mla` (mixers), `dense`, `moe` (FFNs) or `head` (final AttnRes, norm, lm_head).
    pub kind: String,
    pub layers: usize,
    pub ms: f64,
    pub ms_per_layer: f64,
    pub launches_per_layer: f64,
    pub memory_ops_per_layer: f64,
}

/// Device time of one op of the forward in a profiled step, over all layers that run it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpCost {
    /// A span label: `kda` (the read + norm before a KDA mixer), `kda.recurrence`, `moe.experts`, ...
    pub op: String,
    pub ms: f64,
    /// Spans summed (layers that run the op).
    pub count: usize,
    pub launches: u64,
}

/// The bytes one step must move, and the time they take at the measured copy bandwidth.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Floor {
    /// Every weight but the embedding table and the routed experts.
    pub dense_weight_bytes: u64,
    /// The routed experts the step's tokens chose (each counted once per layer).
    pub expert_bytes: u64,
    /// Distinct (layer, expert) pairs read.
    pub experts_read: usize,
    /// The most (token, slot) pairs that one expert took in one layer: how unevenly the step's tokens share the
    /// experts (the grouped expert kernels read an expert's weights once per chunk of its pairs).
    pub busiest_expert_pairs: usize,
    pub embed_bytes: u64,
    /// KDA states and conv windows, read and written.
    pub state_bytes: u64,
    /// MLA latents read, and the new ones written.
    pub kv_bytes: u64,
    pub total_bytes: u64,
    pub floor_ms: f64,
}

/// One batch size of the decode sweep.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BatchResult {
    pub batch: usize,
    pub draft_len: usize,
    pub step_ms_median: f64,
    pub step_ms_mean: f64,
    /// The same steps with CUDA graphs off (only with `compare_eager`).
    pub eager_step_ms_median: Option<f64>,
    /// The same steps with programmatic dependent launch off (only with `compare_serialized`).
    pub serialized_step_ms_median: Option<f64>,
    /// Plain decoding only: the same steps launched ahead as the daemon serves them (`crate::launches`: each
    /// step launched fed on the device before the previous one is collected), the interval between collects.
    pub ahead_step_ms_median: Option<f64>,
    pub tokens_per_second: f64,
    /// Generated tokens per row per step (1 for plain decoding).
    pub tokens_per_step_per_row: f64,
    /// Device time of the profiled step, first to last mark.
    pub profiled_device_ms: f64,
    pub launches_per_step: u64,
    pub memory_ops_per_step: u64,
    /// Timed steps replayed from a CUDA graph, and the nodes of the graph captured for this batch (0: none).
    pub graphed_steps: u64,
    pub graph_nodes: usize,
    pub by_type: Vec<TypeCost>,
    /// The profiled step op by op.
    pub by_op: Vec<OpCost>,
    pub floor: Floor,
    /// `floor.floor_ms / step_ms_median`.
    pub floor_fraction: f64,
}

/// A verify window of `draft_len` drafts at batch 1.
#[derive(Clone, Debug, serde::Serialize)]
pub struct VerifyCost {
    pub draft_len: usize,
    pub step_ms_median: f64,
    /// Over the `ℓ = 0` step.
    pub relative_to_decode: f64,
    /// Device time of the MoE layers in a profiled step of this window, and the routed-expert bytes its
    /// tokens read (more tokens route to more experts).
    pub moe_ms: f64,
    pub expert_bytes: u64,
    /// `(step - MoE) / (decode step - its MoE)`: the window's cost with the expert reads set aside.
    pub relative_without_moe: f64,
    /// Device time of the profiled window step's forward (first to last mark), and the forward op by op.
    pub profiled_device_ms: f64,
    pub by_op: Vec<OpCost>,
}

/// Forced acceptance at batch 1.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ForcedResult {
    pub draft_len: usize,
    pub acceptance_length: f64,
    /// Tokens emitted per verify step, measured.
    pub measured_acceptance_length: f64,
    pub step_ms_median: f64,
    pub tokens_per_second: f64,
}

/// The whole report.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CudaBenchReport {
    pub options: CudaBenchOptions,
    pub device: DeviceInfo,
    pub load: LoadStats,
    /// Device-to-device copy bandwidth, bytes read plus bytes written per second.
    pub copy_bytes_per_second: f64,
    /// Whether the steps ran with programmatic dependent launch ([`Gpu::dependent_launch`]).
    pub dependent_launch: bool,
    pub decode: Vec<BatchResult>,
    pub verify: Vec<VerifyCost>,
    pub forced: Option<ForcedResult>,
    /// One sequence's state exported, imported and forked at the bench's context (`harness::state_bench`).
    pub state_moves: StateMoves,
    /// The draft's cost beside the step (see `harness::draft_bench`).
    pub draft: Vec<DraftCost>,
    /// The forced acceptance of `forced` as rounds that draft with the model: the speculative figure with
    /// the draft's cost in it.
    pub forced_with_draft: Option<ForcedRound>,
}

/// Runs everything `opts` asks for on one device.
pub fn run(opts: &CudaBenchOptions) -> Result<CudaBenchReport> {
    if opts.steps == 0 || opts.batches.contains(&0) {
        return Err(KernelError::InvalidInput("benchmark steps and batch sizes must be at least 1".into()));
    }
    if !(opts.temperature.is_finite() && opts.temperature >= 0.0) {
        return Err(KernelError::InvalidInput(format!("temperature {} is not a number at least 0", opts.temperature)));
    }
    if opts.synthetic_al.is_some() && opts.draft_len == 0 {
        return Err(KernelError::InvalidInput("a synthetic acceptance length needs --draft-len of at least 1".into()));
    }
    let checkpoint = opts.model.as_deref().map(Checkpoint::open).transpose()?;
    let synthetic;
    let (cfg, src): (ModelConfig, &dyn WeightSource) = match &checkpoint {
        Some(c) => (c.config().clone(), c),
        None => {
            let cfg = ModelConfig::preset(&opts.preset)?;
            synthetic = SyntheticWeights::new(cfg.clone(), opts.weights_seed);
            (cfg, &synthetic)
        }
    };
    let mut runner = CudaRunner::new(opts.ordinal, cfg, src)?;
    runner.set_gemm(opts.gemm);
    runner.set_graphs(opts.graphs);
    let copy_bytes_per_second = copy_bandwidth(runner.gpu())?;
    let sweep_mode = match opts.synthetic_al {
        Some(al) => AcceptanceMode::Synthetic(SyntheticSchedule::from_acceptance_length(al, opts.draft_len)?),
        None => AcceptanceMode::Standard,
    };
    runner.set_acceptance(sweep_mode);
    let mut decode = Vec::new();
    for &batch in &opts.batches {
        decode.push(measure_batch(&mut runner, opts, batch, opts.draft_len, copy_bytes_per_second)?);
    }
    runner.set_acceptance(AcceptanceMode::Standard);
    let mut verify = Vec::new();
    if !opts.verify_lens.is_empty() {
        // The windows are compared with graphs as served; an eager timing would be made and dropped.
        let opts = &CudaBenchOptions { compare_eager: false, compare_serialized: false, ..opts.clone() };
        let base = measure_batch(&mut runner, opts, 1, 0, copy_bytes_per_second)?;
        let moe_ms = |r: &BatchResult| r.by_type.iter().filter(|t| t.kind == SPAN_MOE).map(|t| t.ms).sum::<f64>();
        for &l in &opts.verify_lens {
            let r = measure_batch(&mut runner, opts, 1, l, copy_bytes_per_second)?;
            verify.push(VerifyCost {
                draft_len: l,
                step_ms_median: r.step_ms_median,
                relative_to_decode: r.step_ms_median / base.step_ms_median,
                moe_ms: moe_ms(&r),
                expert_bytes: r.floor.expert_bytes,
                relative_without_moe: (r.step_ms_median - moe_ms(&r)) / (base.step_ms_median - moe_ms(&base)),
                profiled_device_ms: r.profiled_device_ms,
                by_op: r.by_op,
            });
        }
    }
    let forced = match opts.forced {
        Some((l, al)) => {
            runner.set_acceptance(AcceptanceMode::Synthetic(SyntheticSchedule::from_acceptance_length(al, l)?));
            let t = timed_steps(&mut runner, opts, 1, l)?;
            runner.set_acceptance(AcceptanceMode::Standard);
            Some(ForcedResult {
                draft_len: l,
                acceptance_length: al,
                measured_acceptance_length: t.tokens_per_row_step,
                step_ms_median: t.median_ms,
                tokens_per_second: t.tokens_per_second,
            })
        }
        None => None,
    };
    let state_moves = state_bench::state_moves(&mut runner, opts.prompt_len, opts.steps)?;
    // Last: an attached drafter makes every later target step commit its taps.
    let (mut draft, mut forced_with_draft) = (Vec::new(), None);
    if !opts.draft_batches.is_empty() {
        runner.attach_drafter(drafter_source(opts, runner.config())?)?;
        draft = draft_bench::draft_costs(&mut runner, &opts.draft_batches, opts.prompt_len, opts.steps)?;
        if let Some((l, al)) = opts.forced {
            forced_with_draft = Some(draft_bench::forced_round(&mut runner, l, al, opts.prompt_len, opts.steps)?);
        }
    }
    Ok(CudaBenchReport {
        options: opts.clone(),
        device: runner.gpu().info.clone(),
        load: runner.load_stats().clone(),
        copy_bytes_per_second,
        dependent_launch: runner.gpu().dependent_launch(),
        decode,
        verify,
        forced,
        state_moves,
        draft,
        forced_with_draft,
    })
}

/// The drafter the bench attaches: `model/drafter` when benchmarking a checkpoint, else the preset's synthetic
/// drafter (seeded like the target).
fn drafter_source(opts: &CudaBenchOptions, target: &ModelConfig) -> Result<DrafterSource> {
    match &opts.model {
        Some(dir) => DrafterSource::checkpoint(&dir.join("drafter"), target),
        None => Ok(DrafterSource::synthetic(DrafterConfig::preset(&opts.preset)?, opts.weights_seed)),
    }
}

/// Device-to-device copy bandwidth over two 2 GiB buffers (bytes read plus written per second),
/// the median of 10 copies after 2 warm-ups, timed with device events.
pub fn copy_bandwidth(gpu: &Gpu) -> Result<f64> {
    let bytes = 2usize << 30;
    let (a, b) = (gpu.zeros::<u8>(bytes)?, gpu.zeros::<u8>(bytes)?);
    let mut times = Vec::new();
    for i in 0..12 {
        let start =
            gpu.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| device_err("event", e))?;
        gpu.copy::<u8>(gpu.ptr(&b), gpu.ptr(&a), bytes)?;
        let end = gpu.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| device_err("event", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| device_err("event time", e))? as f64;
        if i >= 2 {
            times.push(ms);
        }
    }
    Ok(2.0 * bytes as f64 / (median(&mut times) * 1e-3))
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Deterministic prompt tokens of row `row`.
fn prompt(len: usize, row: usize) -> Vec<TokenId> {
    (0..len.max(1)).map(|i| ((i * 7919 + row * 104_729 + 13) % 100_000) as TokenId).collect()
}

/// Tokens of all rows in one prefill step of [`Batch::new`] (prompts longer than that are chunked, as served).
const PREFILL_STEP_TOKENS: usize = 8192;

/// Sequences prefilled with their prompts, each one's last token, and the decode rows' sampling.
pub(super) struct Batch {
    pub(super) states: Vec<StateId>,
    pub(super) last: Vec<TokenId>,
    params: SamplingParams,
}

impl Batch {
    /// `batch` greedy sequences prefilled with `prompt_len` tokens, in chunks of [`PREFILL_STEP_TOKENS`] per step.
    pub(super) fn new(runner: &mut CudaRunner, batch: usize, prompt_len: usize) -> Result<Self> {
        let states = (0..batch).map(|_| runner.alloc_state()).collect::<Result<Vec<_>>>()?;
        let prompts: Vec<Vec<TokenId>> = (0..batch).map(|r| prompt(prompt_len, r)).collect();
        let fed = prompt_len.max(1) - 1;
        let chunk = (PREFILL_STEP_TOKENS / batch.max(1)).max(64);
        for from in (0..fed).step_by(chunk) {
            let to = (from + chunk).min(fed);
            let rows: Vec<RowInput> = states
                .iter()
                .zip(&prompts)
                .map(|(s, p)| RowInput { state: *s, tokens: p[from..to].to_vec(), sample: None })
                .collect();
            runner.step(&rows)?;
        }
        let last = prompts.iter().map(|p| p[p.len() - 1]).collect();
        Ok(Batch { states, last, params: SamplingParams::greedy() })
    }

    /// Decode rows sampled at `temperature` (seeded per row), or greedy at 0.
    pub(super) fn sampled(mut self, temperature: f32) -> Self {
        if temperature > 0.0 {
            self.params = SamplingParams { temperature, top_p: 1.0, top_k: 0, seed: 17, logprobs: None };
        }
        self
    }

    fn rows(&self, draft_len: usize) -> Vec<RowInput> {
        let sample = SampleRequest::new(self.params.clone(), draft_len);
        self.states
            .iter()
            .zip(&self.last)
            .map(|(s, t)| RowInput { state: *s, tokens: vec![*t; draft_len + 1], sample: Some(sample.clone()) })
            .collect()
    }

    /// One step; returns the tokens generated over all rows.
    fn step(
        &mut self,
        runner: &mut CudaRunner,
        draft_len: usize,
        trace: Option<&mut Vec<Vec<Routing<f32>>>>,
    ) -> Result<usize> {
        let out = runner.step_with_trace(&self.rows(draft_len), trace)?;
        Ok(self.advance(&out))
    }

    /// One step verifying `drafts[r]` after row r's last token (every row drafted); returns the tokens
    /// generated over all rows.
    pub(super) fn step_drafted(&mut self, runner: &mut CudaRunner, drafts: &[Vec<TokenId>]) -> Result<usize> {
        let rows: Vec<RowInput> = self
            .states
            .iter()
            .zip(&self.last)
            .zip(drafts)
            .map(|((s, t), d)| {
                let sample = SampleRequest::new(SamplingParams::greedy(), d.len());
                let tokens = std::iter::once(*t).chain(d.iter().copied()).collect();
                RowInput { state: *s, tokens, sample: Some(sample) }
            })
            .collect();
        let out = runner.step(&rows)?;
        Ok(self.advance(&out))
    }

    /// Moves every row's last token to its newest output; returns the tokens generated over all rows.
    fn advance(&mut self, out: &[RowOutput]) -> usize {
        let mut generated = 0;
        for (l, o) in self.last.iter_mut().zip(out) {
            generated += o.tokens.len();
            *l = *o.tokens.last().unwrap_or(l);
        }
        generated
    }

    pub(super) fn free(self, runner: &mut CudaRunner) -> Result<()> {
        self.states.into_iter().try_for_each(|s| runner.free_state(s))
    }
}

pub(super) struct Timed {
    pub(super) median_ms: f64,
    mean_ms: f64,
    tokens_per_second: f64,
    tokens_per_row_step: f64,
    /// Timed steps replayed from a CUDA graph.
    graphed: u64,
}

/// The median step time with a runner setting turned off (`set(runner, false)`), then the setting put back to `was`
/// whether or not the timing succeeded.
fn median_with_off(
    runner: &mut CudaRunner,
    b: &mut Batch,
    steps: usize,
    draft_len: usize,
    was: bool,
    set: fn(&mut CudaRunner, bool),
) -> Result<f64> {
    set(runner, false);
    let off = time_steps(runner, b, steps, draft_len);
    set(runner, was);
    Ok(off?.median_ms)
}

pub(super) fn time_steps(runner: &mut CudaRunner, b: &mut Batch, steps: usize, draft_len: usize) -> Result<Timed> {
    for _ in 0..2 {
        b.step(runner, draft_len, None)?;
    }
    let (mut times, mut generated) = (Vec::with_capacity(steps), 0usize);
    let replayed_before = runner.model().graph_stats().replayed;
    for _ in 0..steps {
        let t0 = Instant::now();
        generated += b.step(runner, draft_len, None)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let graphed = runner.model().graph_stats().replayed - replayed_before;
    let total_s: f64 = times.iter().sum::<f64>() * 1e-3;
    let mean_ms = total_s * 1e3 / steps as f64;
    Ok(Timed {
        median_ms: median(&mut times),
        mean_ms,
        tokens_per_second: generated as f64 / total_s,
        tokens_per_row_step: generated as f64 / (steps * b.states.len()) as f64,
        graphed,
    })
}

/// The median interval between collects of `steps` plain decode steps launched ahead (`crate::launches`), after
/// two warm-up steps: the step time with the host's work per step hidden behind the device's, as served.
fn time_steps_ahead(runner: &mut CudaRunner, b: &mut Batch, steps: usize) -> Result<f64> {
    let fed: Vec<FedRow> = b.states.iter().map(|&state| FedRow { state, params: b.params.clone() }).collect();
    runner.launch(&b.rows(0))?;
    let mut times = Vec::with_capacity(steps);
    let mut t0 = Instant::now();
    for i in 0..steps + 2 {
        if i + 1 < steps + 2 {
            runner.launch_fed(&fed)?;
        }
        let out = runner.collect()?;
        b.advance(&out);
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        t0 = Instant::now();
    }
    Ok(median(&mut times))
}

fn timed_steps(runner: &mut CudaRunner, opts: &CudaBenchOptions, batch: usize, draft_len: usize) -> Result<Timed> {
    let mut b = Batch::new(runner, batch, opts.prompt_len)?.sampled(opts.temperature);
    let t = time_steps(runner, &mut b, opts.steps, draft_len);
    b.free(runner)?;
    t
}

fn measure_batch(
    runner: &mut CudaRunner,
    opts: &CudaBenchOptions,
    batch: usize,
    draft_len: usize,
    copy_bytes_per_second: f64,
) -> Result<BatchResult> {
    let mut b = Batch::new(runner, batch, opts.prompt_len)?.sampled(opts.temperature);
    let result = measure_prefilled(runner, opts, &mut b, draft_len, copy_bytes_per_second);
    b.free(runner)?;
    result
}

fn measure_prefilled(
    runner: &mut CudaRunner,
    opts: &CudaBenchOptions,
    b: &mut Batch,
    draft_len: usize,
    copy_bytes_per_second: f64,
) -> Result<BatchResult> {
    let batch = b.states.len();
    let captured_before = runner.model().graph_stats().captured;
    let timed = time_steps(runner, b, opts.steps, draft_len)?;
    let graphs = runner.model().graph_stats();
    let eager_step_ms_median = if opts.graphs && opts.compare_eager {
        Some(median_with_off(runner, b, opts.steps, draft_len, true, CudaRunner::set_graphs)?)
    } else {
        None
    };
    let ahead_step_ms_median = match draft_len {
        0 => Some(time_steps_ahead(runner, b, opts.steps)?),
        _ => None,
    };
    let serialized_step_ms_median = if opts.compare_serialized {
        let dependent = runner.gpu().dependent_launch();
        Some(median_with_off(runner, b, opts.steps, draft_len, dependent, CudaRunner::set_dependent_launch)?)
    } else {
        None
    };
    // One profiled step (device events at the span marks), then one traced step for the experts read.
    let issued_before = runner.gpu().issued();
    runner.gpu().start_profile();
    let stepped = b.step(runner, draft_len, None);
    let spans = runner.gpu().finish_profile()?;
    stepped?;
    let issued_after = runner.gpu().issued();
    let len_at_trace = runner.state_len(b.states[0])?;
    let mut trace = Vec::new();
    b.step(runner, draft_len, Some(&mut trace))?;
    let floor = floor(runner, b, draft_len, len_at_trace, &trace, copy_bytes_per_second);
    Ok(BatchResult {
        batch,
        draft_len,
        step_ms_median: timed.median_ms,
        step_ms_mean: timed.mean_ms,
        eager_step_ms_median,
        serialized_step_ms_median,
        ahead_step_ms_median,
        tokens_per_second: timed.tokens_per_second,
        tokens_per_step_per_row: timed.tokens_per_row_step,
        profiled_device_ms: spans.iter().map(|s| s.ms).sum(),
        launches_per_step: issued_after.0 - issued_before.0,
        memory_ops_per_step: issued_after.1 - issued_before.1,
        graphed_steps: timed.graphed,
        graph_nodes: if graphs.captured > captured_before { graphs.last_capture_nodes } else { 0 },
        by_type: by_type(&spans),
        by_op: by_op(&spans),
        floor_fraction: floor.floor_ms / timed.median_ms,
        floor,
    })
}

/// Sums the spans per layer type.
fn by_type(spans: &[Span]) -> Vec<TypeCost> {
    [SPAN_KDA, SPAN_MLA, SPAN_DENSE, SPAN_MOE, SPAN_HEAD]
        .iter()
        .filter_map(|kind| {
            let of: Vec<&Span> = spans.iter().filter(|s| span_kind(s.label) == *kind).collect();
            let layers = spans.iter().filter(|s| s.label == *kind).count();
            if layers == 0 {
                return None;
            }
            let (n, ms) = (layers as f64, of.iter().map(|s| s.ms).sum::<f64>());
            Some(TypeCost {
                kind: kind.to_string(),
                layers,
                ms,
                ms_per_layer: ms / n,
                launches_per_layer: of.iter().map(|s| s.launches).sum::<u64>() as f64 / n,
                memory_ops_per_layer: of.iter().map(|s| s.memory_ops).sum::<u64>() as f64 / n,
            })
        })
        .collect()
}

/// The layer kind of a span label (`moe.experts` -> `moe`).
fn span_kind(label: &str) -> &str {
    label.split('.').next().unwrap_or(label)
}

/// Sums the spans per label (a kind's read + norm under the kind's own label, its ops under `kind.op`), in
/// step order.
pub(super) fn by_op(spans: &[Span]) -> Vec<OpCost> {
    let mut out: Vec<OpCost> = Vec::new();
    for s in spans {
        match out.iter_mut().find(|o| o.op == s.label) {
            Some(o) => {
                o.ms += s.ms;
                o.count += 1;
                o.launches += s.launches;
            }
            None => out.push(OpCost { op: s.label.to_string(), ms: s.ms, count: 1, launches: s.launches }),
        }
    }
    out
}

fn lin(l: &DevLinear) -> u64 {
    (l.w.len() * 2) as u64
}

fn mlp(m: &DevMlp) -> u64 {
    (m.gate_up.w.len() * 2) as u64 + lin(&m.down)
}

fn norm(n: &DevNorm) -> u64 {
    (n.w.len() * 2) as u64
}

/// `(non-expert weight bytes, bytes of one routed expert per MoE layer)` of the model.
fn weight_bytes(w: &DevWeights, cfg: &ModelConfig) -> (u64, u64) {
    let mut dense = (w.out_res.len() * 4) as u64 + norm(&w.norm) + lin(&w.lm_head);
    let mut per_expert = 0u64;
    for layer in &w.layers {
        dense += ((layer.attn_res.len() + layer.mlp_res.len()) * 4) as u64
            + norm(&layer.input_norm)
            + norm(&layer.post_norm);
        dense += match &layer.mixer {
            DevMixer::Kda(k) => {
                (k.in_proj.w.len() * 2) as u64
                    + lin(&k.o_proj)
                    + lin(&k.f_b_proj)
                    + ((k.conv.iter().map(|c| c.len()).sum::<usize>() + k.a.len() + k.dt_bias.len() + k.o_norm.len())
                        * 4) as u64
            }
            DevMixer::Mla(m) => {
                (m.in_proj.w.len() * 2) as u64
                    + [&m.q_b_proj, &m.kv_b_proj, &m.o_proj].iter().map(|l| lin(l)).sum::<u64>()
                    + norm(&m.q_a_norm)
                    + norm(&m.kv_a_norm)
            }
        };
        dense += match &layer.ffn {
            DevFfn::Dense(m) => mlp(m),
            DevFfn::Moe(m) => {
                // The checkpoint's bytes of one expert's three matrices (the device's tiling pads some shapes;
                // the kernels never read the padding).
                let matrix = cfg.moe.expert_dim * cfg.moe.latent_dim;
                per_expert = (3 * (matrix / 2 + matrix / crate::mxfp4::GROUP_SIZE)) as u64;
                lin(&m.router)
                    + (m.bias.len() * 4) as u64
                    + lin(&m.down)
                    + lin(&m.up)
                    + norm(&m.norm)
                    + m.shared.as_ref().map_or(0, mlp)
            }
        };
    }
    (dense, per_expert)
}

/// The bytes of one step of `b` (see the module invariants); `len` is the sequences' length before it.
fn floor(
    runner: &CudaRunner,
    b: &Batch,
    draft_len: usize,
    len: usize,
    trace: &[Vec<Routing<f32>>],
    copy_bytes_per_second: f64,
) -> Floor {
    let cfg = &runner.model().cfg;
    let (dense, per_expert) = weight_bytes(&runner.model().weights, cfg);
    let experts_read: usize = trace
        .iter()
        .map(|layer| layer.iter().flat_map(|r| r.experts.iter().copied()).collect::<BTreeSet<_>>().len())
        .sum();
    let busiest_expert_pairs = trace
        .iter()
        .flat_map(|layer| {
            let mut pairs = BTreeMap::<usize, usize>::new();
            for e in layer.iter().flat_map(|r| r.experts.iter().copied()) {
                *pairs.entry(e).or_default() += 1;
            }
            pairs.into_values().max()
        })
        .max()
        .unwrap_or(0);
    let rows = b.states.len() as u64;
    let window = (draft_len + 1) as u64;
    let k = &cfg.kda;
    let kda_state = (k.num_heads * k.head_dim * k.head_dim * 4 + 3 * (k.conv_kernel - 1) * k.proj_dim() * 2) as u64;
    let latent = (cfg.mla.latent_dim() * 2) as u64;
    let mut f = Floor {
        dense_weight_bytes: dense,
        expert_bytes: experts_read as u64 * per_expert,
        experts_read,
        busiest_expert_pairs,
        embed_bytes: rows * window * (cfg.hidden_size * 2) as u64,
        state_bytes: 2 * rows * cfg.kda_layers().len() as u64 * kda_state,
        kv_bytes: rows * cfg.mla_layers().len() as u64 * (len as u64 + window) * latent,
        ..Floor::default()
    };
    f.total_bytes = f.dense_weight_bytes + f.expert_bytes + f.embed_bytes + f.state_bytes + f.kv_bytes;
    f.floor_ms = f.total_bytes as f64 / copy_bytes_per_second * 1e3;
    f
}

impl CudaBenchReport {
    /// A readable summary of the report.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let o = &self.options;
        s += &format!(
            "sparkd bench: {} on {} ({:?} GEMM, CUDA graphs {}, dependent launch {}), prompt {} tokens, {} timed \
             steps, {}\n",
            o.model.as_ref().map_or_else(|| o.preset.clone(), |dir| dir.display().to_string()),
            self.device.name,
            o.gemm,
            if o.graphs { "on" } else { "off" },
            if self.dependent_launch { "on" } else { "off" },
            o.prompt_len,
            o.steps,
            if o.temperature > 0.0 { format!("sampled at temperature {}", o.temperature) } else { "greedy".into() }
        );
        s += &format!(
            "load: {:.1} GB of weights in {:.1} s ({:.2} GB/s; host fetch/generation {:.1} s, upload {:.1} s); kernels ready \
             in {:.2} s; copy bandwidth {:.0} GB/s (read+write)\n",
            self.load.weight_bytes as f64 / 1e9,
            self.load.weights_seconds,
            self.load.weight_bytes as f64 / 1e9 / self.load.weights_seconds,
            self.load.fetch_seconds,
            self.load.upload_seconds,
            self.load.kernel_setup_seconds,
            self.copy_bytes_per_second / 1e9
        );
        s +=
            "batch  step ms  ahead ms  eager ms  serial ms  tok/s     floor ms  floor%  launches/step  graph nodes  | per layer: kind ms \
             (launches)\n";
        for r in &self.decode {
            let types: Vec<String> = r
                .by_type
                .iter()
                .map(|t| format!("{} {:.3} ({:.0})", t.kind, t.ms_per_layer, t.launches_per_layer))
                .collect();
            s += &format!(
                "{:>5}  {:>7.3}  {:>8}  {:>8}  {:>9}  {:>8.1}  {:>8.3}  {:>5.1}%  {:>13}  {:>11}  | {}\n",
                r.batch,
                r.step_ms_median,
                r.ahead_step_ms_median.map_or("-".to_string(), |ms| format!("{ms:.3}")),
                r.eager_step_ms_median.map_or("-".to_string(), |ms| format!("{ms:.3}")),
                r.serialized_step_ms_median.map_or("-".to_string(), |ms| format!("{ms:.3}")),
                r.tokens_per_second,
                r.floor.floor_ms,
                100.0 * r.floor_fraction,
                r.launches_per_step,
                r.graph_nodes,
                types.join(", ")
            );
            let ops: Vec<String> = r.by_op.iter().map(|o| format!("{} {:.3}", o.op, o.ms)).collect();
            s += &format!("       ops (ms per step): {}\n", ops.join(", "));
        }
        if !self.verify.is_empty() {
            s += "verify window at batch 1 (lossless greedy): ℓ  step ms  ×decode  MoE ms  expert MB  ×decode without MoE\n";
            for v in &self.verify {
                s += &format!(
                    "  {:>2}  {:>7.3}  {:>5.2}  {:>6.3}  {:>9.0}  {:>5.2}\n",
                    v.draft_len,
                    v.step_ms_median,
                    v.relative_to_decode,
                    v.moe_ms,
                    v.expert_bytes as f64 / 1e6,
                    v.relative_without_moe
                );
            }
        }
        if let Some(f) = &self.forced {
            s += &format!(
                "forced AL {} at ℓ = {}, batch 1: measured AL {:.2}, step {:.3} ms, {:.1} tokens/s\n",
                f.acceptance_length, f.draft_len, f.measured_acceptance_length, f.step_ms_median, f.tokens_per_second
            );
        }
        let m = &self.state_moves;
        s += &format!(
            "one state of {} tokens ({:.1} MB on the device, {:.1} MB exported): export {:.3} ms, import {:.3} ms, \
             fork {:.3} ms\n",
            m.tokens,
            m.device_bytes as f64 / 1e6,
            m.host_bytes as f64 / 1e6,
            m.export_ms_median,
            m.import_ms_median,
            m.fork_ms_median
        );
        if !self.draft.is_empty() {
            s += "DSpark draft (drafter attached): batch  γ  step ms  greedy ms  ×step  sampled ms  ×step  context ms in \
                  the step\n";
            for d in &self.draft {
                s += &format!(
                    "  {:>5}  {}  {:>7.3}  {:>9.3}  {:>5.2}  {:>10.3}  {:>5.2}  {:>6.3}\n",
                    d.batch,
                    d.block_size,
                    d.step_ms_median,
                    d.greedy_ms_median,
                    d.greedy_relative_to_step,
                    d.sampled_ms_median,
                    d.sampled_relative_to_step,
                    d.step_context_ms
                );
                let ops: Vec<String> = d.greedy_by_op.iter().map(|o| format!("{} {:.3}", o.op, o.ms)).collect();
                s += &format!("         greedy draft by span (ms): {}\n", ops.join(", "));
            }
        }
        if let Some(f) = &self.forced_with_draft {
            s += &format!(
                "forced AL {} at ℓ = {}, batch 1, drafting with the model: measured AL {:.2}, draft {:.3} + step {:.3} = \
                 round {:.3} ms, {:.1} tokens/s (draft included)\n",
                f.acceptance_length,
                f.draft_len,
                f.measured_acceptance_length,
                f.draft_ms_median,
                f.step_ms_median,
                f.round_ms_median,
                f.tokens_per_second
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(label: &'static str, ms: f64, launches: u64) -> Span {
        Span { label, ms, launches, memory_ops: 0 }
    }

    #[test]
    fn a_kind_sums_its_own_span_and_its_op_spans_per_layer() {
        let spans = [
            span("embed", 0.001, 1),
            span("kda", 0.01, 1),
            span("kda.in_proj", 0.1, 2),
            span("moe", 0.02, 1),
            span("moe.experts", 0.2, 2),
            span("kda", 0.01, 1),
            span("kda.in_proj", 0.1, 2),
            span("head", 0.01, 2),
            span("head.lm_head", 0.5, 1),
        ];
        let types = by_type(&spans);
        let kda = types.iter().find(|t| t.kind == SPAN_KDA).unwrap();
        assert_eq!(kda.layers, 2);
        assert!((kda.ms - 0.22).abs() < 1e-12 && (kda.ms_per_layer - 0.11).abs() < 1e-12);
        assert_eq!(kda.launches_per_layer, 3.0);
        let moe = types.iter().find(|t| t.kind == SPAN_MOE).unwrap();
        assert_eq!((moe.layers, moe.launches_per_layer), (1, 3.0));
        assert!(types.iter().all(|t| t.kind != SPAN_MLA && t.kind != "embed"));
        let ops = by_op(&spans);
        let names: Vec<&str> = ops.iter().map(|o| o.op.as_str()).collect();
        assert_eq!(names, ["embed", "kda", "kda.in_proj", "moe", "moe.experts", "head", "head.lm_head"]);
        let in_proj = &ops[2];
        assert_eq!((in_proj.count, in_proj.launches), (2, 4));
        assert!((in_proj.ms - 0.2).abs() < 1e-12);
    }
}
