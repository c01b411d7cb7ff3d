//! Server options of `sparkd serve`: the command-line surface and what it turns into.
//!
//! Invariants:
//! - Every option has a default that lets `sparkd serve` run on a fresh machine with no arguments (the built-in
//!   trained `k3-tiny-trained`, 127.0.0.1:8000, on the GPU when one is usable and on the CPU reference otherwise).
//! - [`ServeArgs::validate`] rejects inconsistent values with an error naming the flag, before anything is
//!   loaded; nothing here panics on input.
//! - Engine limits are passed on as an [`EngineConfig`]; this module never reaches into the engine.
//! - The `--spec*` flags and their validation live in [`speculation`].

pub mod limits;
pub mod memory;
pub mod speculation;

use std::net::SocketAddr;
use std::path::PathBuf;

use self::limits::LimitArgs;
use self::memory::{Budgets, MemoryArgs};
use self::speculation::SpecArgs;
use crate::engine::step_time::{StepTarget, DEFAULT_STEP_TARGET_FACTOR};
use crate::engine::types::{
    EngineConfig, DEFAULT_COMMAND_QUEUE, DEFAULT_MAX_EVENT_BACKLOG, DEFAULT_MAX_KEPT_RESPONSES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
};
use crate::launch::LaunchArgs;

/// The built-in model served when no `--model` is given: k3-tiny and its DSpark drafter trained on the Python
/// standard library, embedded in the binary (`sparkd_kernels::trained`).
pub const DEFAULT_SYNTHETIC_CONFIG: &str = sparkd_kernels::trained::TRAINED_NAME;
/// Context length when neither `--max-model-len` nor the model caps it lower.
pub const DEFAULT_MAX_MODEL_LEN: usize = 131_072;
/// Largest request body accepted (AgentX turns of 200k tokens are about 1 MB of JSON; aiperf-offline.md §2).
pub const DEFAULT_MAX_BODY_BYTES: usize = 64 << 20;
/// How long a drain lets requests in progress run (Kubernetes' default grace period is 30 s as well).
pub const DEFAULT_SHUTDOWN_TIMEOUT_SECS: u64 = 30;
/// Seconds between throughput lines in the log (`--log-stats-interval`), as vLLM's stat logger.
pub const DEFAULT_LOG_STATS_INTERVAL_SECS: u64 = 10;
/// Requests that may wait for the engine before new ones get 429: several full batches, so a burst of agents
/// queues rather than fails, while a flood cannot grow the queue without end.
pub const DEFAULT_MAX_WAITING: usize = 1024;

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// CUDA when a GPU with its libraries (driver, NVRTC, cuBLAS) is usable, else the CPU reference.
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend (NVIDIA GPUs).
    Cuda,
    /// A runner that does no math (deterministic tokens): for overhead benchmarks and fast tests.
    Null,
}

impl Device {
    /// The backend this choice means on this machine: `auto` is CUDA when device 0 opens with its libraries
    /// (driver, NVRTC, cuBLAS), else the CPU; the others are themselves. Logs what `auto` found.
    pub fn resolve(self) -> Device {
        if self != Device::Auto {
            return self;
        }
        match sparkd_kernels::cuda::device::probe(0) {
            Ok(info) => {
                tracing::info!(
                    "--device auto: {} (compute capability {:?}) found, using CUDA",
                    info.name,
                    info.compute_capability
                );
                Device::Cuda
            }
            Err(e) => {
                tracing::info!("--device auto: no usable GPU ({e}); using the CPU reference");
                Device::Cpu
            }
        }
    }
}

/// `--decode-step-target`: how long a step that carries decode rows may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DecodeStepTarget {
    /// Not held: prefill chunks take what `--max-num-batched-tokens` leaves beside the decode rows.
    Off,
    /// Held to this target over the step costs measured on the runner at start-up.
    On(StepTarget),
}

impl std::str::FromStr for DecodeStepTarget {
    type Err = String;

