//! `sparkd-replay`: AgentX-style trace replay against sparkd (or any OpenAI-compatible server).
//!
//! `sparkd-replay run --traces DIR ...` replays once (or `--sweep 1,2,4,8`, once per concurrency,
//! then the Pareto frontier as JSON and SVG); `sparkd-replay compare A.json B.json` prints a
//! side-by-side table with ratios; `sparkd-replay report RUN.json... --html OUT.html` writes the
//! one-page HTML report of several runs. Exit status 1 on any error, with the error on stderr.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};

use sparkd_workloads::metrics::summary_table;
use sparkd_workloads::plot::{pareto, Chart, ParetoSeries};
use sparkd_workloads::replay::ReplayOptions;
use sparkd_workloads::report::{compare, read_labelled, run_line, write_json, SweepReport};
use sparkd_workloads::run::{prepare, run_once, sweep, RunTarget, TransportKind};
use sparkd_workloads::server::ServerClient;
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
    /// Compare two reports side by side, columns named by their runs' labels (ratios second / first).
    Compare(CompareArgs),
    /// Write one self-contained HTML page comparing runs: summary, Pareto frontiers, latency distributions,
    /// acceptance by draft position, cache hit rates.
    Report(ReportArgs),
}

#[derive(clap::Args)]
struct CompareArgs {
    first: PathBuf,
    second: PathBuf,
    /// Labels for the two reports' runs, in order (default: the labels they were written with).
    #[arg(long)]
    label: Vec<String>,
}

#[derive(clap::Args)]
struct ReportArgs {
    /// Run or sweep reports (`run --out`); runs with the same label form one series.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// The HTML page to write.
    #[arg(long)]
    html: PathBuf,
    /// Label for the runs of each file, in file order (repeatable; default: the labels they were written with).
    #[arg(long)]
    label: Vec<String>,
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
    /// Model name sent with every request (default: the one model the server lists at GET /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Names the run in reports and plots (default: the stem of --out, else the model).
    #[arg(long)]
    label: Option<String>,
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
    /// GPUs the server uses, for per-GPU throughput (without it, throughput is the whole server's).
    #[arg(long)]
    gpus: Option<u32>,
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

fn run_target(args: &RunArgs, model: String) -> Result<RunTarget> {
    if args.gpus == Some(0) {
        return Err(ReplayError::option("--gpus", "must be >= 1 (leave it out when the server has no GPU)"));
    }
    let label = match (&args.label, &args.out) {
        (Some(l), _) if l.trim().is_empty() => return Err(ReplayError::option("--label", "is empty")),
        (Some(l), _) => l.clone(),
        (None, Some(out)) => out.file_stem().map_or_else(|| model.clone(), |s| s.to_string_lossy().into_owned()),
        (None, None) => model.clone(),
    };
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
        model,
        history: HistoryMode::Resend,
        grace: seconds("--grace", args.grace)?,
        progress_every: (!args.quiet).then_some(Duration::from_secs(2)),
    };
    options.validate()?;
    Ok(RunTarget {
        label,
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
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let m = ServerClient::new(&args.url, args.api_key.as_deref())?.served_model().await?;
            eprintln!("model {m} (the one GET /v1/models lists)");
            m
        }
    };
    let target = run_target(&args, model)?;
    let prepared = prepare(&target)?;
    eprintln!(
        "{} sessions loaded, {} requests in one full play of each (main-agent and subagent turns); transport {}, \
         token scale {}, time scale {}",
        prepared.sessions.len(),
        prepared.sessions.iter().map(|s| s.request_count()).sum::<usize>(),
        target.transport.name(),
        target.token_scale,
        target.options.time_scale
    );
    if args.sweep.is_empty() {
        let report = run_once(&target, &prepared, args.concurrency).await?;
        println!("{}\n{}", run_line(&report), summary_table(&report.summary));
        if let Some(out) = &args.out {
            write_json(out, &report)?;
        }
    } else {
        let report = sweep(&target, &prepared, &args.sweep).await?;
        let per_gpu = report.points.iter().all(|p| p.per_gpu);
        let unit = if per_gpu { "total tok/s/GPU" } else { "total tok/s" };
        println!("{:>12}{:>22}{:>20}{:>16}", "concurrency", "P90 interactivity", unit, "on frontier");
        for p in &report.points {
            let on = report.frontier.iter().any(|f| f.concurrency == p.concurrency);
            println!("{:>12}{:>22.2}{:>20.1}{:>16}", p.concurrency, p.x, p.y, if on { "yes" } else { "" });
        }
        if let Some(out) = &args.out {
            write_json(out, &report)?;
            write_sweep_svg(&out.with_extension("svg"), &report, per_gpu)?;
        }
    }
    Ok(())
}

/// The sweep's Pareto plot: its one series.
fn write_sweep_svg(path: &std::path::Path, report: &SweepReport, per_gpu: bool) -> Result<()> {
    let transport = report.runs.first().map_or("", |r| r.config.transport.as_str());
    let chart = Chart {
        title: format!("sparkd-replay sweep: {} ({transport})", report.label),
        x_label: "P90 interactivity (tokens/s/user)".into(),
        y_label: format!("total throughput ({})", if per_gpu { "tokens/s per GPU" } else { "tokens/s, whole server" }),
        width: 900,
        height: 560,
    };
    let series = ParetoSeries { label: report.label.clone(), points: report.points.clone() };
    std::fs::write(path, pareto(&chart, &[series])?)
        .map_err(|e| ReplayError::Report { path: path.to_path_buf(), reason: e.to_string() })
}

fn report(args: &ReportArgs) -> Result<()> {
    let runs = read_labelled(&args.runs, &args.label)?;
    let page = sparkd_workloads::html::report(&runs)?;
    std::fs::write(&args.html, page)
        .map_err(|e| ReplayError::Report { path: args.html.clone(), reason: e.to_string() })?;
    eprintln!("wrote {} ({} runs)", args.html.display(), runs.len());
    Ok(())
}

fn compare_reports(args: &CompareArgs) -> Result<()> {
    if args.label.len() > 2 {
        return Err(ReplayError::option("--label", "compare takes at most two labels, one per report"));
    }
    let first = read_labelled(std::slice::from_ref(&args.first), args.label.get(..1).unwrap_or_default())?;
    let second = read_labelled(std::slice::from_ref(&args.second), args.label.get(1..).unwrap_or_default())?;
    print!("{}", compare(&first, &second));
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(*args).await,
        Command::Compare(args) => compare_reports(&args),
        Command::Report(args) => report(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sparkd-replay: {} error: {e}", e.kind());
            ExitCode::FAILURE
        }
    }
}
