// sparkd: the skinny bf16 GEMM of the decode path, y[M, N] = bf(x[M, K] · w[N, K]ᵀ), fp32 accumulate,
// for few tokens (M <= 64 per token chunk) against large weights, on the tensor cores (mma.sync
// m16n8k16, sm_80 and later), optionally with a residual add: y = bf(bf(x · wᵀ) + addend).
//
// Invariants:
// - Batch invariance, bit for bit: the fp32 value of output (token m, row n) is the same whatever M is
//   and whatever else is batched. Weight rows are the 16-row side of the MMA and tokens its 8-column
//   side; an MMA's output element depends only on its own row of A and column of B. K is cut into
//   `slices` slices of `kslice` columns (the host derives `kslice` from (N, K) only, never from M);
//   a slice's partial is one warp's MMA chain over its k32 steps in ascending order, starting from
//   zero, and the output is the left fold ((p0 + p1) + p2) + ... of the slice partials in slice order.
//   Both ways of running the slices compute exactly that:
//   - split (`skinny_gemm_t*`): one block per (row tile, slice); each block writes its fp32 partial to
//     the workspace `ws` [slices, M, N], and the block that arrives last at its tile's ticket folds the
//     partials in slice order and writes the output. Used when the workspace is small (decode, verify).
//   - serial (`skinny_gemm_serial_t*`): one block per row tile runs the slices in turn and folds each
//     partial into its running sum in registers. Used for long prefills, whose workspace would be large.
//   The row-tile size (warps per block) does not enter the order, so the host may choose it freely.
// - Tickets: `tickets[tile * chunks + chunk]` counts the blocks of a split tile that are done; the last
//   one resets it to zero, so the buffer is all zeros between launches (the host keeps one per stream).
// - Each weight element is read once per token chunk of 64 (128-bit streaming loads when K % 8 == 0
//   and w is 16-byte aligned). The token chunk of x is staged in shared memory KC columns at a time,
//   double-buffered with cp.async (the next chunk loads while the current one is multiplied), zero
//   past M and K.
// - K order inside an MMA: a thread loads 8 consecutive k of its weight row and the same 8 k of its
//   token row, and feeds them as k-slots {2t, 2t+1, 2t+8, 2t+9} of two k16 steps; A and B use the same
//   slot-to-k map, so the MMA computes the plain dot product over those 32 k.
// - Output layout: row-major [M, N], or segment-major when `seg` is given: column range
//   [seg[i], seg[i+1]) is its own contiguous [M, seg[i+1] - seg[i]] block at element offset M * seg[i]
//   (a merged projection's parts land where the ops that read them expect separate tensors).
// - The add epilogue rounds like linear then add_in_place (common.cu): bf(bf(acc) + addend), addend
//   laid out as the output; each output element is read and written by one thread, so addend may be y.
// - The partial epilogue (`yf` not null; then `y` and `addend` are unused): the fp32 sums themselves are written to
//   `yf` in the output layout, unrounded: a row-parallel projection's share, which the sharded forward all-reduces
//   before it rounds (cuda::tp). The sums are the same as the bf16 output's before its rounding.
//
// Block: blockDim.x = 32 * warps (4 or 8); each warp owns 16 R weight rows (R 16-row MMA tiles, 1 or 2), so a
// row tile is 16 R * warps rows. Grid: (tiles * slices (split) or tiles (serial), ceil(M / 64)).
// Each warp loads its next group of k32 steps of weights before multiplying the current group, so loads
// stay in flight while the tensor cores work (at decode sizes the GEMM is meant to be bound by HBM bandwidth).
// Compiled after prelude.cuh (compile.rs prepends it: cuda_bf16.h and the shared helpers: u32, i64, ld, bf_round,
// sigmoidf_, block reductions, dependent launch, clusters, cp.async and the bf16 MMA).

#define KC 256          // K columns staged per chunk (kslice is a multiple of it)
#define XS_STRIDE 288   // staged row stride in elements: rows g and g + 1 sit 16 banks apart

// 16 bytes global -> shared, asynchronously, without prelude.cuh's L2 prefetch hint; `bytes` = 0 writes zeros
// without reading.
__device__ __forceinline__ void cp_async16_cg(void *dst, const void *src, int bytes) {
    u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(bytes) : "memory");
}