    /// `off`, `auto` (the default factor), `F x` (a factor of at least 1) or `MS` / `MS ms` (positive).
    fn from_str(text: &str) -> Result<Self, String> {
        let t = text.trim();
        match t {
            "off" => return Ok(DecodeStepTarget::Off),
            "auto" => return Ok(DecodeStepTarget::On(StepTarget::Factor(DEFAULT_STEP_TARGET_FACTOR))),
            _ => {}
        }
        let number = |n: &str| n.trim().parse::<f64>().ok().filter(|v| v.is_finite());
        if let Some(factor) = t.strip_suffix('x') {
            return match number(factor) {
                Some(f) if f >= 1.0 => Ok(DecodeStepTarget::On(StepTarget::Factor(f))),
                _ => Err(format!("`{text}`: a factor must be a number of at least 1, like 1.5x")),
            };
        }
        match number(t.strip_suffix("ms").unwrap_or(t)) {
            Some(ms) if ms > 0.0 => Ok(DecodeStepTarget::On(StepTarget::Seconds(ms / 1e3))),
            _ => Err(format!("`{text}` is not auto, off, a positive time in ms (9 or 9ms) or a factor (1.5x)")),
        }
    }
}

/// `sparkd serve` options.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "SPARKD_HOST")]
    pub host: String,
    /// Port to listen on (0 = any free port; the chosen one is logged).
    #[arg(long, default_value_t = 8000, env = "SPARKD_PORT")]
    pub port: u16,
    /// An API key clients must send as `Authorization: Bearer KEY` (repeat for several; the environment variable
    /// takes a comma-separated list). Without any key every client is served.
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "SPARKD_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments skipped), besides --api-key.
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// A browser origin allowed to call the API (repeat for several; `*`: any). Requests carrying any other
    /// `Origin` header are refused with 403.
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    pub allow_origins: Vec<String>,
    /// Checkpoint folder (config.json + safetensors). Without it: the built-in model `--synthetic` names.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Without --model: the built-in model, `k3-tiny-trained` (trained weights embedded in the binary) or a
    /// random one generated in memory with seed 0 (k3-tiny, k3-mini, k3-mini-wide).
    #[arg(long, default_value = DEFAULT_SYNTHETIC_CONFIG)]
    pub synthetic: String,
    /// Backend.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// Ranks the model is split over (tensor parallelism: attention by heads, MLPs by width, vocabulary-parallel
    /// lm_head). With `--device cpu`, N in-process ranks, one thread each; with `--device cuda`, one process per
    /// GPU (this one and `N / nnodes - 1` workers it starts), joined by the launch contract (docs/multi-gpu.md;
    /// rank 0 serves, the workers follow it). 1 is the
    /// whole model on one device. N must divide the model's heads, MLP widths and vocabulary.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tensor_parallel_size: usize,
    /// With --tensor-parallel-size N > 1: place the routed experts whole on the ranks (expert parallelism; N must
    /// divide the number of experts) instead of splitting every expert by width.
    #[arg(long)]
    pub expert_parallel: bool,
    /// Model name reported by /v1/models, in responses and as the `model_name` metric label.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Longest prompt + output, in tokens.
    #[arg(long, default_value_t = DEFAULT_MAX_MODEL_LEN)]
    pub max_model_len: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_SEQS)]
    pub max_num_seqs: usize,
    /// Most tokens computed per engine step (prefill chunks + decode rows + drafts).
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    pub max_num_batched_tokens: usize,
    /// How long a step that carries decode rows may take, so that decoding does not stall behind long
    /// prompts: `auto` (1.5x the time of the step's decode tokens alone), a factor (`2x`), a time in
    /// milliseconds (`9` or `9ms`), or `off` (prefill takes what --max-num-batched-tokens leaves). Step
    /// costs are measured on the runner at start-up; a prompt still advances by at least 64 tokens per step.
    #[arg(long, default_value = "auto", value_name = "auto|off|MS|Fx")]
    pub decode_step_target: DecodeStepTarget,
    /// Launch the next decode step before the outputs of the step in flight come back, so that the host
    /// work of one step overlaps the device work of the next (a steady decode with speculation off, on a
    /// runner that can; the CPU backend computes each step as it is launched).
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = on_off, action = clap::ArgAction::Set)]
    pub async_scheduling: bool,
    /// Kept responses at most (`store`, `previous_response_id`), whatever their bytes; beyond it the least
    /// recently used are removed (0 keeps none).
    #[arg(long, default_value_t = DEFAULT_MAX_KEPT_RESPONSES)]
    pub max_kept_responses: usize,
    /// A folder for the session journal: committed kept responses (`store`) are written there, synced when
    /// each turn commits, and restored at start-up, so every committed turn can be continued after a crash
    /// or restart. Without it kept responses live in memory only.
    #[arg(long, value_name = "DIR", env = "SPARKD_SESSION_DIR")]
    pub session_dir: Option<PathBuf>,
    /// Most requests waiting for the engine at once (not yet started); beyond them a request is refused with
    /// 429 and `Retry-After` (an error event on a WebSocket).
    #[arg(long, default_value_t = DEFAULT_MAX_WAITING)]
    pub max_waiting: usize,
    /// On SIGTERM or Ctrl-C, how long requests in progress may run before they are cancelled (each stream still
    /// gets its final chunk or event; WebSockets a final event and a normal close), in seconds.
    #[arg(long, default_value_t = DEFAULT_SHUTDOWN_TIMEOUT_SECS, value_name = "SECS")]
    pub shutdown_timeout: u64,
    /// Seconds between throughput lines in the log (prompt and generation tokens/s, running and waiting
    /// requests, acceptance), written only when something happened; 0 turns them off.
    #[arg(long, default_value_t = DEFAULT_LOG_STATS_INTERVAL_SECS, value_name = "SECS")]
    pub log_stats_interval: u64,
    /// Events a request's client may leave unread (a stream it does not read) before the request is cancelled
    /// as a slow reader and its memory freed.
    #[arg(long, default_value_t = DEFAULT_MAX_EVENT_BACKLOG)]
    pub max_event_backlog: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Memory budgets (`--state-budget-bytes`, `--host-offload-bytes`, `--kept-responses-bytes`,
    /// `--prefix-cache-bytes`), sized from the memory present unless given.
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// Per-request limits and request preparation (`--max-prompt-chars`, `--max-stop-strings`, ...).
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Speculative decoding (`--spec`, `--num-spec-tokens`, `--spec-synthetic-al`, `--spec-budget`, ...).
    #[command(flatten)]
    pub spec: SpecArgs,
    /// The group's hosts and rendezvous (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`, ...), for
    /// `--device cuda` over several processes.
    #[command(flatten)]
    pub launch: LaunchArgs,
}

