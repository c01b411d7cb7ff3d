//! Checks and benchmarks that drive the backends from outside: the decode benchmark over any
//! [`Runner`](crate::runner::Runner) (`sparkd bench --device cpu`), step costs against context length over any
//! runner (`sparkd bench --context-steps`), the CUDA benchmark (`sparkd bench
//! --device cuda`), and the CUDA backend's correctness checks against the CPU reference (`sparkd
//! validate`, the batch × window matrix, the long-input attention checks of the GPU tests).
//!
//! Why a module of `sparkd-kernels` and not a crate of its own: the checks reach views of the CUDA
//! backend that it keeps to the crate (one MoE layer run alone with its routing trace, the KDA snapshots
//! a step's undo record holds), which a separate crate could only see if the backend published them.
//!
//! Invariants:
//! - Nothing in `cpu` or `cuda` imports this module: the backends do not know how they are checked.
//! - Every check reports its measured error next to its tolerance (`compare::OpCheck`), and nothing here
//!   panics on a machine without a GPU: a CUDA check returns the `Device` error instead.
//! - Benchmarks time only what they say they time (each file's invariants say what that is).

pub mod attn_check;
pub mod compare;
pub mod context;
pub mod cuda_bench;
pub mod decode;
pub mod draft_bench;
pub mod matrix;
pub mod state_bench;
pub mod validate;
