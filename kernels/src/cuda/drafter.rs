//! The DSpark drafter on the device ([`DeviceDrafter`]): its weights, the per-sequence context cache
//! ([`DrafterContext`]), the context append from target taps, and one batched block forward with the
//! sequential Markov head and the confidence head for every row.
//!
//! Follows the CPU drafter (`dspark::model`, shared/reference/dspark.md §1.1–§1.2, §2.1) op for op:
//! - context: `H_ctx = RMSNorm(W_c · concat(taps))` per committed token, then per draft layer the latent
//!   entry `[kv_a_norm(c) | rope(k_rot, position)]` of `kv_a_proj_with_mqa(H_ctx)`;
//! - block: `[anchor, MASK × (n−1)]` at positions `P..P+n−1` (P = the context's length), pre-norm RoPE
//!   MLA layers whose queries see every context entry and every entry of their own block (non-causal),
//!   a dense SiTU MLP, the final norm, and the target's lm_head giving `U` `[n, V]`;
//! - Markov loop: `logits_k = U_k + bf(W2 · W1[x_{k−1}])` in fp32 (x_0 = the anchor), `x_k` its argmax
//!   for greedy rows, `c_k = σ(wᵀ[h_k ; W1[x_{k−1}]] + b)`; per step one gather, one GEMM for every row and
//!   one pick (docs/perf/decisions.md#d74).
//!
//! Invariants:
//! - Activations are bf16 exactly where the CPU drafter rounds them, reductions fp32, so the device
//!   and CPU drafters differ only by fp32 summation order (bf16 rounding flips, not wrong math).
//! - A context's entries cover positions `start..len()` for every draft layer alike; a block forward
//!   writes its block's latents past `len()` as scratch and never changes `len()`.
//! - Ids the runner's token mask forbids get logit `-inf` in every `logits_k`, as on the CPU.
//! - Sampled drafts (temperature > 0) are drawn on the device from each step's fp32 logits row, never
//!   rounded to bf16 (`cuda::sample::DrawPlan`: `sampling::Distribution::from_logits`, the draft stream
//!   of `dspark::model::draft_uniform`); the draw writes the token where the next Markov step reads it
//!   and the processed distribution as that draft's `q` (f32 probabilities, the layout
//!   `cuda::sample::verify_rows` reads). No logits row leaves the device: only the block's tokens,
//!   confidences and the draws' status words come back, at the end.
//! - All work runs on the runner's main stream (see `cuda::gpu`). The kernels of `drafter.cu` come from the
//!   device's module store (compiled once with every other source); the shared ops (norms, GEMMs, the block's MLA
//!   attention, sampling) are the target model's op families (`DeviceModel::ops`).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use half::bf16;

use crate::config::MLA_NORM_EPS;
use crate::cuda::attn::{check_mla_shape, MlaAttentionArgs};
use crate::cuda::forward::DeviceModel;
use crate::cuda::gpu::Gpu;
use crate::cuda::launch::{DPtr, NULL};
use crate::cuda::ops::Ops;
use crate::cuda::rows::{RmsNormArgs, SituArgs};
use crate::cuda::sample::{DeviceDraw, DeviceTokenMask, DrawPlan};
use crate::cuda::state::{reserve, DeviceMla};
use crate::cuda::step::MlaWindows;
use crate::cuda::weights::{DevLinear, DevNorm};
use crate::dspark::config::{DrafterConfig, MAX_BLOCK};
use crate::dspark::model::DRAFT_STREAM;
use crate::dspark::schema::{
    draft_layer_name, drafter_tensors, CONFIDENCE_BIAS, CONFIDENCE_WEIGHT, CONTEXT_NORM, CONTEXT_PROJ, FINAL_NORM,
    MARKOV_W1, MARKOV_W2,
};
use crate::dspark::DrafterState;
use crate::error::{KernelError, Result};
use crate::runner::{SamplingParams, TokenId};
use crate::tensor::{DType, ExpectedTensor, WeightSource};

