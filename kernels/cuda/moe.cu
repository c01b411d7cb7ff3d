// sparkd: the latent MoE's router and routed experts (MXFP4 weights dequantised in the kernel).
//
// Invariants: the router is an fp32 island over the full hidden vector: sigmoid scores, the correction
// bias only selects, top-k ties go to the lowest expert index, chosen experts are listed ascending,
// weights come from the unbiased scores and are renormalised (in one launch, moe_router, or in two,
// moe_router_logits + moe_route: the same bits). An expert's gate/up outputs are rounded to bf16, SiTU'd and
// rounded again; its down output is rounded to bf16, then the k experts are combined in fp32 in ascending
// expert order and rounded once (kernels/src/cpu/moe.rs), then normalised.
// The expert kernels work per active expert over its grouped (token, slot) pairs (see "Grouped routed
// experts" below) on the tensor cores; a token's results never depend on the batch.
// MXFP4: two E2M1 codes per byte, element 2i in the low nibble; one E8M0 scale per 32 inputs;
// 0xFF is NaN (shared/reference/k3-architecture.md §2.8). On the device the experts are tiled, and the bits of each
// 32-bit word of codes permuted (kernels/src/cuda/expert_layout.rs).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

typedef unsigned char u8;

// The router's fp32 logit of one expert row `wr` for one token row `x` (d inputs), by one warp; every lane gets it.
// Each lane reads 8 inputs (16 bytes) at a time, ROUTER_LOADS of them in flight (a K3 row of 7168 inputs takes four
// such rounds: one warp's dot product is bound by memory latency, not bandwidth; 16 in flight were faster at batch
// 1-8 but took 182 registers, and the fewer blocks per SM cost more at batch 64), and sums them in element order;
// the lanes' partials meet in a fixed butterfly, so a token's logit never depends on the batch or on which kernel
// computes it.
#define ROUTER_LOADS 8

