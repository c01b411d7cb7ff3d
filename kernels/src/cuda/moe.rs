//! The latent MoE's kernels ([`MoeKernels`]): the router, the grouping of (token, expert) pairs by expert and the
//! combine with the routed norm (`kernels/cuda/moe_route.cu`), and the grouped MXFP4 expert kernels
//! (`kernels/cuda/moe.cu`).
//!
//! Invariants:
//! - No host synchronisation: grids are sized from host-known bounds (at most `n k` active experts, at most
//!   `experts`), and blocks past the active count exit.
//! - The pairs grouped by expert have one layout whoever writes them: `moe_group`, or for a step of one token the
//!   router itself (its experts ascending, one pair each), which then saves the grouping launch.
//! - A token's routing and expert outputs do not depend on the other tokens of the batch, bit for bit (fixed
//!   summation orders, no float atomics; see the kernels), whichever router form and expert form run.
//! - Every launch takes an argument struct ([`RouteArgs`], [`Pairs`], [`GateUpArgs`], [`DownArgs`],
//!   [`CombineArgs`]) of device addresses the caller keeps alive across the call.

use cudarc::driver::{CudaFunction, LaunchConfig};

use crate::cuda::gpu::Gpu;
use crate::cuda::launch::{allow_shared_memory, DPtr, NULL};
use crate::cuda::rows::{no_clusters, row_cluster_launch, RowSplit, ROW_CLUSTER};
use crate::error::{KernelError, Result};

/// The router of a MoE layer over `n` tokens ([`MoeKernels::moe_route`]): `h` `[n, d]` bf16, `w` `[experts, d]` bf16,
/// `bias` `[experts]` f32; out: `idx` `[n, k]` chosen experts ascending, `wts` `[n, k]` f32 weights (renormalised
/// when asked, times `scale`), `margin` `[n]` f32 (the k-th choice over the next). `grouping`: where
/// [`MoeKernels::moe_group`] writes the pairs grouped by expert (`group`, `pairs`), which the router writes itself when
/// the step has one token.
#[derive(Clone, Copy, Debug)]
pub struct RouteArgs {
    pub h: DPtr,
    pub w: DPtr,
    pub bias: DPtr,
    pub idx: DPtr,
    pub wts: DPtr,
    pub margin: DPtr,
    pub n: usize,
    pub d: usize,
    pub experts: usize,
    pub k: usize,
    pub renormalize: bool,
    pub scale: f32,
    pub grouping: (DPtr, DPtr),
}

/// The most experts per token whose grouping the router writes itself (one lane of its selecting warp each).
const ROUTER_GROUPS_MAX_K: usize = 32;

/// The (token, expert) pairs of a routed batch: `n` tokens each choosing `k` of `experts`, grouped by expert in
/// `grouping` = (`group`: [`moe_group_len`] ints, the active experts and where each one's pairs start; `pairs`
/// `[n k]`: `t * k + j`, grouped by expert, tokens ascending), as [`MoeKernels::moe_group`] writes them.
#[derive(Clone, Copy, Debug)]
pub struct Pairs {
    pub n: usize,
    pub k: usize,
    pub experts: usize,
    pub grouping: (DPtr, DPtr),
}

/// Gate/up + SiTU of the grouped pairs: `z` `[n, latent]` bf16 in, `a` `[n k, inter]` bf16 out (row `t * k + j`);
/// `w1` and `w3` are (codes, scales) of `[experts, inter, latent]` in the tiled layout of
/// [`crate::cuda::expert_layout`]; `beta` and `lbeta` are SiTU's.
#[derive(Clone, Copy, Debug)]
pub struct GateUpArgs {
    pub z: DPtr,
    pub w1: (DPtr, DPtr),
    pub w3: (DPtr, DPtr),
    pub a: DPtr,
    pub latent: usize,
    pub inter: usize,
    pub beta: f32,
    pub lbeta: f32,
}

