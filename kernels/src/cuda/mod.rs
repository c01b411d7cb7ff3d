//! The CUDA backend: device probing, NVRTC compilation of `kernels/cuda/*.cu`, weights on the device,
//! the op-by-op K3 forward, and [`CudaRunner`] (the `Runner` contract on one GPU).
//!
//! Layering (each module imports only modules of the layers above it in this list, or earlier ones of its own
//! layer; none imports a module below it, so there is no import cycle):
//! 1. Leaves: `device` (probing, opening), `compile` (NVRTC, the CUBIN cache), `expert_layout` (host tiling).
//! 2. `launch` (the one launch helper, [`launch::DPtr`]), `store` (every source compiled once, lookup by kernel
//!    name), `staging` (page-locked buffers for copies that do not wait), then `gpu` ([`gpu::Gpu`]: context, lanes, memory, counters, profile; it knows no op),
//!    then `nccl` (the [`nccl::DeviceCommunicator`] seam of a sharded forward and NCCL behind it), then `tp` (a rank's
//!    [`tp::DeviceGroup`] and the host-staged communicator of ranks sharing one GPU).
//! 3. The op families, each owning its kernels (`XKernels::load(&gpu)`) and taking argument structs: `rows`
//!    (common row kernels, norms, AttnRes), `gemm_tc` then `gemm` (wgmma, skinny mma.sync, cuBLAS), `moe` (router,
//!    grouping, experts, combine), `sample` (sampling, acceptance).
//! 4. Device sequence state: `state` (KDA states, conv windows, MLA caches, undo records), then `step` (the
//!    per-step row table), then `attn` (the batched KDA and MLA kernels over it); `weights` (on the device).
//! 5. `ops` (the families bundled for a model), `graph` (CUDA graph capture policy), `forward`
//!    ([`forward::DeviceModel`]), then `drafter`, `drafter_slot` (the DSpark drafter, whose kernels come from the
//!    same store) and `runner` ([`CudaRunner`]), then `follower` (the ranks of a group other than 0).
//!
//! Checks and benchmarks of this backend live outside it, in `crate::harness`.
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
//!   shared expert, which run on a side lane forked from and joined back to it through events (`gpu`; the
//!   main lane waits for the projection alone before the routed experts); repeated step shapes replay as
//!   CUDA graphs (`graph`). Host copies happen only for the step table (token ids included), routing
//!   traces asked for by validation, and the per-row results of `sample` (tokens, log-probabilities); in a
//!   step, the table and the sampling descriptors go up and the results come back through page-locked
//!   memory without the host waiting for the stream (`staging`).

pub mod attn;
pub mod compile;
pub mod device;
pub mod drafter;
pub mod drafter_slot;
pub mod expert_layout;
pub mod follower;
pub mod forward;
pub mod gemm;
pub mod gemm_tc;
pub mod gpu;
pub mod graph;
pub mod launch;
pub mod moe;
pub mod nccl;
pub mod ops;
pub mod rows;
pub mod runner;
pub mod sample;
pub mod staging;
pub mod state;
pub mod step;
pub mod store;
pub mod tp;
pub mod weights;

pub use device::{probe, DeviceInfo};
pub use runner::CudaRunner;
