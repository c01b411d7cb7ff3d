//! The K3 forward on one GPU over a batch of sequence windows, op by op ([`DeviceModel`]), over the
//! device-resident per-sequence state of `cuda::state`.
//!
//! Invariants:
//! - The same contract as `cpu::forward`: row `r` appends its tokens to its state; a row that asked
//!   for snapshots can be cut back to any `m >= from` of its window tokens with
//!   [`DeviceUndo::commit`], which restores the KDA states and conv windows saved after `m` tokens and
//!   moves the MLA length back (the latent entries past it are simply overwritten later).
//! - Per-token work (projections, AttnRes, norms, FFN) is batched over every token of every row; the
//!   KDA and MLA mixers run one batched launch per kernel for all rows, each row over its own device
//!   state, found through the step's row table (`cuda::step`), built once per forward.
//! - AttnRes sources live in one buffer of slots `[slots, n, d]`: sealed blocks in seal order, the
//!   live sum in slot `sealed` (follows shared/reference/k3-architecture.md §2.1: a seal before the
//!   attention of layer `l % block == 0`; the pre-attention read is skipped while nothing is sealed).
//!   Each read is fused with the RMSNorm after it and with the residual add before it
//!   (`RowKernels::attn_res_norm`), so an FFN output is added to the live slot by the next layer's read.
//! - Logits are produced only for the positions rows ask for, and stay on the device.
//! - A step is host work (the step table, with the token ids and wanted positions, uploaded once) and then
//!   device work only (`step_body`: launches, stream-ordered allocations, events, collectives), so a step whose
//!   shape repeats is captured and replayed as a CUDA graph (`cuda::graph`), with the same results bit for bit.
//! - A model built by [`DeviceModel::sharded`] is one rank of a tensor-parallel group: its `cfg` is the rank's, its
//!   weights the rank's shard, and the step completes the shard's partial results through the group where
//!   `cuda::tp` says (row-parallel projections, routed experts split by width, the vocabulary-parallel embedding and
//!   lm_head). Its logits are whole rows on every rank. Without a group the step makes no collective.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::config::ModelConfig;
use crate::cuda::attn::{KdaArgs, MlaAppendArgs, MlaAttentionArgs, KDA_CHUNKED_MIN_TOKENS, MLA_GROUP_FROM_TOKENS};
use crate::cuda::device::device_err;
use crate::cuda::gpu::{Gemm, Gpu};
use crate::cuda::graph::{CapturedStep, Decision, GraphCache, RowShape, StepShape, GRAPH_MAX_WINDOW};
use crate::cuda::launch::{DPtr, NULL};
use crate::cuda::moe::{moe_group_len, CombineArgs, DownArgs, ExpertForm, GateUpArgs, Pairs, RouteArgs};
use crate::cuda::nccl::Elem;
use crate::cuda::ops::Ops;
use crate::cuda::rows::{AttnResNormArgs, AttnResRead, EmbedPartArgs, GatherArgs, SituArgs};
use crate::cuda::state::{DeviceRow, DeviceUndo};
use crate::cuda::step::{StepBuffer, StepTables, TableSpec, MLA_CHUNK_SPLIT_TOKENS};
use crate::cuda::tp::DeviceGroup;
use crate::cuda::weights::{
    DevFfn, DevKda, DevLinear, DevMerged, DevMixer, DevMla, DevMlp, DevMoe, DevNorm, DevWeights,
};
use crate::error::{KernelError, Result};
use crate::routing::Routing;

/// Profile span labels ([`Gpu::mark`]): a layer's mixer, its FFN, and the final read, norm and lm_head. The
/// span of a kind's own label is its AttnRes read and norm; its ops follow in spans labelled `kind.op`
/// (`kda.recurrence`, `moe.experts`, ...), so a kind's time is the sum of both.
pub const SPAN_KDA: &str = "kda";
pub const SPAN_MLA: &str = "mla";
pub const SPAN_DENSE: &str = "dense";
pub const SPAN_MOE: &str = "moe";
pub const SPAN_HEAD: &str = "head";

/// The result of a forward call.
pub struct DeviceOutput {
    /// `[rows_total, vocab]` bf16 logits, rows in row order.
    pub logits: CudaSlice<bf16>,
    /// Per row: `(first logits row, number of rows)`.
    pub rows: Vec<(usize, usize)>,
    pub undo: Vec<Option<DeviceUndo>>,
    /// `[taps, tokens, d]` bf16: the hidden states of the tapped layers (see [`DeviceModel::forward_tapped`])
    /// at every token, tokens in row order; `None` when no layer was tapped.
    pub taps: Option<CudaSlice<bf16>>,
}

/// What a forward does besides computing logits.
#[derive(Default)]
pub struct StepOptions<'a> {
    /// Receives, per MoE layer, every token's routing (tokens in row order), as `cpu::RoutingTrace` does.
    pub trace: Option<&'a mut Vec<Vec<Routing<f32>>>>,
    /// Layers whose hidden state is kept at every token (ascending, never the last layer), as
    /// `cpu::Probe::tap_layers` defines it: the pre-attention AttnRes read of layer `l + 1`, before its input
    /// norm (the DSpark drafter's context features).
    pub tap_layers: &'a [usize],
    /// A fed step: its token ids (u32, one per row) come from this device address (`cuda::step::TableSpec`).
    pub fed_tokens: Option<DPtr>,
}

