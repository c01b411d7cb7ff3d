// sparkd: the latent MoE's router and routed experts (MXFP4 weights dequantised in the kernel).
//
// Invariants: the router is an fp32 island over the full hidden vector: sigmoid scores, the correction
// bias only selects, top-k ties go to the lowest expert index, chosen experts are listed ascending,
// weights come from the unbiased scores and are renormalised. An expert's gate/up outputs are rounded
// to bf16, SiTU'd and rounded again; its down output is rounded to bf16, then the k experts are
// combined in fp32 in ascending expert order and rounded once (kernels/src/cpu/moe.rs).
// MXFP4: two E2M1 codes per byte, element 2i in the low nibble; one E8M0 scale per 32 inputs;
// 0xFF is NaN (shared/reference/k3-architecture.md §2.8).
#include <cuda_bf16.h>

#define INF_F __int_as_float(0x7f800000)

typedef unsigned char u8;

__device__ __forceinline__ float ld(const __nv_bfloat16 *p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float bf_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float e2m1(u8 code) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[code & 7];
    return (code & 8) ? -v : v;
}

__device__ __forceinline__ float e8m0(u8 b) {
    if (b == 0xFF) return __int_as_float(0x7fc00000);
    if (b == 0) return __int_as_float(1 << 22);
    return __int_as_float((int)b << 23);
}

// Dot of one MXFP4 row (`cols` inputs) with x, by one warp; lane 0 returns the total.
__device__ float mxfp4_row_dot(const u8 *packed, const u8 *scales, const __nv_bfloat16 *x, int cols) {
    float acc = 0.0f;
    for (int i = threadIdx.x & 31; i < cols / 2; i += 32) {
        u8 byte = packed[i];
        float s = e8m0(scales[(2 * i) / 32]);
        acc += e2m1(byte & 15) * s * ld(x, 2 * i) + e2m1(byte >> 4) * s * ld(x, 2 * i + 1);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
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

// Gate/up of the chosen experts and SiTU: a[t, j, :] = bf(SiTU(bf(w1_e z_t), bf(w3_e z_t))), e = idx[t, j].
// grid = (n * k, ceil(I / warps)); one warp per output row. z: [n, D]; w1/w3 packed [E, I, D/2],
// scales [E, I, D/32]; a: [n, k, I].
extern "C" __global__ void moe_gate_up(const __nv_bfloat16 *z, const u8 *w1p, const u8 *w1s, const u8 *w3p,
                                       const u8 *w3s, const int *idx, __nv_bfloat16 *a, int k, int D, int I,
                                       float beta, float lbeta) {
    int tj = blockIdx.x, t = tj / k;
    int row = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= I) return;
    long e = idx[tj];
    long prow = (e * I + row) * (D / 2), srow = (e * I + row) * (D / 32);
    const __nv_bfloat16 *x = z + (long)t * D;
    float g = bf_round(mxfp4_row_dot(w1p + prow, w1s + srow, x, D));
    float u = bf_round(mxfp4_row_dot(w3p + prow, w3s + srow, x, D));
    if ((threadIdx.x & 31) == 0)
        a[(long)tj * I + row] =
            __float2bfloat16_rn((beta * tanhf(g / beta) * sigmoidf_(g)) * (lbeta * tanhf(u / lbeta)));
}

// Down projections and the fp32 combine: out[t, c] = bf(sum_j wts[t, j] * bf(w2_e a[t, j])), e = idx[t, j].
// grid = (n, ceil(D / warps)); one warp per output channel. w2 packed [E, D, I/2], scales [E, D, I/32].
extern "C" __global__ void moe_down_combine(const __nv_bfloat16 *a, const u8 *w2p, const u8 *w2s, const int *idx,
                                            const float *wts, __nv_bfloat16 *out, int k, int D, int I) {
    int t = blockIdx.x;
    int c = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (c >= D) return;
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        long e = idx[(long)t * k + j];
        float y = bf_round(mxfp4_row_dot(w2p + (e * D + c) * (I / 2), w2s + (e * D + c) * (I / 32),
                                         a + ((long)t * k + j) * I, I));
        acc += y * wts[(long)t * k + j];
    }
    if ((threadIdx.x & 31) == 0) out[(long)t * D + c] = __float2bfloat16_rn(acc);
}
