// sparkd: the skinny bf16 GEMM on Hopper's warpgroup MMA (wgmma) and copy engine (TMA), y[M, N] =
// bf(x[M, K] . w[N, K]^T) with fp32 accumulation, optionally y = bf(bf(x . w^T) + addend): the decode path's linear
// layers on sm_90a. The same contract as gemm.cu's skinny_gemm (split and serial forms, K slices of `kslice` columns
// folded left in slice order, segment-major output, the add epilogue) with its own bits; the split form folds its
// slices in a thread-block cluster instead of a workspace.
//
// Invariants:
// - Batch invariance, bit for bit: a token's output is one accumulator chain per K slice over its k16 steps in
//   ascending order from zero (each k16 step one wgmma over 16 contiguous k), then the left fold of the slice
//   partials in slice order, in registers (serial) or through distributed shared memory (split). The
//   host takes `kslice` from the weight's shape alone. Calls of up to 8, 16, 32 or 64 tokens run wgmma m64nNk16 with
//   N = 8, 16, 32 or 64 (`NT`); the H200 gives a token the same bits for every N (kernels/bench/wgmma_probe.cu
//   checks it, and cuda_gemm checks whole calls of 1 to 512 tokens), so a token's sums never depend on how many
//   tokens share its call.
// - Staging: a producer warp streams 64-column stages of 128 weight rows and NT tokens with the copy engine (2D
//   tensor maps, 128-byte swizzle, zeros past the rows, the tokens and K) into a ring of TC_STAGES stages; `full[s]`
//   completes when a stage's bytes land, `empty[s]` when the consumer warpgroup's four warps are done reading it.
//   The first stages' weights are requested before the dependency wait (they do not depend on the previous kernel).
// - The split form runs a tile's slices (2 to TC_MAX_SPLIT) as one cluster, cluster rank = slice. Each block leaves
//   its slice's partial in its drained stage ring; after a cluster barrier block r folds the r-th contiguous share
//   of the tile's outputs from every block's shared memory in slice order and writes them, and a second barrier
//   keeps every block's shared memory alive until all reads are done. No workspace, no tickets, no fences.
// Block: 160 threads, warps 0-3 the consumer warpgroup (rows 64 m + 16 warp .. + 15 of each m64 tile), warp 4 the
// producer. Grid: (row tiles * slices (split) or row tiles (serial), ceil(M / NT)); clusters (slices, 1, 1) in the
// split form. sm_90a only: elsewhere the entry points trap (the host launches them only on Hopper).

#define TC_ROWS 128   // weight rows per block: two m64 tiles
#define TC_K 64       // columns per stage: one 128-byte swizzled line per row
#define TC_STAGES 4
#define TC_W_BYTES (TC_ROWS * TC_K * 2)  // 16 KB
#define TC_MAX_SPLIT 8 // slices of a split launch: a portable cluster
#define TC_PART_STRIDE (TC_ROWS + 4) // floats per token of a block's partial (the pad spreads the banks)

// A CUtensorMap, passed by value (`__grid_constant__`).
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d[64, NT] (+)= a[64, 16] . b[NT, 16]^T: one wgmma m64nNTk16, bf16 in, fp32 accumulators (scale_d = 0: d = a . b^T).
template <int NT>
__device__ __forceinline__ void wgmma(float (&d)[NT / 2], unsigned long long da, unsigned long long db, int scale_d);
template <> __device__ __forceinline__ void wgmma<8>(float (&d)[4], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %6, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n\t}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma<16>(float (&d)[8], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %10, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n\t}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma<32>(float (&d)[16], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %18, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n\t}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma<64>(float (&d)[32], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n\t}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(scale_d));
}

#endif

// Writes output (token, row) of a call: bf(v), or bf(bf(v) + addend) with an addend, or v itself into `yf` (the
// partial epilogue of gemm.cu's contract) when `yf` is not null.
__device__ __forceinline__ void store_output(__nv_bfloat16 *y, const __nv_bfloat16 *addend, float *yf, float v,
                                             int token, int row, int n, int mtotal, const int *seg, int nseg) {
    const long at = out_index(token, row, n, mtotal, seg, nseg);
    if (yf != nullptr) {
        yf[at] = v;
        return;
    }
    if (addend != nullptr) v = bf_round(v) + ld(addend, at);
    y[at] = __float2bfloat16_rn(v);
}