__device__ __forceinline__ float router_dot(const __nv_bfloat16 *x, const __nv_bfloat16 *wr, int d, int lane) {
    float acc = 0.0f;
    int vec = d % 8 == 0 ? d / 8 : 0;  // 16-byte chunks (rows start 16-byte aligned when d is a multiple of 8)
    for (int c0 = lane; c0 < vec; c0 += 32 * ROUTER_LOADS) {
        uint4 xv[ROUTER_LOADS], wv[ROUTER_LOADS];
#pragma unroll
        for (int u = 0; u < ROUTER_LOADS; u++) {
            int c = c0 + 32 * u;
            if (c < vec) {
                xv[u] = ((const uint4 *)x)[c];
                wv[u] = ld_stream16((const uint4 *)wr + c);
            }
        }
#pragma unroll
        for (int u = 0; u < ROUTER_LOADS; u++) {
            if (c0 + 32 * u >= vec) break;
            unsigned int xs[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w}, ws[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                acc += __uint_as_float(xs[i] << 16) * __uint_as_float(ws[i] << 16);
                acc += __uint_as_float(xs[i] & 0xffff0000u) * __uint_as_float(ws[i] & 0xffff0000u);
            }
        }
    }
    for (int c = vec * 8 + lane; c < d; c += 32) acc += ld(x, c) * ld(wr, c);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

// The router's fp32 logits, one warp per (token, expert): grid = (ceil(E / warps), n), blockDim 256.
// h: [n, d]; w: [E, d]; logits: [n, E]. (Split from moe_route so that E dot products run across the whole
// GPU instead of in one block per token.)
extern "C" __global__ void moe_router_logits(const __nv_bfloat16 *h, const __nv_bfloat16 *w, float *logits, int d,
                                             int E) {
    kernel_entry();
    int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (e >= E) return;
    float acc = router_dot(h + (long)blockIdx.y * d, w + (long)e * d, d, lane);
    if (lane == 0) logits[(long)blockIdx.y * E + e] = acc;
}

// The per-token selection by warp 0 of a block, from the sigmoid scores `score` and `choice` = score + bias (shared
// memory, E each; `choice` is consumed). out_idx: [k] chosen experts ascending; out_w: [k]; margin: one float.
// With `group` non-null (a step of one token, k <= 32) it also writes the grouping moe_group would write for the
// token (its experts ascending, pair j = slot j; a slot without an expert, -1, sorts first and is left out, as
// moe_group leaves it out), so that step needs no moe_group launch.
__device__ void route_select(const float *score, float *choice, int *out_idx, float *out_w, float *margin, int E,
                             int k, int renormalize, float scale, int *group, int *pairs) {
    int lane = threadIdx.x;
    // k passes of "best remaining" (larger choice, then lower index) by one warp: lane L scans experts L, L + 32,
    // ... in order, then a butterfly keeps the larger choice, ties to the lower index: a strict total order, so
    // every lane gets the expert a sequential scan would. The owner lane marks the chosen entry -inf.
    // With k <= 32 lane j keeps the j-th choice in a register, and the sort and weights below run on registers and
    // shuffles (every access to out_idx / out_w in global memory would be a dependent round trip).
    const bool in_lanes = k <= 32;
    int mine = -1;
    float last = 0.0f;
    for (int j = 0; j < k; j++) {
        float bv = -INF_F;
        int bi = -1;
        for (int e = lane; e < E; e += 32) {
            float v = choice[e];
            if (v != -INF_F && (bi < 0 || v > bv)) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
        }
        if (in_lanes) {
            if (lane == j) mine = bi;
        } else if (lane == 0) {
            out_idx[j] = bi;
        }
        last = bv;
        if (bi >= 0 && (bi & 31) == lane) choice[bi] = -INF_F;
    }
    float next = -INF_F;
    for (int e = lane; e < E; e += 32) next = fmaxf(next, choice[e]);
    for (int o = 16; o > 0; o >>= 1) next = fmaxf(next, __shfl_xor_sync(0xffffffffu, next, o));
    if (lane == 0) *margin = k < E ? last - next : 0.0f;
    if (in_lanes) {
        // Ascending expert order: a choice's rank is the number of smaller choices (they are distinct); then the
        // weights in that order, summed one after another as below.
        int rank = 0;
        for (int l = 0; l < k; l++) {
            int other = __shfl_sync(0xffffffffu, mine, l);
            rank += lane < k && other < mine;
        }
        float sum = 0.0f, w = 0.0f;
        int sorted = -1;
        for (int j = 0; j < k; j++) {
            int src = __ffs(__ballot_sync(0xffffffffu, lane < k && rank == j)) - 1;
            int e = __shfl_sync(0xffffffffu, mine, src);
            float wj = score[e];
            sum += wj;
            if (lane == j) { w = wj; sorted = e; }
        }
        if (renormalize) {
            sum += 1e-20f;
            w = w / sum;
        }
        if (lane < k) {
            out_idx[lane] = sorted;
            out_w[lane] = w * scale;
        }
        if (group != nullptr) {
            const int active = __popc(__ballot_sync(0xffffffffu, lane < k && sorted >= 0)), a = lane - (k - active);
            if (lane < k && a >= 0) {
                group[1 + a] = sorted;   // the active experts, ascending
                group[1 + E + a] = a;    // where each one's single pair starts
                pairs[a] = lane;         // pair t k + j of token 0
            }
            if (lane == 0) {
                group[0] = active;
                group[1 + E + active] = active;
            }
        }
        return;
    }
    if (lane != 0) return;
    // Ascending expert order (insertion sort of k entries).
    for (int a = 1; a < k; a++) {
        int v = out_idx[a], b = a - 1;
        while (b >= 0 && out_idx[b] > v) { out_idx[b + 1] = out_idx[b]; b--; }
        out_idx[b + 1] = v;
    }
    float sum = 0.0f;
    for (int j = 0; j < k; j++) { out_w[j] = score[out_idx[j]]; sum += out_w[j]; }
    if (renormalize) {
        sum += 1e-20f;
        for (int j = 0; j < k; j++) out_w[j] = out_w[j] / sum;
    }
    for (int j = 0; j < k; j++) out_w[j] *= scale;
}

// grid = n tokens, blockDim 256; dynamic shared memory 2 * E floats.
// logits: [n, E] from moe_router_logits; bias: [E]; idx: [n, k] chosen experts ascending; wts: [n, k];
// margin: [n]; group / pairs: null, or for one token with k <= 32 moe_group's outputs (see route_select).
extern "C" __global__ void moe_route(const float *logits, const float *bias, int *idx, float *wts, float *margin,
                                     int E, int k, int renormalize, float scale, int *group, int *pairs) {
    kernel_entry();
    extern __shared__ float sm[];
    float *score = sm, *choice = sm + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        score[e] = sigmoidf_(logits[(long)blockIdx.x * E + e]);
        choice[e] = score[e] + bias[e];
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    long t = blockIdx.x;
    route_select(score, choice, idx + t * k, wts + t * k, margin + t, E, k, renormalize, scale, group, pairs);
}

#if __CUDA_ARCH__ >= 900
// ---- The router in one launch (Hopper and later: thread-block clusters) -------------------------------------
// moe_router_logits + moe_route for few experts: a cluster of ROUTER_CLUSTER blocks per token computes its logits
// (block r takes experts r, r + ROUTER_CLUSTER, ..., one warp each, with router_dot: the same logits), each into its
// own shared memory; after a cluster barrier block 0 reads them all through distributed shared memory and selects
// (route_select: the same selection). A second cluster barrier keeps the other blocks' shared memory alive until
// block 0 has read it. Same outputs as the two kernels, bit for bit.

#define ROUTER_CLUSTER 8  // blocks per token (the portable cluster size); Gpu::moe_route's ROUTER_CLUSTER

// grid = (ROUTER_CLUSTER, n), blockDim 256, clusters of (ROUTER_CLUSTER, 1, 1); dynamic shared memory 3 E floats.
// h: [n, d]; w: [E, d]; bias: [E]; idx: [n, k] chosen experts ascending; wts: [n, k]; margin: [n]; group / pairs:
// null, or for one token with k <= 32 moe_group's outputs (see route_select).
extern "C" __global__ void __cluster_dims__(ROUTER_CLUSTER, 1, 1) __launch_bounds__(256)
    moe_router(const __nv_bfloat16 *h, const __nv_bfloat16 *w, const float *bias, int *idx, float *wts,
               float *margin, int d, int E, int k, int renormalize, float scale, int *group, int *pairs) {
    kernel_entry();
    extern __shared__ float sm[];
    float *own = sm, *score = sm + E, *choice = sm + 2 * E;  // own: this block's logits at their expert index
    int rank = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    long t = blockIdx.y;
    for (int e = rank + ROUTER_CLUSTER * warp; e < E; e += ROUTER_CLUSTER * warps) {
        float v = router_dot(h + t * d, w + (long)e * d, d, lane);
        if (lane == 0) own[e] = v;
    }
    cluster_sync();  // every block's logits are in its shared memory
    if (rank == 0)
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            score[e] = sigmoidf_(ld_cluster(own + e, (u32)(e % ROUTER_CLUSTER)));
            choice[e] = score[e] + bias[e];
        }
    cluster_sync();  // block 0 has read them (and its score / choice are visible to its warp 0)
    if (rank != 0 || warp != 0) return;
    route_select(score, choice, idx + t * k, wts + t * k, margin + t, E, k, renormalize, scale, group, pairs);
}
#endif

// ---- Grouped routed experts ----------------------------------------------------------------------------------
// After the router, the (token, slot) pairs are grouped by expert on the device (moe_group; a step of one token
// takes the grouping its router wrote, see route_select), so that the expert
// kernels read an expert's MXFP4 weights once for all the tokens that chose it (follows the idea of vLLM's
// moe_align_block_size + fused_moe: sort the pairs by expert, then one weight pass per expert; our own code).
// Grids are sized from host-known bounds (min(n k, E) active-expert slots); blocks past the active count exit,
// so no host synchronisation is needed. A pair p = t * k + j names token t's j-th chosen expert.
//
// group layout (ints): [0] active experts A; [1, 1 + E) the active experts, ascending; [1 + E, 2 + E + A) the
// start of each active expert's pairs in `pairs` (A + 1 entries; the last is n k). pairs: [n k], grouped by
// expert, tokens ascending within an expert.
//
// No float atomics anywhere; batch invariance of the expert kernels: see below.

__device__ __forceinline__ u32 word_of(uint4 q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// The position of `e` in the ascending list row[0..k), or -1.
__device__ __forceinline__ int find_expert(const int *row, int k, int e) {
    int lo = 0, hi = k;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (row[mid] < e) lo = mid + 1; else hi = mid;
    }
    return lo < k && row[lo] == e ? lo : -1;
}

