#![recursion_limit = "256"]
//! `sparkd-kernels`: the numbers of sparkd.
//!
//! K3 configs ([`config`]), the checkpoint schema ([`schema`]) and host tensors ([`tensor`]),
//! per-sequence state ([`state`]), and the [`runner::Runner`] trait that the daemon drives. This
//! crate knows nothing of HTTP, sessions or speculation policy. The backends (`cpu`, `cuda`) are checked and
//! benchmarked from outside by [`harness`]; the routing trace both record is [`routing::Routing`].

pub mod acceptance;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod dspark;
pub mod error;
pub mod float;
pub mod harness;
pub mod launches;
pub mod mxfp4;
pub mod null_runner;
pub mod routing;
pub mod runner;
pub mod sampling;
pub mod schema;
pub mod shard_rule;
pub mod state;
pub mod synth;
pub mod tensor;
pub mod trained;

pub use config::ModelConfig;
pub use error::{KernelError, Result};
pub use runner::{Runner, StateId, TokenId};
