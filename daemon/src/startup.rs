//! Start-up composition of `sparkd serve`: the one place that builds the runner (CPU, CUDA or null, per
//! `--device`; the CPU one split over in-process ranks with `--tensor-parallel-size`), attaches the DSpark drafter the speculation settings need, builds the tokenizer and its chat
//! template, and turns the settings into a proposer and a verify budget (measuring SPS(B) on the runner when
//! a load-aware budget has no profile).
//!
//! Invariants:
//! - Composition happens once, before the engine starts; the engine is handed trait objects only
//!   (`Box<dyn Runner>`, a [`Speculation`] holding a `Box<dyn Proposer>`), so no backend or drafter loader
//!   type reaches `crate::engine`.
//! - The step costs behind `--decode-step-target` are measured once per serve (unless it is `off`), on
//!   states that are freed, and stop at the first size whose step takes [`STEP_COST_CAP`] and, for the
//!   context-read cost, after [`CONTEXT_PROBE_BUDGET`] of prefill, so a slow runner (the CPU reference)
//!   starts quickly.
//! - A setting the runner cannot honour (a drafter or forced acceptance on the null runner, a method that
//!   needs a drafter on a runner without one, a missing `MODEL/drafter` folder) is an error naming the flag
//!   before anything serves.
//! - The SPS(B) and draft-cost measurements step and draft only states they allocate, and free every one of
//!   them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sparkd_kernels::acceptance::AcceptanceMode;
use sparkd_kernels::checkpoint::Checkpoint;
use sparkd_kernels::cpu::{CpuRunner, ParallelConfig, ShardedCpuRunner};
use sparkd_kernels::cuda::gpu::Gpu;
use sparkd_kernels::cuda::tp::DeviceGroup;
use sparkd_kernels::cuda::CudaRunner;
use sparkd_kernels::dspark::{DrafterConfig, DrafterSource, DRAFTER_DIR};
use sparkd_kernels::null_runner::NullRunner;
use sparkd_kernels::runner::{DraftRequest, RowInput, SampleRequest, SamplingParams, TokenMask};
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::tensor::WeightSource;
use sparkd_kernels::trained::{TrainedModel, TrainedWeights, TRAINED_NAME};
use sparkd_kernels::{KernelError, ModelConfig, Runner, StateId, TokenId};
use sparkd_spec::ngram::{NgramConfig, NgramProposer};
use sparkd_spec::suffix::{SuffixConfig, SuffixProposer};
use sparkd_spec::{
    BudgetPolicy, DraftGate, DraftPoint, HybridProposer, HybridRule, ModelDrafts, ProductionBudget, Proposer,
    SpsProfile,
};
use sparkd_tokenizer::{ChatTemplate, Tokenizer};

use crate::config::speculation::{describe, SpecBudget, SpecMethod, SpecSettingError, SpeculationConfig};
use crate::config::{DecodeStepTarget, Device, ServeArgs};
use crate::engine::step_time::{NextPrefill, StepCosts, StepShape, StepTimeLimit};
use crate::engine::Speculation;

/// Seed of the built-in synthetic model.
pub const BUILTIN_SEED: u64 = 0;
/// Seed of the synthetic drafter attached to the built-in synthetic model.
pub const BUILTIN_DRAFTER_SEED: u64 = 0;
/// Batch sizes (tokens) at which SPS(B) is measured at start-up, capped by the step token budget.
pub const SPS_BATCH_SIZES: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Row counts at which the drafter's cost per round is measured at start-up, capped by the step token budget.
pub const DRAFT_ROW_COUNTS: [usize; 3] = [1, 8, 32];
/// Context tokens each draft-cost measurement state is given before it is drafted for.
const DRAFT_CONTEXT_TOKENS: usize = 8;

/// What `sparkd serve` serves: everything the engine and the API are started with.
pub struct Served {
    pub runner: Box<dyn Runner>,
    pub model: ModelConfig,
    /// The backend that serves (`auto` resolved, after any fallback to the CPU).
    pub device: Device,
    pub template: ChatTemplate,
    /// `None` with speculation off.
    pub speculation: Option<Speculation>,
    /// `None` with `--decode-step-target off`.
    pub step_time: Option<StepTimeLimit>,
}

/// Builds what `args` ask to serve (the arguments were validated); with `group`, on rank 0 of that CUDA group
/// (`launch_cli`).
pub fn compose(args: &ServeArgs, group: Option<DeviceGroup>) -> Result<Served> {
    let tokenizer = load_tokenizer(args.model.as_deref())?;
    let template = ChatTemplate::new(tokenizer.clone())?;
    let spec = args.spec.to_config()?;
    let (mut runner, model, device) = build_runner(args, &spec, group)?;
    restrict_to_tokenizer(runner.as_mut(), &tokenizer, &model);
    tracing::info!("{}", describe(&spec));
    let speculation = speculation(&spec, runner.as_mut(), args.max_num_batched_tokens)?;
    let step_time = step_time_limit(args.decode_step_target, runner.as_mut(), args.max_num_batched_tokens)?;
    Ok(Served { runner, model, device, template, speculation, step_time })
}

