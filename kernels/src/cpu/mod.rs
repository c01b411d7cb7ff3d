//! The CPU reference backend: the exact K3 math, batched over sequences, in f32 (serving, with bf16
//! rounding of activations where K3 keeps bf16) or f64 (checking, no rounding).
//!
//! Invariants: one [`CpuModel`] is immutable after loading; all per-sequence data lives in
//! `SeqState`s passed in by the caller, so the same model serves any number of sequences.

pub mod forward;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod ops;
pub mod plan;
pub mod runner;
pub mod shard;
pub mod sharded;
pub mod vocab;
pub mod weights;

pub use forward::{CpuModel, Probe, RoutingTrace, WindowOutput, WindowRow, WindowUndo};
pub use runner::CpuRunner;
pub use sharded::{ParallelConfig, ShardedCpuRunner};