/// Profile span labels ([`Gpu::mark`]): the context append, the block's backbone (embedding, projections, MLP),
/// its attention over the contexts, the final norm and lm_head, the Markov loop with its draws, and the end.
pub const SPAN_CONTEXT: &str = "draft.context";
pub const SPAN_BACKBONE: &str = "draft.backbone";
pub const SPAN_ATTEND: &str = "draft.attend";
pub const SPAN_LM_HEAD: &str = "draft.lm_head";
pub const SPAN_MARKOV: &str = "draft.markov";
pub const SPAN_END: &str = "draft.end";

/// Threads of a `markov_pick` block and vocabulary entries per thread (`PICK_THREADS`, `PICK_PER_THREAD`).
const PICK_THREADS: usize = 256;
const PICK_PER_THREAD: usize = 8;

/// The kernels of `kernels/cuda/drafter.cu`.
struct DrafterKernels {
    concat_taps: CudaFunction,
    rope_rows: CudaFunction,
    markov_pick: CudaFunction,
}

impl DrafterKernels {
    /// Looks the kernels up in `gpu`'s module store.
    fn load(gpu: &Gpu) -> Result<Self> {
        let f = |name: &str| gpu.function(name);
        Ok(DrafterKernels {
            concat_taps: f("concat_taps")?,
            rope_rows: f("rope_rows")?,
            markov_pick: f("markov_pick")?,
        })
    }
}

/// RoPE in place of `vectors` vectors at `x + v * stride + offset` (elements, bf16), vector `v` at position
/// `positions[v / group]` (`positions` `[vectors / group]` i32).
#[derive(Clone, Copy, Debug)]
struct RopeArgs {
    x: DPtr,
    stride: usize,
    offset: usize,
    group: usize,
    positions: DPtr,
    vectors: usize,
}

/// One draft layer's weights: RoPE MLA (no output gate) and a dense SiTU MLP, pre-norm.
struct DraftLayer {
    input_norm: DevNorm,
    q_a_proj: DevLinear,
    q_a_norm: DevNorm,
    q_b_proj: DevLinear,
    kv_a_proj: DevLinear,
    kv_a_norm: DevNorm,
    /// `[H * (nope + v), kv_lora]`
    kv_b_proj: DevLinear,
    o_proj: DevLinear,
    post_norm: DevNorm,
    /// The SiTU MLP's gate, up and down projections.
    mlp_gate: DevLinear,
    mlp_up: DevLinear,
    mlp_down: DevLinear,
}

/// A sequence's drafter context on the device: per draft layer, latent entries `[capacity, latent]`
/// bf16 of the committed tokens at positions `start..len()`.
pub struct DrafterContext {
    start: usize,
    entries: usize,
    layers: Vec<DeviceMla>,
}

impl DrafterContext {
    /// An empty context whose first entry will be the token at position `start`.
    pub fn new(gpu: &Gpu, cfg: &DrafterConfig, start: usize) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.num_draft_layers);
        for _ in 0..cfg.num_draft_layers {
            layers.push(DeviceMla { cache: gpu.zeros(0)?, capacity: 0 });
        }
        Ok(DrafterContext { start, entries: 0, layers })
    }

    /// The position after the last entry (the target's committed length).
    pub fn len(&self) -> usize {
        self.start + self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A device copy (a fork).
    pub fn duplicate(&self, gpu: &Gpu, cfg: &DrafterConfig) -> Result<Self> {
        let ld = cfg.mla().latent_dim();
        let mut out = DrafterContext::new(gpu, cfg, self.start)?;
        out.entries = self.entries;
        for (dst, src) in out.layers.iter_mut().zip(&self.layers) {
            reserve(gpu, dst, self.entries, ld)?;
            gpu.copy::<bf16>(gpu.ptr(&dst.cache), gpu.ptr(&src.cache), self.entries * ld)?;
        }
        Ok(out)
    }

    /// Device bytes held.
    pub fn bytes(&self, cfg: &DrafterConfig) -> usize {
        self.layers.iter().map(|m| m.capacity * cfg.mla().latent_dim() * 2).sum()
    }

    /// A host copy in the CPU drafter's layout (bf16 values as f32), for comparisons.
    pub fn export(&self, gpu: &Gpu, cfg: &DrafterConfig) -> Result<DrafterState<f32>> {
        let ld = cfg.mla().latent_dim();
        let mut state = DrafterState::new(cfg.num_draft_layers, ld, self.start);
        let layers: Vec<Vec<f32>> = self
            .layers
            .iter()
            .map(|m| Ok(gpu.download(&m.cache, self.entries * ld)?.into_iter().map(f32::from).collect()))
            .collect::<Result<_>>()?;
        for t in 0..self.entries {
            let entries: Vec<&[f32]> = layers.iter().map(|l| &l[t * ld..(t + 1) * ld]).collect();
            state.push(&entries);
        }
        Ok(state)
    }
}