/// The step-cost measurement doubles the step's tokens until a step takes this long (or the step token
/// budget is reached): past it a step is compute-bound and the profile's linear extrapolation holds.
pub const STEP_COST_CAP: Duration = Duration::from_millis(20);

/// The step-time limit `target` asks for (`None` when `off`), over step costs measured on `runner` up to
/// `max_batch_tokens`; a prompt beside decode rows advances by at least one MLA block per step.
pub fn step_time_limit(
    target: DecodeStepTarget,
    runner: &mut dyn Runner,
    max_batch_tokens: usize,
) -> Result<Option<StepTimeLimit>> {
    let DecodeStepTarget::On(target) = target else { return Ok(None) };
    let costs = measure_step_costs(runner, max_batch_tokens).context("measuring step costs (--decode-step-target)")?;
    let limit = StepTimeLimit::new(costs, target, sparkd_kernels::state::MLA_BLOCK_TOKENS);
    let beside = |d: usize| {
        let decode = StepShape { tokens: d, rows: d, context_reads: 0 };
        let next = NextPrefill { context: 0, room: max_batch_tokens.saturating_sub(d), first: true };
        limit.chunk_allowance(decode, limit.target_seconds(decode), next)
    };
    let points: Vec<String> = limit
        .costs()
        .tokens()
        .points()
        .iter()
        .map(|p| format!("{}:{:.2}", p.batch_tokens, 1e3 / p.steps_per_second))
        .collect();
    tracing::info!(
        "decode step target {target}: step costs (tokens:ms) {}, {:.3} ms a row past the first, {:.2} ns a context \
         token read; beside 1/16/64 decode rows a step prefills {}/{}/{} tokens",
        points.join(" "),
        limit.costs().per_row_seconds() * 1e3,
        limit.costs().per_context_read_seconds() * 1e9,
        beside(1),
        beside(16),
        beside(64),
    );
    Ok(Some(limit))
}

/// One-token rows of the per-row cost measurement (at most the step token budget).
pub const PER_ROW_PROBE_ROWS: usize = 16;

/// Measures the step-cost model on `runner` (`engine::step_time`'s module doc): `t(B)` at B = 1, 2, 4, ... up to
/// `max_batch_tokens` (and at it), stopping after the first size past B = 1 whose step takes [`STEP_COST_CAP`] or
/// more (two points at least, so the profile has a slope to extrapolate), where a step of B tokens is one row on
/// a fresh state: B − 1 prompt tokens and one sampled token (a decode step at B = 1, a prefill chunk riding along
/// above it); then the cost of a row past the first, from a step of [`PER_ROW_PROBE_ROWS`] one-token rows on fresh
/// states against `t` of as many tokens; then the cost of a context read ([`context_read_seconds`]). Every state
/// it makes is freed.
pub fn measure_step_costs(runner: &mut dyn Runner, max_batch_tokens: usize) -> Result<StepCosts, KernelError> {
    let max = max_batch_tokens.max(1);
    let mut points = Vec::new();
    let mut b = 1;
    loop {
        let size = b.min(max);
        let t = time_chunk_step(runner, size)?;
        points.push(sparkd_spec::sps::SpsPoint { batch_tokens: size, steps_per_second: 1.0 / t.as_secs_f64() });
        if size == max || (t >= STEP_COST_CAP && points.len() >= 2) {
            break;
        }
        b *= 2;
    }
    let prefill_chunk = points.last().map_or(1, |p| p.batch_tokens);
    let profile = SpsProfile::from_points(points).map_err(|e| KernelError::InvalidInput(e.to_string()))?;
    let rows = PER_ROW_PROBE_ROWS.min(max);
    let per_row = match rows {
        1 => 0.0,
        _ => (time_decode_rows(runner, rows)?.as_secs_f64() - profile.step_seconds(rows)) / (rows - 1) as f64,
    };
    let per_read = context_read_seconds(runner, &profile, prefill_chunk)?;
    Ok(StepCosts::new(profile, per_row).with_context_read_seconds(per_read))
}

/// Most context tokens the context-read probe builds.
pub const CONTEXT_PROBE_MAX_TOKENS: usize = 16_384;
/// Time the context-read probe may spend building its context (it stops at the first prefill step past it).
pub const CONTEXT_PROBE_BUDGET: Duration = Duration::from_millis(300);
/// Least context the probe needs for its excess to stand above timing noise (one 64-token chunk reading fewer
/// context tokens than this is not measured: context reads then cost nothing).
pub const CONTEXT_PROBE_MIN_TOKENS: usize = 512;

