// sparkd: elementwise and per-row kernels of the K3 forward (embedding gather, RMSNorm, AttnRes read,
// residual add, the three fused, SiTU and row gathers).
//
// Invariants: activations between ops are bf16 (the values the CPU reference rounds with `Real::act`);
// every reduction runs in fp32; each kernel rounds its output once, where the CPU reference does.
// - A per-row kernel's thread owns the columns threadIdx.x + i * blockDim.x of its block's window of the row
//   (the whole row, or one contiguous window per block in the cluster forms) and sums them in ascending i.
//   Its loops fetch ROW_BATCH of those columns into registers before using any (a row is one block, or one
//   cluster, at decode sizes, so a loop that waited for each load in turn would be bound by memory latency);
//   the order of every sum is the same as a one-column-at-a-time loop's. Block sums run in block_sum's fixed
//   order, and a cluster's block sums meet in rank order: a row's result never depends on the batch.
// - attn_res_norm_cluster differs: its thread owns 8-column chunks of its window, staged in shared memory (see there).
// Math: shared/reference/k3-architecture.md §2.2 (AttnRes), §2.3 (RMSNorm), §2.7 (SiTU).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

#define ROW_BATCH 8

// The thread's columns c0 + u * blockDim.x (u < ROW_BATCH) of a row of `d`, as floats (0 past d).
__device__ __forceinline__ void load_cols(const __nv_bfloat16 *row, int c0, int d, float (&v)[ROW_BATCH]) {
#pragma unroll
    for (int u = 0; u < ROW_BATCH; u++) {
        int c = c0 + u * blockDim.x;
        v[u] = c < d ? ld(row, c) : 0.0f;
    }
}

// The same for a raw copy.
__device__ __forceinline__ void copy_row(const __nv_bfloat16 *src, __nv_bfloat16 *dst, int d) {
    for (int c0 = threadIdx.x; c0 < d; c0 += ROW_BATCH * blockDim.x) {
        __nv_bfloat16 v[ROW_BATCH];
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c < d) v[u] = src[c];
        }
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c < d) dst[c] = v[u];
        }
    }
}

// out[i, :] = table[tokens[i], :]; grid = n tokens.
extern "C" __global__ void embed_gather(const __nv_bfloat16 *table, const u32 *tokens, __nv_bfloat16 *out, int d) {
    kernel_entry();
    copy_row(table + (long)tokens[blockIdx.x] * d, out + (long)blockIdx.x * d, d);
}

// KimiRMSNorm: y = bf(w * bf(x * rsqrt(mean(x^2) + eps))); grid = rows; rows are strided so that a
// prefix of a wider row (the MLA latent) can be normalised in place.
extern "C" __global__ void rms_norm(const __nv_bfloat16 *x, long x_stride, const __nv_bfloat16 *w,
                                    __nv_bfloat16 *y, long y_stride, int dim, float eps) {
    kernel_entry();
    const __nv_bfloat16 *xr = x + blockIdx.x * x_stride;
    __nv_bfloat16 *yr = y + blockIdx.x * y_stride;
    float ss = 0.0f;
    for (int c0 = threadIdx.x; c0 < dim; c0 += ROW_BATCH * blockDim.x) {
        float v[ROW_BATCH];
        load_cols(xr, c0, dim, v);
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++)
            if (c0 + u * (int)blockDim.x < dim) ss += v[u] * v[u];
    }
    ss = block_sum(ss);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int c0 = threadIdx.x; c0 < dim; c0 += ROW_BATCH * blockDim.x) {
        float v[ROW_BATCH], g[ROW_BATCH];
        load_cols(xr, c0, dim, v);
        load_cols(w, c0, dim, g);
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c < dim) yr[c] = __float2bfloat16_rn(g[u] * bf_round(v[u] * r));
        }
    }
}

