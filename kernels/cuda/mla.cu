// sparkd: gated NoPE MLA attention for every row of a step, in the absorbed form over the latent cache,
// split over the cache length (flash-decoding, as FlashMLA / flash-decoding's split-KV: partial max / sum
// / values per split, then a merge).
//
// Invariants:
// - The cache holds per token [c (kv_lora, normalised) | k_rot (rope, raw)] in bf16. `mla_append` writes
//   the window's entries first; window token i of a row attends causally over entries 0 ..= first + i.
// - q_lat and o_lat are rounded to bf16 where the CPU reference rounds them (kernels/src/cpu/mla.rs);
//   scores, the softmax and the merge are fp32.
// - How a token's positions are split depends only on that token (its visible length and its row's split
//   span, chosen from the row alone), and splits merge in ascending order: a row's result does not depend
//   on the other rows of the batch.
// Math: shared/reference/k3-architecture.md §2.6 (W_UK absorbed into the query, W_UV applied after).
#include <cuda_bf16.h>

#define INF_F __int_as_float(0x7f800000)

typedef long long i64;

__device__ __forceinline__ float ld(const __nv_bfloat16 *p, i64 i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float bf_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

__device__ float block_max(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? partial[lane] : -INF_F;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

// One row's entry of the step table (kernels/src/cuda/attn.rs `MLA_ENTRY`).
#define M_CACHE 0   // bf16 [capacity, r + rope]
#define M_FIRST 1   // entries before the window
#define M_OFFSET 2  // first token of the row in the step
#define M_T 3       // tokens of the row
#define M_SPAN 4    // positions per split
#define MLA_ENTRY 5

// grid = (max t, rows); blockDim 128. cache[first + i] = latent[offset + i], latent: [n, ld].
extern "C" __global__ void mla_append(const i64 *table, const __nv_bfloat16 *latent, int ld) {
    const i64 *e = table + (i64)blockIdx.y * MLA_ENTRY;
    int i = blockIdx.x;
    if (i >= e[M_T]) return;
    __nv_bfloat16 *dst = (__nv_bfloat16 *)e[M_CACHE] + (e[M_FIRST] + i) * ld;
    const __nv_bfloat16 *src = latent + (e[M_OFFSET] + i) * ld;
    for (int c = threadIdx.x; c < ld; c += blockDim.x) dst[c] = src[c];
}

#define ABSORB_TOKENS 8

// q_lat[tok, h] = bf(W_UK_h^T q_nope[tok, h]), W_UK_h = kv_b rows [h * per_head, h * per_head + nope).
// grid = (H, ceil(n / ABSORB_TOKENS)); blockDim 128; dynamic shared memory ABSORB_TOKENS * nope floats.
// q: [n, H * (nope + rope)]; kv_b: [H * (nope + v), r]; q_lat: [n, H, r] fp32 (bf16 values).
extern "C" __global__ void mla_absorb(const __nv_bfloat16 *q, const __nv_bfloat16 *kv_b, float *q_lat, int n, int H,
                                      int nope, int rope, int vdim, int r) {
    extern __shared__ float qn[];  // [ABSORB_TOKENS, nope]
    int h = blockIdx.x, tok0 = blockIdx.y * ABSORB_TOKENS;
    int tokens = min(ABSORB_TOKENS, n - tok0);
    int qh = nope + rope, per_head = nope + vdim;
    for (int x = threadIdx.x; x < tokens * nope; x += blockDim.x) {
        int tk = x / nope, i = x % nope;
        qn[x] = ld(q, ((i64)(tok0 + tk) * H + h) * qh + i);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        float acc[ABSORB_TOKENS];
#pragma unroll
        for (int tk = 0; tk < ABSORB_TOKENS; tk++) acc[tk] = 0.0f;
        for (int i = 0; i < nope; i++) {
            float w = ld(kv_b, (i64)(h * per_head + i) * r + c);
#pragma unroll
            for (int tk = 0; tk < ABSORB_TOKENS; tk++)
                if (tk < tokens) acc[tk] += qn[tk * nope + i] * w;
        }
#pragma unroll
        for (int tk = 0; tk < ABSORB_TOKENS; tk++)
            if (tk < tokens) q_lat[((i64)(tok0 + tk) * H + h) * r + c] = bf_round(acc[tk]);
    }
}

#define TILE 64
#define MAX_CH 8  // r <= MAX_CH * blockDim

// One split of one (token, head): positions [s * span, min(visible, (s + 1) * span)) in tiles of TILE with an
// online softmax. grid = (max splits, H, n); blockDim 128; dynamic shared memory (r + rope) floats.
// tok_row: [n] the row of each token. Writes part_o [n, H, splits, r] (unnormalised), part_m / part_l
// [n, H, splits] (max and sum of exp(score - max)); an empty split writes m = -inf, l = 0.
extern "C" __global__ void mla_split(const i64 *table, const i64 *tok_row, const __nv_bfloat16 *q, const float *q_lat,
                                     float *part_o, float *part_m, float *part_l, int H, int nope, int rope, int r,
                                     float scale) {
    extern __shared__ float qs[];  // [r + rope]: q_lat, then q_rot
    __shared__ float sc[TILE];
    int s = blockIdx.x, h = blockIdx.y, splits = gridDim.x;
    i64 tok = blockIdx.z;
    const i64 *e = table + (i64)tok_row[tok] * MLA_ENTRY;
    const __nv_bfloat16 *cache = (const __nv_bfloat16 *)e[M_CACHE];
    int visible = (int)(e[M_FIRST] + (tok - e[M_OFFSET]) + 1);
    int span = (int)e[M_SPAN];
    int lo = s * span, hi = min(visible, lo + span);
    i64 part = (tok * H + h) * splits + s;
    int ld_ = r + rope, qh = nope + rope;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int c = threadIdx.x; c < r; c += blockDim.x) qs[c] = q_lat[(tok * H + h) * r + c];
    for (int c = threadIdx.x; c < rope; c += blockDim.x) qs[r + c] = ld(q, (tok * H + h) * qh + nope + c);
    __syncthreads();
    float m_run = -INF_F, l_run = 0.0f, acc[MAX_CH];
#pragma unroll
    for (int x = 0; x < MAX_CH; x++) acc[x] = 0.0f;
    for (int base = lo; base < hi; base += TILE) {
        int len = min(TILE, hi - base);
        for (int p = warp; p < len; p += warps) {
            const __nv_bfloat16 *ent = cache + (i64)(base + p) * ld_;
            float a = 0.0f;
            for (int c = lane; c < ld_; c += 32) a += qs[c] * ld(ent, c);
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) sc[p] = scale * a;
        }
        __syncthreads();
        float tmax = block_max(threadIdx.x < len ? sc[threadIdx.x] : -INF_F);
        float m_new = fmaxf(m_run, tmax);
        float factor = expf(m_run - m_new);
        float ev = 0.0f;
        if (threadIdx.x < len) {
            ev = expf(sc[threadIdx.x] - m_new);
            sc[threadIdx.x] = ev;
        }
        float tsum = block_sum(ev);
        l_run = l_run * factor + tsum;
        m_run = m_new;
#pragma unroll
        for (int x = 0; x < MAX_CH; x++) {
            int c = threadIdx.x + x * blockDim.x;
            if (c >= r) break;
            float a = acc[x] * factor;
            for (int p = 0; p < len; p++) a += sc[p] * ld(cache, (i64)(base + p) * ld_ + c);
            acc[x] = a;
        }
        __syncthreads();
    }
#pragma unroll
    for (int x = 0; x < MAX_CH; x++) {
        int c = threadIdx.x + x * blockDim.x;
        if (c >= r) break;
        part_o[part * r + c] = acc[x];
    }
    if (threadIdx.x == 0) {
        part_m[part] = m_run;
        part_l[part] = l_run;
    }
}