// Groups the pairs by expert. grid = 1, blockDim 1024 (32 warps); dynamic shared memory 2 E ints, plus n k when
// `staged` (the choices are first copied into shared memory, so that the binary searches below are not dependent
// round trips to global memory).
// idx: [n, k] chosen experts, ascending per token. One warp per expert scans the tokens 32 at a time (a ballot
// ranks the hits), so the order within an expert is the token order.
extern "C" __global__ void moe_group(const int *idx_global, int n, int k, int E, int staged, int *group,
                                     int *pairs) {
    kernel_entry();
    extern __shared__ int gsm[];
    int *count = gsm, *start = gsm + E;
    const int *idx = idx_global;
    if (staged) {
        int *copy = gsm + 2 * E;
        for (int i = threadIdx.x; i < n * k; i += blockDim.x) copy[i] = idx_global[i];
        __syncthreads();
        idx = copy;
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int e = warp; e < E; e += warps) {
        int c = 0;
        for (int t0 = 0; t0 < n; t0 += 32) {
            int t = t0 + lane;
            bool hit = t < n && find_expert(idx + (long)t * k, k, e) >= 0;
            c += __popc(__ballot_sync(0xffffffffu, hit));
        }
        if (lane == 0) count[e] = c;
    }
    __syncthreads();
    if (warp == 0) {
        // Exclusive scans of the pair counts and of the active flags: each lane takes a contiguous run of experts.
        int per = (E + 31) / 32, lo = min(lane * per, E), hi = min(lo + per, E);
        int pairs_before = 0, active_before = 0;
        for (int e = lo; e < hi; e++) { pairs_before += count[e]; active_before += count[e] > 0; }
        int pi = pairs_before, ai = active_before;
        for (int o = 1; o < 32; o <<= 1) {
            int pu = __shfl_up_sync(0xffffffffu, pi, o), au = __shfl_up_sync(0xffffffffu, ai, o);
            if (lane >= o) { pi += pu; ai += au; }
        }
        int p = pi - pairs_before, a = ai - active_before;
        int *active = group + 1, *bounds = group + 1 + E;
        for (int e = lo; e < hi; e++) {
            start[e] = p;
            if (count[e] > 0) { active[a] = e; bounds[a] = p; a++; }
            p += count[e];
        }
        if (lane == 31) { group[0] = ai; bounds[ai] = pi; }
    }
    __syncthreads();
    for (int e = warp; e < E; e += warps) {
        if (count[e] == 0) continue;
        int pos = start[e];
        for (int t0 = 0; t0 < n; t0 += 32) {
            int t = t0 + lane;
            int j = t < n ? find_expert(idx + (long)t * k, k, e) : -1;
            u32 hits = __ballot_sync(0xffffffffu, j >= 0);
            if (j >= 0) pairs[pos + __popc(hits & ((1u << lane) - 1u))] = t * k + j;
            pos += __popc(hits);
        }
    }
}

// The weighted combine in slot order (ascending experts) and the routed RMSNorm, per token:
#define COMBINE_BATCH 4  // columns per thread whose loads are in flight together

// The combine over a window of `w` columns of token t (`y` at the window's first column of pair t k; rows D apart):
// combined[c] = bf(sum_j wt[j] y[t k + j, c]) (shared; `wt`: the token's k weights, read by every thread, so that
// no barrier waits for them); returns the thread's part of the sum of combined[c]^2. Each
// thread's columns c0 + u * blockDim.x, COMBINE_BATCH of them per pass with all their loads issued before the sums;
// every sum runs in the same order as one column at a time.
__device__ __forceinline__ float combine_window(const __nv_bfloat16 *y, const float *wt, long t, int k, int D, int w,
                                                float *combined) {
    float ss = 0.0f;
    for (int c0 = threadIdx.x; c0 < w; c0 += COMBINE_BATCH * blockDim.x) {
        float acc[COMBINE_BATCH];
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; u++) acc[u] = 0.0f;
#pragma unroll 16
        for (int j = 0; j < k; j++) {
            float v[COMBINE_BATCH];
#pragma unroll
            for (int u = 0; u < COMBINE_BATCH; u++) {
                int c = c0 + u * blockDim.x;
                v[u] = c < w ? ld(y, (t * k + j) * D + c) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < COMBINE_BATCH; u++) acc[u] += v[u] * wt[j];
        }
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c >= w) continue;
            float v = bf_round(acc[u]);
            combined[c] = v;
            ss += v * v;
        }
    }
    return ss;
}

// The thread's norm weights of its first pass of a window of `width` columns (c = threadIdx.x + u blockDim.x), loaded
// before the kernel's grid dependency wait (weights are never written by a kernel).
__device__ __forceinline__ void first_norm_weights(const __nv_bfloat16 *w, int width, float (&first)[COMBINE_BATCH]) {
#pragma unroll
    for (int u = 0; u < COMBINE_BATCH; u++) {
        int c = threadIdx.x + u * blockDim.x;
        first[u] = c < width ? ld(w, c) : 0.0f;
    }
}

// out[c] = bf(w[c] * bf(combined[c] * r)) over a window of `width` columns; the first pass's weights are `first`.
__device__ __forceinline__ void combine_norm_window(const float *combined, const __nv_bfloat16 *w, float r,
                                                    int width, __nv_bfloat16 *out,
                                                    const float (&first)[COMBINE_BATCH]) {
    for (int c0 = threadIdx.x; c0 < width; c0 += COMBINE_BATCH * blockDim.x) {
        float g[COMBINE_BATCH];
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            g[u] = c0 == (int)threadIdx.x ? first[u] : c < width ? ld(w, c) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < COMBINE_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c < width) out[c] = __float2bfloat16_rn(g[u] * bf_round(combined[c] * r));
        }
    }
}

// c = bf(sum_j wts[t, j] y[t k + j]); out[t] = bf(w * bf(c * rsqrt(mean(c^2) + eps))).
// grid = n tokens, blockDim 512; dynamic shared memory D floats. y: [n k, D]; wts: [n, k]; out: [n, D].
extern "C" __global__ void moe_combine_norm(const __nv_bfloat16 *y, const float *wts, const __nv_bfloat16 *w,
                                            __nv_bfloat16 *out, int k, int D, float eps) {
    float first[COMBINE_BATCH];
    first_norm_weights(w, D, first);
    kernel_entry();
    extern __shared__ float combined[];
    long t = blockIdx.x;
    float ss = block_sum(combine_window(y, wts + t * k, t, k, D, D, combined));
    combine_norm_window(combined, w, 1.0f / sqrtf(ss / (float)D + eps), D, out + t * D, first);
}

#if __CUDA_ARCH__ >= 900
// moe_combine_norm over a cluster of COMBINE_CLUSTER blocks per token (Hopper and later), as attn_res_norm_cluster in
// common.cu: each block combines one contiguous window of the columns, and the sum of squares is completed through
// distributed shared memory in rank order (another fixed order than moe_combine_norm's: the two differ by rounding).
#define COMBINE_CLUSTER 8  // Gpu::moe_combine_norm's COMBINE_CLUSTER

