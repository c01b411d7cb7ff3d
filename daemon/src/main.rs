//! The `sparkd` command line: `serve`, `synth`, `tokenizer`.
//!
//! Invariants: bad arguments or unloadable inputs end in one clear error line on stderr and a non-zero exit
//! (clap's usage errors exit 2, everything else 1), never a panic. `sparkd serve` with no arguments serves the
//! built-in synthetic k3-tiny (seed 0) at 127.0.0.1:8000, on the GPU when one is usable, else on the CPU.

mod bench_cli;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use sparkd::api::{http, AppState};
use sparkd::config::{Device, ServeArgs, DEFAULT_SYNTHETIC_CONFIG};
use sparkd::engine::spec::{describe as describe_spec, SpecConfig};
use sparkd::engine::EngineConfig;
use sparkd_tokenizer::{export_hf, ChatTemplate, Tokenizer};
use sparkd_kernels::checkpoint::Checkpoint;
use sparkd_kernels::config::PRESET_NAMES;
use sparkd_kernels::cpu::CpuRunner;
use sparkd_kernels::cuda::CudaRunner;
use sparkd_kernels::null_runner::NullRunner;
use sparkd_kernels::runner::TokenMask;
use sparkd_kernels::synth::{write_checkpoint, SyntheticWeights};
use sparkd_kernels::{ModelConfig, Runner};
use tokio::sync::watch;

/// Seed of the built-in synthetic model.
const BUILTIN_SEED: u64 = 0;
/// Default shard size of `sparkd synth`.
const DEFAULT_SHARD_BYTES: u64 = 4 << 30;

