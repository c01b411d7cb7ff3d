// sparkd: the DSpark drafter's own kernels (tap concatenation, RoPE, the Markov head step with the confidence
// head, and the fp32 argmax of a draft step). The block's non-causal MLA runs on the target's kernels (mla.cu).
//
// Invariants: activations are bf16 exactly where the CPU drafter (kernels/src/dspark/model.rs) rounds
// with `Real::act`; RoPE angles and rotations are computed in f64 and rounded f64 -> f32 -> bf16 as the
// CPU does; Markov logits `U_k + bf(W2 W1[x_{k-1}])` are fp32 and never rounded to bf16 (the CPU adds
// them in f32); ties of the argmax go to the lowest id.
// Math: shared/reference/dspark.md §1.1 (KV injection, non-causal block), §1.2 (Markov head),
// §2.1 (confidence head).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

// Per committed token j, the m taps concatenated in tap order:
// out[j, i * d + c] = taps[i, rows[j], c]. taps: [m, n, d] (slot stride `slot`); out: [N, m * d].
// grid = (N, m).
extern "C" __global__ void concat_taps(const __nv_bfloat16 *taps, long slot, const u32 *rows, __nv_bfloat16 *out,
                                       int d) {
    kernel_entry();
    int j = blockIdx.x, i = blockIdx.y, m = gridDim.y;
    const __nv_bfloat16 *src = taps + i * slot + (long)rows[j] * d;
    __nv_bfloat16 *dst = out + ((long)j * m + i) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
}

// RoPE in place, half-split pairs (x_i, x_{i+half}) with angle pos * theta^(-2i/len), in f64.
// Vector v starts at x + v * stride + offset and has `len` values; its position is
// positions[v / group] (group = heads per token for queries, 1 for latents). One thread per pair.
extern "C" __global__ void rope_rows(__nv_bfloat16 *x, long stride, int offset, int len, int group,
                                     const int *positions, long vectors, double theta) {
    kernel_entry();
    int half = len / 2;
    long id = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= vectors * half) return;
    long v = id / half;
    int i = (int)(id % half);
    double angle = (double)positions[v / group] * pow(theta, -2.0 * (double)i / (double)len);
    double s, c;
    sincos(angle, &s, &c);
    __nv_bfloat16 *p = x + v * stride + offset;
    double a = (double)ld(p, i), b = (double)ld(p, i + half);
    p[i] = __float2bfloat16_rn(__double2float_rn(a * c - b * s));
    p[i + half] = __float2bfloat16_rn(__double2float_rn(a * s + b * c));
}

// Markov step k of every row (dspark.md §1.2, §2.1), after `bf(W2 e)` for each row's e = W1[x_{k-1}] (x_0 = the
// anchor) ran as one GEMM (`m`):
//   logits[t, v] = U[t, v] + m[row, v] (fp32), or -inf where the token mask (bit v % 32 of word v / 32 set:
//   allowed; null: all allowed) forbids v; tokens[k + 1, row] = the argmax (lowest id on ties);
//   conf[t] = sigmoid(w[:d] . h_t + w[d:] . e + b) (by the row's block 0),
// with t = base[row] + k the row's block position k. Rows with count[row] <= k are skipped.
// The argmax spans the row's blocks: each block's best (value, id) packed as ordered bits of the value over the
// complement of the id (the largest key: the largest value, then the lowest id) goes to best[row] by atomicMax,
// and the row's last block to finish (counted in done[row], after a fence) writes the token. best and done start
// at zero (below every key: -inf packs to 0x007fffff in the high word).
// U: [N, V] bf16; m: [R, V] bf16; hidden: [N, d]; e: [R, r]; cw: [d + r]; tokens: [stride, R] (row 0 = the
// anchors, row k + 1 = draft k); logits: [N, V] fp32; conf: [N]; best: [R] u64; done: [R] u32.
// grid = (ceil(V / (PICK_THREADS * PICK_PER_THREAD)), R), block = PICK_THREADS.
#define PICK_THREADS 256
#define PICK_PER_THREAD 8
__device__ __forceinline__ unsigned long long pick_key(float x, u32 v) {
    u32 bits = __float_as_uint(x);
    u32 ordered = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
    return ((unsigned long long)ordered << 32) | (0xffffffffu - v);
}
extern "C" __global__ void __launch_bounds__(PICK_THREADS)
    markov_pick(int k, const __nv_bfloat16 *U, const __nv_bfloat16 *m, const __nv_bfloat16 *hidden,
                const __nv_bfloat16 *e, const __nv_bfloat16 *cw, float cb, const int *base, const int *count,
                u32 *tokens, const u32 *mask, float *logits, float *conf, unsigned long long *best, u32 *done,
                int V, int r, int d) {
    kernel_entry();
    __shared__ unsigned long long warp_best[PICK_THREADS / 32];
    int row = blockIdx.y, R = gridDim.y;
    if (k >= count[row]) return;  // uniform over the block
    long t = base[row] + k;
    const __nv_bfloat16 *ur = U + t * V, *mr = m + (long)row * V;
    float *lr = logits + t * V;
    unsigned long long key = 0ull;
    int v0 = blockIdx.x * PICK_THREADS * PICK_PER_THREAD + threadIdx.x;
#pragma unroll
    for (int u = 0; u < PICK_PER_THREAD; u++) {
        int v = v0 + u * PICK_THREADS;
        if (v < V) {
            bool allowed = mask == 0 || ((mask[v >> 5] >> (v & 31)) & 1u);
            float x = allowed ? ld(ur, v) + ld(mr, v) : -INF_F;
            lr[v] = x;
            unsigned long long kx = pick_key(x, (u32)v);
            key = kx > key ? kx : key;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) warp_best[warp] = key;
    if (blockIdx.x == 0) {
        const __nv_bfloat16 *h = hidden + t * d, *er = e + (long)row * r;
        float a = 0.0f, b = 0.0f;
        for (int c = threadIdx.x; c < d; c += blockDim.x) a += ld(cw, c) * ld(h, c);
        for (int c = threadIdx.x; c < r; c += blockDim.x) b += ld(cw, d + c) * ld(er, c);
        a = block_sum(a);
        b = block_sum(b);
        if (threadIdx.x == 0) conf[t] = 1.0f / (1.0f + expf(-(a + b + cb)));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < PICK_THREADS / 32; w++) key = warp_best[w] > key ? warp_best[w] : key;
        atomicMax(best + row, key);
        __threadfence();
        if (atomicAdd(done + row, 1u) == gridDim.x - 1) {
            unsigned long long top = atomicOr(best + row, 0ull);
            tokens[(long)(k + 1) * R + row] = 0xffffffffu - (u32)(top & 0xffffffffull);
        }
    }
}