/// The seconds a context read costs (`engine::step_time`'s module doc, D83): one state is prefilled in chunks of
/// `prefill_chunk` tokens (the profile's largest measured step) until it holds [`CONTEXT_PROBE_MAX_TOKENS`], half
/// the model's positions, or [`CONTEXT_PROBE_BUDGET`] has passed; then one MLA block of tokens that samples once
/// is timed on forks of it against `t` of as many tokens on a fresh state, and the excess is spread over the
/// block's context reads. Zero when the budget allows less than [`CONTEXT_PROBE_MIN_TOKENS`] of context. Every
/// state it makes is freed, on error too.
fn context_read_seconds(
    runner: &mut dyn Runner,
    profile: &SpsProfile,
    prefill_chunk: usize,
) -> Result<f64, KernelError> {
    let cfg = runner.config();
    let (vocab, most) = (cfg.vocab_size, CONTEXT_PROBE_MAX_TOKENS.min(cfg.max_position_embeddings / 2));
    let block = sparkd_kernels::state::MLA_BLOCK_TOKENS;
    let ids = |from: usize, n: usize| -> Vec<TokenId> {
        (from..from + n).map(|i| ((1000 + 37 * i) % vocab) as TokenId).collect()
    };
    let base = runner.alloc_state()?;
    let measured = (|| {
        let (start, mut context) = (Instant::now(), 0);
        while context < most && start.elapsed() < CONTEXT_PROBE_BUDGET {
            let n = prefill_chunk.max(1).min(most - context);
            runner.step(&[RowInput { state: base, tokens: ids(context, n), sample: None }])?;
            context += n;
        }
        if context < CONTEXT_PROBE_MIN_TOKENS {
            return Ok(0.0);
        }
        let at_context = best_after_warmup(|| {
            let fork = runner.fork_state(base)?;
            let sample = Some(SampleRequest::new(SamplingParams::greedy(), 0));
            let row = RowInput { state: fork, tokens: ids(context, block), sample };
            let start = Instant::now();
            let stepped = runner.step(std::slice::from_ref(&row));
            let elapsed = start.elapsed();
            runner.free_state(fork)?;
            stepped.map(|_| elapsed)
        })?;
        let excess = at_context.as_secs_f64() - profile.step_seconds(block);
        Ok(excess / (block as f64 * context as f64))
    })();
    runner.free_state(base)?;
    measured
}

/// The faster of two timed steps of `rows` one-token rows that each sample, on fresh states (after one warm-up
/// step).
fn time_decode_rows(runner: &mut dyn Runner, rows: usize) -> Result<Duration, KernelError> {
    let vocab = runner.config().vocab_size;
    best_after_warmup(|| {
        let mut states = Vec::with_capacity(rows);
        let stepped = (0..rows).try_for_each(|_| runner.alloc_state().map(|s| states.push(s))).and_then(|()| {
            let inputs: Vec<RowInput> = states
                .iter()
                .enumerate()
                .map(|(r, &state)| RowInput {
                    state,
                    tokens: vec![((1000 + 37 * r) % vocab) as TokenId],
                    sample: Some(SampleRequest::new(SamplingParams::greedy(), 0)),
                })
                .collect();
            let start = Instant::now();
            runner.step(&inputs).map(|_| start.elapsed())
        });
        for s in states {
            runner.free_state(s)?;
        }
        stepped
    })
}

/// The faster of two timed steps of one `tokens`-token row that samples once, each on a fresh state (after
/// one warm-up step).
fn time_chunk_step(runner: &mut dyn Runner, tokens: usize) -> Result<Duration, KernelError> {
    let vocab = runner.config().vocab_size;
    let ids: Vec<TokenId> = (0..tokens).map(|i| ((1000 + 37 * i) % vocab) as TokenId).collect();
    best_after_warmup(|| {
        let state = runner.alloc_state()?;
        let sample = Some(SampleRequest::new(SamplingParams::greedy(), 0));
        let row = RowInput { state, tokens: ids.clone(), sample };
        let start = Instant::now();
        let stepped = runner.step(std::slice::from_ref(&row));
        let elapsed = start.elapsed();
        runner.free_state(state)?;
        stepped.map(|_| elapsed)
    })
}

/// The tokenizer of a checkpoint folder (its `tiktoken.model`), else the built-in one.
pub fn load_tokenizer(model: Option<&Path>) -> Result<Tokenizer> {
    match model {
        Some(dir) if dir.join("tiktoken.model").is_file() => {
            Tokenizer::from_dir(dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))
        }
        _ => Tokenizer::builtin().context("building the built-in tokenizer"),
    }
}

/// The weights `--model` or `--synthetic` name: a checkpoint folder, a seeded synthetic preset, or the trained
/// embedded model.
pub enum ModelWeights {
    Checkpoint { checkpoint: Checkpoint, dir: PathBuf },
    Synthetic { weights: SyntheticWeights, preset: String },
    Trained { model: Arc<TrainedModel>, weights: TrainedWeights },
}

