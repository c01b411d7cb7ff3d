//! One replay run or a sweep, from loaded traces to a [`RunReport`]: the glue behind the CLI.
//!
//! Invariants: traces are read and the token pool is vetted once per invocation, before any
//! request; a sweep runs its concurrencies one after another with the same seed and traces. The
//! server's `/metrics` is scraped after the warmup and after the run, so its counters cover the
//! profiled requests only; a failed scrape is noted in the report and never fails the run.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::dag::{sessions, Session};
use crate::error::{ReplayError, Result};
use crate::metrics::summarize;
use crate::pareto::frontier;
use crate::prometheus::ServerStats;
use crate::replay::{profile, warm_up, ReplayOptions, RunOutcome};
use crate::report::{tool_name, RunConfig, RunReport, ServerCounters, SweepReport, Throughput};
use crate::server::ServerClient;
use crate::synth::{HistoryMode, Synth, TokenPool};
use crate::trace::read_all;
use crate::transport::chat::ChatTransport;
use crate::transport::ws::WsTransport;
use crate::transport::Transport;

/// Which wire protocol a run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// `/v1/chat/completions`, full history each turn.
    Chat,
    /// Responses WebSocket, `previous_response_id` chaining.
    Ws,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Chat => "chat",
            TransportKind::Ws => "ws",
        }
    }

    pub fn history(self) -> HistoryMode {
        match self {
            TransportKind::Chat => HistoryMode::Resend,
            TransportKind::Ws => HistoryMode::ServerKept,
        }
    }
}

/// Everything a run needs besides the concurrency.
#[derive(Clone, Debug)]
pub struct RunTarget {
    /// Names the run (or the sweep's series) in reports.
    pub label: String,
    pub url: String,
    /// Sent as `Authorization: Bearer KEY` (a daemon started with `--api-key`).
    pub api_key: Option<String>,
    pub transport: TransportKind,
    pub traces: Vec<PathBuf>,
    pub options: ReplayOptions,
    pub token_scale: f64,
    /// GPUs the server uses, when known: per-GPU throughput needs it.
    pub gpus: Option<u32>,
    /// A checkpoint folder with `tiktoken.model`; `None` uses the daemon's built-in tokenizer.
    pub tokenizer_dir: Option<PathBuf>,
}

/// Loaded inputs, shared by every run of a sweep.
pub struct Prepared {
    pub sessions: Arc<Vec<Session>>,
    pub synth: Arc<Synth>,
}

/// Reads the traces and vets the token pool.
pub fn prepare(target: &RunTarget) -> Result<Prepared> {
    let files = read_all(&target.traces)?;
    let sessions: Vec<Session> = sessions(&files).into_iter().filter(|s| !s.main.turns.is_empty()).collect();
    if sessions.is_empty() {
        return Err(ReplayError::option("--traces", "the traces hold no main-agent requests"));
    }
    let tokenizer = crate::codec::daemon_tokenizer(target.tokenizer_dir.as_deref())?;
    let pool = TokenPool::build(&tokenizer)?;
    let synth = Synth::new(pool, target.token_scale)?;
    Ok(Prepared { sessions: Arc::new(sessions), synth: Arc::new(synth) })
}

/// Runs once at `concurrency`.
pub async fn run_once(target: &RunTarget, prepared: &Prepared, concurrency: usize) -> Result<RunReport> {
    let mut options = target.options.clone();
    options.concurrency = concurrency;
    options.history = target.transport.history();
    let server = ServerClient::new(&target.url, target.api_key.as_deref())?;
    let (outcome, counters) = match target.transport {
        TransportKind::Chat => {
            let t = Arc::new(ChatTransport::new(&target.url, target.api_key.as_deref())?);
            replay_scraped(t, prepared, &options, &server).await?
        }
        TransportKind::Ws => {
            let t = Arc::new(WsTransport::new(&target.url, target.api_key.as_deref())?);
            replay_scraped(t, prepared, &options, &server).await?
        }
    };
    if let ServerCounters::Unavailable { reason } = &counters {
        eprintln!("sparkd-replay: the server's counters are not in the report: {reason}");
    }
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
    Ok(RunReport {
        tool: tool_name(),
        label: target.label.clone(),
        server: Some(counters),
        config: RunConfig {
            url: target.url.clone(),
            transport: target.transport.name().into(),
            model: options.model.clone(),
            concurrency,
            duration_s: secs(options.duration),
            max_requests: options.max_requests,
            time_scale: options.time_scale,
            token_scale: target.token_scale,
            system_idle_cap_s: secs(options.system_idle_cap),
            tree_idle_cap_s: secs(options.tree_idle_cap),
            start_ratio: options.start_ratio,
            seed: options.seed,
            gpus: target.gpus,
            traces: target.traces.iter().map(|p| p.display().to_string()).collect(),
            sessions: prepared.sessions.len(),
        },
        summary: summarize(&outcome.records, target.gpus),
        warmup_requests: outcome.warmup_requests,
        plays: outcome.plays,
        wall_s: outcome.wall_s,
        idle_skipped_s: outcome.idle_skipped_s,
        records: outcome.records,
    })
}

/// Warms the lanes up, scrapes, profiles, scrapes again.
async fn replay_scraped<T: Transport>(
    transport: Arc<T>,
    prepared: &Prepared,
    options: &ReplayOptions,
    server: &ServerClient,
) -> Result<(RunOutcome, ServerCounters)> {
    let warm = warm_up(transport, prepared.synth.clone(), prepared.sessions.clone(), options.clone()).await?;
    let before = server.scrape().await;
    let outcome = profile(warm).await?;
    let counters = match (before, server.scrape().await) {
        (Ok(before), Ok(after)) => ServerCounters::Scraped(ServerStats::between(&before, &after)),
        (Err(e), _) | (_, Err(e)) => ServerCounters::Unavailable { reason: e.to_string() },
    };
    Ok((outcome, counters))
}

/// Runs each concurrency in turn and computes the frontier (total throughput, per GPU when known).
pub async fn sweep(target: &RunTarget, prepared: &Prepared, concurrencies: &[usize]) -> Result<SweepReport> {
    let mut runs = Vec::new();
    for &c in concurrencies {
        let report = run_once(target, prepared, c).await?;
        eprintln!("{}\n{}", crate::report::run_line(&report), crate::metrics::summary_table(&report.summary));
        runs.push(report);
    }
    let points: Vec<_> = runs.iter().map(|r| r.point(Throughput::Total, true)).collect();
    Ok(SweepReport { tool: tool_name(), label: target.label.clone(), frontier: frontier(&points), points, runs })
}
