//! Every Prometheus metric sparkd exports: names, buckets, descriptions, and the recorder install.
//!
//! Invariants:
//! - Every metric name is a constant in this file; code elsewhere records through the `metrics` facade
//!   (`metrics::counter!(metrics::GENERATION_TOKENS_TOTAL)...`) with these constants, never a literal.
//! - vLLM's names, types and buckets where vLLM has the metric (reference/agentx.md §5.1), so AIPerf, the
//!   InferenceX aggregator and vLLM's Grafana dashboards read them unchanged; `sparkd:` names for the rest.
//! - Counters carry the `_total` suffix in their name, so the text exposition says
//!   `# TYPE vllm:prompt_tokens_total counter` exactly as Python `prometheus_client` does (agentx.md §5.3).
//! - Every series carries the global labels `model_name` and `engine` (vLLM's label set); the only other labels
//!   are low-cardinality enums (`finished_reason`, `kind`, `tier`, `endpoint`, `status`, the engine `phase`, the
//!   admission `how`, and the draft `position`,
//!   at most `--num-spec-tokens` values). Never a request,
//!   response or session id.
//! - Every histogram has explicit buckets (without them the exporter would render summaries).
//! - [`install`] registers every metric at zero, so `/metrics` lists the whole set from the first scrape.
//!
//! Who records what (so nothing is counted twice):
//! - the engine thread: TTFT, per-token ITL (a step committing k tokens records k samples of interval/k), the
//!   per-step interval, queue/prefill/decode/inference time, prompt tokens computed, generation tokens,
//!   prefix- and session-cache queries/hits (`engine::reuse`), running/waiting, KV/state usage, sessions,
//!   speculation counters, client disconnects (a failed send on a request's event channel), its own phase
//!   times and per-request admission times, and the errors it raises itself;
//! - the API layer: end-to-end latency, per-request TPOT, `request_success`, request prompt/generation length,
//!   P90 interactivity, the errors it raises (validation, context length, engine gone), HTTP requests by
//!   endpoint and status, open WebSockets.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

// ---- vLLM names (reference/agentx.md §5.1) ----

/// Histogram: seconds from arrival to the first generated token.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "vllm:time_to_first_token_seconds";
/// Histogram: seconds between committed tokens, one sample per token (a step committing k tokens records k
/// samples of interval/k, so speculation does not distort it; agentx.md §2.4).
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "vllm:inter_token_latency_seconds";
/// Histogram: per finished request, (e2e − TTFT) / (output tokens − 1).
pub const REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "vllm:request_time_per_output_token_seconds";
/// Histogram: seconds from arrival to the last token.
pub const E2E_REQUEST_LATENCY_SECONDS: &str = "vllm:e2e_request_latency_seconds";
/// Histogram: seconds a request waited before it was first scheduled.
pub const REQUEST_QUEUE_TIME_SECONDS: &str = "vllm:request_queue_time_seconds";
/// Histogram: seconds from first scheduled to first token.
pub const REQUEST_PREFILL_TIME_SECONDS: &str = "vllm:request_prefill_time_seconds";
/// Histogram: seconds from first token to last token.
pub const REQUEST_DECODE_TIME_SECONDS: &str = "vllm:request_decode_time_seconds";
/// Histogram: seconds from first scheduled to last token.
pub const REQUEST_INFERENCE_TIME_SECONDS: &str = "vllm:request_inference_time_seconds";
/// Histogram: prompt length of each finished request, in tokens.
pub const REQUEST_PROMPT_TOKENS: &str = "vllm:request_prompt_tokens";
/// Histogram: generated length of each finished request, in tokens.
pub const REQUEST_GENERATION_TOKENS: &str = "vllm:request_generation_tokens";
/// Counter: prompt tokens computed by prefill (cached tokens excluded).
pub const PROMPT_TOKENS_TOTAL: &str = "vllm:prompt_tokens_total";
/// Counter: tokens generated.
pub const GENERATION_TOKENS_TOTAL: &str = "vllm:generation_tokens_total";
/// Counter: prompt tokens looked up for reuse (all of a request's context but its last token), in a kept
/// response's state (`previous_response_id`) or the prefix cache (`engine::reuse`).
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "vllm:prefix_cache_queries_total";
/// Counter: looked-up prompt tokens served from a kept response's state or a prefix-cache snapshot, not computed.
pub const PREFIX_CACHE_HITS_TOTAL: &str = "vllm:prefix_cache_hits_total";
/// Counter with label `finished_reason` (`stop`, `length`, `abort`): finished requests.
pub const REQUEST_SUCCESS_TOTAL: &str = "vllm:request_success_total";
/// Gauge: requests in the running batch.
pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
/// Gauge: requests queued, not yet scheduled.
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
/// Gauge: fraction (0–1) of the device state budget in use.
pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
/// Counter: verify steps that carried drafts.
pub const SPEC_DECODE_NUM_DRAFTS_TOTAL: &str = "vllm:spec_decode_num_drafts_total";
/// Counter: draft tokens proposed.
pub const SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL: &str = "vllm:spec_decode_num_draft_tokens_total";
/// Counter: draft tokens accepted (the bonus token excluded).
pub const SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL: &str = "vllm:spec_decode_num_accepted_tokens_total";
/// Counter with label `position` (0-based draft position): rounds in which that position was accepted.
pub const SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL: &str = "vllm:spec_decode_num_accepted_tokens_per_pos_total";