// Accumulator i of m64 tile m for consumer thread (warp, lane): weight row and token within the block's tile.
#define TC_ROW(m, i) (64 * (m) + 16 * warp + lane / 4 + 8 * (((i) % 4) / 2))
#define TC_TOKEN(i) (8 * ((i) / 4) + 2 * (lane % 4) + (i) % 2)

template <int NT, bool SERIAL>
__device__ void skinny_wgmma(const TensorMap &tw, const TensorMap &tx, __nv_bfloat16 *y, const __nv_bfloat16 *addend,
                             float *yf, int n, int kdim, int mtotal, const int *seg, int nseg, int kslice) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char tc_raw[];
    unsigned char *base = reinterpret_cast<unsigned char *>(((unsigned long long)tc_raw + 1023) & ~1023ull);
    unsigned char *wstage = base;                                  // [TC_STAGES][TC_W_BYTES]
    constexpr int X_BYTES = NT * TC_K * 2;
    unsigned char *xstage = base + TC_STAGES * TC_W_BYTES;         // [TC_STAGES][X_BYTES]
    unsigned long long *full = reinterpret_cast<unsigned long long *>(xstage + TC_STAGES * X_BYTES);
    unsigned long long *empty = full + TC_STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int slices = (kdim + kslice - 1) / kslice;
    const int tile = SERIAL ? blockIdx.x : blockIdx.x / slices;
    const int first = SERIAL ? 0 : blockIdx.x % slices, count = SERIAL ? slices : 1;  // the block's slices
    const int row0 = tile * TC_ROWS, m0 = blockIdx.y * NT, mc = min(NT, mtotal - m0);
    // The block's stages: 64 columns each from k_first, in order. Every slice but the last is a whole number of
    // stages (kslice is a multiple of 256), so only the block's last stage may reach past K (zeros there).
    const int k_first = first * kslice, k_end = min((first + count) * kslice, kdim);
    const int stages = (k_end - k_first + TC_K - 1) / TC_K;
    if (threadIdx.x == 0) {
        for (int s = 0; s < TC_STAGES; s++) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], 4);
        }
        mbarrier_init_fence();
    }
    __syncthreads();
    if (warp == 4) { // the producer: weights before the dependency wait, tokens after it
        if (lane == 0) {
            for (int i = 0; i < min(stages, TC_STAGES); i++) {
                mbarrier_expect(&full[i], TC_W_BYTES + X_BYTES);
                tma_load_2d(wstage + i * TC_W_BYTES, &tw, k_first + i * TC_K, row0, &full[i]);
            }
            grid_dependency_wait();
            for (int i = 0; i < min(stages, TC_STAGES); i++)
                tma_load_2d(xstage + i * X_BYTES, &tx, k_first + i * TC_K, m0, &full[i]);
            for (int i = TC_STAGES; i < stages; i++) {
                const int s = i % TC_STAGES;
                mbarrier_wait(&empty[s], (i / TC_STAGES - 1) & 1);
                mbarrier_expect(&full[s], TC_W_BYTES + X_BYTES);
                tma_load_2d(wstage + s * TC_W_BYTES, &tw, k_first + i * TC_K, row0, &full[s]);
                tma_load_2d(xstage + s * X_BYTES, &tx, k_first + i * TC_K, m0, &full[s]);
            }
        } else {
            grid_dependency_wait();
        }
        launch_dependents();
        if (!SERIAL && slices > 1) { // the fold's two cluster barriers count every thread
            cluster_sync();
            cluster_sync();
        }
        return;
    }
    grid_dependency_wait();
    launch_dependents();
    float acc[2][NT / 2], part[2][NT / 2]; // [m64 tile][accumulator]: the fold so far, and the slice being summed
    int i = 0;
    for (int s = first; s < first + count; s++) {
        const int per = (min((s + 1) * kslice, kdim) - s * kslice + TC_K - 1) / TC_K;
        for (int c = 0; c < per; c++, i++) {
            const int st = i % TC_STAGES;
            mbarrier_wait(&full[st], (i / TC_STAGES) & 1);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int j = 0; j < TC_K / 16; j++) {
                const unsigned long long db = smem_desc_sw128(xstage + st * X_BYTES + 32 * j);
                wgmma<NT>(part[0], smem_desc_sw128(wstage + st * TC_W_BYTES + 32 * j), db, (c | j) != 0);
                wgmma<NT>(part[1], smem_desc_sw128(wstage + st * TC_W_BYTES + 64 * 128 + 32 * j), db, (c | j) != 0);
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&empty[st]);
        }
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int e = 0; e < NT / 2; e++) acc[m][e] = s == first ? part[m][e] : acc[m][e] + part[m][e];
    }
    if (!SERIAL && slices > 1) {
        // The fold in the cluster: every block leaves its slice's partial in its drained stage ring, then block
        // `rank` folds its share of the tile's outputs from every block's shared memory, in slice order.
        float *partial = reinterpret_cast<float *>(wstage); // [NT][TC_PART_STRIDE]: this block's slice, by token
        asm volatile("bar.sync 1, 128;" ::: "memory");     // every consumer warp is done reading the ring
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int e = 0; e < NT / 2; e++) partial[TC_TOKEN(e) * TC_PART_STRIDE + TC_ROW(m, e)] = acc[m][e];
        cluster_sync(); // every block's partial is in its shared memory
        // Outputs [tok][row] of the tile per block: whole rows of 128 where the slices divide them.
        const int share = ((TC_ROWS * NT + slices - 1) / slices + 127) / 128 * 128;
        const int done = min((first + 1) * share, TC_ROWS * NT);
        for (int idx = first * share + threadIdx.x; idx < done; idx += 128) {
            const int tok = idx / TC_ROWS, row = row0 + idx % TC_ROWS;
            const float *at_part = partial + tok * TC_PART_STRIDE + idx % TC_ROWS;
            float v[TC_MAX_SPLIT];
#pragma unroll
            for (int q = 0; q < TC_MAX_SPLIT; q++)
                if (q < slices) v[q] = ld_cluster(at_part, (u32)q);
            float total = v[0]; // ((p0 + p1) + p2) + ...: the serial form's order
#pragma unroll
            for (int q = 1; q < TC_MAX_SPLIT; q++)
                if (q < slices) total += v[q];
            if (row < n && tok < mc) store_output(y, addend, yf, total, m0 + tok, row, n, mtotal, seg, nseg);
        }
        cluster_sync(); // no block leaves while another may still read its shared memory
        return;
    }
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int e = 0; e < NT / 2; e++) {
            const int row = row0 + TC_ROW(m, e), tok = TC_TOKEN(e);
            if (row < n && tok < mc) store_output(y, addend, yf, acc[m][e], m0 + tok, row, n, mtotal, seg, nseg);
        }
