// sparkd: the latent MoE's router, the grouping of its (token, slot) pairs by expert, and the weighted combine of the
// experts' outputs with the routed norm (the grouped expert kernels are in moe.cu).
//
// Invariants: the router is an fp32 island over the full hidden vector: sigmoid scores, the correction
// bias only selects, top-k ties go to the lowest expert index, chosen experts are listed ascending,
// weights come from the unbiased scores and are renormalised (in one launch, moe_router, or in two,
// moe_router_logits + moe_route, each with a form for batches that computes ROUTER_TOKENS tokens per warp: the same
// bits). The grouping's integer ORs and popcounts do not depend on the order threads run in. The k experts' bf16
// outputs are combined in fp32 in ascending expert order and rounded once (kernels/src/cpu/moe.rs), then normalised.
// A token's results never depend on the batch: fixed summation orders, no float atomics.
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

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

// router_dot for ROUTER_TOKENS tokens at once (rows x + t ldx, t < nt): each 16-byte chunk of the expert row is read
// once for all of them, so a batch reads the router weights ROUTER_TOKENS times less often (K3's 12.8 MB router was
// read once per token: 822 MB of L2 traffic per layer at batch 64). ROUTER_TILE_LOADS chunks per round keep the
// registers in bounds. Every token's products and sums run in router_dot's order (a lane's chunks ascending, the
// same butterfly), so its logit has router_dot's bits.
#define ROUTER_TOKENS 4
#define ROUTER_TILE_LOADS 4