impl ModelWeights {
    /// The checkpoint in `model`, else the built-in model `synthetic` names (a preset, or [`TRAINED_NAME`]).
    pub fn open(model: Option<&Path>, synthetic: &str) -> Result<Self> {
        if let Some(dir) = model {
            let checkpoint =
                Checkpoint::open(dir).with_context(|| format!("opening the checkpoint {}", dir.display()))?;
            return Ok(ModelWeights::Checkpoint { checkpoint, dir: dir.to_path_buf() });
        }
        if synthetic == TRAINED_NAME {
            let model = TrainedModel::embedded().context("--synthetic k3-tiny-trained")?;
            return Ok(ModelWeights::Trained { weights: model.target(), model });
        }
        let cfg = ModelConfig::preset(synthetic).with_context(|| format!("--synthetic {synthetic}"))?;
        Ok(ModelWeights::Synthetic { weights: SyntheticWeights::new(cfg, BUILTIN_SEED), preset: synthetic.to_string() })
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            ModelWeights::Checkpoint { checkpoint, .. } => checkpoint.config(),
            ModelWeights::Synthetic { weights, .. } => weights.config(),
            ModelWeights::Trained { model, .. } => model.config(),
        }
    }

    pub fn weights(&self) -> &dyn WeightSource {
        match self {
            ModelWeights::Checkpoint { checkpoint, .. } => checkpoint,
            ModelWeights::Synthetic { weights, .. } => weights,
            ModelWeights::Trained { weights, .. } => weights,
        }
    }

    /// Where a DSpark method's drafter comes from for these weights.
    pub fn drafter(&self) -> DrafterOrigin {
        match self {
            ModelWeights::Checkpoint { dir, .. } => DrafterOrigin::Folder(dir.clone()),
            ModelWeights::Synthetic { preset, .. } => DrafterOrigin::Preset(preset.clone()),
            ModelWeights::Trained { model, .. } => DrafterOrigin::Trained(Arc::clone(model)),
        }
    }
}

/// Where the drafter of a DSpark method comes from.
pub enum DrafterOrigin {
    /// `DIR/drafter` of a checkpoint folder.
    Folder(PathBuf),
    /// The seeded synthetic drafter of a preset.
    Preset(String),
    /// The trained drafter of the embedded model.
    Trained(Arc<TrainedModel>),
}

/// The runner `--device` and `--model` ask for (prepared for the speculation settings `spec`), its config and
/// the backend it runs on. With `--device auto`, a GPU whose runner fails to start is reported and the CPU
/// reference serves instead. With `group` (a CUDA group formed by `launch_cli`), rank 0's sharded runner.
pub fn build_runner(
    args: &ServeArgs,
    spec: &SpeculationConfig,
    group: Option<DeviceGroup>,
) -> Result<(Box<dyn Runner>, ModelConfig, Device)> {
    let model = ModelWeights::open(args.model.as_deref(), &args.synthetic)?;
    let cfg = model.config().clone();
    let (weights, drafter) = (model.weights(), model.drafter());
    if let Some(group) = group {
        let runner = CudaRunner::sharded(Gpu::new(0)?, cfg.clone(), weights, group)?;
        return Ok((prepare(runner, CudaRunner::set_acceptance, spec, &drafter)?, cfg, Device::Cuda));
    }
    let (runner, device) = match args.device.resolve() {
        Device::Cuda if args.device == Device::Auto => match cuda_runner(&cfg, weights, spec, &drafter) {
            Ok(runner) => (runner, Device::Cuda),
            Err(e) => {
                tracing::warn!("--device auto: the CUDA runner did not start ({e:#}); using the CPU reference");
                (cpu_runner(&cfg, weights, spec, &drafter)?, Device::Cpu)
            }
        },
        Device::Cuda => (cuda_runner(&cfg, weights, spec, &drafter)?, Device::Cuda),
        Device::Null => {
            spec.check_null_runner()?;
            (Box::new(NullRunner::new(cfg.clone())) as Box<dyn Runner>, Device::Null)
        }
        Device::Cpu if args.tensor_parallel_size > 1 => {
            let parallel =
                ParallelConfig { tensor_parallel: args.tensor_parallel_size, expert_parallel: args.expert_parallel };
            (sharded_cpu_runner(&cfg, weights, parallel, spec, &drafter)?, Device::Cpu)
        }
        Device::Cpu | Device::Auto => (cpu_runner(&cfg, weights, spec, &drafter)?, Device::Cpu),
    };
    Ok((runner, cfg, device))
}

/// The CPU reference runner of `cfg` with `weights`, prepared for `spec`: the drafter it needs attached (from
/// `drafter`), the forced acceptance set.
pub fn cpu_runner(
    cfg: &ModelConfig,
    weights: &dyn WeightSource,
    spec: &SpeculationConfig,
    drafter: &DrafterOrigin,
) -> Result<Box<dyn Runner>> {
    let runner = CpuRunner::new(cfg.clone(), weights)?;
    prepare(runner, CpuRunner::set_acceptance, spec, drafter)
}

