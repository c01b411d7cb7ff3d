//! sparkd serving library.
pub mod engine;
pub mod metrics;
pub mod tokenizer;
