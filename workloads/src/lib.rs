//! `sparkd-workloads`: AgentX-style trace replay for sparkd (the `sparkd-replay` tool).
//!
//! Readers for AgentX/Weka and Mooncake traces ([`trace`]), sessions as request DAGs ([`dag`]),
//! deterministic prompt synthesis from hash ids ([`synth`], vetted against the daemon's tokenizer
//! in [`codec`]), closed-loop replay over the chat or Responses-WebSocket transports ([`replay`],
//! [`transport`]), per-request metrics and run summaries ([`metrics`]), JSON reports and comparison
//! ([`report`]), and the throughput–interactivity Pareto frontier with its SVG plot ([`pareto`]).
//! [`run`] ties them together for the command line.

pub mod codec;
pub mod dag;
pub mod error;
pub mod metrics;
pub mod pareto;
pub mod replay;
pub mod report;
pub mod run;
pub mod synth;
pub mod trace;
pub mod transport;

pub use error::{ReplayError, Result};