/// How many steps ran from CUDA graphs (see `cuda::graph`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphStats {
    /// Graphs held now.
    pub held: usize,
    /// Graphs captured, and steps replayed from one, since the model was loaded.
    pub captured: u64,
    pub replayed: u64,
    /// Nodes of the last graph captured (kernels, memsets, copies, memory nodes, event edges).
    pub last_capture_nodes: usize,
    /// Captures that failed (those shapes run eagerly), and the last one's error.
    pub capture_failures: u64,
    pub last_capture_error: Option<String>,
}

/// The model on the device.
pub struct DeviceModel {
    pub cfg: ModelConfig,
    pub weights: DevWeights,
    /// The op families' kernels on the model's device.
    pub ops: Ops,
    /// KDA windows of at least this many tokens without snapshots run the chunked form.
    pub kda_chunked_min: usize,
    /// MLA windows of at least this many tokens run 4 tokens to a block ([`MLA_GROUP_FROM_TOKENS`]), and windows
    /// longer than a verify window get about `mla_chunk_split_tokens` (token, split) pairs
    /// ([`MLA_CHUNK_SPLIT_TOKENS`]; `cuda::step::mla_span`).
    pub mla_group_from: usize,
    pub mla_chunk_split_tokens: usize,
    /// Whether repeated step shapes are captured into CUDA graphs and replayed (on by default).
    pub graphs_enabled: bool,
    /// The tensor-parallel group this model is a rank of (`None`: the whole model).
    group: Option<DeviceGroup>,
    /// Where each step's row table is uploaded.
    tables: StepBuffer,
    /// The captured steps by shape.
    graphs: Mutex<GraphCache<CapturedStep>>,
    last_capture_nodes: AtomicUsize,
}

impl DeviceModel {
    /// The model of `cfg` over `weights`, run with `ops` (both on the same device).
    pub fn new(cfg: ModelConfig, weights: DevWeights, ops: Ops) -> Self {
        DeviceModel {
            cfg,
            weights,
            ops,
            kda_chunked_min: KDA_CHUNKED_MIN_TOKENS,
            mla_group_from: MLA_GROUP_FROM_TOKENS,
            mla_chunk_split_tokens: MLA_CHUNK_SPLIT_TOKENS,
            graphs_enabled: true,
            group: None,
            tables: StepBuffer::default(),
            graphs: Mutex::new(GraphCache::default()),
            last_capture_nodes: AtomicUsize::new(0),
        }
    }

    /// Rank `group.shard.rank` of the model `cfg` (the whole model's config) sharded over `group`, on `weights`
    /// loaded for the same shard (`DevWeights::load_shard`). The model's `cfg` is the rank's
    /// (`Shard::local_config`), so its sequence states are the rank's shards of them; every rank of the group runs
    /// every step over the same rows (module invariants). A group of one computes the whole model's bits.
    pub fn sharded(cfg: &ModelConfig, weights: DevWeights, ops: Ops, group: DeviceGroup) -> Result<Self> {
        let local = group.shard.local_config(cfg)?;
        if weights.lm_head.out_dim * group.shard.world != cfg.vocab_size {
            return Err(KernelError::InvalidInput(format!(
                "weights with a {}-row lm_head are not rank {}'s shard of a {}-token vocabulary over {} ranks",
                weights.lm_head.out_dim, group.shard.rank, cfg.vocab_size, group.shard.world
            )));
        }
        Ok(DeviceModel { group: Some(group), ..DeviceModel::new(local, weights, ops) })
    }

    /// The group this model is a rank of, if any.
    pub fn group(&self) -> Option<&DeviceGroup> {
        self.group.as_ref()
    }