/// One row of a block forward.
pub struct BlockRow<'a> {
    pub context: &'a mut DrafterContext,
    pub anchor: TokenId,
    /// Drafts to make (the block length), 1..=[`MAX_BLOCK`].
    pub num_drafts: usize,
    pub params: &'a SamplingParams,
}

/// What one batched block forward produced.
pub struct BlockDrafts {
    /// Per row, its drafts.
    pub tokens: Vec<Vec<TokenId>>,
    /// Per row, `c_k` per draft.
    pub confidences: Vec<Vec<f32>>,
    /// `[Σ num_drafts, V]` f32, rows in row order (row `r`'s start at `first[r]`): the processed draft
    /// distributions `q_k` of sampled rows; zeros for greedy rows.
    pub q: CudaSlice<f32>,
    pub first: Vec<usize>,
}

/// A drafter's weights on the device, with its kernels.
pub struct DeviceDrafter {
    cfg: DrafterConfig,
    kernels: DrafterKernels,
    context_proj: DevLinear,
    context_norm: DevNorm,
    layers: Vec<DraftLayer>,
    norm: DevNorm,
    /// `[V, r]`
    markov_w1: CudaSlice<bf16>,
    /// `[V, r]`: the Markov head's output projection, run as a linear layer.
    markov_w2: DevLinear,
    /// `[d + r]`
    confidence_w: CudaSlice<bf16>,
    confidence_b: f32,
    /// Bytes uploaded.
    pub bytes: usize,
}

/// Uploads the drafter's tensors from a source, each checked against `dspark::schema`.
struct Loader<'a> {
    gpu: &'a Gpu,
    specs: Vec<ExpectedTensor>,
    src: &'a dyn WeightSource,
    bytes: usize,
}

impl Loader<'_> {
    fn bf16(&mut self, name: &str) -> Result<(CudaSlice<bf16>, Vec<usize>)> {
        let spec = self
            .specs
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| KernelError::MissingTensor { name: name.to_string() })?;
        let t = self.src.tensor(spec)?;
        if t.dtype != DType::Bf16 {
            return Err(KernelError::TensorMismatch {
                name: name.into(),
                expected: "BF16".into(),
                found: t.dtype.name().into(),
            });
        }
        self.bytes += t.bytes().len();
        Ok((self.gpu.upload_bytes(t.bytes())?, t.shape.clone()))
    }

    fn linear(&mut self, name: &str) -> Result<DevLinear> {
        let (w, shape) = self.bf16(name)?;
        Ok(DevLinear { w, out_dim: shape[0], in_dim: shape[1..].iter().product() })
    }

    fn norm(&mut self, name: &str, eps: f32) -> Result<DevNorm> {
        Ok(DevNorm { w: self.bf16(name)?.0, eps })
    }
}

/// `[n, out]` = `x [n, in] · wᵀ`, a fresh buffer.
fn linear(gpu: &Gpu, ops: &Ops, w: &DevLinear, x: DPtr, n: usize) -> Result<CudaSlice<bf16>> {
    let y = gpu.uninit::<bf16>(n * w.out_dim)?; // written in full by the GEMM
    ops.gemm.linear(gpu, &w.args(gpu, x, n, gpu.ptr(&y)))?;
    Ok(y)
}

/// RMSNorm of `[n, dim]` rows into a fresh buffer.
fn norm(gpu: &Gpu, ops: &Ops, w: &DevNorm, x: DPtr, n: usize, dim: usize) -> Result<CudaSlice<bf16>> {
    let y = gpu.uninit::<bf16>(n * dim)?; // every row written by the norm
    ops.rows.rms_norm(gpu, &w.args(gpu, x, gpu.ptr(&y), n, dim))?;
    Ok(y)
}