#else
    __trap();
#endif
}

// The split and serial entry points for chunks of up to NT tokens: `tw` maps the weight [n, kdim] in boxes of
// [128 rows, 64 columns], `tx` the tokens [mtotal, kdim] in boxes of [NT, 64], both 128-byte swizzled.
#define SKINNY_WGMMA(NAME, NT, SERIAL)                                                                                \
    extern "C" __global__ void __launch_bounds__(160, 2)                                                           \
        NAME(const __grid_constant__ TensorMap tw, const __grid_constant__ TensorMap tx, __nv_bfloat16 *y,            \
             const __nv_bfloat16 *addend, float *yf, int n, int kdim, int mtotal, const int *seg, int nseg,            \
             int kslice) {                                                                                          \
        skinny_wgmma<NT, SERIAL>(tw, tx, y, addend, yf, n, kdim, mtotal, seg, nseg, kslice);                        \
    }
SKINNY_WGMMA(skinny_wgmma_t8, 8, false)
SKINNY_WGMMA(skinny_wgmma_t16, 16, false)
SKINNY_WGMMA(skinny_wgmma_t32, 32, false)
SKINNY_WGMMA(skinny_wgmma_t64, 64, false)
SKINNY_WGMMA(skinny_wgmma_serial_t8, 8, true)
SKINNY_WGMMA(skinny_wgmma_serial_t16, 16, true)
SKINNY_WGMMA(skinny_wgmma_serial_t32, 32, true)
SKINNY_WGMMA(skinny_wgmma_serial_t64, 64, true)