/// A server option that does not make sense.
#[derive(Debug, thiserror::Error)]
#[error("--{flag}: {reason}")]
pub struct ConfigError {
    pub flag: &'static str,
    pub reason: String,
}

impl ServeArgs {
    /// Checks the values that clap's types cannot.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("max-model-len", self.max_model_len),
            ("max-num-seqs", self.max_num_seqs),
            ("max-num-batched-tokens", self.max_num_batched_tokens),
            ("max-body-bytes", self.max_body_bytes),
            ("max-waiting", self.max_waiting),
            ("max-event-backlog", self.max_event_backlog),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError { flag, reason: "must be at least 1".into() });
        }
        self.limits.validate()?;
        if self.tensor_parallel_size == 0 {
            return Err(ConfigError { flag: "tensor-parallel-size", reason: "must be at least 1".into() });
        }
        if self.launch.nnodes > 1 && self.device != Device::Cuda {
            return Err(ConfigError {
                flag: "nnodes",
                reason: "a group over several hosts needs --device cuda (CPU ranks are threads of one process)".into(),
            });
        }
        if self.tensor_parallel_size > 1 && !matches!(self.device, Device::Cpu | Device::Cuda) {
            return Err(ConfigError {
                flag: "tensor-parallel-size",
                reason: format!(
                    "{} ranks need --device cpu (in-process ranks) or --device cuda (one process per GPU)",
                    self.tensor_parallel_size
                ),
            });
        }
        if let Some(dir) = &self.model {
            if !dir.is_dir() {
                return Err(ConfigError { flag: "model", reason: format!("{} is not a folder", dir.display()) });
            }
        }
        self.listen_addr()?;
        Ok(())
    }

    /// The socket address to bind.
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        let text = if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        };
        text.parse()
            .map_err(|e| ConfigError { flag: "host", reason: format!("`{}` is not an IP address ({e})", self.host) })
    }

    /// The name the model is served under: `--served-model-name`, else the checkpoint folder's name, else the
    /// synthetic config's name (`--synthetic`).
    pub fn model_name(&self) -> String {
        if let Some(name) = &self.served_model_name {
            return name.clone();
        }
        match &self.model {
            Some(dir) => dir
                .canonicalize()
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| dir.display().to_string()),
            None => self.synthetic.clone(),
        }
    }

    /// The engine's limits and `budgets` (the budgets follow the memory present, [`MemoryArgs::budgets`]; the
    /// step-time limit, over step costs measured on the runner, is `startup::compose`'s).
    pub fn engine_config(&self, budgets: &Budgets) -> EngineConfig {
        EngineConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            command_queue: DEFAULT_COMMAND_QUEUE,
            state_budget_bytes: budgets.state_bytes,
            host_budget_bytes: budgets.host_offload_bytes,
            kept_responses_bytes: budgets.kept_responses_bytes,
            max_kept_responses: self.max_kept_responses,
            prefix_cache_bytes: budgets.prefix_cache_bytes,
            prefix_device_bytes: budgets.prefix_device_bytes,
            step_time: None,
            async_scheduling: self.async_scheduling,
            max_event_backlog: self.max_event_backlog,
        }
    }
}