fn to_i32(values: impl Iterator<Item = usize>) -> Result<Vec<i32>> {
    values
        .map(|v| i32::try_from(v).map_err(|_| KernelError::InvalidInput(format!("{v} does not fit a device int"))))
        .collect()
}

impl DeviceDrafter {
    /// Uploads and checks every drafter tensor from `src` (the target's embedding and lm_head are read
    /// in place from the target's weights); `cfg` must have been checked against the target.
    pub fn load(gpu: &Gpu, cfg: DrafterConfig, src: &dyn WeightSource) -> Result<Self> {
        check_mla_shape(&cfg.mla())?;
        let kernels = DrafterKernels::load(gpu)?;
        let mut up = Loader { gpu, specs: drafter_tensors(&cfg), src, bytes: 0 };
        let eps = cfg.rms_norm_eps;
        let mut layers = Vec::with_capacity(cfg.num_draft_layers);
        for i in 0..cfg.num_draft_layers {
            let n = |s: &str| draft_layer_name(i, s);
            layers.push(DraftLayer {
                input_norm: up.norm(&n("input_layernorm.weight"), eps)?,
                q_a_proj: up.linear(&n("self_attn.q_a_proj.weight"))?,
                q_a_norm: up.norm(&n("self_attn.q_a_layernorm.weight"), MLA_NORM_EPS)?,
                q_b_proj: up.linear(&n("self_attn.q_b_proj.weight"))?,
                kv_a_proj: up.linear(&n("self_attn.kv_a_proj_with_mqa.weight"))?,
                kv_a_norm: up.norm(&n("self_attn.kv_a_layernorm.weight"), MLA_NORM_EPS)?,
                kv_b_proj: up.linear(&n("self_attn.kv_b_proj.weight"))?,
                o_proj: up.linear(&n("self_attn.o_proj.weight"))?,
                post_norm: up.norm(&n("post_attention_layernorm.weight"), eps)?,
                mlp_gate: up.linear(&n("mlp.gate_proj.weight"))?,
                mlp_up: up.linear(&n("mlp.up_proj.weight"))?,
                mlp_down: up.linear(&n("mlp.down_proj.weight"))?,
            });
        }
        let bias_spec = up
            .specs
            .iter()
            .find(|s| s.name == CONFIDENCE_BIAS)
            .ok_or_else(|| KernelError::MissingTensor { name: CONFIDENCE_BIAS.to_string() })?;
        let confidence_b = src.tensor(bias_spec)?.to_f32()?[0];
        Ok(DeviceDrafter {
            kernels,
            context_proj: up.linear(CONTEXT_PROJ)?,
            context_norm: up.norm(CONTEXT_NORM, eps)?,
            layers,
            norm: up.norm(FINAL_NORM, eps)?,
            markov_w1: up.bf16(MARKOV_W1)?.0,
            markov_w2: up.linear(MARKOV_W2)?,
            confidence_w: up.bf16(CONFIDENCE_WEIGHT)?.0,
            confidence_b,
            bytes: up.bytes + 4,
            cfg,
        })
    }

    pub fn config(&self) -> &DrafterConfig {
        &self.cfg
    }

