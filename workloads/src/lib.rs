//! `sparkd-workloads`: AgentX-style trace replay for sparkd (the `sparkd-replay` tool).
//!
//! Readers for AgentX/Weka and Mooncake traces ([`trace`]), sessions as request DAGs ([`dag`]),
//! deterministic prompt synthesis from hash ids ([`synth`], vetted against the daemon's tokenizer
//! in [`codec`]), closed-loop replay over the chat or Responses-WebSocket transports ([`replay`],
//! [`transport`]), what the server tells besides generation: its model and counters ([`server`],
//! [`prometheus`]), per-request metrics and run summaries ([`metrics`]), JSON reports and comparison
//! ([`report`]), the throughput–interactivity Pareto frontier ([`pareto`]), charts ([`plot`]) and the
//! one-page HTML report ([`html`]). [`run`] ties them together for the command line.

pub mod codec;
pub mod dag;
pub mod error;
pub mod html;
pub mod metrics;
pub mod pareto;
pub mod plot;
pub mod prometheus;
pub mod replay;
pub mod report;
pub mod run;
pub mod server;
pub mod synth;
pub mod trace;
pub mod transport;

pub use error::{ReplayError, Result};
