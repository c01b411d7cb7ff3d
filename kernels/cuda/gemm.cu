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
//   warp order. `split` is chosen by the host from (N, K) only, never from M; the grid size, which
//   block runs which item and the prefetch depth change nothing in that sequence.
// - Each weight element is read once per token chunk of 64; the token chunk of x is staged in shared
//   memory, 512 columns at a time, zero-padded past M and K, double-buffered: the next chunk is loaded
//   into registers while the current one is multiplied and stored when it is consumed.
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
// (two 16-row MMA tiles). Work items are (row group of 32 * 8 / split rows, token chunk of 64), row group
// fastest; the grid is persistent (at most the blocks that fit on the device at once) and block b takes
// items b, b + gridDim.x, ..., so a weight of many row groups spreads evenly over the SMs instead of
// leaving a partial last wave.
// Weights stream through a per-thread ring in shared memory: DEPTH "pairs" (two k32 steps of the
// thread's 8 fragments, 128 bytes) are in flight as cp.async groups, across chunk and item boundaries;
// each thread reads back only the slots it filled itself, so the ring needs no barrier, only
// cp.async.wait_group. DEPTH x 32 KB per block keeps 96-192 KB of weights in flight per SM (Little's law
// at HBM latency), which registers alone could not hold. One block per SM, so the grid is the SM count
// and the host picks splits whose items fill it in even rounds.
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h, INF_F, u32, i64, ld, bf_round, sigmoidf_,
// block_sum, block_max).

#define KC 512          // K columns staged per chunk
#define XS_STRIDE 520   // staged row stride in elements (16 bytes of padding spread the banks)
#define WARPS 8

__device__ __forceinline__ void mma_bf16(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 8 consecutive weights w[row, k..k+8] (zero past N or K) by scalar loads: the path for weights whose
// rows are not 16-byte aligned (K % 8 != 0 or an unaligned base), which cp.async cannot copy.
__device__ __forceinline__ uint4 load_w8_scalar(const __nv_bfloat16 *w, int row, int k, int n, int kdim) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row >= n || k >= kdim) return v;
    const __nv_bfloat16 *p = w + (long)row * kdim + k;
    unsigned short h[8];
    for (int j = 0; j < 8; j++) h[j] = k + j < kdim ? __bfloat16_as_ushort(p[j]) : (unsigned short)0;
    v.x = h[0] | ((u32)h[1] << 16);
    v.y = h[2] | ((u32)h[3] << 16);
    v.z = h[4] | ((u32)h[5] << 16);
    v.w = h[6] | ((u32)h[7] << 16);
    return v;
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

// 16 bytes global -> shared without passing through registers; `bytes` = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int bytes) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(bytes) : "memory");
}