__device__ __forceinline__ void router_dots(const __nv_bfloat16 *x, long ldx, int nt, const __nv_bfloat16 *wr, int d,
                                            int lane, float acc[ROUTER_TOKENS]) {
#pragma unroll
    for (int t = 0; t < ROUTER_TOKENS; t++) acc[t] = 0.0f;
    int vec = d % 8 == 0 ? d / 8 : 0;
    for (int c0 = lane; c0 < vec; c0 += 32 * ROUTER_TILE_LOADS) {
        uint4 wv[ROUTER_TILE_LOADS], xv[ROUTER_TOKENS][ROUTER_TILE_LOADS];
#pragma unroll
        for (int u = 0; u < ROUTER_TILE_LOADS; u++) {
            int c = c0 + 32 * u;
            if (c < vec) {
                wv[u] = ld_stream16((const uint4 *)wr + c);
#pragma unroll
                for (int t = 0; t < ROUTER_TOKENS; t++)
                    if (t < nt) xv[t][u] = ((const uint4 *)(x + t * ldx))[c];
            }
        }
#pragma unroll
        for (int u = 0; u < ROUTER_TILE_LOADS; u++) {
            if (c0 + 32 * u >= vec) break;
            unsigned int ws[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
            for (int t = 0; t < ROUTER_TOKENS; t++) {
                if (t >= nt) break;
                unsigned int xs[4] = {xv[t][u].x, xv[t][u].y, xv[t][u].z, xv[t][u].w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    acc[t] += __uint_as_float(xs[i] << 16) * __uint_as_float(ws[i] << 16);
                    acc[t] += __uint_as_float(xs[i] & 0xffff0000u) * __uint_as_float(ws[i] & 0xffff0000u);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < ROUTER_TOKENS; t++) {
        if (t >= nt) break;
        for (int c = vec * 8 + lane; c < d; c += 32) acc[t] += ld(x + t * ldx, c) * ld(wr, c);
        for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
    }
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

// moe_router_logits for batches: each warp takes ROUTER_TOKENS tokens of one expert (router_dots). grid = (ceil(E /
// warps), ceil(n / ROUTER_TOKENS)), blockDim 256. Arguments as moe_router_logits, plus n; the same bits.
extern "C" __global__ void moe_router_logits_tiled(const __nv_bfloat16 *h, const __nv_bfloat16 *w, float *logits,
                                                   int d, int E, int n) {
    kernel_entry();
    int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (e >= E) return;
    long t0 = (long)blockIdx.y * ROUTER_TOKENS;
    int nt = min(ROUTER_TOKENS, n - (int)t0);
    float acc[ROUTER_TOKENS];
    router_dots(h + t0 * d, d, nt, w + (long)e * d, d, lane, acc);
#pragma unroll
    for (int t = 0; t < ROUTER_TOKENS; t++)
        if (t < nt && lane == 0) logits[(t0 + t) * E + e] = acc[t];
}

// The per-token selection by one warp, from the sigmoid scores `score` and `choice` = score + bias (shared
// memory, E each; `choice` is consumed). out_idx: [k] chosen experts ascending; out_w: [k]; margin: one float.
// With `group` non-null (a step of one token, k <= 32) it also writes the grouping moe_group would write for the
// token (its experts ascending, pair j = slot j; a slot without an expert, -1, sorts first and is left out, as
// moe_group leaves it out), so that step needs no moe_group launch.
__device__ void route_select(const float *score, float *choice, int *out_idx, float *out_w, float *margin, int E,
                             int k, int renormalize, float scale, int *group, int *pairs) {
    int lane = threadIdx.x & 31;
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

// moe_router for batches: each cluster routes ROUTER_TOKENS tokens (router_dots: every expert row read once for
// them), and block 0's warp j selects for the cluster's token j. grid = (ROUTER_CLUSTER, ceil(n / ROUTER_TOKENS)),
// blockDim 256, clusters of (ROUTER_CLUSTER, 1, 1); dynamic shared memory 3 ROUTER_TOKENS E floats. Arguments as
// moe_router, plus n; never writes the grouping (batches take moe_group). The same bits as moe_router.
extern "C" __global__ void __cluster_dims__(ROUTER_CLUSTER, 1, 1) __launch_bounds__(256)
    moe_router_tiled(const __nv_bfloat16 *h, const __nv_bfloat16 *w, const float *bias, int *idx, float *wts,
                     float *margin, int d, int E, int k, int renormalize, float scale, int n) {
    kernel_entry();
    extern __shared__ float sm[];
    // own: this block's logits [ROUTER_TOKENS, E] at their expert index; score, choice: [ROUTER_TOKENS, E] each
    float *own = sm, *score = sm + ROUTER_TOKENS * E, *choice = sm + 2 * ROUTER_TOKENS * E;
    int rank = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    long t0 = (long)blockIdx.y * ROUTER_TOKENS;
    int nt = min(ROUTER_TOKENS, n - (int)t0);
    for (int e = rank + ROUTER_CLUSTER * warp; e < E; e += ROUTER_CLUSTER * warps) {
        float acc[ROUTER_TOKENS];
        router_dots(h + t0 * d, d, nt, w + (long)e * d, d, lane, acc);
#pragma unroll
        for (int t = 0; t < ROUTER_TOKENS; t++)
            if (t < nt && lane == 0) own[t * E + e] = acc[t];
    }
    cluster_sync();  // every block's logits are in its shared memory
    if (rank == 0)
        for (int i = threadIdx.x; i < nt * E; i += blockDim.x) {
            int e = i % E;
            score[i] = sigmoidf_(ld_cluster(own + i, (u32)(e % ROUTER_CLUSTER)));
            choice[i] = score[i] + bias[e];
        }
    cluster_sync();  // block 0 has read them (and its scores and choices are visible to its warps)
    if (rank != 0 || warp >= nt) return;
    long t = t0 + warp;
    route_select(score + warp * E, choice + warp * E, idx + t * k, wts + t * k, margin + t, E, k, renormalize, scale,
                 nullptr, nullptr);
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
// No float atomics anywhere; batch invariance of the expert kernels: see moe.cu.


// The token-window bitmasks of the pairs of tokens [t0, t1): mask[e words + w] bit b says that token t0 + 32 w + b
// chose expert e (a token chooses an expert at most once; a slot without an expert, -1, is left out). Integer ORs
// into shared memory, so the masks do not depend on the order the pairs land in. Ends with the masks complete.
__device__ __forceinline__ void window_masks(const int *idx, int t0, int t1, int k, int E, int words, u32 *mask) {
    for (int i = threadIdx.x; i < E * words; i += blockDim.x) mask[i] = 0u;
    __syncthreads();
    for (int p = t0 * k + threadIdx.x; p < t1 * k; p += blockDim.x) {
        int e = idx[p], tl = p / k - t0;
        if (e >= 0) atomicOr(&mask[e * words + (tl >> 5)], 1u << (tl & 31));
    }
    __syncthreads();
}

// The pairs of expert e in a window's masks.
__device__ __forceinline__ int window_count(const u32 *mask, int e, int words) {
    int c = 0;
    for (int w = 0; w < words; w++) c += __popc(mask[e * words + w]);
    return c;
}

// Groups the pairs by expert. grid = 1, blockDim 256; dynamic shared memory (2 + words) E ints: the tokens go in
// windows of 32 words (the host sizes words so that the masks fit). Two passes over the windows: the first counts
// each expert's pairs, then one warp scans the counts; the second places each pair at its expert's start plus the
// number of earlier tokens that chose the expert (a popcount of the mask bits below it), so the order within an
// expert is the token order. O(n k + E words) work with no searches: one small block, which the scheduler places
// beside the side lane's GEMM blocks.
extern "C" __global__ void moe_group(const int *idx, int n, int k, int E, int words, int *group, int *pairs) {
    kernel_entry();
    extern __shared__ int gsm[];
    int *count = gsm, *start = gsm + E;
    u32 *mask = (u32 *)(gsm + 2 * E);  // [E, words]
    const int span = 32 * words, lane = threadIdx.x & 31;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    for (int t0 = 0; t0 < n; t0 += span) {
        window_masks(idx, t0, min(n, t0 + span), k, E, words, mask);
        for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] += window_count(mask, e, words);
        __syncthreads();  // the counts are read before the next window's masks are cleared
    }
    if (threadIdx.x < 32) {
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
    __syncthreads();  // start[e]: where expert e's pairs of the first window go
    for (int t0 = 0; t0 < n; t0 += span) {
        int t1 = min(n, t0 + span);
        window_masks(idx, t0, t1, k, E, words, mask);
        for (int p = t0 * k + threadIdx.x; p < t1 * k; p += blockDim.x) {
            int e = idx[p], tl = p / k - t0;
            if (e < 0) continue;
            const u32 *m = mask + e * words;
            int below = __popc(m[tl >> 5] & ((1u << (tl & 31)) - 1u));
            for (int w = 0; w < (tl >> 5); w++) below += __popc(m[w]);
            pairs[start[e] + below] = p;
        }
        __syncthreads();  // every pair of the window is placed before the starts move on
        for (int e = threadIdx.x; e < E; e += blockDim.x) start[e] += window_count(mask, e, words);
        __syncthreads();
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
