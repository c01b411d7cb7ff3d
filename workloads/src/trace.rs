//! Trace readers: AgentX/Weka JSON session files (one object per file) and Mooncake FAST'25 JSONL.
//!
//! Invariants:
//! - Parsing is strict, as AIPerf's pydantic models are (`extra="forbid"`, agentx.md §1.3): an
//!   unknown key, a missing key, `ttft` on an `"n"` request, a subagent nested in a subagent, a
//!   zero `block_size` or a `hash_id_scope` other than `"local"` is an error naming the file and
//!   the field. Nothing here panics on input.
//! - Readers return the file's records as they are; the session DAG is built in [`crate::dag`].
//! - A folder is read in file-name order, so the session order (and with it the replay order) is
//!   stable across machines.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{ReplayError, Result};

/// One Weka / AgentX trace file: a whole agent session (agentx.md §1.3).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WekaTrace {
    pub id: String,
    pub models: Vec<String>,
    pub block_size: u32,
    pub hash_id_scope: String,
    #[serde(default)]
    pub tool_tokens: u32,
    #[serde(default)]
    pub system_tokens: u32,
    pub requests: Vec<WekaEntry>,
    #[serde(default)]
    pub totals: Option<serde_json::Value>,
}

/// An entry of a trace's top-level `requests` list.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type")]
pub enum WekaEntry {
    /// Recorded as non-streaming.
    #[serde(rename = "n")]
    Normal(WekaRequest),
    /// Recorded as streaming; only these may carry `ttft`.
    #[serde(rename = "s")]
    Streaming(WekaStreamingRequest),
    #[serde(rename = "subagent")]
    Subagent(WekaSubagent),
}

/// An entry of a subagent's `requests` list: subagents are not nested inside subagents.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type")]
pub enum WekaLeafEntry {
    #[serde(rename = "n")]
    Normal(WekaRequest),
    #[serde(rename = "s")]
    Streaming(WekaStreamingRequest),
}

/// A `"n"` request.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WekaRequest {
    pub t: f64,
    pub model: String,
    #[serde(rename = "in")]
    pub input_tokens: u32,
    #[serde(rename = "out")]
    pub output_tokens: u32,
    pub hash_ids: Vec<u64>,
    #[serde(default)]
    pub input_types: Vec<String>,
    #[serde(default)]
    pub output_types: Vec<String>,
    #[serde(default)]
    pub stop: String,
    #[serde(default)]
    pub api_time: Option<f64>,
    #[serde(default)]
    pub think_time: Option<f64>,
}

/// A `"s"` request: the fields of `"n"` plus the recorded TTFT. A copy of [`WekaRequest`]'s fields rather than a
/// `#[serde(flatten)]` of it, because serde cannot combine `flatten` with `deny_unknown_fields`, which is what
/// rejects `ttft` on an `"n"` request.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WekaStreamingRequest {
    pub t: f64,
    pub model: String,
    #[serde(rename = "in")]
    pub input_tokens: u32,
    #[serde(rename = "out")]
    pub output_tokens: u32,
    pub hash_ids: Vec<u64>,
    #[serde(default)]
    pub input_types: Vec<String>,
    #[serde(default)]
    pub output_types: Vec<String>,
    #[serde(default)]
    pub stop: String,
    #[serde(default)]
    pub api_time: Option<f64>,
    #[serde(default)]
    pub think_time: Option<f64>,
    #[serde(default)]
    pub ttft: Option<f64>,
}

/// A `"subagent"` entry.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WekaSubagent {
    pub t: f64,
    pub agent_id: String,
    #[serde(default)]
    pub subagent_type: String,
    #[serde(default)]
    pub duration_ms: Option<u64>,
    #[serde(default)]
    pub total_tokens: Option<u64>,
    #[serde(default)]
    pub tool_use_count: Option<u64>,
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default)]
    pub tool_tokens: u32,
    #[serde(default)]
    pub system_tokens: u32,
    pub requests: Vec<WekaLeafEntry>,
}

