//! `sparkd bench` and `sparkd validate`: the argument structs and what they run.
//!
//! Invariants: every number comes from `sparkd_kernels::harness` (`decode`, `context`, `cuda_bench`, `validate`)
//! or the start-up step-cost measurement (`sparkd::startup`);
//! this file only parses, runs and prints. The JSON report goes to `--out` (or stdout when it is
//! absent) and a readable table to stderr, so `sparkd bench --device cuda > report.json` works.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sparkd::config::Device;
use sparkd::engine::step_time::StepShape;
use sparkd::startup::measure_step_costs;
use sparkd_kernels::acceptance::{AcceptanceMode, SyntheticSchedule};
use sparkd_kernels::checkpoint::Checkpoint;
use sparkd_kernels::config::PRESET_NAMES;
use sparkd_kernels::cpu::{CpuRunner, ParallelConfig, ShardedCpuRunner};
use sparkd_kernels::cuda::attn::MLA_GROUP_FROM_TOKENS;
use sparkd_kernels::cuda::gpu::Gemm;
use sparkd_kernels::cuda::step::MLA_CHUNK_SPLIT_TOKENS;
use sparkd_kernels::cuda::CudaRunner;
use sparkd_kernels::harness::context::{self, ContextSweep};
use sparkd_kernels::harness::cuda_bench::{self, CudaBenchOptions};
use sparkd_kernels::harness::decode::{run_decode_bench, DecodeBench};
use sparkd_kernels::harness::validate::{self, ValidationOptions};
use sparkd_kernels::synth::SyntheticWeights;
use sparkd_kernels::tensor::WeightSource;
use sparkd_kernels::{ModelConfig, Runner};

/// The linear layers' GEMM on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GemmArg {
    /// The skinny tensor-core GEMM: a token's result does not depend on its batch (the served default).
    BatchInvariant,
    /// cuBLAS GemmEx.
    Cublas,
}

/// `sparkd bench` options.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// Named config (k3-tiny, k3-mini, k3-mini-wide), synthetic weights generated in memory.
    #[arg(long, default_value = "k3-tiny")]
    pub config: String,
    /// Checkpoint folder (config.json + safetensors) to benchmark instead of --config's synthetic weights: real
    /// weights, or a synthetic checkpoint from `sparkd synth` (the same weights as its config and seed, loaded
    /// without generating them again).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["config", "seed"])]
    pub model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// CPU: split the model over N in-process tensor-parallel ranks (as `sparkd serve --tensor-parallel-size`).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tensor_parallel_size: usize,
    /// CPU, with --tensor-parallel-size N > 1: place the routed experts whole on the ranks.
    #[arg(long)]
    pub expert_parallel: bool,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub batch: Vec<usize>,
    /// Timed decode steps per measurement.
    #[arg(long, default_value_t = 16)]
    pub steps: usize,
    /// Tokens prefilled before decoding.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// CUDA: the decode sweep samples at this temperature (0: greedy), as served requests do by default (1).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Draft tokens verified per step in the batch sweep.
    #[arg(long, default_value_t = 0)]
    pub draft_len: usize,
    /// Forced mean acceptance length (bonus included) for the batch sweep; needs --draft-len.
    #[arg(long)]
    pub synthetic_al: Option<f64>,
    /// CUDA: verify windows ℓ = 1..=N timed at batch 1 (0: none).
    #[arg(long, default_value_t = 8)]
    pub max_verify: usize,
    /// CUDA: skip the forced AL = 6, ℓ = 7 measurement at batch 1.
    #[arg(long)]
    pub no_forced: bool,
    /// CUDA: batch sizes at which the DSpark draft is timed beside the step (the preset's synthetic drafter, or
    /// `MODEL/drafter`), comma-separated; the forced measurement is then also run drafting with the model.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub draft_batch: Vec<usize>,
    /// CUDA: attach no drafter (no draft costs, no forced rounds that draft).
    #[arg(long)]
    pub no_draft: bool,
    #[arg(long, value_enum, default_value_t = GemmArg::BatchInvariant)]
    pub gemm: GemmArg,
    /// CUDA: run every step eagerly instead of replaying repeated step shapes from CUDA graphs.
    #[arg(long)]
    pub no_graphs: bool,
    /// CUDA: also time every batch with graphs off, in the same run (the eager baseline).
    #[arg(long)]
    pub compare_eager: bool,
    /// CUDA: also time every batch with programmatic dependent launch off, in the same run (`SPARKD_PDL=off`
    /// turns it off for the whole run).
    #[arg(long)]
    pub compare_serialized: bool,
    /// Instead of the decode sweep: step costs at these contexts (tokens already in the states), comma-separated:
    /// one decode row, --context-batch decode rows, one --context-chunk-token prefill chunk, and both together (a
    /// step the engine's step-time limit plans), beside the start-up step-cost profile the engine predicts with.
    #[arg(long, value_delimiter = ',', value_name = "TOKENS")]
    pub context_steps: Vec<usize>,
    /// Decode rows of --context-steps' batched and mixed steps.
    #[arg(long, default_value_t = 16)]
    pub context_batch: usize,
    /// Tokens of --context-steps' prefill chunk.
    #[arg(long, default_value_t = 64)]
    pub context_chunk: usize,
    /// Most tokens of one step (--context-steps' prefill of its contexts and its step-cost profile).
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// CUDA, --context-steps: MLA windows of at least this many tokens run 4 tokens to a block of the split
    /// attention (a length past every window runs each token in its own block, as before decision D84).
    #[arg(long, default_value_t = MLA_GROUP_FROM_TOKENS)]
    pub mla_group_from: usize,
    /// CUDA, --context-steps: about this many (token, split) pairs for an MLA window longer than a verify window
    /// (0: one split per token, as before decision D84).
    #[arg(long, default_value_t = MLA_CHUNK_SPLIT_TOKENS)]
    pub mla_chunk_split_tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the JSON report here (default: stdout).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// `sparkd validate` options.
