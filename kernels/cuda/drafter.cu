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

// Non-causal MLA of every row's block in two launches: each of a row's t block queries sees every one of the row's
// `visible` cache entries (its context, then its t block entries, already in the cache). The positions are split
// into spans of ATTEND_SPAN (flash decoding): mla_attend_rows computes, per span, the scores, their max, the sum of
// their exps and the latent sum weighted by those exps; mla_attend_merge combines a query's spans in ascending order
// and projects through W_UV. A row's spans depend only on its own `visible`, so no value depends on the rest of the
// batch, and within a block every value keeps the expressions and order of a one-head block (the softmax's strided
// sums and their four-warp tree included), so none depends on hg either.
// q: [N, H * (nope + rope)] (rope part rotated); rows: [R, ATTEND_ROW_WORDS] u64: the row's cache [visible, r + rope]
// (bf16), visible | t << 32, the row's first block query in q / out, the offset of its scores in `scores` (floats),
// the offset of its partials (in (query, span, head) entries, query-major then span then head); kv_b:
// [H * (nope + v), r]; scores: per row [t, H, visible] fp32 scratch; part_ml: per entry the span's max score and sum
// of exps; part_o: per entry [r], the span's sum of exp(score - max) * latent; out: [N, H * v].
#define ATTEND_THREADS 256
#define ATTEND_MAX_HG 8
#define ATTEND_ROW_WORDS 5
#define ATTEND_SPAN 512   // positions per span
#define ATTEND_UNROLL 8   // positions whose loads are issued together (scores per warp, values per channel)
// grid = (largest t * the most spans of a row, H / hg, R), block = ATTEND_THREADS (8 warps); one block serves hg
// heads of one query over one span, so each cache entry of the span is read once for hg heads. Dynamic shared
// memory: hg * r floats.
extern "C" __global__ void __launch_bounds__(ATTEND_THREADS)
    mla_attend_rows(const __nv_bfloat16 *q, const unsigned long long *rows, const __nv_bfloat16 *kv_b, float *scores,
                    float *part_ml, float *part_o, int H, int hg, int nope, int rope, int vdim, int r, int max_spans,
                    float scale) {
    kernel_entry();
    extern __shared__ float sm[];
    __shared__ float part_max[2][4], part_sum[2][4];
    const unsigned long long *row = rows + (long)blockIdx.z * ATTEND_ROW_WORDS;
    int visible = (int)(row[1] & 0xffffffffull), t = (int)(row[1] >> 32);
    int ti = blockIdx.x / max_spans, si = blockIdx.x % max_spans;
    int spans = (visible + ATTEND_SPAN - 1) / ATTEND_SPAN;
    if (ti >= t || si >= spans) return;
    int lo = si * ATTEND_SPAN, hi = min(visible, lo + ATTEND_SPAN);
    const __nv_bfloat16 *cache = (const __nv_bfloat16 *)row[0];
    long tok = (long)row[2] + ti;
    float *sc_row = scores + (long)row[3] + (long)ti * H * visible; // [H, visible] of this query
    long part = (long)row[4] + ((long)ti * spans + si) * H;           // the entry of head 0 of this (query, span)
    int h0 = blockIdx.y * hg;
    int qh = nope + rope, ld_ = r + rope, per_head = nope + vdim;
    float *q_lat = sm;
    const __nv_bfloat16 *qtok = q + tok * H * qh;
    // q_lat[h] = bf(W_UK^T q_nope[h]).
    for (int idx = threadIdx.x; idx < hg * r; idx += blockDim.x) {
        int hl = idx / r, c = idx % r, h = h0 + hl;
        const __nv_bfloat16 *qrow = qtok + (long)h * qh;
        float acc = 0.0f;
        for (int i = 0; i < nope; i++) acc += ld(qrow, i) * ld(kv_b, (long)(h * per_head + i) * r + c);
        q_lat[idx] = bf_round(acc);
    }
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    // ATTEND_UNROLL positions per warp at a time, their products before any store, so the entries' loads overlap.
    for (int p0 = lo + warp; p0 < hi; p0 += warps * ATTEND_UNROLL) {
        for (int hl = 0; hl < hg; hl++) {
            const float *ql = q_lat + hl * r;
            const __nv_bfloat16 *qrow = qtok + (long)(h0 + hl) * qh;
            float a[ATTEND_UNROLL], b[ATTEND_UNROLL];
#pragma unroll
            for (int u = 0; u < ATTEND_UNROLL; u++) {
                int pos = p0 + u * warps;
                a[u] = 0.0f;
                b[u] = 0.0f;
                if (pos < hi) {
                    const __nv_bfloat16 *e = cache + (long)pos * ld_;
                    for (int c = lane; c < r; c += 32) a[u] += ql[c] * ld(e, c);
                    for (int c = lane; c < rope; c += 32) b[u] += ld(qrow, nope + c) * ld(e, r + c);
                }
            }
#pragma unroll
            for (int u = 0; u < ATTEND_UNROLL; u++) {
                for (int o = 16; o > 0; o >>= 1) {
                    a[u] += __shfl_xor_sync(0xffffffffu, a[u], o);
                    b[u] += __shfl_xor_sync(0xffffffffu, b[u], o);
                }
                int pos = p0 + u * warps;
                if (lane == 0 && pos < hi) sc_row[(long)(h0 + hl) * visible + pos] = scale * (a[u] + b[u]);
            }
        }
    }
    __syncthreads();
    // The span's softmax partials per head, two heads at a time: threads 0..127 and 128..255 each act as one
    // 128-thread block. The scores become exp(score - max).
    int g = threadIdx.x >> 7, vt = threadIdx.x & 127, gw = (threadIdx.x >> 5) & 3;
    for (int hb = 0; hb < hg; hb += 2) {
        int hl = hb + g;
        float *sc = sc_row + (long)(h0 + hl) * visible;
        float m = -INF_F;
        if (hl < hg)
            for (int pos = lo + vt; pos < hi; pos += 128) m = fmaxf(m, sc[pos]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) part_max[g][gw] = m;
        __syncthreads();
        m = fmaxf(fmaxf(part_max[g][0], part_max[g][1]), fmaxf(part_max[g][2], part_max[g][3]));
        float sum = 0.0f;
        if (hl < hg)
            for (int pos = lo + vt; pos < hi; pos += 128) {
                float x = expf(sc[pos] - m);
                sc[pos] = x;
                sum += x;
            }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) part_sum[g][gw] = sum;
        __syncthreads();
        if (vt == 0 && hl < hg) {
            part_ml[(part + h0 + hl) * 2] = m;
            part_ml[(part + h0 + hl) * 2 + 1] = (part_sum[g][0] + part_sum[g][2]) + (part_sum[g][1] + part_sum[g][3]);
        }
        __syncthreads();
    }
    // part_o[h] = sum_pos exp(score - max) c_pos, ascending positions per channel, every head from one read of the
    // entry.
    for (int c = threadIdx.x; c < r; c += blockDim.x) {
        float acc[ATTEND_MAX_HG];
#pragma unroll
        for (int hl = 0; hl < ATTEND_MAX_HG; hl++) acc[hl] = 0.0f;
        // ATTEND_UNROLL entries loaded ahead of their products, added in ascending order all the same.
        int pos = lo;
        for (; pos + ATTEND_UNROLL <= hi; pos += ATTEND_UNROLL) {
            float v[ATTEND_UNROLL];
#pragma unroll
            for (int u = 0; u < ATTEND_UNROLL; u++) v[u] = ld(cache, (long)(pos + u) * ld_ + c);
#pragma unroll
            for (int u = 0; u < ATTEND_UNROLL; u++)
#pragma unroll
                for (int hl = 0; hl < ATTEND_MAX_HG; hl++)
                    if (hl < hg) acc[hl] += sc_row[(long)(h0 + hl) * visible + pos + u] * v[u];
        }
        for (; pos < hi; pos++) {
            float v = ld(cache, (long)pos * ld_ + c);
#pragma unroll
            for (int hl = 0; hl < ATTEND_MAX_HG; hl++)
                if (hl < hg) acc[hl] += sc_row[(long)(h0 + hl) * visible + pos] * v;
        }
#pragma unroll
        for (int hl = 0; hl < ATTEND_MAX_HG; hl++)
            if (hl < hg) part_o[(part + h0 + hl) * r + c] = acc[hl];
    }
}

