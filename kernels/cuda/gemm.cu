// sparkd: the skinny bf16 GEMM of the decode path, y[M, N] = bf(x[M, K] · w[N, K]ᵀ), fp32 accumulate,
// for few tokens (M <= 64 per token chunk) against large weights, on the tensor cores (mma.sync
// m16n8k16, sm_80 and later), optionally with a residual add: y = bf(bf(x · wᵀ) + addend).
//
// Invariants:
// - Batch invariance, bit for bit: the fp32 value of output (token m, row n) is the same whatever M is
//   and whatever else is batched. Weight rows are the 16-row side of the MMA and tokens its 8-column
//   side; an MMA's output element depends only on its own row of A and column of B, and every output
//   runs through the same sequence of MMAs: warp `ks` of a row team sums the k-steps of its share of
//   every 512-wide K chunk in ascending order, then the `split` warp partials are added in ascending
//   warp order. `split` is chosen by the host from (N, K) only, never from M.
// - Each weight element is read once per token chunk of 64 (128-bit streaming loads when K % 8 == 0
//   and w is 16-byte aligned); the token chunk of x is staged in shared memory, 512 columns at a time,
//   zero-padded past M and K.
// - K order inside an MMA: a thread loads 8 consecutive k of its weight row and the same 8 k of its
//   token row, and feeds them as k-slots {2t, 2t+1, 2t+8, 2t+9} of two k16 steps; A and B use the same
//   slot-to-k map, so the MMA computes the plain dot product over those 32 k.
// - Output layout: row-major [M, N], or segment-major when `seg` is given: column range
//   [seg[i], seg[i+1]) is its own contiguous [M, seg[i+1] - seg[i]] block at element offset M * seg[i]
//   (a merged projection's parts land where the ops that read them expect separate tensors).
// - The add epilogue rounds like linear then add_in_place (common.cu): bf(bf(acc) + addend), addend
//   laid out as the output; each output element is read and written by one thread, so addend may be y.
//
// Block: 256 threads = 8 warps = (8 / split) row teams x split K shares; a team owns 32 weight rows
// (two 16-row MMA tiles). Grid: (ceil(N / (32 * 8 / split)), ceil(M / 64)).
// Each warp loads the next two k32 steps of weights before multiplying the current two, so loads stay
// in flight while the tensor cores work (at decode sizes the GEMM is meant to be bound by HBM bandwidth).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h, INF_F, u32, i64, ld, bf_round, sigmoidf_,
// block_sum, block_max).

#define KC 512          // K columns staged per chunk
#define XS_STRIDE 520   // staged row stride in elements (16 bytes of padding spread the banks)
#define WARPS 8
#define STAGE_BATCH 4 // staging loads in flight per thread

__device__ __forceinline__ void mma_bf16(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 8 consecutive weights w[row, k..k+8] (zero past N or K).
__device__ __forceinline__ uint4 load_w8(const __nv_bfloat16 *w, int row, int k, int n, int kdim, bool vec) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row >= n || k >= kdim) return v;
    const __nv_bfloat16 *p = w + (long)row * kdim + k;
    if (vec) return __ldcs(reinterpret_cast<const uint4 *>(p));
    unsigned short h[8];
    for (int j = 0; j < 8; j++) h[j] = k + j < kdim ? __bfloat16_as_ushort(p[j]) : (unsigned short)0;
    v.x = h[0] | ((u32)h[1] << 16);
    v.y = h[2] | ((u32)h[3] << 16);
    v.z = h[4] | ((u32)h[5] << 16);
    v.w = h[6] | ((u32)h[7] << 16);
    return v;
}

// The weights of two k32 steps from `kb`: [step][row tile][rows g / g + 8] of a 32-row team whose
// thread row is `row` (= team row + g), 8 k from kb + 32 step + 8 t each.
__device__ __forceinline__ void load_pair(uint4 (&a)[2][2][2], const __nv_bfloat16 *w, int row, int kb, int n,
                                          int kdim, bool vec, int t) {
#pragma unroll
    for (int q = 0; q < 2; q++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            a[q][r][0] = load_w8(w, row + r * 16, kb + q * 32 + 8 * t, n, kdim, vec);
            a[q][r][1] = load_w8(w, row + r * 16 + 8, kb + q * 32 + 8 * t, n, kdim, vec);
        }
}

// x[m0 + r, kc + c .. kc + c + 8] of the token chunk (zero past mc or K).
__device__ __forceinline__ uint4 load_x8(const __nv_bfloat16 *x, int r, int c, int m0, int mc, int kc, int kdim,
                                         bool vec) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r >= mc || kc + c >= kdim) return v;
    const __nv_bfloat16 *p = x + (long)(m0 + r) * kdim + kc + c;
    if (vec) return *reinterpret_cast<const uint4 *>(p);
    unsigned short h[8];
    for (int j = 0; j < 8; j++) h[j] = kc + c + j < kdim ? __bfloat16_as_ushort(p[j]) : (unsigned short)0;
    v.x = h[0] | ((u32)h[1] << 16);
    v.y = h[2] | ((u32)h[3] << 16);
    v.z = h[4] | ((u32)h[5] << 16);
    v.w = h[6] | ((u32)h[7] << 16);
    return v;
}

// Element index of output (m, col) in a [mtotal, n] result, row-major or segment-major.
__device__ __forceinline__ long out_index(int m, int col, int n, int mtotal, const int *seg, int nseg) {
    if (seg == nullptr) return (long)m * n + col;
    int i = 0;
    while (i + 1 < nseg && col >= seg[i + 1]) i++;
    int lo = seg[i], width = seg[i + 1] - lo;
    return (long)mtotal * lo + (long)m * width + (col - lo);
}

