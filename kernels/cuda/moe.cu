// sparkd: the latent MoE's router and routed experts (MXFP4 weights dequantised in the kernel).
//
// Invariants: the router is an fp32 island over the full hidden vector: sigmoid scores, the correction
// bias only selects, top-k ties go to the lowest expert index, chosen experts are listed ascending,
// weights come from the unbiased scores and are renormalised. An expert's gate/up outputs are rounded
// to bf16, SiTU'd and rounded again; its down output is rounded to bf16, then the k experts are
// combined in fp32 in ascending expert order and rounded once (kernels/src/cpu/moe.rs), then normalised.
// The expert kernels work per active expert over its grouped (token, slot) pairs (see "Grouped routed
// experts" below); a token's results never depend on the batch.
// MXFP4: two E2M1 codes per byte, element 2i in the low nibble; one E8M0 scale per 32 inputs;
// 0xFF is NaN (shared/reference/k3-architecture.md §2.8).
#include <cuda_bf16.h>

#define INF_F __int_as_float(0x7f800000)

typedef unsigned char u8;

__device__ __forceinline__ float ld(const __nv_bfloat16 *p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float bf_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float e8m0(u8 b) {
    if (b == 0xFF) return __int_as_float(0x7fc00000);
    if (b == 0) return __int_as_float(1 << 22);
    return __int_as_float((int)b << 23);
}

// The router's fp32 logits, one warp per (token, expert): grid = (ceil(E / warps), n), blockDim 256.
// h: [n, d]; w: [E, d]; logits: [n, E]. (Split from moe_route so that E dot products run across the whole
// GPU instead of in one block per token; each dot keeps the same lane striding and reduction order.)
extern "C" __global__ void moe_router_logits(const __nv_bfloat16 *h, const __nv_bfloat16 *w, float *logits, int d,
                                             int E) {
    int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (e >= E) return;
    const __nv_bfloat16 *x = h + (long)blockIdx.y * d;
    float acc = 0.0f;
    for (int c = lane; c < d; c += 32) acc += ld(x, c) * ld(w, (long)e * d + c);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) logits[(long)blockIdx.y * E + e] = acc;
}

// grid = n tokens, blockDim 256; dynamic shared memory 2 * E floats.
// logits: [n, E] from moe_router_logits; bias: [E]; idx: [n, k] chosen experts ascending; wts: [n, k];
// margin: [n].
extern "C" __global__ void moe_route(const float *logits, const float *bias, int *idx, float *wts, float *margin,
                                     int E, int k, int renormalize, float scale) {
    extern __shared__ float sm[];
    float *score = sm, *choice = sm + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        score[e] = sigmoidf_(logits[(long)blockIdx.x * E + e]);
        choice[e] = score[e] + bias[e];
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    int *out_idx = idx + (long)blockIdx.x * k;
    float *out_w = wts + (long)blockIdx.x * k;
    // k passes of "best remaining" (larger choice, then lower index); chosen entries are marked -inf.
    float last = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (choice[e] != -INF_F && (best < 0 || choice[e] > choice[best])) best = e;
        out_idx[j] = best;
        last = choice[best];
        choice[best] = -INF_F;
    }
    float next = -INF_F;
    for (int e = 0; e < E; e++) next = fmaxf(next, choice[e]);
    margin[blockIdx.x] = k < E ? last - next : 0.0f;
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


// ---- Grouped routed experts ----------------------------------------------------------------------------------
// After the router, the (token, slot) pairs are grouped by expert on the device (moe_group), so that the expert
// kernels read an expert's MXFP4 weights once for all the tokens that chose it (follows the idea of vLLM's
// moe_align_block_size + fused_moe: sort the pairs by expert, then one weight pass per expert; our own code).
// Grids are sized from host-known bounds (min(n k, E) active-expert slots); blocks past the active count exit,
// so no host synchronisation is needed. A pair p = t * k + j names token t's j-th chosen expert.
//
// group layout (ints): [0] active experts A; [1, 1 + E) the active experts, ascending; [1 + E, 2 + E + A) the
// start of each active expert's pairs in `pairs` (A + 1 entries; the last is n k). pairs: [n k], grouped by
// expert, tokens ascending within an expert.
//
// Batch invariance: a pair's dot products run in one warp, each lane over a fixed set of 32-input groups in a
// fixed order, then a fixed butterfly; nothing depends on which other tokens share the expert, so a token's
// result is bit-identical whatever the batch. No float atomics anywhere.

#define MOE_TOKENS 8            // tokens (pairs) per pass over the weights a lane holds
#define MOE_GROUPS_IN_FLIGHT 4  // 32-input groups of a row each lane loads before using the first

typedef unsigned int u32;