// A query's spans combined, in ascending order: o_lat[h] = bf(sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s) with M
// the largest span max, then o[h] = bf(W_UV o_lat[h]). grid = (largest t, H / hg, R), block = ATTEND_THREADS; dynamic
// shared memory: hg * r floats. Arguments as mla_attend_rows.
extern "C" __global__ void __launch_bounds__(ATTEND_THREADS)
    mla_attend_merge(const unsigned long long *rows, const __nv_bfloat16 *kv_b, const float *part_ml,
                     const float *part_o, __nv_bfloat16 *out, int H, int hg, int nope, int vdim, int r) {
    kernel_entry();
    extern __shared__ float sm[];
    const unsigned long long *row = rows + (long)blockIdx.z * ATTEND_ROW_WORDS;
    int visible = (int)(row[1] & 0xffffffffull), t = (int)(row[1] >> 32);
    int ti = blockIdx.x;
    if (ti >= t) return;
    int spans = (visible + ATTEND_SPAN - 1) / ATTEND_SPAN;
    long tok = (long)row[2] + ti;
    long part = (long)row[4] + (long)ti * spans * H; // the entry of (this query, span 0, head 0)
    int h0 = blockIdx.y * hg, per_head = nope + vdim;
    float *o_lat = sm;
    for (int idx = threadIdx.x; idx < hg * r; idx += blockDim.x) {
        int hl = idx / r, c = idx % r, h = h0 + hl;
        float top = -INF_F;
        for (int s = 0; s < spans; s++) top = fmaxf(top, part_ml[(part + (long)s * H + h) * 2]);
        float total = 0.0f, acc = 0.0f;
        for (int s = 0; s < spans; s++) {
            long e = part + (long)s * H + h;
            float w = expf(part_ml[e * 2] - top);
            total += w * part_ml[e * 2 + 1];
            acc += w * part_o[e * r + c];
        }
        o_lat[idx] = bf_round(acc / total);
    }
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    // o[h] = bf(W_UV o_lat[h]).
    for (int j = warp; j < hg * vdim; j += warps) {
        int hl = j / vdim, jw = j % vdim, h = h0 + hl;
        const __nv_bfloat16 *wrow = kv_b + (long)(h * per_head + nope + jw) * r;
        const float *ol = o_lat + hl * r;
        float acc = 0.0f;
        for (int c = lane; c < r; c += 32) acc += ld(wrow, c) * ol[c];
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) out[(tok * H + h) * vdim + jw] = __float2bfloat16_rn(acc);
    }
}

