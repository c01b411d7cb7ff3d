//! [`Ops`]: every op family of the K3 forward on one device, each holding its own kernels looked up once from the
//! device's module store at start-up.
//!
//! Invariants:
//! - One [`Ops`] per device model (`cuda::forward::DeviceModel` owns it); every family
//!   takes its kernels from `Gpu`'s store, so nothing is compiled twice.
//! - The families are independent of each other except through the functions they share below them (`rows`'s
//!   cluster launch and add, `gemm_tc`'s call description); each launches through `Gpu::launcher` alone.

use crate::cuda::attn::AttnKernels;
use crate::cuda::gemm::GemmKernels;
use crate::cuda::gpu::Gpu;
use crate::cuda::moe::MoeKernels;
use crate::cuda::rows::RowKernels;
use crate::cuda::sample::SampleKernels;
use crate::error::Result;

/// The op families of the forward and of sampling.
pub struct Ops {
    /// Embedding gather, norms, AttnRes, add, SiTU, row gather (`common.cu`).
    pub rows: RowKernels,
    /// The linear layers (cuBLAS, `gemm.cu`, `gemm_tc.cu`).
    pub gemm: GemmKernels,
    /// The latent MoE's router, grouping, experts and combine (`moe_route.cu`, `moe.cu`).
    pub moe: MoeKernels,
    /// The batched KDA and MLA mixers (`kda.cu`, `mla.cu`).
    pub attn: AttnKernels,
    /// Sampling, log-probabilities and acceptance (`sample.cu`).
    pub sample: SampleKernels,
}

impl Ops {
    /// Every family's kernels from `gpu`'s module store.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        Ok(Ops {
            rows: RowKernels::load(gpu)?,
            gemm: GemmKernels::load(gpu)?,
            moe: MoeKernels::load(gpu)?,
            attn: AttnKernels::load(gpu)?,
            sample: SampleKernels::load(gpu)?,
        })
    }
}
