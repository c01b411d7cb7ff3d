//! sparkd serving library.
pub mod metrics;
