//! sparkd serving library.
pub mod api;
pub mod config;
pub mod engine;
pub mod launch;
pub mod metrics;
pub mod plan;
pub mod startup;