/// [`cpu_runner`] split over in-process tensor-parallel ranks (`--tensor-parallel-size`, `--expert-parallel`).
/// A group size that does not divide the model is an error naming the flag.
pub fn sharded_cpu_runner(
    cfg: &ModelConfig,
    weights: &dyn WeightSource,
    parallel: ParallelConfig,
    spec: &SpeculationConfig,
    drafter: &DrafterOrigin,
) -> Result<Box<dyn Runner>> {
    let runner = ShardedCpuRunner::new(cfg.clone(), weights, parallel)?;
    prepare(runner, ShardedCpuRunner::set_acceptance, spec, drafter)
}

/// [`cpu_runner`] on the CUDA backend (device 0): the same drafter, uploaded to the device.
pub fn cuda_runner(
    cfg: &ModelConfig,
    weights: &dyn WeightSource,
    spec: &SpeculationConfig,
    drafter: &DrafterOrigin,
) -> Result<Box<dyn Runner>> {
    let runner = CudaRunner::new(0, cfg.clone(), weights)?;
    prepare(runner, CudaRunner::set_acceptance, spec, drafter)
}

/// `runner` prepared for `spec`: the drafter it needs attached, the forced acceptance (if any) set with
/// `set_acceptance`.
fn prepare<R: Runner + 'static>(
    mut runner: R,
    set_acceptance: fn(&mut R, AcceptanceMode),
    spec: &SpeculationConfig,
    drafter: &DrafterOrigin,
) -> Result<Box<dyn Runner>> {
    attach_drafter(&mut runner, spec, drafter)?;
    if let Some(schedule) = &spec.synthetic {
        set_acceptance(&mut runner, AcceptanceMode::Synthetic(schedule.clone()));
    }
    Ok(Box::new(runner))
}

/// Attaches the DSpark drafter the method needs, if any, from `origin`.
fn attach_drafter(
    runner: &mut dyn Runner,
    spec: &SpeculationConfig,
    origin: &DrafterOrigin,
) -> Result<(), SpecSettingError> {
    if !spec.method.needs_drafter() {
        return Ok(());
    }
    let bad = |reason: String| SpecSettingError { flag: "spec", reason };
    let target = runner.config().clone();
    let source = match origin {
        DrafterOrigin::Folder(dir) => {
            let path = dir.join(DRAFTER_DIR);
            if !path.is_dir() {
                return Err(bad(format!("{} needs a DSpark drafter in {}", spec.method.as_str(), path.display())));
            }
            DrafterSource::checkpoint(&path, &target).map_err(|e| bad(e.to_string()))?
        }
        DrafterOrigin::Preset(preset) => {
            let cfg = DrafterConfig::for_target(preset, &target).map_err(|e| bad(e.to_string()))?;
            DrafterSource::synthetic(cfg, BUILTIN_DRAFTER_SEED)
        }
        DrafterOrigin::Trained(model) => model.drafter(),
    };
    runner.attach_drafter(source).map_err(|e| bad(format!("loading the DSpark drafter: {e}")))
}

/// Keeps the model from emitting ids the tokenizer cannot decode (the built-in tokenizer's cl100k ranks
/// leave K3 ids 100,256..163,583 empty, and a synthetic model would sample them). A runner that cannot
/// mask still serves; its text then skips those ids, which the log says.
fn restrict_to_tokenizer(runner: &mut dyn Runner, tokenizer: &Tokenizer, cfg: &ModelConfig) {
    let mask = TokenMask::from_fn(cfg.vocab_size, |id| tokenizer.token_bytes(id).is_some());
    if mask.num_allowed() == cfg.vocab_size {
        return;
    }
    let holes = cfg.vocab_size - mask.num_allowed();
    match runner.set_token_mask(mask) {
        Ok(()) => tracing::info!("{holes} ids without a token in the tokenizer are never emitted"),
        Err(e) => tracing::warn!("{holes} ids have no token in the tokenizer and may be emitted without text: {e}"),
    }
}

