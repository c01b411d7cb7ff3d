//! The CUDA backend: device probing, NVRTC compilation of `kernels/cuda/*.cu`, weights on the device,
//! the op-by-op K3 forward, and [`CudaRunner`] (the `Runner` contract on one GPU).
//!
//! Invariants:
//! - Nothing here makes a cudarc driver call before [`device::open`] has checked that the driver
//!   library loads, so a machine without a GPU gets a [`crate::KernelError::Device`], never a panic.
//! - The device forward computes the same function as the CPU reference (`crate::cpu`), op for op:
//!   activations between ops are bf16 exactly where the reference rounds with `Real::act`, islands
//!   (norms, AttnRes, router, SiTU, KDA state) are fp32. The two differ only in fp32 summation order.
//! - The DSpark drafter (`drafter`, `drafter_slot`) runs on the same stream with the same rounding
//!   rules as the target forward, and reads the target's embedding and lm_head in place.
//! - All work runs on the backend's main stream in issue order, except the MoE's latent down projection and
//!   shared expert, which run on a side lane forked from and joined back to it through events (`ops`; the
//!   main lane waits for the projection alone before the routed experts); repeated step shapes replay as
//!   CUDA graphs (`graph`). Host copies happen only for the step table (token ids included), routing
//!   traces asked for by validation, and the per-row results of `sample` (tokens, log-probabilities).

pub mod attn;
pub mod compile;
pub mod device;
pub mod drafter;
pub mod drafter_slot;
pub mod expert_layout;
pub mod forward;
pub mod gemm_ops;
pub mod gemm_tc;
pub mod graph;
pub mod moe_ops;
pub mod ops;
pub mod runner;
pub mod sample;
pub mod weights;

pub use device::{probe, DeviceInfo};
pub use runner::CudaRunner;
