// sparkd: the bandwidth a KDA decode step's state traffic can reach on the device, without the model around it.
// At batch 64 the recurrence reads and writes every (row, head) state of a layer in place: 6,144 chunks of 64 KB
// (K = 128, fp32). This times that pattern alone (in-place read-modify-write of each chunk by one block of 256
// threads, float4 rows in registers, with and without a chain of dependent loads and barriers; the same through
// shared memory by TMA bulk copies at 3 blocks per SM), against an out-of-place copy of the same bytes.
// It needs only nvcc, so it runs on the GPU machine as is (its results: docs/perf/decisions.md#d54):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/state_rmw kernels/bench/state_rmw.cu && /tmp/state_rmw
#include <cstdio>
#include <cuda_runtime.h>
#define CH (16384)  // floats per chunk (64 KB)
__global__ void copy_k(const float4 *a, float4 *b, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) b[i] = a[i];
}
template <int CHAIN>
__global__ void __launch_bounds__(256, 2) rmw_regs(float *s, const long *table, float f) {
  const long *e = table + blockIdx.x * 4;
  float *p = s;
  if (CHAIN) { long off = e[0]; p = s + off; } else p = s + (long)blockIdx.x * CH;
  float4 v[16];
  int t = threadIdx.x;
#pragma unroll
  for (int i = 0; i < 16; i++) v[i] = ((float4 *)p)[i * 256 + t];
  __shared__ float red[256];
  float acc = 0;
#pragma unroll
  for (int i = 0; i < 16; i++) { v[i].x *= f; v[i].y *= f; v[i].z *= f; v[i].w *= f; acc += v[i].x; }
  if (CHAIN) {
    for (int k = 0; k < CHAIN; k++) { red[t] = acc; __syncthreads(); acc += red[(t + 1) & 255] * 1e-9f; __syncthreads();
      acc += __ldg((const float *)(table + ((long)(acc != 12345.f) * blockIdx.x * 4 + 1))) * 0.0f; }
  }
#pragma unroll
  for (int i = 0; i < 16; i++) { v[i].y += acc * 1e-30f; ((float4 *)p)[i * 256 + t] = v[i]; }
}
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__global__ void __launch_bounds__(256, 3) rmw_tma(float *s, float f) {
  extern __shared__ __align__(16) float st[];
  __shared__ unsigned long long bar;
  float *p = s + (long)blockIdx.x * CH;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar)), "r"(CH * 4) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(st)), "l"(p), "r"(CH * 4), "r"(smem_u32(&bar)) : "memory");
  }
  __syncthreads();
  unsigned done = 0;
  while (!done) asm volatile("{\n\t.reg .pred q;\n\tmbarrier.try_wait.parity.shared::cta.b64 q, [%1], 0;\n\tselp.u32 %0, 1, 0, q;\n\t}" : "=r"(done) : "r"(smem_u32(&bar)) : "memory");
  for (int i = threadIdx.x; i < CH / 4; i += 256) { float4 v = ((float4 *)st)[i]; v.x *= f; v.y *= f; v.z *= f; v.w *= f; ((float4 *)st)[i] = v; }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(p), "r"(smem_u32(st)), "r"(CH * 4) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
  __syncthreads();
}
int main() {
  const int blocks = 6144;
  long n = (long)blocks * CH;
  float *a, *b; long *table;
  cudaMalloc(&a, n * 4); cudaMalloc(&b, n * 4); cudaMalloc(&table, blocks * 4 * 8);
  cudaMemset(a, 0, n * 4);
  long *h = new long[blocks * 4];
  for (int i = 0; i < blocks; i++) { h[i * 4] = (long)i * CH; h[i * 4 + 1] = 0; }
  cudaMemcpy(table, h, blocks * 32, cudaMemcpyHostToDevice);
  cudaFuncSetAttribute(rmw_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, CH * 4);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto time = [&](const char *name, auto launch) {
    for (int w = 0; w < 3; w++) launch();
    cudaEventRecord(e0);
    for (int r = 0; r < 20; r++) launch();
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= 20;
    printf("%-28s %8.1f us  %7.0f GB/s (read+write)  %s\n", name, ms * 1000, 2.0 * n * 4 / (ms * 1e-3) / 1e9, cudaGetErrorString(cudaGetLastError()));
  };
  time("copy (out of place)", [&] { copy_k<<<132 * 8, 512>>>((float4 *)a, (float4 *)b, n / 4); });
  time("rmw registers", [&] { rmw_regs<0><<<blocks, 256>>>(a, table, 1.0f); });
  time("rmw registers, chain 2", [&] { rmw_regs<2><<<blocks, 256>>>(a, table, 1.0f); });
  time("rmw registers, chain 6", [&] { rmw_regs<6><<<blocks, 256>>>(a, table, 1.0f); });
  time("rmw tma (3 blocks/SM)", [&] { rmw_tma<<<blocks, 256, CH * 4>>>(a, 1.0f); });
  return 0;
}