// block_sum of each of N values at once: the same butterflies and the same per-warp partials, summed in the same
// order, as N calls of block_sum, with one pair of barriers instead of N.
template <int N>
__device__ __forceinline__ void block_sums(float (&v)[N]) {
    __shared__ float partial[N][32];
#pragma unroll
    for (int i = 0; i < N; i++)
        for (int o = 16; o > 0; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < N; i++) partial[i][warp] = v[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; i++) {
        float t = lane < warps ? partial[i][lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        v[i] = t;
    }
}

// Sources whose dot products one pass over the columns computes together.
#define SRC_BATCH 4

// The block's sums over the `w` columns of a window of token t (each row pointer below already at the window's
// first column): dot(v_i, q) into dot[i] and sum(v_i^2) into sq[i] for each of the nsrc sources, where source i's
// window starts at src + i * slot. Shared-memory outputs, written by thread 0 and visible after the caller's
// barrier. Each source's sums run over the thread's columns in order, as for one source at a time; SRC_BATCH
// sources share a pass.
__device__ __forceinline__ void attn_res_sums(const __nv_bfloat16 *src, long slot, int nsrc, const float *q, int w,
                                              float *dot, float *sq) {
    for (int i0 = 0; i0 < nsrc; i0 += SRC_BATCH) {
        float sums[2 * SRC_BATCH];  // dot(v_i, q) then sum(v_i^2) of sources i0 ..
#pragma unroll
        for (int s = 0; s < 2 * SRC_BATCH; s++) sums[s] = 0.0f;
        for (int c0 = threadIdx.x; c0 < w; c0 += ROW_BATCH * blockDim.x) {
            float qv[ROW_BATCH];
#pragma unroll
            for (int u = 0; u < ROW_BATCH; u++) {
                int c = c0 + u * blockDim.x;
                qv[u] = c < w ? q[c] : 0.0f;
            }
#pragma unroll
            for (int s = 0; s < SRC_BATCH; s++) {
                if (i0 + s >= nsrc) break;
                float x[ROW_BATCH];
                load_cols(src + (i0 + s) * slot, c0, w, x);
#pragma unroll
                for (int u = 0; u < ROW_BATCH; u++)
                    if (c0 + u * (int)blockDim.x < w) {
                        sums[s] += x[u] * qv[u];
                        sums[SRC_BATCH + s] += x[u] * x[u];
                    }
            }
        }
        block_sums(sums);
        if (threadIdx.x == 0)
            for (int s = 0; s < SRC_BATCH && i0 + s < nsrc; s++) {
                dot[i0 + s] = sums[s];
                sq[i0 + s] = sums[SRC_BATCH + s];
            }
    }
}

// The AttnRes softmax weights from the scores in shared memory (every thread gets all nsrc of them).
__device__ __forceinline__ void attn_res_softmax(const float *score, int nsrc, float p[64]) {
    float m = score[0];
    for (int i = 1; i < nsrc; i++) m = fmaxf(m, score[i]);
    float total = 0.0f;
    for (int i = 0; i < nsrc; i++) { p[i] = expf(score[i] - m); total += p[i]; }
    for (int i = 0; i < nsrc; i++) p[i] = p[i] / total;
}

// The AttnRes softmax weights of token t over its nsrc sources (fp32 island; every thread gets all of them):
// p[i] = softmax_i(dot(v_i, q) * rsqrt(mean(v_i^2) + eps)). `score` is the caller's shared [64].
__device__ __forceinline__ void attn_res_weights(const __nv_bfloat16 *sources, long slot, int nsrc, const float *q,
                                                 long t, int d, float eps, float *score, float p[64]) {
    __shared__ float sq[64];
    attn_res_sums(sources + t * d, slot, nsrc, q, d, score, sq);
    __syncthreads();
    if (threadIdx.x < nsrc) score[threadIdx.x] *= 1.0f / sqrtf(sq[threadIdx.x] / (float)d + eps);
    __syncthreads();
    attn_res_softmax(score, nsrc, p);
}

// The thread's columns c0 + u * blockDim.x of sum_i p[i] * source i over a window of `w` columns, source i's
// window at src + i * slot (each column summed over the sources in ascending order; 0 past w).
__device__ __forceinline__ void weighted_cols(const __nv_bfloat16 *src, long slot, int nsrc, const float *p, int c0,
                                              int w, float (&acc)[ROW_BATCH]) {
#pragma unroll
    for (int u = 0; u < ROW_BATCH; u++) acc[u] = 0.0f;
    for (int i = 0; i < nsrc; i++) {
        float v[ROW_BATCH];
        load_cols(src + i * slot, c0, w, v);
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) acc[u] += p[i] * v[u];
    }
}

// The live source (the last of nsrc, window at `live`) becomes bf(live + addend) over a window of `w` columns, in
// the threads' column order (each thread later reads back only the columns it wrote).
__device__ __forceinline__ void add_window(__nv_bfloat16 *live, const __nv_bfloat16 *addend, int w) {
    for (int c0 = threadIdx.x; c0 < w; c0 += ROW_BATCH * blockDim.x) {
        float a[ROW_BATCH], b[ROW_BATCH];
        load_cols(live, c0, w, a);
        load_cols(addend, c0, w, b);
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c < w) live[c] = __float2bfloat16_rn(a[u] + b[u]);
        }
    }
}

