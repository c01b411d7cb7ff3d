//! One rank's place in the sharded CUDA forward ([`DeviceGroup`]): how a rank of a tensor-parallel group completes
//! what its shard of the weights leaves partial, and [`HostComm`], the device communicator of ranks that share one
//! GPU. The forward (`cuda::forward`) calls these where `cpu::sharded` calls its `Reduce`; which part of each weight
//! a rank holds is `crate::shard_rule`'s, loaded by `DevWeights::load_shard`.
//!
//! Invariants (those of `cpu::shard`, on the device):
//! - A row-parallel projection (KDA and MLA `o_proj`, the dense and shared-expert `down`) writes its fp32 share
//!   unrounded (`GemmKernels::linear_partial`, the GEMMs' partial epilogue), the group all-reduces it in fp32 and
//!   one launch rounds it to bf16 (`round_partial`): the one rounding the unsharded GEMM makes after its own sum. So
//!   over a group of one every output is the unsharded forward's bit for bit (the same sums, rounded once), and over
//!   `N` ranks the outputs differ from it only by the order of the fp32 additions, as the CPU's do.
//! - Routed experts split by width: `moe_down` writes each (token, slot) pair's fp32 share, the whole layer's
//!   `[n k, latent]` is all-reduced once and rounded before the combine, as `cpu::moe::latent_moe_reduced` does.
//!   Dispatch and combine are that all-reduce, not an all-to-all: every rank already holds every token's latent input
//!   (the router, `routed_expert_down_proj` and their inputs are replicated), so an all-to-all would move bytes the
//!   ranks have and still need a gather of the outputs (measured on the CPU, `cpu::moe`). Expert parallelism (whole
//!   experts per rank) is not built on the device: [`DeviceGroup::new`] refuses it, naming the flag.
//! - The embedding is vocabulary-parallel: a rank writes its rows and zeros for the other ranks' ids
//!   (`embed_gather_part`); a bf16 all-reduce of one non-zero term per element is exact. The lm_head writes
//!   `[positions, V / N]` per rank; the slices are all-gathered (exact) and laid out `[positions, V]`
//!   (`vocab_interleave`) on every rank, so sampling reads whole rows as it does unsharded.
//! - Between steps, rank 0 leads and the other ranks follow (`cuda::follower`): before every group-wide action
//!   rank 0 sends its [`Plan`] ([`DeviceGroup::send_plan`]: two broadcasts, its length then its bytes), so every rank
//!   makes the same calls in the same order, as `cpu::sharded` does over the host communicator.
//! - Every collective is issued on the main lane, in the forward's fixed order, by every rank over the same rows:
//!   the ranks make the same calls with the same counts. A shared expert's partial is computed on the side lane and
//!   completed on the main lane after the join. The collectives of a communicator that can be captured (NCCL) sit in
//!   the step's CUDA graph with its kernels; [`HostComm`] cannot be captured, and a step over it runs eagerly.

use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::driver::CudaStream;
use half::bf16;

use crate::comm::Communicator;
use crate::cpu::plan::Plan;
use crate::cuda::device::device_err;
use crate::cuda::gpu::Gpu;
use crate::cuda::launch::DPtr;
use crate::cuda::nccl::{DeviceBuf, DeviceCommunicator, Elem};
use crate::error::{KernelError, Result};
use crate::shard_rule::{Shard, EP_FLAG};

/// A rank of a sharded device model: its shard of the weights and the communicator of its group.
#[derive(Clone)]
pub struct DeviceGroup {
    pub shard: Shard,
    pub comm: Arc<dyn DeviceCommunicator>,
}

impl DeviceGroup {
    /// The group of `comm` holding `shard`, which must name the communicator's rank and size. Expert parallelism is
    /// refused: the device forward splits routed experts by width only.
    pub fn new(shard: Shard, comm: Arc<dyn DeviceCommunicator>) -> Result<Self> {
        if comm.rank() != shard.rank || comm.world_size() != shard.world {
            return Err(KernelError::InvalidInput(format!(
                "shard {} of {} on a communicator of rank {} of {}",
                shard.rank,
                shard.world,
                comm.rank(),
                comm.world_size()
            )));
        }
        if shard.expert_parallel {
            return Err(KernelError::InvalidInput(format!(
                "{EP_FLAG} is not built on CUDA yet: the device forward splits every routed expert by width over the \
                 group (leave out {EP_FLAG})"
            )));
        }
        Ok(DeviceGroup { shard, comm })
    }

    /// Whether a step's collectives can sit in a captured CUDA graph.
    pub fn capturable(&self) -> bool {
        self.comm.capturable()
    }

