// sparkd: the DSpark drafter's own kernels (tap concatenation, RoPE, non-causal block MLA, the Markov
// head step with the confidence head, and the fp32 argmax of a draft step).
//
// Invariants: activations are bf16 exactly where the CPU drafter (kernels/src/dspark/model.rs) rounds
// with `Real::act`; RoPE angles and rotations are computed in f64 and rounded f64 -> f32 -> bf16 as the
// CPU does; Markov logits `U_k + bf(W2 W1[x_{k-1}])` are fp32 and never rounded to bf16 (the CPU adds
// them in f32); ties of the argmax go to the lowest id.
// Math: shared/reference/dspark.md §1.1 (KV injection, non-causal block), §1.2 (Markov head),
// §2.1 (confidence head); MLA in the absorbed form of k3-architecture.md §2.6 (as kernels/cuda/mla.cu).
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

// Non-causal MLA of one row's block: each of the t block queries sees every one of the `visible`
// cache entries (the row's context, then its t block entries, already in the cache).
// grid = (t, H); blockDim a multiple of 32. Dynamic shared memory: 2 * r floats.
// q: [t, H * (nope + rope)] (rope part rotated); cache: [visible, r + rope];
// kv_b: [H * (nope + v), r]; scores: [t, H, visible] fp32 scratch; out: [t, H * v].
extern "C" __global__ void mla_attend_block(const __nv_bfloat16 *q, const __nv_bfloat16 *cache,
                                            const __nv_bfloat16 *kv_b, float *scores, __nv_bfloat16 *out,
                                            int visible, int H, int nope, int rope, int vdim, int r, float scale) {
    kernel_entry();
    extern __shared__ float sm[];
    float *q_lat = sm, *o_lat = sm + r;
    int ti = blockIdx.x, h = blockIdx.y;
    int qh = nope + rope, ld_ = r + rope, per_head = nope + vdim;
    const __nv_bfloat16 *qrow = q + ((long)ti * H + h) * qh;
    // q_lat = bf(W_UK^T q_nope).
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < nope; i++) acc += ld(qrow, i) * ld(kv_b, (long)(h * per_head + i) * r + c);
        q_lat[c] = bf_round(acc);
    }
    __syncthreads();
    float *sc = scores + ((long)ti * H + h) * visible;
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
    // o_lat = bf(sum_pos p_pos c_pos), ascending positions per channel.
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        float acc = 0.0f;
        for (int pos = 0; pos < visible; pos++) acc += (sc[pos] / total) * ld(cache, (long)pos * ld_ + c);
        o_lat[c] = bf_round(acc);
    }
    __syncthreads();
    // o = bf(W_UV o_lat).
    __nv_bfloat16 *orow = out + ((long)ti * H + h) * vdim;
    for (int jw = warp; jw < vdim; jw += warps) {
        const __nv_bfloat16 *wrow = kv_b + (long)(h * per_head + nope + jw) * r;
        float acc = 0.0f;
        for (int c = lane; c < r; c += 32) acc += ld(wrow, c) * o_lat[c];
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) orow[jw] = __float2bfloat16_rn(acc);
    }
}

// Markov step k of every row (dspark.md §1.2, §2.1), one warp per vocabulary entry:
//   e = W1[x_{k-1}] (x_0 = the anchor), logits[t, v] = U[t, v] + bf(W2[v] . e) (fp32), or -inf where
//   the token mask (bit v % 32 of word v / 32 set: allowed; null: all allowed) forbids v,
//   conf[t] = sigmoid(w[:d] . h_t + w[d:] . e + b) (computed by block x = 0),
// with t = base[row] + k the row's block position k. Rows with count[row] <= k are skipped.
// U: [N, V] bf16; hidden: [N, d]; w1, w2: [V, r]; cw: [d + r]; tokens: [R, stride] (column 0 = the
// anchor, column k + 1 = draft k); logits: [N, V] fp32; conf: [N]. grid = (ceil(V / warps), R).
extern "C" __global__ void markov_step(int k, const __nv_bfloat16 *U, const __nv_bfloat16 *hidden,
                                       const __nv_bfloat16 *w1, const __nv_bfloat16 *w2, const __nv_bfloat16 *cw,
                                       float cb, const int *base, const int *count, const u32 *tokens, int stride,
                                       const u32 *mask, float *logits, float *conf, int V, int r, int d) {
    kernel_entry();
    int row = blockIdx.y;
    if (k >= count[row]) return;
    long t = base[row] + k;
    const __nv_bfloat16 *e = w1 + (long)tokens[(long)row * stride + k] * r;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    int v = blockIdx.x * warps + warp;
    if (v < V) {
        const __nv_bfloat16 *wr = w2 + (long)v * r;
        float acc = 0.0f;
        for (int c = lane; c < r; c += 32) acc += ld(wr, c) * ld(e, c);
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        bool allowed = mask == 0 || ((mask[v >> 5] >> (v & 31)) & 1u);
        if (lane == 0) logits[t * V + v] = allowed ? ld(U, t * V + v) + bf_round(acc) : -INF_F;
    }
    if (blockIdx.x == 0) {
        const __nv_bfloat16 *h = hidden + t * d;
        float a = 0.0f, b = 0.0f;
        for (int c = threadIdx.x; c < d; c += blockDim.x) a += ld(cw, c) * ld(h, c);
        for (int c = threadIdx.x; c < r; c += blockDim.x) b += ld(cw, d + c) * ld(e, c);
        a = block_sum(a);
        b = block_sum(b);
        if (threadIdx.x == 0) conf[t] = 1.0f / (1.0f + expf(-(a + b + cb)));
    }
}

// Greedy draft k of every row: tokens[row, k + 1] = argmax_v logits[base[row] + k, v], lowest id on
// ties. Rows with count[row] <= k are skipped. grid = R, 1024 threads.
extern "C" __global__ void argmax_step(int k, const float *logits, const int *base, const int *count, u32 *tokens,
                                       int stride, int V) {
    kernel_entry();
    __shared__ float best_v[1024];
    __shared__ u32 best_i[1024];
    int row = blockIdx.x;
    if (k >= count[row]) return;
    const float *lr = logits + (long)(base[row] + k) * V;
    float bv = -INF_F;
    u32 bi = 0xffffffffu;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float v = lr[i];
        if (v > bv) { bv = v; bi = i; }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = best_v[threadIdx.x + s];
            u32 oi = best_i[threadIdx.x + s];
            if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) tokens[(long)row * stride + k + 1] = best_i[0] == 0xffffffffu ? 0u : best_i[0];
}