#[derive(Clone, Debug, clap::Args)]
pub struct ValidateArgs {
    /// Only `cuda`: the CUDA backend is checked against the CPU reference.
    #[arg(long, value_enum, default_value_t = Device::Cuda)]
    pub device: Device,
    #[arg(long, default_value = "k3-tiny")]
    pub config: String,
    /// Batch sizes of the batch × window matrix, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub batch: Vec<usize>,
    /// Windows 1..=N of the matrix.
    #[arg(long, default_value_t = 8)]
    pub max_window: usize,
    /// Teacher-forced positions of the whole-model check.
    #[arg(long, default_value_t = 48)]
    pub positions: usize,
    /// Write the JSON report here (default: stdout).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

fn check_config(config: &str) -> Result<ModelConfig> {
    if !PRESET_NAMES.contains(&config) {
        bail!("--config: unknown config `{config}` (expected one of {})", PRESET_NAMES.join(", "));
    }
    Ok(ModelConfig::preset(config)?)
}

fn emit(json: &str, out: Option<&PathBuf>) -> Result<()> {
    match out {
        Some(path) => std::fs::write(path, json).with_context(|| format!("--out: writing {}", path.display())),
        None => {
            println!("{json}");
            Ok(())
        }
    }
}

fn open_checkpoint(dir: &Path) -> Result<Checkpoint> {
    Checkpoint::open(dir).with_context(|| format!("--model: opening the checkpoint {}", dir.display()))
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    if args.model.is_none() {
        check_config(&args.config)?;
    }
    if args.batch.is_empty() || args.batch.contains(&0) || args.steps == 0 {
        bail!("--batch and --steps: every value must be at least 1");
    }
    if args.draft_batch.contains(&0) {
        bail!("--draft-batch: every value must be at least 1");
    }
    if args.synthetic_al.is_some() && args.draft_len == 0 {
        bail!("--synthetic-al needs --draft-len of at least 1");
    }
    if !args.context_steps.is_empty() {
        return context_steps(args);
    }
    match args.device {
        Device::Cuda => {
            let opts = CudaBenchOptions {
                weights_seed: args.seed,
                gemm: match args.gemm {
                    GemmArg::BatchInvariant => Gemm::BatchInvariant,
                    GemmArg::Cublas => Gemm::Cublas,
                },
                graphs: !args.no_graphs,
                compare_eager: args.compare_eager,
                compare_serialized: args.compare_serialized,
                batches: args.batch.clone(),
                steps: args.steps,
                prompt_len: args.prompt_len,
                temperature: args.temperature,
                draft_len: args.draft_len,
                synthetic_al: args.synthetic_al,
                verify_lens: (1..=args.max_verify).collect(),
                forced: (!args.no_forced).then_some((7, 6.0)),
                draft_batches: if args.no_draft { Vec::new() } else { args.draft_batch.clone() },
                model: args.model.clone(),
                ..CudaBenchOptions::for_preset(&args.config)
            };
            let report = cuda_bench::run(&opts)?;
            eprint!("{}", report.table());
            emit(&serde_json::to_string_pretty(&report)?, args.out.as_ref())
        }
        Device::Cpu => {
            let (cfg, weights) = bench_weights(args)?;
            let acceptance = match args.synthetic_al {
                Some(al) => AcceptanceMode::Synthetic(SyntheticSchedule::from_acceptance_length(al, args.draft_len)?),
                None => AcceptanceMode::Standard,
            };
            let mut runner: Box<dyn Runner> = match args.tensor_parallel_size {
                0 => bail!("--tensor-parallel-size: must be at least 1"),
                1 => {
                    let mut r = CpuRunner::new(cfg, weights.as_ref())?;
                    r.set_acceptance(acceptance);
                    Box::new(r)
                }
                n => {
                    let parallel = ParallelConfig { tensor_parallel: n, expert_parallel: args.expert_parallel };
                    let mut r = ShardedCpuRunner::new(cfg, weights.as_ref(), parallel)?;
                    r.set_acceptance(acceptance);
                    Box::new(r)
                }
            };
            let mut results = Vec::new();
            let name = args.model.as_ref().map_or_else(|| args.config.clone(), |dir| dir.display().to_string());
            eprintln!("sparkd bench: {name} on the {}\nbatch  step ms  tok/s", runner.device_name());
            for &batch in &args.batch {
                let bench =
                    DecodeBench { batch, prompt_len: args.prompt_len, steps: args.steps, draft_len: args.draft_len };
                let r = run_decode_bench(runner.as_mut(), &bench)?;
                eprintln!("{:>5}  {:>7.3}  {:>8.1}", batch, r.step_ms, r.tokens_per_second);
                results.push(r);
            }
            emit(&serde_json::to_string_pretty(&results)?, args.out.as_ref())
        }
        Device::Null => bail!("--device null has no math to benchmark; use cpu or cuda"),
        Device::Auto => bench(&BenchArgs { device: args.device.resolve(), ..args.clone() }),
    }
}

/// The model `--model` or `--config` names, with its weights.
fn bench_weights(args: &BenchArgs) -> Result<(ModelConfig, Box<dyn WeightSource>)> {
    Ok(match &args.model {
        Some(dir) => {
            let checkpoint = open_checkpoint(dir)?;
            (checkpoint.config().clone(), Box::new(checkpoint))
        }
        None => {
            let cfg = check_config(&args.config)?;
            (cfg.clone(), Box::new(SyntheticWeights::new(cfg, args.seed)))
        }
    })
}

/// `--context-steps`: the context sweep on the CPU or CUDA runner, after the step-cost profile the engine's
/// step-time limit would measure on it at start-up.
fn context_steps(args: &BenchArgs) -> Result<()> {
    if args.context_batch == 0 || args.context_chunk == 0 || args.max_batch_tokens == 0 {
        bail!("--context-batch, --context-chunk and --max-batch-tokens: every value must be at least 1");
    }
    let (cfg, weights) = bench_weights(args)?;
    let mut runner: Box<dyn Runner> = match args.device.resolve() {
        Device::Cuda => {
            let mut runner = CudaRunner::new(0, cfg, weights.as_ref())?;
            runner.set_mla_forms(args.mla_group_from, args.mla_chunk_split_tokens);
            Box::new(runner)
        }
        Device::Cpu => Box::new(CpuRunner::new(cfg, weights.as_ref())?),
        Device::Null | Device::Auto => bail!("--device null has no math to benchmark; use cpu or cuda"),
    };
    let costs = measure_step_costs(runner.as_mut(), args.max_batch_tokens)?;
    let (batch, chunk) = (args.context_batch, args.context_chunk);
    eprintln!(
        "sparkd bench --context-steps on the {}: the start-up cost model ({:.3} ms a row past the first, {:.2} ns a \
         context token read); each context's second line is its prediction",
        runner.device_name(),
        costs.per_row_seconds() * 1e3,
        costs.per_context_read_seconds() * 1e9,
    );
    let sweep =
        ContextSweep { contexts: args.context_steps.clone(), batch, chunk, max_batch_tokens: args.max_batch_tokens };
    eprintln!("{}", context::table_header(&sweep));
    let mut points = Vec::new();
    for &c in &sweep.contexts {
        let point = context::run_context_sweep(runner.as_mut(), &ContextSweep { contexts: vec![c], ..sweep.clone() })?;
        let predicted = |rows: &[usize]| {
            let shape = rows.iter().fold(StepShape::default(), |shape, &tokens| shape.with_row(tokens, c));
            costs.predicted_seconds(shape) * 1e3
        };
        let decode_rows = vec![1; batch];
        let mixed: Vec<usize> = decode_rows.iter().copied().chain([chunk]).collect();
        eprintln!("{}", point[0].table_row());
        eprintln!(
            "{:>8}  {:>9.3}  {:>9.3}  {:>9.3}  {:>9.3}",
            "model",
            predicted(&[1]),
            predicted(&decode_rows),
            predicted(&[chunk]),
            predicted(&mixed)
        );
        points.extend(point);
    }
    let report = serde_json::json!({ "sweep": sweep, "profile": costs.tokens(), "per_row_seconds": costs.per_row_seconds(), "per_context_read_seconds": costs.per_context_read_seconds(), "points": points });
    emit(&serde_json::to_string_pretty(&report)?, args.out.as_ref())
}

pub fn validate(args: &ValidateArgs) -> Result<bool> {
    check_config(&args.config)?;
    if args.device != Device::Cuda {
        bail!("--device: validate checks the CUDA backend against the CPU reference; only `cuda` is accepted");
    }
    if args.batch.is_empty() || args.batch.contains(&0) || args.max_window == 0 || args.positions == 0 {
        bail!("--batch, --max-window and --positions: every value must be at least 1");
    }
    let opts = ValidationOptions {
        preset: args.config.clone(),
        positions: args.positions,
        batches: args.batch.clone(),
        max_window: args.max_window,
        ..ValidationOptions::default()
    };
    let report = validate::run(&opts)?;
    let failed_ops: Vec<&str> = report.ops.iter().filter(|o| !o.pass).map(|o| o.op.as_str()).collect();
    eprintln!(
        "sparkd validate: {} on {}: {} ({} ops checked, failing: {:?}; whole model {}/{} pass; rollback {}/{} pass; \
         matrix {}/{} cases pass)",
        args.config,
        report.device.name,
        if report.pass { "PASS" } else { "FAIL" },
        report.ops.len(),
        failed_ops,
        report.whole_model.iter().filter(|w| w.pass).count(),
        report.whole_model.len(),
        report.rollback.iter().filter(|r| r.pass).count(),
        report.rollback.len(),
        report.matrix_passed,
        report.matrix.len()
    );
    emit(&serde_json::to_string_pretty(&report)?, args.out.as_ref())?;
    Ok(report.pass)
}