// grid = (COMBINE_CLUSTER, n), clusters of (COMBINE_CLUSTER, 1, 1), blockDim 128; dynamic shared memory
// ceil(D / COMBINE_CLUSTER) floats. Arguments as moe_combine_norm.
extern "C" __global__ void __cluster_dims__(COMBINE_CLUSTER, 1, 1) __launch_bounds__(128)
    moe_combine_norm_cluster(const __nv_bfloat16 *y, const float *wts, const __nv_bfloat16 *w, __nv_bfloat16 *out,
                             int k, int D, float eps) {
    const int span = (D + COMBINE_CLUSTER - 1) / COMBINE_CLUSTER, lo = min((int)blockIdx.x * span, D);
    const int width = min(lo + span, D) - lo;  // this block's columns [lo, lo + width)
    float first[COMBINE_BATCH];
    first_norm_weights(w + lo, width, first);
    kernel_entry();
    extern __shared__ float combined[];
    __shared__ float ss_part;
    long t = blockIdx.y;
    float ss = block_sum(combine_window(y + lo, wts + t * k, t, k, D, width, combined));
    if (threadIdx.x == 0) ss_part = ss;
    cluster_sync();  // every block's sum of squares is in its shared memory
    float r = 1.0f / sqrtf(cluster_sum<COMBINE_CLUSTER>(&ss_part) / (float)D + eps);
    combine_norm_window(combined, w + lo, r, width, out + t * D + lo, first);
    cluster_sync();  // no block leaves while another may still read its shared memory
}
#endif

// ---- Grouped routed experts on the tensor cores -------------------------------------------------------------
// An active expert's outputs for all its grouped pairs, with the dot products on mma.sync m16n8k16 (bf16 in,
// fp32 accumulate): the MXFP4 weights are dequantised to bf16 in registers (code * scale is exact in bf16, which
// shares fp32's exponent range) and multiplied against the expert's tokens 8 at a time, so a weight costs its
// dequantisation once per chunk of up to 24 tokens. (The tile mapping follows the idea of kernels/cuda/gemm.cu; the
// dequantisation into MMA fragments is our own.)
//
// Layout: a warp owns a 16-row tile of one expert's matrix; lane (g = lane / 4, t = lane % 4) holds rows g and
// g + 8. K runs in blocks of 4 MXFP4 groups (128 inputs); in a block, thread t takes group 4 b + t whole
// (16 bytes of codes and one scale per row, one 128-bit load per row). The weights are stored tiled
// (kernels/src/cuda/expert_layout.rs): a (tile, block) is one contiguous 1 KB chunk of codes, so the warp's
// loads of a block are 1 KB in address order. A word of 8 codes feeds 2 MMAs: codes
// 2i and 2i + 1 share one bf16x2 (word_codes_bf16x2), so MMA h of the word takes codes (4h, 4h + 1) as k-slots
// {2t, 2t + 1} and (4h + 2, 4h + 3) as {2t + 8, 2t + 9}, and the B fragment takes the token's inputs with the same
// indices, which are the 32-bit words of its 16-byte load as they are: each MMA is the plain dot over 16 of the
// inputs.
//
// Cost: every byte of codes becomes two bf16 once per chunk of tokens, in 9 integer instructions and 4 bf16x2
// multiplies per 8 weights (through fp16 and fp32 it took 36, and bound the kernels at batch 1-8). At batch 1 the
// kernels are bound by instruction issue (BENCHMARKS.md, tenth session), so these instructions are the cost.
//
// Batch invariance: an MMA output depends only on its row of A and column of B (the skinny GEMM relies on the
// same property), a token's column sees the same MMAs in the same order (blocks ascending, then words, then h)
// whatever column or chunk it lands in, and padding columns hold zeros. So a token's result does not depend on
// which other tokens share its experts.

#define MMA_WARPS 4   // 16-row tiles per block
#define TILE_CODE_BYTES 1024  // codes of a (16-row tile, 128-input block) chunk (expert_layout.rs)
#define TILE_SCALE_BYTES 64   // scale bytes of a chunk

// The first chunk of the tile holding row0 of expert e's matrix of `rows` rows and `groups` 32-input groups: an
// expert's matrix is ceil(rows / 16) tiles of ceil(groups / 4) chunks.
__device__ __forceinline__ long tile_index(long e, int row0, int rows, int groups) {
    long quads = (groups + 3) / 4;
    return (e * ((rows + 15) / 16) + row0 / 16) * quads;
}
// Byte offsets in a chunk of thread (g, t)'s group of row g + 8 r: its 16 bytes of codes, its scale byte.
__device__ __forceinline__ int tile_code_offset(int g, int r, int t) { return (g + 8 * r) * 64 + t * 16; }
__device__ __forceinline__ int tile_scale_offset(int g, int r, int t) { return (g + 8 * r) * 4 + t; }
#define GATE_UP_KB 2  // K blocks per step of moe_gate_up: a ring step holds 2 matrices x 2 rows x 2 x 16 bytes per lane
#define DOWN_KB 2     // the same for moe_down (one matrix): 64 bytes per lane in flight
#define DOWN_BLOCKS_PER_SM 5  // moe_down's occupancy target (96 registers; moe_down_full spills none)

// The eight E2M1 codes of one stored word as four bf16x2 of code * 2^-126, exactly: register i holds code 2i (low
// half) and code 2i + 1 (high half), the pairs the token's inputs come in. A code's magnitude bits (e1 e0 m) land on
// the bf16 exponent's two low bits and the top mantissa bit, which makes the bf16 number code * 2^-126 (code 0.5
// lands on the subnormal 2^-127), and its sign on the sign bit. The codes' bits are stored permuted within each word
// (expert_layout.rs, CODE_BIT_SOURCE; kernels/bench/code_bit_order.py derives it), so that this takes 9 integer
// instructions (11 for the checkpoint's nibble order) and the inputs need no byte permutes: registers 0 and 1 are
// the word rotated by 13 and 8 bits, then masked; registers 2 and 3 come from one blend `u` of the word and the
// word shifted left by 2 (CODE_BLEND_MASK picks the word's own bits), rotated by 3 and 0 bits, then masked.
#define CODE_BLEND_MASK 0x11501150u
__device__ __forceinline__ void word_codes_bf16x2(u32 w, u32 out[4]) {
    const u32 keep = 0x81C081C0u;  // per half: sign, exponent bits 1-0, top mantissa bit
    u32 u;  // (w & CODE_BLEND_MASK) | ((w << 2) & ~CODE_BLEND_MASK) as one LOP3 (ptxas splits the C form in two)
    asm("lop3.b32 %0, %1, %2, %3, 0xD8;" : "=r"(u) : "r"(w << 2), "r"(w), "n"(CODE_BLEND_MASK));
    out[0] = __funnelshift_l(w, w, 13) & keep;
    out[1] = __funnelshift_l(w, w, 8) & keep;
    out[2] = __funnelshift_l(u, u, 3) & keep;
    out[3] = u & keep;
}

