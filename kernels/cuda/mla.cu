// sparkd: gated NoPE MLA attention of one sequence window in the absorbed form over the latent cache.
//
// Invariants: the cache holds per token [c (kv_lora, normalised) | k_rot (rope, raw)] in bf16 and
// already contains the window's own entries; window token i attends causally over cache entries
// 0 ..= first + i. q_lat and o_lat are rounded to bf16 where the CPU reference rounds them
// (kernels/src/cpu/mla.rs); scores and the softmax are fp32.
// Math: shared/reference/k3-architecture.md §2.6 (W_UK absorbed into the query, W_UV applied after).
#include <cuda_bf16.h>

#define INF_F __int_as_float(0x7f800000)

__device__ __forceinline__ float ld(const __nv_bfloat16 *p, long i) { return __bfloat162float(p[i]); }

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

// grid = (t tokens, H heads); blockDim a multiple of 32, >= 32. Dynamic shared memory: 2 * r floats.
// q: [t, H * (nope + rope)]; cache: [>= first + t, r + rope]; kv_b: [H * (nope + v), r];
// scores: [t, H, first + t] fp32 scratch; out: [t, H * v].
extern "C" __global__ void mla_attend(const __nv_bfloat16 *q, const __nv_bfloat16 *cache, const __nv_bfloat16 *kv_b,
                                      float *scores, __nv_bfloat16 *out, int first, int t, int H, int nope, int rope,
                                      int vdim, int r, float scale) {
    extern __shared__ float sm[];
    float *q_lat = sm, *o_lat = sm + r;
    int ti = blockIdx.x, h = blockIdx.y;
    int qh = nope + rope, ld_ = r + rope, per_head = nope + vdim;
    int visible = first + ti + 1;
    const __nv_bfloat16 *qrow = q + ((long)ti * H + h) * qh;
    // q_lat = bf(W_UK^T q_nope), W_UK = kv_b rows [h * per_head, h * per_head + nope).
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < nope; i++) acc += ld(qrow, i) * ld(kv_b, (long)(h * per_head + i) * r + c);
        q_lat[c] = __bfloat162float(__float2bfloat16_rn(acc));
    }
    __syncthreads();
    float *sc = scores + ((long)ti * H + h) * (first + t);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int pos = warp; pos < visible; pos += warps) {
        const __nv_bfloat16 *e = cache + (long)pos * ld_;
        float a = 0.0f, b = 0.0f;
        for (int c = lane; c < r; c += 32) a += q_lat[c] * ld(e, c);
        for (int c = lane; c < rope; c += 32) b += ld(qrow, nope + c) * ld(e, r + c);
        for (int o = 16; o > 0; o >>= 1) {
            a += __shfl_xor_sync(0xffffffffu, a, o);
            b += __shfl_xor_sync(0xffffffffu, b, o);
        }
        if (lane == 0) sc[pos] = scale * (a + b);
    }
    __syncthreads();
    float m = -INF_F;
    for (int pos = threadIdx.x; pos < visible; pos += blockDim.x) m = fmaxf(m, sc[pos]);
    m = block_max(m);
    float total = 0.0f;
    for (int pos = threadIdx.x; pos < visible; pos += blockDim.x) {
        float e = expf(sc[pos] - m);
        sc[pos] = e;
        total += e;
    }
    total = block_sum(total);
    __syncthreads();
    // o_lat = bf(sum_pos p_pos c_pos), in ascending position order per channel.
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        float acc = 0.0f;
        for (int pos = 0; pos < visible; pos++) acc += (sc[pos] / total) * ld(cache, (long)pos * ld_ + c);
        o_lat[c] = __bfloat162float(__float2bfloat16_rn(acc));
    }
    __syncthreads();
    // o = bf(W_UV o_lat), W_UV = kv_b rows [h * per_head + nope, (h + 1) * per_head).
    __nv_bfloat16 *orow = out + ((long)ti * H + h) * vdim;
    for (int jw = warp; jw < vdim; jw += warps) {
        const __nv_bfloat16 *wrow = kv_b + (long)(h * per_head + nope + jw) * r;
        float acc = 0.0f;
        for (int c = lane; c < r; c += 32) acc += ld(wrow, c) * o_lat[c];
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) orow[jw] = __float2bfloat16_rn(acc);
    }
}
