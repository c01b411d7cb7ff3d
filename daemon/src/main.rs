//! The `sparkd` command line: `serve` (composed by `sparkd::startup`), `synth`, `tokenizer`, `plan`, `rendezvous`
//! and the hidden `worker` (the launch contract, `launch_cli`).
//!
//! Invariants: bad arguments or unloadable inputs end in one clear error line on stderr and a non-zero exit
//! (clap's usage errors exit 2, everything else 1), never a panic. `sparkd serve` with no arguments serves the
//! built-in synthetic k3-tiny (seed 0) at 127.0.0.1:8000, on the GPU when one is usable, else on the CPU.

mod bench_cli;
mod corpus_cli;
mod launch_cli;
mod plan_cli;
mod spec_eval;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use sparkd::api::{auth, http, AppState};
use sparkd::config::memory::MemoryPresent;
use sparkd::config::{Device, ServeArgs};
use sparkd::engine::journal::OpenJournal;
use sparkd::engine::Engine;
use sparkd::startup::{compose, load_tokenizer, Served};
use sparkd_kernels::config::PRESET_NAMES;
use sparkd_kernels::cuda::tp::DeviceGroup;
use sparkd_kernels::synth::write_checkpoint;
use sparkd_kernels::trained::{TrainedModel, TRAINED_NAME};
use sparkd_kernels::ModelConfig;
use sparkd_tokenizer::export_hf;
use tokio::sync::watch;

/// Default shard size of `sparkd synth`.
const DEFAULT_SHARD_BYTES: u64 = 4 << 30;

#[derive(Parser)]
#[command(name = "sparkd", version, about = "Speculative-decoding daemon serving Kimi K3 to agents")]
struct Cli {
    /// How log lines are written (on stderr): `text` for people (coloured only on a terminal, and never with
    /// NO_COLOR set), `json` for log pipelines (one object per line, fields flattened). `RUST_LOG` filters them.
    #[arg(long, global = true, value_enum, default_value = "text", env = "SPARKD_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP/SSE and WebSocket APIs.
    Serve {
        #[command(flatten)]
        args: Box<ServeArgs>,
    },
    /// Decode benchmark on synthetic weights (JSON report; a table on stderr).
    Bench(bench_cli::BenchArgs),
    /// The CUDA backend's correctness matrix against the CPU reference (JSON report).
    Validate(bench_cli::ValidateArgs),
    /// Speculation on code continuations: DSpark's acceptance per draft position and the calibration of its
    /// confidences, and every drafting method's acceptance length and wall time (JSON report; a table on stderr).
    SpecEval(spec_eval::SpecEvalArgs),
    /// Write a synthetic checkpoint in the real K3 layout (or, with --trained, the trained embedded model).
    Synth {
        /// Named config (k3-tiny, k3-mini, k3-mini-wide, k3).
        #[arg(long, default_value = "k3-tiny", conflicts_with = "trained")]
        config: String,
        #[arg(long, default_value_t = 0, conflicts_with = "trained")]
        seed: u64,
        /// Write the trained k3-tiny and its DSpark drafter (in `drafter/`), expanded to the real layout.
        #[arg(long)]
        trained: bool,
        /// Output folder.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Largest shard, in bytes of tensor data.
        #[arg(long, default_value_t = DEFAULT_SHARD_BYTES, conflicts_with = "trained")]
        max_shard_bytes: u64,
    },
    /// The memory plan of a model over several GPUs: bytes per rank and the largest batch and context that fit
    /// (exits non-zero when the asked batch and context do not).
    Plan(plan_cli::PlanArgs),
    /// Form a multi-node group and print it (every rank's node, address, host and pid), without loading a
    /// model: a check of the network between the nodes (docs/multi-gpu.md, "Launch contract").
    Rendezvous(launch_cli::RendezvousArgs),
    /// One rank of a group on this host, started by `sparkd serve --device cuda --tensor-parallel-size N`.
    #[command(hide = true)]
    Worker(launch_cli::WorkerArgs),
    /// Tokenize the trained model's corpus (the Python standard library) into train and held-out files.
    Corpus(corpus_cli::CorpusArgs),
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
    init_logging(cli.log_format);
    let result = match cli.command {
        Command::Serve { args } => serve(*args),
        Command::Bench(args) => bench_cli::bench(&args),
        Command::Validate(args) => match bench_cli::validate(&args) {
            Ok(true) => Ok(()),
            Ok(false) => Err(anyhow::anyhow!("validation failed; see the report")),
            Err(e) => Err(e),
        },
        Command::SpecEval(args) => spec_eval::run(&args),
        Command::Synth { trained: true, out, .. } => synth_trained(&out),
        Command::Synth { config, seed, out, max_shard_bytes, .. } => synth(&config, seed, &out, max_shard_bytes),
        Command::Tokenizer { export, model } => export_tokenizer(&export, model.as_deref()),
        Command::Plan(args) => plan_cli::run(&args),
        Command::Corpus(args) => corpus_cli::run(&args),
        Command::Rendezvous(args) => launch_cli::rendezvous(&args),
        Command::Worker(args) => launch_cli::worker(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sparkd: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => {
            // https://no-color.org: set and not empty turns colour off.
            let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
            logs.with_ansi(std::io::stderr().is_terminal() && !no_color).init();
        }
        LogFormat::Json => logs.json().flatten_event(true).with_current_span(false).with_span_list(false).init(),
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

fn synth_trained(out: &Path) -> Result<()> {
    let model = TrainedModel::embedded()?;
    let bytes = model.write_checkpoint(out)?;
    println!(
        "wrote {TRAINED_NAME} and its DSpark drafter to {}: {bytes} bytes of tensor data ({} kept token rows)",
        out.display(),
        model.kept_ids().len()
    );
    Ok(())
}

fn export_tokenizer(dir: &Path, model: Option<&Path>) -> Result<()> {
    let tokenizer = load_tokenizer(model)?;
    export_hf(&tokenizer, dir)?;
    println!("wrote a Hugging Face tokenizer ({} ids) to {}", tokenizer.vocab_size(), dir.display());
    Ok(())
}

fn serve(args: ServeArgs) -> Result<()> {
    args.validate()?;
    if args.device == Device::Cuda && (args.tensor_parallel_size > 1 || args.launch.nnodes > 1) {
        return launch_cli::serve_sharded_cuda(&args, |args, group| serve_on(args, Some(group)));
    }
    serve_on(args, None)
}

/// Serves `args` until stopped, on rank 0 of `group` when a CUDA group was formed for it (`launch_cli`).
fn serve_on(args: ServeArgs, group: Option<DeviceGroup>) -> Result<()> {
    let addr = args.listen_addr()?;
    let model_name = args.model_name();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    // Bound before the model loads, as vLLM binds its socket before its engine starts: a port in use fails at
    // once, not after minutes of loading, and clients that connect meanwhile wait in the backlog.
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(addr))
        .with_context(|| format!("--host/--port: cannot listen on {addr}"))?;
    tracing::info!("bound to {}; loading the model", listener.local_addr()?);
    let served = compose(&args, group)?;
    let cfg = &served.model;
    let max_model_len = args.max_model_len.min(cfg.max_position_embeddings);
    tracing::info!(
        model = %model_name, device = %served.runner.device_name(), max_model_len,
        "model ready ({} layers, hidden {})", cfg.num_layers(), cfg.hidden_size
    );
    let metrics = sparkd::metrics::install(&model_name).context("installing the Prometheus recorder")?;
    let template = served.template.clone();
    let engine = start_engine(&args, served, &model_name)?;

    let engine_handle = engine.handle();
    let keys = auth::load_keys(&args.api_keys, args.api_key_file.as_deref()).map_err(anyhow::Error::msg)?;
    let access = auth::Access::new(&keys, &args.allow_origins).map_err(|e| anyhow::anyhow!("--api-key: {e}"))?;
    if !access.requires_key() && !addr.ip().is_loopback() {
        tracing::warn!("listening on {addr} without --api-key: every client that reaches it is served");
    }
    let open_files = sparkd::api::conn::raise_open_file_limit().context("reading the open-file limit")?;
    let conn_limits = args.limits.conn_limits(open_files)?;
    runtime.block_on(async move {
        let bound = listener.local_addr()?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let state = Arc::new(
            AppState::new(
                engine_handle,
                template,
                model_name,
                max_model_len,
                args.max_body_bytes,
                metrics.clone(),
                stop_rx.clone(),
            )
            .with_access(access)
            .with_max_waiting(args.max_waiting)
            .with_limits(args.limits.request_limits(max_model_len))
            .with_prep_threads(args.limits.prep_threads())
            .with_conn_limits(conn_limits),
        );
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                metrics.run_upkeep();
            }
        });
        if args.log_stats_interval > 0 {
            let every = std::time::Duration::from_secs(args.log_stats_interval);
            tokio::spawn(sparkd::api::throughput::log_every(state.clone(), every));
        }
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("signal received");
            let _ = stop_tx.send(true);
        });
        // Tests and scripts read this line to learn the port.
        tracing::info!("listening on http://{bound}");
        http::serve(listener, state, stop_rx, std::time::Duration::from_secs(args.shutdown_timeout)).await;
        anyhow::Ok(())
    })?;
    engine.shutdown();
    tracing::info!("stopped");
    Ok(())
}