// a * b per bf16 half, exactly when the product is a bf16 (fma with -0, which keeps the sign of a zero product).
__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// 2^126 in both bf16 halves: word_codes_bf16x2's output times it is the plain E2M1 value.
#define BF16X2_2P126 0x7E807E80u

// The bf16x2 factor (both halves) that turns word_codes_bf16x2's code * 2^-126 into code * 2^(b - 127) for the E8M0
// byte b. Narrow (b <= 128): 2^(b - 1), one multiply. Wide (some scale of the step is larger): the codes are first
// multiplied by 2^126 and this is 2^(b - 127) (b = 0: the subnormal 2^-127). 0xFF is NaN either way. Every
// product is exact, so both give the same bf16 weights.
__device__ __forceinline__ u32 scale_bf16x2(u32 b, bool wide) {
    if (!wide) return b * 0x00800080u + 0x3F003F00u;  // (b + 126) << 7 in both halves (b <= 128 here)
    u32 h = b == 0xFFu ? 0x7FC0u : b == 0u ? 0x0040u : b << 7;
    return h | (h << 16);
}

// One step of mma_rows_pass: the KB blocks of codes `cur` (scale bytes `cs`) of this step s against the NT
// n-tiles' inputs x (null for a padding column unless FULL). WIDE: some scale of the warp's step exceeds 2^1 (see
// scale_bf16x2). FULL: the matrix's groups fill every step (groups % (4 KB) == 0, as at K3's widths), so no input
// is past the row, and every pointer is valid (a padding column reads a real token, whose results are never
// stored): no masks.
template <int NM, int NT, int KB, bool WIDE, bool FULL>
__device__ __forceinline__ void mma_step(const uint4 cur[NM][2][KB], const u32 cs[NM][2][KB],
                                     const __nv_bfloat16 *const x[NT], int s, int t, int groups,
                                     float acc[NM][NT][4]) {
#pragma unroll
    for (int blk = 0; blk < KB; blk++) {
        int grp = 4 * (KB * s + blk) + t;
        u32 sx[NM][2];
#pragma unroll
        for (int m = 0; m < NM; m++)
#pragma unroll
            for (int r = 0; r < 2; r++) sx[m][r] = scale_bf16x2(cs[m][r][blk], WIDE);
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 a[NM][2][4];  // [matrix][row g / g + 8][codes (i, i + 4)]
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    word_codes_bf16x2(word_of(cur[m][r][blk], w), a[m][r]);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        if constexpr (WIDE) a[m][r][i] = bf16x2_mul(a[m][r][i], BF16X2_2P126);
                        a[m][r][i] = bf16x2_mul(a[m][r][i], sx[m][r]);
                    }
                }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                uint4 xv = FULL || (x[nt] != nullptr && grp < groups) ? *(const uint4 *)(x[nt] + grp * 32 + w * 8)
                                                                       : make_uint4(0u, 0u, 0u, 0u);  // [8 inputs]
                // Inputs (0, 1), (2, 3), (4, 5), (6, 7), as the codes.
#pragma unroll
                for (int m = 0; m < NM; m++) {
                    mma_bf16(acc[m][nt], a[m][0][0], a[m][1][0], a[m][0][1], a[m][1][1], xv.x, xv.y);
                    mma_bf16(acc[m][nt], a[m][0][2], a[m][1][2], a[m][0][3], a[m][1][3], xv.z, xv.w);
                }
            }
        }
    }
}

// mma_step in the form the warp's step needs: WIDE when some of its scales exceed 2^1.
template <int NM, int NT, int KB, bool FULL>
__device__ __forceinline__ void mma_step_scaled(const uint4 cur[NM][2][KB], const u32 cs[NM][2][KB],
                                                const __nv_bfloat16 *const x[NT], int s, int t, int groups,
                                                float acc[NM][NT][4]) {
    bool wide = false;
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int blk = 0; blk < KB; blk++) wide |= cs[m][r][blk] > 128u;
    // Real checkpoints never need the wide path (weights of 4 and more); it keeps large scales exact.
    if (__any_sync(0xffffffffu, wide)) mma_step<NM, NT, KB, true, FULL>(cur, cs, x, s, t, groups, acc);
    else mma_step<NM, NT, KB, false, FULL>(cur, cs, x, s, t, groups, acc);
}

// This thread's B column of each n-tile: pair g of the tile, row pairs[.] / div of `in` (`width` bf16). Past the
// `count` pairs (a padding column, whose results are never stored) the last pair's row when FULL, else null.
template <int NT, bool FULL>
__device__ __forceinline__ void pair_inputs(const __nv_bfloat16 *x[NT], const __nv_bfloat16 *in, const int *pairs,
                                            int count, int div, int width, int g) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        int c = nt * 8 + g;
        if (FULL) x[nt] = in + (long)(pairs[min(c, count - 1)] / div) * width;
        else x[nt] = c < count ? in + (long)(pairs[c] / div) * width : nullptr;
    }
}