#define MERGE_TOKENS 8

// Merge of each token's splits in ascending order, o_lat = bf(sum_s e^{m_s - M} o_s / sum_s e^{m_s - M} l_s), then
// out = bf(W_UV_h o_lat), W_UV_h = kv_b rows [h * per_head + nope, (h + 1) * per_head), for MERGE_TOKENS tokens per
// block so that W_UV_h is read once per tile (each token's sums are its own: tiling does not change them).
// grid = (H, ceil(n / MERGE_TOKENS)); blockDim 128; dynamic shared memory MERGE_TOKENS * r floats. out: [n, H * v].
extern "C" __global__ void mla_merge(const float *part_o, const float *part_m, const float *part_l,
                                     const __nv_bfloat16 *kv_b, __nv_bfloat16 *out, int n, int splits, int H, int nope,
                                     int vdim, int r) {
    extern __shared__ float o_lat[];  // [MERGE_TOKENS, r]
    int h = blockIdx.x, per_head = nope + vdim;
    i64 tok0 = (i64)blockIdx.y * MERGE_TOKENS;
    int tokens = (int)min((i64)MERGE_TOKENS, n - tok0);
    for (int tk = 0; tk < tokens; tk++) {
        i64 base = ((tok0 + tk) * H + h) * splits;
        float M = -INF_F;
        for (int s = 0; s < splits; s++) M = fmaxf(M, part_m[base + s]);
        float L = 0.0f;
        for (int s = 0; s < splits; s++)
            if (part_l[base + s] > 0.0f) L += expf(part_m[base + s] - M) * part_l[base + s];
        for (int c = threadIdx.x; c < r; c += blockDim.x) {
            float acc = 0.0f;
            for (int s = 0; s < splits; s++)
                if (part_l[base + s] > 0.0f) acc += expf(part_m[base + s] - M) * part_o[(base + s) * r + c];
            o_lat[tk * r + c] = bf_round(acc / L);
        }
    }
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int jw = warp; jw < vdim; jw += warps) {
        const __nv_bfloat16 *wrow = kv_b + (i64)(h * per_head + nope + jw) * r;
        float acc[MERGE_TOKENS];
#pragma unroll
        for (int tk = 0; tk < MERGE_TOKENS; tk++) acc[tk] = 0.0f;
        for (int c = lane; c < r; c += 32) {
            float w = ld(wrow, c);
#pragma unroll
            for (int tk = 0; tk < MERGE_TOKENS; tk++)
                if (tk < tokens) acc[tk] += w * o_lat[tk * r + c];
        }
#pragma unroll
        for (int tk = 0; tk < MERGE_TOKENS; tk++) {
            float a = acc[tk];
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0 && tk < tokens) out[((tok0 + tk) * H + h) * vdim + jw] = __float2bfloat16_rn(a);
        }
    }
}