// The read of a window of `w` columns with weights p: read[c] = bf(sum_i p_i v_i) (shared), read_out[c] likewise when
// given; returns the thread's part of the sum of read[c]^2.
__device__ __forceinline__ float read_window(const __nv_bfloat16 *src, long slot, int nsrc, const float *p, int w,
                                             float *read, __nv_bfloat16 *read_out) {
    float ss = 0.0f;
    for (int c0 = threadIdx.x; c0 < w; c0 += ROW_BATCH * blockDim.x) {
        float acc[ROW_BATCH];
        weighted_cols(src, slot, nsrc, p, c0, w, acc);
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c >= w) continue;
            float v = bf_round(acc[u]);
            read[c] = v;
            if (read_out != nullptr) read_out[c] = __float2bfloat16_rn(acc[u]);
            ss += v * v;
        }
    }
    return ss;
}

// out[c] = bf(norm_w[c] * bf(read[c] * r)) over a window of `w` columns.
__device__ __forceinline__ void norm_window(const float *read, const __nv_bfloat16 *norm_w, float r, int w,
                                            __nv_bfloat16 *out) {
    for (int c0 = threadIdx.x; c0 < w; c0 += ROW_BATCH * blockDim.x) {
        float g[ROW_BATCH];
        load_cols(norm_w, c0, w, g);
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c < w) out[c] = __float2bfloat16_rn(g[u] * bf_round(read[c] * r));
        }
    }
}

// AttnRes depth-wise softmax read (fp32 island). `sources` holds `nsrc` slots of [n, d] at stride
// `slot`, sealed blocks first and the live sum last; q is the folded pseudo-query [d].
// out[t] = bf(sum_i softmax_i(dot(v_i, q) * rsqrt(mean(v_i^2) + eps)) * v_i); grid = n tokens.
extern "C" __global__ void attn_res_read(const __nv_bfloat16 *sources, long slot, int nsrc, const float *q,
                                         __nv_bfloat16 *out, int d, float eps) {
    kernel_entry();
    __shared__ float score[64];
    long t = blockIdx.x;
    float p[64];
    attn_res_weights(sources, slot, nsrc, q, t, d, eps, score, p);
    for (int c0 = threadIdx.x; c0 < d; c0 += ROW_BATCH * blockDim.x) {
        float acc[ROW_BATCH];
        weighted_cols(sources + t * d, slot, nsrc, p, c0, d, acc);
#pragma unroll
        for (int u = 0; u < ROW_BATCH; u++) {
            int c = c0 + u * blockDim.x;
            if (c < d) out[t * d + c] = __float2bfloat16_rn(acc[u]);
        }
    }
}

// The residual add, AttnRes read and RMSNorm of one token in one kernel: when `addend` is given, the
// live source (the last slot) first becomes bf(live + addend) (written back); then the read as
// attn_res_read (kept in shared memory, bf16-rounded, and written to `read_out` [n, d] when given: the
// DSpark taps), then rms_norm of it with weight `norm_w` into `out` [n, d].
// Bit-identical to add_in_place, attn_res_read and rms_norm in sequence at 256 threads: the same
// per-thread column order and block reductions. grid = n tokens, 256 threads, d floats of shared memory.
extern "C" __global__ void attn_res_norm(__nv_bfloat16 *sources, long slot, int nsrc, const float *q,
                                         const __nv_bfloat16 *addend, const __nv_bfloat16 *norm_w, float norm_eps,
                                         __nv_bfloat16 *out, __nv_bfloat16 *read_out, int d, float eps) {
    kernel_entry();
    extern __shared__ float read[]; // [d]
    __shared__ float score[64];
    long t = blockIdx.x;
    if (addend != nullptr) add_window(sources + (nsrc - 1) * slot + t * d, addend + t * d, d);
    float p[64];
    attn_res_weights(sources, slot, nsrc, q, t, d, eps, score, p);
    float ss = block_sum(read_window(sources + t * d, slot, nsrc, p, d, read, read_out ? read_out + t * d : nullptr));
    norm_window(read, norm_w, 1.0f / sqrtf(ss / (float)d + norm_eps), d, out + t * d);
}