/// The proposer and verify budget of `spec` on `runner` (`None` with speculation off): the method's
/// proposer (DSpark and the hybrid draft with the runner's drafter, which must be attached), and the budget,
/// over SPS(B) measured on `runner` up to `max_batch_tokens` when a load-aware budget has no loaded profile,
/// with the drafter's cost measured too when the method drafts with the model and the profile has no draft
/// table. A model-drafting method with a load-aware budget and real acceptance also gets the drafting gate.
pub fn speculation(
    spec: &SpeculationConfig,
    runner: &mut dyn Runner,
    max_batch_tokens: usize,
) -> Result<Option<Speculation>> {
    let bad = |reason: String| SpecSettingError { flag: "spec", reason };
    // γ of the runner's drafter, which the model-drafting methods need.
    let block = runner.model_drafter().map(|d| d.block_size());
    let drafter_block =
        || block.ok_or_else(|| bad(format!("{} needs a runner with a DSpark drafter", spec.method.as_str())));
    let suffix = || SuffixProposer::new(SuffixConfig::default()).map_err(|e| bad(e.to_string()));
    // Draft tokens per model-drafted row (DSpark: ℓ; the hybrid: ℓ within γ); 0 without model drafts.
    let mut draft_len = 0;
    let proposer: Box<dyn Proposer> = match spec.method {
        SpecMethod::Off => return Ok(None),
        SpecMethod::Suffix => Box::new(suffix()?),
        SpecMethod::Ngram => Box::new(NgramProposer::new(NgramConfig::default()).map_err(|e| bad(e.to_string()))?),
        // DSpark drafts its request's ℓ; the hybrid's model drafts are DSpark blocks of γ.
        SpecMethod::Dspark => {
            drafter_block()?;
            draft_len = spec.num_spec_tokens;
            Box::new(ModelDrafts::new("dspark"))
        }
        SpecMethod::Hybrid => {
            let block = drafter_block()?;
            draft_len = spec.num_spec_tokens.min(block);
            let model = ModelDrafts::new("dspark").with_max_block(block);
            Box::new(HybridProposer::new(suffix()?, Box::new(model), HybridRule::ModelExpected))
        }
    };
    let mut profile = || -> Result<SpsProfile> {
        let p = match &spec.sps_profile {
            Some(p) => p.clone(),
            None => {
                let p = measure_sps(runner, max_batch_tokens).context("measuring SPS(B) for the verify budget")?;
                tracing::info!(profile = %p.to_json(), "measured SPS(B) for the verify budget");
                p
            }
        };
        if draft_len == 0 || !p.draft_points().is_empty() {
            return Ok(p);
        }
        let draft = measure_draft_cost(runner, max_batch_tokens, draft_len)
            .context("measuring the drafter's cost for the verify budget")?;
        tracing::info!(draft = ?draft, "measured the drafter's cost per round for the verify budget");
        Ok(p.with_draft_cost(draft)?)
    };
    let budget = match spec.budget {
        SpecBudget::Static if spec.threshold > 0.0 => BudgetPolicy::StaticThreshold(spec.threshold),
        SpecBudget::Static => BudgetPolicy::Full,
        SpecBudget::Dspark => BudgetPolicy::Dspark(profile()?),
        SpecBudget::Production => BudgetPolicy::Production(ProductionBudget::new(profile()?)),
    };
    let gated = draft_len > 0 && spec.synthetic.is_none();
    let gate = budget.profile().filter(|_| gated).cloned().map(DraftGate::new);
    Ok(Some(Speculation {
        proposer,
        budget,
        num_spec_tokens: spec.num_spec_tokens,
        synthetic: spec.synthetic.clone(),
        gate,
    }))
}

/// Measures SPS(B) on `runner` at the sizes of [`SPS_BATCH_SIZES`] up to `max_batch_tokens`: each
/// size is one step of verify windows over up to 8 fresh states (a warm-up, then the faster of two
/// timed steps). Every state it makes is freed.
pub fn measure_sps(runner: &mut dyn Runner, max_batch_tokens: usize) -> Result<SpsProfile, KernelError> {
    let sizes: Vec<usize> = SPS_BATCH_SIZES.iter().copied().filter(|&b| b <= max_batch_tokens.max(1)).collect();
    let states = (0..8).map(|_| runner.alloc_state()).collect::<Result<Vec<StateId>, _>>()?;
    let result = SpsProfile::measure(&sizes, |b| time_step(runner, &states, b));
    for s in states {
        runner.free_state(s)?;
    }
    result.map_err(|e| KernelError::InvalidInput(e.to_string()))
}

/// The best of two timed steps of `batch_tokens` tokens spread over `states` (after one warm-up).
fn time_step(runner: &mut dyn Runner, states: &[StateId], batch_tokens: usize) -> Result<Duration, KernelError> {
    let rows_n = batch_tokens.min(states.len());
    let rows: Vec<RowInput> = (0..rows_n)
        .map(|r| {
            let len = batch_tokens / rows_n + usize::from(r < batch_tokens % rows_n);
            let tokens: Vec<TokenId> = (0..len).map(|i| (1000 + 37 * r + i) as TokenId).collect();
            let sample = SampleRequest::new(SamplingParams::greedy(), len - 1);
            RowInput { state: states[r], tokens, sample: Some(sample) }
        })
        .collect();
    best_after_warmup(|| {
        let start = Instant::now();
        runner.step(&rows)?;
        Ok(start.elapsed())
    })
}