// E2M1 code (low four bits of `nibble`) as fp32: placing the three magnitude bits at bits 22-24 gives
// code * 2^-126 (codes 0 and 1 land on the subnormals 0 and 2^-127), and 2^126 scales it back exactly.
__device__ __forceinline__ float e2m1_value(u32 nibble) {
    return __uint_as_float(((nibble & 7u) << 22) | ((nibble & 8u) << 28)) * __int_as_float(0x7e800000);
}

__device__ __forceinline__ u32 word_of(uint4 q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// Eight dequantised weights (one 32-bit word of packed codes, element i in nibble i) times their scale.
__device__ __forceinline__ void dequant_word(u32 w, float s, float out[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = e2m1_value(w >> (4 * i)) * s;
}

// acc += dot(w[0..8), x[0..8)) with x eight bf16 values packed in a uint4, in element order.
__device__ __forceinline__ float dot8(const float w[8], uint4 x, float acc) {
    u32 v[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc = fmaf(w[2 * i], __uint_as_float(v[i] << 16), acc);
        acc = fmaf(w[2 * i + 1], __uint_as_float(v[i] & 0xffff0000u), acc);
    }
    return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The position of `e` in the ascending list row[0..k), or -1.
__device__ __forceinline__ int find_expert(const int *row, int k, int e) {
    int lo = 0, hi = k;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (row[mid] < e) lo = mid + 1; else hi = mid;
    }
    return lo < k && row[lo] == e ? lo : -1;
}

// Groups the pairs by expert. grid = 1, blockDim 1024 (32 warps); dynamic shared memory 2 E ints.
// idx: [n, k] chosen experts, ascending per token. One warp per expert scans the tokens 32 at a time (a ballot
// ranks the hits), so the order within an expert is the token order.
extern "C" __global__ void moe_group(const int *idx, int n, int k, int E, int *group, int *pairs) {
    extern __shared__ int gsm[];
    int *count = gsm, *start = gsm + E;
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

// One warp's pass of NM MXFP4 weight rows (NM = 2: gate and up) over up to MOE_TOKENS pairs. Lane L takes the
// 32-input groups L, L + 32, ... of each row (16 packed bytes and one scale each, from `packed[m]`, `scales[m]`),
// MOE_GROUPS_IN_FLIGHT of them at a time, all loaded before the first is used (a K3 row of 3584 inputs is one
// such chunk), dequantises each word of codes once and applies it to every pair's input row (bf16, at element
// offset x[j] of `in`). acc[m][j] receives the lane's partial dot of row m and pair j (valid j < live); each
// pair's sum runs over the lane's groups in the same order every time.
template <int NM>
__device__ __forceinline__ void rows_pass(const u8 *const packed[NM], const u8 *const scales[NM], int lane,
                                          int groups, const __nv_bfloat16 *in, const int x[MOE_TOKENS], int live,
                                          float acc[NM][MOE_TOKENS]) {
    for (int g0 = 0; g0 < groups; g0 += 32 * MOE_GROUPS_IN_FLIGHT) {
        uint4 q[NM][MOE_GROUPS_IN_FLIGHT];
        u8 sb[NM][MOE_GROUPS_IN_FLIGHT];
#pragma unroll
        for (int i = 0; i < MOE_GROUPS_IN_FLIGHT; i++) {
            int g = g0 + lane + 32 * i;
#pragma unroll
            for (int m = 0; m < NM; m++)
                if (g < groups) {
                    q[m][i] = __ldg((const uint4 *)packed[m] + g);
                    sb[m][i] = __ldg(scales[m] + g);
                }
        }
#pragma unroll
        for (int i = 0; i < MOE_GROUPS_IN_FLIGHT; i++) {
            int g = g0 + lane + 32 * i;
            if (g >= groups) break;
#pragma unroll
            for (int wi = 0; wi < 4; wi++) {
                float w[NM][8];
#pragma unroll
                for (int m = 0; m < NM; m++) dequant_word(word_of(q[m][i], wi), e8m0(sb[m][i]), w[m]);
#pragma unroll
                for (int j = 0; j < MOE_TOKENS; j++) {
                    if (j < live) {
                        uint4 xv = *(const uint4 *)(in + x[j] + g * 32 + wi * 8);
#pragma unroll
                        for (int m = 0; m < NM; m++) acc[m][j] = dot8(w[m], xv, acc[m][j]);
                    }
                }
                // Keeps the compiler from hoisting every pair's input loads of the chunk at once (register spills).
                asm volatile("" ::: "memory");
            }
        }
    }
}

// Gate/up + SiTU per active expert: a[p, r] = bf(SiTU(bf(w1_e[r] z_t), bf(w3_e[r] z_t))) for every pair p = t k + j
// of expert e. grid = (min(n k, E), ceil(I / warps)), blockDim 256; one warp per output row r: its w1 and w3 codes
// come from HBM once, for the first MOE_TOKENS pairs (later passes find them in the caches).
// z: [n, D]; w1/w3 packed [E, I, D/2], scales [E, I, D/32]; a: [n k, I].
extern "C" __global__ void __launch_bounds__(256, 2)
    moe_gate_up(const __nv_bfloat16 *z, const u8 *w1p, const u8 *w1s, const u8 *w3p, const u8 *w3s, const int *group,
                const int *pairs, __nv_bfloat16 *a, int k, int E, int D, int I, float beta, float lbeta) {
    int slot = blockIdx.x;
    if (slot >= group[0]) return;
    int row = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= I) return;
    long e = group[1 + slot];
    int first = group[1 + E + slot], end = group[2 + E + slot], groups = D / 32;
    long r = e * I + row;
    const u8 *packed[2] = {w1p + r * (D / 2), w3p + r * (D / 2)}, *scales[2] = {w1s + r * groups, w3s + r * groups};
    for (int base = first; base < end; base += MOE_TOKENS) {
        int live = min(MOE_TOKENS, end - base), x[MOE_TOKENS];
        float acc[2][MOE_TOKENS];
#pragma unroll
        for (int j = 0; j < MOE_TOKENS; j++) {
            x[j] = (pairs[base + min(j, live - 1)] / k) * D;
            acc[0][j] = 0.0f;
            acc[1][j] = 0.0f;
        }
        rows_pass<2>(packed, scales, lane, groups, z, x, live, acc);
        // Lane j keeps pair j's sums.
        float gv = 0.0f, uv = 0.0f;
#pragma unroll
        for (int j = 0; j < MOE_TOKENS; j++) {
            if (j < live) {
                float gs = warp_sum(acc[0][j]), us = warp_sum(acc[1][j]);
                if (lane == j) { gv = bf_round(gs); uv = bf_round(us); }
            }
        }
        if (lane < live)
            a[(long)pairs[base + lane] * I + row] =
                __float2bfloat16_rn((beta * tanhf(gv / beta) * sigmoidf_(gv)) * (lbeta * tanhf(uv / lbeta)));
    }
}

// Down projection per active expert: y[p, c] = bf(w2_e[c] a[p]) for every pair p of expert e.
// grid = (min(n k, E), ceil(D / warps)), blockDim 256; one warp per output channel c.
// a: [n k, I]; w2 packed [E, D, I/2], scales [E, D, I/32]; y: [n k, D].
extern "C" __global__ void __launch_bounds__(256)
    moe_down(const __nv_bfloat16 *a, const u8 *w2p, const u8 *w2s, const int *group, const int *pairs,
             __nv_bfloat16 *y, int E, int D, int I) {
    int slot = blockIdx.x;
    if (slot >= group[0]) return;
    int c = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (c >= D) return;
    long e = group[1 + slot];
    int first = group[1 + E + slot], end = group[2 + E + slot], groups = I / 32;
    long r = e * D + c;
    const u8 *packed[1] = {w2p + r * (I / 2)}, *scales[1] = {w2s + r * groups};
    for (int base = first; base < end; base += MOE_TOKENS) {
        int live = min(MOE_TOKENS, end - base), x[MOE_TOKENS];
        float acc[1][MOE_TOKENS];
#pragma unroll
        for (int j = 0; j < MOE_TOKENS; j++) {
            x[j] = pairs[base + min(j, live - 1)] * I;
            acc[0][j] = 0.0f;
        }
        rows_pass<1>(packed, scales, lane, groups, a, x, live, acc);
        float v = 0.0f;  // lane j keeps pair j's sum
#pragma unroll
        for (int j = 0; j < MOE_TOKENS; j++) {
            if (j < live) {
                float sum = warp_sum(acc[0][j]);
                if (lane == j) v = sum;
            }
        }
        if (lane < live) y[(long)pairs[base + lane] * D + c] = __float2bfloat16_rn(v);
    }
}

// Sum of `v` over the block (blockDim.x a multiple of 32); every thread gets the total. The same reduction
// as common.cu's block_sum, so the routed norm below rounds exactly as rms_norm over the combined rows would.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    v = warp_sum(v);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(t);
}

// The weighted combine in slot order (ascending experts) and the routed RMSNorm, per token:
// c = bf(sum_j wts[t, j] y[t k + j]); out[t] = bf(w * bf(c * rsqrt(mean(c^2) + eps))).
// grid = n tokens, blockDim 256; dynamic shared memory D floats. y: [n k, D]; wts: [n, k]; out: [n, D].
extern "C" __global__ void moe_combine_norm(const __nv_bfloat16 *y, const float *wts, const __nv_bfloat16 *w,
                                            __nv_bfloat16 *out, int k, int D, float eps) {
    extern __shared__ float combined[];
    long t = blockIdx.x;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += ld(y, (t * k + j) * D + c) * wts[t * k + j];
        float v = bf_round(acc);
        combined[c] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int c = threadIdx.x; c < D; c += blockDim.x)
        out[t * D + c] = __float2bfloat16_rn(ld(w, c) * bf_round(combined[c] * r));
}