    /// Grows the rows' MLA caches for their windows, allocates their snapshot buffers and uploads the
    /// step's row table (see `cuda::step`), for running single ops of a step (the op checks).
    pub fn step_tables(&self, gpu: &Gpu, rows: &mut [DeviceRow<'_>], offsets: &[usize]) -> Result<StepTables> {
        StepTables::build(gpu, &self.cfg, &self.tables, rows, &self.table_spec(offsets, &[], None))
    }

    /// The table of a step with this model's kernel choices.
    fn table_spec<'a>(&self, offsets: &'a [usize], wanted: &'a [u32], fed_tokens: Option<DPtr>) -> TableSpec<'a> {
        TableSpec {
            offsets,
            wanted,
            chunked_min: self.kda_chunked_min,
            mla_chunk_split_tokens: self.mla_chunk_split_tokens,
            mla_group_from: self.mla_group_from,
            fed_tokens,
        }
    }

    fn linear(&self, gpu: &Gpu, w: &DevLinear, x: DPtr, n: usize) -> Result<CudaSlice<bf16>> {
        let y = gpu.uninit::<bf16>(n * w.out_dim)?; // [n, out], written in full by the GEMM
        self.ops.gemm.linear(gpu, &w.args(gpu, x, n, gpu.ptr(&y)))?;
        Ok(y)
    }

    /// A merged projection: one GEMM, parts segment-major (see [`DevMerged`]); returns the buffer and
    /// the device address of each part.
    fn linear_parts(&self, gpu: &Gpu, m: &DevMerged, x: DPtr, n: usize) -> Result<(CudaSlice<bf16>, Vec<DPtr>)> {
        let y = gpu.uninit::<bf16>(n * m.out_dim())?; // [n, out] segment-major, written in full by the GEMM
        self.ops.gemm.linear_parts(gpu, &m.args(gpu, x, n, gpu.ptr(&y)))?;
        let parts = m.bounds[..m.bounds.len() - 1].iter().map(|b| gpu.ptr(&y) + (n * b * 2) as u64).collect();
        Ok((y, parts))
    }

    /// A row-parallel projection of `x` `[n, in]` into `out` `[n, out_dim]` bf16: the whole GEMM, or on a rank of a
    /// group its fp32 share, all-reduced and rounded once (`cuda::tp`).
    fn row_parallel_into(&self, gpu: &Gpu, w: &DevLinear, x: DPtr, n: usize, out: DPtr) -> Result<()> {
        let args = w.args(gpu, x, n, out);
        let Some(group) = &self.group else { return self.ops.gemm.linear(gpu, &args) };
        let part = gpu.uninit::<f32>(n * w.out_dim)?; // [n, out] f32, written in full by the GEMM
        self.ops.gemm.linear_partial(gpu, &args, gpu.ptr(&part))?;
        self.complete(gpu, group, &part, out)
    }

    /// [`Self::row_parallel_into`] into a fresh buffer.
    fn row_parallel(&self, gpu: &Gpu, w: &DevLinear, x: DPtr, n: usize) -> Result<CudaSlice<bf16>> {
        let y = gpu.uninit::<bf16>(n * w.out_dim)?; // [n, out], written in full
        self.row_parallel_into(gpu, w, x, n, gpu.ptr(&y))?;
        Ok(y)
    }

    /// Sums a rank's fp32 share `part` over the group and rounds it into `out` (bf16, as long), on the main lane.
    fn complete(&self, gpu: &Gpu, group: &DeviceGroup, part: &CudaSlice<f32>, out: DPtr) -> Result<()> {
        group.all_reduce(gpu, gpu.ptr(part), part.len(), Elem::F32)?;
        self.ops.rows.round_partial(gpu, gpu.ptr(part), out, part.len())
    }

    fn norm_rows(&self, gpu: &Gpu, norm: &DevNorm, x: DPtr, y: DPtr, rows: usize, dim: usize) -> Result<()> {
        self.ops.rows.rms_norm(gpu, &norm.args(gpu, x, y, rows, dim))
    }

    /// `SiTU(gate x, up x)` over `[n, d]`: the merged gate/up GEMM and SiTU, `[n, inter]`.
    fn situ_act(&self, gpu: &Gpu, w: &DevMlp, x: DPtr, n: usize) -> Result<CudaSlice<bf16>> {
        let (_gu, parts) = self.linear_parts(gpu, &w.gate_up, x, n)?; // [n, inter] gate, then [n, inter] up
        let a = gpu.uninit::<bf16>(n * w.inter())?; // [n, inter], written in full by situ
        let (beta, lbeta) = (self.cfg.situ_beta, self.cfg.situ_linear_beta);
        let situ = SituArgs { g: parts[0], u: parts[1], out: gpu.ptr(&a), len: n * w.inter(), beta, lbeta };
        self.ops.rows.situ(gpu, &situ)?;
        Ok(a)
    }

    /// `down(SiTU(gate x, up x))` over `[n, d]` into a fresh `[n, d]`, `down` row-parallel on a rank of a group.
    fn situ_mlp(&self, gpu: &Gpu, w: &DevMlp, x: DPtr, n: usize) -> Result<CudaSlice<bf16>> {
        let a = self.situ_act(gpu, w, x, n)?;
        self.row_parallel(gpu, &w.down, gpu.ptr(&a), n)
    }

    /// Runs every row's window through the model. `trace` receives, per MoE layer, every token's
    /// routing (tokens in row order), as `cpu::RoutingTrace` does.
    pub fn forward(
        &self,
        gpu: &Gpu,
        rows: &mut [DeviceRow<'_>],
        trace: Option<&mut Vec<Vec<Routing<f32>>>>,
    ) -> Result<DeviceOutput> {
        self.forward_tapped(gpu, rows, StepOptions { trace, tap_layers: &[], fed_tokens: None })
    }

    /// [`Self::forward`] with [`StepOptions`]: taps for the drafter, and a fed step's token ids.
    /// With graphs on, a step whose shape repeats is replayed from a CUDA graph (`cuda::graph`).
    pub fn forward_tapped(&self, gpu: &Gpu, rows: &mut [DeviceRow<'_>], opts: StepOptions<'_>) -> Result<DeviceOutput> {
        let StepOptions { trace, tap_layers, fed_tokens } = opts;
        let cfg = &self.cfg;
        let d = cfg.hidden_size;
        if let Some(bad) = tap_layers.iter().find(|l| **l + 1 >= cfg.num_layers()) {
            return Err(KernelError::InvalidInput(format!(
                "tap layer {bad} is not below the last of the model's {} layers",
                cfg.num_layers()
            )));
        }
        let offsets = crate::runner::window_offsets(
            rows.iter().map(|r| (r.tokens, r.logits_from, r.snapshots_from)),
            cfg.vocab_size,
        )?;
        let n = offsets[rows.len()];
        let wanted: Vec<u32> = rows
            .iter()
            .enumerate()
            .flat_map(|(ri, r)| ((offsets[ri] + r.logits_from) as u32)..(offsets[ri + 1] as u32))
            .collect();
        let spec = self.table_spec(&offsets, &wanted, fed_tokens);
        let mut tables = StepTables::build(gpu, cfg, &self.tables, rows, &spec)?;
        let graphable = self.graphs_enabled
            && trace.is_none()
            && n > 0
            && gpu.gemm == Gemm::BatchInvariant
            && !gpu.profiling()
            && self.group.as_ref().is_none_or(|g| g.capturable())
            && rows.iter().all(|r| r.tokens.len() <= GRAPH_MAX_WINDOW);
        let outputs = |gpu: &Gpu| -> Result<(CudaSlice<bf16>, Option<CudaSlice<bf16>>)> {
            // Written in full by the step: every tap layer's read, every wanted position's logits.
            let taps = if tap_layers.is_empty() { None } else { Some(gpu.uninit::<bf16>(tap_layers.len() * n * d)?) };
            Ok((gpu.uninit::<bf16>(wanted.len() * cfg.vocab_size)?, taps))
        };
        let (logits, taps) = if graphable {
            let shape = StepShape {
                rows: rows
                    .iter()
                    .map(|r| RowShape {
                        tokens: r.tokens.len(),
                        logits_from: r.logits_from,
                        snapshots_from: r.snapshots_from,
                    })
                    .collect(),
                mla_splits: tables.mla_splits(),
                tap_layers: tap_layers.to_vec(),
                table: tables.base(),
            };
            let mut graphs =
                self.graphs.lock().map_err(|_| KernelError::Device("the graph cache lock is poisoned".into()))?;
            if graphs.decide(&shape) == Decision::Capture {
                let (logits, taps) = outputs(gpu)?;
                match self.capture(gpu, &tables, tap_layers, logits, taps) {
                    Ok(step) => {
                        self.last_capture_nodes.store(step.nodes, Ordering::Relaxed);
                        graphs.store(&shape, step);
                    }
                    // The capture ran nothing: the step runs eagerly below, and so does its shape from now on.
                    Err(e) => graphs.refuse(&shape, e.to_string()),
                }
            }
            match graphs.replay(&shape) {
                Some(step) => self.replay(gpu, step)?,
                None => {
                    let (logits, taps) = outputs(gpu)?;
                    self.step_body(
                        gpu,
                        &tables,
                        None,
                        tap_layers,
                        gpu.ptr(&logits),
                        taps.as_ref().map(|t| gpu.ptr(t)),
                    )?;
                    (logits, taps)
                }
            }
        } else {
            let (logits, taps) = outputs(gpu)?;
            self.step_body(gpu, &tables, trace, tap_layers, gpu.ptr(&logits), taps.as_ref().map(|t| gpu.ptr(t)))?;
            (logits, taps)
        };

        let mut out_rows = Vec::with_capacity(rows.len());
        let mut undo = Vec::with_capacity(rows.len());
        let mut cursor = 0;
        for (row, kda) in rows.iter_mut().zip(std::mem::take(&mut tables.undo)) {
            let t = row.tokens.len();
            let count = t - row.logits_from;
            out_rows.push((cursor, count));
            cursor += count;
            undo.push(match (row.snapshots_from, kda) {
                (Some(from), Some(kda)) => Some(DeviceUndo { start_len: row.state.len, from, window_len: t, kda }),
                _ => None,
            });
            row.state.len += t;
        }
        Ok(DeviceOutput { logits, rows: out_rows, undo, taps })
    }

    /// Captures the step of `tables` into a CUDA graph writing into `logits` and `taps` (the capture itself
    /// runs nothing).
    fn capture(
        &self,
        gpu: &Gpu,
        tables: &StepTables,
        tap_layers: &[usize],
        logits: CudaSlice<bf16>,
        taps: Option<CudaSlice<bf16>>,
    ) -> Result<CapturedStep> {
        let (logits_at, taps_at) = (gpu.ptr(&logits), taps.as_ref().map(|t| gpu.ptr(t)));
        gpu.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| device_err("starting a graph capture", e))?;
        let body = self.step_body(gpu, tables, None, tap_layers, logits_at, taps_at);
        // The capture is ended whatever the body did, so the stream is usable again.
        let graph = gpu.stream.end_capture(CUgraphInstantiate_flags(0));
        body?;
        let graph = graph
            .map_err(|e| device_err("instantiating the step graph", e))?
            .ok_or_else(|| KernelError::Device("the step capture produced no graph".into()))?;
        let mut nodes = 0usize;
        // SAFETY: the graph is live; a null node array asks only for the count.
        unsafe { cudarc::driver::sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) }
            .result()
            .map_err(|e| device_err("counting the step graph's nodes", e))?;
        Ok(CapturedStep { graph, nodes, logits, taps })
    }

    /// Launches a captured step and copies its outputs into fresh buffers (they outlive later replays).
    fn replay(&self, gpu: &Gpu, step: &CapturedStep) -> Result<(CudaSlice<bf16>, Option<CudaSlice<bf16>>)> {
        step.graph.launch().map_err(|e| device_err("launching the step graph", e))?;
        let logits = gpu.uninit::<bf16>(step.logits.len())?;
        gpu.copy::<bf16>(gpu.ptr(&logits), gpu.ptr(&step.logits), step.logits.len())?;
        let taps = match &step.taps {
            Some(t) => {
                let copy = gpu.uninit::<bf16>(t.len())?;
                gpu.copy::<bf16>(gpu.ptr(&copy), gpu.ptr(t), t.len())?;
                Some(copy)
            }
            None => None,
        };
        Ok((logits, taps))
    }

    /// Captured steps held and served, and the nodes of the last capture.
    pub fn graph_stats(&self) -> GraphStats {
        let last_capture_nodes = self.last_capture_nodes.load(Ordering::Relaxed);
        match self.graphs.lock() {
            Ok(g) => GraphStats {
                held: g.held(),
                captured: g.captured,
                replayed: g.replayed,
                last_capture_nodes,
                capture_failures: g.capture_failures,
                last_capture_error: g.last_capture_error.clone(),
            },
            Err(_) => GraphStats::default(),
        }
    }

    /// Drops every captured step.
    pub fn clear_graphs(&self) {
        if let Ok(mut g) = self.graphs.lock() {
            g.clear();
        }
    }

    /// The launches of one step, on the device only (no host copies, no synchronisation): what a graph
    /// captures. Reads the step's tokens and wanted positions from `tables`, writes `[wanted, vocab]` logits
    /// at `logits` and, when `tap_layers` is not empty, `[taps, n, d]` at `taps`.
    fn step_body(
        &self,
        gpu: &Gpu,
        tables: &StepTables,
        mut trace: Option<&mut Vec<Vec<Routing<f32>>>>,
        tap_layers: &[usize],
        logits: DPtr,
        taps: Option<DPtr>,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let d = cfg.hidden_size;
        let n = tables.tokens();
        let slots = 1 + (0..cfg.num_layers()).filter(|l| cfg.seals_before(*l)).count();
        let slot = n * d;
        gpu.mark("embed")?;
        // [slots, n, d]: slot 0 written by the embedding, each later one by the copy that opens it, before any read.
        let res = gpu.uninit::<bf16>(slots * slot)?;
        let res_at = |i: usize| gpu.ptr(&res) + (i * slot * 2) as u64;
        let rows_ops = &self.ops.rows;
        match &self.group {
            None => rows_ops.embed(gpu, gpu.ptr(&self.weights.embed), tables.token_ids(), res_at(0), n, d)?,
            Some(group) => {
                // This rank's vocabulary rows, zeros for the others' ids, summed exactly over the group.
                let rows = cfg.vocab_size / group.shard.world;
                let part = EmbedPartArgs {
                    table: gpu.ptr(&self.weights.embed),
                    first: group.shard.rank * rows,
                    rows,
                    tokens: tables.token_ids(),
                    out: res_at(0),
                    n,
                    d,
                };
                rows_ops.embed_part(gpu, &part)?;
                group.all_reduce(gpu, res_at(0), n * d, Elem::Bf16)?;
            }
        }
        // [n, d]: the normalised AttnRes read, the input of each mixer and FFN.
        let hn_buf = gpu.uninit::<bf16>(n * d)?; // written by each layer's norm before its mixer and FFN read it
        let hn = gpu.ptr(&hn_buf);
        let mut sealed = 0usize;
        let (mut kda_idx, mut mla_idx) = (0usize, 0usize);
        let eps = cfg.rms_norm_eps;
        // The AttnRes read of every layer over the residual slots `[slots, n, d]` (its source count set per read).
        let read = |nsrc: usize, q: DPtr| AttnResRead { sources: gpu.ptr(&res), slot, nsrc, q, n, d, eps };
        // The last FFN output, added to the live slot by the next read (one fused launch).
        let mut pending: Option<CudaSlice<bf16>> = None;
        for (l, lw) in self.weights.layers.iter().enumerate() {
            gpu.mark(match lw.mixer {
                DevMixer::Kda(_) => SPAN_KDA,
                DevMixer::Mla(_) => SPAN_MLA,
            })?;
            let input_norm = (gpu.ptr(&lw.input_norm.w), lw.input_norm.eps);
            // The tap of layer l - 1 is the pre-norm read taken here: the live sum, or the AttnRes read
            // (written by the same launch that normalises it).
            let tap = l.checked_sub(1).and_then(|prev| tap_layers.iter().position(|t| *t == prev));
            let tap_at = tap.zip(taps).map(|(i, taps)| taps + (i * n * d * 2) as u64);
            if sealed == 0 {
                if let Some(f) = pending.take() {
                    rows_ops.add(gpu, res_at(0), gpu.ptr(&f), n * d)?;
                }
                self.norm_rows(gpu, &lw.input_norm, res_at(0), hn, n, d)?;
                if let Some(dst) = tap_at {
                    gpu.copy::<bf16>(dst, res_at(0), n * d)?;
                }
            } else {
                let addend = pending.take();
                let add = addend.as_ref().map_or(NULL, |f| gpu.ptr(f));
                rows_ops.attn_res_norm(
                    gpu,
                    &AttnResNormArgs {
                        read: read(sealed + 1, gpu.ptr(&lw.attn_res)),
                        addend: add,
                        norm: input_norm,
                        out: hn,
                        read_out: tap_at.unwrap_or(NULL),
                    },
                )?;
            }
            let live_fresh = cfg.seals_before(l);
            if live_fresh {
                sealed += 1;
            }
            let a = match &lw.mixer {
                DevMixer::Kda(w) => {
                    let out = self.kda(gpu, w, hn, tables, kda_idx)?;
                    kda_idx += 1;
                    out
                }
                DevMixer::Mla(w) => {
                    let out = self.mla(gpu, w, hn, tables, mla_idx)?;
                    mla_idx += 1;
                    out
                }
            };
            // A fresh live slot is a copy of the mixer output; otherwise the read adds it.
            let add = if live_fresh {
                gpu.copy::<bf16>(res_at(sealed), gpu.ptr(&a), n * d)?;
                NULL
            } else {
                gpu.ptr(&a)
            };
            gpu.mark(match lw.ffn {
                DevFfn::Dense(_) => SPAN_DENSE,
                DevFfn::Moe(_) => SPAN_MOE,
            })?;
            let post_norm = (gpu.ptr(&lw.post_norm.w), lw.post_norm.eps);
            rows_ops.attn_res_norm(
                gpu,
                &AttnResNormArgs {
                    read: read(sealed + 1, gpu.ptr(&lw.mlp_res)),
                    addend: add,
                    norm: post_norm,
                    out: hn,
                    read_out: NULL,
                },
            )?;
            let f = match &lw.ffn {
                DevFfn::Dense(w) => {
                    gpu.mark("dense.mlp")?;
                    self.situ_mlp(gpu, w, hn, n)?
                }
                DevFfn::Moe(w) => self.moe(gpu, w, hn, n, trace.as_deref_mut())?,
            };
            pending = Some(f);
        }
        // The final read, norm and lm_head at the wanted positions only (the residual is read by nothing else, so a
        // step that wants no logits leaves the last output unadded).
        gpu.mark(SPAN_HEAD)?;
        let (wanted, nw) = tables.wanted();
        if nw > 0 {
            let hwn = gpu.uninit::<bf16>(nw * d)?; // [nw, d], written by the read + norm
            let norm = (gpu.ptr(&self.weights.norm.w), self.weights.norm.eps);
            let out_res = gpu.ptr(&self.weights.out_res);
            let hwn_at = gpu.ptr(&hwn);
            let last = pending.take();
            if nw == n {
                // Every position (the wanted positions ascend, so they are all of them): the read runs on the
                // residual slots in place and adds the last output as it reads, as the layers' reads do.
                let add = last.as_ref().map_or(NULL, |f| gpu.ptr(f));
                let args =
                    AttnResNormArgs { read: read(sealed + 1, out_res), addend: add, norm, out: hwn_at, read_out: NULL };
                rows_ops.attn_res_norm(gpu, &args)?;
            } else {
                if let Some(f) = last {
                    rows_ops.add(gpu, res_at(sealed), gpu.ptr(&f), n * d)?;
                }
                let packed = gpu.uninit::<bf16>((sealed + 1) * nw * d)?; // [slots, nw, d], written by the gather
                let gather = GatherArgs {
                    src: gpu.ptr(&res),
                    src_slot: slot,
                    rows: wanted,
                    nrows: nw,
                    out: gpu.ptr(&packed),
                    out_slot: nw * d,
                    slots: sealed + 1,
                    d,
                };
                rows_ops.gather_rows(gpu, &gather)?;
                let read = AttnResRead {
                    sources: gpu.ptr(&packed),
                    slot: nw * d,
                    nsrc: sealed + 1,
                    q: out_res,
                    n: nw,
                    d,
                    eps,
                };
                rows_ops
                    .attn_res_norm(gpu, &AttnResNormArgs { read, addend: NULL, norm, out: hwn_at, read_out: NULL })?;
            }
            gpu.mark("head.lm_head")?;
            let lm = &self.weights.lm_head;
            match &self.group {
                None => self.ops.gemm.linear(gpu, &lm.args(gpu, gpu.ptr(&hwn), nw, logits))?,
                Some(group) => {
                    // [nw, V / N] of this rank's ids, all-gathered [N, nw, V / N], laid out [nw, V].
                    let (world, slice) = (group.shard.world, lm.out_dim);
                    let mine = gpu.uninit::<bf16>(nw * slice)?; // written in full by the GEMM
                    self.ops.gemm.linear(gpu, &lm.args(gpu, gpu.ptr(&hwn), nw, gpu.ptr(&mine)))?;
                    let parts = gpu.uninit::<bf16>(world * nw * slice)?; // written in full by the gather
                    group.all_gather_bf16(gpu, gpu.ptr(&mine), nw * slice, gpu.ptr(&parts))?;
                    rows_ops.vocab_interleave(gpu, gpu.ptr(&parts), logits, nw, world, slice)?;
                }
            }
        }
        gpu.mark("end")?;
        Ok(())
    }

    /// A KDA layer over every row of the step (`tables` from [`DeviceModel::step_tables`]): the input
    /// projections, then one batched launch for conv, gates, norms, recurrence and gated norm, then `o_proj`.
    pub fn kda(&self, gpu: &Gpu, w: &DevKda, hn: DPtr, tables: &StepTables, layer: usize) -> Result<CudaSlice<bf16>> {
        let k = &self.cfg.kda;
        let (p, heads) = (k.proj_dim(), k.num_heads);
        let n = tables.tokens();
        // One GEMM for q, k, v, g [n, P] each, f_a [n, head_dim] and b [n, H] (weights::KDA_IN_PARTS).
        gpu.mark("kda.in_proj")?;
        let (_proj, parts) = self.linear_parts(gpu, &w.in_proj, hn, n)?;
        let f = self.linear(gpu, &w.f_b_proj, parts[4], n)?;
        let o = gpu.uninit::<bf16>(n * p)?; // [n, P], every token written by the KDA kernel of its row's form
        let args = KdaArgs {
            qkv: [parts[0], parts[1], parts[2]],
            conv_w: [gpu.ptr(&w.conv[0]), gpu.ptr(&w.conv[1]), gpu.ptr(&w.conv[2])],
            f: gpu.ptr(&f),
            b: parts[5],
            g: parts[3],
            a: gpu.ptr(&w.a),
            dt_bias: gpu.ptr(&w.dt_bias),
            o_norm: gpu.ptr(&w.o_norm),
            o: gpu.ptr(&o),
            heads: heads as i32,
            kw: k.conv_kernel as i32,
            lower_bound: k.gate_lower_bound,
            l2_eps: crate::config::L2_NORM_EPS,
            norm_eps: self.cfg.rms_norm_eps,
        };
        gpu.mark("kda.recurrence")?;
        self.ops.attn.kda_layer(gpu, tables, layer, k.head_dim, &args)?;
        gpu.mark("kda.o_proj")?;
        self.row_parallel(gpu, &w.o_proj, gpu.ptr(&o), n)
    }

    /// An MLA layer over every row of the step in 7 launches: the merged input projection, both input norms
    /// with the latent cache append, `q_b_proj`, the batched split attention with the output gate (three, see
    /// `cuda::attn`) and `o_proj`.
    pub fn mla(&self, gpu: &Gpu, w: &DevMla, hn: DPtr, tables: &StepTables, layer: usize) -> Result<CudaSlice<bf16>> {
        let m = &self.cfg.mla;
        let n = tables.tokens();
        let vw = m.num_heads * m.v_head_dim;
        // One GEMM for q_a [n, q_lora_rank], kv_a [n, r + rope] and the gate g [n, H * v] (weights::MLA_IN_PARTS).
        gpu.mark("mla.in_proj")?;
        let (_proj, parts) = self.linear_parts(gpu, &w.in_proj, hn, n)?;
        let (qa, kva, gate) = (parts[0], parts[1], parts[2]);
        // Both input norms and the cache append (the normalised c part, the raw k_rot) in one launch.
        let qa_n = gpu.uninit::<bf16>(n * m.q_lora_rank)?; // [n, q_lora_rank], every token written
        let append = MlaAppendArgs {
            qa,
            qa_n: gpu.ptr(&qa_n),
            kva,
            q_norm: (gpu.ptr(&w.q_a_norm.w), w.q_a_norm.eps),
            kv_norm: (gpu.ptr(&w.kv_a_norm.w), w.kv_a_norm.eps),
        };
        gpu.mark("mla.q_b")?;
        self.ops.attn.mla_norm_append(gpu, m, tables, layer, &append)?;
        let q = self.linear(gpu, &w.q_b_proj, gpu.ptr(&qa_n), n)?;
        let gated = gpu.uninit::<bf16>(n * vw)?; // [n, H * v], every token written by mla_out
        let kv_b = gpu.ptr(&w.kv_b_proj.w);
        gpu.mark("mla.attention")?;
        let attention = MlaAttentionArgs { q: gpu.ptr(&q), kv_b, gate: Some(gate), out: gpu.ptr(&gated) };
        self.ops.attn.mla_attention(gpu, m, &tables.mla_table(layer), &attention)?;
        gpu.mark("mla.o_proj")?;
        self.row_parallel(gpu, &w.o_proj, gpu.ptr(&gated), n)
    }

    pub(crate) fn moe(
        &self,
        gpu: &Gpu,
        w: &DevMoe,
        hn: DPtr,
        n: usize,
        trace: Option<&mut Vec<Vec<Routing<f32>>>>,
    ) -> Result<CudaSlice<bf16>> {
        let c = &self.cfg.moe;
        let (e, k, latent, inter) = (c.num_experts, c.top_k, c.latent_dim, c.expert_dim);
        let d = self.cfg.hidden_size;
        // The latent down projection runs on the side lane while the main lane routes (the router is bound by
        // its latency, the projection by bandwidth), then the shared expert, overlapping the routing and the
        // routed experts. Their outputs are allocated on the main lane before the fork and read after the
        // main lane has waited for them. On a rank of a group the shared expert's down projection leaves its fp32
        // share, completed on the main lane after the join (collectives stay on the main lane; `cuda::tp`).
        let z = gpu.uninit::<bf16>(n * latent)?; // [n, latent], written in full by the down GEMM
        let down = w.down.args(gpu, hn, n, gpu.ptr(&z));
        gpu.on_side(|| self.ops.gemm.linear(gpu, &down))?;
        gpu.mark_side()?;
        let shared = match &w.shared {
            Some(mlp) => {
                let out = gpu.uninit::<bf16>(n * d)?; // [n, d], written in full by the down GEMM or the rounding
                let part = self.group.as_ref().map(|_| gpu.uninit::<f32>(n * d)).transpose()?; // [n, d] f32 share
                gpu.on_side(|| {
                    let a = self.situ_act(gpu, mlp, hn, n)?;
                    let down = mlp.down.args(gpu, gpu.ptr(&a), n, gpu.ptr(&out));
                    match &part {
                        Some(p) => self.ops.gemm.linear_partial(gpu, &down, gpu.ptr(p)),
                        None => self.ops.gemm.linear(gpu, &down),
                    }
                })?;
                Some((out, part))
            }
            None => None,
        };
        let idx = gpu.uninit::<i32>(n * k)?; // [n, k], written in full by the router
        let wts = gpu.uninit::<f32>(n * k)?;
        let margin = gpu.uninit::<f32>(n)?;
        // The pairs grouped by expert, so each expert's weights are read once for its tokens: written by the router
        // for a step of one token, else by moe_group. The grouping and expert buffers are written by their kernels
        // wherever they are read (no memsets: `pairs` past the grouped ones, left by slots without an expert, is
        // never read).
        let group = gpu.uninit::<i32>(moe_group_len(e))?;
        let pairs = gpu.uninit::<i32>(n * k)?; // [n k], grouped by expert
        gpu.mark("moe.route")?;
        let moe = &self.ops.moe;
        let grouped = moe.moe_route(
            gpu,
            &RouteArgs {
                h: hn,
                w: gpu.ptr(&w.router.w),
                bias: gpu.ptr(&w.bias),
                idx: gpu.ptr(&idx),
                wts: gpu.ptr(&wts),
                margin: gpu.ptr(&margin),
                n,
                d: self.cfg.hidden_size,
                experts: e,
                k,
                renormalize: c.renormalize,
                scale: c.routed_scaling_factor,
                grouping: (gpu.ptr(&group), gpu.ptr(&pairs)),
            },
        )?;
        if let Some(trace) = trace {
            let (ix, wt, mg) = (gpu.download(&idx, n * k)?, gpu.download(&wts, n * k)?, gpu.download(&margin, n)?);
            trace.push(
                (0..n)
                    .map(|t| Routing {
                        experts: ix[t * k..(t + 1) * k].iter().map(|x| *x as usize).collect(),
                        weights: wt[t * k..(t + 1) * k].to_vec(),
                        margin: mg[t],
                    })
                    .collect(),
            );
        }
        let routed = Pairs { n, k, experts: e, grouping: (gpu.ptr(&group), gpu.ptr(&pairs)) };
        if !grouped {
            moe.moe_group(gpu, gpu.ptr(&idx), &routed)?;
        }
        gpu.wait_side_mark()?; // z
        let act = gpu.uninit::<bf16>(n * k * inter)?; // [n k, inter]
        let pair = |x: &crate::cuda::weights::DevExperts| (gpu.ptr(&x.packed), gpu.ptr(&x.scales));
        gpu.mark("moe.experts")?;
        let form = ExpertForm::for_batch(n, k, e, latent);
        let gate_up = GateUpArgs {
            z: gpu.ptr(&z),
            w1: pair(&w.w1),
            w3: pair(&w.w3),
            a: gpu.ptr(&act),
            latent,
            inter,
            beta: self.cfg.situ_beta,
            lbeta: self.cfg.situ_linear_beta,
        };
        moe.moe_gate_up(gpu, &routed, &gate_up, form)?;
        let expert_out = gpu.uninit::<bf16>(n * k * latent)?; // [n k, latent]
                                                              // On a rank of a group, each pair's fp32 share of its expert's output (the expert split by width).
        let part = self.group.as_ref().map(|_| gpu.uninit::<f32>(n * k * latent)).transpose()?; // [n k, latent]
        let down = DownArgs {
            a: gpu.ptr(&act),
            w2: pair(&w.w2),
            y: gpu.ptr(&expert_out),
            partial: part.as_ref().map_or(NULL, |p| gpu.ptr(p)),
            latent,
            inter,
        };
        moe.moe_down(gpu, &routed, &down, form)?;
        if let (Some(group), Some(p)) = (&self.group, &part) {
            self.complete(gpu, group, p, gpu.ptr(&expert_out))?;
        }
        let normed = gpu.uninit::<bf16>(n * latent)?; // [n, latent]
        gpu.mark("moe.combine")?;
        let combine = CombineArgs {
            y: gpu.ptr(&expert_out),
            wts: gpu.ptr(&wts),
            norm_w: gpu.ptr(&w.norm.w),
            out: gpu.ptr(&normed),
            n,
            k,
            latent,
            eps: w.norm.eps,
        };
        moe.moe_combine_norm(gpu, &combine)?;
        // The up projection, with the shared expert's output added as it is written: bf(bf(up) + shared).
        gpu.mark("moe.up")?;
        match shared {
            Some((sh, part)) => {
                gpu.join_side()?;
                if let (Some(group), Some(p)) = (&self.group, &part) {
                    self.complete(gpu, group, p, gpu.ptr(&sh))?;
                }
                self.ops.gemm.linear_add(gpu, &w.up.args(gpu, gpu.ptr(&normed), n, gpu.ptr(&sh)), gpu.ptr(&sh))?;
                Ok(sh)
            }
            None => self.linear(gpu, &w.up, gpu.ptr(&normed), n),
        }
    }
}