/// The faster of two timed runs of `once` (each returning its own measured time) after one warm-up run, at
/// least 1 ns: how every start-up measurement times its step or drafter round.
fn best_after_warmup(mut once: impl FnMut() -> Result<Duration, KernelError>) -> Result<Duration, KernelError> {
    once()?;
    let first = once()?;
    Ok(first.min(once()?).max(Duration::from_nanos(1)))
}

/// Measures the drafter's cost per round on `runner` at the row counts of [`DRAFT_ROW_COUNTS`] up to
/// `max_batch_tokens` (each row feeds at least one token): each count is one greedy draft of `draft_len` tokens per row over fresh states given a short
/// context (a warm-up, then the faster of two timed rounds). Every state it makes is freed.
pub fn measure_draft_cost(
    runner: &mut dyn Runner,
    max_batch_tokens: usize,
    draft_len: usize,
) -> Result<Vec<DraftPoint>, KernelError> {
    let counts: Vec<usize> = DRAFT_ROW_COUNTS.iter().copied().filter(|&r| r <= max_batch_tokens.max(1)).collect();
    let rows = counts.last().copied().unwrap_or(1);
    let states = (0..rows).map(|_| runner.alloc_state()).collect::<Result<Vec<StateId>, _>>()?;
    let result = give_context(runner, &states, max_batch_tokens).and_then(|()| {
        SpsProfile::measure_draft(&counts, |n| time_draft(runner, &states[..n], draft_len))
            .map_err(|e| KernelError::InvalidInput(e.to_string()))
    });
    for s in states {
        runner.free_state(s)?;
    }
    result
}

/// Prefills [`DRAFT_CONTEXT_TOKENS`] tokens into every state, in steps of at most `max_batch_tokens` tokens.
fn give_context(runner: &mut dyn Runner, states: &[StateId], max_batch_tokens: usize) -> Result<(), KernelError> {
    let per_step = (max_batch_tokens / DRAFT_CONTEXT_TOKENS).max(1);
    for chunk in states.chunks(per_step) {
        let rows: Vec<RowInput> = chunk
            .iter()
            .enumerate()
            .map(|(r, &state)| {
                let tokens = (0..DRAFT_CONTEXT_TOKENS).map(|i| (1000 + 37 * r + i) as TokenId).collect();
                RowInput { state, tokens, sample: None }
            })
            .collect();
        runner.step(&rows)?;
    }
    Ok(())
}