#if __CUDA_ARCH__ >= 900
// ---- attn_res_norm over a cluster of blocks per token, its window staged in shared memory (Hopper and later) ------
// One block per token leaves the fused read bound by one SM's memory latency at decode sizes (20.7 us per launch
// at batch 1 on the H200, ncu; 16 launches per k3-mini step). Here the RES_CLUSTER blocks of a token each take one
// contiguous window of its columns, a multiple of 8 wide. A thread owns 8-column chunks of the window (columns
// 8 (threadIdx.x + j blockDim.x) on, j < RES_CHUNKS): it copies its chunks of every sealed source into shared memory
// with cp.async, all in flight at once, adds the addend to its chunks of the live source, and then reads only its own
// chunks back, for the per-source sums and again for the read, so the launch waits on memory once. The norm weights
// and the pseudo-query are loaded before the grid dependency wait (weights are never written by a kernel).
// The per-source sums, the softmax and the sum of squares of the read meet through the block's warps (fixed
// butterflies, warps in order) and the cluster's blocks (rank order, distributed shared memory). The same math as
// attn_res_norm with its sums in another fixed order: the two differ by rounding, and a token's result never
// depends on the batch.

#define RES_CLUSTER 8  // blocks per token (the portable cluster size); rows.rs's ROW_CLUSTER (its test checks)
#define RES_CHUNKS 2     // 8-column chunks per thread: windows up to 2048 columns (d <= 12288 over 8 blocks)
#define RES_SUM_BATCH 8  // sources whose per-source sums meet in one pass of butterflies

// Element e of 8 bf16 packed as 4 bf16x2 words, as a float.
__device__ __forceinline__ float bf16x8_at(uint4 v, int e) {
    const u32 w = e < 2 ? v.x : e < 4 ? v.y : e < 6 ? v.z : v.w;
    return __uint_as_float(e % 2 ? w & 0xFFFF0000u : w << 16);
}

// Packs 8 floats, each rounded to bf16, into 4 bf16x2 words.
__device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
    u32 h[8];
#pragma unroll
    for (int e = 0; e < 8; e++) h[e] = (u32)__bfloat16_as_ushort(__float2bfloat16_rn(v[e]));
    return make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
}

// The window of each block of a token's cluster: 8-column aligned, RES_CLUSTER of them cover d.
__device__ __forceinline__ int res_span(int d) { return ((d + RES_CLUSTER - 1) / RES_CLUSTER + 7) / 8 * 8; }

