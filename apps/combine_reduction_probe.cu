// The MoE layer's last step at 1024 tokens, outside any tile: the down tasks' stores of y
// (bf16, one row a pair) and the combine's weighted sums of each token's 8 rows, against
// reductions (red.global.add.f32, in 1, 2 or 4 lanes) of each weighted row straight into an
// fp32 accumulator of the tokens (8 MB, which L2 holds), zeroed first and rounded to bf16
// last (docs/performance.md, "An fp32 accumulator in place of y; L2 policies on the weight
// copies"). Tasks as the layer's: 80 rows x 128 columns. Medians of 30 launches, "cold"
// after a 1 GiB write that leaves none of the operands in L2; the last line compares the two
// results.
//
//   nvcc -O3 -arch=sm_90a -o combine_reduction_probe apps/combine_reduction_probe.cu
//   ./combine_reduction_probe
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

constexpr int T = 1024, H = 2048, K = 8, P = T * K, ROWS = 80, COLS = 128, THREADS = 128;

__global__ void store_y(const int* tok, const float* w, __nv_bfloat16* y) {
  int r0 = blockIdx.x * ROWS, c0 = blockIdx.y * COLS;
  for (int i = threadIdx.x; i < ROWS * COLS / 2; i += THREADS) {
    int r = r0 + i / (COLS / 2), c = c0 + 2 * (i % (COLS / 2));
    if (r >= P) break;
    float v = (r * 0.001f + c);
    *reinterpret_cast<__nv_bfloat162*>(y + (size_t)r * H + c) = __floats2bfloat162_rn(v, v + 1);
  }
}
__global__ void combine(const int* pair_row, const float* topw, const __nv_bfloat16* y,
                        __nv_bfloat16* out) {
  int t = blockIdx.x;
  for (int c = 2 * threadIdx.x; c < H; c += 2 * THREADS) {
    float a = 0, b = 0;
    for (int k = 0; k < K; ++k) {
      float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
          y + (size_t)pair_row[t * K + k] * H + c));
      float ww = topw[t * K + k];
      a += ww * v.x; b += ww * v.y;
    }
    *reinterpret_cast<__nv_bfloat162*>(out + (size_t)t * H + c) = __floats2bfloat162_rn(a, b);
  }
}
template <int V>
__global__ void red_acc(const int* tok, const float* w, float* acc) {
  int r0 = blockIdx.x * ROWS, c0 = blockIdx.y * COLS;
  for (int i = threadIdx.x; i < ROWS * COLS / V; i += THREADS) {
    int r = r0 + i / (COLS / V), c = c0 + V * (i % (COLS / V));
    if (r >= P) break;
    float ww = w[r], f = r * 0.001f + c;
    float v = ww * f, v1 = ww * (f + 1), v2 = ww * (f + 2), v3 = ww * (f + 3);
    float* p = acc + (size_t)tok[r] * H + c;
    if (V == 4)
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v), "f"(v1), "f"(v2), "f"(v3) : "memory");
    else if (V == 2)
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(v), "f"(v1) : "memory");
    else
      asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory");
  }
}
__global__ void finalize(const float* acc, __nv_bfloat16* out) {
  int t = blockIdx.x;
  for (int c = 4 * threadIdx.x; c < H; c += 4 * THREADS) {
    float4 v = *reinterpret_cast<const float4*>(acc + (size_t)t * H + c);
    *reinterpret_cast<__nv_bfloat162*>(out + (size_t)t * H + c) = __floats2bfloat162_rn(v.x, v.y);
    *reinterpret_cast<__nv_bfloat162*>(out + (size_t)t * H + c + 2) = __floats2bfloat162_rn(v.z, v.w);
  }
}
__global__ void flush(float* big, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) big[i] += 1.f;
}
int main() {
  std::mt19937 g(0);
  std::vector<int> tok(P), pair_row(P);
  std::vector<float> w(P, 0.125f);
  // the rows of y in expert order: each row a random one of the pairs
  std::vector<int> perm(P);
  for (int i = 0; i < P; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), g);
  for (int r = 0; r < P; ++r) { tok[r] = perm[r] / K; pair_row[perm[r]] = r; }
  int *dtok, *dpr; float *dw, *acc, *big; __nv_bfloat16 *y, *out;
  size_t nbig = 256u << 20;
  cudaMalloc(&dtok, P * 4); cudaMalloc(&dpr, P * 4); cudaMalloc(&dw, P * 4);
  cudaMalloc(&acc, (size_t)T * H * 4); cudaMalloc(&y, (size_t)P * H * 2); cudaMalloc(&out, (size_t)T * H * 2);
  cudaMalloc(&big, nbig * 4);
  cudaMemcpy(dtok, tok.data(), P * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dpr, pair_row.data(), P * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dw, w.data(), P * 4, cudaMemcpyHostToDevice);
  dim3 grid((P + ROWS - 1) / ROWS, H / COLS);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto timeit = [&](const char* name, auto fn, bool cold) {
    std::vector<float> ts;
    for (int it = 0; it < 30; ++it) {
      if (cold) flush<<<528, 256>>>(big, nbig);
      cudaEventRecord(a); fn(); cudaEventRecord(b); cudaEventSynchronize(b);
      float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms * 1000);
    }
    std::sort(ts.begin(), ts.end());
    printf("%-40s %s %8.1f us\n", name, cold ? "cold" : "warm", ts[ts.size() / 2]);
  };
  for (bool cold : {false, true}) {
    timeit("store y (bf16, 33.5 MB)", [&] { store_y<<<grid, THREADS>>>(dtok, dw, y); }, cold);
    timeit("combine (reads y)", [&] { combine<<<T, THREADS>>>(dpr, dw, y, out); }, cold);
    timeit("store y + combine", [&] { store_y<<<grid, THREADS>>>(dtok, dw, y); combine<<<T, THREADS>>>(dpr, dw, y, out); }, cold);
    timeit("memset acc (8 MB)", [&] { cudaMemsetAsync(acc, 0, (size_t)T * H * 4); }, cold);
    timeit("red v4", [&] { red_acc<4><<<grid, THREADS>>>(dtok, dw, acc); }, cold);
    timeit("red v2", [&] { red_acc<2><<<grid, THREADS>>>(dtok, dw, acc); }, cold);
    timeit("red scalar", [&] { red_acc<1><<<grid, THREADS>>>(dtok, dw, acc); }, cold);
    timeit("finalize (reads acc)", [&] { finalize<<<T, THREADS>>>(acc, out); }, cold);
    timeit("memset + red v4 + finalize", [&] { cudaMemsetAsync(acc, 0, (size_t)T * H * 4); red_acc<4><<<grid, THREADS>>>(dtok, dw, acc); finalize<<<T, THREADS>>>(acc, out); }, cold);
  }
  // check: reds give the combine's values
  cudaMemset(acc, 0, (size_t)T * H * 4); red_acc<4><<<grid, THREADS>>>(dtok, dw, acc);
  store_y<<<grid, THREADS>>>(dtok, dw, y); combine<<<T, THREADS>>>(dpr, dw, y, out);
  std::vector<float> h_acc((size_t)T * H); std::vector<__nv_bfloat16> h_out((size_t)T * H);
  cudaMemcpy(h_acc.data(), acc, h_acc.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(h_out.data(), out, h_out.size() * 2, cudaMemcpyDeviceToHost);
  double worst = 0;
  for (size_t i = 0; i < h_acc.size(); ++i) worst = std::max(worst, (double)fabsf(h_acc[i] - __bfloat162float(h_out[i])) / (fabsf(h_acc[i]) + 1e-3));
  printf("worst relative difference red vs combine: %.3g (%s)\n", worst, cudaGetErrorString(cudaGetLastError()));
}