// The register pass of a 16-row tile of NM matrices (NM = 2: gate and up) over the pairs[0..count) (count <= 8 NT)
// of one expert, KB blocks of 128 inputs per step: the next step's codes are loaded into registers during this one.
// rows[m]: this thread's 16 bytes of row g of matrix m in the tile's first chunk (row g + 8 is 512 bytes on);
// scales[m]: the tile's first chunk of scales of matrix m. Chunks past the matrix's groups read as zeros; rows past
// the matrix are the tile's zero padding (expert_layout.rs).
// The B column of this thread is pair g of each 8-pair tile: row pairs[.] / div of `in`, `width` (= 32 groups) bf16
// wide. acc[m][nt]: the MMA accumulators of n-tile nt.
template <int NM, int NT, int KB, bool FULL>
__device__ __forceinline__ void mma_rows_pass(const u8 *const rows[NM], const u8 *const scales[NM], int g, int t,
                                              int groups, const __nv_bfloat16 *in, const int *pairs, int count,
                                              int div, int width, float acc[NM][NT][4]) {
    int steps = (groups + 4 * KB - 1) / (4 * KB);
    uint4 q[NM][2][KB];
    u32 sb[NM][2][KB];
    auto load = [&](int s) {
#pragma unroll
        for (int blk = 0; blk < KB; blk++) {
            long chunk = KB * s + blk;
            bool ok = FULL || 4 * chunk + t < groups;
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    q[m][r][blk] = ok ? ld_stream16(rows[m] + chunk * TILE_CODE_BYTES + r * 512) : make_uint4(0u, 0u, 0u, 0u);
                    sb[m][r][blk] = ok ? (u32)__ldg(scales[m] + chunk * TILE_SCALE_BYTES + tile_scale_offset(g, r, t)) : 0u;
                }
        }
    };
    load(0);  // before the pairs are looked up: the codes are the long wait
    const __nv_bfloat16 *x[NT];
    pair_inputs<NT, FULL>(x, in, pairs, count, div, width, g);
    for (int s = 0; s < steps; s++) {
        uint4 cur[NM][2][KB];
        u32 cs[NM][2][KB];
#pragma unroll
        for (int blk = 0; blk < KB; blk++)
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    cur[m][r][blk] = q[m][r][blk];
                    cs[m][r][blk] = sb[m][r][blk];
                }
        if (s + 1 < steps) load(s + 1);
        mma_step_scaled<NM, NT, KB, FULL>(cur, cs, x, s, t, groups, acc);
    }
}

// ---- The weight ring: cp.async copies of the next steps' weights into shared memory ----------------------------
// The ring pass streams a warp's tile through a private ring of EXPERT_STAGES steps in shared memory: a step's codes
// and scales are copied by cp.async (LDGSTS: no registers held while in flight), EXPERT_STAGES - 1 steps ahead of
// the one being multiplied. It holds no next step in registers, which lets moe_gate_up run 4 blocks per SM without
// spills (the register pass needs 168 registers there). A lane reads back exactly the 16-byte pieces of codes it
// copied itself; the scales of a step are copied as whole 4-byte words shared by the warp's lanes, so every step
// starts with a __syncwarp (which also orders the refill of the slot read in the step before). (The multistage
// cp.async pipeline follows the idea of CUTLASS's multistage mainloop; here each warp owns its ring, so no block
// barrier is needed.)
#define EXPERT_STAGES 3  // Gpu's EXPERT_STAGES (moe_ops.rs): steps per warp in the ring

// A ring step of NM matrices and KB blocks: codes [NM][2 rows][KB][32 lanes][16 B], then scales [NM][KB][64 B] (the
// chunks' scale bytes as stored, rows g + 8 r at (g + 8 r) * 4 + t).
template <int NM, int KB>
struct RingStep {
    static constexpr int CODES = NM * 2 * KB * 512;
    static constexpr int BYTES = CODES + NM * KB * TILE_SCALE_BYTES;
};
// Shared memory per warp (moe_ops.rs derives the same from GATE_UP_KB, TILE_SCALE_BYTES and EXPERT_STAGES).
#define RING_WARP_BYTES (EXPERT_STAGES * RingStep<2, GATE_UP_KB>::BYTES)

// mma_rows_pass through the warp's ring (`ring`: RING_WARP_BYTES of shared memory); the same arguments otherwise,
// and the same MMAs in the same order. The slots and the sources of the next copy are bumped once per step; every
// per-block, per-matrix and per-row offset is a constant that the instructions' addresses take.
template <int NM, int NT, int KB>
__device__ __forceinline__ void mma_ring_pass(u8 *ring, const u8 *const rows[NM], const u8 *const scales[NM], int g,
                                              int t, int groups, const __nv_bfloat16 *in, const int *pairs, int count,
                                              int div, int width, float acc[NM][NT][4]) {
    using Step = RingStep<NM, KB>;
    constexpr int SCALE_WORDS = KB * TILE_SCALE_BYTES / 4;  // per matrix and step
    static_assert(SCALE_WORDS <= 32, "one scale word per lane and matrix");
    const int lane = g * 4 + t, steps = (groups + 4 * KB - 1) / (4 * KB), quads = (groups + 3) / 4;
    // Chunk c holds this thread's group 4 c + t while c < live_chunks; scale word `lane` of a step lies in
    // chunk KB s + lane / 16.
    const int live_chunks = (groups - t + 3) / 4, scale_chunk = lane / (TILE_SCALE_BYTES / 4);
    constexpr int LAST_SLOT = (EXPERT_STAGES - 1) * Step::BYTES;
    const u32 first_slot = (u32)__cvta_generic_to_shared(ring);
    const u8 *code_src[NM], *scale_src[NM];  // the next step to copy: its chunk KB s of each matrix
#pragma unroll
    for (int m = 0; m < NM; m++) {
        code_src[m] = rows[m];
        scale_src[m] = scales[m] + lane * 4;
    }
    int next = 0;  // the step that code_src and scale_src point at
    // Copies step `next` into `slot` (past the last step: nothing), then closes its group, so that the group count
    // stays one per step.
    auto issue = [&](u32 slot) {
        if (next < steps) {
            u32 code_bytes[KB];
#pragma unroll
            for (int blk = 0; blk < KB; blk++) code_bytes[blk] = KB * next + blk < live_chunks ? 16u : 0u;
            const u32 dst = slot + lane * 16;
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int blk = 0; blk < KB; blk++)
                        cp_async16_shared(dst + ((m * 2 + r) * KB + blk) * 512,
                                          code_src[m] + blk * TILE_CODE_BYTES + r * 512, code_bytes[blk]);
            if (lane < SCALE_WORDS) {
                const u32 scale_bytes = KB * next + scale_chunk < quads ? 4u : 0u;
#pragma unroll
                for (int m = 0; m < NM; m++)
                    cp_async4_shared(slot + Step::CODES + m * KB * TILE_SCALE_BYTES + lane * 4, scale_src[m],
                                     scale_bytes);
            }
#pragma unroll
            for (int m = 0; m < NM; m++) {
                code_src[m] += KB * TILE_CODE_BYTES;
                scale_src[m] += KB * TILE_SCALE_BYTES;
            }
            next++;
        }
        cp_async_commit();
    };
    __syncwarp();  // every lane is done with the ring of the pass before
