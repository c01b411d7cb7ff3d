// sparkd: gated NoPE MLA attention for every row of a step, in the absorbed form over the latent cache,
// split over the cache length (flash-decoding, as FlashMLA / flash-decoding's split-KV: partial max / sum
// / values per split, then a merge).
//
// Invariants:
// - The cache holds per token [c (kv_lora, normalised) | k_rot (rope, raw)] in bf16. `mla_norm_append` writes
//   the window's entries first; window token i of a row attends causally over entries 0 ..= first + i.
// - Four launches per layer: mla_norm_append (both input norms and the append), mla_absorb, mla_split,
//   mla_out (merge, W_UV and the sigmoid gate). mla_absorb and mla_out read their weight tile once per block of
//   BLOCK_TOKENS tokens, and every token's sums run in a fixed order that no other token changes.
// - q_lat and o_lat are rounded to bf16 where the CPU reference rounds them (kernels/src/cpu/mla.rs);
//   scores, the softmax and the merge are fp32.
// - How a token's positions are split depends only on that token (its visible length and its row's split
//   span, chosen from the row alone), and splits merge in ascending order: a row's result does not depend
//   on the other rows of the batch.
// Math: shared/reference/k3-architecture.md §2.6 (W_UK absorbed into the query, W_UV applied after).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

// One row's entry of the step table (kernels/src/cuda/attn.rs `MLA_ENTRY`).
#define M_CACHE 0   // bf16 [capacity, r + rope]
#define M_FIRST 1   // entries before the window
#define M_OFFSET 2  // first token of the row in the step
#define M_T 3       // tokens of the row
#define M_SPAN 4    // positions per split
#define MLA_ENTRY 5

// The input norms and the cache append of every token of the step, in one launch: qa_n[tok] =
// rms_norm(qa[tok]) (q_a_layernorm), and cache[first + i] = [rms_norm(kva[tok][0, r)) | kva[tok][r, ld)] for
// window token i of a row (kv_a_layernorm of the c part; k_rot raw). Same sums, same order and same roundings
// as `rms_norm` in common.cu (launched with blockDim 256), so the values equal the unfused launches bit for bit.
// grid = (max t, rows); blockDim 256. qa: [n, q_rank], qa_n: [n, q_rank], kva: [n, width] (bf16), width = r + rope.
extern "C" __global__ void mla_norm_append(const i64 *table, const __nv_bfloat16 *qa, __nv_bfloat16 *qa_n,
                                           const __nv_bfloat16 *q_norm_w, int q_rank, float q_eps,
                                           const __nv_bfloat16 *kva, const __nv_bfloat16 *kv_norm_w, int width, int r,
                                           float kv_eps) {
    kernel_entry();
    const i64 *e = table + (i64)blockIdx.y * MLA_ENTRY;
    int i = blockIdx.x;
    if (i >= e[M_T]) return;  // uniform over the block, before any barrier
    i64 tok = e[M_OFFSET] + i;
    const __nv_bfloat16 *xq = qa + tok * q_rank;
    __nv_bfloat16 *yq = qa_n + tok * q_rank;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < q_rank; c += blockDim.x) { float v = ld(xq, c); ss += v * v; }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)q_rank + q_eps);
    for (int c = threadIdx.x; c < q_rank; c += blockDim.x)
        yq[c] = __float2bfloat16_rn(ld(q_norm_w, c) * bf_round(ld(xq, c) * inv));

    const __nv_bfloat16 *xk = kva + tok * width;
    __nv_bfloat16 *dst = (__nv_bfloat16 *)e[M_CACHE] + (e[M_FIRST] + i) * width;
    ss = 0.0f;
    for (int c = threadIdx.x; c < r; c += blockDim.x) { float v = ld(xk, c); ss += v * v; }
    ss = block_sum(ss);
    inv = 1.0f / sqrtf(ss / (float)r + kv_eps);
    for (int c = threadIdx.x; c < r; c += blockDim.x)
        dst[c] = __float2bfloat16_rn(ld(kv_norm_w, c) * bf_round(ld(xk, c) * inv));
    for (int c = r + threadIdx.x; c < width; c += blockDim.x) dst[c] = xk[c];
}

// Eight bf16 at a 16-byte aligned address, widened to fp32.
__device__ __forceinline__ void load8(const __nv_bfloat16 *p, float *out) {
    uint4 raw = __ldg((const uint4 *)p);
    const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&raw;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float2 f = __bfloat1622float2(h2[k]);
        out[2 * k] = f.x;
        out[2 * k + 1] = f.y;
    }
}