    /// RoPE in place as `a` says.
    fn rope(&self, gpu: &Gpu, a: &RopeArgs) -> Result<()> {
        let RopeArgs { x, stride, offset, group, positions, vectors } = *a;
        let len = self.cfg.qk_rope_head_dim;
        let pairs = vectors * len / 2;
        let cfg = LaunchConfig {
            grid_dim: (pairs.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (stride, offset, len, group, vectors) =
            (stride as i64, offset as i32, len as i32, group as i32, vectors as i64);
        let theta = self.cfg.rope_theta;
        let mut b = gpu.launcher(&self.kernels.rope_rows);
        b.arg(&x).arg(&stride).arg(&offset).arg(&len).arg(&group).arg(&positions).arg(&vectors).arg(&theta);
        // SAFETY: the arguments match rope_rows; `x` and `positions` cover the vectors (callers' shapes).
        unsafe { b.launch(cfg, "rope_rows") }
    }

    /// Latent entries `[n, kv_lora + rope]` of rows `h` `[n, d]` at `positions` (`[n]` i32).
    fn latents(
        &self,
        gpu: &Gpu,
        ops: &Ops,
        layer: &DraftLayer,
        h: DPtr,
        positions: DPtr,
        n: usize,
    ) -> Result<CudaSlice<bf16>> {
        let m = self.cfg.mla();
        let (r, ld) = (m.kv_lora_rank, m.latent_dim());
        let kva = linear(gpu, ops, &layer.kv_a_proj, h, n)?;
        let p = gpu.ptr(&kva);
        let kv_norm = &layer.kv_a_norm;
        let normed = RmsNormArgs {
            x: p,
            x_stride: ld,
            w: gpu.ptr(&kv_norm.w),
            y: p,
            y_stride: ld,
            rows: n,
            dim: r,
            eps: kv_norm.eps,
        };
        ops.rows.rms_norm(gpu, &normed)?;
        self.rope(gpu, &RopeArgs { x: p, stride: ld, offset: r, group: 1, positions, vectors: n })?;
        Ok(kva)
    }

    /// Appends context entries to each `(context, count)` from `taps` (`[m, tokens, d]`, the
    /// forward's taps of `target`): context `i` gets the taps of the `count` tokens starting at token `first`.
    pub fn append_context(
        &self,
        gpu: &Gpu,
        target: &DeviceModel,
        taps: &CudaSlice<bf16>,
        tokens: usize,
        rows: &mut [(&mut DrafterContext, usize, usize)],
    ) -> Result<()> {
        let (d, m) = (self.cfg.hidden_size, self.cfg.num_taps());
        let wanted: Vec<u32> =
            rows.iter().flat_map(|(_, first, count)| (*first as u32)..((first + count) as u32)).collect();
        let n = wanted.len();
        if n == 0 {
            return Ok(());
        }
        if wanted.iter().any(|t| *t as usize >= tokens) || taps.len() < m * tokens * d {
            return Err(KernelError::InvalidInput(format!("drafter taps of {tokens} tokens do not cover the commits")));
        }
        gpu.mark(SPAN_CONTEXT)?;
        let idx = gpu.upload(&wanted)?;
        let concat = gpu.zeros::<bf16>(n * m * d)?; // [n, m·d]
        let cfg = LaunchConfig { grid_dim: (n as u32, m as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (slot, d_) = ((tokens * d) as i64, d as i32);
        let (taps_ptr, idx_ptr, out_ptr) = (gpu.ptr(taps), gpu.ptr(&idx), gpu.ptr(&concat));
        let mut b = gpu.launcher(&self.kernels.concat_taps);
        b.arg(&taps_ptr).arg(&slot).arg(&idx_ptr).arg(&out_ptr).arg(&d_);
        // SAFETY: the arguments match concat_taps; the taps cover every wanted token (checked above).
        unsafe { b.launch(cfg, "concat_taps") }?;
        let ops = &target.ops;
        let projected = linear(gpu, ops, &self.context_proj, gpu.ptr(&concat), n)?;
        let ctx = norm(gpu, ops, &self.context_norm, gpu.ptr(&projected), n, d)?; // [n, d]
        let positions = gpu.upload(&to_i32(rows.iter().flat_map(|(c, _, count)| c.len()..c.len() + count))?)?;
        let ld = self.cfg.mla().latent_dim();
        for (li, layer) in self.layers.iter().enumerate() {
            let kva = self.latents(gpu, ops, layer, gpu.ptr(&ctx), gpu.ptr(&positions), n)?;
            let mut at = 0usize;
            for (context, _, count) in rows.iter_mut() {
                let cache = &mut context.layers[li];
                reserve(gpu, cache, context.entries + *count, ld)?;
                gpu.copy::<bf16>(
                    gpu.ptr(&cache.cache) + (context.entries * ld * 2) as u64,
                    gpu.ptr(&kva) + (at * ld * 2) as u64,
                    *count * ld,
                )?;
                at += *count;
            }
        }
        for (context, _, count) in rows.iter_mut() {
            context.entries += *count;
        }
        gpu.mark(SPAN_END)
    }

    /// One batched block forward and Markov loop for every row (greedy rows by device argmax, sampled
    /// rows by device draws, see the module invariants). Row contexts are not changed (their scratch is).
    pub fn draft(
        &self,
        gpu: &Gpu,
        target: &DeviceModel,
        mask: Option<&DeviceTokenMask>,
        rows: &mut [BlockRow<'_>],
    ) -> Result<BlockDrafts> {
        let cfg = &self.cfg;
        let (d, vocab, r) = (cfg.hidden_size, cfg.vocab_size, cfg.markov_rank);
        let mla = cfg.mla();
        let (heads, qh, ld) = (mla.num_heads, mla.q_head_dim(), mla.latent_dim());
        for row in rows.iter() {
            crate::sampling::check_params(row.params)?;
            if row.anchor as usize >= vocab {
                return Err(KernelError::InvalidInput(format!(
                    "anchor token {} outside the vocabulary of {vocab}",
                    row.anchor
                )));
            }
            if row.num_drafts == 0 || row.num_drafts > MAX_BLOCK {
                return Err(KernelError::InvalidInput(format!(
                    "a draft block of {} tokens is outside 1..={MAX_BLOCK}",
                    row.num_drafts
                )));
            }
        }
        let mut first = Vec::with_capacity(rows.len());
        let mut n = 0usize;
        for row in rows.iter() {
            first.push(n);
            n += row.num_drafts;
        }
        let stride = rows.iter().map(|r| r.num_drafts).max().unwrap_or(0) + 1;
        if n == 0 {
            return Ok(BlockDrafts { tokens: Vec::new(), confidences: Vec::new(), q: gpu.zeros(0)?, first });
        }
        // [n] block tokens and positions, rows in order.
        let mut block_tokens = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        for row in rows.iter() {
            for k in 0..row.num_drafts {
                block_tokens.push(if k == 0 { row.anchor } else { cfg.mask_token_id });
                positions.push(row.context.len() + k);
            }
        }
        gpu.mark(SPAN_BACKBONE)?;
        let tokens = gpu.upload(&block_tokens)?;
        let positions = gpu.upload(&to_i32(positions.into_iter())?)?;
        let x = gpu.zeros::<bf16>(n * d)?; // [n, d] residual stream
        let ops = &target.ops;
        ops.rows.embed(gpu, gpu.ptr(&target.weights.embed), gpu.ptr(&tokens), gpu.ptr(&x), n, d)?;
        // The block's attention windows (the target's MLA kernels): each block query is a window of one token
        // after every other entry of its row, its context and then its whole block (appended below before the
        // attention), so that the block is non-causal (dspark.md §1.1). Every cache is grown first, so that one
        // table holds every layer's cache addresses.
        let mut windows = MlaWindows::default();
        let mut caches = vec![Vec::with_capacity(n); self.layers.len()];
        for (row, s) in rows.iter_mut().zip(&first) {
            let (t, entries) = (row.num_drafts, row.context.entries);
            for k in 0..t {
                windows.push(entries + t - 1, s + k, 1)?;
            }
            for (layer, cache) in caches.iter_mut().zip(row.context.layers.iter_mut()) {
                reserve(gpu, cache, entries + t, ld)?;
                layer.extend(std::iter::repeat_n(gpu.ptr(&cache.cache), t));
            }
        }
        let (_windows_table, tables) = windows.upload(gpu, &caches)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = norm(gpu, ops, &layer.input_norm, gpu.ptr(&x), n, d)?;
            let qa = linear(gpu, ops, &layer.q_a_proj, gpu.ptr(&h), n)?;
            let qa_n = norm(gpu, ops, &layer.q_a_norm, gpu.ptr(&qa), n, mla.q_lora_rank)?;
            let q = linear(gpu, ops, &layer.q_b_proj, gpu.ptr(&qa_n), n)?; // [n, H·qh]
            let rope = RopeArgs {
                x: gpu.ptr(&q),
                stride: qh,
                offset: mla.qk_nope_head_dim,
                group: heads,
                positions: gpu.ptr(&positions),
                vectors: n * heads,
            };
            self.rope(gpu, &rope)?;
            let block = self.latents(gpu, ops, layer, gpu.ptr(&h), gpu.ptr(&positions), n)?; // [n, ld]
            gpu.mark(SPAN_ATTEND)?;
            for (row, s) in rows.iter().zip(&first) {
                let (t, entries) = (row.num_drafts, row.context.entries);
                gpu.copy::<bf16>(
                    gpu.ptr(&row.context.layers[li].cache) + (entries * ld * 2) as u64,
                    gpu.ptr(&block) + (s * ld * 2) as u64,
                    t * ld,
                )?;
            }
            let o = gpu.uninit::<bf16>(n * heads * mla.v_head_dim)?; // [n, H·v], written in full by mla_out
            let attention =
                MlaAttentionArgs { q: gpu.ptr(&q), kv_b: gpu.ptr(&layer.kv_b_proj.w), gate: None, out: gpu.ptr(&o) };
            ops.attn.mla_attention(gpu, &mla, &tables[li], &attention)?;
            gpu.mark(SPAN_BACKBONE)?;
            let attn = linear(gpu, ops, &layer.o_proj, gpu.ptr(&o), n)?;
            ops.rows.add(gpu, gpu.ptr(&x), gpu.ptr(&attn), n * d)?;
            let hn = norm(gpu, ops, &layer.post_norm, gpu.ptr(&x), n, d)?;
            let g = linear(gpu, ops, &layer.mlp_gate, gpu.ptr(&hn), n)?;
            let u = linear(gpu, ops, &layer.mlp_up, gpu.ptr(&hn), n)?;
            let a = gpu.uninit::<bf16>(n * layer.mlp_gate.out_dim)?; // written in full by situ
            let len = n * layer.mlp_gate.out_dim;
            let (beta, lbeta) = (cfg.situ_beta, cfg.situ_linear_beta);
            ops.rows.situ(gpu, &SituArgs { g: gpu.ptr(&g), u: gpu.ptr(&u), out: gpu.ptr(&a), len, beta, lbeta })?;
            let f = linear(gpu, ops, &layer.mlp_down, gpu.ptr(&a), n)?;
            ops.rows.add(gpu, gpu.ptr(&x), gpu.ptr(&f), n * d)?;
        }
        gpu.mark(SPAN_LM_HEAD)?;
        let hidden = norm(gpu, ops, &self.norm, gpu.ptr(&x), n, d)?; // [n, d]
        let lm = &target.weights.lm_head;
        let base_logits = linear(gpu, ops, lm, gpu.ptr(&hidden), n)?; // U: [n, V]

        // The Markov loop: one step per block position for every row at once.
        gpu.mark(SPAN_MARKOV)?;
        let nrows = rows.len();
        // [stride, R]: the anchors, then draft k of every row in row k + 1 (what step k + 1 gathers at once).
        let mut host_tokens = vec![0u32; stride * nrows];
        for (i, row) in rows.iter().enumerate() {
            host_tokens[i] = row.anchor;
        }
        let draft_tokens = gpu.upload(&host_tokens)?;
        let base = gpu.upload(&to_i32(first.iter().copied())?)?;
        let count = gpu.upload(&to_i32(rows.iter().map(|r| r.num_drafts))?)?;
        let logits = gpu.zeros::<f32>(n * vocab)?; // [n, V]
        let sampled = rows.iter().any(|r| !r.params.is_greedy());
        let q = gpu.zeros::<f32>(if sampled { n * vocab } else { 0 })?; // [n, V] when any row samples
        let conf = gpu.zeros::<f32>(n)?;
        // Per step and row, the argmax's packed best and its count of finished blocks (markov_pick).
        let best = gpu.zeros::<u64>((stride - 1) * nrows)?;
        let done = gpu.zeros::<u32>((stride - 1) * nrows)?;
        let mask_ptr = match mask {
            Some(m) if m.vocab() != vocab => {
                return Err(KernelError::InvalidInput(format!(
                    "a token mask over {} ids does not fit the drafter's vocabulary of {vocab}",
                    m.vocab()
                )))
            }
            Some(m) => m.ptr(gpu),
            None => NULL,
        };
        let e = gpu.uninit::<bf16>(nrows * r)?; // [R, r]: W1 of each row's previous token, gathered per step
        let (u_ptr, h_ptr, e_ptr, w1, cw) = (
            gpu.ptr(&base_logits),
            gpu.ptr(&hidden),
            gpu.ptr(&e),
            gpu.ptr(&self.markov_w1),
            gpu.ptr(&self.confidence_w),
        );
        let (base_ptr, count_ptr, tok_ptr, logits_ptr, conf_ptr) =
            (gpu.ptr(&base), gpu.ptr(&count), gpu.ptr(&draft_tokens), gpu.ptr(&logits), gpu.ptr(&conf));
        let (v_, r_, d_) = (vocab as i32, r as i32, d as i32);
        let cb = self.confidence_b;
        let pick_cfg = LaunchConfig {
            grid_dim: (vocab.div_ceil(PICK_THREADS * PICK_PER_THREAD) as u32, nrows as u32, 1),
            block_dim: (PICK_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // Group k: the sampled rows' draws of draft k, after the argmax of step k (which they overwrite).
        let q_ptr = gpu.ptr(&q);
        let draws: Vec<Vec<DeviceDraw<'_>>> = (0..stride - 1)
            .map(|k| {
                rows.iter()
                    .enumerate()
                    .filter(|(_, row)| !row.params.is_greedy() && k < row.num_drafts)
                    .map(|(i, row)| {
                        let at = ((first[i] + k) * vocab * 4) as u64; // byte offset of row [first + k, V] f32
                        DeviceDraw {
                            logits: logits_ptr + at,
                            probs_out: q_ptr + at,
                            token_out: tok_ptr + (((k + 1) * nrows + i) * 4) as u64,
                            params: row.params,
                            position: (row.context.len() + 1 + k) as u64,
                        }
                    })
                    .collect()
            })
            .collect();
        let plan = DrawPlan::new(gpu, vocab, &draws, DRAFT_STREAM)?;
        for k in 0..stride - 1 {
            ops.rows.embed(gpu, w1, tok_ptr + (k * nrows * 4) as u64, e_ptr, nrows, r)?;
            let m = linear(gpu, ops, &self.markov_w2, e_ptr, nrows)?; // [R, V] bf(W2 e)
            let (k_, m_ptr) = (k as i32, gpu.ptr(&m));
            let (best_ptr, done_ptr) =
                (gpu.ptr(&best) + (k * nrows * 8) as u64, gpu.ptr(&done) + (k * nrows * 4) as u64);
            let mut b = gpu.launcher(&self.kernels.markov_pick);
            b.arg(&k_).arg(&u_ptr).arg(&m_ptr).arg(&h_ptr).arg(&e_ptr).arg(&cw).arg(&cb);
            b.arg(&base_ptr).arg(&count_ptr).arg(&tok_ptr).arg(&mask_ptr).arg(&logits_ptr).arg(&conf_ptr);
            b.arg(&best_ptr).arg(&done_ptr).arg(&v_).arg(&r_).arg(&d_);
            // SAFETY: the arguments match markov_pick; every buffer covers the block's rows and vocabulary, and
            // step k's best and done words start at zero.
            unsafe { b.launch(pick_cfg, "markov_pick") }?;
            plan.launch(gpu, &ops.sample, k)?;
        }
        gpu.mark(SPAN_END)?;
        plan.finish(gpu)?;
        let all_tokens = gpu.download(&draft_tokens, stride * nrows)?;
        let all_conf = gpu.download(&conf, n)?;
        let tokens = rows
            .iter()
            .enumerate()
            .map(|(i, row)| (1..=row.num_drafts).map(|k| all_tokens[k * nrows + i]).collect())
            .collect();
        let confidences = rows.iter().zip(&first).map(|(row, s)| all_conf[*s..s + row.num_drafts].to_vec()).collect();
        Ok(BlockDrafts { tokens, confidences, q, first })
    }
}