// Waits until at most N of this thread's cp.async groups are still pending.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// NT = token tiles of 8 (a chunk holds up to 8 * NT tokens); DEPTH = weight pairs in flight per thread.
template <int NT, int DEPTH>
__device__ void skinny_gemm(const __nv_bfloat16 *__restrict__ w, const __nv_bfloat16 *__restrict__ x,
                            __nv_bfloat16 *y, const __nv_bfloat16 *addend, int n, int kdim, int mtotal,
                            const int *seg, int nseg, int split, int vec) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int XS_ELEMS = 8 * NT * XS_STRIDE;
    __nv_bfloat16 *xs_base = reinterpret_cast<__nv_bfloat16 *>(smem); // [2 buffers][8 NT, XS_STRIDE]
    // [DEPTH slots][8 fragments: step q, row tile r, rows g / g + 8][256 threads]
    uint4 *ring = reinterpret_cast<uint4 *>(smem + 2 * XS_ELEMS * sizeof(__nv_bfloat16)) + threadIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ks = warp % split, team = warp / split, teams = WARPS / split;
    const int groups = (n + 32 * teams - 1) / (32 * teams);
    const int items = groups * ((mtotal + 63) / 64);
    const int pairs = (KC / 64) / split; // weight pairs per warp per chunk
    const int first = ks * pairs * 64;   // this warp's first k in a chunk
    const bool wvec = vec & 1, xvec = vec & 2;
    // Item -> this team's first weight row, and the item's first token.
    auto team_row = [&](int item) { return ((item % groups) * teams + team) * 32; };
    auto chunk_m0 = [&](int item) { return (item / groups) * 64; };
    if ((int)blockIdx.x >= items) return;

    // The prefetch cursor runs DEPTH pairs ahead of the multiplications, over the same sequence
    // (item, chunk, pair); past the last item it fetches row n, i.e. zeros without reading memory.
    int p_item = blockIdx.x, p_kc = 0, p_s = 0;
    auto prefetch = [&](int slot) {
        const int row = (p_item < items ? team_row(p_item) : n) + g;
        const int k = p_kc + first + p_s * 64 + 8 * t;
#pragma unroll
        for (int f = 0; f < 8; f++) { // fragment f = (q, r, h): k + 32 q, row + 16 r + 8 h
            const int rr = row + ((f >> 1) & 1) * 16 + (f & 1) * 8, kk = k + (f >> 2) * 32;
            uint4 *dst = ring + (slot * 8 + f) * 256;
            if (wvec) {
                const bool in = rr < n && kk < kdim; // K % 8 == 0: the 8 k are all in or all out
                cp_async16(dst, in ? w + (long)rr * kdim + kk : w, in ? 16 : 0);
            } else {
                *dst = load_w8_scalar(w, rr, kk, n, kdim);
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (++p_s == pairs) {
            p_s = 0;
            p_kc += KC;
            if (p_kc >= kdim) {
                p_kc = 0;
                p_item += gridDim.x;
            }
        }
    };
    // x[m0 .. m0 + 8 NT, kc .. kc + KC] (zero past mc and K) into registers, then into a staging buffer.
    auto load_x = [&](uint4 (&v)[2 * NT], int m0, int mc, int kc) {
#pragma unroll
        for (int u = 0; u < 2 * NT; u++) {
            const int i = threadIdx.x + u * 256;
            v[u] = load_x8(x, i / (KC / 8), (i % (KC / 8)) * 8, m0, mc, kc, kdim, xvec);
        }
    };
    auto store_x = [&](const uint4 (&v)[2 * NT], __nv_bfloat16 *xs) {
#pragma unroll
        for (int u = 0; u < 2 * NT; u++) {
            const int i = threadIdx.x + u * 256;
            *reinterpret_cast<uint4 *>(xs + (i / (KC / 8)) * XS_STRIDE + (i % (KC / 8)) * 8) = v[u];
        }
    };

#pragma unroll
    for (int d = 0; d < DEPTH; d++) prefetch(d);
    {
        const int m0 = chunk_m0(blockIdx.x);
        uint4 v[2 * NT];
        load_x(v, m0, min(8 * NT, mtotal - m0), 0);
        store_x(v, xs_base);
    }
    __syncthreads();

    int slot = 0, buf = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int row0 = team_row(item), m0 = chunk_m0(item), mc = min(8 * NT, mtotal - m0);
        const int next_item = item + gridDim.x;
        float acc[2][NT][4]; // [row tile][token tile][c0..c3]
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[r][j][e] = 0.0f;

        for (int kc = 0; kc < kdim; kc += KC) {
            // The next chunk of x (this item's, else the next item's first) loads while this one is used.
            const bool last_chunk = kc + KC >= kdim, has_next = !last_chunk || next_item < items;
            uint4 next_x[2 * NT];
            if (has_next) {
                const int xm0 = last_chunk ? chunk_m0(next_item) : m0;
                load_x(next_x, xm0, min(8 * NT, mtotal - xm0), last_chunk ? 0 : kc + KC);
            }
            const __nv_bfloat16 *xs = xs_base + buf * XS_ELEMS;
            for (int s = 0; s < pairs; s++) {
                const int kb = kc + first + s * 64;
                cp_async_wait<DEPTH - 1>(); // this pair's group has landed
                uint4 a[2][2][2];           // [step][row tile][rows g / g + 8]
#pragma unroll
                for (int f = 0; f < 8; f++) a[f >> 2][(f >> 1) & 1][f & 1] = ring[(slot * 8 + f) * 256];
                if (kb < kdim) {
#pragma unroll
                    for (int q = 0; q < 2; q++) {
                        const int col = kb - kc + q * 32 + 8 * t;
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
                prefetch(slot); // the slot's values are in registers and used: refill it DEPTH pairs ahead
                slot = slot + 1 == DEPTH ? 0 : slot + 1;
            }
            if (has_next) store_x(next_x, xs_base + (buf ^ 1) * XS_ELEMS);
            __syncthreads(); // the next buffer is staged, this one consumed
            buf ^= 1;
        }

        if (split > 1) {
            // Fixed-order reduction of the split partials in the buffer just consumed (free until the end of
            // the next chunk): warps ks > 0 publish, warp ks = 0 of each team sums in ascending warp order.
            float *red = reinterpret_cast<float *>(xs_base + (buf ^ 1) * XS_ELEMS); // [WARPS][2][NT][4][32]
            if (ks != 0) {
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++) red[(((warp * 2 + r) * NT + j) * 4 + e) * 32 + lane] = acc[r][j][e];
            }
            __syncthreads();
            if (ks == 0) {
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            float sum = acc[r][j][e];
                            for (int q = 1; q < split; q++)
                                sum += red[((((warp + q) * 2 + r) * NT + j) * 4 + e) * 32 + lane];
                            acc[r][j][e] = sum;
                        }
            }
            __syncthreads(); // `red` is read before the buffer is staged again
        }

        // c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8, the same tokens.
        if (ks == 0) {
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int row = row0 + r * 16 + g + (e >> 1) * 8;
                        const int m = j * 8 + 2 * t + (e & 1);
                        if (row < n && m < mc) {
                            const long at = out_index(m0 + m, row, n, mtotal, seg, nseg);
                            float v = acc[r][j][e];
                            if (addend != nullptr) v = bf_round(v) + ld(addend, at);
                            y[at] = __float2bfloat16_rn(v);
                        }
                    }
        }
    }
    cp_async_wait<0>(); // the prefetches past the last item (zeros) land before the block exits
}

// One entry point per token-tile count: chunks of up to 8, 16, 32 and 64 tokens, one block per SM with the
// deepest ring that fits 227 KB of shared memory beside the two x buffers (ops.rs sizes it the same way).
// `addend` is null for a plain GEMM.
#define SKINNY_GEMM(NT, DEPTH)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                           \
        skinny_gemm_t##NT(const __nv_bfloat16 *w, const __nv_bfloat16 *x, __nv_bfloat16 *y,                        \
                          const __nv_bfloat16 *addend, int n, int kdim, int mtotal, const int *seg, int nseg,      \
                          int split, int vec) {                                                                    \
        skinny_gemm<NT, DEPTH>(w, x, y, addend, n, kdim, mtotal, seg, nseg, split, vec);                           \
    }
SKINNY_GEMM(1, 6)
SKINNY_GEMM(2, 6)
SKINNY_GEMM(4, 5)
SKINNY_GEMM(8, 3)