// grid = (RES_CLUSTER, n), clusters of (RES_CLUSTER, 1, 1), blockDim 128; dynamic shared memory nsrc res_span(d)
// bf16. d and slot must be multiples of 8, so that every window is whole 16-byte chunks. Arguments as attn_res_norm.
extern "C" __global__ void __cluster_dims__(RES_CLUSTER, 1, 1) __launch_bounds__(128)
    attn_res_norm_cluster(__nv_bfloat16 *sources, long slot, int nsrc, const float *q, const __nv_bfloat16 *addend,
                          const __nv_bfloat16 *norm_w, float norm_eps, __nv_bfloat16 *out, __nv_bfloat16 *read_out,
                          int d, float eps) {
    extern __shared__ __align__(16) unsigned char staged[];  // [nsrc][span] bf16: this block's window of every source
    __shared__ float warp_dot[64][4], warp_sq[64][4];  // per source and warp
    __shared__ float dot[64], sq[64], prob[64], ss_part;
    const int span = res_span(d), lo = min((int)blockIdx.x * span, d);
    const int w = min(lo + span, d) - lo;       // this block's columns [lo, lo + w)
    const long at = blockIdx.y * (long)d + lo;  // the window's first element in a [n, d] tensor
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int col[RES_CHUNKS];  // each chunk's first column in the window
    bool owned[RES_CHUNKS];  // the chunk lies in the window
    float4 qv[RES_CHUNKS][2];
    uint4 nw[RES_CHUNKS];
#pragma unroll
    for (int j = 0; j < RES_CHUNKS; j++) {
        col[j] = 8 * (threadIdx.x + j * blockDim.x);
        owned[j] = col[j] < w;
        if (!owned[j]) continue;
        qv[j][0] = *(const float4 *)(q + lo + col[j]);
        qv[j][1] = *(const float4 *)(q + lo + col[j] + 4);
        nw[j] = *(const uint4 *)(norm_w + lo + col[j]);
    }
    kernel_entry();
    const u32 base = smem_addr(staged);
    const int sealed = addend != nullptr ? nsrc - 1 : nsrc;
    for (int i = 0; i < sealed; i++)
#pragma unroll
        for (int j = 0; j < RES_CHUNKS; j++)
            if (owned[j]) cp_async16_shared(base + 2 * (i * span + col[j]), sources + i * slot + at + col[j], 16u);
    cp_async_commit();
    if (addend != nullptr) {
        __nv_bfloat16 *live = sources + (nsrc - 1) * slot + at;
#pragma unroll
        for (int j = 0; j < RES_CHUNKS; j++) {
            if (!owned[j]) continue;
            uint4 a = *(const uint4 *)(live + col[j]), b = *(const uint4 *)(addend + at + col[j]);
            float sum[8];
#pragma unroll
            for (int e = 0; e < 8; e++) sum[e] = bf16x8_at(a, e) + bf16x8_at(b, e);
            uint4 v = pack_bf16x8(sum);
            *(uint4 *)(live + col[j]) = v;
            *(uint4 *)(staged + 2 * ((nsrc - 1) * span + col[j])) = v;
        }
    }
    cp_async_wait<0>();  // this thread's chunks are in; no other thread's are read
    // The per-source sums, RES_SUM_BATCH sources at a time so that their butterflies overlap.
    for (int i0 = 0; i0 < nsrc; i0 += RES_SUM_BATCH) {
        float ds[RES_SUM_BATCH], ss[RES_SUM_BATCH];
#pragma unroll
        for (int b = 0; b < RES_SUM_BATCH; b++) {
            ds[b] = 0.0f;
            ss[b] = 0.0f;
            if (i0 + b >= nsrc) continue;
#pragma unroll
            for (int j = 0; j < RES_CHUNKS; j++) {
                if (!owned[j]) continue;
                uint4 x = *(const uint4 *)(staged + 2 * ((i0 + b) * span + col[j]));
                const float qs[8] = {qv[j][0].x, qv[j][0].y, qv[j][0].z, qv[j][0].w,
                                     qv[j][1].x, qv[j][1].y, qv[j][1].z, qv[j][1].w};
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    float v = bf16x8_at(x, e);
                    ds[b] += v * qs[e];
                    ss[b] += v * v;
                }
            }
        }
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int b = 0; b < RES_SUM_BATCH; b++) {
                ds[b] += __shfl_xor_sync(0xffffffffu, ds[b], o);
                ss[b] += __shfl_xor_sync(0xffffffffu, ss[b], o);
            }
        if (lane == 0)
#pragma unroll
            for (int b = 0; b < RES_SUM_BATCH; b++)
                if (i0 + b < nsrc) {
                    warp_dot[i0 + b][warp] = ds[b];
                    warp_sq[i0 + b][warp] = ss[b];
                }
    }
    __syncthreads();
    const int warps = blockDim.x >> 5;
    if (threadIdx.x < nsrc) {
        float ds = 0.0f, ss = 0.0f;
        for (int v = 0; v < warps; v++) {
            ds += warp_dot[threadIdx.x][v];
            ss += warp_sq[threadIdx.x][v];
        }
        dot[threadIdx.x] = ds;
        sq[threadIdx.x] = ss;
    }
    cluster_sync();  // every block's per-source sums are in its shared memory
    if (warp == 0) {
        // The softmax over the sources in warp 0: lane l takes sources l and l + 32.
        const float neg_inf = __int_as_float(0xff800000);
        float score[2], m = neg_inf;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int i = lane + 32 * h;
            score[h] = neg_inf;
            if (i < nsrc) {
                float total_sq = cluster_sum<RES_CLUSTER>(sq + i);
                score[h] = cluster_sum<RES_CLUSTER>(dot + i) * (1.0f / sqrtf(total_sq / (float)d + eps));
            }
            m = fmaxf(m, score[h]);
        }
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float e[2], total = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            e[h] = lane + 32 * h < nsrc ? expf(score[h] - m) : 0.0f;
            total += e[h];
        }
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
#pragma unroll
        for (int h = 0; h < 2; h++)
            if (lane + 32 * h < nsrc) prob[lane + 32 * h] = e[h] / total;
    }
    __syncthreads();
    float rd[RES_CHUNKS][8], ss = 0.0f;
