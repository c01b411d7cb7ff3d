//! `sparkd-replay`: AgentX-style trace replay against sparkd (or any OpenAI-compatible server).
//!
//! `sparkd-replay run --traces DIR ...` replays once (or `--sweep 1,2,4,8`, once per concurrency,
//! then the Pareto frontier as JSON and SVG); `sparkd-replay compare A.json B.json` prints a
//! side-by-side table with ratios. Exit status 1 on any error, with the error on stderr.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

use sparkd_workloads::metrics::summary_table;
use sparkd_workloads::pareto::svg;
use sparkd_workloads::replay::ReplayOptions;
use sparkd_workloads::report::{compare, read_runs, write_json};
use sparkd_workloads::run::{prepare, run_once, sweep, RunTarget, TransportKind};
use sparkd_workloads::synth::HistoryMode;
use sparkd_workloads::{ReplayError, Result};

#[derive(Parser)]
#[command(name = "sparkd-replay", version, about = "AgentX-style trace replay for sparkd")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay traces against a server.
    Run(Box<RunArgs>),
    /// Compare two reports side by side (ratios B/A).
    Compare { a: PathBuf, b: PathBuf },
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    Chat,
    Ws,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// API key of a daemon started with `--api-key` (sent as `Authorization: Bearer KEY`).
    #[arg(long, env = "SPARKD_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Trace files or folders (Weka .json, Mooncake .jsonl); repeatable.
    #[arg(long, required = true)]
    traces: Vec<PathBuf>,
    #[arg(long, value_enum, default_value = "chat")]
    transport: TransportArg,
    /// Model name sent with every request.
    #[arg(long, default_value = "k3-tiny")]
    model: String,
    /// Live session trees.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Comma-separated concurrencies: one run each, then the Pareto frontier.
    #[arg(long, value_delimiter = ',')]
    sweep: Vec<usize>,
    /// Profiling seconds per run.
    #[arg(long)]
    duration: Option<f64>,
    /// Profiled requests per run at most.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Factor on recorded think times (0 = back to back).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Factor on recorded input/output lengths, in (0, 1]; the hash-block structure is kept.
    #[arg(long, default_value_t = 1.0)]
    token_scale: f64,
    /// Whole-system idle cap in seconds (0 turns it off).
    #[arg(long, default_value_t = 10.0)]
    system_idle_cap: f64,
    /// Cap on each single delay within a tree, seconds.
    #[arg(long)]
    tree_idle_cap: Option<f64>,
    /// t* range of the first population, as `MIN,MAX` fractions of each trace's duration.
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.75")]
    start_ratio: Vec<f64>,
    /// Start every first play at turn 0, with no warmup primer.
    #[arg(long)]
    no_warmup: bool,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// GPUs the server uses, for per-GPU throughput.
    #[arg(long, default_value_t = 1)]
    gpus: u32,
    /// Checkpoint folder whose tiktoken.model the server uses (default: the built-in tokenizer).
    #[arg(long)]
    tokenizer_dir: Option<PathBuf>,
    /// Seconds requests in flight may take to finish after the stop.
    #[arg(long, default_value_t = 120.0)]
    grace: f64,
    /// JSON report path; a sweep also writes the SVG next to it (`.svg`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
}

fn seconds(option: &str, v: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| ReplayError::Option { option: option.into(), reason: format!("{v} is not a duration") })
}

fn run_target(args: &RunArgs) -> Result<RunTarget> {
    let start_ratio = match (args.no_warmup, args.start_ratio.as_slice()) {
        (true, _) => None,
        (false, [lo, hi]) => Some((*lo, *hi)),
        (false, other) => {
            return Err(ReplayError::Option {
                option: "--start-ratio".into(),
                reason: format!("expected MIN,MAX, found {other:?}"),
            })
        }
    };
    let options = ReplayOptions {
        concurrency: args.concurrency,
        duration: args.duration.map(|d| seconds("--duration", d)).transpose()?,
        max_requests: args.max_requests,
        time_scale: args.time_scale,
        system_idle_cap: (args.system_idle_cap > 0.0)
            .then(|| seconds("--system-idle-cap", args.system_idle_cap))
            .transpose()?,
        tree_idle_cap: args.tree_idle_cap.map(|d| seconds("--tree-idle-cap", d)).transpose()?,
        start_ratio,
        seed: args.seed,
        model: args.model.clone(),
        history: HistoryMode::Resend,
        grace: seconds("--grace", args.grace)?,
        progress_every: (!args.quiet).then_some(Duration::from_secs(2)),
    };
    options.validate()?;
    Ok(RunTarget {
        url: args.url.clone(),
        api_key: args.api_key.clone(),
        transport: match args.transport {
            TransportArg::Chat => TransportKind::Chat,
            TransportArg::Ws => TransportKind::Ws,
        },
        traces: args.traces.clone(),
        options,
        token_scale: args.token_scale,
        gpus: args.gpus,
        tokenizer_dir: args.tokenizer_dir.clone(),
    })
}

async fn run(args: RunArgs) -> Result<()> {
    let target = run_target(&args)?;
    let prepared = prepare(&target)?;
    eprintln!(
        "{} sessions, {} requests; transport {}, token scale {}, time scale {}",
        prepared.sessions.len(),
        prepared.sessions.iter().map(|s| s.request_count()).sum::<usize>(),
        target.transport.name(),
        target.token_scale,
        target.options.time_scale
    );
    if args.sweep.is_empty() {
        let report = run_once(&target, &prepared, args.concurrency).await?;
        println!("{}", summary_table(&report.summary));
        if let Some(out) = &args.out {
            write_json(out, &report)?;
        }
    } else {
        let report = sweep(&target, &prepared, &args.sweep).await?;
        println!("{:>12}{:>22}{:>20}{:>16}", "concurrency", "P90 interactivity", "total tok/s/GPU", "on frontier");
        for p in &report.points {
            let on = report.frontier.iter().any(|f| f.concurrency == p.concurrency);
            println!("{:>12}{:>22.2}{:>20.1}{:>16}", p.concurrency, p.x, p.y, if on { "yes" } else { "" });
        }
        if let Some(out) = &args.out {
            write_json(out, &report)?;
            let title = format!("sparkd-replay sweep ({})", target.transport.name());
            std::fs::write(out.with_extension("svg"), svg(&report.points, &title))
                .map_err(|e| ReplayError::Report { path: out.with_extension("svg"), reason: e.to_string() })?;
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(*args).await,
        Command::Compare { a, b } => read_runs(&a).and_then(|ra| {
            let rb = read_runs(&b)?;
            print!("{}", compare(&ra, &rb));
            Ok(())
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sparkd-replay: {} error: {e}", e.kind());
            ExitCode::FAILURE
        }
    }
}
