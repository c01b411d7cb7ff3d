// sparkd: gated NoPE MLA attention for every row of a step, in the absorbed form over the latent cache,
// split over the cache length (flash-decoding, as FlashMLA / flash-decoding's split-KV: partial max / sum
// / values per split, then a merge).
//
// Invariants:
// - The cache holds per token [c (kv_lora, normalised) | k_rot (rope, raw)] in bf16. `mla_norm_append` writes
//   the window's entries first; window token i of a row attends causally over entries 0 ..= first + i.
// - Four or five launches per layer: mla_norm_append (both input norms and the append), mla_absorb, the split
//   attention, mla_out (merge, W_UV and the sigmoid gate). The split attention is mla_split_heads (16 heads of a
//   token per cache tile) for one-token rows and mla_split_heads_tokens (16 heads of 4 tokens of a window per
//   tile) for windows, each launched when the step has rows for it, where the shapes allow, from Hopper on; else
//   mla_split (one head per block).
//   mla_absorb and mla_out read their weight tile once per block of BLOCK_TOKENS tokens, and every token's sums
//   run in a fixed order that no other token changes.
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

#define ABSORB_COLS 64       // columns of q_lat per block: one MMA m-tile of 16 per warp
#define ABSORB_WARPS 4       // blockDim 128
#define ABSORB_K 16          // nope is a whole number of MMA k-steps
#define ABSORB_MAX_NOPE 128  // nope <= ABSORB_MAX_NOPE: the A fragments (32 registers) are held for the block's life
#define ABSORB_TOKENS 32     // tokens per pass: four MMA n-tiles
#define ABSORB_W_PAD 8       // bf16 past each staged weight row: ldmatrix's 8 rows land 4 banks apart
#define ABSORB_Q_PAD 8       // bf16 past each staged token row: the B fragments' 8 tokens land 4 banks apart
#define BLOCK_TOKENS 64      // tokens per block of mla_absorb and mla_out (grid z): decode steps read weights once

