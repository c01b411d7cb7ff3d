// sparkd: Kimi Delta Attention for one sequence window: the short causal conv with SiLU, and the
// per-head recurrence (gates, l2 norms, delta rule, gated output RMSNorm), token by token.
//
// Invariants: the state S of a head is [K, V] fp32, decayed by rows; column j of S is owned by
// thread j, which walks the key channels i in ascending order, the order of the CPU reference
// (kernels/src/cpu/kda.rs `recurrent_step`). Conv windows hold the last kw-1 pre-conv inputs (bf16).
// With snapshots on, the layer state after m window tokens is written for every from <= m < t, so a
// verify window can be cut back exactly (fla's IS_SPEC_DECODING per-token states).
// Math: shared/reference/k3-architecture.md §2.4.
#include <cuda_bf16.h>

__device__ __forceinline__ float ld(const __nv_bfloat16 *p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
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

// Depthwise causal conv + SiLU over a window of t tokens for one of q/k/v.
// x: [t, P] new pre-conv inputs; window: [kw-1, P] (state, updated in place); w: [P, kw] fp32
// (tap kw-1 multiplies the current token); out: [t, P]; hist (optional): [kw-1+t, P], the old window
// followed by the new inputs, kept so that a verify window can restore the window after m tokens.
extern "C" __global__ void kda_conv(const __nv_bfloat16 *x, __nv_bfloat16 *window, const float *w,
                                    __nv_bfloat16 *out, __nv_bfloat16 *hist, int t, int P, int kw) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= P) return;
    float win[8];  // kw <= 8
    for (int j = 0; j < kw - 1; j++) {
        win[j] = ld(window, (long)j * P + c);
        if (hist) hist[(long)j * P + c] = window[(long)j * P + c];
    }
    for (int ti = 0; ti < t; ti++) {
        win[kw - 1] = ld(x, (long)ti * P + c);
        if (hist) hist[(long)(kw - 1 + ti) * P + c] = x[(long)ti * P + c];
        float acc = 0.0f;
        for (int j = 0; j < kw; j++) acc += w[c * kw + j] * win[j];
        out[(long)ti * P + c] = __float2bfloat16_rn(acc * sigmoidf_(acc));
        for (int j = 0; j < kw - 1; j++) win[j] = win[j + 1];
    }
    for (int j = 0; j < kw - 1; j++) window[(long)j * P + c] = __float2bfloat16_rn(win[j]);
}

// The recurrence of one head over t tokens; grid = heads, blockDim = dk (= dv, a multiple of 32).
// qc, kc, vc: [t, P] conv outputs; f: [t, P] forget-gate input; b: [t, H] beta logits; g: [t, P]
// output-gate logits; S: [H, dk, dk]; a: exp(A_log) [H]; dt_bias: [P]; o_norm: [dk];
// o: [t, P] gated, normalised outputs; snaps (optional): [t - from, H, dk, dk].
extern "C" __global__ void kda_recurrence(const __nv_bfloat16 *qc, const __nv_bfloat16 *kc, const __nv_bfloat16 *vc,
                                          const __nv_bfloat16 *f, const __nv_bfloat16 *b, const __nv_bfloat16 *g,
                                          float *S, const float *a, const float *dt_bias, const float *o_norm,
                                          __nv_bfloat16 *o, float *snaps, int t, int H, int dk, float lower_bound,
                                          float l2_eps, float norm_eps, int snap_from) {
    extern __shared__ float sm[];
    float *q = sm, *k = sm + dk, *decay = sm + 2 * dk;
    int h = blockIdx.x, j = threadIdx.x;
    int P = H * dk;
    float *s = S + (long)h * dk * dk;
    float scale = 1.0f / sqrtf((float)dk);
    for (int ti = 0; ti < t; ti++) {
        long off = (long)ti * P + h * dk;
        float qv = ld(qc, off + j), kv = ld(kc, off + j);
        float qq = block_sum(qv * qv), kk = block_sum(kv * kv);
        float qn = (1.0f / sqrtf(qq + l2_eps)) * scale;
        float kn = 1.0f / sqrtf(kk + l2_eps);
        q[j] = qv * qn;
        k[j] = kv * kn;
        float z = a[h] * (ld(f, off + j) + dt_bias[h * dk + j]);
        decay[j] = expf(lower_bound * sigmoidf_(z));
        float beta = sigmoidf_(ld(b, (long)ti * H + h));
        __syncthreads();
        // Decay the rows, then the delta-rule error u_j = v_j - sum_i k_i S[i, j].
        float u = ld(vc, off + j);
        for (int i = 0; i < dk; i++) {
            float sij = s[i * dk + j] * decay[i];
            s[i * dk + j] = sij;
            u -= k[i] * sij;
        }
        // Rank-1 write, then the read with the updated state.
        float out = 0.0f;
        for (int i = 0; i < dk; i++) {
            float sij = s[i * dk + j] + beta * k[i] * u;
            s[i * dk + j] = sij;
        }
        for (int i = 0; i < dk; i++) out += q[i] * s[i * dk + j];
        // Gated output RMSNorm of the head (fp32), then bf16.
        float ss = block_sum(out * out);
        float r = 1.0f / sqrtf(ss / (float)dk + norm_eps);
        o[off + j] = __float2bfloat16_rn(out * r * o_norm[j] * sigmoidf_(ld(g, off + j)));
        int m = ti + 1;
        if (snaps && m >= snap_from && m < t) {
            float *dst = snaps + ((long)(m - snap_from) * H + h) * dk * dk;
            for (int i = 0; i < dk; i++) dst[i * dk + j] = s[i * dk + j];
        }
        __syncthreads();
    }
}
