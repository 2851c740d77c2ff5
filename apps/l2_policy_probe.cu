// L2 eviction policies on a streamed weight read, outside any tile: would an evict-first
// hint on the weights' cp.async copies keep another buffer (the MoE layer's y, 33 MB at 1024
// tokens) in L2 while 400 MB of weights stream past? (docs/performance.md, "An fp32
// accumulator in place of y; L2 policies on the weight copies".) Prints the 64-bit values
// `createpolicy` yields, then one line a way of streaming, each with the time to read y back
// after the stream. A hinted copy that stops the kernel ("an illegal instruction") leaves
// the context unusable, so each way runs in a process of its own:
//
//   nvcc -O3 -arch=sm_90a -o l2_policy_probe apps/l2_policy_probe.cu
//   for way in 0 1 2 3 4; do ./l2_policy_probe $way; done
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

enum Way { kPlain, kCreatePolicy, kConstant, kNoStream, kLoaded, kWays };
const char* kNames[kWays] = {"plain cp.async", "evict_first (createpolicy)",
                             "evict_first (a constant)", "no stream (y left in L2)",
                             "evict_first (loaded a thread)"};

__global__ void policies(unsigned long long* out) {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  out[0] = p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  out[1] = p;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
  out[2] = p;
  asm volatile("createpolicy.fractional.L2::evict_unchanged.b64 %0, 1.0;" : "=l"(p));
  out[3] = p;
}

__global__ void write_y(float* y, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = i;
}

__global__ void read_y(const float* y, size_t n, float* sink) {
  float s = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n / 4; i += gridDim.x * blockDim.x) {
    float4 v = reinterpret_cast<const float4*>(y)[i];
    s += v.x + v.y + v.z + v.w;
  }
  if (s == -1.f) *sink = s;
}

// Each CTA streams its slab through a 4-stage ring of 8 KB slices (three in flight), with
// the policy, where there is one, from `createpolicy`, a kernel parameter or a load.
template <Way W>
__global__ void stream(const char* w, size_t slab, unsigned long long constant, float* sink,
                       const unsigned long long* loaded) {
  extern __shared__ __align__(16) char ring[];
  unsigned long long policy = constant;
  if (W == kCreatePolicy)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  if (W == kLoaded) policy = *(volatile const unsigned long long*)loaded;
  const char* base = w + blockIdx.x * slab;
  uint32_t shared = (uint32_t)__cvta_generic_to_shared(ring);
  int steps = slab / 8192;
  auto issue = [&](int q) {
    for (int c = 0; c < 4; ++c) {
      uint32_t dst = shared + (q % 4) * 8192 + (c * 128 + threadIdx.x) * 16;
      const char* src = base + (size_t)q * 8192 + (c * 128 + threadIdx.x) * 16;
      if (W == kPlain)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
      else
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
                     ::"r"(dst), "l"(src), "l"(policy) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  float s = 0;
  for (int q = 0; q < 3; ++q) issue(q);
  for (int q = 0; q < steps; ++q) {
    if (q + 3 < steps) issue(q + 3);
    else asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 3;" ::: "memory");
    __syncthreads();
    s += reinterpret_cast<float*>(ring + (q % 4) * 8192)[threadIdx.x];
    __syncthreads();
  }
  if (s == -1.f) *sink = s;
}

int main(int argc, char** argv) {
  int only = argc > 1 ? atoi(argv[1]) : -1;
  unsigned long long* device_policies;
  cudaMalloc(&device_policies, 32);
  policies<<<1, 1>>>(device_policies);
  unsigned long long p[4];
  cudaMemcpy(p, device_policies, 32, cudaMemcpyDeviceToHost);
  printf("createpolicy: evict_first %016llx evict_last %016llx evict_normal %016llx "
         "evict_unchanged %016llx\n", p[0], p[1], p[2], p[3]);
  size_t ny = (33u << 20) / 4, slab = 192 * 1024, ctas = 528 * 4;  // 405 MB of weights
  float *y, *sink;
  char* w;
  cudaMalloc(&y, ny * 4);
  cudaMalloc(&sink, 4);
  cudaMalloc(&w, slab * ctas * 2);
  cudaMemset(w, 1, slab * ctas * 2);
  cudaEvent_t a, b, c;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventCreate(&c);
  for (int way = 0; way < kWays; ++way) {
    if (only >= 0 && way != only) continue;
    std::vector<float> streamed, read;
    for (int it = 0; it < 20; ++it) {
      const char* weights = w + (it % 2) * slab * ctas;  // two halves: none of it in L2
      write_y<<<528, 256>>>(y, ny);
      cudaEventRecord(a);
      if (way == kPlain) stream<kPlain><<<ctas, 128, 32768>>>(weights, slab, 0, sink, nullptr);
      if (way == kCreatePolicy)
        stream<kCreatePolicy><<<ctas, 128, 32768>>>(weights, slab, 0, sink, nullptr);
      if (way == kConstant)
        stream<kConstant><<<ctas, 128, 32768>>>(weights, slab, p[0], sink, nullptr);
      if (way == kLoaded)
        stream<kLoaded><<<ctas, 128, 32768>>>(weights, slab, 0, sink, device_policies);
      cudaEventRecord(b);
      read_y<<<528, 256>>>(y, ny, sink);
      cudaEventRecord(c);
      cudaEventSynchronize(c);
      float ms_stream, ms_read;
      cudaEventElapsedTime(&ms_stream, a, b);
      cudaEventElapsedTime(&ms_read, b, c);
      streamed.push_back(ms_stream * 1000);
      read.push_back(ms_read * 1000);
    }
    std::sort(streamed.begin(), streamed.end());
    std::sort(read.begin(), read.end());
    printf("%-30s stream 405 MB %7.1f us, then read y (33 MB) %6.1f us: %s\n", kNames[way],
           streamed[10], read[10], cudaGetErrorString(cudaGetLastError()));
  }
}