#define ABSORB_COLS 64     // columns of q_lat per block: 8 groups of 8 (one 16-byte load per weight row)
#define ABSORB_SLICES 16   // row slices per block: thread (slice s, group g) reads rows s, s + 16, ...
#define ABSORB_ROWS 8      // rows per slice: nope <= ABSORB_SLICES * ABSORB_ROWS (128)
#define ABSORB_TOKENS 16   // tokens per pass over the block's weight tile (held in registers)
#define ABSORB_WARPS 4     // blockDim 128 = ABSORB_SLICES * 8
#define BLOCK_TOKENS 64    // tokens per block of mla_absorb and mla_out (grid z): decode steps read weights once

// q_lat[tok, h, c] = bf(W_UK_h^T q_nope[tok, h])[c], W_UK_h = kv_b rows [h * per_head, h * per_head + nope).
// Bandwidth-shaped (issue #7): block (h, column tile) reads its [nope, ABSORB_COLS] weight tile ONCE, as 16-byte
// loads all in flight (ABSORB_ROWS per thread), and applies it to every token of the step. A thread's partial
// sums its rows in ascending order; slices are then added by a fixed butterfly within the warp (xor 8, 16) and
// the warps in ascending order: the same order for every token, whatever the batch.
// grid = (H, ceil(r / ABSORB_COLS), ceil(n / BLOCK_TOKENS)); blockDim 128. Needs r % 8 == 0, nope % ABSORB_SLICES == 0,
// nope <= ABSORB_SLICES * ABSORB_ROWS (checked on the host).
// q: [n, H * (nope + rope)]; kv_b: [H * (nope + v), r]; q_lat: [n, H, r] fp32 (bf16 values).
extern "C" __global__ void mla_absorb(const __nv_bfloat16 *q, const __nv_bfloat16 *kv_b, float *q_lat, int n, int H,
                                      int nope, int rope, int vdim, int r) {
    kernel_entry();
    __shared__ float qn[ABSORB_TOKENS][ABSORB_SLICES * ABSORB_ROWS];     // [tokens, nope]
    __shared__ float part[ABSORB_TOKENS][ABSORB_WARPS][ABSORB_COLS];     // per-warp sums
    int h = blockIdx.x, col0 = blockIdx.y * ABSORB_COLS;
    int g = threadIdx.x & 7, s = threadIdx.x >> 3;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int qh = nope + rope, per_head = nope + vdim, rows = nope / ABSORB_SLICES;
    int c0 = col0 + g * 8;
    bool col_ok = c0 < r;  // r % 8 == 0: a group is all in or all out
    float w[ABSORB_ROWS][8];
#pragma unroll
    for (int k = 0; k < ABSORB_ROWS; k++) {
        if (k < rows && col_ok) {
            load8(kv_b + (i64)(h * per_head + s + k * ABSORB_SLICES) * r + c0, w[k]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) w[k][j] = 0.0f;
        }
    }
    int tok_end = min(n, (int)(blockIdx.z + 1) * BLOCK_TOKENS);
    for (int tok0 = blockIdx.z * BLOCK_TOKENS; tok0 < tok_end; tok0 += ABSORB_TOKENS) {
        int tokens = min(ABSORB_TOKENS, tok_end - tok0);
        for (int x = threadIdx.x; x < tokens * nope; x += blockDim.x) {
            int tk = x / nope, i = x % nope;
            qn[tk][i] = ld(q, ((i64)(tok0 + tk) * H + h) * qh + i);
        }
        __syncthreads();
        for (int tk = 0; tk < tokens; tk++) {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; j++) acc[j] = 0.0f;
#pragma unroll
            for (int k = 0; k < ABSORB_ROWS; k++) {
                if (k < rows) {
                    float qv = qn[tk][s + k * ABSORB_SLICES];
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[j] += qv * w[k][j];
                }
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 8);
                acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 16);
            }
            if (lane < 8) {
#pragma unroll
                for (int j = 0; j < 8; j++) part[tk][warp][g * 8 + j] = acc[j];
            }
        }
        __syncthreads();
        for (int x = threadIdx.x; x < tokens * ABSORB_COLS; x += blockDim.x) {
            int tk = x / ABSORB_COLS, col = x % ABSORB_COLS;
            if (col0 + col < r) {
                float v = part[tk][0][col];
#pragma unroll
                for (int wi = 1; wi < ABSORB_WARPS; wi++) v += part[tk][wi][col];
                q_lat[((i64)(tok0 + tk) * H + h) * r + col0 + col] = bf_round(v);
            }
        }
    }
}