/// The best of two timed drafter rounds of `draft_len` tokens for every state of `states` (after one warm-up).
fn time_draft(runner: &mut dyn Runner, states: &[StateId], draft_len: usize) -> Result<Duration, KernelError> {
    let requests: Vec<DraftRequest> = states
        .iter()
        .map(|&state| DraftRequest { state, anchor: 1000, num_drafts: draft_len, params: SamplingParams::greedy() })
        .collect();
    best_after_warmup(|| {
        let mut drafter =
            runner.model_drafter().ok_or_else(|| KernelError::InvalidInput("the runner has no drafter".into()))?;
        let start = Instant::now();
        drafter.draft(&requests)?;
        Ok(start.elapsed())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::step_time::StepTarget;
    use sparkd_kernels::state::MLA_BLOCK_TOKENS;

    #[test]
    fn step_costs_double_up_to_the_budget_and_free_their_states() {
        let mut r = NullRunner::new(ModelConfig::preset("k3-tiny").unwrap());
        let p = measure_step_costs(&mut r, 100).unwrap();
        let sizes: Vec<usize> = p.tokens().points().iter().map(|p| p.batch_tokens).collect();
        assert_eq!(sizes, vec![1, 2, 4, 8, 16, 32, 64, 100]);
        assert_eq!(r.num_states(), 0);
        assert!(step_time_limit(DecodeStepTarget::Off, &mut r, 100).unwrap().is_none());
        let limit = step_time_limit(DecodeStepTarget::On(StepTarget::Factor(1.5)), &mut r, 100).unwrap().unwrap();
        assert_eq!(limit.min_prefill_chunk(), MLA_BLOCK_TOKENS);
        assert_eq!(r.num_states(), 0);
    }

    /// A NullRunner whose steps take a modelled time: 2 ms, plus 20 µs a token, plus 20 ns a context read.
    struct Clocked(NullRunner);

    impl Runner for Clocked {
        fn config(&self) -> &ModelConfig {
            self.0.config()
        }
        fn device_name(&self) -> String {
            "clocked".into()
        }
        fn alloc_state(&mut self) -> Result<StateId, KernelError> {
            self.0.alloc_state()
        }
        fn fork_state(&mut self, src: StateId) -> Result<StateId, KernelError> {
            self.0.fork_state(src)
        }
        fn free_state(&mut self, id: StateId) -> Result<(), KernelError> {
            self.0.free_state(id)
        }
        fn state_len(&self, id: StateId) -> Result<usize, KernelError> {
            self.0.state_len(id)
        }
        fn state_bytes(&self, id: StateId) -> Result<usize, KernelError> {
            self.0.state_bytes(id)
        }
        fn export_state(&self, id: StateId) -> Result<sparkd_kernels::state::SeqState, KernelError> {
            self.0.export_state(id)
        }
        fn import_state(&mut self, state: sparkd_kernels::state::SeqState) -> Result<StateId, KernelError> {
            self.0.import_state(state)
        }
        fn step(&mut self, rows: &[RowInput]) -> Result<Vec<sparkd_kernels::runner::RowOutput>, KernelError> {
            let mut seconds = 2e-3;
            for r in rows {
                seconds += r.tokens.len() as f64 * (20e-6 + 20e-9 * self.0.state_len(r.state)? as f64);
            }
            std::thread::sleep(Duration::from_secs_f64(seconds));
            self.0.step(rows)
        }
    }

    #[test]
    fn the_context_read_cost_is_measured_on_a_long_state_and_frees_it() {
        let mut r = Clocked(NullRunner::new(ModelConfig::preset("k3-tiny").unwrap()));
        let costs = measure_step_costs(&mut r, 256).unwrap();
        let per_read = costs.per_context_read_seconds();
        // The probe's excess is a few ms over thousands of context tokens; a loaded host's sleep overshoot (CI
        // runs tests in parallel on two cores) moves it by tens of per cent, never by a factor of two.
        assert!((10e-9..40e-9).contains(&per_read), "measured {:.2} ns a context read, modelled 20", per_read * 1e9);
        assert!(costs.per_row_seconds() < 5e-4, "a row past the first costs nothing here: {}", costs.per_row_seconds());
        assert_eq!(r.0.num_states(), 0);
    }

    #[test]
    fn sps_is_measured_on_the_runner_and_frees_its_states() {
        let mut r = NullRunner::new(ModelConfig::preset("k3-tiny").unwrap());
        let p = measure_sps(&mut r, 16).unwrap();
        let sizes: Vec<usize> = p.points().iter().map(|p| p.batch_tokens).collect();
        assert_eq!(sizes, vec![1, 2, 4, 8, 16]);
        assert_eq!(r.num_states(), 0);
    }

    #[test]
    fn the_drafters_cost_is_measured_per_row_count_and_frees_its_states() {
        let cfg = ModelConfig::preset("k3-tiny").unwrap();
        let spec = SpeculationConfig { method: SpecMethod::Dspark, num_spec_tokens: 4, ..SpeculationConfig::default() };
        let mut runner =
            cpu_runner(&cfg, &SyntheticWeights::new(cfg.clone(), 1), &spec, &DrafterOrigin::Preset("k3-tiny".into()))
                .unwrap();
        let table = measure_draft_cost(runner.as_mut(), 16, 4).unwrap();
        let rows: Vec<usize> = table.iter().map(|p| p.rows).collect();
        assert_eq!(rows, vec![1, 8]);
        assert!(table.iter().all(|p| p.seconds > 0.0), "{table:?}");
        let after = runner.alloc_state().unwrap();
        assert!((1..after.0).all(|id| runner.state_len(StateId(id)).is_err()), "every measurement state is freed");
        let mut null = NullRunner::new(cfg);
        assert!(measure_draft_cost(&mut null, 16, 4).is_err(), "no drafter, no draft cost");
        assert_eq!(null.num_states(), 0);
    }

    #[test]
    fn tensor_parallel_size_builds_the_sharded_cpu_runner_or_names_the_flag() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let args = |extra: &[&str]| {
            let mut all = vec!["sparkd", "--device", "cpu"];
            all.extend_from_slice(extra);
            <Cli as clap::Parser>::try_parse_from(all).expect("parses").serve
        };
        let spec = SpeculationConfig::default();
        let (runner, _, device) = build_runner(&args(&["--tensor-parallel-size", "2"]), &spec, None).unwrap();
        assert_eq!((runner.device_name().as_str(), device), ("cpu tp2", Device::Cpu));
        let dspark =
            SpeculationConfig { method: SpecMethod::Dspark, num_spec_tokens: 4, ..SpeculationConfig::default() };
        let (mut runner, _, _) =
            build_runner(&args(&["--tensor-parallel-size", "2", "--expert-parallel"]), &dspark, None).unwrap();
        assert_eq!(runner.device_name(), "cpu tp2 ep");
        assert!(runner.model_drafter().is_some(), "the drafter is attached beside the sharded runner");
        let (runner, _, _) =
            build_runner(&args(&["--tensor-parallel-size", "1", "--expert-parallel"]), &spec, None).unwrap();
        assert_eq!(runner.device_name(), "cpu", "one rank is the unsharded runner");
        // k3-tiny has 4 KDA heads: 3 ranks do not divide them.
        let err = build_runner(&args(&["--tensor-parallel-size", "3"]), &spec, None).err().expect("refused");
        assert!(format!("{err:#}").contains("--tensor-parallel-size"), "{err:#}");
    }
}