#pragma unroll
    for (int s = 0; s < EXPERT_STAGES - 1; s++) issue(first_slot + s * Step::BYTES);
    const __nv_bfloat16 *x[NT];
    pair_inputs<NT, false>(x, in, pairs, count, div, width, g);
    // Byte offsets in the ring of the slot of step s (read) and of the slot of step s - 1, which step
    // s + EXPERT_STAGES - 1 refills.
    int read = 0, refill = LAST_SLOT;
    for (int s = 0; s < steps; s++) {
        cp_async_wait<EXPERT_STAGES - 2>();  // this lane's copies of step s have landed
        __syncwarp();                        // and every lane's: the shared scale words are in
        issue(first_slot + refill);          // every lane has read the slot of step s - 1
        const u32 codes = first_slot + read + lane * 16;
        const u32 scales_at = first_slot + read + Step::CODES + tile_scale_offset(g, 0, t);
        uint4 cur[NM][2][KB];
        u32 cs[NM][2][KB];
#pragma unroll
        for (int blk = 0; blk < KB; blk++)
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    cur[m][r][blk] = ld_shared16(codes + ((m * 2 + r) * KB + blk) * 512);
                    // row g + 8 r: tile_scale_offset(g, r, t)
                    cs[m][r][blk] = ld_shared_u8(scales_at + (m * KB + blk) * TILE_SCALE_BYTES + r * 32);
                }
        refill = read;
        read = read == LAST_SLOT ? 0 : read + Step::BYTES;
        mma_step_scaled<NM, NT, KB, false>(cur, cs, x, s, t, groups, acc);
    }
}

// The grouping entries of the block's active-expert slot (blockIdx.x) in one round trip with the active count:
// expert e and its pairs [p, end). False when the slot is idle (its entries are then unused).
__device__ __forceinline__ bool expert_slot(const int *group, int E, int &e, int &p, int &end) {
    int slot = blockIdx.x;
    int active = group[0];
    e = group[1 + slot], p = group[1 + E + slot], end = group[2 + E + slot];
    return slot < active;
}

// The MMA accumulators of NM tiles and NT n-tiles, zeroed.
template <int NM, int NT>
__device__ __forceinline__ void zero_acc(float acc[NM][NT][4]) {
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][nt][e] = 0.0f;
}

// Gate/up + SiTU of one 16-row tile for pairs[0..count), count <= 8 NT (see moe_gate_up).
template <int NT, int KB>
__device__ __forceinline__ void gate_up_mma_chunk(u8 *ring, const u8 *const rows[2], const u8 *const scales[2],
                                                  int g, int t, int groups, const __nv_bfloat16 *z, const int *pairs,
                                                  int count, int k, int D, __nv_bfloat16 *a, int I, int row0,
                                                  float beta, float lbeta) {
    float acc[2][NT][4];
    zero_acc<2, NT>(acc);
    mma_ring_pass<2, NT, KB>(ring, rows, scales, g, t, groups, z, pairs, count, k, D, acc);
    // c0, c1: row g, pairs 2t, 2t + 1 of the tile; c2, c3: row g + 8, the same pairs.
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int row = row0 + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
            if (row < I && c < count) {
                float gate = bf_round(acc[0][nt][e]), up = bf_round(acc[1][nt][e]);
                a[(long)pairs[c] * I + row] =
                    __float2bfloat16_rn((beta * tanhf(gate / beta) * sigmoidf_(gate)) * (lbeta * tanhf(up / lbeta)));
            }
        }
}

// The expert's pairs in chunks of up to 24: one pass of 3 n-tiles (1 K block per step, so that its accumulators fit
// without spills) for more than 16, else one of 2 or 1 n-tiles (KB blocks per step). Every chunk reads the tile's
// weights (from HBM once, then from the caches; a second pass comes only past 24 tokens on one expert). A token's
// column sees the same MMAs in the same order whatever the chunk's n-tiles or K blocks per step.
#define MMA_CHUNKS(CALL, KB, FULL)                       \
    for (int left = end - p; left > 0; left = end - p) { \
        int count = min(left, 24);                       \
        if (count > 16) CALL(3, 1, FULL);                \
        else if (count > 8) CALL(2, KB, FULL);           \
        else CALL(1, KB, FULL);                          \
        p += count;                                      \
    }

// Gate/up + SiTU per active expert: a[p, r] = bf(SiTU(bf(w1_e[r] z_t), bf(w3_e[r] z_t))) for every pair p = t k + j
// of expert e. The weights stream through each warp's ring (mma_ring_pass), which leaves it 128 registers without
// spills: 4 blocks per SM instead of the register pass's 3.
// grid = (min(n k, E), ceil(I / (16 MMA_WARPS))), blockDim 32 MMA_WARPS; dynamic shared memory MMA_WARPS
// RING_WARP_BYTES.
// z: [n, D]; w1/w3 tiled [E, I, D] codes and scales (expert_layout.rs); a: [n k, I]. D must be a multiple of 32.
// (Unlike moe_down, a form without masks for full widths was slower here: 1-3% at K3's routing, BENCHMARKS.md.)
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 4)
    moe_gate_up(const __nv_bfloat16 *z, const u8 *w1p, const u8 *w1s, const u8 *w3p, const u8 *w3s,
                    const int *group, const int *pairs, __nv_bfloat16 *a, int k, int E, int D, int I, float beta,
                    float lbeta) {
    kernel_entry();
    int e, p, end;
    if (!expert_slot(group, E, e, p, end)) return;
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0 = (blockIdx.y * MMA_WARPS + (threadIdx.x >> 5)) * 16;
    if (row0 >= I) return;
    int groups = D / 32;
    extern __shared__ __align__(16) u8 rings[];
    u8 *ring = rings + (threadIdx.x >> 5) * RING_WARP_BYTES;
    long tile = tile_index(e, row0, I, groups), code = tile * TILE_CODE_BYTES + tile_code_offset(g, 0, t);
    const u8 *rows[2] = {w1p + code, w3p + code}, *scales[2] = {w1s + tile * TILE_SCALE_BYTES, w3s + tile * TILE_SCALE_BYTES};
#define GATE_UP_MMA(NT, KB, FULL) \
    gate_up_mma_chunk<NT, KB>(ring, rows, scales, g, t, groups, z, pairs + p, count, k, D, a, I, row0, beta, lbeta)
    MMA_CHUNKS(GATE_UP_MMA, GATE_UP_KB, false)
#undef GATE_UP_MMA
}