// q_lat[tok, h, c] = bf(W_UK_h^T q_nope[tok, h])[c], W_UK_h = kv_b rows [h * per_head, h * per_head + nope).
// Bandwidth-shaped (issue #7): block (h, column tile) reads its [nope, ABSORB_COLS] weight tile ONCE, as 16-byte
// loads into shared memory before it waits for the kernel before (the weights are no kernel's output), and holds
// it as MMA A fragments (W_UK^T, columns as rows: ldmatrix with transpose) for every token of the step. The dot
// products run on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulators, k-steps of 16 in ascending
// order); a token's outputs depend only on its own column of the MMAs, so they are the same bits whatever the
// batch.
// grid = (H, ceil(r / ABSORB_COLS), ceil(n / BLOCK_TOKENS)); blockDim 128. Needs r % 8 == 0, nope % ABSORB_K == 0,
// nope <= ABSORB_MAX_NOPE (checked on the host).
// q: [n, H * (nope + rope)]; kv_b: [H * (nope + v), r]; q_lat: [n, H, r] fp32 (bf16 values).
extern "C" __global__ void __launch_bounds__(32 * ABSORB_WARPS)
    mla_absorb(const __nv_bfloat16 *q, const __nv_bfloat16 *kv_b, float *q_lat, int n, int H, int nope, int rope,
               int vdim, int r) {
    __shared__ __align__(16) __nv_bfloat16 ws[ABSORB_MAX_NOPE][ABSORB_COLS + ABSORB_W_PAD];  // [nope, cols]
    __shared__ __align__(16) __nv_bfloat16 qs[ABSORB_TOKENS][ABSORB_MAX_NOPE + ABSORB_Q_PAD]; // [tokens, nope]
    int h = blockIdx.x, col0 = blockIdx.y * ABSORB_COLS;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, fg = lane >> 2, ft = lane & 3;
    int qh = nope + rope, per_head = nope + vdim, ksteps = nope / ABSORB_K;
    // The weight tile, 8 columns per 16-byte load (zeros past r).
    for (int x = threadIdx.x; x < nope * (ABSORB_COLS / 8); x += blockDim.x) {
        int i = x / (ABSORB_COLS / 8), c = (x % (ABSORB_COLS / 8)) * 8;
        *(uint4 *)&ws[i][c] = col0 + c < r ? __ldg((const uint4 *)(kv_b + (i64)(h * per_head + i) * r + col0 + c))
                                           : make_uint4(0u, 0u, 0u, 0u);
    }
    __syncthreads();
    // Warp w's A fragments: columns col0 + 16 w .. + 15 as rows, k-step ks's inputs 16 ks .. + 15. Lanes 8 j .. 8 j
    // + 7 address matrix j: inputs 8 (j / 2) + lane % 8 of the k-step, columns 8 (j % 2) of the tile.
    u32 a[ABSORB_MAX_NOPE / ABSORB_K][4];
    int mj = lane >> 3, mrow = lane & 7;
#pragma unroll
    for (int ks = 0; ks < ABSORB_MAX_NOPE / ABSORB_K; ks++)
        if (ks < ksteps) ldmatrix_x4<true>(a[ks], &ws[ABSORB_K * ks + 8 * (mj >> 1) + mrow][16 * warp + 8 * (mj & 1)]);
    grid_dependency_wait();
    launch_dependents();
    int tok_end = min(n, (int)(blockIdx.z + 1) * BLOCK_TOKENS);
    for (int tok0 = blockIdx.z * BLOCK_TOKENS; tok0 < tok_end; tok0 += ABSORB_TOKENS) {
        int tokens = min(ABSORB_TOKENS, tok_end - tok0);
        __syncthreads();  // every warp is done with the pass before's tokens
        for (int x = threadIdx.x; x < tokens * (nope / 8); x += blockDim.x) {
            int tk = x / (nope / 8), i = (x % (nope / 8)) * 8;
            *(uint4 *)&qs[tk][i] = *(const uint4 *)(q + ((i64)(tok0 + tk) * H + h) * qh + i);
        }
        __syncthreads();
        float acc[ABSORB_TOKENS / 8][4];  // [n-tile][c0..c3]
#pragma unroll
        for (int nt = 0; nt < ABSORB_TOKENS / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < ABSORB_TOKENS / 8; nt++) {
            if (8 * nt >= tokens) break;  // uniform: no token in the n-tile (a token past `tokens` is never stored)
            const __nv_bfloat16 *row = qs[8 * nt + fg];
#pragma unroll
            for (int ks = 0; ks < ABSORB_MAX_NOPE / ABSORB_K; ks++)
                if (ks < ksteps)
                    mma_bf16(acc[nt], a[ks][0], a[ks][1], a[ks][2], a[ks][3],
                             *(const u32 *)(row + ABSORB_K * ks + 2 * ft), *(const u32 *)(row + ABSORB_K * ks + 2 * ft + 8));
        }
        // c0, c1: column 16 w + fg, tokens 2 ft, 2 ft + 1 of the n-tile; c2, c3: column 16 w + fg + 8.
#pragma unroll
        for (int nt = 0; nt < ABSORB_TOKENS / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int tk = 8 * nt + 2 * ft + (e & 1), c = col0 + 16 * warp + fg + 8 * (e >> 1);
                if (tk < tokens && c < r) q_lat[((i64)(tok0 + tk) * H + h) * r + c] = bf_round(acc[nt][e]);
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

#define HEADS_TILE 16    // heads per block of mla_split_heads: one MMA m-tile
#define KV_TILE 64       // cache positions per staged tile: 16 per warp in the scores
#define HEADS_WARPS 4    // blockDim 128
#define HEADS_MAX_NT 16  // value n-tiles (8 channels) per warp: r <= 8 HEADS_MAX_NT HEADS_WARPS (512)
#define ROW_PAD 8        // bf16 past each staged row: rows sit 4 banks apart, so fragment loads are conflict-free
#define HEADS_TOKENS 4   // tokens of a row per block of mla_split_heads_tokens: a warp group of HEADS_WARPS each

#if __CUDA_ARCH__ >= 900
// The staging of a cache tile by TMA bulk copies (one per cache row) completing on an mbarrier (prelude.cuh).
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory, counted on `bar`. The
// proxy fence first orders this thread's earlier generic accesses of shared memory before the copy's writes.
__device__ __forceinline__ void bulk_copy_to_shared(void *dst, const void *src, u32 bytes, unsigned long long *bar) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
// Two bf16 as one fragment register, `lo` in the low half.
__device__ __forceinline__ u32 pack_pair(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return (u32)__bfloat16_as_ushort(lo) | ((u32)__bfloat16_as_ushort(hi) << 16);
}
#endif

// mla_split for HEADS_TILE heads at once (FlashMLA's shape: every cache tile is read once for a group of heads,
// not once per head), and for TOKS consecutive tokens of one row at once (every tile staged once for all of
// them, as FlashMLA packs a window's query tokens with its heads). Scores and values run on the tensor cores:
// S [16 heads, KV_TILE] = Q [16, r + rope] K^T, then O [16, r] += P_hi V + P_lo V, where P_hi = bf16(P) and
// P_lo = bf16(P - P_hi): P keeps 16 bits of mantissa (bf16 P alone, as FlashMLA rounds it, moved k3-tiny's logits
// past validate's bound); the softmax statistics stay fp32. Same partials as mla_split (part_o unnormalised,
// part_m, part_l; an empty split writes m = -inf, l = 0), for the same splits, so mla_out merges either.
// Token group g (warps [4 g, 4 g + 4)) computes token tok0 + g; its warp w scores positions [16 w, 16 w + 16) of
// each tile and owns value channels [w r / 4, (w + 1) r / 4). A score sums over the channels in MMA k-steps of 16
// in ascending order; a value sums the tiles in ascending order and, within a tile, the positions in k-steps of 16:
// a fixed order that no other token or head changes. The block stages the tiles up to its last token's visible
// end; a token's positions past its own end score -inf, so P is exactly 0 there and its sums, maximum and tiles
// are those it has alone (a tile wholly past its end leaves its statistics and values as they were), bit for bit.
// A tile is staged by warp 0 as one TMA bulk copy per cache row, completing on an mbarrier, so the staging costs
// a few instructions per row instead of an address computation and a cp.async per 16 bytes and thread.
// Rows: TOKS = 1 takes the rows of fewer than `group_from` tokens, TOKS > 1 the others, one block per TOKS tokens
// (the blocks of the other tokens return at once).
// grid = (max splits, ceil(H / 16), n); blockDim 128 TOKS; dynamic shared memory heads_shared_bytes (attn.rs):
// Q [16 TOKS, ld + ROW_PAD], the tile [KV_TILE, ld + ROW_PAD], P_hi and P_lo [16, KV_TILE + ROW_PAD] per token,
// bf16. Needs (r + rope) % 16 == 0, r % 32 == 0, r <= 512 and nope % 8 == 0 (checked on the host). Hopper and later
// (TMA and mbarriers): elsewhere the entry points trap, and the host takes mla_split.
template <int TOKS>
__device__ __forceinline__ void split_heads(const i64 *table, const i64 *tok_row, const __nv_bfloat16 *q,
                                            const float *q_lat, float *part_o, float *part_m, float *part_l, int H,
                                            int nope, int rope, int r, float scale, int group_from) {
    kernel_entry();
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) __nv_bfloat16 staged[];
    __shared__ float red_m[TOKS * HEADS_WARPS][HEADS_TILE], red_l[TOKS * HEADS_WARPS][HEADS_TILE];
    __shared__ unsigned long long tile_bar;  // the staged tile's bulk copies; phase k = tile k
    i64 tok0 = blockIdx.z;
    const i64 *e = table + tok_row[tok0] * MLA_ENTRY;
    int t = (int)e[M_T], rel0 = (int)(tok0 - e[M_OFFSET]);
    // Uniform over the block, before any barrier: the rows of the other kernel, and the tokens of another block.
    if (TOKS == 1 ? t >= group_from : (t < group_from || rel0 % TOKS != 0)) return;
    if (threadIdx.x == 0) {
        mbarrier_init(&tile_bar, 1);
        mbarrier_init_fence();
    }
    int ld_ = r + rope, stride = ld_ + ROW_PAD, pstride = KV_TILE + ROW_PAD, qh = nope + rope;
    int toks = min(TOKS, t - rel0);                         // this block's tokens: tok0 .. tok0 + toks - 1
    __nv_bfloat16 *qs = staged;                             // [TOKS HEADS_TILE, stride]
    __nv_bfloat16 *kv = qs + TOKS * HEADS_TILE * stride;    // [KV_TILE, stride]
    int s = blockIdx.x, h0 = blockIdx.y * HEADS_TILE, splits = gridDim.x;
    const __nv_bfloat16 *cache = (const __nv_bfloat16 *)e[M_CACHE];
    int first = (int)e[M_FIRST], span = (int)e[M_SPAN];
    int lo = s * span, end = min(first + rel0 + toks, lo + span);  // the last token's visible end in this split
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    int grp = warp / HEADS_WARPS, wg = warp % HEADS_WARPS;
    // This group's token; a group past the block's tokens sees nothing (its rows of Q are zero, nothing is written).
    i64 tok = tok0 + grp;
    int hi = grp < toks ? min(first + rel0 + grp + 1, lo + span) : lo;
    __nv_bfloat16 *ps = kv + KV_TILE * stride + grp * 2 * HEADS_TILE * pstride;  // P_hi [HEADS_TILE, pstride]
    __nv_bfloat16 *ps_lo = ps + HEADS_TILE * pstride;                            // P_lo [HEADS_TILE, pstride]
    int heads = min(HEADS_TILE, H - h0);
    // Q rows, 8 channels per 16-byte store: q_lat (fp32 holding bf16 values, so exact) then q_rot (r, nope and rope
    // are multiples of 8, so no chunk straddles them and every load is aligned); rows past the last head or token
    // are zero.
    int qchunks = ld_ / 8;
    for (int i = threadIdx.x; i < TOKS * HEADS_TILE * qchunks; i += blockDim.x) {
        int row = i / qchunks, gg = row / HEADS_TILE, hh = row % HEADS_TILE, c = (i % qchunks) * 8;
        i64 qt = tok0 + gg;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (gg < toks && hh < heads && c < r) {
            const float4 *src = (const float4 *)(q_lat + (qt * H + h0 + hh) * r + c);
            float4 x = src[0], y = src[1];
            __nv_bfloat162 b[4] = {__floats2bfloat162_rn(x.x, x.y), __floats2bfloat162_rn(x.z, x.w),
                                   __floats2bfloat162_rn(y.x, y.y), __floats2bfloat162_rn(y.z, y.w)};
            v = *(const uint4 *)b;
        } else if (gg < toks && hh < heads) {
            v = *(const uint4 *)(q + (qt * H + h0 + hh) * qh + nope + c - r);
        }
        *(uint4 *)(qs + row * stride + c) = v;
    }
    int nts = r / (8 * HEADS_WARPS), c0 = wg * nts * 8;  // this warp's value n-tiles and first channel
    float m_run[2] = {-INF_F, -INF_F}, l_run[2] = {0.0f, 0.0f};  // rows g and g + 8
    float acc[HEADS_MAX_NT][4];
#pragma unroll
    for (int nt = 0; nt < HEADS_MAX_NT; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) acc[nt][x] = 0.0f;
    int chunks = ld_ / 8;
    u32 parity = 0;
    for (int base = lo; base < end; base += KV_TILE, parity ^= 1u) {
        int len = min(KV_TILE, end - base), mine = min(KV_TILE, hi - base);  // staged rows; this token's rows
        __syncthreads();  // the tile before is consumed (and, the first time, Q is staged and the barrier set up)
        // Warp 0 stages the tile's len rows, one bulk copy per row (rows are padded in shared memory); the
        // rows past len, read by the value MMAs with P = 0 there, are zeroed so that they hold no NaN.
        if (warp == 0) {
            if (lane == 0) mbarrier_expect(&tile_bar, (u32)(len * ld_ * 2));
            __syncwarp();
            for (int p = lane; p < len; p += 32)
                bulk_copy_to_shared(kv + p * stride, cache + (i64)(base + p) * ld_, (u32)(ld_ * 2), &tile_bar);
        }
        for (int i = threadIdx.x; i < (KV_TILE - len) * chunks; i += blockDim.x)
            *(uint4 *)(kv + (len + i / chunks) * stride + (i % chunks) * 8) = make_uint4(0u, 0u, 0u, 0u);
        mbarrier_wait(&tile_bar, parity);
        __syncthreads();  // the zeroed rows
        // Scores of this warp's 16 positions (two n-tiles): c[0], c[1] row g, c[2], c[3] row g + 8, positions
        // 16 wg + 8 nt + 2 t4 (+1).
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        // ldmatrix rows: A (Q) lane l gives head l % 16, channels + 8 (l / 16); B (K) positions + 8 (l / 16) +
        // l % 8, channels + 8 (l / 8 % 2), so b[0], b[1] are n-tile 0's fragments and b[2], b[3] n-tile 1's.
        const __nv_bfloat16 *q_rows = qs + (grp * HEADS_TILE + (lane & 15)) * stride + (lane >> 4) * 8;
        const __nv_bfloat16 *k_rows = kv + (wg * 16 + (lane >> 4) * 8 + (lane & 7)) * stride + ((lane >> 3) & 1) * 8;
        for (int k0 = 0; k0 < ld_; k0 += 16) {
            u32 a[4], b[4];
            ldmatrix_x4<false>(a, q_rows + k0);
            ldmatrix_x4<false>(b, k_rows + k0);
            mma_bf16(sc[0], a[0], a[1], a[2], a[3], b[0], b[1]);
            mma_bf16(sc[1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
        // Online softmax per head row: the maximum and the sum over the tile by lanes t4, then by the group's warps
        // in order. A token none of whose positions this split has seen yet keeps m = -inf and P = 0.
        float tmax[2] = {-INF_F, -INF_F};
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) {
                int p = wg * 16 + nt * 8 + 2 * t4 + (x & 1);
                sc[nt][x] = p < mine ? scale * sc[nt][x] : -INF_F;
                tmax[x >> 1] = fmaxf(tmax[x >> 1], sc[nt][x]);
            }
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            tmax[rr] = fmaxf(tmax[rr], __shfl_xor_sync(0xffffffffu, tmax[rr], 1));
            tmax[rr] = fmaxf(tmax[rr], __shfl_xor_sync(0xffffffffu, tmax[rr], 2));
            if (t4 == 0) red_m[warp][g + 8 * rr] = tmax[rr];
        }
        __syncthreads();
        float m_new[2], factor[2], tsum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            float mx = red_m[grp * HEADS_WARPS][g + 8 * rr];
#pragma unroll
            for (int w = 1; w < HEADS_WARPS; w++) mx = fmaxf(mx, red_m[grp * HEADS_WARPS + w][g + 8 * rr]);
            m_new[rr] = fmaxf(m_run[rr], mx);
            factor[rr] = m_new[rr] == -INF_F ? 1.0f : expf(m_run[rr] - m_new[rr]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
#pragma unroll
            for (int x = 0; x < 4; x++) {
                sc[nt][x] = m_new[x >> 1] == -INF_F ? 0.0f : expf(sc[nt][x] - m_new[x >> 1]);
                tsum[x >> 1] += sc[nt][x];
            }
            int p = wg * 16 + nt * 8 + 2 * t4;
            __nv_bfloat16 hi_[4], lo_[4];
#pragma unroll
            for (int x = 0; x < 4; x++) {
                hi_[x] = __float2bfloat16_rn(sc[nt][x]);
                lo_[x] = __float2bfloat16_rn(sc[nt][x] - __bfloat162float(hi_[x]));
            }
            *(u32 *)(ps + g * pstride + p) = pack_pair(hi_[0], hi_[1]);
            *(u32 *)(ps + (g + 8) * pstride + p) = pack_pair(hi_[2], hi_[3]);
            *(u32 *)(ps_lo + g * pstride + p) = pack_pair(lo_[0], lo_[1]);
            *(u32 *)(ps_lo + (g + 8) * pstride + p) = pack_pair(lo_[2], lo_[3]);
        }
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            tsum[rr] += __shfl_xor_sync(0xffffffffu, tsum[rr], 1);
            tsum[rr] += __shfl_xor_sync(0xffffffffu, tsum[rr], 2);
            if (t4 == 0) red_l[warp][g + 8 * rr] = tsum[rr];
        }
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            float total = 0.0f;
#pragma unroll
            for (int w = 0; w < HEADS_WARPS; w++) total += red_l[grp * HEADS_WARPS + w][g + 8 * rr];
            l_run[rr] = l_run[rr] * factor[rr] + total;
            m_run[rr] = m_new[rr];
        }
        // O [16, this warp's channels] = factor O + P V; the tile's rows past len are zero (and so is P there).
#pragma unroll
        for (int nt = 0; nt < HEADS_MAX_NT; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) acc[nt][x] *= factor[x >> 1];
        // ldmatrix rows: A (P) as for Q; B (V, transposed) lane l gives position l % 16 and the channels of
        // n-tile nt + l / 16, so b[0], b[1] are n-tile nt's fragments and b[2], b[3] n-tile nt + 1's (the last
        // n-tile again where nts is odd).
        const __nv_bfloat16 *p_rows = ps + (lane & 15) * pstride + (lane >> 4) * 8;
        const __nv_bfloat16 *v_rows = kv + (lane & 15) * stride + c0;
        for (int k0 = 0; k0 < KV_TILE; k0 += 16) {
            u32 a[4], al[4];
            ldmatrix_x4<false>(a, p_rows + k0);
            ldmatrix_x4<false>(al, p_rows + HEADS_TILE * pstride + k0);
#pragma unroll
            for (int nt = 0; nt < HEADS_MAX_NT; nt += 2) {
                if (nt >= nts) break;
                u32 b[4];
                ldmatrix_x4<true>(b, v_rows + k0 * stride + min(nt + (lane >> 4), nts - 1) * 8);
                mma_bf16(acc[nt], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma_bf16(acc[nt], al[0], al[1], al[2], al[3], b[0], b[1]);
                if (nt + 1 < nts) {
                    mma_bf16(acc[nt + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                    mma_bf16(acc[nt + 1], al[0], al[1], al[2], al[3], b[2], b[3]);
                }
            }
        }
    }
    if (grp >= toks) return;
    // c[0], c[1]: head g, channels c0 + 8 nt + 2 t4 (+1); c[2], c[3]: head g + 8.
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        int hh = g + 8 * rr;
        if (hh >= heads) continue;
        i64 part = (tok * H + h0 + hh) * splits + s;
#pragma unroll
        for (int nt = 0; nt < HEADS_MAX_NT; nt++) {
            if (nt >= nts) break;
            float2 pair = make_float2(acc[nt][2 * rr], acc[nt][2 * rr + 1]);
            *(float2 *)(part_o + part * r + c0 + nt * 8 + 2 * t4) = pair;
        }
        if (wg == 0 && t4 == 0) {
            part_m[part] = m_run[rr];
            part_l[part] = l_run[rr];
        }
    }
#else
    __trap();
#endif
}

// One block per (split, 16 heads, token), for the rows of fewer than `group_from` tokens (decode rows).
extern "C" __global__ void __launch_bounds__(32 * HEADS_WARPS)
    mla_split_heads(const i64 *table, const i64 *tok_row, const __nv_bfloat16 *q, const float *q_lat, float *part_o,
                    float *part_m, float *part_l, int H, int nope, int rope, int r, float scale, int group_from) {
    split_heads<1>(table, tok_row, q, q_lat, part_o, part_m, part_l, H, nope, rope, r, scale, group_from);
}

// One block per (split, 16 heads, HEADS_TOKENS tokens of a row), for the rows of at least `group_from` tokens
// (verify windows and prefill chunks).
extern "C" __global__ void __launch_bounds__(32 * HEADS_WARPS * HEADS_TOKENS)
    mla_split_heads_tokens(const i64 *table, const i64 *tok_row, const __nv_bfloat16 *q, const float *q_lat,
                           float *part_o, float *part_m, float *part_l, int H, int nope, int rope, int r, float scale,
                           int group_from) {
    split_heads<HEADS_TOKENS>(table, tok_row, q, q_lat, part_o, part_m, part_l, H, nope, rope, r, scale, group_from);
}

#define OUT_CHANNELS 32 // value channels per block: two MMA m-tiles
#define OUT_WARPS 4     // blockDim 128; warp w takes columns [128 w, 128 w + 128) of o_lat
#define OUT_WARP_COLS 128
#define OUT_CHUNKS 4    // 32-column chunks per warp: one 16-byte piece per lane and row
#define OUT_TOKENS 16   // tokens per pass over the block's weight tile: two MMA n-tiles
#define OUT_MAX_RANK 512   // OUT_WARPS * OUT_WARP_COLS
#define OUT_MAX_SPLITS 64  // MLA_MAX_SPLITS in attn.rs
#define OUT_MIN_BLOCKS 3   // blocks per SM: K3's decode step (96 heads x 4 row tiles) in one wave of 132 SMs

// The merge of each token's splits and the output, for 32 value channels (two MMA m-tiles) of one head:
// o_lat = bf(sum_s e^{m_s - M} o_s / sum_s e^{m_s - M} l_s) (splits in ascending order, as before), then
// o = bf(W_UV_h o_lat), W_UV_h = kv_b rows [h * per_head + nope, (h + 1) * per_head), and with a gate
// (non-null) out = bf(o * bf(sigmoid(g))) (HF computes the sigmoid in bf16), else out = o.
// Bandwidth-shaped (issue #7): block (h, row tile) reads its [32, r] weight tile ONCE, as 16-byte loads all in
// flight, kept as bf16 MMA fragments in registers, before it waits for the kernel before (the weights are no
// kernel's output), and applies it to every token of the step on the tensor cores (mma.sync m16n8k16, bf16 in,
// fp32 accumulators): warp w sums its 128 columns of o_lat in four chunks of 32 (lane (g, t) holds 8 contiguous
// columns 8 t.. of rows g and g + 8, and the token's 16-byte piece of the same columns is its B fragment, as in
// moe.cu's expert kernels), then the four warps' partials are added in warp order. A token's outputs depend only on
// its own column of the MMAs: the same bits whatever the batch.
// Latency: the merge reads every split's m and l at once into shared memory, turns them into factors
// e^{m_s - M} (0 for an empty split), and then sums part_o over the splits with loads that depend on nothing
// but the factors, so several are in flight; empty splits are skipped, as exact zeros they would add nothing.
// grid = (H, ceil(v / OUT_CHANNELS), ceil(n / BLOCK_TOKENS)); blockDim 128. Needs r % 8 == 0, r <= OUT_MAX_RANK and
// splits <= OUT_MAX_SPLITS.
// part_o: [n, H, splits, r]; part_m / part_l: [n, H, splits]; g, out: [n, H * v] bf16.
extern "C" __global__ void __launch_bounds__(32 * OUT_WARPS, OUT_MIN_BLOCKS)
    mla_out(const float *part_o, const float *part_m, const float *part_l, const __nv_bfloat16 *kv_b,
            const __nv_bfloat16 *g, __nv_bfloat16 *out, int n, int splits, int H, int nope, int vdim, int r) {
    __shared__ uint4 o_lat8[OUT_TOKENS * OUT_MAX_RANK / 8];   // [OUT_TOKENS, r] bf16 (its values are bf16)
    __shared__ float split_f[OUT_TOKENS][OUT_MAX_SPLITS];     // m_s, then the factor e^{m_s - M} (0: empty)
    __shared__ float split_l[OUT_TOKENS][OUT_MAX_SPLITS];     // l_s
    __shared__ float merge_l[OUT_TOKENS];                      // each token's sum over its splits
    __shared__ float red[OUT_WARPS][OUT_TOKENS][OUT_CHANNELS]; // each warp's partial outputs [token, channel]
    int h = blockIdx.x, per_head = nope + vdim;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, fg = lane >> 2, ft = lane & 3;
    int j0 = blockIdx.y * OUT_CHANNELS;
    // The A fragments: rows j0 + 16 m + fg + 8 q, columns 128 warp + 32 c + 8 ft .. + 7 (zeros past v and r).
    uint4 w[OUT_CHUNKS][2][2];  // [chunk][m-tile][row fg / fg + 8], 8 bf16 each
#pragma unroll
    for (int c = 0; c < OUT_CHUNKS; c++) {
        int c0 = OUT_WARP_COLS * warp + 32 * c + 8 * ft;
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int q = 0; q < 2; q++) {
                int j = j0 + 16 * m + fg + 8 * q;
                w[c][m][q] = j < vdim && c0 < r ? __ldg((const uint4 *)(kv_b + (i64)(h * per_head + nope + j) * r + c0))
                                                : make_uint4(0u, 0u, 0u, 0u);
            }
    }
    grid_dependency_wait();
    launch_dependents();
    int tok_end = min(n, (int)(blockIdx.z + 1) * BLOCK_TOKENS);
    for (int tok0 = blockIdx.z * BLOCK_TOKENS; tok0 < tok_end; tok0 += OUT_TOKENS) {
        int tokens = min(OUT_TOKENS, tok_end - tok0);
        // The merges, in three phases, so that no thread walks a chain of dependent loads: every thread loads
        // some (token, split) m and l; thread tk takes token tk's maximum, factors and sum (splits in ascending
        // order); then every thread merges 8 channels of a token at a time (16-byte loads, issued together),
        // over the splits in ascending order.
        for (int i = threadIdx.x; i < tokens * splits; i += blockDim.x) {
            int tk = i / splits, s = i - tk * splits;
            i64 part = ((i64)(tok0 + tk) * H + h) * splits + s;
            split_f[tk][s] = part_m[part];
            split_l[tk][s] = part_l[part];
        }
        __syncthreads();
        if (threadIdx.x < tokens) {
            int tk = threadIdx.x;
            float M = -INF_F;
            for (int s = 0; s < splits; s++) M = fmaxf(M, split_f[tk][s]);
            float L = 0.0f;
            for (int s = 0; s < splits; s++) {
                float f = split_l[tk][s] > 0.0f ? expf(split_f[tk][s] - M) : 0.0f;
                split_f[tk][s] = f;
                L += f * split_l[tk][s];
            }
            merge_l[tk] = L;
        }
        __syncthreads();
        for (int x0 = threadIdx.x * 8; x0 < tokens * r; x0 += blockDim.x * 8) {
            int tk = x0 / r, c0 = x0 - tk * r;  // r % 8 == 0: the 8 channels belong to one token
            i64 base = ((i64)(tok0 + tk) * H + h) * splits;
            float acc[8];
#pragma unroll
            for (int u = 0; u < 8; u++) acc[u] = 0.0f;
#pragma unroll 4
            for (int s = 0; s < splits; s++) {
                float f = split_f[tk][s];
                if (f != 0.0f) {
                    const float4 *o = (const float4 *)(part_o + (base + s) * r + c0);
                    float4 lo = o[0], hi = o[1];
                    float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                    for (int u = 0; u < 8; u++) acc[u] += f * v[u];
                }
            }
            float L = merge_l[tk];
            __nv_bfloat162 packed[4];
#pragma unroll
            for (int u = 0; u < 4; u++) packed[u] = __floats2bfloat162_rn(acc[2 * u] / L, acc[2 * u + 1] / L);
            o_lat8[(tk * r + c0) / 8] = *(const uint4 *)packed;
        }
        __syncthreads();
        float acc[2][2][4];  // [m-tile][n-tile][c0..c3]
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[m][nt][e] = 0.0f;
#pragma unroll
        for (int c = 0; c < OUT_CHUNKS; c++) {
            int c0 = OUT_WARP_COLS * warp + 32 * c + 8 * ft;
            if (OUT_WARP_COLS * warp + 32 * c >= r) break;  // the warp's chunks past r (uniform)
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                if (8 * nt >= tokens) break;  // uniform: no token in the n-tile
                // Token 8 nt + fg's columns c0 .. c0 + 7 (zeros past r; a column past `tokens` is never stored).
                uint4 xv = c0 < r ? o_lat8[((8 * nt + fg) * r + c0) / 8] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const uint4 &lo = w[c][m][0], &hi = w[c][m][1];
                    mma_bf16(acc[m][nt], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
                    mma_bf16(acc[m][nt], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
                }
            }
        }
        // c0, c1: channel fg, tokens 2 ft, 2 ft + 1 of the n-tile; c2, c3: channel fg + 8.
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) red[warp][8 * nt + 2 * ft + (e & 1)][16 * m + fg + 8 * (e >> 1)] = acc[m][nt][e];
        __syncthreads();
        for (int x = threadIdx.x; x < tokens * OUT_CHANNELS; x += blockDim.x) {
            int tk = x / OUT_CHANNELS, ch = x % OUT_CHANNELS;
            if (j0 + ch < vdim) {
                float a = red[0][tk][ch];
#pragma unroll
                for (int wi = 1; wi < OUT_WARPS; wi++) a += red[wi][tk][ch];
                i64 idx = ((i64)(tok0 + tk) * H + h) * vdim + j0 + ch;
                __nv_bfloat16 o = __float2bfloat16_rn(a);
                if (g) o = __float2bfloat16_rn(__bfloat162float(o) * bf_round(sigmoidf_(ld(g, idx))));
                out[idx] = o;
            }
        }
        __syncthreads();
    }
}