#define TILE 64
#define MAX_CH 4      // r <= MAX_CH * blockDim (512, as OUT_MAX_RANK)
#define SCORE_POS 4   // positions a warp scores at once (their loads in flight together)

// One split of one (token, head): positions [s * span, min(visible, (s + 1) * span)) in tiles of TILE with an
// online softmax. grid = (max splits, H, n); blockDim 128; dynamic shared memory (r + rope) floats.
// tok_row: [n] the row of each token. Writes part_o [n, H, splits, r] (unnormalised), part_m / part_l
// [n, H, splits] (max and sum of exp(score - max)); an empty split writes m = -inf, l = 0.
// Latency (issue #7): a warp scores SCORE_POS positions at once and the value sums run positions outermost over
// all of a thread's channels, so that several independent cache loads are in flight; every score and every
// channel still sums in the same order (channels c = lane, lane + 32, .. then the butterfly; positions ascending).
extern "C" __global__ void mla_split(const i64 *table, const i64 *tok_row, const __nv_bfloat16 *q, const float *q_lat,
                                     float *part_o, float *part_m, float *part_l, int H, int nope, int rope, int r,
                                     float scale) {
    kernel_entry();
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
        for (int p0 = warp * SCORE_POS; p0 < len; p0 += warps * SCORE_POS) {
            const __nv_bfloat16 *ent = cache + (i64)(base + p0) * ld_;
            float a[SCORE_POS];
#pragma unroll
            for (int u = 0; u < SCORE_POS; u++) a[u] = 0.0f;
            for (int c = lane; c < ld_; c += 32) {
                float qv = qs[c];
#pragma unroll
                for (int u = 0; u < SCORE_POS; u++)
                    if (p0 + u < len) a[u] += qv * ld(ent, (i64)u * ld_ + c);
            }
#pragma unroll
            for (int u = 0; u < SCORE_POS; u++) {
                for (int o = 16; o > 0; o >>= 1) a[u] += __shfl_xor_sync(0xffffffffu, a[u], o);
                if (lane == 0 && p0 + u < len) sc[p0 + u] = scale * a[u];
            }
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
        for (int x = 0; x < MAX_CH; x++) acc[x] *= factor;
#pragma unroll 4
        for (int p = 0; p < len; p++) {
            float pv = sc[p];
            const __nv_bfloat16 *ent = cache + (i64)(base + p) * ld_;
#pragma unroll
            for (int x = 0; x < MAX_CH; x++) {
                int c = threadIdx.x + x * blockDim.x;
                if (c < r) acc[x] += pv * ld(ent, c);
            }
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

#define OUT_ROWS 4      // rows of W_UV per warp
#define OUT_WARPS 4     // blockDim 128
#define OUT_CHUNKS 2    // 16-byte column chunks per lane and row: r <= 32 * 8 * OUT_CHUNKS (512)
#define OUT_TOKENS 16   // tokens per pass over the block's weight tile
#define OUT_MAX_RANK 512

// The merge of each token's splits and the output, for OUT_ROWS * OUT_WARPS value channels of one head:
// o_lat = bf(sum_s e^{m_s - M} o_s / sum_s e^{m_s - M} l_s) (splits in ascending order, as before), then
// o = bf(W_UV_h o_lat), W_UV_h = kv_b rows [h * per_head + nope, (h + 1) * per_head), and with a gate
// (non-null) out = bf(o * bf(sigmoid(g))) (HF computes the sigmoid in bf16), else out = o.
// Bandwidth-shaped (issue #7): block (h, row tile) reads its [OUT_ROWS * OUT_WARPS, r] weight tile ONCE, as
// 16-byte loads all in flight (OUT_ROWS * OUT_CHUNKS per lane), and applies it to every token of the step; a
// lane sums its columns in ascending order, then the warp adds lanes by a fixed butterfly (xor 16 .. 1).
// grid = (H, ceil(v / (OUT_ROWS * OUT_WARPS)), ceil(n / BLOCK_TOKENS)); blockDim 128. Needs r % 8 == 0, r <= OUT_MAX_RANK.
// part_o: [n, H, splits, r]; part_m / part_l: [n, H, splits]; g, out: [n, H * v] bf16.
extern "C" __global__ void mla_out(const float *part_o, const float *part_m, const float *part_l,
                                   const __nv_bfloat16 *kv_b, const __nv_bfloat16 *g, __nv_bfloat16 *out, int n,
                                   int splits, int H, int nope, int vdim, int r) {
    kernel_entry();
    __shared__ float4 o_lat4[OUT_TOKENS * OUT_MAX_RANK / 4];  // [OUT_TOKENS, r] (16-byte aligned)
    __shared__ float merge_m[OUT_TOKENS], merge_l[OUT_TOKENS];  // each token's maximum and sum over its splits
    float *o_lat = (float *)o_lat4;
    int h = blockIdx.x, per_head = nope + vdim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int j0 = blockIdx.y * (OUT_ROWS * OUT_WARPS) + warp * OUT_ROWS;
    float w[OUT_ROWS][OUT_CHUNKS][8];
#pragma unroll
    for (int q = 0; q < OUT_ROWS; q++) {
#pragma unroll
        for (int m = 0; m < OUT_CHUNKS; m++) {
            int c0 = (lane + 32 * m) * 8;
            if (j0 + q < vdim && c0 < r) {
                load8(kv_b + (i64)(h * per_head + nope + j0 + q) * r + c0, w[q][m]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) w[q][m][e] = 0.0f;
            }
        }
    }
    int tok_end = min(n, (int)(blockIdx.z + 1) * BLOCK_TOKENS);
    for (int tok0 = blockIdx.z * BLOCK_TOKENS; tok0 < tok_end; tok0 += OUT_TOKENS) {
        int tokens = min(OUT_TOKENS, tok_end - tok0);
        // The merges, in two phases, so that no thread walks one token's chain of dependent loads after
        // another's: thread tk takes the maximum and the sum of token tk's splits, then every thread merges 8
        // channels of a token at a time (16-byte loads, issued together), over the splits in ascending order.
        if (threadIdx.x < tokens) {
            i64 base = ((i64)(tok0 + threadIdx.x) * H + h) * splits;
            float M = -INF_F;
            for (int s = 0; s < splits; s++) M = fmaxf(M, part_m[base + s]);
            float L = 0.0f;
            for (int s = 0; s < splits; s++)
                if (part_l[base + s] > 0.0f) L += expf(part_m[base + s] - M) * part_l[base + s];
            merge_m[threadIdx.x] = M;
            merge_l[threadIdx.x] = L;
        }
        __syncthreads();
        for (int x0 = threadIdx.x * 8; x0 < tokens * r; x0 += blockDim.x * 8) {
            int tk = x0 / r, c0 = x0 - tk * r;  // r % 8 == 0: the 8 channels belong to one token
            i64 base = ((i64)(tok0 + tk) * H + h) * splits;
            float M = merge_m[tk], acc[8];
#pragma unroll
            for (int u = 0; u < 8; u++) acc[u] = 0.0f;
            for (int s = 0; s < splits; s++) {
                if (part_l[base + s] > 0.0f) {
                    float f = expf(part_m[base + s] - M);
                    const float4 *o = (const float4 *)(part_o + (base + s) * r + c0);
                    float4 lo = o[0], hi = o[1];
                    float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                    for (int u = 0; u < 8; u++) acc[u] += f * v[u];
                }
            }
            float L = merge_l[tk];
#pragma unroll
            for (int u = 0; u < 8; u++) o_lat[tk * r + c0 + u] = bf_round(acc[u] / L);
        }
        __syncthreads();
        for (int tk = 0; tk < tokens; tk++) {
            float acc[OUT_ROWS];
#pragma unroll
            for (int q = 0; q < OUT_ROWS; q++) acc[q] = 0.0f;
#pragma unroll
            for (int m = 0; m < OUT_CHUNKS; m++) {
                int c0 = (lane + 32 * m) * 8;
                if (c0 < r) {
                    float4 lo = *(const float4 *)(o_lat + tk * r + c0);
                    float4 hi = *(const float4 *)(o_lat + tk * r + c0 + 4);
                    float x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                    for (int q = 0; q < OUT_ROWS; q++) {
#pragma unroll
                        for (int e = 0; e < 8; e++) acc[q] += w[q][m][e] * x[e];
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < OUT_ROWS; q++) {
                for (int o = 16; o > 0; o >>= 1) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], o);
            }
            if (lane < OUT_ROWS && j0 + lane < vdim) {
                float a = acc[0];
#pragma unroll
                for (int q = 1; q < OUT_ROWS; q++)
                    if (lane == q) a = acc[q];
                i64 idx = ((i64)(tok0 + tk) * H + h) * vdim + j0 + lane;
                __nv_bfloat16 o = __float2bfloat16_rn(a);
                if (g) o = __float2bfloat16_rn(__bfloat162float(o) * bf_round(sigmoidf_(ld(g, idx))));
                out[idx] = o;
            }
        }
        __syncthreads();
    }
}