    /// Sums `count` elements of `elem` at `at` over the group in place, on the main lane.
    pub(crate) fn all_reduce(&self, gpu: &Gpu, at: DPtr, count: usize, elem: Elem) -> Result<()> {
        self.comm.all_reduce_sum(DeviceBuf { at, count, elem }, main_lane(gpu)?)
    }

    /// Every rank's `count` bf16 at `send`, in rank order into `recv` (`[world, count]`), on the main lane.
    pub(crate) fn all_gather_bf16(&self, gpu: &Gpu, send: DPtr, count: usize, recv: DPtr) -> Result<()> {
        self.comm.all_gather(DeviceBuf { at: send, count, elem: Elem::Bf16 }, recv, main_lane(gpu)?)
    }
}

/// The largest plan a follower accepts (a length past it is a corrupt message, not a plan).
const MAX_PLAN_BYTES: usize = 1 << 30;

impl DeviceGroup {
    /// Rank 0: sends `plan` to every other rank (waits for nothing but the copies of its bytes).
    pub fn send_plan(&self, gpu: &Gpu, plan: &Plan) -> Result<()> {
        self.message(gpu, Some(&plan.encode())).map(|_| ())
    }

    /// Every rank but 0: the next plan rank 0 sends (waits for it).
    pub fn recv_plan(&self, gpu: &Gpu) -> Result<Plan> {
        Plan::decode(&self.message(gpu, None)?)
    }

    /// A message of any length from rank 0 (`msg`, on rank 0 only) to every rank: its length, then its bytes.
    fn message(&self, gpu: &Gpu, msg: Option<&[u8]>) -> Result<Vec<u8>> {
        let len_buf = gpu.upload(&(msg.map_or(0, <[u8]>::len) as u64).to_le_bytes())?;
        self.broadcast(gpu, gpu.ptr(&len_buf), 8, Elem::U8)?;
        if let Some(m) = msg {
            let buf = gpu.upload(m)?;
            self.broadcast(gpu, gpu.ptr(&buf), m.len(), Elem::U8)?;
            return Ok(m.to_vec());
        }
        let len = gpu.download(&len_buf, 8)?;
        let len = u64::from_le_bytes(len.try_into().unwrap_or_default()) as usize;
        if len == 0 || len > MAX_PLAN_BYTES {
            return Err(KernelError::Device(format!("rank 0 sent a plan of {len} bytes (1 to {MAX_PLAN_BYTES})")));
        }
        let buf = gpu.zeros::<u8>(len)?;
        self.broadcast(gpu, gpu.ptr(&buf), len, Elem::U8)?;
        gpu.download(&buf, len)
    }

    /// Rank 0's `values` (given on rank 0; `count` zeros elsewhere) on every rank.
    pub fn broadcast_values(&self, gpu: &Gpu, values: Option<&[f32]>, count: usize) -> Result<Vec<f32>> {
        let buf = match values {
            Some(v) if v.len() == count => gpu.upload(v)?,
            Some(v) => {
                return Err(KernelError::InvalidInput(format!(
                    "a broadcast of {} values announced as {count}",
                    v.len()
                )))
            }
            None => gpu.zeros::<f32>(count)?,
        };
        self.broadcast(gpu, gpu.ptr(&buf), count, Elem::F32)?;
        gpu.download(&buf, count)
    }

    /// Every rank's `local` (equal lengths) in rank order, `[world, local]`, on every rank.
    pub fn gather_values(&self, gpu: &Gpu, local: &[f32]) -> Result<Vec<f32>> {
        let send = gpu.upload(local)?;
        let recv = gpu.zeros::<f32>(local.len() * self.shard.world)?;
        let send_buf = DeviceBuf { at: gpu.ptr(&send), count: local.len(), elem: Elem::F32 };
        self.comm.all_gather(send_buf, gpu.ptr(&recv), main_lane(gpu)?)?;
        gpu.download(&recv, local.len() * self.shard.world)
    }

    fn broadcast(&self, gpu: &Gpu, at: DPtr, count: usize, elem: Elem) -> Result<()> {
        self.comm.broadcast(0, DeviceBuf { at, count, elem }, main_lane(gpu)?)
    }
}

/// The main stream, where every collective goes (module invariants).
fn main_lane(gpu: &Gpu) -> Result<&CudaStream> {
    if gpu.on_side_lane() {
        return Err(KernelError::Device("a collective was issued on the side lane".into()));
    }
    Ok(&gpu.stream)
}