/// The down projection of the grouped pairs: `a` `[n k, inter]` bf16 in, `y` `[n k, latent]` bf16 out (row
/// `t * k + j`); `w2` is (codes, scales) of `[experts, latent, inter]` in the tiled layout of
/// [`crate::cuda::expert_layout`]. When `partial` is not [`NULL`], the unrounded fp32 sums go there instead, laid
/// out as `y` (an expert split by width over a tensor-parallel group: this rank's share; `cuda::tp`).
#[derive(Clone, Copy, Debug)]
pub struct DownArgs {
    pub a: DPtr,
    pub w2: (DPtr, DPtr),
    pub y: DPtr,
    pub partial: DPtr,
    pub latent: usize,
    pub inter: usize,
}

/// The weighted combine of each token's `k` expert outputs `y` `[n k, latent]` bf16 with weights `wts` `[n, k]`
/// f32, in slot order, then the routed RMSNorm with weight `norm_w` `[latent]` bf16: `out` `[n, latent]` bf16.
#[derive(Clone, Copy, Debug)]
pub struct CombineArgs {
    pub y: DPtr,
    pub wts: DPtr,
    pub norm_w: DPtr,
    pub out: DPtr,
    pub n: usize,
    pub k: usize,
    pub latent: usize,
    pub eps: f32,
}

/// The kernels of `moe_route.cu` and `moe.cu`.
pub struct MoeKernels {
    /// `moe_router_logits`, then its form for batches (`moe_router_logits_tiled`: several tokens per warp).
    moe_router_logits: [CudaFunction; 2],
    moe_route: CudaFunction,
    /// `moe_router` and `moe_router_tiled` (both in one launch, thread-block clusters): present from Hopper on.
    moe_router: Option<[CudaFunction; 2]>,
    moe_group: CudaFunction,
    moe_gate_up: CudaFunction,
    /// The grouped down projection: `[0]` any width, `[1]` widths whose steps are all full (no masks).
    moe_down: [CudaFunction; 2],
    moe_gate_up_staged: CudaFunction,
    moe_down_staged: CudaFunction,
    moe_combine_norm: CudaFunction,
    /// `moe_combine_norm` over a cluster of blocks per token: present from Hopper on.
    moe_combine_norm_cluster: Option<CudaFunction>,
}

