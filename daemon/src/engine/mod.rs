//! The engine: one thread that owns the runner, every sequence state, the scheduler, kept
//! responses (sessions), the prefix cache and the speculator (drafts, verify budgets and their
//! statistics), and talks to the rest of the daemon only through bounded channels ([`types`] is
//! the contract).
//!
//! Invariants: the engine sees the runner, its drafter and the proposer as trait objects only
//! (`dyn Runner`, `dyn Drafter`, `dyn Proposer`), composed at start-up (`crate::startup`); once
//! running, nothing outside this module touches a `Runner` or a `StateId`; no lock is held around
//! the model.

mod constraints;
pub mod core;
pub mod journal;
mod phases;
pub mod prefix_cache;
mod reuse;
pub mod scheduler;
pub mod sessions;
pub mod speculator;
pub mod step_time;
pub mod types;

#[cfg(test)]
mod speculation_tests;
#[cfg(test)]
mod tests;

pub use self::core::{spawn, spawn_journaled, spawn_with_policy, Engine};
pub use speculator::Speculation;

pub use types::{
    EngineCommand, EngineConfig, EngineError, EngineEvent, EngineHandle, FinishReason, GenerateRequest, RequestId,
    ResponseId, Usage,
};