/// A [`DeviceCommunicator`] whose collectives stage through the host over an in-process [`Communicator`]: for ranks
/// that share one GPU (threads of one process), which NCCL refuses (a rank per device). Each collective waits for
/// the caller's stream, copies the buffer to the host, runs the host collective (sums in rank order, in fp32 for
/// bf16 and f32 buffers) and copies the result back, so it cannot be captured into a graph. It serves the checks of
/// the sharded forward on a machine with one GPU; NCCL ([`crate::cuda::nccl::NcclComm`]) serves groups of GPUs.
pub struct HostComm {
    comm: Box<dyn Communicator + Sync>,
}

impl HostComm {
    /// Over `comm` (e.g. a rank of `crate::comm::local_group`), whose `abort` may be called while a collective waits.
    pub fn new(comm: impl Communicator + Sync + 'static) -> Self {
        HostComm { comm: Box::new(comm) }
    }
}

fn elem_bytes(elem: Elem) -> usize {
    match elem {
        Elem::Bf16 => 2,
        Elem::F32 => 4,
        Elem::U8 => 1,
    }
}

/// Copies `count` elements of `elem` at `at` to the host in `stream`'s order (after the work that wrote them) and
/// waits for the copy.
fn download(at: DPtr, count: usize, elem: Elem, stream: &CudaStream) -> Result<Vec<u8>> {
    let mut host = vec![0u8; count * elem_bytes(elem)];
    // SAFETY: `at` holds `count` elements (the collective's contract); `host` outlives the copy (waited for below).
    unsafe { cu::cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), at, host.len(), stream.cu_stream()) }
        .result()
        .map_err(|e| device_err("copying a collective's buffer to the host", e))?;
    stream.synchronize().map_err(|e| device_err("waiting for a collective's copy", e))?;
    Ok(host)
}

/// Copies `bytes` to `at` in `stream`'s order, so the stream's later work reads them, and waits for the copy (a
/// synchronous copy would go through the legacy stream, which the backend's non-blocking streams do not wait for).
fn upload(at: DPtr, bytes: &[u8], stream: &CudaStream) -> Result<()> {
    // SAFETY: `at` holds `bytes.len()` bytes (the collective's contract); `bytes` outlives the copy (waited for).
    unsafe { cu::cuMemcpyHtoDAsync_v2(at, bytes.as_ptr().cast(), bytes.len(), stream.cu_stream()) }
        .result()
        .map_err(|e| device_err("copying a collective's result to the device", e))?;
    stream.synchronize().map_err(|e| device_err("waiting for a collective's copy", e))
}

fn widen(bytes: &[u8], elem: Elem) -> Vec<f32> {
    match elem {
        Elem::Bf16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Elem::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Elem::U8 => bytes.iter().map(|b| *b as f32).collect(),
    }
}

fn narrow(values: &[f32], elem: Elem) -> Vec<u8> {
    match elem {
        Elem::Bf16 => values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        Elem::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Elem::U8 => values.iter().map(|v| *v as u8).collect(),
    }
}

impl DeviceCommunicator for HostComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn capturable(&self) -> bool {
        false
    }

    fn all_reduce_sum(&self, buf: DeviceBuf, stream: &CudaStream) -> Result<()> {
        let mut values = widen(&download(buf.at, buf.count, buf.elem, stream)?, buf.elem);
        self.comm.all_reduce_sum(&mut values)?;
        upload(buf.at, &narrow(&values, buf.elem), stream)
    }

    fn all_gather(&self, send: DeviceBuf, recv: DPtr, stream: &CudaStream) -> Result<()> {
        let values = widen(&download(send.at, send.count, send.elem, stream)?, send.elem);
        let mut out = vec![0f32; values.len() * self.comm.world_size()];
        self.comm.all_gather(&values, &mut out)?;
        upload(recv, &narrow(&out, send.elem), stream)
    }

    fn reduce_scatter_sum(&self, send: DPtr, recv: DeviceBuf, stream: &CudaStream) -> Result<()> {
        let values = widen(&download(send, recv.count * self.comm.world_size(), recv.elem, stream)?, recv.elem);
        let mut out = vec![0f32; recv.count];
        self.comm.reduce_scatter_sum(&values, &mut out)?;
        upload(recv.at, &narrow(&out, recv.elem), stream)
    }

    fn broadcast(&self, root: usize, buf: DeviceBuf, stream: &CudaStream) -> Result<()> {
        let mut bytes = download(buf.at, buf.count, buf.elem, stream)?;
        self.comm.broadcast_bytes(root, &mut bytes)?;
        upload(buf.at, &bytes, stream)
    }

    fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }
}