// Markov step k of every row (dspark.md §1.2, §2.1):
//   e = W1[x_{k-1}] (x_0 = the anchor), logits[t, v] = U[t, v] + bf(W2[v] . e) (fp32), or -inf where
//   the token mask (bit v % 32 of word v / 32 set: allowed; null: all allowed) forbids v,
//   conf[t] = sigmoid(w[:d] . h_t + w[d:] . e + b) (computed by the blocks with x = 0),
// with t = base[row] + k the row's block position k. Rows with count[row] <= k are skipped.
// One warp per vocabulary entry, MARKOV_PER_WARP entries per warp, for up to MARKOV_ROWS rows: each W2 row is read
// once (into registers) for all of them, and the rows' e vectors once per block (shared memory). The dot products
// run in the lane order of one warp per (row, entry), so a logit does not depend on how rows are grouped.
// U: [N, V] bf16; hidden: [N, d]; w1, w2: [V, r] (r <= MARKOV_MAX_R); cw: [d + r]; tokens: [R, stride] (column 0 =
// the anchor, column k + 1 = draft k); logits: [N, V] fp32; conf: [N].
// grid = (ceil(V / (warps * MARKOV_PER_WARP)), ceil(R / MARKOV_ROWS)); dynamic shared memory: MARKOV_ROWS * r bf16.
#define MARKOV_ROWS 64
#define MARKOV_MAX_R 256
#define MARKOV_PER_WARP 16
extern "C" __global__ void markov_step(int k, const __nv_bfloat16 *U, const __nv_bfloat16 *hidden,
                                       const __nv_bfloat16 *w1, const __nv_bfloat16 *w2, const __nv_bfloat16 *cw,
                                       float cb, const int *base, const int *count, const u32 *tokens, int stride,
                                       const u32 *mask, float *logits, float *conf, int V, int r, int d, int R) {
    kernel_entry();
    extern __shared__ __nv_bfloat16 es[]; // [rows of the group, r]
    int r0 = blockIdx.y * MARKOV_ROWS, nr = min(MARKOV_ROWS, R - r0);
    for (int idx = threadIdx.x; idx < nr * r; idx += blockDim.x) {
        int row = r0 + idx / r;
        es[idx] = k < count[row] ? w1[(long)tokens[(long)row * stride + k] * r + idx % r] : __float2bfloat16_rn(0.0f);
    }
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    int v0 = (blockIdx.x * warps + warp) * MARKOV_PER_WARP;
    for (int u = 0; u < MARKOV_PER_WARP; u++) {
        int v = v0 + u;
        if (v >= V) break;
        const __nv_bfloat16 *wr = w2 + (long)v * r;
        float w[MARKOV_MAX_R / 32];
#pragma unroll
        for (int j = 0; j < MARKOV_MAX_R / 32; j++) w[j] = lane + 32 * j < r ? ld(wr, lane + 32 * j) : 0.0f;
        bool allowed = mask == 0 || ((mask[v >> 5] >> (v & 31)) & 1u);
        for (int i = 0; i < nr; i++) {
            int row = r0 + i;
            if (k >= count[row]) continue;
            long t = base[row] + k;
            const __nv_bfloat16 *e = es + i * r;
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < MARKOV_MAX_R / 32; j++)
                if (lane + 32 * j < r) acc += w[j] * ld(e, lane + 32 * j);
            for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (lane == 0) logits[t * V + v] = allowed ? ld(U, t * V + v) + bf_round(acc) : -INF_F;
        }
    }
    if (blockIdx.x == 0) {
        for (int i = 0; i < nr; i++) {
            int row = r0 + i;
            if (k >= count[row]) continue;
            long t = base[row] + k;
            const __nv_bfloat16 *h = hidden + t * d, *e = es + i * r;
            float a = 0.0f, b = 0.0f;
            for (int c = threadIdx.x; c < d; c += blockDim.x) a += ld(cw, c) * ld(h, c);
            for (int c = threadIdx.x; c < r; c += blockDim.x) b += ld(cw, d + c) * ld(e, c);
            a = block_sum(a);
            b = block_sum(b);
            if (threadIdx.x == 0) conf[t] = 1.0f / (1.0f + expf(-(a + b + cb)));
        }
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
