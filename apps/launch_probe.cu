// What a persistent kernel pays before its first task, outside any tile: the launch itself
// (plain or cooperative, from a CUDA graph, back to back) and the prologue's grid-wide
// barrier (cooperative groups' grid sync, or one counter of arrivals). Each way is a CUDA
// graph of `kLaunches` launches of the same kernel, replayed; one line a way with the mean
// time a launch, so that the gap between a megakernel's replays and its own time can be
// split into what the launch costs and what the barrier does. Last, the way the benchmarks
// time a call: one launch a graph, queued behind a sleep kernel between two events
// (docs/performance.md, "A map's waits in one round of loads; what a launch costs").
//
//   nvcc -O3 -arch=sm_90a -o launch_probe apps/launch_probe.cu
//   ./launch_probe            # 132 SMs x 2 CTAs, 128 threads, 100 KB of shared memory a CTA
//   ./launch_probe 4 48       # 4 CTAs an SM, 48 KB each
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace cg = cooperative_groups;

constexpr int kThreads = 128;
constexpr int kLaunches = 200;
constexpr int kStateWords = 16384;  // a layer's counters and status, about 64 KB

#define CHECK(call)                                                                    \
  do {                                                                                 \
    cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

enum Body { kEmpty, kGridSync, kStateAndGridSync, kCounterBarrier, kStateAndCounterBarrier };

// One counter of arrivals that only grows: launch n's CTAs wait for it to reach `target`,
// (n + 1) x grid, so no launch resets it; n comes from a one-thread kernel after each launch.
__device__ void counter_barrier(unsigned* arrived, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrived, 1u);
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(arrived));
    } while (static_cast<int>(seen - target) < 0);
  }
  __syncthreads();
}

template <Body kBody>
__global__ void __launch_bounds__(kThreads) prologue(int* state, unsigned* arrived,
                                                     const unsigned* epoch) {
  extern __shared__ int arena[];
  if (kBody == kStateAndGridSync || kBody == kStateAndCounterBarrier) {
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < kStateWords;
         i += gridDim.x * kThreads)
      state[i] = 0;
  }
  if (kBody == kGridSync || kBody == kStateAndGridSync) cg::this_grid().sync();
  if (kBody == kCounterBarrier || kBody == kStateAndCounterBarrier)
    counter_barrier(arrived, (*epoch + 1u) * gridDim.x);
  if (threadIdx.x == 0) arena[0] = blockIdx.x;  // keeps the arena
}

__global__ void next_epoch(unsigned* epoch) { *epoch += 1u; }

__global__ void sleep_for(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

template <Body kBody>
float time_way(bool cooperative, bool with_epoch, int ctas, size_t smem, int* state,
               unsigned* arrived, unsigned* epoch) {
  CHECK(cudaFuncSetAttribute(prologue<kBody>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaMemset(arrived, 0, sizeof(unsigned)));
  CHECK(cudaMemset(epoch, 0, sizeof(unsigned)));
  void* args[] = {&state, &arrived, &epoch};
  auto launch = [&] {
    if (cooperative)
      CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(prologue<kBody>), ctas,
                                        kThreads, args, smem, stream));
    else
      prologue<kBody><<<ctas, kThreads, smem, stream>>>(state, arrived, epoch);
    if (with_epoch) next_epoch<<<1, 1, 0, stream>>>(epoch);
  };
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kLaunches; ++i) launch();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaGraphLaunch(exec, stream));  // warm
  CHECK(cudaStreamSynchronize(stream));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    best = ms < best ? ms : best;
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  return best * 1000.0f / kLaunches;
}

// Median us between two events around one replay of a one-launch graph, queued behind a
// sleep kernel the host outruns (timing.time_interleaved(queued=True)'s method).
template <Body kBody>
float time_queued(bool cooperative, int ctas, size_t smem, int* state, unsigned* arrived,
                  unsigned* epoch) {
  CHECK(cudaFuncSetAttribute(prologue<kBody>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void* args[] = {&state, &arrived, &epoch};
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  if (cooperative)
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(prologue<kBody>), ctas, kThreads,
                                      args, smem, stream));
  else
    prologue<kBody><<<ctas, kThreads, smem, stream>>>(state, arrived, epoch);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int rep = 0; rep < 220; ++rep) {
    sleep_for<<<1, 1, 0, stream>>>(200000);  // about 100 us
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (rep >= 20) times.push_back(ms * 1000.0f);
  }
  std::sort(times.begin(), times.end());
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  return times[times.size() / 2];
}

int main(int argc, char** argv) {
  int per_sm = argc > 1 ? std::atoi(argv[1]) : 2;
  size_t smem = (argc > 2 ? std::atoi(argv[2]) : 100) * 1024;
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int ctas = sms * per_sm;
  int* state;
  unsigned *arrived, *epoch;
  CHECK(cudaMalloc(&state, kStateWords * sizeof(int)));
  CHECK(cudaMalloc(&arrived, sizeof(unsigned)));
  CHECK(cudaMalloc(&epoch, sizeof(unsigned)));
  std::printf("%d CTAs (%d an SM) x %d threads, %zu KB of shared memory a CTA; us a launch, "
              "mean of %d in one graph, best of 5 replays\n",
              ctas, per_sm, kThreads, smem / 1024, kLaunches);
  std::printf("%-48s %8.2f\n", "plain launch, empty",
              time_way<kEmpty>(false, false, ctas, smem, state, arrived, epoch));
  std::printf("%-48s %8.2f\n", "plain launch + 1-thread epoch kernel",
              time_way<kEmpty>(false, true, ctas, smem, state, arrived, epoch));
  std::printf("%-48s %8.2f\n", "cooperative launch, empty",
              time_way<kEmpty>(true, false, ctas, smem, state, arrived, epoch));
  std::printf("%-48s %8.2f\n", "cooperative, grid sync",
              time_way<kGridSync>(true, false, ctas, smem, state, arrived, epoch));
  std::printf("%-48s %8.2f\n", "cooperative, 64 KB of state + grid sync",
              time_way<kStateAndGridSync>(true, false, ctas, smem, state, arrived, epoch));
  std::printf("%-48s %8.2f\n", "cooperative, counter barrier + epoch kernel",
              time_way<kCounterBarrier>(true, true, ctas, smem, state, arrived, epoch));
  std::printf("%-48s %8.2f\n", "cooperative, 64 KB of state + counter barrier",
              time_way<kStateAndCounterBarrier>(true, true, ctas, smem, state, arrived,
                                                 epoch));
  std::printf("%-48s %8.2f\n", "plain, 64 KB of state + counter barrier",
              time_way<kStateAndCounterBarrier>(false, true, ctas, smem, state, arrived,
                                                 epoch));
  std::printf("%-48s %8.2f\n", "one plain launch a graph, queued, empty",
              time_queued<kEmpty>(false, ctas, smem, state, arrived, epoch));
  std::printf("%-48s %8.2f\n", "one cooperative launch a graph, queued, empty",
              time_queued<kEmpty>(true, ctas, smem, state, arrived, epoch));
  std::printf("%-48s %8.2f\n", "same, 64 KB of state + grid sync",
              time_queued<kStateAndGridSync>(true, ctas, smem, state, arrived, epoch));
  return 0;
}