// ---- sparkd names ----

/// Counter with label `position` (0-based draft position): verify rounds whose draft had a token at that
/// position, the denominator of the per-position acceptance rate (verify budgets cut drafts to varying lengths).
pub const SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POS_TOTAL: &str = "sparkd:spec_decode_num_draft_tokens_per_pos_total";
/// Gauge: mean acceptance length since start-up, `1 + accepted / drafts` (bonus included). For a benchmark
/// window use the counters' deltas instead, as vLLM's tools do.
pub const SPEC_DECODE_MEAN_ACCEPTANCE_LENGTH: &str = "sparkd:spec_decode_mean_acceptance_length";
/// Counter: verify rounds whose acceptance was forced (`--spec-synthetic-al`; included in `num_drafts`).
pub const SPEC_DECODE_NUM_SYNTHETIC_DRAFTS_TOTAL: &str = "sparkd:spec_decode_num_synthetic_drafts_total";
/// Gauge: the forced mean acceptance length (`--spec-synthetic-al`), 0 when acceptance is not forced.
pub const SPEC_DECODE_FORCED_ACCEPTANCE_LENGTH: &str = "sparkd:spec_decode_forced_acceptance_length";
/// Counter: decode steps whose model-drafting round the drafting gate skipped (drafts could not pay).
pub const SPEC_DECODE_GATED_STEPS_TOTAL: &str = "sparkd:spec_decode_gated_steps_total";
/// Counter: model-drafting rounds made as probes while the gate was skipping (to see acceptance come back).
pub const SPEC_DECODE_PROBES_TOTAL: &str = "sparkd:spec_decode_probes_total";
/// Gauge: the acceptance length the drafting gate expects of a model draft, `1 + Σ_j ē_j` over the calibrated
/// survivals of a typical draft (0 until the gate has judged a step).
pub const SPEC_DECODE_CALIBRATED_ACCEPTANCE_LENGTH: &str = "sparkd:spec_decode_calibrated_acceptance_length";
/// Gauge: 1 / P90 of per-request mean ITL over the recent window ([`InteractivityWindow`]), tokens/s/user.
pub const INTERACTIVITY_P90_TOKENS_PER_SECOND: &str = "sparkd:interactivity_p90_tokens_per_second";
/// Histogram: seconds per engine step that emitted tokens (one sample per step per request).
pub const STEP_INTERVAL_SECONDS: &str = "sparkd:step_interval_seconds";
/// Counter: responses kept for continuation (`store`, sessions).
pub const SESSIONS_KEPT_TOTAL: &str = "sparkd:sessions_kept_total";
/// Counter with label `tier` (`host`, `dropped`, `removed`): kept states evicted from the device, or dropped
/// from host (the history stays), or kept responses removed entirely by the kept-responses byte budget.
pub const SESSIONS_EVICTED_TOTAL: &str = "sparkd:sessions_evicted_total";
/// Counter: kept responses deleted by a client (`DELETE /v1/responses/{id}`).
pub const SESSIONS_DELETED_TOTAL: &str = "sparkd:sessions_deleted_total";
/// Counter with label `tier` (`device`, `host`, `prefill`): continuations, by where the state came from.
pub const SESSIONS_RESTORED_TOTAL: &str = "sparkd:sessions_restored_total";
/// Counter: prompt tokens of continuations (`previous_response_id`) a kept state could have served (all of the
/// context but its last token).
pub const SESSION_CACHE_QUERIES_TOTAL: &str = "sparkd:session_cache_queries_total";
/// Counter: continuation tokens restored from the kept state (none when the state was dropped: rebuilt by prefill).
pub const SESSION_CACHE_HITS_TOTAL: &str = "sparkd:session_cache_hits_total";
/// Gauge: kept responses currently held.
pub const SESSIONS_KEPT: &str = "sparkd:sessions_kept";
/// Gauge: bytes kept responses hold (states in every tier, token histories, stored response objects): what
/// `--kept-responses-bytes` bounds.
pub const SESSIONS_BYTES: &str = "sparkd:sessions_bytes";
/// Gauge with label `tier` (`device`, `host`): bytes of per-sequence state held.
pub const STATE_MEMORY_BYTES: &str = "sparkd:state_memory_bytes";
/// Gauge with label `tier` (`device`: forked runner states, `host`: exported copies): bytes held by prefix-cache
/// snapshots.
pub const PREFIX_CACHE_BYTES: &str = "sparkd:prefix_cache_bytes";
/// Counter with label `to` (`host`: a device snapshot exported down a tier, `dropped`): prefix-cache snapshots
/// moved out of a full tier.
pub const PREFIX_CACHE_MOVES_TOTAL: &str = "sparkd:prefix_cache_moves_total";
/// Counter with label `kind` (an error's stable `kind()`): failed requests.
pub const ERRORS_TOTAL: &str = "sparkd:errors_total";
/// Counter with labels `endpoint` and `status`: HTTP requests answered.
pub const HTTP_REQUESTS_TOTAL: &str = "sparkd:http_requests_total";
/// Gauge: open WebSocket connections.
pub const WEBSOCKETS_OPEN: &str = "sparkd:websockets_open";
/// Counter: requests whose client went away before they finished.
pub const CLIENT_DISCONNECTS_TOTAL: &str = "sparkd:client_disconnects_total";
/// HTTP connections open; an upgraded WebSocket leaves it for `websockets_open` (keeping its connection slot).
pub const HTTP_CONNECTIONS_OPEN: &str = "sparkd:http_connections_open";
/// Requests cancelled because their client left `--max-event-backlog` events unread.
pub const SLOW_READER_CANCELS_TOTAL: &str = "sparkd:slow_reader_cancels_total";
/// Histogram with label `phase` ([`ENGINE_PHASES`]): seconds the engine thread spent in one phase of one turn
/// of its loop; the phases of a turn add up to the turn (`crate::engine::phases`).
pub const ENGINE_PHASE_SECONDS: &str = "sparkd:engine_phase_seconds";
/// Histogram with label `how` (`continued`, `prefix`, `fresh`): seconds to give one admitted request its state
/// (a kept response's checkout, a prefix-cache import, or a fresh allocation) and begin its speculation.
pub const REQUEST_ADMIT_SECONDS: &str = "sparkd:request_admit_seconds";
/// Histogram: host seconds computing one step's grammar masks (constrained requests only), on a helper thread
/// while the engine thread launches the step's forward and the device runs it (`engine::constraints`).
pub const CONSTRAINT_MASK_SECONDS: &str = "sparkd:constraint_mask_seconds";