#pragma unroll
    for (int j = 0; j < RES_CHUNKS; j++) {
#pragma unroll
        for (int e = 0; e < 8; e++) rd[j][e] = 0.0f;
        if (!owned[j]) continue;
#pragma unroll 4
        for (int i = 0; i < nsrc; i++) {
            const float p = prob[i];
            uint4 x = *(const uint4 *)(staged + 2 * (i * span + col[j]));
#pragma unroll
            for (int e = 0; e < 8; e++) rd[j][e] += p * bf16x8_at(x, e);
        }
        if (read_out != nullptr) *(uint4 *)(read_out + at + col[j]) = pack_bf16x8(rd[j]);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            rd[j][e] = bf_round(rd[j][e]);
            ss += rd[j][e] * rd[j][e];
        }
    }
    ss = block_sum(ss);
    if (threadIdx.x == 0) ss_part = ss;
    cluster_sync();  // every block's sum of squares is in its shared memory
    const float r = 1.0f / sqrtf(cluster_sum<RES_CLUSTER>(&ss_part) / (float)d + norm_eps);
#pragma unroll
    for (int j = 0; j < RES_CHUNKS; j++) {
        if (!owned[j]) continue;
        float o[8];
#pragma unroll
        for (int e = 0; e < 8; e++) o[e] = bf16x8_at(nw[j], e) * bf_round(rd[j][e] * r);
        *(uint4 *)(out + at + col[j]) = pack_bf16x8(o);
    }
    cluster_sync();  // no block leaves while another may still read its shared memory
}
#endif

// a = bf(a + b) (the bf16 residual add).
extern "C" __global__ void add_in_place(__nv_bfloat16 *a, const __nv_bfloat16 *b, long n) {
    kernel_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        a[i] = __float2bfloat16_rn(ld(a, i) + ld(b, i));
}

// SiTU (fp32 island): out = bf([beta tanh(g/beta) sigmoid(g)] * [lbeta tanh(u/lbeta)]).
extern "C" __global__ void situ(const __nv_bfloat16 *g, const __nv_bfloat16 *u, __nv_bfloat16 *out, long n,
                                float beta, float lbeta) {
    kernel_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float gv = ld(g, i), uv = ld(u, i);
        out[i] = __float2bfloat16_rn((beta * tanhf(gv / beta) * sigmoidf_(gv)) * (lbeta * tanhf(uv / lbeta)));
    }
}

// out[s, j, :] = src[s, rows[j], :] for every slot s; grid = (rows, slots).
extern "C" __global__ void gather_rows(const __nv_bfloat16 *src, long src_slot, const u32 *rows, __nv_bfloat16 *out,
                                       long out_slot, int d) {
    kernel_entry();
    copy_row(src + blockIdx.y * src_slot + (long)rows[blockIdx.x] * d, out + blockIdx.y * out_slot + (long)blockIdx.x * d, d);
}

// ---- The sharded forward's own kernels (cuda::tp) ----

// A vocabulary-parallel embedding: out[i, :] = table[tokens[i] - first, :] for the ids this rank holds
// (first .. first + rows), zeros for the others, so the group's all-reduce sums exactly one row per token.
// grid = n tokens.
extern "C" __global__ void embed_gather_part(const __nv_bfloat16 *table, const u32 *tokens, __nv_bfloat16 *out, int d,
                                             u32 first, u32 rows) {
    kernel_entry();
    const u32 id = tokens[blockIdx.x];
    __nv_bfloat16 *dst = out + (long)blockIdx.x * d;
    if (id >= first && id - first < rows) {
        copy_row(table + (long)(id - first) * d, dst, d);
    } else {
        for (int c = threadIdx.x; c < d; c += blockDim.x) dst[c] = __float2bfloat16_rn(0.0f);
    }
}

// y = bf(x): a row-parallel projection's all-reduced fp32 sums, rounded once as the unsharded GEMM rounds them.
extern "C" __global__ void round_partial(const float *x, __nv_bfloat16 *y, long n) {
    kernel_entry();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(x[i]);
}

// The all-gathered vocabulary slices of a vocabulary-parallel lm_head, [world, positions, slice], laid out as the
// whole logits [positions, world * slice]: out[p, r * slice + j] = parts[r, p, j]. grid = (positions, world).
extern "C" __global__ void vocab_interleave(const __nv_bfloat16 *parts, __nv_bfloat16 *out, int positions, int slice) {
    kernel_entry();
    const long p = blockIdx.x, r = blockIdx.y;
    copy_row(parts + (r * positions + p) * slice, out + p * (long)gridDim.y * slice + r * slice, slice);
}