// NT = token tiles of 8 (the chunk holds up to 8 * NT tokens).
template <int NT>
__device__ void skinny_gemm(const __nv_bfloat16 *__restrict__ w, const __nv_bfloat16 *__restrict__ x,
                            __nv_bfloat16 *y, const __nv_bfloat16 *addend, int n, int kdim, int mtotal,
                            const int *seg, int nseg, int split, int vec) {
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16 *xs = reinterpret_cast<__nv_bfloat16 *>(smem); // [8 * NT, XS_STRIDE]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ks = warp % split, team = warp / split;
    const int row0 = (blockIdx.x * (WARPS / split) + team) * 32;
    const int m0 = blockIdx.y * 64;
    const int mc = min(8 * NT, mtotal - m0);
    const int steps = (KC / 32) / split; // k32 steps per warp per chunk
    const bool wvec = vec & 1, xvec = vec & 2;

    float acc[2][NT][4]; // [row tile][token tile][c0..c3]
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[r][j][e] = 0.0f;

    // This warp's k32 steps of a chunk start at `first`; weights go two steps (a "pair") at a time and
    // the next pair is loaded before the current one is multiplied, across chunk boundaries too
    // (loads past K return zeros without touching memory).
    const int first = ks * steps * 32;
    uint4 a[2][2][2]; // [step][row tile][rows g / g + 8]
    load_pair(a, w, row0 + g, first, n, kdim, wvec, t);
    for (int kc = 0; kc < kdim; kc += KC) {
        __syncthreads(); // the previous chunk is consumed
        // Stage x[m0 .. m0 + 8 NT, kc .. kc + KC] (zero past mc and K), four loads in flight per thread.
#pragma unroll
        for (int u0 = 0; u0 < 2 * NT; u0 += STAGE_BATCH) {
            uint4 v[STAGE_BATCH];
#pragma unroll
            for (int u = 0; u < STAGE_BATCH; u++) {
                int i = threadIdx.x + (u0 + u) * 256;
                v[u] = u0 + u < 2 * NT ? load_x8(x, i / (KC / 8), (i % (KC / 8)) * 8, m0, mc, kc, kdim, xvec)
                                       : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < STAGE_BATCH; u++) {
                int i = threadIdx.x + (u0 + u) * 256;
                if (u0 + u < 2 * NT) *reinterpret_cast<uint4 *>(xs + (i / (KC / 8)) * XS_STRIDE + (i % (KC / 8)) * 8) = v[u];
            }
        }
        __syncthreads();
        for (int s = 0; s < steps; s += 2) {
            int kb = kc + first + s * 32;
            int next = s + 2 < steps ? kb + 64 : kc + KC + first;
            uint4 nx[2][2][2];
            load_pair(nx, w, row0 + g, next, n, kdim, wvec, t);
            if (kb < kdim) {
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    int col = kb - kc + q * 32 + 8 * t;
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        uint4 b = *reinterpret_cast<const uint4 *>(xs + (j * 8 + g) * XS_STRIDE + col); // [8 tokens, 8 k]
#pragma unroll
                        for (int r = 0; r < 2; r++) {
                            mma_bf16(acc[r][j], a[q][r][0].x, a[q][r][1].x, a[q][r][0].y, a[q][r][1].y, b.x, b.y);
                            mma_bf16(acc[r][j], a[q][r][0].z, a[q][r][1].z, a[q][r][0].w, a[q][r][1].w, b.z, b.w);
                        }
                    }
                }
            }
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    a[q][r][0] = nx[q][r][0];
                    a[q][r][1] = nx[q][r][1];
                }
        }
    }

    if (split > 1) {
        // Fixed-order reduction of the split partials: red[warp][row tile][token tile][e][lane].
        __syncthreads();
        float *red = reinterpret_cast<float *>(smem);
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) red[(((warp * 2 + r) * NT + j) * 4 + e) * 32 + lane] = acc[r][j][e];
        __syncthreads();
        if (ks != 0) return;
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float sum = acc[r][j][e];
                    for (int q = 1; q < split; q++) sum += red[((((warp + q) * 2 + r) * NT + j) * 4 + e) * 32 + lane];
                    acc[r][j][e] = sum;
                }
    }

    // c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8, the same tokens.
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = row0 + r * 16 + g + (e >> 1) * 8;
                int m = j * 8 + 2 * t + (e & 1);
                if (row < n && m < mc) {
                    const long at = out_index(m0 + m, row, n, mtotal, seg, nseg);
                    float v = acc[r][j][e];
                    if (addend != nullptr) v = bf_round(v) + ld(addend, at);
                    y[at] = __float2bfloat16_rn(v);
                }
            }
}

// One entry point per token-tile count: chunks of up to 8, 16, 32 and 64 tokens (64: one block per SM,
// for the registers of 64 accumulators and two weight pairs). `addend` is null for a plain GEMM.
#define SKINNY_GEMM(NT, MIN_BLOCKS)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) skinny_gemm_t##NT(                                            \
        const __nv_bfloat16 *w, const __nv_bfloat16 *x, __nv_bfloat16 *y, const __nv_bfloat16 *addend, int n,       \
        int kdim, int mtotal, const int *seg, int nseg, int split, int vec) {                                      \
        skinny_gemm<NT>(w, x, y, addend, n, kdim, mtotal, seg, nseg, split, vec);                                   \
    }
SKINNY_GEMM(1, 2)
SKINNY_GEMM(2, 2)
SKINNY_GEMM(4, 2)
SKINNY_GEMM(8, 1)