/// Parses `on` or `off`.
fn on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("`{other}` is neither `on` nor `off`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    const BUDGETS: Budgets = Budgets {
        state_bytes: 1 << 30,
        host_offload_bytes: 1 << 30,
        kept_responses_bytes: 2 << 30,
        prefix_cache_bytes: 0,
        prefix_device_bytes: 0,
    };

    fn parse(args: &[&str]) -> ServeArgs {
        let mut all = vec!["sparkd"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).expect("parses").serve
    }

    #[test]
    fn defaults_serve_the_trained_model_on_loopback() {
        let a = parse(&[]);
        a.validate().unwrap();
        assert_eq!(a.listen_addr().unwrap().to_string(), "127.0.0.1:8000");
        assert_eq!(a.model_name(), "k3-tiny-trained");
        assert_eq!(a.device, Device::Auto);
        assert_eq!(a.engine_config(&BUDGETS).max_num_seqs, DEFAULT_MAX_NUM_SEQS);
    }

    #[test]
    fn bad_values_name_the_flag() {
        let err = parse(&["--max-num-seqs", "0"]).validate().unwrap_err();
        assert_eq!(err.flag, "max-num-seqs");
        let err = parse(&["--host", "not-an-ip"]).validate().unwrap_err();
        assert!(err.to_string().starts_with("--host:"), "{err}");
        let err = parse(&["--model", "/definitely/not/here"]).validate().unwrap_err();
        assert_eq!(err.flag, "model");
        let err = parse(&["--max-stop-strings", "0"]).validate().unwrap_err();
        assert_eq!(err.flag, "max-stop-strings");
        let err = parse(&["--prep-threads", "0"]).validate().unwrap_err();
        assert_eq!(err.flag, "prep-threads");
        assert!(Cli::try_parse_from(["sparkd", "--device", "tpu"]).is_err());
    }

    #[test]
    fn tensor_parallelism_is_checked_against_the_device() {
        let a = parse(&["--device", "cpu", "--tensor-parallel-size", "2", "--expert-parallel"]);
        a.validate().unwrap();
        assert_eq!((a.tensor_parallel_size, a.expert_parallel), (2, true));
        assert_eq!(parse(&[]).tensor_parallel_size, 1);
        let err = parse(&["--tensor-parallel-size", "0"]).validate().unwrap_err();
        assert_eq!(err.flag, "tensor-parallel-size");
        parse(&["--device", "cuda", "--tensor-parallel-size", "2"]).validate().unwrap();
        let err = parse(&["--device", "null", "--tensor-parallel-size", "2"]).validate().unwrap_err();
        assert!(err.to_string().starts_with("--tensor-parallel-size:"), "{err}");
        let err = parse(&["--device", "cpu", "--nnodes", "2", "--tensor-parallel-size", "2"]).validate().unwrap_err();
        assert_eq!(err.flag, "nnodes");
    }

    #[test]
    fn the_prompt_limit_follows_the_context_unless_given() {
        assert_eq!(parse(&[]).limits.request_limits(1000).max_prompt_chars, 32_000);
        let a = parse(&["--max-prompt-chars", "500", "--max-logprobs", "0"]);
        let limits = a.limits.request_limits(1000);
        assert_eq!((limits.max_prompt_chars, limits.max_logprobs), (500, 0));
    }

    #[test]
    fn connections_fit_the_open_file_limit_or_start_up_is_refused() {
        let a = parse(&[]);
        assert_eq!(a.limits.conn_limits(1024).unwrap().max_connections, 1024 - 256);
        assert_eq!(a.limits.conn_limits(1 << 20).unwrap().max_connections, 16_384);
        assert_eq!(a.limits.conn_limits(100).unwrap_err().flag, "max-connections");
        let err = parse(&["--max-connections", "2000"]).limits.conn_limits(1024).unwrap_err();
        assert!(err.to_string().contains("ulimit -n"), "{err}");
        let fits = parse(&["--max-connections", "500", "--header-timeout", "3"]).limits.conn_limits(1024).unwrap();
        assert_eq!((fits.max_connections, fits.header_timeout.as_secs()), (500, 3));
        assert_eq!(parse(&["--idle-timeout", "0"]).validate().unwrap_err().flag, "idle-timeout");
    }

    #[test]
    fn async_scheduling_is_on_unless_turned_off() {
        assert!(parse(&[]).async_scheduling);
        assert!(!parse(&["--async-scheduling", "off"]).async_scheduling);
        assert!(!parse(&["--async-scheduling=off"]).engine_config(&BUDGETS).async_scheduling);
        assert!(Cli::try_parse_from(["sparkd", "--async-scheduling", "maybe"]).is_err());
    }

    #[test]
    fn decode_step_targets_parse_and_bad_ones_are_rejected() {
        let target = |text: &str| parse(&["--decode-step-target", text]).decode_step_target;
        assert_eq!(parse(&[]).decode_step_target, DecodeStepTarget::On(StepTarget::Factor(DEFAULT_STEP_TARGET_FACTOR)));
        assert_eq!(target("off"), DecodeStepTarget::Off);
        assert_eq!(target("2x"), DecodeStepTarget::On(StepTarget::Factor(2.0)));
        assert_eq!(target("9"), DecodeStepTarget::On(StepTarget::Seconds(0.009)));
        assert_eq!(target("12.5ms"), DecodeStepTarget::On(StepTarget::Seconds(0.0125)));
        for bad in ["0.5x", "0", "-3ms", "fast", "NaNx", "inf"] {
            let flag = format!("--decode-step-target={bad}");
            let err = Cli::try_parse_from(["sparkd", flag.as_str()]).err().expect(bad);
            assert!(err.to_string().contains("decode-step-target"), "{err}");
        }
    }

    #[test]
    fn ipv6_hosts_and_served_names() {
        let a = parse(&["--host", "::1", "--port", "9000", "--served-model-name", "kimi"]);
        assert_eq!(a.listen_addr().unwrap().to_string(), "[::1]:9000");
        assert_eq!(a.model_name(), "kimi");
        assert_eq!(parse(&["--synthetic", "k3-mini"]).model_name(), "k3-mini");
    }
}