#[derive(Parser)]
#[command(name = "sparkd", version, about = "Speculative-decoding daemon serving Kimi K3 to agents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP/SSE and WebSocket APIs.
    Serve {
        #[command(flatten)]
        args: ServeArgs,
    },
    /// Decode benchmark on synthetic weights (JSON report; a table on stderr).
    Bench(bench_cli::BenchArgs),
    /// The CUDA backend's correctness matrix against the CPU reference (JSON report).
    Validate(bench_cli::ValidateArgs),
    /// Write a synthetic checkpoint in the real K3 layout.
    Synth {
        /// Named config (k3-tiny, k3-mini, k3-mini-wide, k3).
        #[arg(long, default_value = DEFAULT_SYNTHETIC_CONFIG)]
        config: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Output folder.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Largest shard, in bytes of tensor data.
        #[arg(long, default_value_t = DEFAULT_SHARD_BYTES)]
        max_shard_bytes: u64,
    },
    /// Work with the served tokenizer.
    Tokenizer {
        /// Write it as a Hugging Face tokenizer folder.
        #[arg(long, value_name = "DIR")]
        export: PathBuf,
        /// Checkpoint folder whose `tiktoken.model` to use (default: the built-in tokenizer).
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version are not errors.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Serve { args } => serve(args),
        Command::Bench(args) => bench_cli::bench(&args),
        Command::Validate(args) => match bench_cli::validate(&args) {
            Ok(true) => Ok(()),
            Ok(false) => Err(anyhow::anyhow!("validation failed; see the report")),
            Err(e) => Err(e),
        },
        Command::Synth { config, seed, out, max_shard_bytes } => synth(&config, seed, &out, max_shard_bytes),
        Command::Tokenizer { export, model } => export_tokenizer(&export, model.as_deref()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sparkd: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn synth(config: &str, seed: u64, out: &Path, max_shard_bytes: u64) -> Result<()> {
    if !PRESET_NAMES.contains(&config) {
        bail!("--config: unknown config `{config}` (expected one of {})", PRESET_NAMES.join(", "));
    }
    if max_shard_bytes == 0 {
        bail!("--max-shard-bytes: must be at least 1");
    }
    let cfg = ModelConfig::preset(config)?;
    let report = write_checkpoint(&cfg, seed, out, max_shard_bytes)?;
    println!(
        "wrote {config} (seed {seed}) to {}: {} tensors, {} bytes of tensor data in {} shard(s)",
        report.dir.display(),
        report.tensor_count,
        report.total_bytes,
        report.shards.len()
    );
    for shard in &report.shards {
        println!("  {}  {} tensors  {} bytes", shard.file, shard.tensors, shard.bytes);
    }
    Ok(())
}

/// The tokenizer of a checkpoint folder (its `tiktoken.model`), else the built-in one.
fn load_tokenizer(model: Option<&Path>) -> Result<Tokenizer> {
    match model {
        Some(dir) if dir.join("tiktoken.model").is_file() => {
            Tokenizer::from_dir(dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))
        }
        _ => Tokenizer::builtin().context("building the built-in tokenizer"),
    }
}

fn export_tokenizer(dir: &Path, model: Option<&Path>) -> Result<()> {
    let tokenizer = load_tokenizer(model)?;
    export_hf(&tokenizer, dir)?;
    println!("wrote a Hugging Face tokenizer ({} ids) to {}", tokenizer.vocab_size(), dir.display());
    Ok(())
}

/// The runner `--device` and `--model` ask for (prepared for the speculation settings `spec`), and its config.
/// With `--device auto`, a GPU whose runner fails to start is reported and the CPU reference serves instead.
fn build_runner(args: &ServeArgs, spec: &SpecConfig) -> Result<(Box<dyn Runner>, ModelConfig)> {
    let checkpoint = match &args.model {
        Some(dir) => Some(Checkpoint::open(dir).with_context(|| format!("opening the checkpoint {}", dir.display()))?),
        None => None,
    };
    let synthetic = args.synthetic.as_str();
    let cfg = match &checkpoint {
        Some(c) => c.config().clone(),
        None => ModelConfig::preset(synthetic).with_context(|| format!("--synthetic {synthetic}"))?,
    };
    let cpu_runner = || -> Result<Box<dyn Runner>> {
        let mut runner = match &checkpoint {
            Some(c) => CpuRunner::new(cfg.clone(), c)?,
            None => CpuRunner::new(cfg.clone(), &SyntheticWeights::new(cfg.clone(), BUILTIN_SEED))?,
        };
        spec.prepare_cpu_runner(&mut runner, args.model.as_deref(), synthetic)?;
        Ok(Box::new(runner))
    };
    let cuda_runner = || -> Result<Box<dyn Runner>> {
        let mut runner = match &checkpoint {
            Some(c) => CudaRunner::new(0, cfg.clone(), c)?,
            None => CudaRunner::new(0, cfg.clone(), &SyntheticWeights::new(cfg.clone(), BUILTIN_SEED))?,
        };
        spec.prepare_cuda_runner(&mut runner, args.model.as_deref(), synthetic)?;
        Ok(Box::new(runner))
    };
    let runner = match args.device.resolve() {
        Device::Cuda if args.device == Device::Auto => cuda_runner().or_else(|e| {
            tracing::warn!("--device auto: the CUDA runner did not start ({e:#}); using the CPU reference");
            cpu_runner()
        })?,
        Device::Cuda => cuda_runner()?,
        Device::Null => {
            spec.check_null_runner()?;
            Box::new(NullRunner::new(cfg.clone()))
        }
        Device::Cpu | Device::Auto => cpu_runner()?,
    };
    Ok((runner, cfg))
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

fn serve(args: ServeArgs) -> Result<()> {
    args.validate()?;
    let addr = args.listen_addr()?;
    let model_name = args.model_name();
    let tokenizer = load_tokenizer(args.model.as_deref())?;
    let template = ChatTemplate::new(tokenizer.clone())?;
    let spec = args.spec.to_config()?;
    let (mut runner, cfg) = build_runner(&args, &spec)?;
    restrict_to_tokenizer(runner.as_mut(), &tokenizer, &cfg);
    tracing::info!("{}", describe_spec(&spec));
    let max_model_len = args.max_model_len.min(cfg.max_position_embeddings);
    tracing::info!(
        model = %model_name, device = %runner.device_name(), max_model_len,
        "model ready ({} layers, hidden {})", cfg.num_layers(), cfg.hidden_size
    );
    let metrics = sparkd::metrics::install(&model_name).context("installing the Prometheus recorder")?;
    let engine_config = EngineConfig { spec, ..args.engine_config() };
    let engine = sparkd::engine::spawn(runner, engine_config).context("starting the engine thread")?;

    let engine_handle = engine.handle();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--host/--port: cannot listen on {addr}"))?;
        let bound = listener.local_addr()?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let state = Arc::new(AppState::new(
            engine_handle,
            template,
            model_name,
            max_model_len,
            args.max_body_bytes,
            metrics.clone(),
            stop_rx.clone(),
        ));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                metrics.run_upkeep();
            }
        });
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("signal received");
            let _ = stop_tx.send(true);
        });
        // Tests and scripts read this line to learn the port.
        tracing::info!("listening on http://{bound}");
        http::serve(listener, state, stop_rx).await;
        anyhow::Ok(())
    })?;
    engine.shutdown();
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
