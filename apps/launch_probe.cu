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

// What every way launches: the grid, its shared memory and the kernel's buffers.
struct Grid {
  int ctas;
  size_t smem;
  int* state;
  unsigned* arrived;
  unsigned* epoch;
};

// A graph of `launches` launches of prologue<kBody> on `stream`, each followed by a
// one-thread kernel that counts it where `count_epochs` (the counter barrier's launch number).
template <Body kBody>
cudaGraphExec_t capture(Grid g, bool cooperative, bool count_epochs, int launches,
                        cudaStream_t stream) {
  CHECK(cudaFuncSetAttribute(prologue<kBody>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(g.smem)));
  void* args[] = {&g.state, &g.arrived, &g.epoch};
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < launches; ++i) {
    if (cooperative)
      CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(prologue<kBody>), g.ctas,
                                        kThreads, args, g.smem, stream));
    else
      prologue<kBody><<<g.ctas, kThreads, g.smem, stream>>>(g.state, g.arrived, g.epoch);
    if (count_epochs) next_epoch<<<1, 1, 0, stream>>>(g.epoch);
  }
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphDestroy(graph));
  return exec;
}

// us between two events around a replay of `exec`, queued behind a sleep kernel the host
// outruns where `queued` (timing.time_interleaved(queued=True)'s method).
float replay(cudaGraphExec_t exec, cudaStream_t stream, bool queued) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  if (queued) sleep_for<<<1, 1, 0, stream>>>(200000);  // about 100 us
  CHECK(cudaEventRecord(start, stream));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  float ms;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return ms * 1000.0f;
}

// us a launch: the best of 5 replays of a graph of kLaunches launches back to back.
template <Body kBody>
float back_to_back(Grid g, bool cooperative, bool count_epochs) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaMemset(g.arrived, 0, sizeof(unsigned)));
  CHECK(cudaMemset(g.epoch, 0, sizeof(unsigned)));
  cudaGraphExec_t exec = capture<kBody>(g, cooperative, count_epochs, kLaunches, stream);
  CHECK(cudaGraphLaunch(exec, stream));  // warm
  CHECK(cudaStreamSynchronize(stream));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) best = std::min(best, replay(exec, stream, false));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaStreamDestroy(stream));
  return best / kLaunches;
}

// us a call as the benchmarks time one: the median of 200 replays of a one-launch graph,
// each queued behind a sleep kernel (after 20 not counted).
template <Body kBody>
float one_a_graph(Grid g, bool cooperative) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t exec = capture<kBody>(g, cooperative, false, 1, stream);
  std::vector<float> times;
  for (int rep = 0; rep < 220; ++rep) {
    float us = replay(exec, stream, true);
    if (rep >= 20) times.push_back(us);
  }
  std::sort(times.begin(), times.end());
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaStreamDestroy(stream));
  return times[times.size() / 2];
}

void row(const char* way, float us) { std::printf("%-48s %8.2f\n", way, us); }

int main(int argc, char** argv) {
  int per_sm = argc > 1 ? std::atoi(argv[1]) : 2;
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Grid g{sms * per_sm, static_cast<size_t>(argc > 2 ? std::atoi(argv[2]) : 100) * 1024};
  CHECK(cudaMalloc(&g.state, kStateWords * sizeof(int)));
  CHECK(cudaMalloc(&g.arrived, sizeof(unsigned)));
  CHECK(cudaMalloc(&g.epoch, sizeof(unsigned)));
  std::printf("%d CTAs (%d an SM) x %d threads, %zu KB of shared memory a CTA; us a launch, "
              "mean of %d in one graph, best of 5 replays\n",
              g.ctas, per_sm, kThreads, g.smem / 1024, kLaunches);
  row("plain launch, empty", back_to_back<kEmpty>(g, false, false));
  row("plain launch + 1-thread epoch kernel", back_to_back<kEmpty>(g, false, true));
  row("cooperative launch, empty", back_to_back<kEmpty>(g, true, false));
  row("cooperative, grid sync", back_to_back<kGridSync>(g, true, false));
  row("cooperative, 64 KB of state + grid sync", back_to_back<kStateAndGridSync>(g, true, false));
  row("cooperative, counter barrier + epoch kernel", back_to_back<kCounterBarrier>(g, true, true));
  row("cooperative, 64 KB of state + counter barrier",
      back_to_back<kStateAndCounterBarrier>(g, true, true));
  row("plain, 64 KB of state + counter barrier",
      back_to_back<kStateAndCounterBarrier>(g, false, true));
  row("one plain launch a graph, queued, empty", one_a_graph<kEmpty>(g, false));
  row("one cooperative launch a graph, queued, empty", one_a_graph<kEmpty>(g, true));
  row("same, 64 KB of state + grid sync", one_a_graph<kStateAndGridSync>(g, true));
  return 0;
}