/// The `phase` label values of [`ENGINE_PHASE_SECONDS`], in loop order.
pub const ENGINE_PHASES: &[&str] =
    &["idle", "commands", "admit", "draft", "schedule", "step", "apply", "emit", "memory"];

/// vLLM's TTFT buckets (agentx.md §5.1).
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
/// vLLM's ITL / TPOT buckets, with sub-10 ms bounds prepended: decode on an H200 and the null runner land there.
pub const ITL_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
];
/// vLLM's request-latency buckets (E2E, queue, prefill, decode, inference).
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];
/// Engine phase buckets: 10 µs to 1 s, fine enough to tell a 50 µs host phase from a 4 ms device step.
pub const PHASE_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0,
];
/// 1-2-5 buckets for token counts, up to 1M tokens (vLLM builds them up to max_model_len).
pub const TOKEN_COUNT_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
    200000.0, 500000.0, 1000000.0,
];

/// Metric kind, for describing and registering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// One exported metric: its name, kind, the label values it is pre-registered with, and its help text.
#[derive(Clone, Copy, Debug)]
pub struct MetricDef {
    pub name: &'static str,
    pub kind: MetricKind,
    /// `(label, values)` to register at zero; empty for unlabelled metrics (besides the global labels).
    pub labels: (&'static str, &'static [&'static str]),
    pub help: &'static str,
}

const NO_LABELS: (&str, &[&str]) = ("", &[]);

const fn def(name: &'static str, kind: MetricKind, help: &'static str) -> MetricDef {
    MetricDef { name, kind, labels: NO_LABELS, help }
}

const fn labelled(
    name: &'static str,
    kind: MetricKind,
    labels: (&'static str, &'static [&'static str]),
    help: &'static str,
) -> MetricDef {
    MetricDef { name, kind, labels, help }
}

use MetricKind::{Counter, Gauge, Histogram};

/// Every metric sparkd exports, with its help text.
pub const ALL_METRICS: &[MetricDef] = &[
    def(TIME_TO_FIRST_TOKEN_SECONDS, Histogram, "Histogram of time to first token in seconds."),
    def(
        INTER_TOKEN_LATENCY_SECONDS,
        Histogram,
        "Histogram of inter-token latency in seconds, one sample per committed token (a step that commits k tokens records k samples of step/k).",
    ),
    def(
        REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
        Histogram,
        "Histogram of time_per_output_token_seconds per request: (e2e - ttft) / (output_tokens - 1).",
    ),
    def(E2E_REQUEST_LATENCY_SECONDS, Histogram, "Histogram of e2e request latency in seconds."),
    def(REQUEST_QUEUE_TIME_SECONDS, Histogram, "Histogram of time spent waiting before first scheduled, in seconds."),
    def(REQUEST_PREFILL_TIME_SECONDS, Histogram, "Histogram of time spent in prefill, in seconds."),
    def(REQUEST_DECODE_TIME_SECONDS, Histogram, "Histogram of time spent in decode, in seconds."),
    def(REQUEST_INFERENCE_TIME_SECONDS, Histogram, "Histogram of time spent scheduled (prefill + decode), in seconds."),
    def(REQUEST_PROMPT_TOKENS, Histogram, "Number of prefill tokens per finished request."),
    def(REQUEST_GENERATION_TOKENS, Histogram, "Number of generation tokens per finished request."),
    def(PROMPT_TOKENS_TOTAL, Counter, "Number of prefill tokens computed (prefix-cache hits excluded)."),
    def(GENERATION_TOKENS_TOTAL, Counter, "Number of generation tokens processed."),
    def(
        PREFIX_CACHE_QUERIES_TOTAL,
        Counter,
        "Prefix cache queries, in terms of number of queried tokens (kept states of continuations included).",
    ),
    def(
        PREFIX_CACHE_HITS_TOTAL,
        Counter,
        "Prefix cache hits, in terms of number of cached tokens (kept states of continuations included).",
    ),
    labelled(
        REQUEST_SUCCESS_TOTAL,
        Counter,
        ("finished_reason", &["stop", "length", "abort"]),
        "Count of successfully processed requests, by finish reason.",
    ),
    def(NUM_REQUESTS_RUNNING, Gauge, "Number of requests in model execution batches."),
    def(NUM_REQUESTS_WAITING, Gauge, "Number of requests waiting to be processed."),
    def(KV_CACHE_USAGE_PERC, Gauge, "Fraction of the device state budget in use (1 = full)."),
    def(SPEC_DECODE_NUM_DRAFTS_TOTAL, Counter, "Number of verify steps that carried draft tokens."),
    def(SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL, Counter, "Number of draft tokens proposed."),
    def(SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL, Counter, "Number of draft tokens accepted (bonus token excluded)."),
    labelled(
        SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL,
        Counter,
        ("position", &[]),
        "Verify rounds in which the draft token at this position was accepted.",
    ),
    labelled(
        SPEC_DECODE_NUM_DRAFT_TOKENS_PER_POS_TOTAL,
        Counter,
        ("position", &[]),
        "Verify rounds whose draft had a token at this position.",
    ),
    def(SPEC_DECODE_MEAN_ACCEPTANCE_LENGTH, Gauge, "Mean acceptance length since start-up (bonus token included)."),
    def(
        SPEC_DECODE_NUM_SYNTHETIC_DRAFTS_TOTAL,
        Counter,
        "Verify rounds whose acceptance was forced (synthetic acceptance length; the text is not the model's).",
    ),
    def(SPEC_DECODE_FORCED_ACCEPTANCE_LENGTH, Gauge, "Forced mean acceptance length, 0 when acceptance is not forced."),
    def(
        SPEC_DECODE_GATED_STEPS_TOTAL,
        Counter,
        "Decode steps whose model-drafting round was skipped because drafting was not expected to pay.",
    ),
    def(SPEC_DECODE_PROBES_TOTAL, Counter, "Model-drafting rounds made as probes while drafting was being skipped."),
    def(
        SPEC_DECODE_CALIBRATED_ACCEPTANCE_LENGTH,
        Gauge,
        "Acceptance length the drafting gate expects of a model draft (calibrated survivals), 0 before its first judgement.",
    ),
    def(
        INTERACTIVITY_P90_TOKENS_PER_SECOND,
        Gauge,
        "P90 interactivity: 1 / P90 of per-request mean inter-token latency over the recent finished requests (InferenceX).",
    ),
    def(STEP_INTERVAL_SECONDS, Histogram, "Seconds per engine step that emitted tokens, one sample per step per request."),
    def(SESSIONS_KEPT_TOTAL, Counter, "Responses kept for continuation."),
    labelled(
        SESSIONS_EVICTED_TOTAL,
        Counter,
        ("tier", &["host", "dropped", "removed"]),
        "Kept states evicted: moved to host memory, or dropped (rebuilt by prefill if continued); or kept responses removed entirely (the kept-responses byte budget).",
    ),
    def(SESSIONS_DELETED_TOTAL, Counter, "Kept responses deleted by a client."),
    labelled(
        SESSIONS_RESTORED_TOTAL,
        Counter,
        ("tier", &["device", "host", "prefill"]),
        "Continuations of kept responses, by where the state came from.",
    ),
    def(
        SESSION_CACHE_QUERIES_TOTAL,
        Counter,
        "Prompt tokens of continuations (previous_response_id) a kept state could have served.",
    ),
    def(SESSION_CACHE_HITS_TOTAL, Counter, "Continuation tokens restored from the kept state, not computed."),
    def(SESSIONS_KEPT, Gauge, "Kept responses currently held."),
    def(
        SESSIONS_BYTES,
        Gauge,
        "Bytes kept responses hold: states in every tier, token histories and stored response objects.",
    ),
    labelled(STATE_MEMORY_BYTES, Gauge, ("tier", &["device", "host"]), "Bytes of per-sequence model state held."),
    labelled(PREFIX_CACHE_BYTES, Gauge, ("tier", &["device", "host"]), "Bytes held by prefix-cache state snapshots."),
    labelled(
        PREFIX_CACHE_MOVES_TOTAL,
        Counter,
        ("to", &["host", "dropped"]),
        "Prefix-cache snapshots moved out of a full tier: exported to the host, or dropped.",
    ),
    labelled(
        ERRORS_TOTAL,
        Counter,
        ("kind", &["invalid_field", "invalid_json", "context_length_exceeded", "engine_unavailable", "runner"]),
        "Failed requests, by error kind.",
    ),
    labelled(HTTP_REQUESTS_TOTAL, Counter, ("endpoint", &[]), "HTTP requests answered, by endpoint and status."),
    def(WEBSOCKETS_OPEN, Gauge, "Open WebSocket connections."),
    def(CLIENT_DISCONNECTS_TOTAL, Counter, "Requests whose client went away before they finished."),
    def(HTTP_CONNECTIONS_OPEN, Gauge, "HTTP connections open (with open WebSockets, at most --max-connections)."),
    def(SLOW_READER_CANCELS_TOTAL, Counter, "Requests cancelled because their client left --max-event-backlog events unread."),
    labelled(
        ENGINE_PHASE_SECONDS,
        Histogram,
        ("phase", ENGINE_PHASES),
        "Seconds the engine thread spent in one phase of one loop turn: idle (blocked with no work), commands (handling \
         queued commands), admit (giving admitted requests a state), draft (drafting and the verify budget; speculation \
         on only), schedule (planning the step), step (runner.step: the device forward and the verify of the drafts, \
         fused in one step by both backends), apply (scheduler update, speculation statistics, snapshots, finished \
         requests), emit (building and sending events, retrying backlogs), memory (kept-response budgets and gauges).",
    ),
    labelled(
        REQUEST_ADMIT_SECONDS,
        Histogram,
        ("how", &["continued", "prefix", "fresh"]),
        "Seconds to give one admitted request its state and begin its speculation: continued (a kept response's \
         state), prefix (a prefix-cache import), fresh (a new state).",
    ),
    def(
        CONSTRAINT_MASK_SECONDS,
        Histogram,
        "Host seconds computing one step's grammar masks (response_format, grammars, required tool calls), on a \
         helper thread beside the launch of the step's forward: on a GPU they overlap the forward.",
    ),
];

/// The buckets of one histogram.
pub fn buckets_for(name: &str) -> &'static [f64] {
    match name {
        TIME_TO_FIRST_TOKEN_SECONDS => TTFT_BUCKETS,
        INTER_TOKEN_LATENCY_SECONDS | REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS | STEP_INTERVAL_SECONDS => ITL_BUCKETS,
        REQUEST_PROMPT_TOKENS | REQUEST_GENERATION_TOKENS => TOKEN_COUNT_BUCKETS,
        ENGINE_PHASE_SECONDS | REQUEST_ADMIT_SECONDS | CONSTRAINT_MASK_SECONDS => PHASE_BUCKETS,
        _ => REQUEST_LATENCY_BUCKETS,
    }
}

/// Installs the global Prometheus recorder (no listener of its own: the daemon serves [`PrometheusHandle::render`]
/// at `/metrics`), describes every metric and registers it at zero. Call once per process; the caller must run
/// [`PrometheusHandle::run_upkeep`] periodically.
pub fn install(model_name: &str) -> Result<PrometheusHandle, BuildError> {
    let mut builder =
        PrometheusBuilder::new().add_global_label("model_name", model_name).add_global_label("engine", "0");
    for m in ALL_METRICS.iter().filter(|m| m.kind == Histogram) {
        builder = builder.set_buckets_for_metric(Matcher::Full(m.name.to_string()), buckets_for(m.name))?;
    }
    let handle = builder.install_recorder()?;
    describe_and_register();
    Ok(handle)
}

fn describe_and_register() {
    for m in ALL_METRICS {
        match m.kind {
            Counter => metrics::describe_counter!(m.name, m.help),
            Gauge => metrics::describe_gauge!(m.name, m.help),
            Histogram => metrics::describe_histogram!(m.name, m.help),
        }
        let (label, values) = m.labels;
        if label.is_empty() {
            register(m.kind, m.name, None);
        }
        for value in values.iter() {
            register(m.kind, m.name, Some((label, value)));
        }
    }
}

fn register(kind: MetricKind, name: &'static str, label: Option<(&'static str, &'static str)>) {
    let labels: Vec<metrics::Label> = label.map(|(k, v)| metrics::Label::new(k, v)).into_iter().collect();
    match kind {
        Counter => metrics::counter!(name, labels).increment(0),
        Gauge => metrics::gauge!(name, labels).set(0.0),
        Histogram => {
            let _registered = metrics::histogram!(name, labels);
        }
    }
}

/// Percentile with linear interpolation between closest ranks, as InferenceX computes it
/// (`aggregation_common.percentile`: `k = (n−1)·q; v = s[f] + (k−f)(s[f+1]−s[f])`). `sorted` must be ascending.
///
/// Example: `[1, 2, 3, 4]` at q = 0.9: k = 2.7, so v = 3 + 0.7 · (4 − 3) = 3.7.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let k = last as f64 * q.clamp(0.0, 1.0);
    let f = k.floor() as usize;
    let c = (f + 1).min(last);
    Some(sorted[f] + (k - f as f64) * (sorted[c] - sorted[f]))
}

/// The per-request mean ITLs of the most recent finished requests (at most `capacity`, none older than `horizon`),
/// from which the P90 interactivity gauge is computed: `1 / P90(ITL)` (agentx.md §2.2).
#[derive(Debug)]
pub struct InteractivityWindow {
    capacity: usize,
    horizon: Duration,
    samples: VecDeque<(Instant, f64)>,
}

impl InteractivityWindow {
    pub fn new(capacity: usize, horizon: Duration) -> Self {
        InteractivityWindow { capacity: capacity.max(1), horizon, samples: VecDeque::new() }
    }

    /// Adds one finished request's mean ITL in seconds (`(last − first content time) / (tokens − 1)`).
    pub fn record(&mut self, now: Instant, itl_seconds: f64) {
        if !itl_seconds.is_finite() || itl_seconds < 0.0 {
            return;
        }
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back((now, itl_seconds));
    }

    /// `1 / P90(ITL)` over the samples not older than the horizon; `None` when there are none (or P90 is 0).
    pub fn p90_interactivity(&mut self, now: Instant) -> Option<f64> {
        while let Some(&(at, _)) = self.samples.front() {
            if now.saturating_duration_since(at) > self.horizon {
                self.samples.pop_front();
            } else {
                break;
            }
        }
        let mut itls: Vec<f64> = self.samples.iter().map(|&(_, itl)| itl).collect();
        itls.sort_by(f64::total_cmp);
        percentile(&itls, 0.9).filter(|&p| p > 0.0).map(|p| 1.0 / p)
    }
}

/// Test support: a Prometheus recorder of a test's own. Handles taken inside [`LocalMetrics::capture`] (as the engine
/// takes its counters when it is made) record into it from any thread, while the process's other tests record
/// elsewhere.
#[cfg(test)]
pub(crate) struct LocalMetrics {
    recorder: metrics_exporter_prometheus::PrometheusRecorder,
}

#[cfg(test)]
impl LocalMetrics {
    pub fn new() -> Self {
        LocalMetrics { recorder: PrometheusBuilder::new().build_recorder() }
    }

    /// Runs `f` with this recorder as the thread's own.
    pub fn capture<T>(&self, f: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.recorder, f)
    }

    /// The value of the series `name` whose labels include `label` (`name{label="value"}` in the text format);
    /// `None` when there is no such series.
    pub fn value(&self, name: &str, label: Option<(&str, &str)>) -> Option<f64> {
        let wanted = label.map(|(k, v)| format!("{k}=\"{v}\""));
        self.recorder.handle().render().lines().filter(|l| !l.starts_with('#')).find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, labels) = series.split_once('{').unwrap_or((series, ""));
            let matches = series_name == name && wanted.as_ref().is_none_or(|w| labels.contains(w.as_str()));
            matches.then(|| value.parse().ok()).flatten()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_like_inferencex() {
        assert_eq!(percentile(&[], 0.9), None);
        assert_eq!(percentile(&[5.0], 0.9), Some(5.0));
        let p = percentile(&[1.0, 2.0, 3.0, 4.0], 0.9).unwrap();
        assert!((p - 3.7).abs() < 1e-12, "{p}");
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 1.0), Some(4.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.0), Some(1.0));
    }

    #[test]
    fn interactivity_is_the_reciprocal_of_the_p90_itl_over_the_window() {
        let t0 = Instant::now();
        let mut w = InteractivityWindow::new(10, Duration::from_secs(60));
        assert_eq!(w.p90_interactivity(t0), None);
        // ITLs 10..=100 ms: P90 = 91 ms.
        for i in 1..=10 {
            w.record(t0, i as f64 * 0.01);
        }
        let v = w.p90_interactivity(t0).unwrap();
        assert!((v - 1.0 / 0.091).abs() < 1e-9, "{v}");
        // Capacity: one more fast request pushes out the 10 ms one.
        w.record(t0, 0.001);
        let v = w.p90_interactivity(t0).unwrap();
        assert!((v - 1.0 / 0.091).abs() < 1e-9, "{v}");
        // Horizon: after it, the old samples are gone and only a new one counts.
        let later = t0 + Duration::from_secs(61);
        w.record(later, 0.5);
        assert!((w.p90_interactivity(later).unwrap() - 2.0).abs() < 1e-12);
        // Garbage is ignored.
        w.record(later, f64::NAN);
        w.record(later, -1.0);
        assert!((w.p90_interactivity(later).unwrap() - 2.0).abs() < 1e-12);
    }

    #[test]
    fn every_histogram_has_sorted_buckets_and_every_name_is_unique() {
        let mut names: Vec<&str> = ALL_METRICS.iter().map(|m| m.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len(), "duplicate metric name");
        for m in ALL_METRICS {
            assert!(m.name.starts_with("vllm:") || m.name.starts_with("sparkd:"), "{}", m.name);
            assert_eq!(
                m.kind == Counter,
                m.name.ends_with("_total"),
                "{}: counters and only counters end in _total",
                m.name
            );
            if m.kind == Histogram {
                let b = buckets_for(m.name);
                assert!(b.windows(2).all(|w| w[0] < w[1]), "{} buckets not ascending", m.name);
            }
        }
    }
}
