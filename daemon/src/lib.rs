//! sparkd serving library.
pub mod metrics;
pub mod tokenizer;