// The down projection's outputs of NM consecutive 16-row tiles from row0 (output channels below D) for the chunk's
// pairs[0..count): c0, c1 are row g of pairs 2t, 2t + 1 of an n-tile, c2, c3 row g + 8.
template <int NM, int NT>
__device__ __forceinline__ void store_down(const float acc[NM][NT][4], const int *pairs, int count,
                                           __nv_bfloat16 *y, int D, int row0, int g, int t) {
#pragma unroll
    for (int m = 0; m < NM; m++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = row0 + 16 * m + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
                if (row < D && c < count) y[(long)pairs[c] * D + row] = __float2bfloat16_rn(acc[m][nt][e]);
            }
}

// Down projection of one 16-row tile (output channels) for pairs[0..count) (see moe_down).
template <int NT, int KB, bool FULL>
__device__ __forceinline__ void down_mma_chunk(const u8 *const rows[1], const u8 *const scales[1], int g, int t,
                                               int groups, const __nv_bfloat16 *act, const int *pairs, int count,
                                               int I, __nv_bfloat16 *y, int D, int row0) {
    float acc[1][NT][4];
    zero_acc<1, NT>(acc);
    mma_rows_pass<1, NT, KB, FULL>(rows, scales, g, t, groups, act, pairs, count, 1, I, acc);
    store_down<1, NT>(acc, pairs, count, y, D, row0, g, t);
}

// Down projection per active expert: y[p, c] = bf(w2_e[c] a[p]) for every pair p of expert e. Two K blocks per step
// and at most 96 registers (5 blocks per SM; no spills in moe_down_full): more warps in flight with fewer bytes
// each beat 4 blocks of 4 K blocks per step (H200, routed_expert_bandwidth: 111.2 -> 105.2 us at batch 8; at K3's
// routing 212 -> 202 at 8 and 1,185 -> 1,141 at 64; equal at batch 1; BENCHMARKS.md, tenth session).
// grid = (min(n k, E), ceil(D / (16 MMA_WARPS))), blockDim 32 MMA_WARPS.
// a: [n k, I]; w2 tiled [E, D, I] codes and scales (expert_layout.rs); y: [n k, D]. I must be a multiple of 32;
// moe_down_full takes the I that are multiples of 128 DOWN_KB (every step full, no masks).
template <bool FULL>
__device__ __forceinline__ void down_kernel(const __nv_bfloat16 *a, const u8 *w2p, const u8 *w2s, const int *group,
                                            const int *pairs, __nv_bfloat16 *y, int E, int D, int I) {
    kernel_entry();
    int e, p, end;
    if (!expert_slot(group, E, e, p, end)) return;
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0 = (blockIdx.y * MMA_WARPS + (threadIdx.x >> 5)) * 16;
    if (row0 >= D) return;
    int groups = I / 32;
    long tile = tile_index(e, row0, D, groups);
    const u8 *rows[1] = {w2p + tile * TILE_CODE_BYTES + tile_code_offset(g, 0, t)};
    const u8 *scales[1] = {w2s + tile * TILE_SCALE_BYTES};
#define DOWN_MMA(NT, KB, FULL) \
    down_mma_chunk<NT, KB, FULL>(rows, scales, g, t, groups, a, pairs + p, count, I, y, D, row0)
    MMA_CHUNKS(DOWN_MMA, DOWN_KB, FULL)
#undef DOWN_MMA
}
#define DOWN_ARGS                                                                                                  \
    const __nv_bfloat16 *a, const u8 *w2p, const u8 *w2s, const int *group, const int *pairs, __nv_bfloat16 *y,    \
        int E, int D, int I
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, DOWN_BLOCKS_PER_SM) moe_down(DOWN_ARGS) {
    down_kernel<false>(a, w2p, w2s, group, pairs, y, E, D, I);
}
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, DOWN_BLOCKS_PER_SM) moe_down_full(DOWN_ARGS) {
    down_kernel<true>(a, w2p, w2s, group, pairs, y, E, D, I);
}
// Down projection of two 16-row tiles (rows row0 .. row0 + 31) for pairs[0..count) through the warp's ring (see
// moe_down_tile_pairs).
template <int NT, int KB>
__device__ __forceinline__ void down_pair_mma_chunk(u8 *ring, const u8 *const rows[2], const u8 *const scales[2], int g,
                                                    int t, int groups, const __nv_bfloat16 *act, const int *pairs,
                                                    int count, int I, __nv_bfloat16 *y, int D, int row0) {
    float acc[2][NT][4];
    zero_acc<2, NT>(acc);
    mma_ring_pass<2, NT, KB>(ring, rows, scales, g, t, groups, act, pairs, count, 1, I, acc);
    store_down<2, NT>(acc, pairs, count, y, D, row0, g, t);
}

// Down projection as moe_down, with two 16-row tiles per warp streamed through its ring as moe_gate_up streams the
// gate and up tiles: the two tiles share every load of the token inputs. With many pairs per expert those loads, not
// the weights, bound moe_down (ncu at k3-mini's batch 64, 16 pairs per expert: L1 85% busy, DRAM 31%; BENCHMARKS.md,
// eleventh session). Each tile sees the MMAs of moe_down in the same order, so the results are the same bits.
// grid = (min(n k, E), D / (32 MMA_WARPS) rounded up), blockDim 32 MMA_WARPS; dynamic shared memory MMA_WARPS
// RING_WARP_BYTES. D must be a multiple of 32 (the host takes moe_down otherwise).
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 4) moe_down_tile_pairs(DOWN_ARGS) {
    kernel_entry();
    int e, p, end;
    if (!expert_slot(group, E, e, p, end)) return;
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int row0 = (blockIdx.y * MMA_WARPS + (threadIdx.x >> 5)) * 32;
    if (row0 >= D) return;
    int groups = I / 32;
    extern __shared__ __align__(16) u8 rings[];
    u8 *ring = rings + (threadIdx.x >> 5) * RING_WARP_BYTES;
    long tile = tile_index(e, row0, D, groups), quads = (groups + 3) / 4;  // the second tile follows the first
    long code = tile * TILE_CODE_BYTES + tile_code_offset(g, 0, t);
    const u8 *rows[2] = {w2p + code, w2p + code + quads * TILE_CODE_BYTES};
    const u8 *scales[2] = {w2s + tile * TILE_SCALE_BYTES, w2s + (tile + quads) * TILE_SCALE_BYTES};
#define DOWN_PAIR_MMA(NT, KB, FULL) \
    down_pair_mma_chunk<NT, KB>(ring, rows, scales, g, t, groups, a, pairs + p, count, I, y, D, row0)
    MMA_CHUNKS(DOWN_PAIR_MMA, GATE_UP_KB, false)
#undef DOWN_PAIR_MMA
}
#undef DOWN_ARGS