/// Sizes the memory budgets from the memory present and starts the engine, with its kept responses restored
/// from and written to the session journal when `--session-dir` is given.
fn start_engine(args: &ServeArgs, served: Served, model_name: &str) -> Result<Engine> {
    let cfg = &served.model;
    let present = MemoryPresent::read(served.device).unwrap_or_else(|e| {
        tracing::warn!("cannot read the memory present ({e}): the budgets take their fixed defaults, unchecked");
        MemoryPresent::unknown()
    });
    let budgets = args.memory.budgets(&present)?;
    tracing::info!(
        "memory budgets: states {} MiB, host offload {} MiB, kept responses {} MiB, prefix cache {} MiB host and \
         {} MiB device (host available {} MiB{})",
        budgets.state_bytes >> 20,
        budgets.host_offload_bytes >> 20,
        budgets.kept_responses_bytes >> 20,
        budgets.prefix_cache_bytes >> 20,
        budgets.prefix_device_bytes >> 20,
        present.host_available >> 20,
        present.device_free.map(|f| format!(", device free {} MiB", f >> 20)).unwrap_or_default(),
    );
    let config = sparkd::engine::EngineConfig { step_time: served.step_time, ..args.engine_config(&budgets) };
    match &args.session_dir {
        Some(dir) => {
            // Token ids only mean the same text to the same model and tokenizer.
            let fingerprint = format!(
                "{model_name} layers={} hidden={} vocab={}",
                cfg.num_layers(),
                cfg.hidden_size,
                served.template.tokenizer().vocab_size()
            );
            let journal = OpenJournal::open(dir, &fingerprint).context("--session-dir")?;
            sparkd::engine::spawn_journaled(served.runner, served.speculation, config, journal)
        }
        None => {
            tracing::warn!(
                "kept responses live in memory only: a restart loses them (give --session-dir to keep them)"
            );
            sparkd::engine::spawn(served.runner, served.speculation, config)
        }
    }
    .context("starting the engine thread")
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
