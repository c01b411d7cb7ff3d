// sparkd: the helpers every kernel source shares. compile.rs prepends this file to each .cu source before
// NVRTC compiles it (and the CUBIN cache key covers it), so a source uses these without an #include.
//
// Invariants: the block reductions sum (or take the max) in one fixed order — a xor butterfly within each
// warp, then the warp partials in warp order — so a reduction's result depends only on the values, never
// on the batch a row sits in; blockDim.x is a multiple of 32 and at most 1024, and every thread of the
// block calls them (they synchronise) and gets the result.
#include <cuda_bf16.h>

#define INF_F __int_as_float(0x7f800000)

typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float ld(const __nv_bfloat16 *p, i64 i) { return __bfloat162float(p[i]); }

// A 16-byte load of weights that are streamed (read once per pass): read-only path, not kept in L1, and a miss
// fetches 256 bytes into L2 so that the next 128 bytes of the row are on their way before they are asked for.
// `p` is 16-byte aligned.
__device__ __forceinline__ uint4 ld_stream16(const void *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
// Programmatic dependent launch (Hopper and later; the host launches every kernel with programmatic stream
// serialisation, see launch.rs). A kernel may start while the kernel before it on the stream is still running, so
// every kernel calls grid_dependency_wait() before it writes anything, and before it reads anything but weights and
// data that it says no kernel of the step writes before it (kda_step: the step table, uploaded before the step,
// and its own rows' states): the wait returns once the kernel before has finished and its memory is visible (so,
// in turn, every kernel before that). Every kernel calls it on every path, early exits included, so that its
// completion implies its predecessors'. Then launch_dependents() lets the next kernel's blocks be scheduled into
// what this one leaves free; they run only their early loads until their wait. Both are no-ops before Hopper and
// in a launch without the attribute.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// The entry of a kernel that reads nothing before its wait.
__device__ __forceinline__ void kernel_entry() {
    grid_dependency_wait();
    launch_dependents();
}
__device__ __forceinline__ float bf_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum of `v` over the block.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// The shared-memory address of `p` (a generic pointer into shared memory), as the shared-state instructions take it.
__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }

// Hopper and later; also declared in nvcc's host pass, which parses kernel bodies (kernels/bench/wgmma_probe.cu
// includes this file; NVRTC always compiles for a device).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// mbarriers in shared memory that count the copy engine's transfers (Hopper and later).
__device__ __forceinline__ void mbarrier_init(unsigned long long *bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Makes the block's mbarrier initialisations visible to the copy engine and the cluster (once, after them all).
__device__ __forceinline__ void mbarrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive(unsigned long long *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// An arrival that also expects `bytes` of copies to complete the phase.
__device__ __forceinline__ void mbarrier_expect(unsigned long long *bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned long long *bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile(
            "{\n\t.reg .pred q;\n\tmbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2;\n\tselp.u32 %0, 1, 0, q;\n\t}"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
}

// The copy engine (TMA): the box of the 2D tensor map `map` (a CUtensorMap) at (column k, row) into shared memory,
// counted on `bar`.
__device__ __forceinline__ void tma_load_2d(void *dst, const void *map, int k, int row, unsigned long long *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(smem_addr(dst)), "l"(map), "r"(k), "r"(row), "r"(smem_addr(bar))
                 : "memory");
}
// The warpgroup MMA's descriptor of a K-major tile of 128-byte swizzled lines (1024 bytes per 8 rows) from its k16
// step at `p` in shared memory.
__device__ __forceinline__ unsigned long long smem_desc_sw128(const void *p) {
    return (unsigned long long)((smem_addr(p) & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// Thread-block clusters (Hopper and later).

// Every thread of every block of the cluster waits here; shared-memory writes before it are visible to the
// cluster's blocks after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The float at `p` in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float ld_cluster(const float *p, u32 rank) {
    u32 local = (u32)__cvta_generic_to_shared(p), remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// The sum over the cluster's BLOCKS blocks, in rank order, of the float at `p` in each one's shared memory
// (written before a cluster_sync). Every remote load is issued before the first add.
template <int BLOCKS>
__device__ __forceinline__ float cluster_sum(const float *p) {
    float v[BLOCKS];
#pragma unroll
    for (int r = 0; r < BLOCKS; r++) v[r] = ld_cluster(p, (u32)r);
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < BLOCKS; r++) total += v[r];
    return total;
}
#endif

// Max of `v` over the block.
__device__ float block_max(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? partial[lane] : -INF_F;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

// Asynchronous copies from global to the shared address `dst` (Ampere and later), waited for by commit group: 16
// bytes through L2 only (a miss fetches 256 bytes) or 4 bytes through L1, copying `bytes` (16 or 4; 0: zeros, nothing
// read).
__device__ __forceinline__ void cp_async16_shared(u32 dst, const void *src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async4_shared(u32 dst, const void *src, u32 bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// cp_async4_shared to a generic pointer into shared memory; with `ok` false the destination is zero-filled.
__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool ok) {
    cp_async4_shared(smem_addr(dst), src, ok ? 4u : 0u);
}
// Loads from a shared address (the ring pass keeps its slots as shared addresses, so that constant offsets fold into
// the instructions).
__device__ __forceinline__ uint4 ld_shared16(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ u32 ld_shared_u8(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// Four 8x8 bf16 matrices from shared memory: lanes 8i..8i+7 give the 16-byte rows of matrix i, and lane l
// receives r[i] = matrix i's (row l / 4, columns 2 (l % 4), +1); with TRANS, matrix i's (rows 2 (l % 4), +1,
// column l / 4): the MMA fragment layouts.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void *row) {
    u32 a = (u32)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
}
// d = a b + d on the tensor cores (Ampere and later): a 16 x 16 bf16 A fragment (a0..a3, row-major), a 16 x 8 bf16 B
// fragment (b0, b1, column-major), fp32 accumulators c[0..3] (rows g and g + 8, columns 2t and 2t + 1 of the tile,
// g = lane / 4, t = lane % 4).
__device__ __forceinline__ void mma_bf16(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Element index of output (m, col) of a GEMM's [mtotal, n] result (gemm.cu, gemm_tc.cu): row-major, or segment-major
// when `seg` is given (column range [seg[i], seg[i + 1]) is its own contiguous [mtotal, seg[i + 1] - seg[i]] block at
// element offset mtotal * seg[i]).
__device__ __forceinline__ long out_index(int m, int col, int n, int mtotal, const int *seg, int nseg) {
    if (seg == nullptr) return (long)m * n + col;
    int i = 0;
    while (i + 1 < nseg && col >= seg[i + 1]) i++;
    int lo = seg[i], width = seg[i + 1] - lo;
    return (long)mtotal * lo + (long)m * width + (col - lo);
}