/// The fields of a `"n"` or `"s"` request that replay uses.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedRequest {
    pub t: f64,
    pub model: String,
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub hash_ids: Vec<u64>,
    pub api_time: Option<f64>,
    pub think_time: Option<f64>,
}

impl From<&WekaRequest> for RecordedRequest {
    fn from(r: &WekaRequest) -> Self {
        RecordedRequest {
            t: r.t,
            model: r.model.clone(),
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            hash_ids: r.hash_ids.clone(),
            api_time: r.api_time,
            think_time: r.think_time,
        }
    }
}

impl From<&WekaStreamingRequest> for RecordedRequest {
    fn from(r: &WekaStreamingRequest) -> Self {
        RecordedRequest {
            t: r.t,
            model: r.model.clone(),
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            hash_ids: r.hash_ids.clone(),
            api_time: r.api_time,
            think_time: r.think_time,
        }
    }
}

impl WekaLeafEntry {
    pub fn recorded(&self) -> RecordedRequest {
        match self {
            WekaLeafEntry::Normal(r) => r.into(),
            WekaLeafEntry::Streaming(r) => r.into(),
        }
    }
}

/// One line of a Mooncake FAST'25 trace (agentx.md §1.8): `timestamp` in ms, 512-token hash blocks.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MooncakeRequest {
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

/// Tokens per hash block in the Mooncake traces.
pub const MOONCAKE_BLOCK_SIZE: u32 = 512;

/// A Mooncake trace file: its requests in file order; the file name is the hash-id scope.
#[derive(Clone, Debug)]
pub struct MooncakeTrace {
    pub id: String,
    pub requests: Vec<MooncakeRequest>,
}

/// A parsed trace file of either format.
#[derive(Clone, Debug)]
pub enum TraceFile {
    Weka(Box<WekaTrace>),
    Mooncake(MooncakeTrace),
}

impl TraceFile {
    /// Requests in the file, subagent inner requests included (the count MANIFEST.csv gives).
    pub fn request_count(&self) -> usize {
        match self {
            TraceFile::Weka(t) => t
                .requests
                .iter()
                .map(|e| match e {
                    WekaEntry::Subagent(s) => s.requests.len(),
                    _ => 1,
                })
                .sum(),
            TraceFile::Mooncake(t) => t.requests.len(),
        }
    }
}

/// Reads one Weka trace file and validates it.
pub fn read_weka(path: &Path) -> Result<WekaTrace> {
    let bytes = read_bytes(path)?;
    parse_weka(path, &bytes)
}

/// Parses and validates Weka trace JSON; `path` is only used in error messages.
pub fn parse_weka(path: &Path, bytes: &[u8]) -> Result<WekaTrace> {
    let trace: WekaTrace = serde_json::from_slice(bytes).map_err(|e| json_error(path, &e))?;
    validate_weka(path, &trace)?;
    Ok(trace)
}

fn validate_weka(path: &Path, trace: &WekaTrace) -> Result<()> {
    if trace.block_size == 0 {
        return Err(ReplayError::field(path, "block_size", "must be > 0"));
    }
    if trace.hash_id_scope != "local" {
        return Err(ReplayError::field(
            path,
            "hash_id_scope",
            format!("only \"local\" is supported, found {:?}", trace.hash_id_scope),
        ));
    }
    for (i, entry) in trace.requests.iter().enumerate() {
        match entry {
            WekaEntry::Normal(r) => check_request(path, &format!("requests[{i}]"), &r.into())?,
            WekaEntry::Streaming(r) => check_request(path, &format!("requests[{i}]"), &r.into())?,
            WekaEntry::Subagent(s) => {
                for (j, inner) in s.requests.iter().enumerate() {
                    check_request(path, &format!("requests[{i}].requests[{j}]"), &inner.recorded())?;
                }
            }
        }
    }
    Ok(())
}

