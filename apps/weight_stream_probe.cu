// Weight streaming on the H200, outside any tile: each CTA reads its own contiguous slab,
// as the MoE layer's grouped-GEMM tasks do at few tokens (docs/performance.md, "What a
// weight stream reaches"). Variants: a cp.async ring in shared memory (with and without
// the L2 prefetch-size hints; 8 KB and 16 KB slices), 16-byte loads into registers, and a
// ring filled by bulk copies (cp.async.bulk, one thread issuing, an mbarrier a slot).
// Slabs rotate through 1 GiB so that L2 holds none of them; each time is the mean of 40
// launches back to back, so it includes the gap between launches.
//
//   nvcc -O3 -arch=sm_90a -o weight_stream_probe apps/weight_stream_probe.cu
//   ./weight_stream_probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

constexpr int kThreads = 128;

enum Hint { kNoHint, kL2Prefetch128, kL2Prefetch256 };

template <Hint H>
__device__ __forceinline__ void copy16(uint32_t dst, const char* src) {
  if (H == kNoHint)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  if (H == kL2Prefetch128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src)
                 : "memory");
  if (H == kL2Prefetch256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src)
                 : "memory");
}

// Slice q of the CTA's slab into ring slot q % STAGES.
template <Hint H, int STAGES>
__device__ __forceinline__ void issue(uint32_t ring, const char* slab, int slice, int q) {
  for (int i = threadIdx.x; i < slice / 16; i += kThreads)
    copy16<H>(ring + (q % STAGES) * slice + i * 16, slab + static_cast<size_t>(q) * slice + i * 16);
}

// The CTA's slab through a STAGES-deep ring of `slice`-byte slots, the gemm tiles' loop:
// STAGES - 1 slices in flight, two CTA barriers a slice.
template <Hint H, int STAGES>
__global__ void __launch_bounds__(kThreads)
    ring_stream(const char* w, size_t slab_bytes, int slice, float* sink) {
  extern __shared__ uint4 ring[];
  const char* slab = w + blockIdx.x * slab_bytes;
  const int slices = static_cast<int>(slab_bytes / slice);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  float acc = 0;
  for (int p = 0; p < STAGES - 1; ++p) {
    if (p < slices) issue<H, STAGES>(base, slab, slice, p);
    asm volatile("cp.async.commit_group;");
  }
  for (int k = 0; k < slices; ++k) {
    if (k + STAGES - 1 < slices) issue<H, STAGES>(base, slab, slice, k + STAGES - 1);
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
    __syncthreads();
    const uint4* slot = ring + (k % STAGES) * slice / 16;
    for (int i = threadIdx.x; i < slice / 16; i += kThreads) acc += __uint_as_float(slot[i].x);
    __syncthreads();
  }
  if (acc == 1234.5f) *sink = acc;  // never true: keeps the loads
}

__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
  asm volatile(
      "{ .reg .pred done;\n"
      "WAIT%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT%=; }" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One bulk copy (the TMA's 1-D form) of `bytes` into a ring slot, counted by its mbarrier.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const char* src, int bytes, uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// The CTA's slab through a STAGES-deep ring of `slice`-byte slots filled by one thread's bulk
// copies: STAGES slices in flight, an mbarrier a slot, one CTA barrier a slice.
template <int STAGES>
__global__ void __launch_bounds__(kThreads)
    bulk_stream(const char* w, size_t slab_bytes, int slice, float* sink) {
  extern __shared__ __align__(128) uint4 ring[];
  __shared__ __align__(8) uint64_t full[STAGES];
  const char* slab = w + blockIdx.x * slab_bytes;
  const int slices = static_cast<int>(slab_bytes / slice);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int q = 0; q < STAGES && q < slices; ++q)
      bulk_copy(base + q * slice, slab + static_cast<size_t>(q) * slice, slice, bars + 8 * q);
  }
  __syncthreads();
  float acc = 0;
  for (int k = 0; k < slices; ++k) {
    const int s = k % STAGES;
    mbarrier_wait(bars + 8 * s, (k / STAGES) & 1);
    const uint4* slot = ring + s * slice / 16;
    for (int i = threadIdx.x; i < slice / 16; i += kThreads) acc += __uint_as_float(slot[i].x);
    __syncthreads();
    if (threadIdx.x == 0 && k + STAGES < slices)
      bulk_copy(base + s * slice, slab + static_cast<size_t>(k + STAGES) * slice, slice,
                bars + 8 * s);
  }
  if (acc == 1234.5f) *sink = acc;
}