// Packs 8 bf16 read one by one (zero past `limit` elements from p).
__device__ __forceinline__ uint4 load8_scalar(const __nv_bfloat16 *p, int limit) {
    unsigned short h[8];
    for (int j = 0; j < 8; j++) h[j] = j < limit ? __bfloat16_as_ushort(p[j]) : (unsigned short)0;
    return make_uint4(h[0] | ((u32)h[1] << 16), h[2] | ((u32)h[3] << 16), h[4] | ((u32)h[5] << 16),
                      h[6] | ((u32)h[7] << 16));
}

// 8 consecutive weights w[row, k..k+8] (zero past N or K).
__device__ __forceinline__ uint4 load_w8(const __nv_bfloat16 *w, int row, int k, int n, int kdim, bool vec) {
    if (row >= n || k >= kdim) return make_uint4(0u, 0u, 0u, 0u);
    const __nv_bfloat16 *p = w + (long)row * kdim + k;
    if (vec) return ld_stream16(p);
    return load8_scalar(p, kdim - k);
}

// Starts staging x[m0 .. m0 + 8 NT, kc .. kc + KC] into `xs` [8 NT, XS_STRIDE] (zero past mc and K) as
// one cp.async group; the scalar path (x unaligned or K % 8 != 0) stores synchronously.
template <int NT>
__device__ __forceinline__ void stage_x(__nv_bfloat16 *xs, const __nv_bfloat16 *x, int m0, int mc, int kc, int kdim,
                                        bool xvec) {
    for (int i = threadIdx.x; i < 8 * NT * (KC / 8); i += blockDim.x) {
        int r = i / (KC / 8), c = (i % (KC / 8)) * 8;
        __nv_bfloat16 *dst = xs + r * XS_STRIDE + c;
        bool live = r < mc && kc + c < kdim;
        const __nv_bfloat16 *src = x + (long)(m0 + r) * kdim + kc + c;
        if (xvec) {
            cp_async16_cg(dst, live ? src : x, live ? 16 : 0);
        } else {
            *reinterpret_cast<uint4 *>(dst) = live ? load8_scalar(src, kdim - kc - c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    cp_async_commit();
}

// The weights of STEPS k32 steps from `kb`: [step][row tile][rows g / g + 8] of a warp's 16 R rows whose
// thread row is `row` (= first row + g), 8 k from kb + 32 step + 8 t each; zeros without reading
// from `kend` on (the end of the slice).
template <int STEPS, int R>
__device__ __forceinline__ void load_steps(uint4 (&a)[STEPS][R][2], const __nv_bfloat16 *w, int row, int kb, int kend,
                                           int n, int kdim, bool vec, int t) {
#pragma unroll
    for (int q = 0; q < STEPS; q++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            int k = kb < kend ? kb + q * 32 + 8 * t : kdim;
            a[q][r][0] = load_w8(w, row + r * 16, k, n, kdim, vec);
            a[q][r][1] = load_w8(w, row + r * 16 + 8, k, n, kdim, vec);
        }
}

// The MMAs of STEPS k32 steps: weights `a`, B fragments `b`.
template <int STEPS, int NT, int R>
__device__ __forceinline__ void mma_steps(float (&acc)[R][NT][4], const uint4 (&a)[STEPS][R][2],
                                          const uint4 (&b)[STEPS][NT]) {
#pragma unroll
    for (int q = 0; q < STEPS; q++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                mma_bf16(acc[r][j], a[q][r][0].x, a[q][r][1].x, a[q][r][0].y, a[q][r][1].y, b[q][j].x, b[q][j].y);
                mma_bf16(acc[r][j], a[q][r][0].z, a[q][r][1].z, a[q][r][0].w, a[q][r][1].w, b[q][j].z, b[q][j].w);
            }
}

// acc = this warp's partial over K columns [k0, k1) (k1 - k0 a multiple of KC unless k1 = K), from zero,
// STEPS k32 steps per group with the next group's weights in flight. Every thread of the block calls it
// (it synchronises); `xs` holds two staging buffers.
template <int NT, int STEPS, int R>
__device__ void slice_partial(float (&acc)[R][NT][4], __nv_bfloat16 *xs, const __nv_bfloat16 *__restrict__ w,
                              const __nv_bfloat16 *__restrict__ x, int row, int k0, int k1, int n, int kdim, int m0,
                              int mc, bool wvec, bool xvec, int g, int t) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[r][j][e] = 0.0f;
    constexpr int GROUP = 32 * STEPS;
    uint4 a[STEPS][R][2]; // [step][row tile][rows g / g + 8]
    const int chunks = (k1 - k0 + KC - 1) / KC;
    load_steps<STEPS, R>(a, w, row, k0, k1, n, kdim, wvec, t); // weights only: before the wait
    grid_dependency_wait();
    launch_dependents();
    stage_x<NT>(xs, x, m0, mc, k0, kdim, xvec);
    for (int c = 0; c < chunks; c++) {
        const int kc = k0 + c * KC;
        const __nv_bfloat16 *buf = xs + (c & 1) * (8 * NT * XS_STRIDE);
        if (c + 1 < chunks) {
            stage_x<NT>(xs + ((c + 1) & 1) * (8 * NT * XS_STRIDE), x, m0, mc, kc + KC, kdim, xvec);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); // chunk c is staged
        const int kend = min(kc + KC, k1);
        for (int kb = kc; kb < kend; kb += GROUP) {
            uint4 na[STEPS][R][2];
            load_steps<STEPS, R>(na, w, row, kb + GROUP, k1, n, kdim, wvec, t); // the next group, across chunk ends too
            uint4 b[STEPS][NT];
#pragma unroll
            for (int q = 0; q < STEPS; q++)
#pragma unroll
                for (int j = 0; j < NT; j++) // [8 tokens, 8 k]
                    b[q][j] = *reinterpret_cast<const uint4 *>(buf + (j * 8 + g) * XS_STRIDE + kb - kc + q * 32 + 8 * t);
            mma_steps<STEPS, NT, R>(acc, a, b);
#pragma unroll
            for (int q = 0; q < STEPS; q++)
#pragma unroll
                for (int r = 0; r < R; r++) {
                    a[q][r][0] = na[q][r][0];
                    a[q][r][1] = na[q][r][1];
                }
        }
        __syncthreads(); // chunk c is consumed before its buffer is staged again
    }
}

// Accumulator element e of row tile r, token tile j: row g (+ 8 for e >= 2), token 2t (+ 1 for odd e).
#define ACC_ROW(r, e) (row0 + (r) * 16 + g + ((e) >> 1) * 8)
#define ACC_TOKEN(j, e) ((j) * 8 + 2 * t + ((e) & 1))

// NT = token tiles of 8 (the chunk holds up to 8 * NT tokens); SERIAL: one block runs every slice; STEPS:
// k32 steps of weights per load group (more bytes in flight per warp, more registers); R: 16-row MMA tiles
// per warp.
template <int NT, bool SERIAL, int STEPS, int R>
__device__ void skinny_gemm(const __nv_bfloat16 *__restrict__ w, const __nv_bfloat16 *__restrict__ x,
                            __nv_bfloat16 *y, const __nv_bfloat16 *addend, float *yf, int n, int kdim,
                            int mtotal, const int *seg, int nseg, int kslice, float *ws, u32 *tickets, int vec) {
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16 *xs = reinterpret_cast<__nv_bfloat16 *>(smem); // [2][8 * NT, XS_STRIDE]
    __shared__ int last_block;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int slices = (kdim + kslice - 1) / kslice;
    const int tile = SERIAL ? blockIdx.x : blockIdx.x / slices;
    const int row0 = (tile * (blockDim.x >> 5) + warp) * 16 * R;
    const int m0 = blockIdx.y * 64;
    const int mc = min(8 * NT, mtotal - m0);
    const bool wvec = vec & 1, xvec = vec & 2;

    float acc[R][NT][4]; // [row tile][token tile][c0..c3]
    if (SERIAL) {
        slice_partial<NT, STEPS, R>(acc, xs, w, x, row0 + g, 0, min(kslice, kdim), n, kdim, m0, mc, wvec, xvec, g, t);
        for (int s = 1; s < slices; s++) {
            float part[R][NT][4];
            slice_partial<NT, STEPS, R>(part, xs, w, x, row0 + g, s * kslice, min((s + 1) * kslice, kdim), n, kdim, m0, mc,
                              wvec, xvec, g, t);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[r][j][e] += part[r][j][e];
        }
    } else {
        const int s = blockIdx.x % slices;
        slice_partial<NT, STEPS, R>(acc, xs, w, x, row0 + g, s * kslice, min((s + 1) * kslice, kdim), n, kdim, m0, mc, wvec,
                          xvec, g, t);
        if (slices > 1) {
            // ws [slices, mtotal, n]: this block's partial, then the last block of the tile folds them.
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (ACC_ROW(r, e) < n && ACC_TOKEN(j, e) < mc)
                            ws[((long)s * mtotal + m0 + ACC_TOKEN(j, e)) * n + ACC_ROW(r, e)] = acc[r][j][e];
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) {
                u32 *ticket = tickets + (long)tile * gridDim.y + blockIdx.y;
                last_block = atomicAdd(ticket, 1u) == (u32)(slices - 1);
                if (last_block) *ticket = 0u;
            }
            __syncthreads();
            if (!last_block) return;
            __threadfence();
            // ((p0 + p1) + p2) + ...: slice by slice, so each slice's loads are all in flight at once.
            for (int q = 0; q < slices; q++) {
                const float *part_q = ws + (long)q * mtotal * n;
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            if (ACC_ROW(r, e) < n && ACC_TOKEN(j, e) < mc) {
                                const float v = __ldcg(part_q + (long)(m0 + ACC_TOKEN(j, e)) * n + ACC_ROW(r, e));
                                acc[r][j][e] = q == 0 ? v : acc[r][j][e] + v;
                            }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int row = ACC_ROW(r, e), m = ACC_TOKEN(j, e);
                if (row < n && m < mc) {
                    const long at = out_index(m0 + m, row, n, mtotal, seg, nseg);
                    float v = acc[r][j][e];
                    if (yf != nullptr) {
                        yf[at] = v;
                        continue;
                    }
                    if (addend != nullptr) v = bf_round(v) + ld(addend, at);
                    y[at] = __float2bfloat16_rn(v);
                }
            }
}

// One pair of entry points per token-tile count: chunks of up to 8, 16, 32 and 64 tokens. `addend` is
// null for a plain GEMM, `yf` null but for a partial one; `ws` and `tickets` are only read by split launches of
// more than one slice.
// Split launches give each warp one 16-row MMA tile and 8 k32 steps per load group (4 at 64 tokens, for the
// accumulators' registers): a group reads 512 contiguous bytes of each weight row, which the H200's HBM
// serves 10-15% faster than two tiles of 256 (measured over the k3-mini shapes; docs/perf/decisions.md#d19). Serial
// launches, which keep a second set of accumulators for the fold, use two row tiles per warp.
// The wide split entry points (32 and 64 tokens) also give each warp two row tiles, 4 k32 steps per group: every
// token fragment read from shared memory feeds two weight tiles instead of one. They halve the blocks, so the
// host takes them only for launches of many waves (the lm_head; Gpu::skinny_layout).
#define SKINNY_GEMM(NAME, NT, SERIAL, STEPS, R, MIN_BLOCKS)                                                           \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS)                                                 \
        NAME(const __nv_bfloat16 *w, const __nv_bfloat16 *x, __nv_bfloat16 *y, const __nv_bfloat16 *addend,       \
             float *yf, int n, int kdim, int mtotal, const int *seg, int nseg, int kslice, float *ws, u32 *tickets,  \
             int vec) {                                                                                            \
        skinny_gemm<NT, SERIAL, STEPS, R>(w, x, y, addend, yf, n, kdim, mtotal, seg, nseg, kslice, ws, tickets,    \
                                          vec);                                                                    \
    }
SKINNY_GEMM(skinny_gemm_t1, 1, false, 8, 1, 1)
SKINNY_GEMM(skinny_gemm_t2, 2, false, 8, 1, 1)
SKINNY_GEMM(skinny_gemm_t4, 4, false, 8, 1, 1)
SKINNY_GEMM(skinny_gemm_t8, 8, false, 4, 1, 1)
SKINNY_GEMM(skinny_gemm_wide_t4, 4, false, 4, 2, 1)
SKINNY_GEMM(skinny_gemm_wide_t8, 8, false, 4, 2, 1)
SKINNY_GEMM(skinny_gemm_serial_t1, 1, true, 4, 2, 1)
SKINNY_GEMM(skinny_gemm_serial_t2, 2, true, 4, 2, 1)
SKINNY_GEMM(skinny_gemm_serial_t4, 4, true, 4, 2, 1)
SKINNY_GEMM(skinny_gemm_serial_t8, 8, true, 2, 2, 1)