impl MoeKernels {
    /// Looks the kernels up in `gpu`'s module store and allows the ring kernels their shared memory.
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let f = |name: &str| gpu.function(name);
        let hopper = gpu.hopper();
        let k = MoeKernels {
            moe_router_logits: [f("moe_router_logits")?, f("moe_router_logits_tiled")?],
            moe_route: f("moe_route")?,
            moe_router: hopper.then(|| Ok::<_, KernelError>([f("moe_router")?, f("moe_router_tiled")?])).transpose()?,
            moe_group: f("moe_group")?,
            moe_gate_up: f("moe_gate_up")?,
            moe_down: [f("moe_down")?, f("moe_down_full")?],
            moe_gate_up_staged: f("moe_gate_up_staged")?,
            moe_down_staged: f("moe_down_staged")?,
            moe_combine_norm: f("moe_combine_norm")?,
            moe_combine_norm_cluster: hopper.then(|| f("moe_combine_norm_cluster")).transpose()?,
        };
        for (kernel, name, bytes) in [
            (&k.moe_gate_up, "moe_gate_up", GATE_UP_SHARED_BYTES),
            (&k.moe_gate_up_staged, "moe_gate_up_staged", STAGED_SHARED_BYTES),
            (&k.moe_down_staged, "moe_down_staged", STAGED_SHARED_BYTES),
        ] {
            allow_shared_memory(kernel, bytes as usize, name)?;
        }
        Ok(k)
    }

    /// The row splits the combine + routed norm has on this device: the cluster form from Hopper on, the one-block
    /// form always.
    pub fn row_splits(&self) -> Vec<RowSplit> {
        RowSplit::available(self.moe_combine_norm_cluster.is_some())
    }

    /// The router of `r.n` tokens: `idx`, `wts` `[n, k]`, `margin` `[n]`. Up to `FUSED_ROUTER_EXPERTS` (128) experts on
    /// Hopper and later, one launch (`moe_router`: a cluster of blocks per token computes its logits, then selects);
    /// otherwise two: the fp32 logits `[n, experts]` (one warp per token and expert), then the per-token
    /// selection. Batches that would read the router weights often enough ([`router_tiles_tokens`]) take the forms
    /// that compute `ROUTER_TOKENS` tokens per warp. Every form gives the same outputs bit for bit. Returns whether
    /// it also wrote `r.grouping` (what [`MoeKernels::moe_group`] writes): it does for a step of one token with at most 32
    /// experts per token, which then needs no grouping launch.
    pub fn moe_route(&self, gpu: &Gpu, r: &RouteArgs) -> Result<bool> {
        let Some(routers) = self.moe_router.as_ref().filter(|_| r.experts <= FUSED_ROUTER_EXPERTS) else {
            return self.moe_route_in_two_launches(gpu, r);
        };
        let (group, pairs, grouped) = router_grouping(r);
        let (d, e, k, rn) = (r.d as i32, r.experts as i32, r.k as i32, r.renormalize as i32);
        if router_tiles_tokens(r.n, r.experts, r.d) {
            let cfg = LaunchConfig {
                grid_dim: (ROUTER_CLUSTER, r.n.div_ceil(ROUTER_TOKENS) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: (3 * ROUTER_TOKENS * r.experts * 4) as u32,
            };
            let n = r.n as i32;
            let mut b = gpu.launcher(&routers[1]);
            b.arg(&r.h).arg(&r.w).arg(&r.bias).arg(&r.idx).arg(&r.wts).arg(&r.margin).arg(&d).arg(&e).arg(&k);
            b.arg(&rn).arg(&r.scale).arg(&n);
            // SAFETY: the arguments match moe_router_tiled; the buffers are the caller's (`RouteArgs`).
            unsafe { b.launch(cfg, "moe_router_tiled") }?;
            return Ok(false);
        }
        let cfg = LaunchConfig {
            grid_dim: (ROUTER_CLUSTER, r.n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (3 * r.experts * 4) as u32,
        };
        let mut b = gpu.launcher(&routers[0]);
        b.arg(&r.h).arg(&r.w).arg(&r.bias).arg(&r.idx).arg(&r.wts).arg(&r.margin).arg(&d).arg(&e).arg(&k).arg(&rn);
        b.arg(&r.scale).arg(&group).arg(&pairs);
        // SAFETY: the arguments match moe_router; the buffers are the caller's (`RouteArgs`).
        unsafe { b.launch(cfg, "moe_router") }?;
        Ok(grouped)
    }

    /// [`MoeKernels::moe_route`] in its two-launch form whatever the expert count (the form K3's 896 experts take).
    pub fn moe_route_in_two_launches(&self, gpu: &Gpu, r: &RouteArgs) -> Result<bool> {
        let (group, pairs, grouped) = router_grouping(r);
        let logits = gpu.uninit::<f32>(r.n * r.experts)?; // [n, E], written in full by moe_router_logits
        let logits_ptr = gpu.ptr(&logits);
        let (d, e, k, rn) = (r.d as i32, r.experts as i32, r.k as i32, r.renormalize as i32);
        let tiled = router_tiles_tokens(r.n, r.experts, r.d);
        let token_blocks = if tiled { r.n.div_ceil(ROUTER_TOKENS) } else { r.n };
        let cfg = LaunchConfig {
            grid_dim: (r.experts.div_ceil(8) as u32, token_blocks as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.launcher(&self.moe_router_logits[usize::from(tiled)]);
        b.arg(&r.h).arg(&r.w).arg(&logits_ptr).arg(&d).arg(&e);
        let n = r.n as i32;
        if tiled {
            b.arg(&n);
        }
        let name = if tiled { "moe_router_logits_tiled" } else { "moe_router_logits" };
        // SAFETY: the arguments match moe_router_logits(_tiled); `logits` holds [n, E].
        unsafe { b.launch(cfg, name) }?;
        let cfg = LaunchConfig {
            grid_dim: (r.n as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: (2 * r.experts * 4) as u32,
        };
        let mut b = gpu.launcher(&self.moe_route);
        b.arg(&logits_ptr).arg(&r.bias).arg(&r.idx).arg(&r.wts).arg(&r.margin).arg(&e).arg(&k).arg(&rn).arg(&r.scale);
        b.arg(&group).arg(&pairs);
        // SAFETY: the arguments match moe_route; the buffers are the caller's (`RouteArgs`).
        unsafe { b.launch(cfg, "moe_route") }?;
        Ok(grouped)
    }

    /// Groups the routed (token, slot) pairs by expert on the device (no host synchronisation) into `p.grouping`
    /// (see [`Pairs`]), from `idx` `[n, k]` (ascending per token). One block of 256 threads, the tokens in windows
    /// whose bitmasks fit in shared memory ([`group_window_words`]).
    pub fn moe_group(&self, gpu: &Gpu, idx: DPtr, p: &Pairs) -> Result<()> {
        let words = group_window_words(p.n, p.experts)?;
        let shared_bytes = (2 + words) * p.experts * 4;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: shared_bytes as u32 };
        let (n, k, e, words) = (p.n as i32, p.k as i32, p.experts as i32, words as i32);
        let (group, pairs) = p.grouping;
        let mut b = gpu.launcher(&self.moe_group);
        b.arg(&idx).arg(&n).arg(&k).arg(&e).arg(&words).arg(&group).arg(&pairs);
        // SAFETY: the arguments match moe_group; `idx` holds [n, k] and the grouping buffers their lengths.
        unsafe { b.launch(cfg, "moe_group") }
    }

    /// Gate/up + SiTU per active expert over its grouped pairs (see [`GateUpArgs`]). Both forms give the same bits
    /// (the model takes [`ExpertForm::for_batch`]).
    pub fn moe_gate_up(&self, gpu: &Gpu, p: &Pairs, a: &GateUpArgs, form: ExpertForm) -> Result<()> {
        let Pairs { n, k, experts, grouping } = *p;
        let GateUpArgs { z, w1, w3, a: act, latent, inter, beta, lbeta } = *a;
        check_expert_width("latent", latent)?;
        let (kernel, name, cfg) = match form {
            ExpertForm::Rows => {
                (&self.moe_gate_up, "moe_gate_up", expert_launch(n, k, experts, inter, 16, GATE_UP_SHARED_BYTES))
            }
            ExpertForm::Staged => (
                &self.moe_gate_up_staged,
                "moe_gate_up_staged",
                expert_launch(n, k, experts, inter, 16, STAGED_SHARED_BYTES),
            ),
        };
        let (k, e, dl, di) = (k as i32, experts as i32, latent as i32, inter as i32);
        let mut b = gpu.launcher(kernel);
        b.arg(&z).arg(&w1.0).arg(&w1.1).arg(&w3.0).arg(&w3.1).arg(&grouping.0).arg(&grouping.1).arg(&act);
        b.arg(&k).arg(&e).arg(&dl).arg(&di).arg(&beta).arg(&lbeta);
        // SAFETY: the arguments match both gate/up forms; the buffers are the caller's (`GateUpArgs`).
        unsafe { b.launch(cfg, name) }
    }

    /// Down projection per active expert over its grouped pairs (see [`DownArgs`]). Both forms give the same bits
    /// (the model takes [`ExpertForm::for_batch`]); [`ExpertForm::Staged`] needs `latent` to be a multiple of 32.
    pub fn moe_down(&self, gpu: &Gpu, p: &Pairs, a: &DownArgs, form: ExpertForm) -> Result<()> {
        let Pairs { n, k, experts, grouping } = *p;
        let DownArgs { a: act, w2, y, partial, latent, inter } = *a;
        check_expert_width("expert", inter)?;
        let (e, dl, di) = (experts as i32, latent as i32, inter as i32);
        let (kernel, name, cfg) = match form {
            ExpertForm::Rows => {
                let full = inter % (128 * DOWN_KB) == 0;
                let name = if full { "moe_down_full" } else { "moe_down" };
                (&self.moe_down[usize::from(full)], name, expert_launch(n, k, experts, latent, 16, 0))
            }
            ExpertForm::Staged => {
                if latent % 32 != 0 {
                    return Err(KernelError::InvalidInput(format!(
                        "the staged moe_down takes two 16-row tiles per warp and needs a multiple of 32 output \
                         rows, got {latent}"
                    )));
                }
                let cfg = expert_launch(n, k, experts, latent, 32, STAGED_SHARED_BYTES);
                (&self.moe_down_staged, "moe_down_staged", cfg)
            }
        };
        let mut b = gpu.launcher(kernel);
        b.arg(&act).arg(&w2.0).arg(&w2.1).arg(&grouping.0).arg(&grouping.1).arg(&y).arg(&partial);
        b.arg(&e).arg(&dl).arg(&di);
        // SAFETY: the arguments match both down forms; the buffers are the caller's (`DownArgs`).
        unsafe { b.launch(cfg, name) }
    }

    /// The combine and routed norm of `a`. Each token's row is spread as [`RowSplit::for_width`] says.
    pub fn moe_combine_norm(&self, gpu: &Gpu, a: &CombineArgs) -> Result<()> {
        let split = RowSplit::for_width(self.moe_combine_norm_cluster.is_some(), a.latent);
        self.moe_combine_norm_as(gpu, split, a)
    }

    /// [`MoeKernels::moe_combine_norm`] spread as `split` says (for the equivalence checks of both forms; the two
    /// sum the norm's squares in different fixed orders and differ by rounding).
    pub fn moe_combine_norm_as(&self, gpu: &Gpu, split: RowSplit, a: &CombineArgs) -> Result<()> {
        let CombineArgs { y, wts, norm_w, out, n, k, latent, eps } = *a;
        let (kernel, cfg) = match split {
            RowSplit::Cluster => (
                self.moe_combine_norm_cluster.as_ref().ok_or_else(no_clusters)?,
                row_cluster_launch(n, latent.div_ceil(ROW_CLUSTER as usize)),
            ),
            RowSplit::OneBlock => (
                &self.moe_combine_norm,
                LaunchConfig {
                    grid_dim: (n as u32, 1, 1),
                    block_dim: (512, 1, 1),
                    shared_mem_bytes: (latent * 4) as u32,
                },
            ),
        };
        if cfg.shared_mem_bytes > 48 * 1024 {
            return Err(KernelError::InvalidInput(format!("a routed norm over {latent} values is not supported")));
        }
        let (k, dl) = (k as i32, latent as i32);
        let mut b = gpu.launcher(kernel);
        b.arg(&y).arg(&wts).arg(&norm_w).arg(&out).arg(&k).arg(&dl).arg(&eps);
        // SAFETY: the arguments match both combine forms; the buffers are the caller's (`CombineArgs`).
        unsafe { b.launch(cfg, "moe_combine_norm") }
    }
}

/// The grouping pointers the router kernels take (null: `moe_group` groups), and whether they are set.
fn router_grouping(r: &RouteArgs) -> (DPtr, DPtr, bool) {
    if r.n == 1 && r.k <= ROUTER_GROUPS_MAX_K {
        (r.grouping.0, r.grouping.1, true)
    } else {
        (NULL, NULL, false)
    }
}

/// The most dynamic shared memory `moe_group` takes (the default limit, no opt-in needed).
const GROUP_SHARED_LIMIT: usize = 48 * 1024;

/// The 32-token mask words per expert of each token window of `moe_group` for `n` tokens over `experts` experts:
/// every token in one window where the masks fit beside the counts and starts (2 ints per expert) in
/// [`GROUP_SHARED_LIMIT`], else as many words as fit (more windows, the same grouping).
pub(crate) fn group_window_words(n: usize, experts: usize) -> Result<usize> {
    let fit = (GROUP_SHARED_LIMIT / 4 / experts.max(1)).saturating_sub(2);
    if fit == 0 {
        return Err(KernelError::InvalidInput(format!("grouping {experts} experts needs too much shared memory")));
    }
    Ok(n.div_ceil(32).clamp(1, fit))
}

/// Blocks per token of the one-launch router (`ROUTER_CLUSTER` in `kernels/cuda/moe_route.cu`).
const ROUTER_CLUSTER: u32 = 8;

/// Tokens per warp of the routers' forms for batches (`ROUTER_TOKENS` in `kernels/cuda/moe_route.cu`).
const ROUTER_TOKENS: usize = 4;

/// The router weight bytes a batch reads (once per token) from which the routers compute `ROUTER_TOKENS` tokens
/// per warp, reading the weights that many times less often. Below it the one-token forms' fewer, wider rounds of
/// loads (8 chunks in flight against 4) should be faster: the bytes are few and each warp's latency sets the time.
/// The threshold is an estimate (three extra rounds of L2 latency against the traffic saved), not a measured
/// crossover: k3-mini's 0.9 MB router tiles from 26 tokens, K3's 12.8 MB from 2. Measured with it
/// (docs/perf/decisions.md#d45): `moe.route` at k3-mini's batch 32 and 64 0.275 → 0.251 and 0.341 → 0.289 ms per
/// step, at K3's routing 0.611 → 0.369 at batch 64.
const ROUTER_TILED_MIN_BYTES: usize = 24 << 20;

/// Whether a router call of `n` tokens over `experts` rows of `d` inputs takes the forms for batches.
fn router_tiles_tokens(n: usize, experts: usize, d: usize) -> bool {
    n > 1 && n * experts * d * 2 >= ROUTER_TILED_MIN_BYTES
}

/// The most experts the one-launch router takes (its cluster has 64 warps, one dot product each per 64 experts;
/// past 2 each the two-launch router spreads the dot products wider).
const FUSED_ROUTER_EXPERTS: usize = 128;

/// Ints of the grouping buffer [`MoeKernels::moe_group`] writes for `experts` experts: the active count, the
/// active experts `[experts]`, and the start of each active expert's pairs `[experts + 1]`.
pub fn moe_group_len(experts: usize) -> usize {
    2 * experts + 2
}

/// 16-row tiles (one per warp) per block of the grouped expert kernels (`MMA_WARPS` in `kernels/cuda/moe.cu`).
const EXPERT_WARPS: u32 = 4;

/// Steps of weights in each warp's shared-memory ring of the ring kernels, K blocks of 128 inputs per step of
/// `moe_gate_up` and of the staged kernels, and the scale bytes of a block's 16-row chunk (`EXPERT_STAGES`,
/// `GATE_UP_KB`, `STAGED_KB`, `TILE_SCALE_BYTES` in `kernels/cuda/moe.cu`).
const EXPERT_STAGES: u32 = 3;
const GATE_UP_KB: u32 = 2;
const STAGED_KB: u32 = 1;
const TILE_SCALE_BYTES: u32 = 64;

/// The bytes of one ring step of two matrices and `kb` K blocks (`RingStep<2, kb>::BYTES` there): codes for 2 rows
/// per lane, 16 bytes per row and block, then the scale chunks.
const fn ring_step_bytes(kb: u32) -> u32 {
    2 * 2 * kb * 512 + 2 * kb * TILE_SCALE_BYTES
}

/// Dynamic shared memory of a `moe_gate_up` block: one ring per warp.
const GATE_UP_SHARED_BYTES: u32 = EXPERT_WARPS * EXPERT_STAGES * ring_step_bytes(GATE_UP_KB);

/// The most pairs per chunk of the staged kernels (`STAGED_COLUMNS`), and their dynamic shared memory
/// (`STAGED_SHARED_BYTES`): one ring per warp, then the block's stage of token inputs, a slot per ring step of
/// `STAGED_COLUMNS` rows of `STAGED_KB` blocks of 128 bf16 inputs.
const STAGED_COLUMNS: u32 = 32;
const STAGED_SHARED_BYTES: u32 =
    EXPERT_WARPS * EXPERT_STAGES * ring_step_bytes(STAGED_KB) + EXPERT_STAGES * STAGED_COLUMNS * STAGED_KB * 256;

/// K blocks of 128 inputs per step of moe_down (`DOWN_KB` in `kernels/cuda/moe.cu`): expert widths that are
/// multiples of `128 * DOWN_KB` inputs (K3's 3,072) fill every step and take `moe_down_full`, the form without masks.
const DOWN_KB: usize = 2;

/// Where the grouped expert kernels read the token inputs: each warp its pairs' rows from global memory (`Rows`:
/// `moe_gate_up`, and `moe_down` with one 16-row tile per warp), or through a per-block stage in shared memory that
/// the block's warps share (`Staged`: `moe_gate_up_staged`, and `moe_down_staged` with two tiles per warp). The
/// same bits either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertForm {
    Rows,
    Staged,
}

/// The fewest pairs per expert, on average over the batch, from which [`ExpertForm::Staged`] runs whatever the
/// number of active experts: there the token inputs' loads bound the row form (H200; docs/perf/decisions.md#d37
/// and docs/perf/decisions.md#d40).
const STAGED_MIN_PAIRS: usize = 8;

/// The most active experts (bounded by `min(n k, experts)`) at which [`ExpertForm::Staged`] runs with fewer pairs
/// per expert: a launch of a few waves, whose warps wait on their loads, gains from the stage's prefetched copies
/// (k3-mini's batches 1 to 32, and K3's batch 1; docs/perf/decisions.md#d40), while the many waves of K3's
/// routing at batch 8 and more run the row form's two K blocks per step faster.
const STAGED_MAX_ACTIVE_EXPERTS: usize = 64;

impl ExpertForm {
    /// The form for `n` tokens choosing `k` of `experts` experts, with `latent` output rows: a function of the batch
    /// shape alone (the kernels never wait for the routing on the host).
    pub fn for_batch(n: usize, k: usize, experts: usize, latent: usize) -> Self {
        let (pairs, active) = (n * k, (n * k).min(experts));
        if latent % 32 == 0 && (active <= STAGED_MAX_ACTIVE_EXPERTS || pairs >= STAGED_MIN_PAIRS * experts) {
            ExpertForm::Staged
        } else {
            ExpertForm::Rows
        }
    }
}

/// The launch of a grouped expert kernel with `rows` output rows per expert, `warp_rows` of them per warp, and
/// `shared_bytes` of dynamic shared memory: one block per active-expert slot and group of `EXPERT_WARPS` warps.
fn expert_launch(n: usize, k: usize, experts: usize, rows: usize, warp_rows: usize, shared_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (active_slots(n, k, experts), rows.div_ceil(warp_rows * EXPERT_WARPS as usize) as u32, 1),
        block_dim: (32 * EXPERT_WARPS, 1, 1),
        shared_mem_bytes: shared_bytes,
    }
}

/// Blocks along the active-expert axis of the grouped expert kernels: at most `n k` pairs, at most `experts`.
fn active_slots(n: usize, k: usize, experts: usize) -> u32 {
    (n * k).min(experts) as u32
}

/// The grouped expert kernels read a row's codes 32 inputs (16 bytes) per lane at a time.
pub(crate) fn check_expert_width(what: &str, inputs: usize) -> Result<()> {
    if inputs == 0 || inputs % 32 != 0 {
        return Err(KernelError::InvalidInput(format!(
            "MoE {what} width {inputs}: the grouped MXFP4 kernels need a positive multiple of 32"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define name value` in `kernels/cuda/moe.cu` (and in `moe_route.cu`).
    fn defined(name: &str) -> u32 {
        crate::cuda::compile::source_define("moe.cu", name)
    }
    fn defined_in_route(name: &str) -> u32 {
        crate::cuda::compile::source_define("moe_route.cu", name)
    }

    #[test]
    fn the_launch_constants_match_the_kernel_source() {
        // A ring larger than the shared memory the launch gives would overrun it.
        assert_eq!(EXPERT_STAGES, defined("EXPERT_STAGES"));
        assert_eq!(GATE_UP_KB, defined("GATE_UP_KB"));
        assert_eq!(STAGED_KB, defined("STAGED_KB"));
        assert_eq!(STAGED_COLUMNS, defined("STAGED_COLUMNS"));
        assert_eq!(TILE_SCALE_BYTES, defined("TILE_SCALE_BYTES"));
        assert_eq!(DOWN_KB as u32, defined("DOWN_KB"));
        assert_eq!(EXPERT_WARPS, defined("MMA_WARPS"));
        assert_eq!(ROUTER_CLUSTER, defined_in_route("ROUTER_CLUSTER"));
        assert_eq!(ROUTER_TOKENS as u32, defined_in_route("ROUTER_TOKENS"));
    }

    #[test]
    fn batches_tile_the_router_where_they_read_its_weights_often() {
        let d = 7168;
        assert!(!router_tiles_tokens(1, 896, d), "one token reads the weights once");
        assert!(router_tiles_tokens(2, 896, d), "K3's 12.8 MB router at two tokens");
        assert!(!router_tiles_tokens(16, 64, d), "k3-mini's 0.9 MB router at 16 tokens");
        assert!(router_tiles_tokens(32, 64, d) && router_tiles_tokens(64, 64, d));
    }

    #[test]
    fn the_grouping_windows_fit_their_masks_in_shared_memory() {
        // k3-mini's 64 experts take every decode and verify batch in one window; K3's 896 one of up to 352 tokens.
        assert_eq!(group_window_words(64, 64).unwrap(), 2);
        assert_eq!(group_window_words(1, 896).unwrap(), 1);
        assert_eq!(group_window_words(64, 896).unwrap(), 2);
        assert_eq!(group_window_words(4096, 896).unwrap(), 11);
        for (n, e) in [(64, 64), (4096, 896), (100_000, 64)] {
            assert!((2 + group_window_words(n, e).unwrap()) * e * 4 <= GROUP_SHARED_LIMIT, "{n} tokens, {e} experts");
        }
        assert!(group_window_words(64, 6000).is_err());
    }

    #[test]
    fn the_staged_form_takes_few_active_experts_or_many_pairs_per_expert() {
        let (k3_mini, k3, k, latent) = (64, 896, 16, 3584);
        // k3-mini has 64 experts: every batch takes the staged form, and from batch 32 (8 pairs per expert) it is
        // the token loads it saves that matter.
        for n in [1, 2, 8, 16, 32, 64] {
            assert_eq!(ExpertForm::for_batch(n, k, k3_mini, latent), ExpertForm::Staged, "k3-mini batch {n}");
        }
        // K3's 896 experts: up to 64 pairs (batch 4) a launch of few waves; from batch 8 (about 1.1 pairs per active
        // expert) the row form, until 8 pairs per expert on average.
        for n in [1, 4] {
            assert_eq!(ExpertForm::for_batch(n, k, k3, latent), ExpertForm::Staged, "K3 batch {n}");
        }
        for n in [5, 8, 64, 447] {
            assert_eq!(ExpertForm::for_batch(n, k, k3, latent), ExpertForm::Rows, "K3 batch {n}");
        }
        assert_eq!(ExpertForm::for_batch(448, k, k3, latent), ExpertForm::Staged);
        // The staged down projection needs whole pairs of 16-row tiles.
        assert_eq!(ExpertForm::for_batch(64, k, k3_mini, 48), ExpertForm::Rows);
    }
}