fn check_request(path: &Path, at: &str, r: &RecordedRequest) -> Result<()> {
    if !r.t.is_finite() || r.t < 0.0 {
        return Err(ReplayError::field(path, format!("{at}.t"), format!("must be a finite time >= 0, found {}", r.t)));
    }
    if r.input_tokens == 0 {
        return Err(ReplayError::field(path, format!("{at}.in"), "must be > 0"));
    }
    for (name, v) in [("think_time", r.think_time), ("api_time", r.api_time)] {
        if let Some(v) = v {
            if !v.is_finite() || v < 0.0 {
                return Err(ReplayError::field(path, format!("{at}.{name}"), format!("must be >= 0, found {v}")));
            }
        }
    }
    Ok(())
}

/// Reads a Mooncake JSONL trace; each line is one request.
pub fn read_mooncake(path: &Path) -> Result<MooncakeTrace> {
    let bytes = read_bytes(path)?;
    parse_mooncake(path, &bytes)
}

/// Parses Mooncake JSONL; `path` names the file in errors and gives the trace id (its stem).
pub fn parse_mooncake(path: &Path, bytes: &[u8]) -> Result<MooncakeTrace> {
    let text = std::str::from_utf8(bytes)
        .map_err(|e| ReplayError::TraceFile { path: path.to_path_buf(), reason: format!("not UTF-8: {e}") })?;
    let mut requests = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: MooncakeRequest = serde_json::from_str(line)
            .map_err(|e| ReplayError::TraceFile { path: path.to_path_buf(), reason: format!("line {}: {e}", i + 1) })?;
        if r.input_length == 0 {
            return Err(ReplayError::field(path, format!("line {}: input_length", i + 1), "must be > 0"));
        }
        requests.push(r);
    }
    let id = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(MooncakeTrace { id, requests })
}

/// Reads a trace file, choosing the format by extension: `.json` is Weka, `.jsonl` is Mooncake.
pub fn read_file(path: &Path) -> Result<TraceFile> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("json") => Ok(TraceFile::Weka(Box::new(read_weka(path)?))),
        Some("jsonl") => Ok(TraceFile::Mooncake(read_mooncake(path)?)),
        _ => Err(ReplayError::TraceFile {
            path: path.to_path_buf(),
            reason: "unknown trace format: expected a .json (Weka) or .jsonl (Mooncake) file".into(),
        }),
    }
}

/// The trace files a path names: the file itself, or a folder's `.json`/`.jsonl` files (not
/// recursive) in name order.
pub fn trace_paths(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path)
        .map_err(|e| ReplayError::TraceFile { path: path.to_path_buf(), reason: e.to_string() })?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = std::fs::read_dir(path)
        .map_err(|e| ReplayError::TraceFile { path: path.to_path_buf(), reason: e.to_string() })?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| ReplayError::TraceFile { path: path.to_path_buf(), reason: e.to_string() })?;
        let p = entry.path();
        if p.is_file() && matches!(p.extension().and_then(|e| e.to_str()), Some("json" | "jsonl")) {
            paths.push(p);
        }
    }
    paths.sort();
    if paths.is_empty() {
        return Err(ReplayError::TraceFile {
            path: path.to_path_buf(),
            reason: "folder holds no .json/.jsonl traces".into(),
        });
    }
    Ok(paths)
}

/// Reads every trace a list of files and folders names.
pub fn read_all(paths: &[PathBuf]) -> Result<Vec<TraceFile>> {
    let mut out = Vec::new();
    for p in paths {
        for file in trace_paths(p)? {
            out.push(read_file(&file)?);
        }
    }
    Ok(out)
}

fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| ReplayError::TraceFile { path: path.to_path_buf(), reason: e.to_string() })
}

fn json_error(path: &Path, e: &serde_json::Error) -> ReplayError {
    let msg = e.to_string();
    // serde names the offending key in its message ("unknown field `x`", "missing field `in`").
    let field = msg
        .split('`')
        .nth(1)
        .filter(|_| msg.contains("field"))
        .map(str::to_owned)
        .unwrap_or_else(|| format!("at line {} column {}", e.line(), e.column()));
    ReplayError::TraceField { path: path.to_path_buf(), field, reason: msg }
}