// The CTA's slab in 16-byte loads that skip L1, U of them in flight a thread.
template <int U>
__global__ void __launch_bounds__(kThreads)
    register_stream(const char* w, size_t slab_bytes, int, float* sink) {
  const uint4* slab = reinterpret_cast<const uint4*>(w + blockIdx.x * slab_bytes);
  const size_t n = slab_bytes / 16;
  float acc = 0;
  for (size_t i = threadIdx.x; i < n; i += kThreads * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t j = i + u * kThreads;
      v[u] = make_uint4(0, 0, 0, 0);
      if (j < n)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                     : "l"(slab + j));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc += __uint_as_float(v[u].x);
  }
  if (acc == 1234.5f) *sink = acc;
}

using Kernel = void (*)(const char*, size_t, int, float*);

struct Variant {
  const char* name;
  Kernel kernel;
  int slot_bytes, stages;
};

int main() {
  const size_t total = size_t{1} << 30;
  char* w;
  float* sink;
  cudaMalloc(&w, total);
  cudaMalloc(&sink, sizeof(float));
  cudaMemset(w, 1, total);
  const Variant variants[] = {
      {"cp.async 8x8KB", ring_stream<kNoHint, 8>, 8192, 8},
      {"cp.async.L2::128B 8x8KB", ring_stream<kL2Prefetch128, 8>, 8192, 8},
      {"cp.async.L2::256B 8x8KB", ring_stream<kL2Prefetch256, 8>, 8192, 8},
      {"cp.async 12x8KB", ring_stream<kNoHint, 12>, 8192, 12},
      {"cp.async 6x16KB", ring_stream<kNoHint, 6>, 16384, 6},
      {"ld.global x4", register_stream<4>, 0, 0},
      {"ld.global x8", register_stream<8>, 0, 0},
      {"bulk 8x16KB", bulk_stream<8>, 16384, 8},
      {"bulk 12x16KB", bulk_stream<12>, 16384, 12},
      {"bulk 4x32KB", bulk_stream<4>, 32768, 4},
      {"bulk 6x32KB", bulk_stream<6>, 32768, 6},
  };
  // 384 KB x 128 and 192 KB x 128: one token's gate_up and down tasks at one CTA an SM
  const size_t slabs[] = {384 << 10, 256 << 10, 192 << 10, 128 << 10};
  const int ctas[] = {128, 192, 256, 264, 528};
  const int reps = 40;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  printf("%-26s %8s %6s %9s %8s\n", "variant", "slab KB", "CTAs", "us", "TB/s");
  for (const Variant& v : variants) {
    const int smem = v.slot_bytes * v.stages;
    cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    for (size_t slab : slabs) {
      for (int n : ctas) {
        const size_t bytes = slab * n;
        const size_t windows = total / bytes;
        auto launch = [&](int r) {
          v.kernel<<<n, kThreads, smem>>>(w + (r % windows) * bytes, slab, v.slot_bytes, sink);
        };
        for (int r = 0; r < 3; ++r) launch(r);
        cudaEventRecord(start);
        for (int r = 0; r < reps; ++r) launch(r);
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms;
        cudaEventElapsedTime(&ms, start, stop);
        const double us = ms * 1e3 / reps;
        printf("%-26s %8zu %6d %9.2f %8.2f\n", v.name, slab >> 10, n, us, bytes / us / 1e6);
      }
    }
  }
  const cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
